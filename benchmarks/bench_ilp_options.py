"""HiGHS's MIP options on a layout search's own ILPs: its defaults beside autopar's.

    python benchmarks/bench_ilp_options.py [--rows gpt3-175b,1t] [--out build/bench_ilp_options]

The search's intra-op ILPs are small (~40 decisions, ~540 binaries, ~10k continuous edge
variables) and their LP relaxation is weak under a binding memory row (a GPT-3 stage ILP:
root bound 39% under the optimum), so HiGHS's MIP spends its time proving: restarting
(presolving again after root fixings, three times on one such ILP) and running RINS / RENS
sub-MIPs (most of its LP iterations). `autopar.search.ilp._HIGHS_SWITCHES` turns those off.
This script records every ILP a row's default search solves (`autopar.plan` on the
`bench_search.py` row), then solves each one with `solve_intra_op` twice, once with HiGHS's
defaults and once with autopar's switches (alternating which goes first), and prints the
thread CPU seconds of both, their ratio, how many objectives differ (relative 1e-9; each
run is exact to the MIP gap 1e-7) and how many assignments differ (exactly tied optima:
the two runs may pick different ones). Writes one CSV row per ILP.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ilp_dp import recorded_problems  # noqa: E402
from bench_search import build_row  # noqa: E402

import autopar  # noqa: E402
from autopar.search import ilp  # noqa: E402
from autopar.views.bench import write_rows_csv  # noqa: E402


@contextmanager
def highs_defaults():
    """`solve_intra_op` with HiGHS's own MIP options (no autopar switches) inside."""
    kept = ilp._HIGHS_SWITCHES
    ilp._HIGHS_SWITCHES = {}
    try:
        yield
    finally:
        ilp._HIGHS_SWITCHES = kept


def timed_solve(problem) -> tuple[float, float | None, tuple[int, ...] | None]:
    t0 = time.thread_time()
    try:
        sol = ilp.solve_intra_op(problem)
        out = (sol.objective, sol.choices)
    except (ilp.MemoryInfeasible, ilp.SolverTimeout, ValueError):
        out = (None, None)
    return time.thread_time() - t0, *out


def run_row(row: str) -> list[dict]:
    model, batch, cluster = build_row(row)
    problems = []
    with recorded_problems(problems):
        autopar.plan(model, batch, cluster=cluster)
    rows = []
    for k, problem in enumerate(problems):
        runs = {}
        for which in ("defaults", "autopar") if k % 2 else ("autopar", "defaults"):
            if which == "defaults":
                with highs_defaults():
                    runs[which] = timed_solve(problem)
            else:
                runs[which] = timed_solve(problem)
        (t_def, obj_def, ch_def), (t_ap, obj_ap, ch_ap) = runs["defaults"], runs["autopar"]
        same = obj_def == obj_ap or (
            obj_def is not None
            and obj_ap is not None
            and abs(obj_ap - obj_def) <= 1e-9 * max(abs(obj_def), 1e-30)
        )
        rows.append({"row": row, "problem": k, "decisions": len(problem.node_cost),
                     "defaults_s": t_def, "autopar_s": t_ap, "defaults": obj_def,
                     "autopar": obj_ap, "same_objective": same,
                     "same_choices": ch_def == ch_ap})  # fmt: skip
        print(f"{row} #{k:3d}  defaults {t_def:6.2f} s  autopar {t_ap:6.2f} s  "
              f"{'same' if same else 'DIFFERENT'} objective"
              f"{'' if ch_def == ch_ap else ', tied assignment differs'}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="gpt3-175b")
    parser.add_argument("--out", default="build/bench_ilp_options")
    args = parser.parse_args()
    rows = [r for row in args.rows.split(",") for r in run_row(row)]
    print(f"\n{'row':12s} {'ILPs':>5s} {'defaults s':>11s} {'autopar s':>10s} {'ratio':>6s} "
          f"{'objectives differ':>18s} {'assignments differ':>19s}")  # fmt: skip
    for row in dict.fromkeys(r["row"] for r in rows):
        mine = [r for r in rows if r["row"] == row]
        d, a = sum(r["defaults_s"] for r in mine), sum(r["autopar_s"] for r in mine)
        print(f"{row:12s} {len(mine):5d} {d:11.1f} {a:10.1f} {a / max(d, 1e-9):6.2f} "
              f"{sum(not r['same_objective'] for r in mine):18d} "
              f"{sum(not r['same_choices'] for r in mine):19d}")  # fmt: skip
    out = Path(args.out)
    write_rows_csv(out / "bench_ilp_options.csv", rows)
    print(f"wrote {out / 'bench_ilp_options.csv'}")


if __name__ == "__main__":
    main()

"""The search's ILP solver (variable elimination first, `autopar.search.elimination`) timed
beside HiGHS alone on a search's own ILPs.

    python benchmarks/bench_ilp_dp.py [--rows llama3-8b,gpt3-175b,1t] [--out build/bench_ilp_dp]

The layout search's ILPs (`autopar.search.ilp`) are small (GPT-3 175B's: ~40 decisions,
~540 choices; Llama-3-8B's 74 and ~1450) and their interaction graph (pairs, and the gated
triples of the lever decision) has a min-fill elimination width of 4-5. `solve_intra_op`
(backend "auto") first runs a min-sum variable elimination: the least-cost assignment, a
Lagrangian walk over the memory row and, when neither proves the optimum, Lagrangian
variable fixing, which leaves HiGHS a MIP over the few choices that can still beat the best
answer found. This script plans each row on one process recording every ILP it solves,
then solves each again with `solve_intra_op(backend="highs")` (HiGHS on the whole problem)
and with the default, printing both times (thread CPU s), how the default settled it, the
relative objective difference (exact: 0 to rounding) and whether the assignments differ
(tied optima); the totals and their ratio; a CSV.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_search import build_row  # noqa: E402

import autopar  # noqa: E402
from autopar.search import elimination, ilp, workers  # noqa: E402
from autopar.search.ilp_problem import IntraOpProblem, _reduce  # noqa: E402
from autopar.views.bench import write_rows_csv  # noqa: E402


@contextmanager
def recorded_problems(into: list[IntraOpProblem]):
    """Every problem `ilp.solve_all` solves while inside, appended to `into` (the search on
    one process: a forked one's problems would stay there, `search.workers`)."""
    solve = ilp.solve_intra_op
    processes = os.environ.get(workers.PROCESSES_ENV)

    def recording(problem, **kw):
        into.append(problem)
        return solve(problem, **kw)

    ilp.solve_intra_op = recording
    os.environ[workers.PROCESSES_ENV] = "1"
    try:
        yield
    finally:
        ilp.solve_intra_op = solve
        if processes is None:
            os.environ.pop(workers.PROCESSES_ENV)
        else:
            os.environ[workers.PROCESSES_ENV] = processes


def how_settled(problem: IntraOpProblem) -> str:
    """How the default settled it: "dp" (elimination proved the optimum), "dp+mip N/M"
    (the MIP solved N of M choices left after fixing), "mip" (elimination declined)."""
    red = _reduce(problem)
    settled = elimination.settle(problem, red, ilp._REL_GAP)
    if settled is None or (not settled.optimal and not settled.keep):
        return "mip"
    if settled.optimal:
        return "dp"
    kept = sum(len(k) for k in settled.keep.values())
    return f"dp+mip {kept}/{sum(len(red.allowed[i]) for i in settled.keep)}"


def run_row(row: str) -> list[dict]:
    model, batch, cluster = build_row(row)
    problems: list[IntraOpProblem] = []
    with recorded_problems(problems):
        autopar.plan(model, batch, cluster=cluster, pipeline_stages="auto")
    rows = []
    for k, problem in enumerate(problems):
        times, answers = {}, {}
        for backend in ("highs", "auto"):
            t0 = time.thread_time()
            try:
                answers[backend] = ilp.solve_intra_op(problem, backend=backend)
            except (ilp.MemoryInfeasible, ilp.SolverTimeout, ValueError):
                answers[backend] = None
            times[backend] = time.thread_time() - t0
        highs, auto = answers["highs"], answers["auto"]
        diff = None if highs is None or auto is None else (
            (auto.objective - highs.objective) / abs(highs.objective))  # fmt: skip
        same = None if diff is None else highs.choices == auto.choices
        rows.append({"row": row, "problem": k, "decisions": len(problem.node_cost),
                     "highs_s": times["highs"], "auto_s": times["auto"],
                     "settled": how_settled(problem), "rel_diff": diff,
                     "same_choices": same})  # fmt: skip
        r = rows[-1]
        print(f"{row} #{k:3d}  highs {r['highs_s']:6.2f} s  auto {r['auto_s']:6.2f} s  "
              f"{r['settled']:>16}  diff {diff if diff is None else f'{diff:+.1e}'}"
              f"{'' if same in (None, True) else '  (a tied optimum)'}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="llama3-8b,gpt3-175b")
    parser.add_argument("--out", default="build/bench_ilp_dp")
    args = parser.parse_args()
    rows = [r for row in args.rows.split(",") for r in run_row(row)]
    for row in dict.fromkeys(r["row"] for r in rows):
        mine = [r for r in rows if r["row"] == row]
        highs, auto = sum(r["highs_s"] for r in mine), sum(r["auto_s"] for r in mine)
        by_dp = sum(r["settled"] == "dp" for r in mine)
        diffs = [abs(r["rel_diff"]) for r in mine if r["rel_diff"] is not None]
        print(
            f"{row}: {len(mine)} ILPs, {by_dp} proven by elimination alone; HiGHS "
            f"{highs:.1f} s, default {auto:.1f} s ({auto / max(highs, 1e-9):.2f}x); "
            f"largest |relative difference| {max(diffs, default=0):.1e}; "
            f"{sum(r['same_choices'] is False for r in mine)} tied optima picked apart"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_rows_csv(out / "bench_ilp_dp.csv", rows)
    print(f"wrote {out / 'bench_ilp_dp.csv'}")


if __name__ == "__main__":
    main()

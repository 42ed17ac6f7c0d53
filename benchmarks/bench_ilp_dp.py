"""A candidate exact solver for the intra-op ILP, timed beside HiGHS on a search's own ILPs.

    python benchmarks/bench_ilp_dp.py [--rows gpt3-175b] [--max-cells 2000000]
                                      [--out build/bench_ilp_dp]

The layout search's ILPs (`autopar.search.ilp`) are small (GPT-3 175B's: ~40 decisions,
~540 choices) and their interaction graph (pairs, and the gated triples of the lever
decision) has a min-fill elimination width of 4 (3 without the lever decision), yet HiGHS
spends 0.3-3 s on each MIP, most of the search's time. This script measures the route the
#11 notes propose, exactly as it would replace the MIP:

1. Lagrangian relaxation of the memory row: a min-sum variable elimination (numpy) of
   cost + lambda * memory over the factors (node rows, edge matrices, gated edges as
   factors over (u, v, w)) solves each lambda exactly; the cutting-plane walk over lambda
   gives the best feasible assignment found (an upper bound) and lambda*.
2. An exact (cost, memory) Pareto DP over the same elimination order: each message maps
   a separator assignment to the Pareto front of (memory, cost) of its eliminated part,
   pruned by the Lagrangian "outside" bound (a downward pass of the lambda* elimination:
   the least cost + lambda* * memory of everything outside a bucket, per separator
   assignment): a point whose cost + lambda* memory + outside - lambda* limit exceeds the
   upper bound cannot be in a better answer. The front at the root holds the optimum.

Each problem is first re-solved by `solve_intra_op` (HiGHS, as the search does), then by
the DP (pure Python fronts; problems whose largest elimination bucket exceeds
`--max-cells` separator-and-choice cells are skipped and counted). Printed: per-problem
seconds of both and the relative objective difference; the totals and their ratio; a CSV.
Nothing here is used by autopar's search yet: the tie rule (the DP and HiGHS pick
different assignments among exactly tied optima), `minimize_memory`, and a vectorised
front are what using it needs.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_search import build_row  # noqa: E402

import autopar  # noqa: E402
from autopar.search import ilp, workers  # noqa: E402
from autopar.search.ilp_problem import IntraOpProblem, evaluate  # noqa: E402
from autopar.views.bench import write_rows_csv  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"


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


# ---- factors -----------------------------------------------------------------------------
def _terms(p: IntraOpProblem):
    """(scope, [cost array, memory array]) of every term, scopes possibly repeating a
    decision (a self edge, a gate on an endpoint); inf cost forbids."""
    for i, (c, m) in enumerate(zip(p.node_cost, p.node_memory, strict=True)):
        c, m = np.asarray(c, float), np.asarray(m, float)
        bad = ~np.isfinite(c) | ~np.isfinite(m)
        yield (i,), np.where(bad, np.inf, c), np.where(bad, 0.0, m)
    for e in p.edges:
        c = np.asarray(e.cost, float)
        m = np.zeros_like(c) if e.memory is None else np.asarray(e.memory, float)
        yield (e.u, e.v), c, m
    for g in p.gated:
        c = np.asarray(g.cost, float)
        m = np.zeros_like(c) if g.memory is None else np.asarray(g.memory, float)
        k = len(p.node_cost[g.w])
        cc, mm = np.zeros((*c.shape, k)), np.zeros((*c.shape, k))
        cc[..., g.choice], mm[..., g.choice] = c, m
        yield (g.u, g.v, g.w), cc, mm


def factors(p: IntraOpProblem) -> dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]:
    """Sorted scope -> (cost, memory) arrays, terms of one scope summed."""
    out: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
    for scope, c, m in _terms(p):
        uniq = tuple(sorted(set(scope)))
        spec = "".join(LETTERS[uniq.index(v)] for v in scope) + "->" + LETTERS[: len(uniq)]
        c, m = np.einsum(spec, c), np.einsum(spec, m)
        if uniq in out:
            c, m = out[uniq][0] + c, out[uniq][1] + m
        out[uniq] = (c, m)
    return out


def elimination_order(n: int, scopes) -> list[int]:
    """Min-fill, ties by degree then index."""
    adj: dict[int, set[int]] = {i: set() for i in range(n)}
    for s in scopes:
        for a, b in itertools.combinations(s, 2):
            adj[a].add(b)
            adj[b].add(a)

    def fill(x: int) -> int:
        return sum(1 for a, b in itertools.combinations(adj[x], 2) if b not in adj[a])

    order = []
    while adj:
        x = min(adj, key=lambda x: (fill(x), len(adj[x]), x))
        nb = adj.pop(x)
        order.append(x)
        for a in nb:
            adj[a].discard(x)
            adj[a] |= nb - {a}
    return order


def _expand(arr: np.ndarray, scope, into) -> np.ndarray:
    return arr.reshape([arr.shape[scope.index(v)] if v in scope else 1 for v in into])


# ---- the scalar (Lagrangian) elimination ------------------------------------------------------
def eliminate(fs: dict, lam: float, order: list[int]):
    """Min-sum elimination of cost + lam * memory: (assignment, buckets), buckets[x] =
    (scope, separator, [(scope, array, child or None)], their sum over scope)."""
    pool = [(s, c + lam * m if lam else c, None) for s, (c, m) in fs.items()]
    buckets, trace = {}, []
    for x in order:
        mine = [f for f in pool if x in f[0]]
        pool = [f for f in pool if x not in f[0]]
        scope = tuple(sorted(set().union(*[s for s, _, _ in mine])))
        acc = sum(_expand(a, s, scope) for s, a, _ in mine)
        k = scope.index(x)
        rest = scope[:k] + scope[k + 1 :]
        trace.append((x, rest, np.argmin(acc, axis=k)))
        buckets[x] = (scope, rest, mine, acc)
        pool.append((rest, np.min(acc, axis=k), x))
    choice = [0] * len(order)
    for x, rest, arg in reversed(trace):
        choice[x] = int(arg[tuple(choice[v] for v in rest)])
    return tuple(choice), buckets


def lagrangian(p: IntraOpProblem, fs: dict, order: list[int]):
    """(lambda*, its bound, best feasible (cost, choices) found or None): the cutting-plane
    walk."""
    limit = p.memory_limit

    def at(lam):
        choice, _ = eliminate(fs, lam, order)
        return (*evaluate(p, choice), choice)

    c, m, choice = at(0.0)
    if m <= limit:
        return 0.0, c, (c, choice)
    lo, lam = (c, m), max(c, 1e-12) / m * 1e-3
    while True:
        c, m, choice = at(lam)
        if m <= limit:
            hi, best = (c, m), (c, choice)
            break
        lo, lam = (c, m), lam * 10
        if lam > 1e12:
            return 0.0, -math.inf, None
    best_value, best_lam = -math.inf, lam
    for _ in range(60):
        lam = (hi[0] - lo[0]) / (lo[1] - hi[1])
        c, m, choice = at(lam)
        value = c + lam * (m - limit)
        if value > best_value:
            best_value, best_lam = value, lam
        if m <= limit and c < best[0]:
            best = (c, choice)
        line = lo[0] + lam * (lo[1] - limit)
        if value >= line - 1e-12 * abs(line):
            break
        hi, lo = ((c, m), lo) if m <= limit else (hi, (c, m))
    return best_lam, best_value, best


def outside_bounds(buckets: dict, order: list[int], dom: list[int]) -> dict[int, np.ndarray]:
    """Per x, over its separator: the least of everything outside x's subtree."""
    parent = {child: x for x in order for _, _, child in buckets[x][2] if child is not None}
    out: dict[int, np.ndarray] = {}
    for x in reversed(order):
        rest = buckets[x][1]
        if x not in parent:
            out[x] = np.zeros([dom[v] for v in rest])
            continue
        scope, prest, mine, _ = buckets[parent[x]]
        acc = sum(_expand(a, s, scope) for s, a, child in mine if child != x)
        acc = np.broadcast_to(acc + _expand(out[parent[x]], prest, scope), [dom[v] for v in scope])
        axes = tuple(i for i, v in enumerate(scope) if v not in rest)
        red = np.min(acc, axis=axes) if axes else acc
        kept = [v for v in scope if v in rest]
        out[x] = np.transpose(red, [kept.index(v) for v in rest])
    return out


# ---- the Pareto DP ---------------------------------------------------------------------------
def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(memory, cost) points -> the front: memory ascending, cost strictly descending."""
    points.sort()
    out, best = [], math.inf
    for m, c in points:
        if c < best:
            out.append((m, c))
            best = c
    return out


def _plus(a, b):
    if len(a) == 1:
        m0, c0 = a[0]
        return [(m0 + m, c0 + c) for m, c in b]
    return pareto([(m1 + m2, c1 + c2) for m1, c1 in a for m2, c2 in b])


def solve_pareto(p: IntraOpProblem, max_cells: float) -> float | None:
    """The least cost of an assignment within the memory limit (None: skipped, or none
    fits); exact, by the module docstring's two steps. The Pareto DP runs first under a
    bound a little above the Lagrangian's (an answer at or below it is the optimum:
    nothing at or below the bound was pruned), raised 4x towards the best feasible
    answer known until one is."""
    dom, fs = [len(c) for c in p.node_cost], factors(p)
    order = elimination_order(len(dom), fs)
    lam, low, best = lagrangian(p, fs, order)
    if best is None:
        return None
    if lam == 0.0:  # the least-cost assignment fits: the optimum
        return best[0]
    _, buckets = eliminate(fs, lam, order)
    if max(math.prod(dom[v] for v in buckets[x][0]) for x in order) > max_cells:
        return None
    outside = outside_bounds(buckets, order, dom)
    tables = [(s, {k: [(float(m[k]), float(c[k]))] for k in np.ndindex(c.shape)
                   if math.isfinite(c[k])}) for s, (c, m) in fs.items()]  # fmt: skip
    known, step = best[0], (best[0] - low) / 16
    while True:
        bound = min(known, low + step)
        found = _pareto_at(p, tables, order, lam, buckets, outside, bound)
        if found is not None and found <= bound:  # the optimum was not pruned: it is this
            return found
        known = known if found is None else min(known, found)
        if bound >= known:  # nothing at or below the best known was pruned
            return known
        step *= 4


def _pareto_at(p, tables, order, lam, buckets, outside, bound) -> float | None:
    """The least cost within the memory limit among assignments whose Lagrangian bound
    is at most `bound` (None: none)."""
    limit, pool = p.memory_limit, list(tables)
    for x in order:
        mine = [f for f in pool if x in f[0]]
        pool = [f for f in pool if x not in f[0]]
        scope, rest, _, acc = buckets[x]
        # the least each factor still to be added can add (memories may be negative)
        lows = [min((c + lam * m for f in t.values() for m, c in f), default=0.0) for _, t in mine]
        later = [sum(lows[i + 1 :]) for i in range(len(mine))]
        # (separator, choice) cells whose Lagrangian bound (the bucket's scalar sum at
        # lambda*, which no front point undercuts, + outside) can still beat the bound
        top = bound * (1 + 1e-9) + 1e-12 + lam * limit
        whole = acc + _expand(outside[x], rest, scope)
        cells: dict[tuple, list[int]] = {}
        for at in np.argwhere(whole <= top):
            named = dict(zip(scope, at.tolist(), strict=True))
            cells.setdefault(tuple(named[v] for v in rest), []).append(named[x])
        msg = {}
        for key, ks in cells.items():
            slack = top - float(outside[x][key])
            at, union = dict(zip(rest, key, strict=True)), []
            for k in ks:
                at[x], front = k, [(0.0, 0.0)]
                for (s, table), low in zip(mine, later, strict=True):
                    f = table.get(tuple(at[v] for v in s))
                    front = [] if f is None else _plus(front, f)
                    front = [(m, c) for m, c in front if c + lam * m + low <= slack]
                    if not front:
                        break
                union.extend(front)
            if union:
                msg[key] = pareto(union)
        pool.append((rest, msg))
    root = [(0.0, 0.0)]
    for _, table in pool:
        if () not in table:
            return None
        root = _plus(root, table[()])
    fitting = [c for m, c in root if m <= limit * (1 + 1e-12)]
    return min(fitting) if fitting else None


# ---- the benchmark ---------------------------------------------------------------------------
def run_row(row: str, max_cells: float) -> list[dict]:
    model, batch, cluster = build_row(row)
    problems: list[IntraOpProblem] = []
    with recorded_problems(problems):
        autopar.plan(model, batch, cluster=cluster, pipeline_stages="auto")
    rows = []
    for k, problem in enumerate(problems):
        t0 = time.thread_time()
        try:
            highs = ilp.solve_intra_op(problem).objective
        except (ilp.MemoryInfeasible, ilp.SolverTimeout, ValueError):
            highs = None
        t1 = time.thread_time()
        dp = solve_pareto(problem, max_cells)
        t2 = time.thread_time()
        diff = None if highs is None or dp is None else (dp - highs) / abs(highs)
        rows.append({"row": row, "problem": k, "decisions": len(problem.node_cost),
                     "highs_s": t1 - t0, "dp_s": t2 - t1, "highs": highs, "dp": dp,
                     "rel_diff": diff})  # fmt: skip
        print(f"{row} #{k:3d}  highs {t1 - t0:6.2f} s  dp {t2 - t1:6.2f} s  "
              f"{'skipped' if dp is None else f'diff {diff:+.1e}'}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="gpt3-175b")
    parser.add_argument("--max-cells", type=float, default=2e6)
    parser.add_argument("--out", default="build/bench_ilp_dp")
    args = parser.parse_args()
    rows = [r for row in args.rows.split(",") for r in run_row(row, args.max_cells)]
    for row in dict.fromkeys(r["row"] for r in rows):
        mine = [r for r in rows if r["row"] == row]
        solved = [r for r in mine if r["dp"] is not None]
        highs = sum(r["highs_s"] for r in solved)
        dp = sum(r["dp_s"] for r in solved)
        worst = max((abs(r["rel_diff"]) for r in solved if r["rel_diff"] is not None), default=0)
        print(f"{row}: {len(solved)}/{len(mine)} solved by the DP; HiGHS {highs:.1f} s, "
              f"DP {dp:.1f} s on those ({dp / max(highs, 1e-9):.2f}x); "
              f"largest |relative difference| {worst:.1e}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_rows_csv(out / "bench_ilp_dp.csv", rows)
    print(f"wrote {out / 'bench_ilp_dp.csv'}")


if __name__ == "__main__":
    main()

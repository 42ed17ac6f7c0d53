"""Tests for the intra-op ILP (autopar.search.ilp) on tiny hand-made and random problems."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from autopar.search import (
    Edge,
    GatedEdge,
    IntraOpProblem,
    MemoryInfeasible,
    evaluate,
    solve_intra_op,
)

INF = math.inf
BACKENDS = ["auto", "highs", "cpsat"]


def _problem(cost, memory, edges, limit=INF, time_limit_s=10.0) -> IntraOpProblem:
    return IntraOpProblem(
        node_cost=tuple(tuple(float(x) for x in c) for c in cost),
        node_memory=tuple(tuple(float(x) for x in m) for m in memory),
        edges=tuple(Edge(u, v, tuple(tuple(float(x) for x in r) for r in c)) for u, v, c in edges),
        memory_limit=limit,
        time_limit_s=time_limit_s,
    )


def _brute_force(p: IntraOpProblem) -> tuple[float, tuple[int, ...] | None]:
    best, arg = INF, None
    for choices in itertools.product(*(range(len(c)) for c in p.node_cost)):
        obj, mem = evaluate(p, choices)
        if mem <= p.memory_limit and obj < best:
            best, arg = obj, choices
    return best, arg


def _chain3(limit=INF) -> IntraOpProblem:
    # Greedy per node picks choice 0 everywhere (node cost 0 vs 1), but switching between
    # 0 and 1 costs 10 and 0->0 costs 5 on both edges: all-1 (cost 3) beats all-0 (cost 10).
    sw = ((5, 10), (10, 0))
    return _problem(
        cost=[(0, 1), (0, 1), (0, 1)],
        memory=[(1, 3), (1, 3), (1, 3)],
        edges=[(0, 1, sw), (1, 2, sw)],
        limit=limit,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_non_greedy_optimum(backend: str) -> None:
    sol = solve_intra_op(_chain3(), backend=backend)
    assert sol.choices == (1, 1, 1)
    assert sol.objective == pytest.approx(3.0)
    assert sol.memory == pytest.approx(9.0)
    assert sol.status == "optimal" and sol.gap == 0.0
    assert sol.solve_time_s >= 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_limit_flips_choice(backend: str) -> None:
    sol = solve_intra_op(_chain3(limit=5.0), backend=backend)
    assert sol.choices == (0, 0, 0)
    assert sol.objective == pytest.approx(10.0)
    assert sol.memory <= 5.0
    # 7 bytes allows exactly one choice 1: the best such plan is (1, 0, 0) or (0, 0, 1).
    sol = solve_intra_op(_chain3(limit=7.0), backend=backend)
    assert sol.memory <= 7.0
    assert sol.objective == pytest.approx(_brute_force(_chain3(limit=7.0))[0])


def test_memory_infeasible_reports_min_memory() -> None:
    with pytest.raises(MemoryInfeasible) as info:
        solve_intra_op(_chain3(limit=2.5))
    assert info.value.min_memory == pytest.approx(3.0)
    assert info.value.memory_limit == 2.5
    assert isinstance(info.value, ValueError) and "2.5" in str(info.value)


def test_memory_infeasible_through_forbidden_pairs() -> None:
    # Cheap bound (1 + 1 = 2) fits the limit 3, but the pair (0, 0) is forbidden, so the
    # real minimum is 1 + 4 = 5: found by the diagnosis solve.
    p = _problem(
        cost=[(0, 0), (0, 0)],
        memory=[(1, 4), (1, 4)],
        edges=[(0, 1, ((INF, 0), (0, 0)))],
        limit=3.0,
    )
    with pytest.raises(MemoryInfeasible) as info:
        solve_intra_op(p)
    assert info.value.min_memory == pytest.approx(5.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forbidden_pairs_and_choices(backend: str) -> None:
    # Cheapest pair (0, 0) is forbidden on the edge; choice 2 of decision 1 is forbidden.
    p = _problem(
        cost=[(0, 1, 2), (0, 1, -5)],
        memory=[(0, 0, 0), (0, 0, 0)],
        edges=[(0, 1, ((INF, 1, 0), (2, 3, 0), (0, 0, 0)))],
    )
    p = IntraOpProblem(
        (p.node_cost[0], (0.0, 1.0, INF)), p.node_memory, p.edges, p.memory_limit, 10.0
    )
    sol = solve_intra_op(p, backend=backend)
    assert sol.choices[1] != 2 and sol.choices[:2] != (0, 0)
    assert sol.objective == pytest.approx(_brute_force(p)[0])
    assert sol.objective == pytest.approx(2.0)  # (0, 1): 0 + 1 + 1 or (2, 0): 2 + 0 + 0


def test_all_forbidden_raises_value_error() -> None:
    p = _problem(cost=[(0, 0), (0, 0)], memory=[(0, 0), (0, 0)], edges=[(0, 1, ((INF,) * 2,) * 2)])
    with pytest.raises(ValueError) as info:
        solve_intra_op(p)
    assert not isinstance(info.value, MemoryInfeasible)


@pytest.mark.parametrize("backend", BACKENDS)
def test_self_edge_uses_diagonal(backend: str) -> None:
    # Node cost prefers choice 0, the self edge's diagonal makes it expensive; the
    # off-diagonal entries are unreachable and must not matter.
    p = _problem(
        cost=[(0, 1), (0, 0)],
        memory=[(0, 0), (0, 0)],
        edges=[(0, 0, ((5, -100), (-100, 0))), (0, 1, ((0, 0), (0, 0)))],
    )
    sol = solve_intra_op(p, backend=backend)
    assert sol.choices[0] == 1
    assert sol.objective == pytest.approx(1.0)


def test_parallel_and_reversed_edges_merge() -> None:
    # (0,1) and (1,0) edges are summed; each alone is separable, the sum is not.
    p = _problem(
        cost=[(0, 0), (0, 0)],
        memory=[(0, 0), (0, 0)],
        edges=[(0, 1, ((0, 1), (2, 3))), (1, 0, ((4, 0), (0, 4))), (0, 1, ((1, 1), (1, 1)))],
    )
    sol = solve_intra_op(p)
    assert sol.objective == pytest.approx(_brute_force(p)[0])
    assert sol.objective == pytest.approx(2.0)  # merged matrix [[5, 2], [3, 8]]


def test_single_choice_and_evaluate() -> None:
    p = _problem(cost=[(2,), (1, 3)], memory=[(5,), (1, 2)], edges=[(0, 1, ((0, -3),))])
    sol = solve_intra_op(p)
    assert sol.choices == (0, 1) and sol.objective == pytest.approx(2.0)
    assert evaluate(p, (0, 0)) == (3.0, 6.0)
    assert evaluate(p, sol.choices) == (sol.objective, sol.memory)
    with pytest.raises(ValueError):
        evaluate(p, (0,))


def _random_problem(seed: int, n: int = 8, k: int = 3, m: int = 12) -> IntraOpProblem:
    rng = random.Random(seed)
    scale = 10.0 ** rng.uniform(-6, 2)  # exercise the objective scaling
    cost = [[rng.uniform(0, 1) * scale for _ in range(k)] for _ in range(n)]
    memory = [[rng.uniform(1e9, 4e9) for _ in range(k)] for _ in range(n)]
    edges = []
    for _ in range(m):
        u, v = rng.randrange(n), rng.randrange(n)
        mat = [[rng.uniform(0, 2) * scale for _ in range(k)] for _ in range(k)]
        if rng.random() < 0.2:
            mat[rng.randrange(k)][rng.randrange(k)] = INF
        edges.append((u, v, mat))
    mins = sum(min(r) for r in memory)
    limit = mins + rng.uniform(0.2, 0.8) * (sum(max(r) for r in memory) - mins)
    return _problem(cost, memory, edges, limit=limit)


@pytest.mark.parametrize("seed", range(6))
def test_random_matches_brute_force(seed: int) -> None:
    p = _random_problem(seed)
    best, _ = _brute_force(p)
    if not math.isfinite(best):
        with pytest.raises(ValueError):
            solve_intra_op(p)
        return
    for backend in BACKENDS:
        sol = solve_intra_op(p, backend=backend)
        assert sol.memory <= p.memory_limit * (1 + 1e-9)
        assert sol.objective == pytest.approx(best, rel=1e-6), backend
        assert sol.status == "optimal" and sol.gap <= 1e-6


def _chain_skip_problem(n: int = 300, k: int = 6, seed: int = 0) -> IntraOpProblem:
    rng = random.Random(seed)
    cost = [[rng.uniform(1e-5, 1e-2) for _ in range(k)] for _ in range(n)]
    memory = [[rng.choice((1, 2, 4, 8)) * 2**28 / (1 + j) for j in range(k)] for _ in range(n)]

    def mat() -> list[list[float]]:
        return [[0.0 if a == b else rng.uniform(1e-4, 2e-2) for b in range(k)] for a in range(k)]

    edges = [(i, i + 1, mat()) for i in range(n - 1)]
    edges += [(i, i + 3, mat()) for i in range(0, n - 3, 4)]
    mins = sum(min(r) for r in memory)
    limit = mins + 0.3 * (sum(max(r) for r in memory) - mins)
    return _problem(cost, memory, edges, limit=limit, time_limit_s=10.0)


def test_large_chain_with_skips_within_time_limit() -> None:
    p = _chain_skip_problem()
    sol = solve_intra_op(p)
    assert sol.solve_time_s <= p.time_limit_s + 5.0
    assert sol.status in ("optimal", "feasible")
    assert 0.0 <= sol.gap < 0.05
    assert sol.memory <= p.memory_limit * (1 + 1e-9)
    assert evaluate(p, sol.choices) == (sol.objective, sol.memory)
    print(f"300x6: {sol.status} gap={sol.gap:.2e} t={sol.solve_time_s:.2f}s")


def test_tiny_differences_under_large_constant() -> None:
    # 100 s of unavoidable cost; choices differ by microseconds and must still be optimal.
    p = _random_problem(11)
    p = IntraOpProblem(
        tuple(tuple(100.0 + x * 1e-6 / max(r) for x in r) for r in p.node_cost),
        p.node_memory,
        tuple(Edge(e.u, e.v, tuple(tuple(x * 1e-6 for x in r) for r in e.cost)) for e in p.edges),
        p.memory_limit,
        10.0,
    )
    best, _ = _brute_force(p)
    sol = solve_intra_op(p)
    assert sol.objective - best <= 1e-12 * best


def test_reductions_shrink_the_model() -> None:
    from autopar.search.ilp import _build, _reduce

    zero, sep, dense = ((0, 0), (0, 0)), ((1, 3), (2, 4)), ((0, 5), (5, 0))
    p = _problem(
        cost=[(0, 1), (0, 1), (7,), (0, 1)],
        memory=[(0, 0)] * 2 + [(0,), (0, 0)],
        edges=[(0, 1, zero), (1, 3, sep), (2, 3, ((1, 2),)), (0, 3, dense), (3, 0, dense)],
    )
    mdl = _build(_reduce(p), p)
    # 3 free decisions x 2 choices; only the merged dense (0, 3) pair needs 4 edge variables.
    assert mdl.model.get_num_variables() == 6 + 4
    assert solve_intra_op(p).objective == pytest.approx(_brute_force(p)[0])


def test_falls_back_to_cpsat_when_highs_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from autopar.search import ilp

    real_solve, used = ilp.mathopt.solve, []

    def fake_solve(model, solver, **kwargs):
        used.append(solver)
        if solver == ilp.mathopt.SolverType.HIGHS:
            raise RuntimeError("HiGHS not available")
        return real_solve(model, solver, **kwargs)

    monkeypatch.setattr(ilp.mathopt, "solve", fake_solve)
    monkeypatch.setattr(ilp.elimination, "settle", lambda *args: None)  # to the MIP
    sol = solve_intra_op(_chain3())
    assert used == [ilp.mathopt.SolverType.HIGHS, ilp.mathopt.SolverType.CP_SAT]
    assert sol.choices == (1, 1, 1) and sol.status == "optimal"
    with pytest.raises(ValueError):
        solve_intra_op(_chain3(), backend="gurobi")


def test_memory_infeasible_pickles() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(MemoryInfeasible(3.0, 2.0)))
    assert (err.min_memory, err.memory_limit) == (3.0, 2.0) and "2" in str(err)


def _lever_problem(seed: int, n: int = 6, k: int = 3) -> IntraOpProblem:
    """Random problem with edge memories of either sign (a recompute decision's savings)
    and gated edges (terms that count only when a third decision picks one choice)."""
    rng = random.Random(seed)
    cost = [[rng.uniform(0, 1) for _ in range(k)] for _ in range(n)]
    memory = [[rng.uniform(2, 4) for _ in range(k)] for _ in range(n)]
    if rng.random() < 0.5:  # a pinned gate: one allowed choice
        cost[0] = [INF if j != 1 else cost[0][j] for j in range(k)]
    edges, gated = [], []
    for _ in range(6):
        u, v = rng.randrange(n), rng.randrange(n)
        c = tuple(tuple(rng.uniform(0, 1) for _ in range(k)) for _ in range(k))
        m = tuple(tuple(rng.uniform(-1.5, 1) for _ in range(k)) for _ in range(k))
        edges.append(Edge(u, v, c, m))
    for _ in range(6):
        u, v, w = rng.randrange(n), rng.randrange(n), rng.randrange(n)
        c = tuple(tuple(rng.choice((0.0, rng.uniform(0, 1))) for _ in range(k)) for _ in range(k))
        m = tuple(tuple(rng.choice((0.0, rng.uniform(0, 2))) for _ in range(k)) for _ in range(k))
        gated.append(GatedEdge(u, v, w, rng.randrange(k), c, m))
    base = IntraOpProblem(
        tuple(map(tuple, cost)), tuple(map(tuple, memory)), tuple(edges), INF, 10.0, tuple(gated)
    )
    mems = sorted(evaluate(base, ch)[1] for ch in itertools.product(range(k), repeat=n))
    limit = mems[len(mems) // 3]
    return IntraOpProblem(base.node_cost, base.node_memory, base.edges, limit, 10.0, base.gated)


@pytest.mark.parametrize("seed", range(12))
def test_edge_memory_and_gated_edges_match_brute_force(seed: int) -> None:
    p = _lever_problem(seed)
    best, _ = _brute_force(p)
    if not math.isfinite(best):
        with pytest.raises(ValueError):
            solve_intra_op(p)
        return
    for backend in BACKENDS:
        sol = solve_intra_op(p, backend=backend)
        assert sol.memory <= p.memory_limit * (1 + 1e-9)
        assert sol.objective == pytest.approx(best, rel=1e-6), backend
        assert evaluate(p, sol.choices) == (sol.objective, sol.memory)


def test_gated_edge_counts_only_under_its_gate() -> None:
    # decision 2 is the gate: its choice 1 is free but adds 7 B on the pair (1, 1)
    g = GatedEdge(0, 1, 2, 1, ((0, 0), (0, 0)), ((0, 0), (0, 7)))
    p = IntraOpProblem(((9, 0), (9, 0), (1, 0)), ((0, 0),) * 3, (), INF, 10.0, (g,))
    assert evaluate(p, (1, 1, 0)) == (1.0, 0.0)
    assert evaluate(p, (1, 1, 1)) == (0.0, 7.0)
    assert evaluate(p, (0, 1, 1)) == (9.0, 0.0)
    assert solve_intra_op(p).choices == (1, 1, 1)
    limited = IntraOpProblem(p.node_cost, p.node_memory, (), 6.0, 10.0, (g,))
    sol = solve_intra_op(limited)
    assert sol.choices == (1, 1, 0) and sol.memory == 0.0 and sol.objective == 1.0


def test_gated_edges_on_a_dense_pair_are_one_block() -> None:
    """HiGHS prices a gated edge between two free decisions that keep their `e` variables
    with one `y` per matrix (not a `z` per entry), exactly: same optimum as brute force and
    as CP-SAT's `z` model, under a memory limit that the gated memory makes bind."""
    from autopar.search.ilp import _build, _reduce

    rng = random.Random(7)
    k = 4
    dense = tuple(tuple(rng.uniform(0, 1) for _ in range(k)) for _ in range(k))
    gate_cost = tuple(tuple(rng.uniform(0, 2) for _ in range(k)) for _ in range(k))
    gate_mem = tuple(
        tuple(rng.choice((0.0, rng.uniform(1, 3))) for _ in range(k)) for _ in range(k)
    )
    base = IntraOpProblem(
        node_cost=(tuple(rng.uniform(0, 1) for _ in range(k)),) * 2 + ((0.5, 0.0, 0.2),),
        node_memory=((1.0,) * k,) * 2 + ((0.0, 2.0, 1.0),),
        edges=(Edge(0, 1, dense),),
        memory_limit=INF,
        gated=(GatedEdge(1, 0, 2, 1, gate_cost, gate_mem),),  # reversed: stored transposed
    )
    mems = sorted(evaluate(base, ch)[1] for ch in itertools.product(range(k), range(k), range(3)))
    p = IntraOpProblem(
        base.node_cost, base.node_memory, base.edges, mems[len(mems) // 2], 10.0, base.gated
    )
    blocks, plain = _build(_reduce(p), p), _build(_reduce(p, blocks=False), p)
    assert len(blocks.y) == 2 and not blocks.z and len(plain.z) == k * k
    best, _ = _brute_force(p)
    for backend in BACKENDS:
        sol = solve_intra_op(p, backend=backend)
        assert sol.objective == pytest.approx(best, rel=1e-9) and sol.memory <= p.memory_limit


def test_a_relaxation_that_mixes_choices_to_fit_memory_does_not_settle_the_ilp() -> None:
    """The LP relaxation settles the ILP only with an assignment read off it that fits
    and costs its optimum: here it runs the decision half on its cheap, large choice and
    half on its dear, small one to meet the limit exactly (cost 0.5 for 1 byte); neither
    reading (largest value: over memory; least memory: cost 1, above 0.5) settles it, so
    the MIP decides (the small choice: cost 1, memory 0)."""
    from autopar.search import ilp

    p = _problem([[0, 1]], [[2, 0]], [], limit=1.0)
    red = ilp._reduce(p)
    mdl = ilp._build(red, p)
    assert ilp._relaxation_if_settled(mdl, red, p, 10.0) is None and mdl.rounded is None
    sol = solve_intra_op(p)
    assert (sol.objective, sol.memory) == (1.0, 0.0) and sol.status == "optimal"


def _settle(p: IntraOpProblem):
    from autopar.search import elimination
    from autopar.search.ilp import _REL_GAP, _reduce

    return elimination.settle(p, _reduce(p), _REL_GAP)


@pytest.mark.parametrize("seed", range(12))
def test_elimination_settles_or_narrows_without_losing_the_optimum(seed: int) -> None:
    """Variable elimination proves the optimum when the least-cost (or, among ties,
    least-memory) assignment fits or the Lagrangian bound meets its best fitting answer;
    otherwise every choice it forbids lies outside any assignment that beats that answer:
    the brute-force optimum keeps all its choices."""
    p = _lever_problem(seed)
    best, arg = _brute_force(p)
    settled = _settle(p)
    if not math.isfinite(best):
        assert settled is None or not settled.optimal
        return
    assert settled is not None
    if settled.optimal:
        assert evaluate(p, settled.choices)[0] == pytest.approx(best, rel=1e-9)
        return
    if settled.choices is not None:  # a fitting answer, no better than the optimum
        cost, memory = evaluate(p, settled.choices)
        assert memory <= p.memory_limit and cost >= best * (1 - 1e-9)
    for i, kept in (settled.keep or {}).items():
        optima = [
            ch
            for ch in itertools.product(*(range(len(c)) for c in p.node_cost))
            if (v := evaluate(p, ch))[1] <= p.memory_limit and v[0] <= best * (1 + 1e-12)
        ]
        assert any(ch[i] in kept for ch in optima), (i, kept, arg)


def test_elimination_answers_a_chain_without_the_mip(monkeypatch: pytest.MonkeyPatch) -> None:
    """The least-cost assignment of `_chain3` fits (no limit; then a limit it meets
    exactly): `solve_intra_op` returns it without building a MIP."""
    from autopar.search import ilp

    def no_mip(*args, **kw):
        raise AssertionError("the MIP was built")

    monkeypatch.setattr(ilp, "_solve_model", no_mip)
    for limit in (INF, 9.0):
        sol = solve_intra_op(_chain3(limit=limit))
        assert (sol.choices, sol.objective, sol.status) == ((1, 1, 1), 3.0, "optimal")


def test_elimination_breaks_a_tie_towards_the_assignment_that_fits() -> None:
    """Two choices cost the same; the first needs more memory than the limit: the tie
    goes to the second, proven without the MIP."""
    p = _problem([[1, 1], [0, 0]], [[5, 1], [1, 1]], [(0, 1, ((0, 0), (0, 0)))], limit=3.0)
    settled = _settle(p)
    assert settled is not None and settled.optimal and settled.choices[0] == 1


@pytest.mark.parametrize("seed", range(6))
def test_elimination_by_choice_equals_the_whole_bucket(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large separators are minimised one choice at a time (`_least_by_choice`, the argmin
    read when backtracking): the same assignment, ties to the first choice, as summing the
    whole bucket; and a branch's walk stopped by an earlier branch's answer settles the
    same."""
    from autopar.search import elimination

    p = _lever_problem(seed)
    red = _reduce_of(p)
    fs = elimination._factors(red)
    order = elimination.order_of(fs)
    for lam in (0.0, 0.3):
        factors = {s: np.round(v, 1) for s, v in fs.at(lam).items()}  # ties on purpose
        monkeypatch.setattr(elimination, "_BY_CHOICE", 10**9)
        whole, _ = elimination._eliminate(factors, fs.sizes, order, keep_buckets=False)
        monkeypatch.setattr(elimination, "_BY_CHOICE", 1)
        by_choice, _ = elimination._eliminate(factors, fs.sizes, order, keep_buckets=False)
        assert [step[:2] for step in whole] == [step[:2] for step in by_choice]
        assert elimination._back(whole) == elimination._back(by_choice)
    settled = _settle(p)
    bounded = elimination._bounded
    monkeypatch.setattr(  # every branch walks to its end
        elimination, "_bounded", lambda *args, beaten=math.inf: bounded(*args[:5])
    )
    unstopped = _settle(p)
    assert (settled is None) == (unstopped is None)
    if settled is not None:
        assert (settled.choices, settled.optimal, settled.keep) == (
            unstopped.choices,
            unstopped.optimal,
            unstopped.keep,
        )


def test_a_branch_whose_floor_passes_an_earlier_answer_is_not_eliminated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hub's last choice made dear (its floor, the least of every factor, above any
    answer of the other branches): that branch is bounded by its floor without any
    elimination, and `settle` answers as when every branch is eliminated."""
    from dataclasses import replace

    from autopar.search import elimination

    for seed in range(12):
        p = _lever_problem(seed)
        hub = elimination._hub(_reduce_of(p))
        if hub is not None:
            break
    dear = [list(c) for c in p.node_cost]
    dear[hub][-1] += 100.0  # and no memory limit: the first branch's least cost is an answer
    p = replace(p, node_cost=tuple(map(tuple, dear)), memory_limit=INF)
    last = {hub: len(dear[hub]) - 1}
    branch, runs = [None], []  # the branch being bounded; the branch of each elimination
    bounded, eliminate = elimination._bounded, elimination._eliminate

    def bounded_in(*args, every=False, **kw):
        branch[0] = args[3]
        return bounded(*args[:5]) if every else bounded(*args, **kw)

    monkeypatch.setattr(elimination, "_bounded", bounded_in)
    monkeypatch.setattr(
        elimination, "_eliminate", lambda *a, **kw: runs.append(branch[0]) or eliminate(*a, **kw)
    )
    settled = _settle(p)
    assert last not in runs and runs
    runs.clear()
    monkeypatch.setattr(  # every branch eliminated, its walk not stopped
        elimination, "_bounded", lambda *args: bounded_in(*args, every=True)
    )
    every = _settle(p)
    assert last in runs
    assert (settled.choices, settled.optimal, settled.keep) == (
        every.choices,
        every.optimal,
        every.keep,
    )


@pytest.mark.parametrize("saves", [True, False], ids=["saves memory", "saves nothing"])
@pytest.mark.parametrize("seed", range(6))
def test_a_branch_that_only_adds_cost_is_not_eliminated(
    seed: int, saves: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lever (decision 3) whose choices 1 and 2 only add work (their node cost and the
    terms they gate are >= 0). Where they save memory, choice 0's least cost fits, so the
    other branches, every cost at least choice 0's, are bounded by that answer; where they
    save nothing (every memory at least choice 0's too) and the limit binds, choice 0's
    branch holds an assignment as good as any of theirs. Either way only choice 0 is
    eliminated, and the answer is the brute-force optimum, as when every branch is."""
    from autopar.search import elimination

    rng = random.Random(seed)
    k = 3

    def matrix(lo: float, hi: float):
        return tuple(tuple(rng.uniform(lo, hi) for _ in range(k)) for _ in range(k))

    cost = [[rng.uniform(0, 1) for _ in range(k)] for _ in range(3)] + [[0.0, 0.5, 0.7]]
    lever = [0.0, -1.5, -3.0] if saves else [0.0, 0.2, 0.4]
    memory = [[rng.uniform(2, 4) for _ in range(k)] for _ in range(3)] + [lever]
    edges = (Edge(0, 1, matrix(0, 1), matrix(0, 1)), Edge(1, 2, matrix(0, 1), matrix(0, 1)))
    gated = tuple(  # the lever's choice c: more work, and more memory unless it saves
        GatedEdge(u, v, 3, c, matrix(0, 1), matrix(0, 0.5))
        for u, v in ((0, 1), (1, 2), (0, 2))
        for c in (1, 2)
    )
    p = IntraOpProblem(tuple(map(tuple, cost)), tuple(map(tuple, memory)), edges, 1e9, 10.0, gated)
    if not saves:  # a limit that binds: the median assignment's memory
        mems = sorted(evaluate(p, ch)[1] for ch in itertools.product(range(k), repeat=4))
        p = replace(p, memory_limit=mems[len(mems) // 2])
    best = _brute_force(p)[0]
    assert elimination._hub(_reduce_of(p)) == 3
    pinned, bounded = [], elimination._bounded
    monkeypatch.setattr(
        elimination, "_bounded", lambda *a, **kw: pinned.append(a[3]) or bounded(*a, **kw)
    )
    settled = _settle(p)
    assert pinned == [{3: 0}]
    assert solve_intra_op(p).objective == pytest.approx(best, rel=1e-12)
    pinned.clear()
    monkeypatch.setattr(elimination, "_covering", lambda *a: None)
    every = _settle(p)
    assert pinned == [{3: 0}, {3: 1}, {3: 2}]
    if saves:
        assert settled.optimal and (settled.choices, settled.optimal) == (
            every.choices,
            every.optimal,
        )
    assert solve_intra_op(p).objective == pytest.approx(best, rel=1e-12)


def _reduce_of(p: IntraOpProblem):
    from autopar.search.ilp import _reduce

    return _reduce(p)


def test_elimination_takes_the_order_of_fewer_entries() -> None:
    """A graph where min-fill's order holds 58,194 bucket entries and the least-separator
    order 15,174 (decisions of 5 to 29 choices, as a Falcon template's): `order_of` takes
    the smaller, and elimination in it settles the MIP's optimum."""
    from autopar.search import elimination, elimination_order

    rng = random.Random(0)
    sizes = (9, 15, 29, 15, 5, 9)
    pairs = ((0, 1), (0, 2), (0, 4), (1, 3), (1, 4), (1, 5), (2, 3), (2, 5))
    cost = [[rng.uniform(0, 1) for _ in range(k)] for k in sizes]
    edges = [
        (u, v, [[rng.uniform(0, 1) for _ in range(sizes[v])] for _ in range(sizes[u])])
        for u, v in pairs
    ]
    p = _problem(cost, [[0.0] * k for k in sizes], edges)
    fs = elimination._factors(_reduce_of(p))
    order = elimination_order.order_of(fs)
    adj = {i: {j for e in pairs if i in e for j in e if j != i} for i in range(len(sizes))}
    entries = 0
    for i in order:  # the buckets of this order
        entries += math.prod(sizes[a] for a in adj[i]) * sizes[i]
        for a in adj[i]:
            adj[a] |= adj[i] - {a}
            adj[a].discard(i)
        del adj[i]
    assert entries == 15_174
    settled = _settle(p)
    assert settled.optimal
    highs = solve_intra_op(p, backend="highs")
    assert evaluate(p, settled.choices)[0] == pytest.approx(highs.objective, rel=1e-9)


def test_elimination_branches_on_a_value_every_decision_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chain of decisions that all read decision 7 (a rotary table every layer reads):
    eliminated whole, its buckets pass the cap; with 7 fixed at each choice they do not,
    so each choice is a branch and `settle` proves the brute-force optimum (without the
    branches it declines, for the MIP)."""
    from autopar.search import elimination, elimination_order

    rng = random.Random(1)
    k, n = 3, 7

    def matrix():
        return [[rng.uniform(0, 1) for _ in range(k)] for _ in range(k)]

    chain = [(i, i + 1, matrix()) for i in range(n - 1)] + [(i, n, matrix()) for i in range(n)]
    p = _problem(
        [[rng.uniform(0, 1) for _ in range(k)] for _ in range(n + 1)], [[0.0] * k] * (n + 1), chain
    )
    fs = elimination._factors(_reduce_of(p))

    assert elimination._star(fs) == n
    monkeypatch.setattr(elimination_order, "MAX_BUCKETS", 3 * k**3)  # ~k**3 per bucket whole
    assert elimination_order.order_of(fs) is None
    assert elimination_order.order_of(fs.fixing(n, 0)) is not None
    settled = _settle(p)
    assert settled is not None and settled.optimal
    assert evaluate(p, settled.choices)[0] == pytest.approx(_brute_force(p)[0], rel=1e-12)
    monkeypatch.setattr(elimination, "_star", lambda fs: None)
    assert _settle(p) is None


@pytest.mark.parametrize("cap", ["MAX_BUCKET", "MAX_BUCKETS"])
def test_elimination_gives_way_to_the_mip_past_its_bucket_caps(
    cap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket over `MAX_BUCKET` entries, or all over `MAX_BUCKETS`: `settle` declines,
    the MIP solves."""
    from autopar.search import elimination_order

    monkeypatch.setattr(elimination_order, cap, 3)
    p = _random_problem(0)
    assert _settle(p) is None
    best, _ = _brute_force(p)
    if math.isfinite(best):
        assert solve_intra_op(p).objective == pytest.approx(best, rel=1e-6)


def test_a_narrowed_mip_out_of_time_returns_the_answer_elimination_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The MIP over what elimination left finds nothing in its time: the fitting answer
    elimination handed over is returned, as "feasible" (not a SolverTimeout)."""
    from types import SimpleNamespace

    from autopar.search import ilp

    p = _lever_problem(0)
    settled = _settle(p)
    assert settled is not None and not settled.optimal and settled.choices is not None
    real = ilp._solve_model

    def out_of_time(*args, **kw):
        mdl, red, _ = real(*args, **kw)
        bounds = SimpleNamespace(dual_bound=-math.inf)
        termination = SimpleNamespace(reason=ilp._TR.NO_SOLUTION_FOUND, objective_bounds=bounds)
        return (
            mdl,
            red,
            SimpleNamespace(termination=termination, has_primal_feasible_solution=lambda: False),
        )

    monkeypatch.setattr(ilp, "_solve_model", out_of_time)
    sol = solve_intra_op(p)
    assert sol.choices == settled.choices and sol.status == "feasible"
    assert (sol.objective, sol.memory) == evaluate(p, settled.choices)
    assert sol.memory <= p.memory_limit and sol.objective >= _brute_force(p)[0]

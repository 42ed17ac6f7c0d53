"""Intra-operator sharding ILP (Alpa / meta-autoparallel style) over an abstract problem.

Each *decision* ``i`` (a node, or a group of nodes sharing one strategy) picks one of
``K_i`` *choices* (a sharding strategy).  Choosing costs ``node_cost[i][k]`` seconds and
``node_memory[i][k]`` bytes per device; an :class:`Edge` ``(u, v)`` adds the resharding cost
``cost[a][b]`` (and, optionally, the memory ``memory[a][b]``, of either sign) when ``u``
picks ``a`` and ``v`` picks ``b``. A :class:`GatedEdge` ``(u, v | w = c)`` adds its
``cost[a][b]`` / ``memory[a][b]`` (both >= 0) only when moreover ``w`` picks ``c`` (a
three-way term: a layer's recompute or reshard decision on a resharding edge).

Formulation (after the reductions below; built by `autopar.search.ilp_model`)::

    s[i,k] in {0,1}                 choice variables              (_add_choice_vars)
    sum_k s[i,k] = 1                one-hot per decision          (_add_choice_vars)
    e[u,v,a,b] in [0,1]             linearizes s[u,a] * s[v,b]    (_add_edge_vars)
    sum_b e[u,v,a,b] = s[u,a]       for every a                   (_add_edge_vars)
    sum_a e[u,v,a,b] = s[v,b]       for every b  (=> sum e = 1)   (_add_edge_vars)
    z[g,a,b] >= s[u,a] + s[v,b] + s[w,c] - 2,  z >= 0              (_add_gate_vars)
    sum_i sum_k mem[i][k] s[i,k] + sum M[a][b] e[u,v,a,b] + sum G_mem z <= memory_limit
                                                                  (_add_memory_constraint)
    min  sum_i sum_k c[i][k] s[i,k] + sum_(u,v) sum_(a,b) C[a][b] e[u,v,a,b] + sum G z
                                                                  (_set_objective)

``e`` is continuous for HiGHS: once the ``s`` are integral, the two rows of each pair leave
one ``e`` nonzero, ``e[u,v,a*,b*] = 1``, so branching on the ``s`` alone is exact (and the
MIP branches over ~1.5k binaries instead of ~50k on a Llama template: 1.6x faster).
``z`` is continuous: its coefficients are >= 0 in the objective and in the ``<=`` memory
row, so at an optimum it sits at its lower bound, the product of the three choices.

Blocks (HiGHS; :func:`_add_blocks`). The gated edges between two free decisions ``u < v``
that keep their ``e`` variables, gated by a free ``w`` on choice ``c``, are summed into one
matrix ``G`` per (u, v, w, c) (cost and memory apart) and priced by one variable each::

    y in [0, 1],  y >= sum_(a,b) (G[a][b] / max G) e[u,v,a,b] - (1 - s[w,c]),  worth max G

At an integral point ``y`` is ``G[a][b] / max G`` of the picked pair when ``w`` picks ``c``
and 0 otherwise, so the model is exact with one variable per block instead of one ``z``
per entry (a Llama-3-8B template: 35k ``z`` -> 192 ``y``; the LP is also tighter, because
it reads the ``e`` of the pair). HiGHS runs with feasibility tolerances of 1e-9 so that a
``y`` short of its bound by the tolerance cannot cost ``max G`` x 1e-6 of optimality.
CP-SAT, whose variables are integral, solves the ``z`` model (``_reduce(blocks=False)``).

Reductions (:func:`_reduce`) that keep the model small:

* ``inf`` in ``node_cost`` (or ``node_memory``) forbids that choice; a decision left with a
  single allowed choice is fixed (no variable) and its edges fold into the neighbour's
  node cost (``_fold_fixed_edges``; an ``inf`` there forbids the neighbour's choice).
* Self edges ``u == v`` (a repeated layer feeding its own input decision) can only take
  the diagonal, so ``cost[a][a]`` is added to the node cost.
* Edges between the same pair are merged by summing cost matrices (``(v, u)`` transposed).
* Separable matrices ``C[a][b] = r[a] + c[b]`` (all-zero included; the memory matrix too)
  are folded into the node costs and memories (``_fold_separable``); no ``e`` variables.
* A gated edge whose gate ``w`` has one allowed choice is an edge (or nothing); its fixed
  endpoints become constants, and with one free literal left it is a node term.
* ``e`` variables whose cost is ``inf`` are not created, which forbids that pair.
* The memory constraint is dropped when even the largest choices fit.

Costs span ~1e-6..1e2 s: coefficients are shifted by the per-decision minimum (the constant
stays outside the model so the solver's relative gap sees only the rest) and divided by the
largest one (memory likewise; an edge's memory is shifted by its own minimum, since exactly
one of its ``e`` is 1); objective / memory are recomputed by :func:`evaluate`.

Solver: variable elimination first (`autopar.search.elimination.settle`: the least-cost
assignment, a Lagrangian walk over the memory row, then Lagrangian variable fixing), which
proves most optima without a MIP and leaves the rest a MIP over the choices that can still
beat its best answer (`_narrowed`); then OR-Tools MathOpt with HiGHS, its LP relaxation
first (an assignment read off its optimum that costs that optimum is the MIP's,
`_relaxation_if_settled`), then the MIP (without restarts or sub-MIP heuristics,
`_HIGHS_SWITCHES`); CP-SAT (``num_workers=8``) when HiGHS is unavailable, errors out or
finds no solution within the time limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import timedelta

from ortools.math_opt.python import mathopt

from autopar.devices import local_cores
from autopar.search import ahead, elimination
from autopar.search.ilp_model import _build, _Model  # noqa: F401 - tests build models
from autopar.search.ilp_problem import (  # noqa: F401 - re-exported
    Edge,
    GatedEdge,
    IntraOpProblem,
    Matrix,
    _reduce,
    _Reduced,
    evaluate,
)

_REL_GAP = 1e-7  # MIP relative gap tolerance handed to the solver
_CPSAT_WORKERS = 8
_HIGHS_TOLERANCES = {"mip_feasibility_tolerance": 1e-9, "primal_feasibility_tolerance": 1e-9}
# HiGHS's MIP machinery that these small, tie-rich models pay for and do not use: restarts
# (presolve again after root fixings: three times on a GPT-3 stage ILP) and the RINS / RENS
# sub-MIPs (most of the LP iterations). Without them GPT-3 175B's 61 ILPs solve in 32 s
# instead of 62 s, every objective the same (`benchmarks/bench_ilp_options.py`).
_HIGHS_SWITCHES = {
    "mip_allow_restart": False,
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
}
# one thread per HiGHS solve: the search already solves its problems on a thread each
# (`solve_all`), and a HiGHS task executor with worker threads does not survive the fork of
# the layout search's processes (`search.workers`: the child's next solve waits forever)
_HIGHS_THREADS = 1
_TR = mathopt.TerminationReason
_PROVEN_INFEASIBLE = (_TR.INFEASIBLE, _TR.INFEASIBLE_OR_UNBOUNDED)


@dataclass(frozen=True, slots=True)
class IntraOpSolution:
    choices: tuple[int, ...]
    objective: float
    memory: float
    gap: float  # relative gap between objective and best bound (0 when optimal)
    status: str  # "optimal" | "feasible"
    solve_time_s: float


class SolverTimeout(RuntimeError):
    """No assignment found within the time limit (none proven impossible either)."""


class MemoryInfeasible(ValueError):
    """No assignment fits ``memory_limit``; ``min_memory`` is the least memory reachable."""

    def __init__(self, min_memory: float, memory_limit: float, message: str = "") -> None:
        self.min_memory = min_memory
        self.memory_limit = memory_limit
        super().__init__(
            message
            or f"memory limit {memory_limit:.4g} B infeasible: at least {min_memory:.4g} B needed"
        )

    def __reduce__(self) -> tuple[type, tuple[float, float, str]]:  # picklable across processes
        return type(self), (self.min_memory, self.memory_limit, str(self))

    def explained(self, cluster, limit: float) -> MemoryInfeasible:
        """This shortfall on `cluster` (a `Cluster`) named, with the smallest cluster that
        would fit (states and activations shard at best linearly with the device count,
        so this is a lower bound)."""
        world = cluster.world_size
        devices = math.ceil(world * self.min_memory / limit)
        nodes = max(1, math.ceil(devices / (cluster.devices_per_node or world)))
        gib = 2**30
        return MemoryInfeasible(
            self.min_memory,
            limit,
            f"no plan fits in {limit / gib:.3g} GiB per device on {cluster}: even the most "
            f"sharded plan needs {self.min_memory / gib:.3g} GiB per device. Use at least "
            f"{devices} devices (e.g. Cluster.preset(..., nodes={nodes})), a smaller batch, or "
            "memory_limit= if the device has more memory.",
        )


def _params(solver: mathopt.SolverType, time_limit_s: float) -> mathopt.SolveParameters:
    params = mathopt.SolveParameters(
        time_limit=timedelta(seconds=max(time_limit_s, 0.01)),
        relative_gap_tolerance=_REL_GAP,
        absolute_gap_tolerance=0.0,
    )
    if solver == mathopt.SolverType.CP_SAT:  # HiGHS: leave `threads` unset (misleading error)
        params.cp_sat.num_workers = _CPSAT_WORKERS
    else:  # the blocks' `y` weigh a whole matrix: feasibility to 1e-9 of its largest entry
        params.highs.double_options.update(_HIGHS_TOLERANCES)
        params.highs.bool_options.update(_HIGHS_SWITCHES)
        params.highs.int_options["threads"] = _HIGHS_THREADS
    return params


def _solve(mdl: _Model, solver: mathopt.SolverType, params) -> mathopt.SolveResult:
    """`mathopt.solve`, returning the values of the choice variables only: the rest (the
    edges' `e`, the duals) are read from no one, and parsing them into Python cost ~0.5 s
    per solve on a Llama template (as much as HiGHS's LP)."""
    choices = [mdl.model.get_variable(v) for s in mdl.s.values() for v in s.values()]
    none = mathopt.SparseVectorFilter(filtered_items=())
    only = mathopt.ModelSolveParameters(
        variable_values_filter=mathopt.SparseVectorFilter(filtered_items=choices),
        dual_values_filter=none,
        reduced_costs_filter=none,
    )
    return mathopt.solve(mdl.model, solver, params=params, model_params=only)


def _relaxation_if_settled(
    mdl: _Model, red: _Reduced, p: IntraOpProblem, time_limit_s: float
) -> mathopt.SolveResult | None:
    """HiGHS's LP relaxation, when it settles the MIP: it is infeasible, or an assignment
    read off it (each decision's largest value, or among its nonzero ones the least memory)
    is allowed, fits, and costs the LP's optimum to the MIP's gap (relative to the objective
    less its constant, as the solver's, `_set_objective`), so it is the MIP's
    optimum too (`mdl.rounded`, which `_choices` returns); None otherwise. Sharding problems
    are full of exact ties, whose LP optimum is integral or mixes tied choices: HiGHS's MIP
    machinery (presolve, heuristics, restarts) spent 1-3 s on each of a Llama-3-8B
    template's ILPs (5-25 s on others) whose LP, ~0.5 s, had settled 5 of 7 of them."""
    params = _params(mathopt.SolverType.HIGHS, time_limit_s)
    params.highs.bool_options["solve_relaxation"] = True
    result = _solve(mdl, mathopt.SolverType.HIGHS, params)
    if result.termination.reason in _PROVEN_INFEASIBLE:
        return result
    if result.termination.reason != _TR.OPTIMAL:
        return None
    values = {var.id: x for var, x in result.variable_values().items()}
    bound = mdl.const + result.objective_value() * mdl.scale
    for least_memory in (False, True):
        choices = _read_off(mdl, red, values, least_memory)
        cost, memory = evaluate(p, choices)
        worth = memory if mdl.minimizes_memory else cost
        fits = mdl.minimizes_memory or memory <= p.memory_limit
        gap = _REL_GAP * abs(worth - mdl.const) + 1e-13 * abs(worth)  # as the MIP's, + rounding
        if fits and math.isfinite(cost) and worth - bound <= gap:
            mdl.rounded = choices
            return result
    return None


def _read_off(mdl: _Model, red: _Reduced, values: dict[int, float], least_memory: bool):
    """Each decision's choice of largest value, or of least memory among its nonzero ones."""
    out = []
    for i, ks in enumerate(red.allowed):
        s = mdl.s.get(i)
        if s is None:
            out.append(ks[0])
        elif least_memory:
            out.append(min((k for k in s if values[s[k]] > 1e-6), key=red.mem[i].__getitem__))
        else:
            out.append(max(s, key=lambda k, s=s: values[s[k]]))
    return tuple(out)


def _solve_model(
    p: IntraOpProblem,
    backend: str,
    *,
    minimize_memory: bool = False,
    reduced: _Reduced | None = None,
) -> tuple[_Model, _Reduced, mathopt.SolveResult]:
    """HiGHS first; CP-SAT if HiGHS is unavailable, fails, or finds no solution. HiGHS
    solves the model with blocks (`_add_blocks`); CP-SAT, whose variables are integral,
    the one with a `z` per product (`_add_gate_vars`)."""
    order = {"auto": ["highs", "cpsat"], "highs": ["highs"], "cpsat": ["cpsat"]}.get(backend)
    if order is None:
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'highs' or 'cpsat'")
    deadline = time.perf_counter() + p.time_limit_s
    result, error = None, None
    for name in order:
        solver = mathopt.SolverType.HIGHS if name == "highs" else mathopt.SolverType.CP_SAT
        highs = name == "highs"
        red = reduced if reduced is not None and highs else _reduce(p, blocks=highs)
        mdl = _build(red, p, minimize_memory=minimize_memory, highs=highs)
        remaining = max(deadline - time.perf_counter(), min(1.0, p.time_limit_s))
        try:
            result = _relaxation_if_settled(mdl, red, p, remaining) if highs else None
            if result is None:
                remaining = max(deadline - time.perf_counter(), min(1.0, p.time_limit_s))
                result = _solve(mdl, solver, _params(solver, remaining))
        except Exception as exc:  # solver not linked in / internal failure: try the next one
            error = exc
            continue
        if result.has_primal_feasible_solution() or result.termination.reason in _PROVEN_INFEASIBLE:
            return mdl, red, result
    if result is None:
        raise RuntimeError(f"no ILP solver could run: {error}") from error
    return mdl, red, result


def _choices(mdl: _Model, red: _Reduced, result: mathopt.SolveResult) -> tuple[int, ...]:
    if mdl.rounded is not None:  # read off the LP relaxation (`_relaxation_if_settled`)
        return mdl.rounded
    values = {var.id: x for var, x in result.variable_values().items()}
    return _read_off(mdl, red, values, least_memory=False)


def _bound(mdl: _Model, result: mathopt.SolveResult) -> float:
    """Best proven lower bound on the (unscaled) objective."""
    return mdl.const + result.termination.objective_bounds.dual_bound * mdl.scale


def _gap(mdl: _Model, result: mathopt.SolveResult, objective: float) -> float:
    if result.termination.reason == _TR.OPTIMAL:
        return 0.0
    bound = _bound(mdl, result)
    if not math.isfinite(bound):
        return math.inf
    return max(0.0, objective - bound) / max(abs(objective), 1e-30)


def _diagnose(red: _Reduced, p: IntraOpProblem, backend: str) -> Exception:
    """The model is infeasible: blame memory if some assignment exists without the limit."""
    if red.min_memory() > p.memory_limit:
        return MemoryInfeasible(red.min_memory(), p.memory_limit)
    mdl, red, result = _solve_model(p, backend, minimize_memory=True)
    if not result.has_primal_feasible_solution():
        return ValueError("no assignment satisfies the forbidden (inf) choices and pairs")
    _, mem = evaluate(p, _choices(mdl, red, result))
    if result.termination.reason != _TR.OPTIMAL:  # report a lower bound
        mem = max(red.min_memory(), _bound(mdl, result))
    return MemoryInfeasible(mem, p.memory_limit)


def solve_intra_op(problem: IntraOpProblem, *, backend: str = "auto") -> IntraOpSolution:
    """Solve the intra-op ILP. ``backend``: "auto" (`elimination.settle`, then HiGHS on
    what it leaves, then CP-SAT), "highs", "cpsat".

    Raises :class:`MemoryInfeasible` when no assignment fits ``memory_limit`` and
    ``ValueError`` when the forbidden choices/pairs leave no assignment at all.
    """
    t0 = time.perf_counter()
    red = _reduce(problem)
    min_mem = red.min_memory()
    if min_mem > problem.memory_limit:
        raise MemoryInfeasible(min_mem, problem.memory_limit)
    settled = None
    if backend == "auto":
        settled = elimination.settle(problem, red, _REL_GAP)
        if settled is not None and settled.optimal:
            return _solution(problem, settled.choices, "optimal", 0.0, t0)
    narrowed = problem if settled is None else _narrowed(problem, settled)
    mdl, solved, result = _solve_model(
        narrowed, backend, reduced=red if narrowed is problem else None
    )
    # the fitting answer elimination handed over first: kept where the MIP's is no better
    # (within its gap) or where the MIP found none in its time
    answers = [settled.choices] if settled is not None and settled.choices is not None else []
    if result.has_primal_feasible_solution():
        answers.append(_choices(mdl, solved, result))
    if not answers:
        if result.termination.reason in _PROVEN_INFEASIBLE:
            raise _diagnose(red, problem, backend)
        raise SolverTimeout(f"no solution in {problem.time_limit_s} s: {result.termination}")
    choices = min(answers, key=lambda c: evaluate(problem, c)[0])  # ties: the first
    status = "optimal" if result.termination.reason == _TR.OPTIMAL else "feasible"
    gap = _gap(mdl, result, evaluate(problem, choices)[0])
    return _solution(problem, choices, status, gap, t0)


def _solution(p: IntraOpProblem, choices, status: str, gap: float, t0: float) -> IntraOpSolution:
    objective, memory = evaluate(p, choices)
    return IntraOpSolution(choices, objective, memory, gap, status, time.perf_counter() - t0)


def _narrowed(p: IntraOpProblem, settled: elimination.Settled) -> IntraOpProblem:
    """`p` with the choices `settled` proved cannot beat its answer forbidden (inf cost):
    the MIP then solves only what is left, its answer among them."""
    if not settled.keep:
        return p
    cost = list(p.node_cost)
    for i, kept in settled.keep.items():
        keep = set(kept)
        cost[i] = tuple(c if k in keep else math.inf for k, c in enumerate(cost[i]))
    return replace(p, node_cost=tuple(cost))


def solve_all(
    problems: list[IntraOpProblem], meanwhile: Callable[[], None] | None = None
) -> list[IntraOpSolution | Exception]:
    """Each problem's solution (or the exception its solve raised), in order. The solvers
    run in C++ without the GIL, so the problems are solved on a thread each, as many at once
    as this process has cores (the three cost scales of a Llama-3-8B template, ~4 s each,
    take ~7 s on 2 cores instead of ~12), and `meanwhile` (`search.ahead`: the layout
    search's next candidate) runs on this thread while they do."""

    def solve(problem: IntraOpProblem) -> IntraOpSolution | Exception:
        try:
            return solve_intra_op(problem)
        except (MemoryInfeasible, SolverTimeout, ValueError, RuntimeError) as exc:
            return exc

    workers = min(len(problems), local_cores())
    if workers <= 1 and meanwhile is None:
        return [solve(p) for p in problems]
    with ThreadPoolExecutor(workers, thread_name_prefix="autopar-ilp") as pool:
        futures = [pool.submit(solve, p) for p in problems]
        if meanwhile is not None:
            ahead.run_safely(meanwhile)
        return [f.result() for f in futures]

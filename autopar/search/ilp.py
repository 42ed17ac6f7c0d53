"""Intra-operator sharding ILP (Alpa / meta-autoparallel style) over an abstract problem.

Each *decision* ``i`` (a node, or a group of nodes sharing one strategy) picks one of
``K_i`` *choices* (a sharding strategy).  Choosing costs ``node_cost[i][k]`` seconds and
``node_memory[i][k]`` bytes per device; an :class:`Edge` ``(u, v)`` adds the resharding cost
``cost[a][b]`` when ``u`` picks ``a`` and ``v`` picks ``b``.

Formulation (after the reductions below)::

    s[i,k] in {0,1}                 choice variables              (_add_choice_vars)
    sum_k s[i,k] = 1                one-hot per decision          (_add_choice_vars)
    e[u,v,a,b] in {0,1}             linearizes s[u,a] * s[v,b]    (_add_edge_vars)
    sum_b e[u,v,a,b] = s[u,a]       for every a                   (_add_edge_vars)
    sum_a e[u,v,a,b] = s[v,b]       for every b  (=> sum e = 1)   (_add_edge_vars)
    sum_i sum_k mem[i][k] s[i,k] <= memory_limit                  (_add_memory_constraint)
    min  sum_i sum_k c[i][k] s[i,k] + sum_(u,v) sum_(a,b) C[a][b] e[u,v,a,b]
                                                                  (_set_objective)

Reductions (:func:`_reduce`) that keep the model small:

* ``inf`` in ``node_cost`` (or ``node_memory``) forbids that choice; a decision left with a
  single allowed choice is fixed (no variable) and its edges fold into the neighbour's
  node cost (``_fold_fixed_edges``; an ``inf`` there forbids the neighbour's choice).
* Self edges ``u == v`` (a repeated layer feeding its own input decision) can only take
  the diagonal, so ``cost[a][a]`` is added to the node cost.
* Edges between the same pair are merged by summing cost matrices (``(v, u)`` transposed).
* Separable matrices ``C[a][b] = r[a] + c[b]`` (all-zero included) are folded into the node
  costs (``_fold_separable``); no ``e`` variables.
* ``e`` variables whose cost is ``inf`` are not created, which forbids that pair.
* The memory constraint is dropped when even the largest choices fit.

Costs span ~1e-6..1e2 s: coefficients are shifted by the per-decision minimum (the constant
stays outside the model so the solver's relative gap sees only the rest) and divided by the
largest one (memory likewise); objective / memory are recomputed by :func:`evaluate`.

Solver: OR-Tools MathOpt with HiGHS; CP-SAT (``num_workers=8``) when HiGHS is unavailable,
errors out or finds no solution within the time limit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta

from ortools.math_opt.python import mathopt

_REL_GAP = 1e-7  # MIP relative gap tolerance handed to the solver
_SEP_TOL = 1e-9  # relative tolerance of the separability test
_CPSAT_WORKERS = 8
_TR = mathopt.TerminationReason
_PROVEN_INFEASIBLE = (_TR.INFEASIBLE, _TR.INFEASIBLE_OR_UNBOUNDED)
Matrix = list[list[float]]


@dataclass(frozen=True, slots=True)
class Edge:
    u: int
    v: int
    cost: tuple[tuple[float, ...], ...]  # [choice_u][choice_v], seconds


@dataclass(frozen=True, slots=True)
class IntraOpProblem:
    node_cost: tuple[tuple[float, ...], ...]  # per decision, per choice (seconds)
    node_memory: tuple[tuple[float, ...], ...]  # per decision, per choice (bytes per device)
    edges: tuple[Edge, ...]
    memory_limit: float  # bytes per device
    time_limit_s: float = 30.0


@dataclass(frozen=True, slots=True)
class IntraOpSolution:
    choices: tuple[int, ...]
    objective: float
    memory: float
    gap: float  # relative gap between objective and best bound (0 when optimal)
    status: str  # "optimal" | "feasible"
    solve_time_s: float


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


def evaluate(problem: IntraOpProblem, choices: tuple[int, ...] | list[int]) -> tuple[float, float]:
    """Price an assignment: ``(objective seconds, memory bytes)``; inf if it is forbidden."""
    if len(choices) != len(problem.node_cost):
        raise ValueError(f"{len(choices)} choices for {len(problem.node_cost)} decisions")
    if any(not 0 <= k < len(c) for k, c in zip(choices, problem.node_cost, strict=True)):
        raise ValueError(f"choice out of range in {tuple(choices)}")
    obj = math.fsum(problem.node_cost[i][k] for i, k in enumerate(choices))
    obj += math.fsum(e.cost[choices[e.u]][choices[e.v]] for e in problem.edges)
    mem = math.fsum(problem.node_memory[i][k] for i, k in enumerate(choices))
    return obj, mem


@dataclass(slots=True)
class _Reduced:
    cost: Matrix  # node cost per decision/choice, edges folded in where possible
    allowed: list[list[int]]  # allowed choices per decision
    pairs: dict[tuple[int, int], Matrix]  # u < v, both free, not separable

    def fixed(self, i: int) -> bool:
        return len(self.allowed[i]) == 1

    def min_memory(self, memory: tuple[tuple[float, ...], ...]) -> float:
        return math.fsum(min(memory[i][k] for k in ks) for i, ks in enumerate(self.allowed))


def _validate(p: IntraOpProblem) -> None:
    n = len(p.node_cost)
    if len(p.node_memory) != n:
        raise ValueError("node_cost and node_memory differ in length")
    for i, (c, m) in enumerate(zip(p.node_cost, p.node_memory, strict=True)):
        if not c or len(c) != len(m) or any(math.isnan(x) or x == -math.inf for x in (*c, *m)):
            raise ValueError(f"decision {i}: empty, mismatched, NaN or -inf cost/memory")
    for e in p.edges:
        if not (0 <= e.u < n and 0 <= e.v < n):
            raise ValueError(f"edge {e.u}->{e.v} out of range")
        ku, kv = len(p.node_cost[e.u]), len(p.node_cost[e.v])
        if len(e.cost) != ku or any(len(r) != kv for r in e.cost):
            raise ValueError(f"edge {e.u}->{e.v}: cost matrix is not {ku}x{kv}")
        if any(math.isnan(x) or x == -math.inf for r in e.cost for x in r):
            raise ValueError(f"edge {e.u}->{e.v}: NaN or -inf cost")


def _merge_edges(p: IntraOpProblem, cost: Matrix) -> dict[tuple[int, int], Matrix]:
    """Self edges go to the node cost diagonal; parallel edges are summed with u < v."""
    pairs: dict[tuple[int, int], Matrix] = {}
    for e in p.edges:
        if e.u == e.v:
            for a in range(len(cost[e.u])):
                cost[e.u][a] += e.cost[a][a]
            continue
        m = [list(r) for r in e.cost] if e.u < e.v else [list(c) for c in zip(*e.cost, strict=True)]
        key = (min(e.u, e.v), max(e.u, e.v))
        if key in pairs:
            acc = pairs[key]
            for a, row in enumerate(m):
                for b, x in enumerate(row):
                    acc[a][b] += x
        else:
            pairs[key] = m
    return pairs


def _fold_fixed_edges(red: _Reduced) -> None:
    """Fold edges with a fixed endpoint into the other endpoint until nothing changes."""
    changed = True
    while changed:
        changed = False
        for (u, v), m in list(red.pairs.items()):
            if red.fixed(u):
                tgt, vec = v, m[red.allowed[u][0]]
            elif red.fixed(v):
                b, tgt = red.allowed[v][0], u
                vec = [row[b] for row in m]
            else:
                continue
            del red.pairs[(u, v)]
            for k in red.allowed[tgt]:
                red.cost[tgt][k] += vec[k]
            red.allowed[tgt] = [k for k in red.allowed[tgt] if math.isfinite(red.cost[tgt][k])]
            if not red.allowed[tgt]:
                raise ValueError(f"decision {tgt}: every choice is forbidden")
            changed = True


def _fold_separable(red: _Reduced) -> None:
    """Fold edges with C[a][b] = r[a] + c[b] (over allowed choices) into node costs."""
    for (u, v), m in list(red.pairs.items()):
        au, av = red.allowed[u], red.allowed[v]
        vals = [m[a][b] for a in au for b in av]
        if not all(math.isfinite(x) for x in vals):
            continue
        a0, b0 = au[0], av[0]
        tol = _SEP_TOL * max(1e-30, max(abs(x) for x in vals))
        r = {a: m[a][b0] - m[a0][b0] for a in au}
        if any(abs(m[a][b] - r[a] - m[a0][b]) > tol for a in au for b in av):
            continue
        del red.pairs[(u, v)]
        for a in au:
            red.cost[u][a] += r[a]
        for b in av:
            red.cost[v][b] += m[a0][b]


def _reduce(p: IntraOpProblem) -> _Reduced:
    _validate(p)
    cost = [list(c) for c in p.node_cost]
    pairs = _merge_edges(p, cost)
    allowed = []
    for i, c in enumerate(cost):
        ks = [k for k, x in enumerate(c) if math.isfinite(x) and math.isfinite(p.node_memory[i][k])]
        if not ks:
            raise ValueError(f"decision {i}: every choice is forbidden")
        allowed.append(ks)
    red = _Reduced(cost, allowed, pairs)
    _fold_fixed_edges(red)
    _fold_separable(red)
    return red


@dataclass(slots=True)
class _Model:
    model: mathopt.Model
    s: dict[int, dict[int, mathopt.Variable]]  # free decision -> choice -> variable
    scale: float = 1.0  # objective = const + scale * model objective
    const: float = 0.0  # kept out of the model so the solver's relative gap sees only the rest


def _add_choice_vars(mdl: _Model, red: _Reduced) -> None:
    for i, ks in enumerate(red.allowed):
        if len(ks) > 1:
            mdl.s[i] = {k: mdl.model.add_binary_variable(name=f"s_{i}_{k}") for k in ks}
            mdl.model.add_linear_constraint(mathopt.fast_sum(mdl.s[i].values()) == 1)


def _add_edge_vars(mdl: _Model, red: _Reduced) -> dict[mathopt.Variable, float]:
    """Create e[u,v,a,b] for finite pairs; returns their (unscaled) objective coefficients."""
    coef: dict[mathopt.Variable, float] = {}
    add = mdl.model.add_linear_constraint
    for (u, v), m in red.pairs.items():
        su, sv = mdl.s[u], mdl.s[v]
        e = {
            (a, b): mdl.model.add_binary_variable(name=f"e_{u}_{v}_{a}_{b}")
            for a in su
            for b in sv
            if math.isfinite(m[a][b])
        }
        for (a, b), var in e.items():
            coef[var] = m[a][b]
        for a in su:
            add(mathopt.fast_sum(e[a, b] for b in sv if (a, b) in e) == su[a])
        for b in sv:
            add(mathopt.fast_sum(e[a, b] for a in su if (a, b) in e) == sv[b])
    return coef


def _masked(values: tuple[tuple[float, ...], ...] | Matrix, red: _Reduced) -> Matrix:
    """``values`` with forbidden choices set to inf."""
    return [
        [x if k in ks else math.inf for k, x in enumerate(row)]
        for row, ks in zip(values, red.allowed, strict=True)
    ]


def _shifted(mdl: _Model, rows: Matrix) -> tuple[float, dict[mathopt.Variable, float]]:
    """Constant part (fixed choices + per-decision minimum) and the per-variable excess."""
    const, coef = 0.0, {}
    for i, row in enumerate(rows):
        lo = min(row)  # forbidden choices are inf in `rows`
        const += lo
        if i in mdl.s:
            coef.update({var: row[k] - lo for k, var in mdl.s[i].items() if row[k] != lo})
    return const, coef


def _add_memory_constraint(mdl: _Model, red: _Reduced, memory: Matrix, limit: float) -> None:
    rows = _masked(memory, red)
    const, coef = _shifted(mdl, rows)
    worst = math.fsum(max(x for x in row if math.isfinite(x)) for row in rows)
    if not coef or worst <= limit:
        return  # even the largest choices fit: the constraint cannot bind
    scale = max(coef.values())
    expr = mathopt.fast_sum(c / scale * var for var, c in coef.items())
    mdl.model.add_linear_constraint(expr <= (limit - const) / scale, name="memory")


def _set_objective(mdl: _Model, edge_coef: dict[mathopt.Variable, float], rows: Matrix) -> None:
    const, coef = _shifted(mdl, rows)
    coef.update(edge_coef)
    mdl.const = const
    mdl.scale = max((abs(c) for c in coef.values() if c), default=1.0)
    mdl.model.objective.is_maximize = False
    for var, c in coef.items():
        if c:
            mdl.model.objective.set_linear_coefficient(var, c / mdl.scale)


def _build(red: _Reduced, p: IntraOpProblem, *, minimize_memory: bool = False) -> _Model:
    mdl = _Model(mathopt.Model(name="intra_op"), {})
    _add_choice_vars(mdl, red)
    edge_coef = _add_edge_vars(mdl, red)
    if minimize_memory:  # diagnosis model: least memory, ignoring the limit
        _set_objective(mdl, dict.fromkeys(edge_coef, 0.0), _masked(p.node_memory, red))
        return mdl
    _add_memory_constraint(mdl, red, p.node_memory, p.memory_limit)
    _set_objective(mdl, edge_coef, _masked(red.cost, red))
    return mdl


def _params(solver: mathopt.SolverType, time_limit_s: float) -> mathopt.SolveParameters:
    params = mathopt.SolveParameters(
        time_limit=timedelta(seconds=max(time_limit_s, 0.01)),
        relative_gap_tolerance=_REL_GAP,
        absolute_gap_tolerance=0.0,
    )
    if solver == mathopt.SolverType.CP_SAT:  # HiGHS: leave `threads` unset (misleading error)
        params.cp_sat.num_workers = _CPSAT_WORKERS
    return params


def _solve_model(mdl: _Model, backend: str, time_limit_s: float) -> mathopt.SolveResult:
    """HiGHS first; CP-SAT if HiGHS is unavailable, fails, or finds no solution."""
    order = {"auto": ["highs", "cpsat"], "highs": ["highs"], "cpsat": ["cpsat"]}.get(backend)
    if order is None:
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'highs' or 'cpsat'")
    deadline = time.perf_counter() + time_limit_s
    result, error = None, None
    for name in order:
        solver = mathopt.SolverType.HIGHS if name == "highs" else mathopt.SolverType.CP_SAT
        remaining = max(deadline - time.perf_counter(), min(1.0, time_limit_s))
        try:
            result = mathopt.solve(mdl.model, solver, params=_params(solver, remaining))
        except Exception as exc:  # solver not linked in / internal failure: try the next one
            error = exc
            continue
        if result.has_primal_feasible_solution() or result.termination.reason in _PROVEN_INFEASIBLE:
            return result
    if result is None:
        raise RuntimeError(f"no ILP solver could run: {error}") from error
    return result


def _choices(mdl: _Model, red: _Reduced, result: mathopt.SolveResult) -> tuple[int, ...]:
    values = result.variable_values()
    out = []
    for i, ks in enumerate(red.allowed):
        s = mdl.s.get(i)
        out.append(ks[0] if s is None else max(s, key=lambda k, s=s: values[s[k]]))
    return tuple(out)


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
    if red.min_memory(p.node_memory) > p.memory_limit:
        return MemoryInfeasible(red.min_memory(p.node_memory), p.memory_limit)
    mdl = _build(red, p, minimize_memory=True)
    result = _solve_model(mdl, backend, p.time_limit_s)
    if not result.has_primal_feasible_solution():
        return ValueError("no assignment satisfies the forbidden (inf) choices and pairs")
    _, mem = evaluate(p, _choices(mdl, red, result))
    if result.termination.reason != _TR.OPTIMAL:  # report a lower bound
        mem = max(red.min_memory(p.node_memory), _bound(mdl, result))
    return MemoryInfeasible(mem, p.memory_limit)


def solve_intra_op(problem: IntraOpProblem, *, backend: str = "auto") -> IntraOpSolution:
    """Solve the intra-op ILP. ``backend``: "auto" (HiGHS, then CP-SAT), "highs", "cpsat".

    Raises :class:`MemoryInfeasible` when no assignment fits ``memory_limit`` and
    ``ValueError`` when the forbidden choices/pairs leave no assignment at all.
    """
    t0 = time.perf_counter()
    red = _reduce(problem)
    min_mem = red.min_memory(problem.node_memory)
    if min_mem > problem.memory_limit:
        raise MemoryInfeasible(min_mem, problem.memory_limit)
    mdl = _build(red, problem)
    result = _solve_model(mdl, backend, problem.time_limit_s)
    if not result.has_primal_feasible_solution():
        if result.termination.reason in _PROVEN_INFEASIBLE:
            raise _diagnose(red, problem, backend)
        raise RuntimeError(f"no solution in {problem.time_limit_s} s: {result.termination}")
    choices = _choices(mdl, red, result)
    objective, memory = evaluate(problem, choices)
    status = "optimal" if result.termination.reason == _TR.OPTIMAL else "feasible"
    gap, elapsed = _gap(mdl, result, objective), time.perf_counter() - t0
    return IntraOpSolution(choices, objective, memory, gap, status, elapsed)

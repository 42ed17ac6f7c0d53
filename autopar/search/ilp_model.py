"""The intra-op ILP as a MIP: flat arrays of variables and rows, handed to the solver as one
`ModelProto` (`_build`, `_finish`). The formulation (choice, edge, gate and block variables,
the memory row, the shifted and scaled objective) is stated in `autopar.search.ilp`'s
docstring, which solves it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ortools.math_opt import model_pb2
from ortools.math_opt.python import mathopt

from autopar.search.ilp_problem import IntraOpProblem, Matrix, _Reduced


@dataclass(slots=True)
class _Model:
    """The MIP as flat arrays (variables by id, rows of (ids, coefficients)), handed to the
    solver as one `ModelProto` (`_finish`): mathopt's expression API cost more than HiGHS's
    own solve on a Llama template."""

    s: dict[int, dict[int, int]] = field(default_factory=dict)  # free decision -> choice -> id
    scale: float = 1.0  # objective = const + scale * model objective
    const: float = 0.0  # kept out of the model so the solver's relative gap sees only the rest
    e: dict[tuple[int, int], dict[tuple[int, int], int]] = field(default_factory=dict)
    z: dict[tuple[tuple[int, int], ...], int] = field(default_factory=dict)
    y: list[tuple[int, int, float]] = field(default_factory=list)  # id, 0/1 (cost/memory), max
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[tuple[float, float, list[int], list[float]]] = field(default_factory=list)
    objective: dict[int, float] = field(default_factory=dict)
    model: mathopt.Model | None = None  # built by `_finish`
    minimizes_memory: bool = False  # the diagnosis model (`_build(minimize_memory=True)`)
    rounded: tuple[int, ...] | None = None  # the optimum read off the LP relaxation

    def var(self, integer: bool) -> int:
        self.lower.append(0.0)
        self.upper.append(1.0)
        self.integer.append(integer)
        return len(self.lower) - 1

    def row(self, ids: list[int], coefs: list[float], lb: float, ub: float) -> None:
        self.rows.append((lb, ub, ids, coefs))


def _finish(mdl: _Model) -> mathopt.Model:
    """One ModelProto of the arrays (matrix entries row-major, columns sorted)."""
    proto = model_pb2.ModelProto(name="intra_op")
    n = len(mdl.lower)
    proto.variables.ids.extend(range(n))
    proto.variables.lower_bounds.extend(mdl.lower)
    proto.variables.upper_bounds.extend(mdl.upper)
    proto.variables.integers.extend(mdl.integer)
    rows = proto.linear_constraints
    rows.ids.extend(range(len(mdl.rows)))
    rows.lower_bounds.extend(r[0] for r in mdl.rows)
    rows.upper_bounds.extend(r[1] for r in mdl.rows)
    row_ids, col_ids, coefs = [], [], []
    for i, (_, _, ids, cs) in enumerate(mdl.rows):
        entries = sorted(zip(ids, cs, strict=True))
        row_ids.extend([i] * len(entries))
        col_ids.extend(j for j, _ in entries)
        coefs.extend(c for _, c in entries)
    matrix = proto.linear_constraint_matrix
    matrix.row_ids.extend(row_ids)
    matrix.column_ids.extend(col_ids)
    matrix.coefficients.extend(coefs)
    objective = sorted((j, c) for j, c in mdl.objective.items() if c)
    proto.objective.maximize = False
    proto.objective.linear_coefficients.ids.extend(j for j, _ in objective)
    proto.objective.linear_coefficients.values.extend(c for _, c in objective)
    mdl.model = mathopt.Model.from_model_proto(proto)
    return mdl.model


def _add_choice_vars(mdl: _Model, red: _Reduced) -> None:
    for i, ks in enumerate(red.allowed):
        if len(ks) > 1:
            mdl.s[i] = {k: mdl.var(True) for k in ks}
            mdl.row(list(mdl.s[i].values()), [1.0] * len(ks), 1.0, 1.0)


def _add_edge_vars(mdl: _Model, red: _Reduced, integral: bool) -> dict[int, float]:
    """Create e[u,v,a,b] for finite pairs (continuous unless `integral`: CP-SAT's); returns
    their (unscaled) objective coefficients."""
    coef: dict[int, float] = {}
    for (u, v), m in red.pairs.items():
        su, sv = mdl.s[u], mdl.s[v]
        e = {(a, b): mdl.var(integral) for a in su for b in sv if math.isfinite(m[a][b])}
        mdl.e[(u, v)] = e
        for (a, b), var in e.items():
            coef[var] = m[a][b]
        for a in su:
            ids = [e[a, b] for b in sv if (a, b) in e]
            mdl.row([*ids, su[a]], [1.0] * len(ids) + [-1.0], 0.0, 0.0)
        for b in sv:
            ids = [e[a, b] for a in su if (a, b) in e]
            mdl.row([*ids, sv[b]], [1.0] * len(ids) + [-1.0], 0.0, 0.0)
    return coef


def _add_gate_vars(mdl: _Model, red: _Reduced) -> None:
    """z >= sum of the literals - (count - 1): the product of binaries, at its bound."""
    for lits in red.gates:
        z = mdl.var(False)
        ids = [mdl.s[d][k] for d, k in lits]
        mdl.row([z, *ids], [1.0] + [-1.0] * len(ids), 1.0 - len(lits), math.inf)
        mdl.z[lits] = z


def _add_blocks(mdl: _Model, red: _Reduced) -> None:
    """y >= sum_ab (G[a][b] / max G) e[u,v,a,b] - (1 - s[w,c]), y >= 0: one variable per
    block (u, v, w, c) and matrix (cost, memory), worth max G; at an integral point y is
    the picked entry's share when w picks c, else 0 (`y` sits at its bound as `z` does)."""
    for (u, v, w, c), mats in red.blocks.items():
        e = mdl.e[(u, v)]
        for which, m in enumerate(mats):
            top = max((m[a][b] for a, b in e), default=0.0)
            if top <= 0:
                continue
            y = mdl.var(False)
            terms = [(var, -m[a][b] / top) for (a, b), var in e.items() if m[a][b]]
            ids = [y, *(var for var, _ in terms), mdl.s[w][c]]
            mdl.row(ids, [1.0, *(x for _, x in terms), -1.0], -1.0, math.inf)
            mdl.y.append((y, which, top))


def _gate_coef(mdl: _Model, red: _Reduced, which: int) -> dict[int, float]:
    coef = {mdl.z[lits]: cm[which] for lits, cm in red.gates.items() if cm[which]}
    coef.update({y: top for y, w, top in mdl.y if w == which})
    return coef


def _edge_memory(mdl: _Model, red: _Reduced) -> tuple[float, dict[int, float]]:
    """Each edge's memory, shifted by its least entry (exactly one of its e is 1)."""
    const, coef = 0.0, {}
    for key, e in mdl.e.items():
        m = red.pair_mem[key]
        if not e:
            continue
        lo = min(m[a][b] for a, b in e)
        const += lo
        coef.update({var: m[a][b] - lo for (a, b), var in e.items() if m[a][b] != lo})
    return const, coef


def _masked(values: tuple[tuple[float, ...], ...] | Matrix, red: _Reduced) -> Matrix:
    """``values`` with forbidden choices set to inf."""
    return [
        [x if k in ks else math.inf for k, x in enumerate(row)]
        for row, ks in zip(values, red.allowed, strict=True)
    ]


def _shifted(mdl: _Model, rows: Matrix) -> tuple[float, dict[int, float]]:
    """Constant part (fixed choices + per-decision minimum) and the per-variable excess."""
    const, coef = 0.0, {}
    for i, row in enumerate(rows):
        lo = min(row)  # forbidden choices are inf in `rows`
        const += lo
        if i in mdl.s:
            coef.update({var: row[k] - lo for k, var in mdl.s[i].items() if row[k] != lo})
    return const, coef


def _memory_terms(mdl: _Model, red: _Reduced) -> tuple[float, dict, float]:
    """(constant, coefficient per variable, worst case) of the memory of an assignment."""
    rows = _masked(red.mem, red)
    const, coef = _shifted(mdl, rows)
    pconst, pcoef = _edge_memory(mdl, red)
    coef.update(pcoef)
    for var, c in _gate_coef(mdl, red, 1).items():
        coef[var] = coef.get(var, 0.0) + c
    worst = math.fsum(max(x for x in row if math.isfinite(x)) for row in rows)
    worst += math.fsum(
        max(m[a][b] for a, b in mdl.e[k]) for k, m in red.pair_mem.items() if mdl.e[k]
    )
    worst += math.fsum(cm[1] for cm in red.gates.values())
    worst += math.fsum(top for _, which, top in mdl.y if which == 1)
    return const + pconst, coef, worst


def _add_memory_constraint(mdl: _Model, red: _Reduced, limit: float) -> None:
    const, coef, worst = _memory_terms(mdl, red)
    if not coef or worst <= limit:
        return  # even the largest choices fit: the constraint cannot bind
    scale = max(coef.values())
    mdl.row(list(coef), [c / scale for c in coef.values()], -math.inf, (limit - const) / scale)


def _set_objective(mdl: _Model, coef: dict[int, float], const: float) -> None:
    mdl.const = const
    mdl.scale = max((abs(c) for c in coef.values() if c), default=1.0)
    mdl.objective = {var: c / mdl.scale for var, c in coef.items() if c}


def _build(
    red: _Reduced, p: IntraOpProblem, *, minimize_memory: bool = False, highs: bool = True
) -> _Model:
    mdl = _Model()
    _add_choice_vars(mdl, red)
    edge_coef = _add_edge_vars(mdl, red, integral=not highs)
    _add_gate_vars(mdl, red)
    _add_blocks(mdl, red)
    if minimize_memory:  # diagnosis model: least memory, ignoring the limit
        mdl.minimizes_memory = True
        const, coef, _ = _memory_terms(mdl, red)
        _set_objective(mdl, coef, const)
        _finish(mdl)
        return mdl
    _add_memory_constraint(mdl, red, p.memory_limit)
    const, coef = _shifted(mdl, _masked(red.cost, red))
    coef.update(edge_coef)
    for var, c in _gate_coef(mdl, red, 0).items():
        coef[var] = coef.get(var, 0.0) + c
    _set_objective(mdl, coef, const)
    _finish(mdl)
    return mdl

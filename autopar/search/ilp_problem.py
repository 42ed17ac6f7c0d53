"""The intra-op ILP's problem, its price (`evaluate`) and the reductions that keep the MIP
small (`_reduce`); the formulation and the solver are in `autopar.search.ilp`, whose
docstring states both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_SEP_TOL = 1e-9  # relative tolerance of the separability test
Matrix = list[list[float]]


@dataclass(frozen=True, slots=True)
class Edge:
    u: int
    v: int
    cost: tuple[tuple[float, ...], ...]  # [choice_u][choice_v], seconds
    memory: tuple[tuple[float, ...], ...] | None = None  # [choice_u][choice_v], bytes


@dataclass(frozen=True, slots=True)
class GatedEdge:
    """An edge's cost and memory that count only when decision `w` picks `choice`."""

    u: int
    v: int
    w: int
    choice: int
    cost: tuple[tuple[float, ...], ...]  # [choice_u][choice_v], seconds, >= 0
    memory: tuple[tuple[float, ...], ...] | None = None  # bytes, >= 0


@dataclass(frozen=True, slots=True)
class IntraOpProblem:
    node_cost: tuple[tuple[float, ...], ...]  # per decision, per choice (seconds)
    node_memory: tuple[tuple[float, ...], ...]  # per decision, per choice (bytes per device)
    edges: tuple[Edge, ...]
    memory_limit: float  # bytes per device
    time_limit_s: float = 30.0
    gated: tuple[GatedEdge, ...] = ()


def evaluate(problem: IntraOpProblem, choices: tuple[int, ...] | list[int]) -> tuple[float, float]:
    """Price an assignment: ``(objective seconds, memory bytes)``; inf if it is forbidden."""
    if len(choices) != len(problem.node_cost):
        raise ValueError(f"{len(choices)} choices for {len(problem.node_cost)} decisions")
    if any(not 0 <= k < len(c) for k, c in zip(choices, problem.node_cost, strict=True)):
        raise ValueError(f"choice out of range in {tuple(choices)}")
    obj = math.fsum(problem.node_cost[i][k] for i, k in enumerate(choices))
    obj += math.fsum(e.cost[choices[e.u]][choices[e.v]] for e in problem.edges)
    on = [g for g in problem.gated if choices[g.w] == g.choice]
    obj += math.fsum(g.cost[choices[g.u]][choices[g.v]] for g in on)
    mem = math.fsum(problem.node_memory[i][k] for i, k in enumerate(choices))
    mem += math.fsum(
        m[choices[e.u]][choices[e.v]] for e in (*problem.edges, *on) if (m := e.memory) is not None
    )
    return obj, mem


@dataclass(slots=True)
class _Reduced:
    cost: Matrix  # node cost per decision/choice, edges folded in where possible
    mem: Matrix  # node memory per decision/choice, edge memories folded in likewise
    allowed: list[list[int]]  # allowed choices per decision
    pairs: dict[tuple[int, int], Matrix]  # u < v, both free, not separable
    pair_mem: dict[tuple[int, int], Matrix]  # the memory matrix of each of `pairs`
    gates: dict[tuple[tuple[int, int], ...], list[float]] = field(default_factory=dict)
    # gates: free literals (decision, choice), 2 or more -> [cost, memory] of their product
    blocks: dict[tuple[int, int, int, int], tuple[Matrix, Matrix]] = field(default_factory=dict)
    # blocks: (u, v, w, c), u < v a pair of `pairs`, w free -> (cost, memory) matrices of the
    # gated edges between u and v that count when w picks c (one term each, `ilp._add_blocks`)

    def fixed(self, i: int) -> bool:
        return len(self.allowed[i]) == 1

    def min_memory(self) -> float:
        """A lower bound on the memory of any allowed assignment."""
        nodes = math.fsum(min(self.mem[i][k] for k in ks) for i, ks in enumerate(self.allowed))
        pairs = math.fsum(
            min(m[a][b] for a in self.allowed[u] for b in self.allowed[v])
            for (u, v), m in self.pair_mem.items()
        )
        return nodes + pairs


def _validate(p: IntraOpProblem) -> None:
    n = len(p.node_cost)
    if len(p.node_memory) != n:
        raise ValueError("node_cost and node_memory differ in length")
    for i, (c, m) in enumerate(zip(p.node_cost, p.node_memory, strict=True)):
        if not c or len(c) != len(m) or _nan_or_minus_inf((c, m)):
            raise ValueError(f"decision {i}: empty, mismatched, NaN or -inf cost/memory")
    for e in (*p.edges, *p.gated):
        if not (0 <= e.u < n and 0 <= e.v < n):
            raise ValueError(f"edge {e.u}->{e.v} out of range")
        ku, kv = len(p.node_cost[e.u]), len(p.node_cost[e.v])
        for m in (e.cost, e.memory or e.cost):
            if len(m) != ku or any(len(r) != kv for r in m):
                raise ValueError(f"edge {e.u}->{e.v}: cost/memory matrix is not {ku}x{kv}")
            if _nan_or_minus_inf(m):
                raise ValueError(f"edge {e.u}->{e.v}: NaN or -inf cost/memory")
        if e.memory is not None and _infinite(e.memory):
            raise ValueError(f"edge {e.u}->{e.v}: inf memory (forbid pairs by an inf cost)")
    for g in p.gated:
        if not (0 <= g.w < n and 0 <= g.choice < len(p.node_cost[g.w])):
            raise ValueError(f"gated edge {g.u}->{g.v}: gate {g.w}={g.choice} out of range")
        mats = (g.cost, g.memory or ())
        if any(min(r) < 0 for m in mats for r in m) or any(_infinite(m) for m in mats):
            raise ValueError(f"gated edge {g.u}->{g.v}: costs and memories must be finite, >= 0")


def _nan_or_minus_inf(rows) -> bool:
    """Whether a row holds a NaN or -inf. A row's sum (C speed) is NaN or -inf whenever it
    does, so only those rows are read entry by entry."""
    for r in rows:
        total = sum(r)
        if (total != total or total == -math.inf) and any(
            math.isnan(x) or x == -math.inf for x in r
        ):
            return True
    return False


def _infinite(rows) -> bool:
    """Whether a row holds an infinity (its sum is then not finite)."""
    return any(not math.isfinite(sum(r)) and any(math.isinf(x) for x in r) for r in rows)


def _merge_edges(edges, cost: Matrix, mem: Matrix) -> tuple[dict, dict]:
    """Self edges go to the node cost (memory) diagonal; parallel edges are summed, u < v."""
    pairs: dict[tuple[int, int], Matrix] = {}
    pair_mem: dict[tuple[int, int], Matrix] = {}
    for e in edges:
        em = e.memory or [[0.0] * len(r) for r in e.cost]
        if e.u == e.v:
            for a in range(len(cost[e.u])):
                cost[e.u][a] += e.cost[a][a]
                mem[e.u][a] += em[a][a]
            continue
        key = (min(e.u, e.v), max(e.u, e.v))
        for acc, x in ((pairs, e.cost), (pair_mem, em)):
            m = [list(r) for r in x] if e.u < e.v else [list(c) for c in zip(*x, strict=True)]
            if key not in acc:
                acc[key] = m
                continue
            for a, row in enumerate(m):
                for b, y in enumerate(row):
                    acc[key][a][b] += y
    return pairs, pair_mem


def _fold_fixed_edges(red: _Reduced) -> None:
    """Fold edges with a fixed endpoint into the other endpoint until nothing changes."""
    changed = True
    while changed:
        changed = False
        for (u, v), m in list(red.pairs.items()):
            mm = red.pair_mem[(u, v)]
            if red.fixed(u):
                tgt, vec, mvec = v, m[red.allowed[u][0]], mm[red.allowed[u][0]]
            elif red.fixed(v):
                b, tgt = red.allowed[v][0], u
                vec, mvec = [row[b] for row in m], [row[b] for row in mm]
            else:
                continue
            del red.pairs[(u, v)], red.pair_mem[(u, v)]
            for k in red.allowed[tgt]:
                red.cost[tgt][k] += vec[k]
                red.mem[tgt][k] += mvec[k]
            red.allowed[tgt] = [k for k in red.allowed[tgt] if math.isfinite(red.cost[tgt][k])]
            if not red.allowed[tgt]:
                raise ValueError(f"decision {tgt}: every choice is forbidden")
            changed = True


def _separable(m: Matrix, au: list[int], av: list[int]) -> bool:
    vals = [m[a][b] for a in au for b in av]
    if not all(math.isfinite(x) for x in vals):
        return False
    a0, b0 = au[0], av[0]
    tol = _SEP_TOL * max(1e-30, max(abs(x) for x in vals))
    return all(abs(m[a][b] - (m[a][b0] - m[a0][b0]) - m[a0][b]) <= tol for a in au for b in av)


def _fold_separable(red: _Reduced) -> None:
    """Fold edges with C[a][b] = r[a] + c[b] (over allowed choices, the memory matrix
    likewise) into node costs and memories."""
    for (u, v), m in list(red.pairs.items()):
        au, av = red.allowed[u], red.allowed[v]
        mm = red.pair_mem[(u, v)]
        if not (_separable(m, au, av) and _separable(mm, au, av)):
            continue
        del red.pairs[(u, v)], red.pair_mem[(u, v)]
        a0, b0 = au[0], av[0]
        for node, x in ((red.cost, m), (red.mem, mm)):
            for a in au:
                node[u][a] += x[a][b0] - x[a0][b0]
            for b in av:
                node[v][b] += x[a0][b]


def _open_gates(p: IntraOpProblem) -> tuple[list, list[GatedEdge]]:
    """Gated edges whose gate has one allowed choice become edges (or vanish)."""
    edges, gated = list(p.edges), []
    for g in p.gated:
        ok = [
            k
            for k, x in enumerate(p.node_cost[g.w])
            if math.isfinite(x) and math.isfinite(p.node_memory[g.w][k])
        ]
        if len(ok) > 1:
            gated.append(g)
        elif ok == [g.choice]:
            edges.append(Edge(g.u, g.v, g.cost, g.memory))
    return edges, gated


def _fold_gates(red: _Reduced, gated: list[GatedEdge], blocks: bool) -> None:
    """Resolve fixed literals; one free literal left is a node term, more are a `z`; with
    `blocks`, a gated edge between a pair with `e` variables and a free gate is a block."""
    for g in gated:
        if blocks and _block(red, g):
            continue
        for a in red.allowed[g.u]:
            for b in red.allowed[g.v]:
                c, m = g.cost[a][b], (g.memory[a][b] if g.memory is not None else 0.0)
                lits = {(g.u, a), (g.v, b), (g.w, g.choice)}
                if (c == 0 and m == 0) or len({d for d, _ in lits}) < len(lits):
                    continue  # nothing to add, or one decision with two choices
                if any(k not in red.allowed[d] for d, k in lits):
                    continue
                free = tuple(sorted(x for x in lits if not red.fixed(x[0])))
                if len(free) <= 1:
                    d, k = free[0] if free else (g.w, g.choice)
                    red.cost[d][k] += c
                    red.mem[d][k] += m
                else:
                    acc = red.gates.setdefault(free, [0.0, 0.0])
                    acc[0] += c
                    acc[1] += m


def _block(red: _Reduced, g: GatedEdge) -> bool:
    """Add `g` to its (u, v, w, c) block when u, v and w are three free decisions and
    (u, v) keeps its `e` variables; False otherwise."""
    u, v, w = min(g.u, g.v), max(g.u, g.v), g.w
    if len({u, v, w}) < 3 or any(red.fixed(d) for d in (u, v, w)) or (u, v) not in red.pairs:
        return False
    if g.choice not in red.allowed[w]:
        return True  # never counts
    flip = g.u > g.v
    for which, m in enumerate((g.cost, g.memory)):
        if m is None:
            continue
        rows = [list(c) for c in zip(*m, strict=True)] if flip else m
        acc = red.blocks.setdefault((u, v, w, g.choice), (_zeros(rows), _zeros(rows)))[which]
        for a, row in enumerate(rows):
            for b, x in enumerate(row):
                acc[a][b] += x
    return True


def _zeros(m) -> Matrix:
    return [[0.0] * len(r) for r in m]


def _reduce(p: IntraOpProblem, *, blocks: bool = True) -> _Reduced:
    _validate(p)
    cost = [list(c) for c in p.node_cost]
    mem = [list(m) for m in p.node_memory]
    edges, gated = _open_gates(p)
    pairs, pair_mem = _merge_edges(edges, cost, mem)
    allowed = []
    for i, c in enumerate(cost):
        ks = [k for k, x in enumerate(c) if math.isfinite(x) and math.isfinite(mem[i][k])]
        if not ks:
            raise ValueError(f"decision {i}: every choice is forbidden")
        allowed.append(ks)
    red = _Reduced(cost, mem, allowed, pairs, pair_mem)
    _fold_fixed_edges(red)
    _fold_separable(red)
    _fold_gates(red, gated, blocks)
    return red

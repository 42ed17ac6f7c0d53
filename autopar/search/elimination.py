"""The intra-op problem by variable elimination (min-sum bucket elimination: dynamic
programming over the decisions' interaction graph), with the memory row relaxed into the
objective (Lagrangian relaxation, ``cost + lam * memory``).

A sharding problem's graph is nearly a chain: a block's decisions talk to their neighbours
along the residual stream and the attention / MLP branches, plus one gate (a layer's
recompute or reshard decision) on the blocks' three-way terms. Eliminated in a greedy
order (`elimination_order`), a Llama-3-8B template's buckets hold ~5M entries in all (the
widest ~0.8M) and one elimination of a hub's branch takes ~0.02 s of numpy, where HiGHS's
LP relaxation of the same problem (~40k variables: one per pair of choices on each edge)
takes ~0.6 s and a MIP 2-4 s.

`settle` answers what it can prove and narrows the rest for the MIP (`ilp.solve_intra_op`):

1. The least-cost assignment (lam = 0), then the least ``cost + eps * memory`` (the same
   cost, ties broken towards less memory): one that fits the limit is the optimum.
2. Otherwise the Lagrangian dual: for every lam, ``L(lam) = min cost + lam * (memory -
   limit)`` is a lower bound on the optimum; a cutting-plane walk over lam (`_walk`) keeps
   the best bound and the best fitting assignment seen (an upper bound). Within the MIP's
   gap of each other, that assignment is the optimum.
3. Otherwise each choice's min-marginal at the best lam (the least Lagrangian value of an
   assignment that takes it: one pass up, `_eliminate`, and one down, `_outside`) less
   ``lam * limit`` bounds every fitting assignment that takes it; a choice whose bound
   exceeds the best answer known cannot improve on it and is forbidden (Lagrangian
   variable fixing), and the MIP solves what is left (the best answer known is in it).

Where one decision gates the blocks (the hub: a layer's lever), steps 1-3 run on each of
its choices apart (`_Factors.fixing`), the bounds and answers taken over all of them; a
choice whose every cost is at least an earlier one's is not eliminated where its every
memory is too, or where the earlier one's least cost is an answer's or more (`_covering`).

Every term of the reduced problem (`ilp_problem._Reduced`) is a factor: a node's row, a
pair's matrix (inf cost forbids a pair), a block's matrix on its gate's choice, a gate's
product of literals; each over the allowed choices of its decisions, cost and memory apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.search.elimination_order import Scope, order_of
from autopar.search.ilp_problem import IntraOpProblem, _Reduced, evaluate

_TIE_WEIGHT = 1e-9  # eps: a memory limit's worth of bytes costs this much of the cost above
# its floor (the least of every factor), so ties break towards less memory
_WALK_STEPS = 12  # elimination passes of the cutting-plane walk at most
_BY_CHOICE = 4096  # separators of at least this many entries are minimised choice by choice


@dataclass(slots=True)
class Settled:
    """`settle`'s answer: `choices` (one per decision) is the optimum when `optimal`;
    otherwise the best fitting assignment found (or None) and, per free decision, the
    choices that can still beat it (`keep`; None: all)."""

    choices: tuple[int, ...] | None
    optimal: bool
    keep: dict[int, list[int]] | None = None


@dataclass(slots=True)
class _Factors:
    cost: dict[Scope, np.ndarray]
    memory: dict[Scope, np.ndarray]
    sizes: dict[int, int]  # free decision -> allowed choices
    fixed: tuple[float, float]  # (cost, memory) of the decisions with one allowed choice

    def at(self, lam: float) -> dict[Scope, np.ndarray]:
        if not lam:
            return dict(self.cost)
        return {s: c + lam * self.memory[s] for s, c in self.cost.items()}

    def fixing(self, i: int, pos: int) -> _Factors:
        """These factors with decision `i` at its choice of position `pos`: each factor
        holding it sliced there (one of no other decision joins the constants)."""
        cost: dict[Scope, np.ndarray] = {}
        memory: dict[Scope, np.ndarray] = {}
        fixed = list(self.fixed)
        for scope, c in self.cost.items():
            m = self.memory[scope]
            if i in scope:
                axis = scope.index(i)
                scope = scope[:axis] + scope[axis + 1 :]
                c, m = c.take(pos, axis=axis), m.take(pos, axis=axis)
            if not scope:
                fixed[0] += float(c)
                fixed[1] += float(m)
            elif scope in cost:
                cost[scope], memory[scope] = cost[scope] + c, memory[scope] + m
            else:
                cost[scope], memory[scope] = c, m
        sizes = {d: k for d, k in self.sizes.items() if d != i}
        return _Factors(cost, memory, sizes, (fixed[0], fixed[1]))

    def least_memory(self) -> float:
        """A lower bound on the memory of any assignment."""
        return self.fixed[1] + math.fsum(float(np.min(m)) for m in self.memory.values())


@dataclass(slots=True)
class _Branch:
    """One restriction of the problem (all of it, or its hub at one choice), bounded:
    `bound` <= its optimum <= the cost of `best` (cost, memory, choices; None: no fitting
    answer found); `lam` the multiplier of `bound`."""

    fs: _Factors
    order: list[int]
    pinned: dict[int, int]  # free decisions fixed in this branch -> their position
    floor: float  # the least of every factor: no assignment costs less
    lam: float = 0.0
    bound: float = -math.inf
    best: tuple | None = None
    covered: bool = False  # another branch holds, per assignment, one no dearer nor larger


def settle(p: IntraOpProblem, red: _Reduced, rel_gap: float) -> Settled | None:
    """See the module docstring; `red` is `p` reduced. Where one decision (the hub: a
    layer's lever) gates the blocks' three-way terms, each of its choices is a branch of
    its own: fixing it turns the gated terms into plain ones and, as it moves much of the
    memory, makes each branch's Lagrangian bound far tighter (a GPT-3 stage ILP: 15% under
    the optimum whole, 5e-6 by branches, most of which fit nothing). None when a branch's
    buckets are too large (`elimination_order`)."""
    hub = _hub(red)
    whole = _factors(red)
    if hub is None:
        restricted = [({}, whole)]
    else:  # the branches whose least memory may fit
        restricted = _fixing({}, whole, hub, p.memory_limit)
    if restricted and order_of(restricted[0][1]) is None and (star := _star(restricted[0][1])):
        restricted = [b for pin, fs in restricted for b in _fixing(pin, fs, star, p.memory_limit)]
    # a branch whose bound passes the best answer of those before it stops its walk: it
    # holds nothing better, and the answer (and what variable fixing keeps) is the same
    floor = min((_floor(fs) for _, fs in restricted), default=math.inf)
    branches: list[_Branch] = []
    for pinned, fs in restricted:
        answer = min((b.best[0] for b in branches if b.best is not None), default=math.inf)
        covering = _covering(fs, branches, answer)
        if covering is not None:  # it holds nothing better: not eliminated
            under, entirely = covering
            order = order_of(fs)  # for `_keep`, where it is not covered entirely
            b = None if order is None else _Branch(fs, order, pinned, _floor(fs))
            if b is not None:
                b.bound, b.covered = under.bound, entirely
        else:
            b = _bounded(p, red, fs, pinned, rel_gap, _upper(answer, floor))
        if b is None:
            return None
        branches.append(b)
    fitting = [b for b in branches if b.best is not None]
    if not fitting:
        return Settled(None, False)
    best = min(fitting, key=lambda b: b.best[0]).best
    bound = min(b.bound for b in branches)
    if _proven(best[0], bound, floor, rel_gap):
        return Settled(best[2], True)
    upper = _upper(best[0], floor)
    keep: dict[int, set[int]] = {}
    for b in branches:
        if b.bound > upper or b.covered:
            continue  # nothing in it beats the best answer, or another branch's
        kept = _keep(b.fs, b.order, b.lam, p.memory_limit, upper)
        kept.update({i: [n] for i, n in b.pinned.items()})
        for i, ns in kept.items():
            keep.setdefault(i, set()).update(red.allowed[i][n] for n in ns)
    return Settled(best[2], False, {i: sorted(ks) for i, ks in keep.items()})


def _upper(cost: float, floor: float) -> float:
    """What an answer of `cost` leaves for variable fixing to keep: `cost`, plus rounding."""
    return cost + 1e-9 * (cost - floor) + 1e-12 * abs(cost)


def _floor(fs: _Factors) -> float:
    """The least of every factor: no assignment of `fs` costs less."""
    return fs.fixed[0] + math.fsum(float(np.min(c)) for c in fs.cost.values())


def _proven(cost: float, bound: float, floor: float, rel_gap: float) -> bool:
    """`cost` within the MIP's gap of `bound`, relative to the cost above the floor (as
    the MIP's objective is shifted, `ilp_model._set_objective`), plus rounding."""
    return cost - bound <= rel_gap * (cost - floor) + 1e-13 * abs(cost)


def _fixing(pinned: dict[int, int], fs: _Factors, i: int, limit: float) -> list:
    """(pinned, factors) with decision `i` fixed at each of its choices, where the least
    memory may fit."""
    fixed = [({**pinned, i: n}, fs.fixing(i, n)) for n in range(fs.sizes[i])]
    return [(pin, f) for pin, f in fixed if f.least_memory() <= limit]


def _star(fs: _Factors) -> int | None:
    """The free decision of the most neighbours (at most 8 choices), where buckets
    eliminating around it pass the caps: a value every layer reads (Hugging Face's rotary
    cos / sin: 71 neighbours in Qwen3-8B's template, whose buckets then hold 70M entries
    in the best order found, 23M with it fixed), each of whose choices is a branch."""
    degree: dict[int, set[int]] = {i: set() for i in fs.sizes}
    for scope in fs.cost:
        for i in scope:
            degree[i].update(scope)
    few = [i for i in fs.sizes if fs.sizes[i] <= 8]
    return max(few, key=lambda i: (len(degree[i]), -i)) if few else None


def _hub(red: _Reduced) -> int | None:
    """The free decision that gates the most blocks (at most 8 choices), or None."""
    gates: dict[int, int] = {}
    for _, _, w, _ in red.blocks:
        gates[w] = gates.get(w, 0) + 1
    hubs = [w for w in gates if len(red.allowed[w]) <= 8]
    return max(hubs, key=lambda w: (gates[w], -w)) if hubs else None


def _bounded(
    p: IntraOpProblem,
    red: _Reduced,
    fs: _Factors,
    pinned: dict[int, int],
    rel_gap: float,
    beaten: float = math.inf,
) -> _Branch | None:
    """Steps 1-2 of the module docstring on one branch: `fs`, the factors with the free
    decisions of `pinned` fixed at those positions (None: a bucket too large); its walk
    stops once its bound passes `beaten` (it can hold no answer below it), and does not
    start where its floor already does."""
    order = order_of(fs)
    if order is None:
        return None
    limit = p.memory_limit
    floor = _floor(fs)
    branch = _Branch(fs, order, pinned, floor)
    if floor > beaten:  # even the least of every factor cannot beat an earlier answer
        branch.bound = floor
        return branch

    def run(lam: float):
        steps, _ = _eliminate(fs.at(lam), fs.sizes, order, keep_buckets=False)
        if steps is None:
            return None
        choices = _choices(red, {**_back(steps), **pinned})
        return (*evaluate(p, choices), choices)

    first = run(0.0)
    if first is None or not math.isfinite(first[0]):
        branch.bound = math.inf  # no allowed assignment
        return branch
    branch.bound = first[0]
    if first[1] <= limit:
        branch.best = first
        return branch
    if first[0] > beaten:
        return branch
    tied = run(_TIE_WEIGHT * max(first[0] - floor, 1e-30) / max(abs(limit), 1.0))
    fits = tied if tied is not None and tied[1] <= limit else None
    if fits is not None and _proven(tied[0], first[0], floor, rel_gap):
        branch.best = tied
        return branch
    branch.lam, branch.bound, branch.best = _walk(run, limit, first, fits, beaten)
    return branch


def _covering(fs: _Factors, branches: list[_Branch], answer: float):
    """(b, entirely): an earlier branch `b` whose every cost is at most `fs`'s at the same
    choices (a layer's lever that adds work, never saves it), and whether it covers `fs`
    entirely: every memory at most `fs`'s too (each assignment of `fs` has one in `b` no
    dearer and no larger, so none of `fs`'s choices need be kept). Otherwise `b.bound`
    must be its least cost (lam 0) and no less than the best `answer`: `fs` holds nothing
    cheaper. None where no branch covers `fs`."""
    for b in branches:
        if not _at_least(fs, b.fs, 0):
            continue
        if _at_least(fs, b.fs, 1):
            return b, True
        if not b.lam and b.bound >= answer:
            return b, False
    return None


def _at_least(fs: _Factors, other: _Factors, memory: int) -> bool:
    """Whether every cost (`memory` 0) or memory (1) of `fs` is at least `other`'s at the
    same choices."""
    mine, theirs = (fs.memory, other.memory) if memory else (fs.cost, other.cost)
    if mine.keys() != theirs.keys() or fs.fixed[memory] < other.fixed[memory]:
        return False
    return all(x is (y := theirs[s]) or bool(np.all(x >= y)) for s, x in mine.items())


def _choices(red: _Reduced, pos: dict[int, int]) -> tuple[int, ...]:
    out = [ks[0] for ks in red.allowed]
    for i, p in pos.items():
        out[i] = red.allowed[i][p]
    return tuple(out)


def _walk(run, limit: float, first, best=None, beaten: float = math.inf):
    """The cutting-plane walk over lam from `first` (lam = 0, not fitting): lam grows
    10x until an assignment fits, then each next lam is where the lines of the last
    fitting and the last unfitting answers cross, until the bound passes `beaten`.
    Returns (best lam, its bound, the best fitting (cost, memory, choices), `best` if none
    beats it, or None)."""
    lo, lam = first, max(abs(first[0]), 1e-30) / max(first[1], 1.0) * 1e-3
    best_lam, best_bound, steps = 0.0, first[0], 0  # L(0): the least cost
    hi = None
    while steps < _WALK_STEPS:
        got = run(lam)
        steps += 1
        if got is None:
            break
        cost, memory, _ = got
        value = cost + lam * (memory - limit)
        if value > best_bound:
            best_lam, best_bound = lam, value
        if best_bound > beaten:
            break
        if memory <= limit and (best is None or cost < best[0]):
            best = got
        if hi is None:
            if memory <= limit:
                hi = got
            else:
                lo, lam = got, lam * 10
                continue
        else:
            line = lo[0] + lam * (lo[1] - limit)
            if value >= line - 1e-12 * abs(line):
                break  # the lines' crossing is the dual's top
            if memory <= limit:
                hi = got
            else:
                lo = got
        if lo[1] <= hi[1]:
            break
        lam = (hi[0] - lo[0]) / (lo[1] - hi[1])
    return best_lam, best_bound, best


def _keep(
    fs: _Factors, order: list[int], lam: float, limit: float, upper: float
) -> dict[int, list[int]]:
    """Per free decision, the positions of the choices whose Lagrangian min-marginal less
    lam * limit is at most `upper`."""
    _, buckets = _eliminate(fs.at(lam), fs.sizes, order, keep_buckets=True)
    outside = _outside(buckets, order, fs.sizes)
    constant = fs.fixed[0] + lam * fs.fixed[1]
    keep: dict[int, list[int]] = {}
    for x in order:
        scope, rest, _, total = buckets[x]
        whole = total + _broadcast(outside[x], rest, scope)
        axes = tuple(a for a, d in enumerate(scope) if d != x)
        marginal = np.min(whole, axis=axes) if axes else whole
        keep[x] = np.flatnonzero(marginal + constant - lam * limit <= upper).tolist()
    return keep


def _factors(red: _Reduced) -> _Factors:
    """Every term as arrays over the allowed choices of its free decisions, terms of one
    scope summed."""
    free = [i for i, ks in enumerate(red.allowed) if len(ks) > 1]
    pos = {i: {k: n for n, k in enumerate(red.allowed[i])} for i in free}
    cost: dict[Scope, np.ndarray] = {}
    memory: dict[Scope, np.ndarray] = {}

    def add(scope: Scope, c: np.ndarray, m: np.ndarray) -> None:
        order = sorted(range(len(scope)), key=scope.__getitem__)
        key = tuple(scope[j] for j in order)
        c, m = c.transpose(order), m.transpose(order)
        cost[key] = cost[key] + c if key in cost else c
        memory[key] = memory[key] + m if key in memory else m

    for i in free:
        ks = red.allowed[i]
        add((i,), np.array(red.cost[i])[ks], np.array(red.mem[i])[ks])
    for (u, v), m in red.pairs.items():
        at = np.ix_(red.allowed[u], red.allowed[v])
        add((u, v), np.array(m)[at], np.array(red.pair_mem[u, v])[at])
    for (u, v, w, c), (g, gm) in red.blocks.items():
        at, shape = np.ix_(red.allowed[u], red.allowed[v]), (len(pos[u]), len(pos[v]), len(pos[w]))
        gc, gmem = np.zeros(shape), np.zeros(shape)
        gc[:, :, pos[w][c]], gmem[:, :, pos[w][c]] = np.array(g)[at], np.array(gm)[at]
        add((u, v, w), gc, gmem)
    for lits, (c, m) in red.gates.items():
        scope = tuple(d for d, _ in lits)
        shape = tuple(len(pos[d]) for d in scope)
        gc, gmem = np.zeros(shape), np.zeros(shape)
        at = tuple(pos[d][k] for d, k in lits)
        gc[at], gmem[at] = c, m
        add(scope, gc, gmem)
    fixed = [(i, ks[0]) for i, ks in enumerate(red.allowed) if len(ks) == 1]
    constants = (
        math.fsum(red.cost[i][k] for i, k in fixed),
        math.fsum(red.mem[i][k] for i, k in fixed),
    )
    return _Factors(cost, memory, {i: len(red.allowed[i]) for i in free}, constants)


def _eliminate(
    factors: dict[Scope, np.ndarray], sizes: dict[int, int], order: list[int], keep_buckets: bool
):
    """Each decision of `order` minimised out in turn. Returns (steps, buckets): a step is
    (decision, its separator, the argmin table over the separator); a bucket (kept on
    request) is (scope, separator, [(factor scope, values, the decision whose message it
    is, or None)], their sum over scope); a step of a large separator holds, instead of its
    argmin table, the factors it summed (`_least_by_choice`). Steps is None when no
    assignment is allowed."""
    pending = [(s, v, None) for s, v in factors.items()]
    steps, buckets = [], {}
    for i in order:
        held = [f for f in pending if i in f[0]]
        pending = [f for f in pending if i not in f[0]]
        scope = tuple(sorted({d for s, _, _ in held for d in s}))
        axis = scope.index(i)
        rest = scope[:axis] + scope[axis + 1 :]
        if keep_buckets or math.prod(sizes[d] for d in rest) < _BY_CHOICE:
            total = np.zeros([sizes[d] for d in scope])
            for s, v, _ in held:  # summed in place: a bucket is up to MAX_BUCKET entries
                total += _broadcast(v, s, scope)
            argmin, message = total.argmin(axis=axis), total.min(axis=axis)  # the same values
            if keep_buckets:
                buckets[i] = (scope, rest, held, total)
        else:  # the argmin is read when backtracking, from the held factors
            argmin, message = held, _least_by_choice(held, i, rest, sizes)
        steps.append((i, rest, argmin))
        if not rest and not np.isfinite(message):
            return None, buckets
        pending.append((rest, message, i))
    return steps, buckets


def _least_by_choice(held: list, i: int, rest: Scope, sizes: dict[int, int]) -> np.ndarray:
    """The least over decision `i` of the sum of the `held` factors (each holds `i`), over
    `rest`: the sum at each of `i`'s choices in turn, its minimum with the least so far.
    The same numbers as summing the whole bucket (each entry's terms added in the same
    order) without its argmin across a middle axis, which numpy copies; the argmin is read
    where backtracking needs it, at one entry (`_first_least`). ~40% less time on a large
    bucket."""
    parts = [  # i's axis last, unit axes for the decisions of `rest` a factor lacks
        _broadcast(np.moveaxis(v, s.index(i), -1), (*(d for d in s if d != i), i), (*rest, i))
        for s, v, _ in held
    ]
    shape = [sizes[d] for d in rest]
    least, acc = np.empty(shape), np.empty(shape)
    for c in range(sizes[i]):
        into = least if c == 0 else acc
        if len(parts) == 1:
            into[...] = parts[0][..., c]
        else:
            np.add(parts[0][..., c], parts[1][..., c], out=into)
            for v in parts[2:]:
                into += v[..., c]
        if c:
            np.minimum(least, acc, out=least)
    return least


def _first_least(held: list, i: int, pos: dict[int, int]) -> int:
    """The first choice of `i` whose sum of the `held` factors, at the positions `pos` of
    the other decisions, is the least (`np.argmin` of the bucket's entries there)."""
    scope, values, _ = held[0]
    best, arg = math.inf, 0
    for c in range(values.shape[scope.index(i)]):
        total = 0.0
        for s, v, _ in held:
            total += float(v[tuple(c if d == i else pos[d] for d in s)])
        if total < best:
            best, arg = total, c
    return arg


def _back(steps) -> dict[int, int]:
    """The argmin tables (or the held factors, `_least_by_choice`) read from the last
    eliminated decision back to the first."""
    pos: dict[int, int] = {}
    for i, rest, argmin in reversed(steps):
        if isinstance(argmin, list):
            pos[i] = _first_least(argmin, i, pos)
        else:
            pos[i] = int(argmin[tuple(pos[d] for d in rest)])
    return pos


def _outside(buckets: dict, order: list[int], sizes: dict[int, int]) -> dict[int, np.ndarray]:
    """Per decision, over its separator: the least of every factor outside its subtree
    (the downward pass; a root's outside is the other components' least)."""
    parent = {child: x for x in order for _, _, child in buckets[x][2] if child is not None}
    roots = {x: float(np.min(buckets[x][3])) for x in order if x not in parent}
    everything = math.fsum(roots.values())
    out: dict[int, np.ndarray] = {}
    for x in reversed(order):
        rest = buckets[x][1]
        if x in roots:
            out[x] = np.array(everything - roots[x])
            continue
        scope, prest, held, _ = buckets[parent[x]]
        acc = sum(_broadcast(v, s, scope) for s, v, child in held if child != x)
        acc = acc + _broadcast(out[parent[x]], prest, scope)
        acc = np.broadcast_to(acc, [sizes[d] for d in scope])
        axes = tuple(a for a, d in enumerate(scope) if d not in rest)
        least = np.min(acc, axis=axes) if axes else acc
        kept = [d for d in scope if d in rest]
        out[x] = np.transpose(least, [kept.index(d) for d in rest])
    return out


def _broadcast(values: np.ndarray, scope: Scope, into: Scope) -> np.ndarray:
    """`values` (axes `scope`) with unit axes for the decisions of `into` it lacks."""
    shape = [1] * len(into)
    for axis, d in zip(values.shape, scope, strict=True):
        shape[into.index(d)] = axis
    return np.reshape(values, shape)

"""Memory levers as ILP decisions: activation checkpointing and FSDP's reshard after forward.

`add_levers(dec, rep, index, strats, ctx, problem, recompute=, reshard=) -> (problem, Levers)`
appends one decision per *canonical* layer C (the layer whose node decisions repeated
layers share, `intra_op.share_layers`; a layer shares its levers as it shares its sharding):

    D_C in CHOICES = (policy, reshard) for policy in ("none", "selective", "full"),
                     reshard in (False, True)

A pin gives the other choices an infinite cost (the ILP fixes the decision and folds its
terms away: with "none" / False every term below is 0 or absent, and the objective is
today's, exactly). Under "auto", (full, True) is left out: full recompute re-runs the
layer's collectives, weight all-gathers included, so it reshards anyway and prices as
(full, False). Terms, per node n of layer L (canonical C), strategy s, weight
w = CostWeights.of(n), activation weight w_a = w * CostWeights.activation:

Recompute (an `Edge` between n's decision and D_C, cost and memory matrices):
    n is recomputed under policy P iff `recomputed(P, n.target)` and n is not a *region
    output* (no user outside L reads it, directly or through views/getitems): a region
    output is what the next layer (or the head) reads, so it is kept whatever L's policy,
    which is also how "full keeps the layer's inputs" is counted (once, at its producer).
    recomputed n:  time   + w * forward_time(n, s)        (forward compute again)
                   memory - w_a * activation bytes(n, s)   (not saved)
                          + activation bytes(n, s)  if L == C  (working set: while one
                            layer recomputes, its recomputed outputs are live again; counted
                            once, for the canonical instance, unweighted)
Full recompute re-runs the layer's collectives (`GatedEdge`s on D_C's "full" choices):
every non-weight operand edge into a recomputed node of L costs w * its forward
redistribution again (weight gathers are priced below).

Gathered weights (an FSDP weight, or any weight redistributed at its use): the edge from a
weight (`CostContext.is_weight`) to a consumer v that saves it for backward (every op but
the embedding lookup) with a forward redistribution t > 0 materializes the consumer-side
copy, g = local bytes of the weight under v's input spec. The copy is *regathered* when L
reshards or recomputes fully:
    v outside any layer:       memory + w * g                   (kept until backward)
    v in L, not regathered:    memory + w * g                   (`GatedEdge`s on D_C)
    v in L, regathered:        time + w * t  (all-gathered again for backward)
                               memory + g if L == C  (one layer's gathered copy, working set)
The re-gather's time is a weight edge's gather: `comm_scale[0]` multiplies it as
`intra_op.price` scales the weight edges' gathers (the candidates `intra_op.solve_intra`
ranks by the overlapped step). `add_levers_at_scales(..., [(problem, comm_scale), ...])` does
this for the problems of one set of decisions at several scales, the terms priced once.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.capture.export import layer_of
from autopar.capture.recompute_policy import recomputed
from autopar.cost_models import memory
from autopar.plan import RECOMPUTE_POLICIES
from autopar.search.costs import VIEW_OPS, CostContext
from autopar.search.ilp import Edge, GatedEdge, IntraOpProblem

aten = torch.ops.aten
CHOICES: tuple[tuple[str, bool], ...] = tuple(
    (policy, raf) for policy in RECOMPUTE_POLICIES for raf in (False, True)
)
# consumers that do not save a (gathered) weight for backward
WEIGHT_NOT_SAVED = frozenset({aten.embedding.default})
Matrix = list[list[float]]


@dataclass
class Levers:
    """Where the lever decisions are in the ILP and what they mean."""

    canonical: dict[str, str]  # layer -> the layer whose decisions it shares
    decision: dict[str, int]  # canonical layer -> ILP decision, choices CHOICES
    region_outputs: set[fx.Node] = field(default_factory=set)

    def policies(self, choices) -> dict[str, str]:
        """Layer -> recompute policy, for every layer."""
        return {L: CHOICES[choices[self.decision[c]]][0] for L, c in self.canonical.items()}

    def reshards(self, choices) -> dict[str, bool]:
        return {L: CHOICES[choices[self.decision[c]]][1] for L, c in self.canonical.items()}

    def is_recomputed(self, n: fx.Node, policies: dict[str, str]) -> bool:
        layer = layer_of(n)
        if layer is None or n.op != "call_function" or n in self.region_outputs:
            return False
        return recomputed(policies.get(layer, "none"), n.target)


def _pin_row(recompute: str, reshard: bool | str) -> tuple[float, ...]:
    def allowed(policy: str, raf: bool) -> bool:
        if reshard == "auto" and policy == "full" and raf:
            return False  # prices as (full, False): left out
        return recompute in ("auto", policy) and (reshard == "auto" or bool(reshard) == raf)

    if recompute not in ("auto", *RECOMPUTE_POLICIES) or reshard not in ("auto", True, False):
        raise ValueError(
            f"activation_checkpointing={recompute!r}, reshard_after_forward={reshard!r}: "
            f"give 'auto' or one of {RECOMPUTE_POLICIES}, and 'auto', True or False"
        )

    return tuple(0.0 if allowed(p, r) else float("inf") for p, r in CHOICES)


def _regathered(choice: tuple[str, bool]) -> bool:
    return choice[1] or choice[0] == "full"


def canonical_layers(dec, rep: list[int]) -> dict[str, str]:
    """Layer -> the layer of the decisions its first decision shares (itself if none)."""
    out: dict[str, str] = {}
    for d, item in enumerate(dec.items):
        layer = layer_of(item.members[0][0])
        if layer is not None and layer not in out:
            out[layer] = layer_of(dec.items[rep[d]].members[0][0]) or layer
    for item in dec.items:  # followers of another layer's decision
        for n, _ in item.members:
            layer = layer_of(n)
            if layer is not None:
                out.setdefault(layer, layer)
    return out


def region_outputs(nodes) -> set[fx.Node]:
    """Nodes of a layer read outside it (directly or through views and getitems)."""
    out = set()
    for n in nodes:
        layer = layer_of(n)
        if layer is None:
            continue
        todo, seen = list(n.users), set()
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            if layer_of(u) != layer:
                out.add(n)
                break
            if u.target in VIEW_OPS or u.target is operator.getitem:
                todo.extend(u.users)
    return out


class _Terms:
    """Accumulated edge and gated-edge matrices (keyed (u, v) and (u, v, w, choice)); an
    overlay of `base` (`over`) starts from copies of the base's matrices it is asked for."""

    def __init__(self, sizes: list[int], base: _Terms | None = None):
        self.sizes = sizes
        self.base = base
        self.terms: dict[tuple[int, ...], tuple[Matrix, Matrix]] = {}
        self._frozen: dict[tuple[int, ...], tuple | None] = {}  # `_freeze`'s, by key

    def over(self) -> _Terms:
        return _Terms(self.sizes, self)

    def at(self, key: tuple[int, ...]) -> tuple[Matrix, Matrix]:
        """The matrices of an edge (u, v) or a gated edge (u, v, w, choice)."""
        found = self.terms.get(key)
        if found is None:
            if self.base is not None and key in self.base.terms:
                c, m = self.base.terms[key]
                found = [r[:] for r in c], [r[:] for r in m]
            else:
                ku, kv = self.sizes[key[0]], self.sizes[key[1]]
                found = [[0.0] * kv for _ in range(ku)], [[0.0] * kv for _ in range(ku)]
            self.terms[key] = found
        return found

    def edge(self, u: int, v: int) -> tuple[Matrix, Matrix]:
        return self.at((u, v))

    def gate(self, u: int, v: int, w: int, choice: int) -> tuple[Matrix, Matrix]:
        return self.at((u, v, w, choice))

    def problem(self, p: IntraOpProblem, cost: list, mem: list) -> IntraOpProblem:
        """`p` with these terms' nonzero edges and gated edges appended (an overlay's: the
        base's in its order, each as changed here, then those only here)."""
        base = self.base or _Terms(self.sizes)
        keys = [*base.terms, *(k for k in self.terms if k not in base.terms)]
        made = [self._freeze(k) if k in self.terms else base._freeze(k) for k in keys]
        return IntraOpProblem(
            node_cost=tuple(cost),
            node_memory=tuple(mem),
            edges=(*p.edges, *(e for e in made if isinstance(e, Edge))),
            memory_limit=p.memory_limit,
            time_limit_s=p.time_limit_s,
            gated=(*p.gated, *(e for e in made if isinstance(e, GatedEdge))),
        )

    def _freeze(self, key: tuple[int, ...]) -> Edge | GatedEdge | None:
        """The term as the problem holds it (None where it is all zeros), made once."""
        if key not in self._frozen:
            c, m = self.terms[key]
            frozen = None
            if any(x for r in (*c, *m) for x in r):
                cost, mem = tuple(map(tuple, c)), tuple(map(tuple, m))
                frozen = Edge(*key, cost, mem) if len(key) == 2 else GatedEdge(*key, cost, mem)
            self._frozen[key] = frozen
        return self._frozen[key]


def add_levers(
    dec,
    rep: list[int],
    index: dict[int, int],
    strats,
    ctx: CostContext,
    problem: IntraOpProblem,
    *,
    recompute: str = "auto",
    reshard: bool | str = "auto",
    comm_scale: tuple[float, float] = (1.0, 1.0),
) -> tuple[IntraOpProblem, Levers]:
    """The problem with the lever decisions and terms appended (module docstring)."""
    [(out, lv)] = add_levers_at_scales(
        dec, rep, index, strats, ctx, [(problem, comm_scale)], recompute=recompute, reshard=reshard
    )
    return out, lv


def add_levers_at_scales(
    dec,
    rep: list[int],
    index: dict[int, int],
    strats,
    ctx: CostContext,
    problems: list[tuple[IntraOpProblem, tuple[float, float]]],
    *,
    recompute: str = "auto",
    reshard: bool | str = "auto",
) -> list[tuple[IntraOpProblem, Levers]]:
    """`add_levers` of each (problem, comm_scale) (problems of the same decisions, which
    differ in their edges): the terms are priced once and the gathers' scale applied per
    problem, in the order `add_levers` adds them alone, so each problem is the one it
    gives to the last bit (three weight-edge scales priced the recompute terms and every
    gathered weight three times: a third of `intra_op._build_problem`'s time)."""
    canon = canonical_layers(dec, rep)
    layers = list(dict.fromkeys(canon.values()))
    n0 = len(problems[0][0].node_cost)
    lv = Levers(
        canon,
        {c: n0 + i for i, c in enumerate(layers)},
        region_outputs(n for item in dec.items for n, _ in item.members),
    )
    pins = [_pin_row(recompute, reshard)] * len(layers)
    priced = _Terms([len(c) for c in (*problems[0][0].node_cost, *pins)])
    _price_recompute(dec, rep, index, strats, ctx, lv, priced)
    gathers = _weight_gathers(dec, rep, index, strats, ctx, lv)
    out = []
    for problem, comm_scale in problems:
        cost = [*problem.node_cost, *pins]
        mem = [*problem.node_memory, *[(0.0,) * len(CHOICES)] * len(layers)]
        terms = priced.over()  # the recompute terms made once, shared by every scale
        _add_gathers(gathers, terms, comm_scale[0])
        out.append((terms.problem(problem, cost, mem), lv))
    return out


def _price_recompute(dec, rep, index, strats, ctx: CostContext, lv: Levers, terms) -> None:
    every = dict.fromkeys(lv.canonical, "full")
    for d, item in enumerate(dec.items):
        i = index[rep[d]]
        for n, mapping in item.members:
            if not lv.is_recomputed(n, every):
                continue
            layer = layer_of(n)
            w, wa, once = ctx.weights.of(n), ctx.memory_weight(n), layer == lv.canonical[layer]
            r = lv.decision[lv.canonical[layer]]
            cost, mem = terms.edge(i, r)
            for c, j in enumerate(mapping):
                s = strats[n][j]
                t, b = w * ctx.forward_time(n, s), ctx.node_memory(n, s)
                for a, (policy, _) in enumerate(CHOICES):
                    if recomputed(policy, n.target):
                        cost[c][a] += t
                        mem[c][a] += -wa * b + (b if once else 0.0)
            if n is item.members[0][0]:
                _price_collectives(dec, rep, index, strats, ctx, d, r, terms)


def _price_collectives(dec, rep, index, strats, ctx: CostContext, d: int, r: int, terms) -> None:
    """Under "full", the head's non-weight input redistributions run again."""
    v_node, v_map = dec.items[d].members[0]
    v = index[rep[d]]
    for pos, op in ctx.operands(v_node):
        if ctx.is_weight(op.producer):
            continue
        du, map_u = dec.owner[op.producer]
        fulls = [k for k, (policy, _) in enumerate(CHOICES) if policy == "full"]
        gates = [terms.gate(index[rep[du]], v, r, k)[0] for k in fulls]
        srcs = [ctx.output_spec(op, strats[op.producer][ju]) for ju in map_u]
        ss = [strats[v_node][jv] for jv in v_map]
        w = ctx.weights.of(v_node)
        for cu, row in enumerate(ctx.edge_part_matrices(op, srcs, v_node, ss, pos)):
            for cv, (fwd, _) in enumerate(row):
                if fwd < float("inf"):  # an inf pair is forbidden by the plain edge
                    for cost in gates:
                        cost[cu][cv] += w * fwd


def _weight_gathers(dec, rep, index, strats, ctx: CostContext, lv: Levers) -> list[tuple]:
    """Gathered weight copies: kept until backward, or freed and gathered again. Per
    weight edge, in order: (the keys of the terms that keep the copy, of those that
    gather it again, and per pair of choices priced (cu, cv, w * g, w * t, g if the layer
    is canonical else 0)) for `_add_gathers`."""
    out = []
    for d, item in enumerate(dec.items):
        v_node, v_map = item.members[0]
        if v_node.target in WEIGHT_NOT_SAVED:
            continue
        v, layer, w = index[rep[d]], layer_of(v_node), ctx.weights.of(v_node)
        for pos, op in ctx.operands(v_node):
            if not ctx.is_weight(op.producer) or op.tensor is None:
                continue
            du, map_u = dec.owner[op.producer]
            u = index[rep[du]]
            if layer is None:
                kept, again = [(u, v)], []
            else:
                f = lv.decision[lv.canonical[layer]]
                kept = [(u, v, f, k) for k, c in enumerate(CHOICES) if not _regathered(c)]
                again = [(u, v, f, k) for k, c in enumerate(CHOICES) if _regathered(c)]
            once = layer is not None and layer == lv.canonical[layer]
            srcs = [ctx.output_spec(op, strats[op.producer][ju]) for ju in map_u]
            ss = [strats[v_node][jv] for jv in v_map]
            pairs = []
            for cu, row in enumerate(ctx.edge_part_matrices(op, srcs, v_node, ss, pos)):
                for cv, (fwd, _) in enumerate(row):
                    if not 0 < fwd < float("inf"):
                        continue
                    g = gathered_bytes(op, strats[v_node][v_map[cv]], pos, ctx)
                    pairs.append((cu, cv, w * g, w * fwd, g if once else 0.0))
            out.append((kept, again, pairs))
    return out


def _add_gathers(gathers: list[tuple], terms: _Terms, scale: float) -> None:
    """`_weight_gathers` added to `terms`, the gathers again priced at `scale`."""
    for kept_keys, again_keys, pairs in gathers:
        kept = [terms.at(key) for key in kept_keys]
        again = [terms.at(key) for key in again_keys]
        for cu, cv, wg, wt, g in pairs:
            for _, mem in kept:
                mem[cu][cv] += wg
            for cost, mem in again:
                cost[cu][cv] += wt * scale
                mem[cu][cv] += g


def gathered_bytes(op, s, pos: int, ctx: CostContext) -> float:
    """Local bytes of the weight `op` reads as input `pos` of a node running `s`."""
    val = op.tensor
    return float(
        memory.activation_bytes(val.shape, val.element_size(), s.inputs[pos], ctx.mesh_shape)
    )


def gathered_layers(result_chosen, priced, ctx: CostContext) -> set[str]:
    """Layers with a weight redistributed at a use that saves it (what F_C applies to)."""
    out: set[str] = set()
    for v in priced:
        layer = layer_of(v)
        if layer is None or v.target in WEIGHT_NOT_SAVED or v not in result_chosen:
            continue
        s = result_chosen[v]
        for pos, op in ctx.operands(v):
            if ctx.is_weight(op.producer) and op.tensor is not None:
                src = ctx.output_spec(op, result_chosen[op.producer])
                fwd, _ = ctx.edge_parts(op, src, v, s, pos)
                if 0 < fwd < float("inf"):
                    out.add(layer)
                    break
    return out


def layer_summary(levers: Levers, choices, chosen, priced, ctx) -> tuple[tuple, tuple, dict]:
    """(plan.memory.recompute, plan.memory.reshard_after_forward, layer -> policy)."""
    policies = levers.policies(choices)
    reshards = levers.reshards(choices)
    gathered = gathered_layers(chosen, priced, ctx)
    recompute = tuple((L, p) for L, p in policies.items() if p != "none")
    raf = tuple(L for L, on in reshards.items() if on and L in gathered)
    return recompute, raf, policies

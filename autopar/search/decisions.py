"""The intra-op ILP's decisions: which nodes choose a strategy, and which share a choice.

`build_decisions(gm, strats, ctx) -> Decisions`: one *decision* per node, except
*followers*: a node with one tensor operand (`autopar.capture.operands`) which has, for
every choice of that operand's producer, a strategy taking the operand as it is (views,
permutes, unary elementwise, and every getitem of a multi-output node: its strategies are
the producer's, one to one). A follower adds its cost and memory to the producer's
decision and costs no resharding. Every other node is a decision *head*.

`share_layers(dec, strats) -> rep`: decisions of repeated layers (same `nn_module_stack`
block structure, same strategies) map onto the first such layer's decisions.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.capture.export import layer_of
from autopar.passes.strategies import NodeStrategy
from autopar.search.costs import CostContext


@dataclass
class Decision:
    """One ILP decision: its choices index the strategies of its first member."""

    num_choices: int
    members: list[tuple[fx.Node, list[int]]] = field(default_factory=list)  # node, choice->strat


@dataclass
class Decisions:
    items: list[Decision]
    owner: dict[fx.Node, tuple[int, list[int]]]  # node -> (decision, choice -> strategy)


def build_decisions(
    gm: fx.GraphModule, strats: dict[fx.Node, list[NodeStrategy]], ctx: CostContext
) -> Decisions:
    items: list[Decision] = []
    owner: dict[fx.Node, tuple[int, list[int]]] = {}
    for n in gm.graph.nodes:
        if n not in strats:
            continue
        follow = _follow(n, strats, owner, items, ctx)
        if follow is not None:
            d, mapping = follow
        else:
            d, mapping = len(items), list(range(len(strats[n])))
            items.append(Decision(num_choices=len(strats[n])))
        items[d].members.append((n, mapping))
        owner[n] = (d, mapping)
    return Decisions(items, owner)


def _follow(n: fx.Node, strats, owner, items, ctx: CostContext):
    ins = ctx.operands(n)
    if n.op != "call_function" or len(ins) != 1 or ins[0][1].producer not in owner:
        return None
    pos, op = ins[0]
    u = op.producer
    d, map_u = owner[u]
    by_input: dict[object, int] = {}
    for j, s in enumerate(strats[n]):
        key = s.inputs[pos] if pos < len(s.inputs) else None
        if key not in by_input or ctx.node_cost(n, s) < ctx.node_cost(n, strats[n][by_input[key]]):
            by_input[key] = j
    mapping = []
    for c in range(items[d].num_choices):
        out = ctx.output_spec(op, strats[u][map_u[c]])
        if out not in by_input:
            return None
        mapping.append(by_input[out])
    return d, mapping


def share_layers(dec: Decisions, strats) -> list[int]:
    """rep[d] = the decision that d shares its choice with (itself if not repeated)."""
    by_layer: dict[str, list[int]] = defaultdict(list)
    for d, item in enumerate(dec.items):
        layer = layer_of(item.members[0][0])
        if layer is not None:
            by_layer[layer].append(d)
    rep = list(range(len(dec.items)))
    first_of: dict[tuple, list[int]] = {}
    for ds in by_layer.values():
        sig = tuple(_signature(dec.items[d], strats) for d in ds)
        if sig in first_of:
            for d, r in zip(ds, first_of[sig], strict=True):
                rep[d] = r
        else:
            first_of[sig] = ds
    return rep


def _signature(item: Decision, strats) -> tuple:
    return tuple(
        (_op_key(n), _shape(n), tuple(m), tuple(str(s) for s in strats[n])) for n, m in item.members
    )


def _op_key(n: fx.Node) -> str:
    """What a node computes; placeholders are told apart by role, not by their names."""
    return f"placeholder:{n.meta.get('autopar_role')}" if n.op == "placeholder" else str(n.target)


def _shape(n: fx.Node):
    val = n.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None

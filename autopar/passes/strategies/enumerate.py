"""``enumerate_strategies(gm, mesh)``: the candidate strategies of every node of a graph.

Nodes are visited in graph (topological) order. Per node kind:

* placeholder / get_attr holding a tensor: one strategy per *storage* spec, i.e. every
  product over mesh axes of ``{R} ∪ {S(d) : d a dim}`` (``torch.chunk`` shards, the last
  smaller or empty: a vocabulary of 97 shards over 4); ``inputs=()``.
* ``operator.getitem`` of a multi-output node: exactly one strategy per strategy of the
  producer, in the same order (``strategies[getitem][i]`` belongs to
  ``strategies[producer][i]``), with input and output both the producer's output spec at
  that index. The search can therefore tie a getitem's choice to its producer's.
* call_function with no tensor input (arange, full, scalar_tensor, ...): all-Replicate.
* an op with an autopar rule (``rules/``): the rule's strategies.
* any other op: DTensor's registry (:mod:`.from_dtensor`); an op whose DTensor sources
  reject every sharding of its arguments gets only the all-Replicate strategy (a warning
  once per op and enumeration, naming the user's source line); an op DTensor does not know
  at all stops planning with one ``UnsupportedOpError`` (a ValueError) naming the op and
  the user's source line, rather than failing on every rank at run time.

Every call_function node's list contains the all-Replicate strategy (all tensor inputs
and outputs ``R``), first; duplicates are removed. Nodes that produce no tensor and are
not getitems (the output node, export's ``_guards_fn`` module call, asserts) get no entry.
The input specs of a strategy may differ from every spec its producers offer; the search
prices that resharding on the edge.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._compat import StridedShard
from autopar.capture.operands import operands, tensor_operands
from autopar.passes.strategies.from_dtensor import (
    Candidates,
    dtensor_enumeration,
    dtensor_strategies,
    report_replicated,
    unsupported_op,
)
from autopar.passes.strategies.rules import get_rule, register_dtensor_rules
from autopar.passes.strategies.spec import (
    NodeStrategy,
    Spec,
    is_valid_spec,
    output_vals,
    replicate_spec,
)
from autopar.passes.strategies.strided import Hints, kept, strided_hints


def storage_specs(
    shape: torch.Size, mesh_shape: tuple[int, ...], strided: Iterable[tuple[int, int]] = ()
) -> list[Spec]:
    """Every product over axes of {R} ∪ {S(d)} (uneven shards kept) ∪ {SS(d:k)} for each
    ``(d, k)`` of ``strided`` (:mod:`.strided`), all-Replicate first."""
    per_axis: list[Placement] = [Replicate(), *(Shard(d) for d in range(len(shape)))]
    per_axis += [StridedShard(d, split_factor=k) for d, k in sorted(strided)]
    return [
        spec
        for spec in itertools.product(per_axis, repeat=len(mesh_shape))
        if is_valid_spec(spec, shape, mesh_shape, storage=True)
    ]


def replicate_strategy(node: fx.Node, ndim: int) -> NodeStrategy:
    """All tensor inputs and all tensor outputs replicated."""
    rep = replicate_spec(ndim)
    ins = tuple(rep if op.tensor is not None else None for op in operands(node))
    outs = tuple(None if v is None else rep for v in output_vals(node))
    return NodeStrategy(ins, outs)


def _getitem_strategies(node: fx.Node, table: dict[fx.Node, list[NodeStrategy]]) -> list:
    (op,) = operands(node)
    return [
        NodeStrategy((op.select(s.outputs),), (op.select(s.outputs),)) for s in table[op.producer]
    ]


def _candidates(node: fx.Node, table: dict[fx.Node, list[NodeStrategy]], ndim: int) -> Candidates:
    """Per tensor input of ``node``: the distinct specs its operand (the producer's
    selected output) may have."""
    cands: Candidates = {}
    for op in operands(node):
        specs: dict[str, Spec] = {}
        for s in table.get(op.producer, []):
            out = op.select(s.outputs)
            if out is not None:
                specs.setdefault("".join(map(str, out)), out)
        cands[op.producer] = list(specs.values()) or [replicate_spec(ndim)]
    return cands


def _dedup(strategies: list[NodeStrategy]) -> list[NodeStrategy]:
    seen: dict[str, NodeStrategy] = {}
    for s in strategies:
        seen.setdefault(s.key(), s)
    return list(seen.values())


def _op_strategies(
    node: fx.Node, mesh: DeviceMesh, table: dict[fx.Node, list[NodeStrategy]]
) -> list[NodeStrategy]:
    """Strategies of a call_function node other than getitem; all-Replicate first."""
    rep = replicate_strategy(node, mesh.ndim)
    if not tensor_operands(node):
        return [rep]
    rule = get_rule(node.target)
    if rule is not None:
        found = rule(node, mesh)
    else:
        found = dtensor_strategies(node, mesh, _candidates(node, table, mesh.ndim))
        if found is None:
            raise unsupported_op(node)
        if not found:
            report_replicated(node)
    return _dedup([rep, *found])


def _signature(node: fx.Node, table: dict[fx.Node, list[NodeStrategy]]) -> str:
    """What a node's strategies depend on: op, non-tensor args, input shapes/dtypes and the
    specs producers offer, output shapes. Repeated layers share signatures."""

    def key(n: fx.Node) -> object:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return ("value", val)
        offered = sorted({repr(s.outputs[0]) for s in table.get(n, []) if s.outputs})
        return ("tensor", tuple(val.shape), val.dtype, tuple(offered))

    outs = [None if v is None else (tuple(v.shape), v.dtype) for v in output_vals(node)]
    return repr((node.target, fx.node.map_arg((node.args, node.kwargs), key), outs))


def node_strategies(
    node: fx.Node,
    mesh: DeviceMesh,
    table: dict[fx.Node, list[NodeStrategy]],
    memo: dict[str, list[NodeStrategy]] | None = None,
    hints: Hints | None = None,
) -> list[NodeStrategy] | None:
    """The strategies of one node given those of the nodes before it (None: no entry).

    ``memo`` (signature -> strategies) lets repeated layers reuse one computation;
    ``hints`` (:func:`.strided.strided_hints`) adds strided storage specs to placeholders.
    """
    if node.op in ("placeholder", "get_attr"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        specs = storage_specs(val.shape, tuple(mesh.shape), (hints or {}).get(node, ()))
        return on_unit_axes([NodeStrategy((), (s,)) for s in specs], tuple(mesh.shape))
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and node.args[0] in table:
        return _getitem_strategies(node, table)
    if not any(v is not None for v in output_vals(node)):
        return None
    if memo is None:
        found = _op_strategies(node, mesh, table)
    else:
        sig = _signature(node, table)
        if sig not in memo:
            memo[sig] = _op_strategies(node, mesh, table)
        found = memo[sig]
    return kept(node, on_unit_axes(found, tuple(mesh.shape)), hints or {})


def on_unit_axes(found: list[NodeStrategy], mesh_shape: tuple[int, ...]) -> list[NodeStrategy]:
    """The strategies replicated on every mesh axis of one device (where any is): a split
    or a partial sum over one device is the same local tensor, so the others only repeat
    them (DTensor moves nothing on such an axis, and the search prices nothing)."""
    unit = [a for a, n in enumerate(mesh_shape) if n == 1]
    if not unit:
        return found
    kept_ = [
        s
        for s in found
        if all(spec is None or all(spec[a].is_replicate() for a in unit)
               for spec in (*s.inputs, *s.outputs))
    ]  # fmt: skip
    return kept_ or found


def enumerate_strategies(gm: fx.GraphModule, mesh: DeviceMesh) -> dict[fx.Node, list[NodeStrategy]]:
    """Candidate strategies per node of ``gm`` (ATen graph with ``meta["val"]``) on ``mesh``."""
    table: dict[fx.Node, list[NodeStrategy]] = {}
    memo: dict[str, list[NodeStrategy]] = {}
    hints = strided_hints(gm)
    register_dtensor_rules()
    with dtensor_enumeration():
        for node in gm.graph.nodes:
            found = node_strategies(node, mesh, table, memo, hints)
            if found is not None:
                assert found, f"no strategy for {node.format_node()}"
                table[node] = found
    return table

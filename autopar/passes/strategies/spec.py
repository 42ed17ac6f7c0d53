"""Specs and node strategies: the data the strategy stage hands to the search.

A *spec* is a tuple of DTensor placements, one per mesh axis. Only four kinds appear:
``Replicate()``, ``Shard(d)``, ``Partial("sum")`` and DTensor's ``_MaskPartial`` (the
pending masked sum of a vocab-parallel embedding), plus ``Partial("avg")`` on 0-d tensors
only (a mean loss over a batch-sharded input), and ``_StridedShard(d, k)`` (``SS(d:k)``:
dim ``d`` seen as ``k`` pieces, each split evenly over the axis: a column-split fused
projection, :mod:`autopar.passes.strategies.strided`) on a dim no other axis splits.
A spec is *valid* for a global shape on a mesh when it mixes no two kinds of partial (DTensor cannot reduce them in one step) and
every ``Shard(d)`` can split dim ``d``. Shards follow DTensor's ``torch.chunk`` semantics:
walking the axes in mesh order, a dim of local size ``L`` split over an axis of size ``n``
gives pieces of ``ceil(L / n)`` elements, the last ones smaller or empty (97 over 4:
25, 25, 25, 22; 6 over 4: 2, 2, 2, 0). Costs price the largest piece (what the padded
collectives move, :func:`autopar.cost_models.memory.local_shape`). An op's operand needs
at least as many elements on a dim as the shards it is cut into (DTensor's
``is_tensor_shardable``); a stored tensor (parameter, buffer, input: ``storage=True``) only
one, so FSDP shards any weight; autopar's own rules ask for ``even=True`` (their index
arithmetic assumes equal pieces).

A :class:`NodeStrategy` is one way to run one FX node: the spec each tensor input must have
(``inputs``, in the order of :func:`tensor_inputs`) and the spec each tensor output then has
(``outputs``). It prints DTensor-style with one spec per operand, placements concatenated
per axis: ``(S(0)R, RS(1)) -> S(0)S(1)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._compat import MaskPartial, StridedShard
from autopar.capture.operands import operands

Spec = tuple[Placement, ...]


def placement_str(p: Placement) -> str:
    """Compact form: ``R``, ``S(d)``, ``P`` (sum), ``MP`` (masked sum), else DTensor's str.
    (The common classes are told by `type` first: `isinstance` with a placement class that
    is not the object's runs DTensor's Python `__instancecheck__`, ~0.4 us, and the search
    asks ~10^6 times.)"""
    kind = type(p)
    if kind is Shard:
        return f"S({p.dim})"
    if kind is Replicate:
        return "R"
    if kind is Partial and p.reduce_op == "sum":
        return "P"
    if isinstance(p, MaskPartial):
        return "MP"
    if isinstance(p, StridedShard):
        return f"SS({p.dim}:{p.split_factor})"
    return str(p)  # P(avg)


def spec_str(spec: Spec | None) -> str:
    return "-" if spec is None else "".join(placement_str(p) for p in spec)


@dataclass(frozen=True, slots=True)
class NodeStrategy:
    """Input specs (one per tensor input, see :func:`tensor_inputs`) and output specs."""

    inputs: tuple[Spec | None, ...]
    outputs: tuple[Spec | None, ...]

    def __str__(self) -> str:
        ins = ", ".join(spec_str(s) for s in self.inputs)
        outs = ", ".join(spec_str(s) for s in self.outputs)
        return f"({ins}) -> {outs if len(self.outputs) == 1 else f'({outs})'}"

    def key(self) -> str:
        """Hashable identity (``_MaskPartial`` compares by buffer identity, so not ``==``)."""
        return str(self)


def is_allowed(p: Placement, scalar: bool = True) -> bool:
    """The placements a plan may use: no max/min partials, and ``Partial("avg")`` only on a
    0-d tensor (``scalar``): a mean-reduced loss of a batch-sharded input (DTensor's
    nll_loss/mean strategies), which only gets all-reduced.
    """
    kind = type(p)  # the common classes first (`placement_str`)
    if kind is Shard or kind is Replicate:
        return True
    if kind is Partial:
        return p.reduce_op == "sum" or (scalar and p.reduce_op == "avg")
    return isinstance(p, (Replicate, MaskPartial, StridedShard))


def is_valid_spec(
    spec: Spec,
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    *,
    even: bool = False,
    storage: bool = False,
) -> bool:
    """Allowed placements, at most one kind of partial, and every shard splittable (see the
    module docstring): exactly when `even`, else into ``torch.chunk`` pieces, none of them
    empty unless `storage`."""
    local = [int(s) for s in shape]
    pieces = [1] * len(local)  # how many shards each dim is cut into so far
    partial_kinds: set[type] = set()
    if not _mask_partial_ok(spec, len(local)):
        return False
    for axis, p in enumerate(spec):
        if not is_allowed(p, scalar=not local):
            return False
        kind = type(p)  # the common classes first (`placement_str`)
        if kind is Replicate:
            continue
        if kind is not Shard and isinstance(p, Partial):
            partial_kinds.add(kind)
        elif kind is not Shard and isinstance(p, StridedShard):
            if not _strided_ok(spec, axis, local, mesh_shape):
                return False
            local[p.dim] //= mesh_shape[axis]
        elif isinstance(p, Shard):
            if p.dim >= len(local) or (even and local[p.dim] % mesh_shape[axis]):
                return False
            local[p.dim] = -(-local[p.dim] // mesh_shape[axis])  # the largest chunk
            pieces[p.dim] *= mesh_shape[axis]
            if int(shape[p.dim]) < (1 if storage else pieces[p.dim]):
                return False  # as DTensor's is_tensor_shardable: a row per shard
    return len(partial_kinds) <= 1


def _strided_ok(spec: Spec, axis: int, local: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """``spec[axis]`` strided: its dim exists, splits evenly into its pieces' shards, and no
    other axis splits it (DTensor's nested strided layouts are not planned)."""
    p = spec[axis]
    if p.dim >= len(local) or local[p.dim] % (p.split_factor * mesh_shape[axis]):
        return False
    others = (q for a, q in enumerate(spec) if a != axis)
    return not any(isinstance(q, (Shard, StridedShard)) and q.dim == p.dim for q in others)


def _mask_partial_ok(spec: Spec, ndim: int) -> bool:
    """``_MaskPartial`` (vocab-parallel embedding) only where DTensor executes it correctly:
    on one axis (two axes share one mask buffer and conflict), and with no later axis
    sharding a dim other than the last (DTensor would gather that shard before applying
    the mask, whose shape is the local indices'). Found by the numerical tests.
    """
    axes = [
        a
        for a, p in enumerate(spec)
        if type(p) is not Shard and type(p) is not Replicate and isinstance(p, MaskPartial)
    ]
    if not axes:
        return True
    if len(axes) > 1:
        return False
    return all(not isinstance(p, Shard) or p.dim == ndim - 1 for p in spec[axes[0] + 1 :])


def replicate_spec(ndim: int) -> Spec:
    return (Replicate(),) * ndim


def summed_spec(spec: Sequence[Placement]) -> Spec:
    """`spec` with every Partial Replicate: where a value's pending sum is read whole. A
    gradient arrives so at the node that computed the value (what the search prices each
    node's backward from, and what lowering pins), and a value crosses a stage so."""
    return tuple(Replicate() if p.is_partial() else p for p in spec)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The producers of the node's operands (:func:`autopar.capture.operands.operands`):
    input nodes in flattened (args, kwargs) order, repeats kept.

    ``NodeStrategy.inputs[i]`` is the spec for ``tensor_inputs(node)[i]`` (None where that
    input is not a tensor, e.g. a SymInt). For an ``operator.getitem`` of a multi-output
    node, the spec is that of the selected output (see :class:`Operand`).
    """
    return [op.producer for op in operands(node)]


def is_tensor_node(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def output_vals(node: fx.Node) -> list[torch.Tensor | None]:
    """The node's outputs as a flat list (None for non-tensor entries)."""
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    return [v if isinstance(v, torch.Tensor) else None for v in vals]

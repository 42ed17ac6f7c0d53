"""What the step model reads of an edge beyond its seconds: its collectives (to fuse and
bucket them as `passes.comm` does) and its local copies (`cost_models.rearrange`).

A mixin of `search.costs.CostContext` (which provides `cluster`, `is_weight`,
`reduce_itemsize`, `_grad_spec_at_consumer` and `_grad_source`).
"""

from __future__ import annotations

import torch.fx as fx

from autopar.capture.operands import Operand
from autopar.cost_models import comm
from autopar.cost_models.reshard import rearrange_seconds, reshard_parts, same_spec
from autopar.passes.strategies import NodeStrategy
from autopar.search.edge_matrices import EdgeValue, enters_partial


class EdgeCollectives:
    def weight_gathers(self, op: Operand, src, v: fx.Node, s: NodeStrategy, pos: int):
        """``(key, kind, axis, bytes)`` per collective of the forward reshard of the weight
        `op` reads (empty for an activation): what `passes.comm` fuses per layer."""
        dst = s.inputs[pos] if pos < len(s.inputs) else None
        val = op.tensor
        if src is None or dst is None or val is None or not self.is_weight(op.producer):
            return []
        size, shape = val.element_size(), tuple(val.shape)
        into = enters_partial(v, pos)
        parts = reshard_parts(self.cluster, tuple(src), tuple(dst), shape, size, into) or ()
        return [((kind, axis, size), kind, axis, b) for axis, kind, b in parts]

    def grad_reductions(self, op: Operand, src, v: fx.Node, s: NodeStrategy, pos: int):
        """``(key, kind, axis, bytes)`` per collective reducing the gradient of the weight
        `op` reads (empty for an activation): what `cost_models.buckets` buckets, keyed by
        (kind, axis, dtype size) as the pass keys (group, reduce op, dtype)."""
        if not self.is_weight(op.producer):
            return []
        size = op.tensor.element_size() if op.tensor is not None else 0
        dst = s.inputs[pos] if pos < len(s.inputs) else None
        if self.reduce_itemsize and src is not None and dst is not None and same_spec(src, dst):
            size = self.reduce_itemsize
        parts = self._grad_parts(op, src, s, pos, size)
        return [((kind, axis, size), kind, axis, b) for axis, kind, b in parts]

    def activation_grad_all_reduces(
        self, op: Operand, src, v: fx.Node, s: NodeStrategy, pos: int
    ) -> float:
        """Seconds of the all-reduces in the gradient reshard of the activation `op` reads
        (from spec `src`) as input `pos` of `v` running `s` (0 for a weight): what
        `passes.comm` issues as soon as `v`'s backward computes that gradient."""
        if self.is_weight(op.producer) or op.tensor is None:
            return 0.0
        return sum(
            comm.collective_time(kind, nbytes, axis, self.cluster)
            for axis, kind, nbytes in self._grad_parts(op, src, s, pos, op.tensor.element_size())
            if comm.Collective(kind) is comm.Collective.ALL_REDUCE
        )

    def _grad_parts(self, op: Operand, src, s: NodeStrategy, pos: int, size: int) -> tuple:
        """(axis, collective, bytes) per step of moving the gradient of the value `op` reads
        (spec `src`) as input `pos` of a node running `s` back into the producer's spec, in
        elements of `size` bytes (() where nothing moves or there is no tensor)."""
        dst = s.inputs[pos] if pos < len(s.inputs) else None
        val = op.tensor
        if src is None or dst is None or val is None:
            return ()
        grad_dst = self._grad_spec_at_consumer(dst, s)
        grad_src = self._grad_source(tuple(src))
        return reshard_parts(self.cluster, grad_dst, grad_src, tuple(val.shape), size) or ()

    def weight_copies(self, op: Operand, src, v: fx.Node, s: NodeStrategy, pos: int):
        """(forward, backward) seconds of the local copies around the collectives of the
        weight `op`'s reshard and of its gradient's (`reshard.rearrange_seconds`: DTensor's
        layout on dims other than 0), (0, 0) for an activation (whose copies its edge's
        seconds hold): what the step runs after a gather's wait and before a reduction."""
        dst = s.inputs[pos] if pos < len(s.inputs) else None
        val = op.tensor
        if src is None or dst is None or val is None or not self.is_weight(op.producer):
            return 0.0, 0.0
        size, shape, src, dst = val.element_size(), tuple(val.shape), tuple(src), tuple(dst)
        via = EdgeValue.of(self, op, val, v, pos).through_source(src, dst)
        into = enters_partial(v, pos)
        forward = rearrange_seconds(self.cluster, src, dst, shape, size, into, via)
        grad_size = self.reduce_itemsize if self.reduce_itemsize and same_spec(src, dst) else size
        grad_dst, grad_src = self._grad_spec_at_consumer(dst, s), self._grad_source(src)
        backward = rearrange_seconds(self.cluster, grad_dst, grad_src, shape, grad_size, False, via)
        return forward, backward

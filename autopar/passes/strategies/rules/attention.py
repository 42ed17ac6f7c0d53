"""Attention: ``aten.scaled_dot_product_attention`` and its CPU flash kernels.

Attention on ``q [B, H, T, D]``, ``k, v [B, Hkv, S, D]`` (``H % Hkv == 0``, grouped-query
attention when ``Hkv < H``) is independent across the batch and across heads, so on each
mesh axis one of three rules holds:

* all Replicate;
* batch: ``Shard(0)`` on q, k, v and the output (and on logsumexp / gradients);
* heads: ``Shard(1)`` on all of them. With GQA, local q head ``j`` on shard ``r`` is global
  head ``r*H/n + j`` and reads kv head ``(r*H/n + j) // (H/Hkv) = r*Hkv/n + j // (H/Hkv)``,
  i.e. local kv head ``j // (H/Hkv)``: correct exactly when both ``H`` and ``Hkv`` divide
  by the axis size, which the even-division filter enforces.

* sequence (context parallel, all-gathered K/V): ``Shard(2)`` on q, the output and the
  logsumexp ``[B, H, T]``, ``Replicate`` on k and v. The K/V all-gather is then the
  redistribution into the node (``Shard(2) -> Replicate``, priced as an all-gather by the
  cost model), and in backward ``dk``, ``dv`` come out ``Partial`` (each rank's query rows
  contribute to every key): reduced back to the producers' ``Shard(2)`` they are a
  reduce-scatter. Non-causal attention is then exact as it is. Causal attention on a
  query shard starting at row ``o`` (its global offset) needs the mask ``key <= o + row``,
  not the kernel's top-left ``key <= row``: :func:`flash_cpu_handler` runs those kernels
  (forward and backward) with ``is_causal=False`` and the additive mask
  ``-inf * [key > o + row]``, which is exactly causal attention of those rows.

* sequence (context parallel, ring): ``Shard(2)`` on q, k, v, the output, the logsumexp
  and every gradient, on exactly one axis (and q split on the sequence there only), self
  attention (``T == S``) without a mask: :mod:`.ring` passes the K/V blocks around that
  axis with an online-softmax merge, forward and backward (dK/dV travel back to their
  owners); causal attention is load-balanced inside the op (partner ranks swap query
  halves, wholly masked key halves are skipped: every rank computes ``n / 2`` blocks). No
  K/V all-gather and no reduce-scatter (the node's edges move nothing); the ring's own
  traffic is priced in the node (``cost_models.ring``: :func:`ring_axis`,
  :func:`ring_kv_bytes`, the swaps :func:`ring_half_bytes`), its work by
  :func:`work_factor`. The search chooses between it and the all-gathered variant by cost
  (ring: less memory, per-step passes that overlap the kernels; all-gather: one collective).

An attention mask follows the batch or head split on the dim where it is not broadcast
(size > 1), and is replicated otherwise; with the all-gather sequence split it follows
q's rows.

``aten.scaled_dot_product_attention.default`` is kept whole in the captured graph, so the
search sees :func:`sdpa_rule`. Eager DTensor programs on CPU reach the fused kernels
``_scaled_dot_product_flash_attention_for_cpu`` (outputs: out, logsumexp ``[B, H, T]``) and
its ``_backward``, which DTensor's registry lacks; :func:`register_dtensor` adds the same
rules for them so that running a plan agrees with planning it. It runs when autopar plans
or lowers (:func:`autopar.passes.strategies.rules.register_dtensor_rules`), never on import.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._compat import (
    OpOverload,
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    dispatch_with_local,
    expand_to_full_mesh_op_strategy,
    op_strategy_func,
    register_dtensor_handler,
    register_op_strategy,
)
from autopar.passes.strategies.from_dtensor import expand_per_axis
from autopar.passes.strategies.rules import register_rule
from autopar.passes.strategies.rules.ring import (
    HalfBytes,
    Ring,
    balanced,
    ring_backward,
    ring_forward,
)
from autopar.passes.strategies.spec import NodeStrategy

aten = torch.ops.aten
FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask_placement(mask_shape: Sequence[int] | None, dim: int) -> Placement | None:
    """How the mask goes along with a split of q/k/v on ``dim`` (None: no mask)."""
    if mask_shape is None:
        return None
    # the mask broadcasts from the right against [B, H, T, S]
    pos = dim - (4 - len(mask_shape))
    if pos >= 0 and mask_shape[pos] > 1:
        return Shard(pos)
    return Replicate()


SEQ = 2  # the sequence dim of q [B, H, T, D], the output and logsumexp [B, H, T]
Q, KV, GRAD_KV = "q", "kv", "grad_kv"  # roles under the sequence split


def seq_rule(roles: Sequence[str], mask_shape: Sequence[int] | None) -> list[Placement]:
    """The context-parallel rule: q-like tensors Shard(2), k/v Replicate, their grads
    Partial; ``roles`` in rule order (outputs, then inputs), the mask appended."""
    place = {Q: Shard(SEQ), KV: Replicate(), GRAD_KV: Partial()}
    rule: list[Placement] = [place[r] for r in roles]
    if mask_shape is not None:
        rule.append(_mask_placement(mask_shape, SEQ))  # type: ignore[arg-type]
    return rule


def ring_rule(n: int) -> list[Placement]:
    """The ring rule on ``n`` entries (outputs and inputs): everything ``Shard(2)``."""
    return [Shard(SEQ)] * n


def _seq_axes(spec: Sequence[Placement] | None) -> tuple[int, ...]:
    return tuple(a for a, p in enumerate(spec or ()) if p == Shard(SEQ))


def valid_ring(q: Sequence[Placement] | None, k: Sequence[Placement] | None) -> bool:
    """K/V split on the sequence (ring) on at most one axis, q on the sequence there only."""
    ring = _seq_axes(k)
    return not ring or (len(ring) == 1 and _seq_axes(q) == ring)


def axis_rules(
    n_out: int, n_qkv_like: int, mask_shape: Sequence[int] | None
) -> list[list[Placement]]:
    """Single-axis rules ``[outputs..., qkv-like inputs..., mask?]`` for attention.

    Every output and every non-mask input is split on the same dim (0 = batch, 1 = heads);
    the sequence split is :func:`seq_rule`.
    """
    rules = []
    for dim in (None, 0, 1):
        p: Placement = Replicate() if dim is None else Shard(dim)
        rule = [p] * (n_out + n_qkv_like)
        m = _mask_placement(mask_shape, dim) if dim is not None else Replicate()
        if mask_shape is not None:
            rule.append(m)  # type: ignore[arg-type]
        rules.append(rule)
    return rules


@register_rule(aten.scaled_dot_product_attention.default)
def sdpa_rule(node: fx.Node, mesh: DeviceMesh) -> list[NodeStrategy]:
    """sdpa(q, k, v, attn_mask=None, ...) -> out: replicate, batch, head or sequence split."""
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    mask_shape = mask.meta["val"].shape if isinstance(mask, fx.Node) else None
    rules = [*axis_rules(1, 3, mask_shape), seq_rule((Q, Q, KV, KV), mask_shape)]
    q, k = (a.meta["val"] for a in node.args[:2])
    if mask_shape is None and q.shape[SEQ] == k.shape[SEQ]:
        rules.append(ring_rule(4))
    found = expand_per_axis(node, rules, 1, mesh)
    return [s for s in found if valid_ring(s.inputs[0], s.inputs[1])]


def ring_axis(node: fx.Node, strategy: NodeStrategy) -> int | None:
    """The mesh axis of ``strategy``'s ring (K split on the sequence), None if none."""
    if node.target != aten.scaled_dot_product_attention.default or len(strategy.inputs) < 2:
        return None
    axes = _seq_axes(strategy.inputs[1])
    return axes[0] if axes else None


def _local_numel(val: torch.Tensor, spec: Sequence[Placement] | None, mesh_shape) -> float:
    """Elements of the largest local shard of ``val`` laid out as ``spec``."""
    numel = float(val.numel())
    for axis, p in enumerate(spec or ()):
        if isinstance(p, Shard):
            numel *= -(-val.shape[p.dim] // mesh_shape[axis]) / max(val.shape[p.dim], 1)
    return numel


def ring_kv_bytes(node: fx.Node, strategy: NodeStrategy, mesh_shape: Sequence[int]) -> float:
    """Bytes of one rank's K and V blocks under a ring ``strategy`` (one pass of the ring):
    the largest local shard of each, every axis's split applied."""
    return sum(
        _local_numel(arg.meta["val"], spec, mesh_shape) * arg.meta["val"].element_size()
        for arg, spec in zip(node.args[1:3], strategy.inputs[1:3], strict=True)
    )


def _is_causal(node: fx.Node) -> bool:
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))


def _ring_rows(node: fx.Node, strategy: NodeStrategy, mesh_shape: Sequence[int]) -> int:
    """Query rows one rank holds under ``strategy`` (its largest shard)."""
    rows = node.args[0].meta["val"].shape[SEQ]  # type: ignore[union-attr]
    for axis, p in enumerate(strategy.inputs[0] or ()):
        if p == Shard(SEQ):
            rows = -(-rows // mesh_shape[axis])
    return rows


def _balanced_ring(node: fx.Node, strategy: NodeStrategy, mesh_shape: Sequence[int]) -> bool:
    """Whether ``strategy``'s ring runs the load-balanced causal split (:mod:`.ring`)."""
    axis = ring_axis(node, strategy)
    if axis is None:
        return False
    return balanced(_is_causal(node), _ring_rows(node, strategy, mesh_shape), mesh_shape[axis])


def ring_half_bytes(
    node: fx.Node, strategy: NodeStrategy, mesh_shape: Sequence[int]
) -> HalfBytes | None:
    """What one rank swaps with its partner under the balanced causal ring (its high half of
    q, of the output and of the float32 logsumexp), None where the ring does not split."""
    if not _balanced_ring(node, strategy, mesh_shape):
        return None
    q, out = node.args[0].meta["val"], node.meta["val"]  # type: ignore[union-attr]
    rows = _ring_rows(node, strategy, mesh_shape)
    half = (rows // 2) / rows  # the high half's share of the rank's rows
    out_numel = _local_numel(out, strategy.outputs[0], mesh_shape)
    return HalfBytes(
        q=_local_numel(q, strategy.inputs[0], mesh_shape) * q.element_size() * half,
        out=out_numel * out.element_size() * half,
        lse=out_numel / out.shape[-1] * 4 * half,
    )


def work_factor(
    node: fx.Node, strategy: NodeStrategy, mesh_shape: Sequence[int] | None = None
) -> float:
    """How much more work than its share a rank does under ``strategy`` (the cost model
    divides a node's FLOPs, causal attention's already halved, by the split), for causal
    attention with the sequence split: 2 with all-gathered K/V, whose offset mask makes the
    kernel compute every block of its rows (none is wholly masked, so none is skipped);
    1 on a ring of ``n`` (:mod:`.ring`'s load-balanced split: every rank ``n / 2`` blocks),
    ``(2n - 1) / n`` on one whose ranks hold a single row (not split: the last rank computes
    ``n - 1/2`` blocks); ``mesh_shape`` gives ``n``, 2 without it. 1 otherwise."""
    if node.target != aten.scaled_dot_product_attention.default or not _is_causal(node):
        return 1.0
    out = strategy.outputs[0] if strategy.outputs else None
    if out is None or not any(p == Shard(SEQ) for p in out):
        return 1.0
    axis = ring_axis(node, strategy)
    if axis is None or mesh_shape is None:
        return 2.0
    if _balanced_ring(node, strategy, mesh_shape):
        return 1.0
    n = mesh_shape[axis]
    return (2 * n - 1) / n


def _mask_shape(op_schema: OpSchema) -> Sequence[int] | None:
    mask = op_schema.kwargs_schema.get("attn_mask")
    return mask.shape if isinstance(mask, OpStrategy) else None


def _keep_valid_rings(strategy: OpStrategy, q_index: int) -> OpStrategy:
    """Drop the expanded strategies whose ring is not :func:`valid_ring`."""
    strategy.strategies = [
        s
        for s in strategy.strategies
        if s.input_specs is None
        or valid_ring(s.input_specs[q_index].placements, s.input_specs[q_index + 1].placements)
    ]
    return strategy


def flash_cpu_strategy(op_schema: OpSchema) -> OpStrategy:
    """DTensor strategy for the CPU flash forward: (out, logsumexp) from (q, k, v[, mask])."""
    mask = _mask_shape(op_schema)
    rules = [*axis_rules(2, 3, mask), seq_rule((Q, Q, Q, KV, KV), mask)]
    if mask is None:
        rules.append(ring_rule(5))
    mesh = op_schema.get_mesh_from_args()
    found = expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=2)  # type: ignore[arg-type]
    return _keep_valid_rings(found, 0)


def flash_cpu_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    """DTensor strategy for the CPU flash backward: grads of q, k, v from
    (grad_out, q, k, v, out, logsumexp[, mask])."""
    mask = _mask_shape(op_schema)
    roles = (Q, GRAD_KV, GRAD_KV, Q, Q, KV, KV, Q, Q)  # (dq, dk, dv, dout, q, k, v, out, lse)
    rules = [*axis_rules(3, 6, mask), seq_rule(roles, mask)]
    if mask is None:
        rules.append(ring_rule(9))
    mesh = op_schema.get_mesh_from_args(validate=False)
    found = expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=3)  # type: ignore[arg-type]
    return _keep_valid_rings(found, 1)


def _causal_flag(op_call: OpOverload, args: tuple, kwargs: dict) -> tuple[int, bool]:
    """(position, value) of ``is_causal``: forward (q, k, v, dropout_p, is_causal),
    backward (dout, q, k, v, out, lse, dropout_p, is_causal)."""
    pos = 4 if op_call is FLASH_CPU else 7
    if len(args) > pos:
        return pos, bool(args[pos])
    return pos, bool(kwargs.get("is_causal", False))


def _seq_offset(spec) -> int:
    """Where this rank's rows of a tensor laid out as ``spec`` start on dim ``SEQ``: DTensor
    splits a dim sharded on several axes left to right, evenly (the enumeration keeps only
    even splits); in plain ints, as the mesh coordinate is (no traced index tensors)."""
    size, offset = spec.tensor_meta.shape[SEQ], 0
    coordinate = spec.mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the attention's mesh"
    for axis, p in enumerate(spec.placements):
        if p == Shard(SEQ):
            size //= spec.mesh.size(axis)
            offset += coordinate[axis] * size
    return offset


def _ring_call(op_call: OpOverload, local_args: tuple, local_kwargs: dict, k_spec) -> object:
    """The local ring attention (:mod:`.ring`) of a CPU flash kernel whose K is split on
    the sequence on one axis of ``k_spec``'s mesh."""
    (axis,) = _seq_axes(k_spec.placements)
    mesh = k_spec.mesh
    ring = Ring(mesh.get_local_rank(axis), mesh.size(axis), mesh.get_group(axis).group_name)
    _, causal = _causal_flag(op_call, local_args, local_kwargs)
    assert local_kwargs.get("attn_mask") is None, "ring attention takes no mask"
    dropout_pos = 3 if op_call is FLASH_CPU else 6
    assert len(local_args) <= dropout_pos or not local_args[dropout_pos], "ring: no dropout"
    scale = local_kwargs.get("scale")
    if op_call is FLASH_CPU:
        return ring_forward(op_call, *local_args[:3], causal, scale, ring)
    return ring_backward(op_call, *local_args[:6], causal, scale, ring)


def flash_cpu_handler(op_call: OpOverload, args: tuple, kwargs: dict) -> object:
    """DTensor dispatch of the CPU flash kernels; a call with K split on the sequence runs
    ring attention, a causal call on a sequence-sharded query against full K/V runs with
    the query shard's offset causal mask (module docstring)."""

    def local(local_args: tuple, local_kwargs: dict, out_spec, in_specs) -> object:
        k_spec = in_specs[1 if op_call is FLASH_CPU else 2]
        if _seq_axes(k_spec.placements):
            return _ring_call(op_call, local_args, local_kwargs, k_spec)
        pos, causal = _causal_flag(op_call, local_args, local_kwargs)
        q_spec = out_spec[0]  # the output (forward) / dq (backward) is laid out like q
        if not (causal and any(p == Shard(SEQ) for p in q_spec.placements)):
            return op_call(*local_args, **local_kwargs)
        assert local_kwargs.get("attn_mask") is None, "sdpa takes a mask or is_causal"
        qi = 0 if op_call is FLASH_CPU else 1
        q, k = local_args[qi], local_args[qi + 1]
        offset = _seq_offset(q_spec)
        mask = torch.full((q.shape[SEQ], k.shape[SEQ]), float("-inf"), dtype=q.dtype)
        if len(local_args) > pos:
            local_args = (*local_args[:pos], False, *local_args[pos + 1 :])
        else:
            local_kwargs = {**local_kwargs, "is_causal": False}
        mask = mask.to(q.device).triu(offset + 1)
        return op_call(*local_args, **{**local_kwargs, "attn_mask": mask})

    return dispatch_with_local(op_call, args, kwargs, local)


def register_dtensor() -> None:
    """Register the CPU flash-attention strategies and handlers into DTensor
    (idempotent)."""
    if op_strategy_func(FLASH_CPU_BWD) is flash_cpu_backward_strategy:
        return
    register_dtensor_handler(FLASH_CPU, flash_cpu_handler)
    register_dtensor_handler(FLASH_CPU_BWD, flash_cpu_handler)
    info = RuntimeSchemaInfo(static_argnum=3, static_kwargkey=["attn_mask", "scale"])
    register_op_strategy(FLASH_CPU, flash_cpu_strategy, info)
    bwd_info = RuntimeSchemaInfo(static_argnum=6, static_kwargkey=["attn_mask", "scale"])
    register_op_strategy(FLASH_CPU_BWD, flash_cpu_backward_strategy, bwd_info)

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

An attention mask follows the batch or head split on the dim where it is not broadcast
(size > 1), and is replicated otherwise; with the sequence split it follows q's rows.
Ring attention (K/V blocks passed around the axis with an online-softmax merge) is not
offered: all-gathered K/V holds the full K/V of one layer at a time.

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
    return expand_per_axis(node, rules, 1, mesh)


def work_factor(node: fx.Node, strategy: NodeStrategy) -> float:
    """How much more work than its share a rank does under ``strategy`` (the cost model
    divides a node's FLOPs, causal attention's already halved, by the split): 2 for causal
    attention with the sequence split, whose offset mask makes the kernel compute every
    block of its rows (no block is wholly masked, so none is skipped); 1 otherwise."""
    if node.target != aten.scaled_dot_product_attention.default:
        return 1.0
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    out = strategy.outputs[0] if strategy.outputs else None
    seq = out is not None and any(p == Shard(SEQ) for p in out)
    return 2.0 if causal and seq else 1.0


def _mask_shape(op_schema: OpSchema) -> Sequence[int] | None:
    mask = op_schema.kwargs_schema.get("attn_mask")
    return mask.shape if isinstance(mask, OpStrategy) else None


def flash_cpu_strategy(op_schema: OpSchema) -> OpStrategy:
    """DTensor strategy for the CPU flash forward: (out, logsumexp) from (q, k, v[, mask])."""
    mask = _mask_shape(op_schema)
    rules = [*axis_rules(2, 3, mask), seq_rule((Q, Q, Q, KV, KV), mask)]
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=2)  # type: ignore[arg-type]


def flash_cpu_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    """DTensor strategy for the CPU flash backward: grads of q, k, v from
    (grad_out, q, k, v, out, logsumexp[, mask])."""
    mask = _mask_shape(op_schema)
    roles = (Q, GRAD_KV, GRAD_KV, Q, Q, KV, KV, Q, Q)  # (dq, dk, dv, dout, q, k, v, out, lse)
    rules = [*axis_rules(3, 6, mask), seq_rule(roles, mask)]
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=3)  # type: ignore[arg-type]


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


def flash_cpu_handler(op_call: OpOverload, args: tuple, kwargs: dict) -> object:
    """DTensor dispatch of the CPU flash kernels; a causal call on a sequence-sharded query
    runs with the query shard's offset causal mask (module docstring)."""

    def local(local_args: tuple, local_kwargs: dict, out_spec) -> object:
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

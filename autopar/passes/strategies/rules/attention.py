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

An attention mask follows the batch or head split on the dim where it is not broadcast
(size > 1), and is replicated otherwise. Sequence (context-parallel) sharding is not
offered: it needs ring attention or gathered k/v.

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
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._compat import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    expand_to_full_mesh_op_strategy,
    op_strategy_func,
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


def axis_rules(
    n_out: int, n_qkv_like: int, mask_shape: Sequence[int] | None
) -> list[list[Placement]]:
    """Single-axis rules ``[outputs..., qkv-like inputs..., mask?]`` for attention.

    Every output and every non-mask input is split on the same dim (0 = batch, 1 = heads).
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
    """sdpa(q, k, v, attn_mask=None, ...) -> out: replicate, batch split, head split."""
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    mask_shape = mask.meta["val"].shape if isinstance(mask, fx.Node) else None
    return expand_per_axis(node, axis_rules(1, 3, mask_shape), 1, mesh)


def _mask_shape(op_schema: OpSchema) -> Sequence[int] | None:
    mask = op_schema.kwargs_schema.get("attn_mask")
    return mask.shape if isinstance(mask, OpStrategy) else None


def flash_cpu_strategy(op_schema: OpSchema) -> OpStrategy:
    """DTensor strategy for the CPU flash forward: (out, logsumexp) from (q, k, v[, mask])."""
    rules = axis_rules(2, 3, _mask_shape(op_schema))
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=2)  # type: ignore[arg-type]


def flash_cpu_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    """DTensor strategy for the CPU flash backward: grads of q, k, v from
    (grad_out, q, k, v, out, logsumexp[, mask])."""
    rules = axis_rules(3, 6, _mask_shape(op_schema))
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=3)  # type: ignore[arg-type]


def register_dtensor() -> None:
    """Register the CPU flash-attention strategies into DTensor (idempotent)."""
    if op_strategy_func(FLASH_CPU_BWD) is flash_cpu_backward_strategy:
        return
    info = RuntimeSchemaInfo(static_argnum=3, static_kwargkey=["attn_mask", "scale"])
    register_op_strategy(FLASH_CPU, flash_cpu_strategy, info)
    bwd_info = RuntimeSchemaInfo(static_argnum=6, static_kwargkey=["attn_mask", "scale"])
    register_op_strategy(FLASH_CPU_BWD, flash_cpu_backward_strategy, bwd_info)

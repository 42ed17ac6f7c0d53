"""BatchNorm statistics: ``autopar::batch_norm_stats`` and its backward.

Capture decomposes BatchNorm (:mod:`autopar.capture.batch_norm`) so that the per-channel sums
``stats = stack([sum(x), sum(x * x)])`` over every dim but the channel dim 1 are one op,
``batch_norm_stats(x [N, C, *S]) -> [2, C]``; everything else is elementwise. On each mesh
axis one of these holds:

* all Replicate;
* samples split: ``x`` on ``Shard(d)`` for ``d = 0`` or a spatial dim ``d >= 2`` gives
  ``Partial`` stats — each rank sums its shard, and the consumers that need the global mean
  and variance all-reduce ``2C`` floats (SyncBatchNorm's collective, priced by the search as
  the ``Partial -> Replicate`` edge like any other redistribution);
* channels split: ``x`` on ``Shard(1)`` gives stats on ``Shard(1)``, no communication.

``batch_norm_stats_backward(grad [2, C], x) -> dx = grad[0] + 2 x grad[1]`` (per channel) is
linear in ``grad`` and elementwise in ``x``: ``dx`` takes ``x``'s split on a sample dim with
``grad`` Replicate; ``Shard(1)`` on all three; or ``Partial`` ``grad`` with ``x`` Replicate
gives a ``Partial`` ``dx``.

The same rules are registered into DTensor's propagator by :func:`register_dtensor` (called
through :func:`autopar.passes.strategies.rules.register_dtensor_rules`, never on import), so
that lowering executes what the search planned.
"""

from __future__ import annotations

import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._compat import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    expand_to_full_mesh_op_strategy,
    op_strategy_func,
    register_op_strategy,
)
from autopar.capture.batch_norm import STATS, STATS_BACKWARD
from autopar.passes.strategies.from_dtensor import expand_per_axis
from autopar.passes.strategies.rules import register_rule
from autopar.passes.strategies.spec import NodeStrategy


def stats_rules(ndim: int) -> list[list[Placement]]:
    """Single-axis rules ``[stats, x]`` for ``batch_norm_stats`` on an ``ndim``-dim ``x``."""
    rules: list[list[Placement]] = [[Replicate(), Replicate()], [Shard(1), Shard(1)]]
    rules += [[Partial(), Shard(d)] for d in (0, *range(2, ndim))]
    return rules


def stats_backward_rules(ndim: int) -> list[list[Placement]]:
    """Single-axis rules ``[dx, grad, x]`` for ``batch_norm_stats_backward``."""
    rules: list[list[Placement]] = [
        [Replicate(), Replicate(), Replicate()],
        [Shard(1), Shard(1), Shard(1)],
        [Partial(), Partial(), Replicate()],
    ]
    rules += [[Shard(d), Replicate(), Shard(d)] for d in (0, *range(2, ndim))]
    return rules


@register_rule(STATS)
def stats_rule(node: fx.Node, mesh: DeviceMesh) -> list[NodeStrategy]:
    """Strategies of ``batch_norm_stats(x)``: replicate, sample split (Partial), channels."""
    ndim = node.args[0].meta["val"].dim()  # type: ignore[union-attr]
    return expand_per_axis(node, stats_rules(ndim), 1, mesh)


@register_rule(STATS_BACKWARD)
def stats_backward_rule(node: fx.Node, mesh: DeviceMesh) -> list[NodeStrategy]:
    """Strategies of ``batch_norm_stats_backward(grad, x)`` (met in joint graphs)."""
    ndim = node.args[1].meta["val"].dim()  # type: ignore[union-attr]
    return expand_per_axis(node, stats_backward_rules(ndim), 1, mesh)


def stats_strategy(op_schema: OpSchema) -> OpStrategy:
    """DTensor strategy of ``batch_norm_stats``."""
    (x,) = op_schema.args_schema[:1]
    mesh = op_schema.get_mesh_from_args(validate=False)
    rules = stats_rules(x.ndim)  # type: ignore[union-attr]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=1)  # type: ignore[arg-type]


def stats_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    """DTensor strategy of ``batch_norm_stats_backward``."""
    x = op_schema.args_schema[1]
    mesh = op_schema.get_mesh_from_args(validate=False)
    rules = stats_backward_rules(x.ndim)  # type: ignore[union-attr]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=1)  # type: ignore[arg-type]


def register_dtensor() -> None:
    """Register both strategies into DTensor (idempotent)."""
    if op_strategy_func(STATS_BACKWARD) is stats_backward_strategy:
        return
    register_op_strategy(STATS, stats_strategy, RuntimeSchemaInfo())
    register_op_strategy(STATS_BACKWARD, stats_backward_strategy, RuntimeSchemaInfo())

"""autopar's own strategy rules, for ops DTensor's registry does not cover.

One file per op family. A rule is ``rule(node, mesh) -> list[NodeStrategy]`` registered with
``@register_rule(op, ...)``; it is consulted before DTensor's registry, so a rule may also
override a DTensor strategy that plans must not use. Importing this package fills autopar's
own table (:data:`RULES`) and leaves DTensor's registry alone.

A rule whose op also runs in eager DTensor programs has an equivalent DTensor strategy,
registered into DTensor's propagator only by an explicit call: :func:`register_dtensor_rules`
(idempotent), which strategy enumeration and lowering call before DTensor sees such an op.
The fused kernels' ops exist only once :mod:`autopar.kernels` is imported; their rules and
DTensor strategies are registered by :func:`autopar.passes.strategies.rules.fused.register`,
which the fusion pass calls before it puts a fused op in a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autopar._compat import OpOverload, untraced_strided_offsets
from autopar.capture.regions import spec_of
from autopar.passes.strategies.spec import NodeStrategy

Rule = Callable[[fx.Node, DeviceMesh], list[NodeStrategy]]

RULES: dict[OpOverload, Rule] = {}


def register_rule(*ops: OpOverload) -> Callable[[Rule], Rule]:
    """Decorator: ``rule`` gives the strategies of every op in ``ops``."""

    def wrap(rule: Rule) -> Rule:
        for op in ops:
            RULES[op] = rule
        return rule

    return wrap


def get_rule(op: object) -> Rule | None:
    rule = RULES.get(op)  # type: ignore[call-overload]
    if rule is None and spec_of(op) is not None:  # a region's op, defined at capture
        return regions.region_rule
    return rule


def register_dtensor_rules() -> None:
    """Register autopar's DTensor strategies (the CPU flash-attention kernels that eager
    DTensor programs reach from ``scaled_dot_product_attention``, BatchNorm's statistics)
    into DTensor's propagator, and its handlers of random ops (:mod:`.random_ops`) and of
    the regions defined so far (:mod:`.regions`).
    Also lets DTensor's strided-shard index arithmetic run untraced
    (:func:`~autopar._compat.untraced_strided_offsets`).
    Idempotent; never run on import."""
    untraced_strided_offsets()
    attention.register_dtensor()
    batch_norm.register_dtensor()
    random_ops.register_dtensor()
    regions.register_dtensor()


from autopar.passes.strategies.rules import (  # noqa: E402, F401  (fill RULES)
    attention,
    batch_norm,
    fused,
    random_ops,
    regions,
)

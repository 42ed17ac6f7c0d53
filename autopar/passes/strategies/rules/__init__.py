"""autopar's own strategy rules, for ops DTensor's registry does not cover.

One file per op family. A rule is ``rule(node, mesh) -> list[NodeStrategy]`` registered with
``@register_rule(op, ...)``; it is consulted before DTensor's registry, so a rule may also
override a DTensor strategy that plans must not use. A rule whose op also runs in eager
DTensor programs registers the equivalent DTensor strategy (``register_dtensor``) so that
executing a plan agrees with planning it. Importing this package registers everything;
registration is idempotent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh

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
    return RULES.get(op)  # type: ignore[call-overload]


from autopar.passes.strategies.rules import attention, fused  # noqa: E402, F401  (registers rules)

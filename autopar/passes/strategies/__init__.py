"""Candidate sharding strategies per FX node, on an N-D device mesh.

``enumerate_strategies(gm, mesh) -> {node: [NodeStrategy]}`` is the stage's one entry point
(see :mod:`.enumerate` for the per-node contract). Strategies come from DTensor's own
registry (:mod:`.from_dtensor`) first, and from autopar's rules (:mod:`.rules`, one file per
op family, ``@register_rule(op)``) for ops DTensor does not cover. Importing this package
leaves DTensor's registry alone: :func:`register_dtensor_rules` (idempotent; called by
``enumerate_strategies`` and by lowering) registers autopar's DTensor strategies, so that
eager DTensor execution of a plan agrees with planning it.
"""

from autopar.passes.strategies.enumerate import (
    enumerate_strategies,
    node_strategies,
    storage_specs,
)
from autopar.passes.strategies.rules import RULES, register_dtensor_rules, register_rule
from autopar.passes.strategies.spec import (
    NodeStrategy,
    Spec,
    is_valid_spec,
    placement_str,
    spec_str,
    summed_spec,
    tensor_inputs,
)

__all__ = [
    "RULES",
    "NodeStrategy",
    "Spec",
    "enumerate_strategies",
    "is_valid_spec",
    "node_strategies",
    "placement_str",
    "register_dtensor_rules",
    "register_rule",
    "spec_str",
    "storage_specs",
    "summed_spec",
    "tensor_inputs",
]

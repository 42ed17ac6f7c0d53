"""Strategies of regions (:mod:`autopar.capture.regions`): the placements they declare.

On each mesh axis a region's forward op ``(inputs..., params...) -> outputs`` takes one of:

* ``replicate``: everything Replicate (every rank computes the whole region);
* ``rows``: inputs and outputs ``Shard(0)``, parameters Replicate (a batch shard);
* ``experts`` (regions with ``compute_expert_parallel``): as ``rows``, and the expert
  parameters ``Shard(0)``; the computation moves tokens to their experts' ranks over the
  axis's process group. At most one axis per strategy.

Its backward op ``(inputs..., params..., grad_outputs...) -> grads`` follows the forward's
choice: grads of inputs like the inputs, of parameters ``Partial`` where rows are split and
the parameter is not (``Shard(0)`` for an expert parameter on its experts axis).

At run time DTensor dispatches the ops through :func:`region_handler`, which passes the
process group of the experts axis (its name) to the local op, so that the traced per-rank
program calls the region's expert-parallel computation with that group.
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
    dispatch_with_local,
    expand_to_full_mesh_op_strategy,
    op_strategy_func,
    register_dtensor_handler,
    register_op_strategy,
)
from autopar.capture.regions import REGIONS, RegionSpec, is_backward, spec_of
from autopar.passes.strategies.from_dtensor import expand_per_axis
from autopar.passes.strategies.spec import NodeStrategy

REPLICATE, ROWS, EXPERTS = "replicate", "rows", "experts"


def modes(spec: RegionSpec) -> tuple[str, ...]:
    """The per-axis choices of a region (module docstring)."""
    return (REPLICATE, ROWS, EXPERTS) if spec.shards_experts else (REPLICATE, ROWS)


def forward_rule(spec: RegionSpec, mode: str) -> list[Placement]:
    """``[outputs..., args...]`` of the forward op on one axis in ``mode``."""
    if mode == REPLICATE:
        return [Replicate()] * (spec.n_outputs + spec.n_args)
    args: list[Placement] = [
        Shard(0) if i < spec.n_inputs or (mode == EXPERTS and spec.is_expert(i)) else Replicate()
        for i in range(spec.n_args)
    ]
    return [Shard(0)] * spec.n_outputs + args


def backward_rule(spec: RegionSpec, mode: str) -> list[Placement]:
    """``[grads..., args..., grad_outputs...]`` of the backward op on one axis in ``mode``."""
    forward = forward_rule(spec, mode)
    outs, args = forward[: spec.n_outputs], forward[spec.n_outputs :]
    grads = [Partial() if mode != REPLICATE and p == Replicate() else p for p in args]
    return grads + args + outs


def one_experts_axis(inputs, spec: RegionSpec) -> bool:
    """At most one axis shards the experts (the local computation takes one group)."""
    for i, placements in enumerate(inputs[: spec.n_args]):
        if spec.is_expert(i) and placements is not None:
            if sum(1 for p in placements if p == Shard(0)) > 1:
                return False
    return True


def experts_axis(spec: RegionSpec, placements_of_args) -> int | None:
    """The mesh axis on which the expert parameters are ``Shard(0)``, if any."""
    for i, placements in enumerate(placements_of_args[: spec.n_args]):
        if spec.is_expert(i) and placements is not None:
            for axis, p in enumerate(placements):
                if p == Shard(0):
                    return axis
    return None


def experts_axis_of(node: fx.Node, strategy: NodeStrategy) -> int | None:
    """For a region's forward node under ``strategy``: its experts axis, if any."""
    spec = spec_of(node.target)
    return None if spec is None else experts_axis(spec, strategy.inputs)


# ------------------------------------------------------------------ planning rule


def region_rule(node: fx.Node, mesh: DeviceMesh) -> list[NodeStrategy]:
    spec = spec_of(node.target)
    assert spec is not None and not is_backward(node.target), node
    rules = [forward_rule(spec, m) for m in modes(spec)]
    found = expand_per_axis(node, rules, spec.n_outputs, mesh)
    return [s for s in found if one_experts_axis(s.inputs, spec)]


# ------------------------------------------------------------------ DTensor


def _dtensor_strategy(spec: RegionSpec, backward: bool):
    def strategy(op_schema: OpSchema) -> OpStrategy:
        rule = backward_rule if backward else forward_rule
        rules = [rule(spec, m) for m in modes(spec)]
        n_out = spec.n_args if backward else spec.n_outputs
        mesh = op_schema.get_mesh_from_args(validate=False)
        found = expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=n_out)  # type: ignore[arg-type]
        kept = [
            s
            for s in found.strategies
            if one_experts_axis([sp.placements for sp in s.input_specs], spec)
        ]
        return OpStrategy(kept)

    return strategy


def region_handler(op_call, args: tuple, kwargs: dict) -> object:
    """DTensor's dispatch of a region op, the local op told its experts axis's group."""
    spec = spec_of(op_call)
    assert spec is not None

    def local(local_args: tuple, local_kwargs: dict, out_spec, in_specs) -> object:
        axis = experts_axis(spec, [s.placements for s in in_specs])
        group = "" if axis is None else in_specs[0].mesh.get_group(axis).group_name
        return op_call(*local_args[:-1], group, **local_kwargs)

    return dispatch_with_local(op_call, args, kwargs, local)


def register_dtensor() -> None:
    """DTensor strategies and handlers of every region defined so far (idempotent)."""
    for spec in REGIONS.values():
        for op, backward in ((spec.forward, False), (spec.backward, True)):
            if op_strategy_func(op) is not None:
                continue
            n_tensors = spec.n_args + (spec.n_outputs if backward else 0)
            info = RuntimeSchemaInfo(static_argnum=n_tensors)
            register_op_strategy(op, _dtensor_strategy(spec, backward), info)
            register_dtensor_handler(op, region_handler)

"""Seconds of one parameter's optimizer update on one device: what `runtime.optimizer` runs
once per step, after the last gradient is reduced (`update_time`).

The update is memory-bound: it streams what torch's default update loop moves (its
single-tensor loop on CPU, the same kernels as foreach ones on a GPU; `runtime.optimizer`
runs the user's torch optimizer): `LOOP_PASSES` master-sized elements per element it
updates, read or written by its kernels (AdamW, 8 kernels: the decay `mul_` 2, the first
moment's `lerp_` 3, the second's `mul_` 2 and `addcmul_` 3, `sqrt` 2 and `div` 2 into
new tensors, `add_` 2, the step's `addcdiv_` 4: 20; a fused kernel would move 7), those
writing in place at `DeviceSpec.memory_in_place`, and under mixed precision it refreshes
the working copy from the master (one master read, one compute-dtype write). On 4 CPU
processes a 10M-parameter MLP's AdamW loop took ~65 ms a step where its 7 fused passes
were priced 35. ZeRO (`shard_optimizer`) updates only the device's flat shard of the
parameter (1 / the devices replicating it). Each kernel of the loop pays the launch cost.
A device whose loop `autopar calibrate` timed (`DeviceSpec.update_rates`) takes that
instead: the tensor's elements at the rate measured for its size (the passes' bytes
under-priced a CPU's loop of 16 MiB tensors ~2x: its `sqrt` and `div` outputs are fresh
mappings there; 256 KiB ones ran ~2x the 16 MiB ones' rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autopar.cluster import Cluster
from autopar.cost_models.compute import compute_time
from autopar.cost_models.memory import FP32_BYTES, local_numel, optimizer_states, replicas

__all__ = ["LOOP_PASSES", "update_time"]

# per optimizer states, torch's update loop as ((passes, kernels) writing in place,
# (passes, kernels) writing new tensors), a pass one master-sized element moved per
# updated element: SGD (`add_`), SGD with momentum (`mul_`, `add_`, `add_`), Adam/AdamW
# (above: `sqrt` and `div` write new tensors)
LOOP_PASSES = {0: ((3, 1), (0, 0)), 1: ((8, 3), (0, 0)), 2: ((16, 6), (4, 2))}


def update_time(
    shape: Sequence[int],
    dtype: torch.dtype,
    spec: Sequence[Any],
    mesh_shape: Sequence[int],
    cluster: Cluster,
    optimizer: int | str = 2,
    shard_optimizer: bool = False,
    mixed_precision: bool = False,
) -> float:
    """Seconds of the update of a parameter of ``shape`` (captured ``dtype``: the compute
    dtype under the policy) placed as ``spec`` on a device (module docstring)."""
    states = optimizer_states(optimizer) if isinstance(optimizer, str) else optimizer
    n = local_numel(shape, spec, mesh_shape)
    if shard_optimizer:
        n = -(-n // replicas(spec, mesh_shape))
    if n <= 0:
        return 0.0
    master = FP32_BYTES if mixed_precision else dtype.itemsize
    rate = cluster.device.update_rate(states, n)
    if rate:  # the loop as timed here (float32 elements: by their bytes for other dtypes)
        refresh = n * (master + dtype.itemsize) if mixed_precision else 0.0
        copy = compute_time(0.0, refresh, "float32", cluster, op="memory") if refresh else 0.0
        return n * master / FP32_BYTES / rate + copy
    (in_place, kernels), (new, allocating) = LOOP_PASSES.get(
        states, ((3 + 6 * states, 1 + 2 * states), (2 * states, states))
    )
    fresh = n * master * new
    if mixed_precision:  # the working copy refreshed: one more kernel
        fresh += n * (master + dtype.itemsize)
        allocating += 1
    moved = n * master * in_place
    return compute_time(
        0.0, moved, "float32", cluster, op="memory", kernels=kernels, in_place=True
    ) + compute_time(0.0, fresh, "float32", cluster, op="memory", kernels=max(allocating, 1))

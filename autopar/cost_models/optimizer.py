"""Seconds of one parameter's optimizer update on one device: what `runtime.optimizer` runs
once per step, after the last gradient is reduced (`update_time`).

The update is memory-bound: it streams every element it updates once, reading the master
parameter, its gradient and each optimizer state and writing the parameter and each state,
(3 + 2 * states) master-sized elements (AdamW: 7 x 4 bytes, the traffic of a fused kernel;
torch's foreach and single-tensor loops make more passes, partly from cache), and under
mixed precision it refreshes the working copy from the master (one master read, one
compute-dtype write). ZeRO (`shard_optimizer`) updates only the device's flat shard of the
parameter (1 / the devices replicating it). `UPDATE_KERNELS` kernels per parameter
(AdamW's loop: the moments, their corrections, the step) pay the launch cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autopar.cluster import Cluster
from autopar.cost_models.compute import compute_time
from autopar.cost_models.memory import FP32_BYTES, local_numel, optimizer_states, replicas

__all__ = ["UPDATE_KERNELS", "update_time"]

UPDATE_KERNELS = 8


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
    nbytes = n * master * (3 + 2 * states)
    if mixed_precision:
        nbytes += n * (master + dtype.itemsize)
    return compute_time(0.0, nbytes, "float32", cluster, op="memory", kernels=UPDATE_KERNELS)

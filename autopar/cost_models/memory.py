"""Memory cost model: bytes per device of tensors, parameters and optimizer state.

The search (``autopar.search.costs``) prices every node's memory with these formulas; there
is no other memory model.

Local shapes
------------
A spec is one DTensor placement per mesh axis. Axes apply in mesh order (DTensor's default
shard order), each ``Shard(d)`` on an axis of size ``n`` splits the *current* local size of
dim ``d`` into ``ceil(size / n)`` (the largest shard, which is what a device must hold and
what a padded collective moves). ``Replicate`` and ``Partial`` (incl. ``_MaskPartial``) keep
the full size: a partial tensor is full-size on every device.

Training state (``param_state_bytes``)
--------------------------------------
``bytes = local_numel * per_element`` with, for a tensor of itemsize ``b`` and ``k``
optimizer states (``OPTIMIZER_STATES``: AdamW/Adam 2, SGD with momentum / Adagrad /
RMSprop 1, plain SGD 0):

* not trained (buffer, input): ``b``;
* fp32 (any dtype not bf16/fp16) parameter: ``2b + k*b`` (parameter, gradient, states in
  the parameter's dtype, as PyTorch's optimizers keep them);
* bf16/fp16 parameter, trained in mixed precision as Megatron and torchtitan do:
  ``2b + 4*(1 + k)`` (parameter and gradient in its own dtype, an fp32 master copy and fp32
  states).

With ``shard_optimizer`` (ZeRO-1, Megatron's distributed optimizer) the master copy and
states (the ``k*b`` or ``4*(1 + k)`` term) are divided by ``replicas``, the number of
devices holding the same shard (product of the sizes of the mesh axes on which the spec
is ``Replicate``), at no extra time: reduce-scatter + all-gather moves what the gradient
all-reduce already does.

Activations
-----------
``activation_bytes`` is the local bytes of a tensor kept for backward; which tensors are
kept is the caller's (the search's) decision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "FP32_BYTES",
    "LOW_PRECISION",
    "OPTIMIZER_STATES",
    "activation_bytes",
    "local_numel",
    "local_shape",
    "optimizer_states",
    "param_state_bytes",
    "replicas",
    "shard_dim",
    "state_bytes_per_element",
]

# Optimizer state tensors per parameter, each the size of the parameter.
OPTIMIZER_STATES: dict[str, int] = {
    "adamw": 2,
    "adam": 2,
    "sgd": 0,
    "sgd_momentum": 1,
    "adagrad": 1,
    "rmsprop": 1,
}
LOW_PRECISION = (torch.bfloat16, torch.float16)  # trained with an fp32 master copy
FP32_BYTES = 4


def shard_dim(placement: Any) -> int | None:
    """Tensor dim a placement shards (``Shard`` and ``_StridedShard``), else ``None``."""
    if placement.is_replicate() or placement.is_partial():
        return None
    return getattr(placement, "dim", None)


def local_shape(
    shape: Sequence[int], spec: Sequence[Any], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Shape of the largest local shard of a ``shape`` tensor placed as ``spec``."""
    if len(spec) != len(mesh_shape):
        raise ValueError(
            f"spec {tuple(spec)} has {len(spec)} placements for mesh {tuple(mesh_shape)}"
        )
    out = [int(s) for s in shape]
    for placement, n in zip(spec, mesh_shape, strict=True):
        d = shard_dim(placement)
        if d is None:
            continue
        if not -len(out) <= d < len(out):
            raise ValueError(f"{placement} shards dim {d} of a {len(out)}-D tensor {tuple(shape)}")
        d %= len(out)
        out[d] = -(-out[d] // n)  # ceil: uneven shards pad to the largest one
    return tuple(out)


def local_numel(shape: Sequence[int], spec: Sequence[Any], mesh_shape: Sequence[int]) -> int:
    """Elements of the largest local shard (see ``local_shape``)."""
    return math.prod(local_shape(shape, spec, mesh_shape))


def replicas(spec: Sequence[Any], mesh_shape: Sequence[int]) -> int:
    """Devices holding the same shard: the product of the ``Replicate`` axes' sizes."""
    return math.prod(size for p, size in zip(spec, mesh_shape, strict=True) if p.is_replicate())


def optimizer_states(optimizer: str) -> int:
    """State tensors per parameter of a named optimizer (see ``OPTIMIZER_STATES``)."""
    key = optimizer.lower()
    if key not in OPTIMIZER_STATES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)} "
            "(or pass its number of state tensors per parameter)"
        )
    return OPTIMIZER_STATES[key]


def state_bytes_per_element(
    dtype: torch.dtype,
    states: int = 2,
    *,
    trained: bool = True,
    replicas: int = 1,
    shard_optimizer: bool = False,
) -> float:
    """Bytes per local element of a tensor and, when ``trained``, its gradient, master copy
    and ``states`` optimizer states (see the module docstring)."""
    size = dtype.itemsize
    if not trained:
        return size
    if dtype in LOW_PRECISION:
        master_and_states = FP32_BYTES * (1 + states)
    else:
        master_and_states = size * states
    return 2 * size + master_and_states / (replicas if shard_optimizer else 1)


def param_state_bytes(
    shape: Sequence[int],
    dtype: torch.dtype,
    spec: Sequence[Any],
    mesh_shape: Sequence[int],
    *,
    optimizer: int | str = 2,
    trained: bool = True,
    shard_optimizer: bool = False,
) -> float:
    """Bytes one device holds for a parameter (``trained``) or a buffer/input placed as
    ``spec``: its local shard times ``state_bytes_per_element``. ``optimizer``: a name in
    ``OPTIMIZER_STATES`` or the number of state tensors per parameter."""
    states = optimizer_states(optimizer) if isinstance(optimizer, str) else optimizer
    per_element = state_bytes_per_element(
        dtype,
        states,
        trained=trained,
        replicas=replicas(spec, mesh_shape),
        shard_optimizer=shard_optimizer,
    )
    return float(local_numel(shape, spec, mesh_shape) * per_element)


def activation_bytes(
    shape: Sequence[int], itemsize: int, spec: Sequence[Any] | None, mesh_shape: Sequence[int]
) -> int:
    """Local bytes of an activation of ``shape`` placed as ``spec`` (``None``: replicated)."""
    if spec is None:
        return math.prod(int(s) for s in shape) * itemsize
    return local_numel(shape, spec, mesh_shape) * itemsize

"""Memory cost model: bytes per device of tensors, parameters and optimizer state.

Local shapes
------------
A spec is one DTensor placement per mesh axis. Axes apply in mesh order (DTensor's default
shard order), each ``Shard(d)`` on an axis of size ``n`` splits the *current* local size of
dim ``d`` into ``ceil(size / n)`` (the largest shard, which is what a device must hold and
what a padded collective moves). ``Replicate`` and ``Partial`` (incl. ``_MaskPartial``) keep
the full size: a partial tensor is full-size on every device.

Training state (``param_state_bytes``)
--------------------------------------
``bytes = numel * itemsize * (1 + grad + states)``: the parameter, its gradient (same dtype)
and the optimizer state tensors, which PyTorch's optimizers keep in the parameter's dtype:
AdamW/Adam ``exp_avg`` + ``exp_avg_sq`` (2), SGD with momentum / Adagrad / RMSprop (1),
plain SGD (0). ``numel`` is the *local* numel, so ZeRO/FSDP sharding is accounted for by the
caller passing ``local_numel(shape, spec, mesh_shape)``. Mixed-precision fp32 master weights
are not modelled (plans keep one dtype per parameter).

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
    "OPTIMIZER_STATES",
    "activation_bytes",
    "local_numel",
    "local_shape",
    "param_state_bytes",
    "shard_dim",
    "tensor_bytes",
    "val_bytes",
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


def tensor_bytes(shape: Sequence[int], itemsize: int) -> int:
    return math.prod(int(s) for s in shape) * itemsize


def val_bytes(val: Any) -> int:
    """Bytes of a ``meta["val"]``: a (Fake)Tensor, or a tuple/list of them; others count 0."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(val_bytes(v) for v in val)
    return 0


def activation_bytes(
    shape: Sequence[int], itemsize: int, spec: Sequence[Any] | None, mesh_shape: Sequence[int]
) -> int:
    """Local bytes of an activation of ``shape`` placed as ``spec`` (``None``: replicated)."""
    if spec is None:
        return tensor_bytes(shape, itemsize)
    return local_numel(shape, spec, mesh_shape) * itemsize


def param_state_bytes(
    numel: int, itemsize: int, optimizer: str = "adamw", *, requires_grad: bool = True
) -> int:
    """Bytes for a parameter, its gradient and optimizer state (see module docstring)."""
    key = optimizer.lower()
    if key not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)}")
    copies = 1 + (1 + OPTIMIZER_STATES[key] if requires_grad else 0)
    return int(numel) * itemsize * copies

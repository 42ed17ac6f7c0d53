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

Training state (``param_state_bytes``, ``param_state_breakdown``)
-----------------------------------------------------------------
Exactly what the runtime holds per parameter (``autopar.runtime.optimizer``). For a local
shard of ``N`` elements (``local_numel``), ``k`` optimizer states (``OPTIMIZER_STATES``:
AdamW/Adam 2, SGD with momentum / Adagrad / RMSprop 1, plain SGD 0), ``w`` the itemsize of
the captured dtype (the compute dtype under a mixed-precision policy, else the model's own)
and ``m`` the itemsize of the master, gradient and states (4 under the policy, else ``w``):

* not trained (buffer, input): ``N*w`` (category ``buffers``);
* plain (the model's own dtype, bf16 included: no master copy):
  parameters ``N*w``, gradients ``N*w``, optimizer_state ``k*N*w``;
* mixed precision (``mixed_precision``): parameters ``N*4`` (the fp32 master the program
  reads) ``+ N*w`` (its compute-dtype cast, saved for backward), gradients ``N*4`` (reduced
  in ``reduce_dtype``, held fp32), optimizer_state ``k*N*4``;
* ZeRO (``shard_optimizer``), with ``S = ceil(N / R)`` (``R = replicas``, the flat shard is
  padded): parameters ``N*w`` (the working parameter), optimizer_state ``(1 + k)*S*m`` (the
  flat master and states), gradients ``S*m`` (the flat gradient shard) ``+ N*w`` (the
  full-size gradient buffer, ZeRO-1 only; ZeRO-2, ``shard_gradients``, frees it in backward).

Time: ZeRO's reduce-scatter (in backward) + all-gather (after the update) move the volume
of the all-reduce the search prices for a replicated parameter's gradient, so the search
keeps pricing that all-reduce.

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
    "param_state_breakdown",
    "param_state_bytes",
    "replicas",
    "shard_dim",
    "shard_splits",
    "split_shape",
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
LOW_PRECISION = (torch.bfloat16, torch.float16)  # the compute dtypes of the policy
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
    return split_shape(shape, shard_splits(spec, mesh_shape))


def shard_splits(spec: Sequence[Any], mesh_shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(tensor dim, axis size) of each mesh axis whose placement shards a dim, in mesh order:
    the divisions `local_shape` makes, read of the spec alone (`split_shape` applies them to
    any shape; the cost models keep them per pair of specs)."""
    if len(spec) != len(mesh_shape):
        raise ValueError(
            f"spec {tuple(spec)} has {len(spec)} placements for mesh {tuple(mesh_shape)}"
        )
    return tuple(
        (d, int(n))
        for p, n in zip(spec, mesh_shape, strict=True)
        if (d := shard_dim(p)) is not None
    )


def split_shape(shape: Sequence[int], splits: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """`shape` divided as `splits` (`shard_splits`) divides it: each sharded dim's size
    becomes ``ceil(size / n)`` (uneven shards pad to the largest one)."""
    out = [int(s) for s in shape]
    for d, n in splits:
        if not -len(out) <= d < len(out):
            raise ValueError(f"Shard({d}) shards dim {d} of a {len(out)}-D tensor {tuple(shape)}")
        d %= len(out)
        out[d] = -(-out[d] // n)
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


def param_state_breakdown(
    shape: Sequence[int],
    dtype: torch.dtype,
    spec: Sequence[Any],
    mesh_shape: Sequence[int],
    *,
    optimizer: int | str = 2,
    trained: bool = True,
    shard_optimizer: bool = False,
    shard_gradients: bool = False,
    mixed_precision: bool = False,
) -> dict[str, float]:
    """Bytes one device holds for a parameter (``trained``) or a buffer/input placed as
    ``spec``, by memory category (parameters, gradients, optimizer_state; buffers when not
    trained). ``dtype``: the captured one (the compute dtype under the policy)."""
    states = optimizer_states(optimizer) if isinstance(optimizer, str) else optimizer
    n = local_numel(shape, spec, mesh_shape)
    w = dtype.itemsize
    if not trained:
        return {"buffers": float(n * w)}
    m = FP32_BYTES if mixed_precision else w
    if not shard_optimizer:
        return {
            "parameters": float(n * m + (n * w if mixed_precision else 0)),
            "gradients": float(n * m),
            "optimizer_state": float(states * n * m),
        }
    s = -(-n // replicas(spec, mesh_shape))
    return {
        "parameters": float(n * w),
        "gradients": float(s * m + (0 if shard_gradients else n * w)),
        "optimizer_state": float((1 + states) * s * m),
    }


def param_state_bytes(
    shape: Sequence[int],
    dtype: torch.dtype,
    spec: Sequence[Any],
    mesh_shape: Sequence[int],
    *,
    optimizer: int | str = 2,
    trained: bool = True,
    shard_optimizer: bool = False,
    shard_gradients: bool = False,
    mixed_precision: bool = False,
) -> float:
    """The total of ``param_state_breakdown``. ``optimizer``: a name in
    ``OPTIMIZER_STATES`` or the number of state tensors per parameter."""
    return sum(
        param_state_breakdown(
            shape,
            dtype,
            spec,
            mesh_shape,
            optimizer=optimizer,
            trained=trained,
            shard_optimizer=shard_optimizer,
            shard_gradients=shard_gradients,
            mixed_precision=mixed_precision,
        ).values()
    )


def activation_bytes(
    shape: Sequence[int], itemsize: int, spec: Sequence[Any] | None, mesh_shape: Sequence[int]
) -> int:
    """Local bytes of an activation of ``shape`` placed as ``spec`` (``None``: replicated)."""
    if spec is None:
        return math.prod(int(s) for s in shape) * itemsize
    return local_numel(shape, spec, mesh_shape) * itemsize

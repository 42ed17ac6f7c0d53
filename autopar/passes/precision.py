"""The parameter boundary of a lowered step: mixed-precision casts and ZeRO gradient shards.

`ParamBoundary.of(plan)` reads `plan.memory` (param_dtype, reduce_dtype, loss_scaling,
shard_optimizer, shard_gradients); lowering (`passes.lower`, `runtime.pipeline`) calls
`boundary.wrap(...)` where a parameter's local tensor enters the program as a DTensor.

Mixed precision (FSDP2's `MixedPrecisionPolicy`): the program takes the fp32 master shard;
`wrap` casts it to the compute dtype *before* any redistribution (so an FSDP all-gather
moves compute-dtype bytes) and, in backward, casts the gradient that reaches the parameter
to `reduce_dtype` first and then redistributes it to the storage placement (the Partial ->
Replicate data-parallel all-reduce, Partial -> Shard reduce-scatter of a parameter stored
sharded on a replicated-use axis, run in `reduce_dtype`), then to fp32 for the master.
A reduction that DTensor runs *downstream* of the boundary (the backward of the all-gather
at an FSDP weight's use) runs in the compute dtype: the cast sits at the storage shard.

ZeRO (`shard_optimizer`): the gradient is not reduced to the storage placement on the
parameter's replicated axes `A` (mesh axes where its storage spec is `Replicate`,
`R = prod(size(a) for a in A)`). `wrap` takes two tensors: the working parameter (the
local shard at its storage spec, in the compute dtype under the policy) and the *flat
master shard* that receives the gradient: with `N` local elements padded to
`L = ceil(N / R) * R`, the shard of the rank at coordinates `c` is elements
`[j * L / R, (j + 1) * L / R)` of the flattened, zero-padded local tensor, `j` the rank's
index in the nested (mesh-order) split over `A`, i.e. DTensor's `Shard(0)` on every axis of
`A`. Backward redistributes the (reduce-dtype) gradient from `Partial` to `Shard(0)` on the
axes where it is partial (a reduce-scatter) and takes the local chunk where it is already
replicated, inside the backward pass, so the full gradient dies there (ZeRO-2). With
ZeRO-1 (`shard_gradients=False`) the full local gradient, unreduced on `A`, is also
returned as the working parameter's gradient: the full-size buffer Megatron's
distributed optimizer keeps.

Loss scaling (fp16): the program takes one more input, the scale; the loss is multiplied
by it before `autograd.grad` (`scaled_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.plan import Plan, Spec

LOSS_SCALE = "loss_scale"  # the name of the scale input when loss scaling


@dataclass(frozen=True, slots=True)
class ParamBoundary:
    """How a parameter enters the lowered program (see the module docstring)."""

    compute_dtype: torch.dtype | None = None  # None: the parameter's own dtype, no casts
    reduce_dtype: torch.dtype | None = None
    shard_optimizer: bool = False
    shard_gradients: bool = False
    loss_scaling: bool = False

    @classmethod
    def of(cls, plan: Plan) -> ParamBoundary:
        m = plan.memory
        return cls(
            compute_dtype=_dtype(m.param_dtype),
            reduce_dtype=_dtype(m.reduce_dtype or m.param_dtype),
            shard_optimizer=m.shard_optimizer,
            shard_gradients=m.shard_gradients,
            loss_scaling=m.loss_scaling,
        )

    @property
    def plain(self) -> bool:
        """Today's boundary: the local tensor wrapped as it is, gradients reduced to it."""
        return self.compute_dtype is None and not self.shard_optimizer

    def extra_names(self, params: Sequence[str]) -> list[str]:
        """Program inputs after (params, buffers, inputs): flat master shards, the scale."""
        out = [flat_name(p) for p in params] if self.shard_optimizer else []
        return out + ([LOSS_SCALE] if self.loss_scaling else [])

    def grad_targets(
        self, params: Sequence[torch.Tensor], extras: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """What the program returns gradients for, in order."""
        if not self.shard_optimizer:
            return list(params)
        flats = list(extras[: len(params)])
        return flats if self.shard_gradients else [*params, *flats]

    def scaled_loss(self, loss: torch.Tensor, extras: Sequence[torch.Tensor]) -> torch.Tensor:
        return loss.float() * extras[-1] if self.loss_scaling else loss

    def wrap(
        self,
        local: torch.Tensor,
        spec: Spec,
        shape: Sequence[int],
        mesh: DeviceMesh,
        flat: torch.Tensor | None = None,
    ) -> DTensor:
        """The parameter as the captured graph reads it (compute dtype, storage spec)."""
        if self.shard_optimizer:
            assert flat is not None, "ZeRO needs the flat master shard"
            return _ZeroBoundary.apply(local, flat, self, tuple(spec), tuple(shape), mesh)
        return _CastBoundary.apply(local, self, tuple(spec), tuple(shape), mesh)


def flat_name(param: str) -> str:
    return f"{param}__flat"


def replicated_axes(spec: Spec) -> tuple[int, ...]:
    return tuple(a for a, p in enumerate(spec) if isinstance(p, Replicate))


def flat_length(numel: int, spec: Spec, mesh_shape: Sequence[int]) -> int:
    """`L`: the local element count padded to a multiple of the replica count."""
    r = math.prod(mesh_shape[a] for a in replicated_axes(spec))
    return -(-numel // r) * r


def flat_spec(spec: Spec) -> Spec:
    """The flat master's placements: Shard(0) on the replicated axes, else Replicate (no
    communication on axes where the parameter is already sharded)."""
    return tuple(Shard(0) if isinstance(p, Replicate) else Replicate() for p in spec)


def flat_shard(local: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's flat shard of a local tensor already equal on its replicated axes."""
    flat = _padded_flat(local, spec, mesh)
    for axis in replicated_axes(spec):
        flat = flat.chunk(mesh.size(axis))[mesh.get_coordinate()[axis]]
    return flat.clone()


def gather_flat(
    flat: torch.Tensor, spec: Spec, mesh: DeviceMesh, local_shape: Sequence[int]
) -> torch.Tensor:
    """The local tensor at `spec` from every replica's flat shard (an all-gather over the
    replicated axes; a collective: every rank calls it)."""
    r = math.prod(mesh.size(a) for a in replicated_axes(spec))
    if r == 1:
        return flat.reshape(local_shape)
    length = flat.numel() * r
    dt = DTensor.from_local(
        flat, mesh, flat_spec(spec), run_check=False, shape=torch.Size([length]), stride=(1,)
    )
    full = dt.redistribute(mesh, tuple(Replicate() for _ in spec)).to_local()
    return full[: math.prod(local_shape)].reshape(local_shape)


def _padded_flat(local: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    flat = local.reshape(-1)
    pad = flat_length(flat.numel(), spec, mesh.shape) - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)) if pad else flat


def _dtype(name: str | None) -> torch.dtype | None:
    return getattr(torch, name) if name else None


def _from_local(local: torch.Tensor, spec: Spec, shape, mesh: DeviceMesh) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, spec, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _in_compute(local: torch.Tensor, b: ParamBoundary) -> torch.Tensor:
    if b.compute_dtype is None or local.dtype == b.compute_dtype:
        return local.detach()
    return local.detach().to(b.compute_dtype)


def _reduce_dtype(grad: DTensor, b: ParamBoundary) -> DTensor:
    want = b.reduce_dtype
    return grad if want is None or grad.dtype == want else grad.to(want)


class _CastBoundary(torch.autograd.Function):
    """forward: the local shard cast to the compute dtype, as a DTensor at `spec`;
    backward: gradient -> reduce dtype -> storage spec (the reduction) -> the local dtype."""

    @staticmethod
    def forward(ctx, local, b: ParamBoundary, spec, shape, mesh):
        ctx.b, ctx.spec, ctx.mesh, ctx.dtype = b, spec, mesh, local.dtype
        return _from_local(_in_compute(local, b), spec, shape, mesh)

    @staticmethod
    def backward(ctx, grad: DTensor):
        g = _reduce_dtype(grad, ctx.b)
        if tuple(g.placements) != ctx.spec:
            g = g.redistribute(ctx.mesh, ctx.spec)
        return g.to_local().to(ctx.dtype), None, None, None, None


class _ZeroBoundary(torch.autograd.Function):
    """forward: the working parameter as a DTensor at `spec` (cast under the policy);
    backward: the gradient reduce-scattered into the flat master shard's gradient."""

    @staticmethod
    def forward(ctx, local, flat, b: ParamBoundary, spec, shape, mesh):
        ctx.b, ctx.spec, ctx.mesh = b, spec, mesh
        ctx.dtypes = (local.dtype, flat.dtype)
        ctx.flat_numel = flat.numel()
        return _from_local(_in_compute(local, b), spec, shape, mesh)

    @staticmethod
    def backward(ctx, grad: DTensor):
        b, spec, mesh = ctx.b, ctx.spec, ctx.mesh
        g = _reduce_dtype(grad, b)
        # reduce to the storage spec except on the replicated axes where the gradient is
        # partial: those are reduce-scattered into the flat shard below
        keep = tuple(
            gp if isinstance(sp, Replicate) and gp.is_partial() else sp
            for sp, gp in zip(spec, g.placements, strict=True)
        )
        if tuple(g.placements) != keep:
            g = g.redistribute(mesh, keep)
        local = g.to_local()
        flat = _padded_flat(local, spec, mesh)
        src = tuple(p if p.is_partial() else Replicate() for p in keep)
        dt = DTensor.from_local(flat, mesh, src, run_check=False, shape=flat.shape, stride=(1,))
        shard = dt.redistribute(mesh, flat_spec(spec)).to_local()
        assert shard.numel() == ctx.flat_numel, (shard.shape, ctx.flat_numel)
        # a storage of its own: a chunk (an axis without a reduction) or the local
        # gradient itself (no replicated axis) would keep the full gradient alive through
        # the view. Reduce-scattered on every replicated axis, the shard is the collective's
        # own result (or its slice of a gradient bucket, `passes.comm`): no copy
        axes = replicated_axes(spec)
        fresh = bool(axes) and all(src[a].is_partial() for a in axes)
        if shard.dtype != ctx.dtypes[1]:
            out = shard.to(ctx.dtypes[1])
        else:
            out = shard if fresh else shard.clone()
        full = None if b.shard_gradients else local.to(ctx.dtypes[0])
        return full, out, None, None, None, None

"""What a rank holds per parameter and how the optimizer updates it: plain, mixed
precision (fp32 master), ZeRO-1/2 (flat master shards) and fp16 dynamic loss scaling.

`ParamState(shards, specs, mesh, boundary, optimizer)` takes the local shards of the user's
parameters at their storage placements (the model's own dtype, fp32 for a mixed-precision
run) and `passes.precision.ParamBoundary.of(plan)`. Per parameter of `N` local elements,
`R` replicas (product of the mesh axes its spec is `Replicate` on), model dtype bytes `b`,
compute dtype bytes `c`, `k` optimizer state tensors, this rank holds:

    setting             between steps                        during the step, in addition
    plain               param N*b, grad N*b, states k*N*b
    mixed precision     master N*4 (the program's input and  the cast working copy N*c
                        the optimizer's param), grad N*4     (saved for backward)
                        (reduced in reduce_dtype, then fp32),
                        states k*N*4
    ZeRO-1              working param N*b (N*c under the     -
                        policy), flat master N/R*b (*4),
                        flat grad N/R*b (*4), full-size
                        grad buffer N*b (N*c), states k*N/R
    ZeRO-2              as ZeRO-1 without the full-size      the full gradient, freed in
                        gradient buffer                      backward by its reduce-scatter

(`N/R` is `ceil(N/R)`: the flat shard is padded.) `cost_models.memory` prices exactly
these. The ZeRO update: the optimizer steps the flat masters, then every rank all-gathers
them over the replicated axes into the working parameters (in the compute dtype under the
policy: a bf16 all-gather), so the all-reduce of plain data parallelism becomes a
reduce-scatter (in backward) + all-gather (after the step) of the same volume. A pipeline
rank (`runtime.pipeline_model`) uses the same state over its stages' shards: its stage
modules hold the working parameters, the microbatches accumulate their full-size gradients
(ZeRO-2 too), and `runtime.stage_grads.GradientScatter` reduce-scatters them into the flat
gradients after the last backward (ZeRO-2 then frees the full-size ones).

Loss scaling (`plan.memory.loss_scaling`, fp16): as `torch.amp.GradScaler`: the program
multiplies the loss (in fp32) by `scale` (2**15 at first: the largest power of two an
fp16 loss gradient holds) before backward; its gradients are divided
by it as they come out; at the optimizer step, if any rank holds an inf/nan (all-reduced
max), the step is skipped and the scale halved; after `growth_interval` clean steps it
doubles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.passes.precision import (
    LOSS_SCALE,
    ParamBoundary,
    flat_shard,
    gather_flat,
    replicated_axes,
)
from autopar.plan import Spec
from autopar.runtime.shards import mesh_device as _device

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class LossScaler:
    """Dynamic loss scaling (`torch.amp.GradScaler`'s rules; see the module docstring)."""

    def __init__(self, init: float = 2.0**15, growth_interval: int = 2000):
        self.scale = init
        self.growth_interval = growth_interval
        self._clean = 0
        self.skipped = 0

    def unscale(self, grads: Iterable[torch.Tensor]) -> None:
        """Divide the gradients of a scaled loss by the scale, in place."""
        for g in grads:
            g.mul_(1.0 / self.scale)

    @staticmethod
    def all_finite(grads: list[torch.Tensor]) -> bool:
        """True if every rank's gradients are finite (a collective over the world)."""
        bad = torch.zeros((), device=grads[0].device if grads else None)
        for g in grads:
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().to(bad.dtype))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= 0.5
            self._clean = 0
            self.skipped += 1
            return
        self._clean += 1
        if self._clean == self.growth_interval:
            self.scale *= 2.0
            self._clean = 0

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.scale, dtype=torch.float32, device=like.device)


class ParamState:
    """The parameter tensors of one rank, the optimizer over them, and the update."""

    def __init__(
        self,
        shards: Mapping[str, torch.Tensor],
        specs: Mapping[str, Spec],
        mesh: DeviceMesh,
        boundary: ParamBoundary,
        optimizer: OptimizerFactory | None,
    ):
        self.b, self.mesh, self.specs = boundary, mesh, dict(specs)
        self.scaler = LossScaler() if boundary.loss_scaling else None
        if boundary.shard_optimizer:
            dtype = boundary.compute_dtype
            self.params = {
                n: (s.to(dtype) if dtype else s.clone()).requires_grad_(
                    not boundary.shard_gradients
                )
                for n, s in shards.items()
            }
            self.flats = {
                n: flat_shard(s, specs[n], mesh).requires_grad_(True) for n, s in shards.items()
            }
            trained = list(self.flats.values())
        else:
            self.params = {n: s.requires_grad_(True) for n, s in shards.items()}
            self.flats = {}
            trained = list(self.params.values())
        self.optimizer = optimizer(trained) if optimizer else None

    # ---- the program's inputs and outputs --------------------------------------------
    def examples(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Example tensors of the program's extra inputs (`ParamBoundary.extra_names`)."""
        out = {f"{n}__flat": f for n, f in self.flats.items()}
        if self.scaler is not None:
            out[LOSS_SCALE] = torch.ones((), device=_device(self.mesh))
        return {k: out[k] for k in names}

    def program_inputs(self, params: list[str]) -> tuple[list, list]:
        """(parameters, extras) in the program's order."""
        ps = [self.params[n].detach() for n in params]
        extras = [self.flats[n].detach() for n in params] if self.flats else []
        if self.scaler is not None:
            like = ps[0] if ps else torch.zeros((), device=_device(self.mesh))
            extras.append(self.scaler.tensor(like))
        return ps, extras

    def set_grads(self, params: list[str], grads: list[torch.Tensor]) -> None:
        if not self.b.shard_optimizer:
            targets = [self.params[n] for n in params]
        elif self.b.shard_gradients:
            targets = [self.flats[n] for n in params]
        else:
            targets = [self.params[n] for n in params] + [self.flats[n] for n in params]
        if self.scaler is not None:
            self.scaler.unscale(grads)
        for t, g in zip(targets, grads, strict=True):
            t.grad = g

    # ---- the update --------------------------------------------------------------------
    def trained(self) -> list[torch.Tensor]:
        return list((self.flats or self.params).values())

    def step(self, gather: bool = True) -> None:
        """Unscale (fp16), step the optimizer, clear gradients, all-gather ZeRO masters
        (`gather=False`: the caller does, `ParamGather`; the gradients are freed first)."""
        if self.optimizer is None:
            return
        finite = True
        if self.scaler is not None:
            finite = self.scaler.all_finite([p.grad for p in self.trained() if p.grad is not None])
            self.scaler.update(finite)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params.values():
            p.grad = None
        if finite and gather:
            self._gather_masters()

    def _gather_masters(self) -> None:
        """Every working parameter from its flat master (in the compute dtype under the
        policy), bucketed per replicated axis (`ParamGather`)."""
        keys = {(0, n): n for n in self.flats}
        gather = ParamGather(
            {k: self.params[n] for k, n in keys.items()},
            {k: self.flats[n] for k, n in keys.items()},
            {k: self.specs[n] for k, n in keys.items()},
            self.mesh,
        )
        gather.launch()
        gather.wait_all()

    # ---- views ---------------------------------------------------------------------------
    def grads(self) -> dict[str, torch.Tensor | None]:
        """The gradient the optimizer reads: the local shard, or the flat shard (ZeRO)."""
        return {n: p.grad for n, p in (self.flats or self.params).items()}

    def held_gradients(self) -> list[torch.Tensor | None]:
        """Every gradient tensor held (ZeRO-1: the full-size buffers too)."""
        extra = [p.grad for p in self.params.values()] if self.flats else []
        return [*self.grads().values(), *extra]

    def masters(self) -> list[torch.Tensor]:
        """Master copies held apart from the program's parameters (ZeRO's flat shards)."""
        return list(self.flats.values())

    def expected_grad(self, name: str, local_ref: torch.Tensor) -> torch.Tensor:
        """The piece of a reference gradient (already this rank's local shard) that
        `grads()[name]` holds."""
        if not self.flats:
            return local_ref
        return flat_shard(local_ref, self.specs[name], self.mesh)

    def master_local(self, name: str) -> torch.Tensor:
        """The master value of the local shard at its storage spec (a collective under
        ZeRO: every rank calls it for the same names in the same order)."""
        if not self.flats:
            return self.params[name].detach()
        flat = self.flats[name].detach()
        return gather_flat(flat, self.specs[name], self.mesh, self.params[name].shape)


class ParamGather:
    """ZeRO: the working parameters all-gathered from the flat masters after the optimizer
    step, one flat buffer per group and replicated axis (`R x sum(L_i / R)`: row r holds
    every parameter's r-th chunk of its padded flat, the rows the gradients' reduce-scatter
    handed out; in the working dtype), issued without waiting in group order; `wait(group)`
    finishes a group's. Keys are (group, name): a pipeline's group is a stage, which waits
    for its own at its next forward (`StageModule.ready`), so a rank's later stages and the
    ranks that start late in the schedule hide theirs (Megatron's overlapped parameter
    gather; `search.inter_op.price_schedule` prices it so); `ParamState` has one group and
    waits at once. A parameter replicated on more than one axis is gathered at launch
    (`passes.precision.gather_flat`). `params`: key -> the working parameter, `flats` /
    `specs` the same keys' masters and specs."""

    def __init__(self, params: dict, flats: dict, specs: dict, mesh: DeviceMesh):
        self.params, self.flats, self.specs, self.mesh = params, flats, specs, mesh
        self._pending: dict[int, list] = {}  # stage -> [(work, rows, [(key, width)])]
        self.late = 0  # stages `wait_all` waited for: their forward never did (tests read it)

    @torch.no_grad()
    def launch(self) -> None:
        buckets: dict[tuple[int, int], list[tuple]] = {}
        for key in sorted(self.params):
            spec, work = self.specs[key], self.params[key]
            axes = replicated_axes(spec)
            if len(axes) != 1:  # unreplicated: a copy; two axes: DTensor's gather, now
                full = gather_flat(
                    self.flats[key].detach().to(work.dtype), spec, self.mesh, work.shape
                )
                work.copy_(full)
                continue
            buckets.setdefault((key[0], axes[0]), []).append(key)
        for (stage, axis), keys in sorted(buckets.items()):
            mine = torch.cat([self.flats[k].detach().to(self.params[k].dtype) for k in keys])
            flat = mine.new_empty(self.mesh.size(axis) * mine.numel())  # gloo: flat form
            group = self.mesh.get_group(axis)
            work = dist.all_gather_into_tensor(flat, mine, group=group, async_op=True)
            rows = flat.view(self.mesh.size(axis), mine.numel())
            widths = [(k, self.flats[k].numel()) for k in keys]
            self._pending.setdefault(stage, []).append((work, rows, widths))

    @torch.no_grad()
    def wait(self, stage: int) -> None:
        for work, rows, widths in self._pending.pop(stage, []):
            work.wait()
            offset = 0
            for key, w in widths:
                param = self.params[key]
                full = rows[:, offset : offset + w].reshape(-1)[: param.numel()]
                param.copy_(full.view_as(param))
                offset += w

    def wait_all(self) -> None:
        self.late += len(self._pending)
        for stage in sorted(self._pending):
            self.wait(stage)

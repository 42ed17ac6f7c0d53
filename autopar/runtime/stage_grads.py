"""A pipeline rank's gradient reduction, once per step, each stage's from its last backward.

`GradientSync(modules, mesh)` (plain data parallelism) and `GradientScatter(modules, mesh,
master, tied)` (ZeRO) take the gradients the stage programs left partial on the axes where
a parameter is replicated (`runtime.pipeline._DeferGradSync`), summed over the
microbatches. The schedule's REDUCE_GRAD action, which torch puts right after a stage's
last B or W, calls `launch(module)` (`SyncingStage`): the stage's gradients are copied
into flat buffers, in the policy's reduce dtype, and their collective is issued without
waiting, so it runs while the rank's other stages compute. `wait()` (after the schedule,
before the optimizer) finishes them in launch order. Only the batch's last schedule step
launches (`armed`: uneven microbatches run two); a stage whose action never came is
launched by `wait`, in stage order (`late` counts them: the tests expect none).

`search.inter_op.price_schedule` prices each stage's reduction on its rank's
communication channel from that stage's last backward (`schedules.synced_end`);
`search.peak` holds every stage's buffers at once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.passes.precision import flat_spec

if TYPE_CHECKING:  # runtime.pipeline imports this module
    from autopar.runtime.pipeline import StageModule


class _StageReduction:
    """Launch once per stage and step; wait for all (module docstring)."""

    def __init__(self, modules: list[StageModule], mesh: DeviceMesh):
        self.modules, self.mesh = modules, mesh
        self.armed = False
        self.late = 0
        self._launched: set[int] = set()
        self._pending: list[tuple] = []

    def launch(self, module: StageModule) -> None:
        # a stage's index: the smaller microbatches' twin module shares its gradients
        if not self.armed or module.stage.index in self._launched:
            return
        self._launched.add(module.stage.index)
        self._issue(module)

    def wait(self) -> None:
        for module in self.modules:
            if self.armed and module.stage.index not in self._launched:
                self.late += 1
                self.launch(module)
        self._launched.clear()
        self.armed = False
        self._drain()

    def _drain(self) -> None:
        """Finish what was issued, in issue order."""
        pending, self._pending = self._pending, []
        for entry in pending:
            self._finish(*entry)

    def _issue(self, module: StageModule) -> None:
        raise NotImplementedError

    def _finish(self, *entry) -> None:
        raise NotImplementedError


class GradientSync(_StageReduction):
    """All-reduce, in place: one flat buffer per (partial axes, dtype) of a stage, issued
    over its first partial axis; `wait` reduces it over the further ones (a parameter
    replicated on two axes: rare and small, the norms under sequence parallelism). The
    gradients then are their slices of the buffer (DDP's `gradient_as_bucket_view`): copied
    back only where the reduction ran in another dtype or the gradient is strided. A lone
    gradient is its own buffer (`_reducible_in_place`)."""

    def _issue(self, module: StageModule) -> None:
        buckets: dict[tuple, list[nn.Parameter]] = {}
        for i, p in enumerate(module.shards):
            keep = module.grad_placements.get(i)
            if p.grad is None or keep is None or not any(q.is_partial() for q in keep):
                continue
            assert all(is_sum_partial(q) for q in keep if q.is_partial()), keep
            axes = tuple(a for a, q in enumerate(keep) if q.is_partial())
            buckets.setdefault((axes, module.reduce_dtype or p.grad.dtype), []).append(p)
        for (axes, dtype), params in buckets.items():
            grads = [p.grad for p in params]
            alone = len(grads) == 1 and _reducible_in_place(grads[0], dtype)
            flat = (
                grads[0].view(-1) if alone else torch.cat([g.reshape(-1).to(dtype) for g in grads])
            )
            work = dist.all_reduce(flat, group=self.mesh.get_group(axes[0]), async_op=True)
            self._pending.append((work, flat, axes[1:], [] if alone else params))

    def _finish(self, work, flat: torch.Tensor, rest: tuple[int, ...], params) -> None:
        work.wait()
        for axis in rest:
            dist.all_reduce(flat, group=self.mesh.get_group(axis))
        offset = 0
        for p in params:  # none when the gradient was reduced in place
            piece = flat[offset : offset + p.grad.numel()].view(p.grad.shape)
            if _reducible_in_place(p.grad, flat.dtype):
                p.grad = piece  # the bucket's slice: no copy back
            else:
                p.grad.copy_(piece)
            offset += piece.numel()


class GradientScatter(_StageReduction):
    """ZeRO: reduce-scatter each stage's gradients into each parameter's flat shard
    (`passes.precision.flat_shard`'s padded layout), bucketed per (placements, flat
    placements, dtype). A bucket is the `R x sum(L_i / R)` matrix whose row r is every
    parameter's r-th chunk of its padded flat gradient (`R` replicas, rows in the nested
    `Shard(0)` order of the replicated axes), so the reduce-scatter hands rank r its row:
    the concatenation of its flat shards. A bucket partial on one axis and split on it
    alone is one `reduce_scatter_tensor` issued at once; any other is redistributed by
    DTensor at `wait`. The parameters in `tied` (read by two stages) wait for their sum
    over the pipeline axis (`PipelineModel._sync_tied_grads`) and are scattered by
    `wait`. `shards`: (stage, parameter index) -> the flat shard in `master` dtype."""

    def __init__(self, modules, mesh, master: torch.dtype | None, tied: list[str]):
        super().__init__(modules, mesh)
        self.master, self.tied = master, set(tied)
        # tied parameters whose gradients the pipeline completes before the scatter
        # (ranks on stage meshes of different shapes): cut, not summed
        self.complete: set[str] = set()
        self.shards: dict[tuple[int, int], torch.Tensor] = {}

    def wait(self) -> None:
        super().wait()
        for module in self.modules:
            self._scatter(module, tied=True)
        self._drain()

    def _issue(self, module: StageModule) -> None:
        self._scatter(module, tied=False)

    def _scatter(self, module: StageModule, tied: bool) -> None:
        buckets: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        for i, p in enumerate(module.shards):
            keep = module.grad_placements.get(i)
            if p.grad is None or keep is None or (module.stage.params[i] in self.tied) != tied:
                continue
            summed = module.stage.params[i] in self.complete
            src = tuple(q if q.is_partial() and not summed else Replicate() for q in keep)
            dst = flat_spec(module._specs[i])
            dtype = module.reduce_dtype or p.grad.dtype
            buckets.setdefault((src, dst, dtype), []).append((i, p.grad))
        for (src, dst, dtype), grads in buckets.items():
            r = math.prod(self.mesh.size(a) for a, q in enumerate(dst) if isinstance(q, Shard))
            widths = [-(-g.numel() // r) for _, g in grads]
            alone = grads[0][1]
            if len(grads) == 1 and alone.numel() % r == 0 and _reducible_in_place(alone, dtype):
                rows = alone.view(r, widths[0])  # its own rows: nothing to pad or copy in
            else:
                rows = torch.zeros(r, sum(widths), dtype=dtype, device=alone.device)
                offset = 0
                for (_, g), w in zip(grads, widths, strict=True):
                    _fill_rows(rows[:, offset : offset + w], g)
                    offset += w
            entries = [(module.stage.index, i, w) for (i, _), w in zip(grads, widths, strict=True)]
            axis = _one_scatter_axis(src, dst)
            if axis is None:
                self._pending.append((None, rows, (src, dst), entries))
                continue
            mine = rows.new_empty(sum(widths))
            group = self.mesh.get_group(axis)
            work = dist.reduce_scatter_tensor(mine, rows.view(-1), group=group, async_op=True)
            self._pending.append((work, mine, rows, entries))

    def _finish(self, work, buffer: torch.Tensor, extra, entries) -> None:
        if work is not None:
            work.wait()  # `extra`: the rows it reads, alive until then
            mine = buffer
        else:
            src, dst = extra
            flat = buffer.view(-1)
            dt = DTensor.from_local(
                flat, self.mesh, src, run_check=False, shape=flat.shape, stride=(1,)
            )
            mine = dt.redistribute(self.mesh, dst).to_local()
        offset = 0
        for stage, i, w in entries:
            shard = mine[offset : offset + w]
            wanted = self.master is not None and shard.dtype != self.master
            self.shards[stage, i] = shard.to(self.master) if wanted else shard
            offset += w


def _reducible_in_place(grad: torch.Tensor, dtype: torch.dtype) -> bool:
    """A gradient contiguous and already in the reduce dtype: alone in its bucket, it is
    the flat buffer (no copy in or back, as `cost_models.buckets.fused_copies` prices a key
    of one tensor); in a bucket, its slice of the sum replaces it (no copy back)."""
    return grad.is_contiguous() and grad.dtype == dtype


def _one_scatter_axis(src: tuple, dst: tuple) -> int | None:
    """The axis a bucket's redistribution reduce-scatters on, when that is all it does
    (partial there, `Shard(0)` of the flat there, the same elsewhere); else None."""
    moved = [a for a, (s, d) in enumerate(zip(src, dst, strict=True)) if s != d]
    if len(moved) != 1:
        return None
    a = moved[0]
    return a if is_sum_partial(src[a]) and dst[a] == Shard(0) else None


def _fill_rows(block: torch.Tensor, grad: torch.Tensor) -> None:
    """Row k of `block` (R x w): chunk k of the gradient's flat, zero-padded to R * w."""
    flat = grad.reshape(-1)
    w = block.shape[1]
    full, rest = divmod(flat.numel(), w)
    if full:
        block[:full].copy_(flat[: full * w].view(full, w))
    if rest:
        block[full, :rest].copy_(flat[full * w :])


def is_sum_partial(p) -> bool:
    return type(p) is Partial and p.reduce_op == "sum"


class SyncingStage(PipelineStage):
    """torch's `PipelineStage` whose REDUCE_GRAD action (after its last backward) hands
    the stage's gradients to `sync.launch`."""

    def __init__(self, *args, sync: _StageReduction | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sync = sync

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        super().perform_reduce_grad(grad_scale_factor)
        if self.sync is not None:
            self.sync.launch(self.submod)

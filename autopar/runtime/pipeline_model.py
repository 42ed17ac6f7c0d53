"""PipelineModel: the pipelined counterpart of ParallelModel (same public methods).

A batch of N rows the microbatch count M does not divide is cut as `torch.tensor_split`
(`search.schedules.microbatch_rows`: the first N mod M microbatches one row larger). A
stage program has one shape, and torch's stages receive into buffers of one shape, so the
two sizes run as two schedule steps, one after the other, each with its own stage
programs over the same parameter shards (the smaller ones' graph captured at their size,
`SmallerMicrobatches`). Microbatch i's loss is weighted by its share of the batch (its
target): n_i / N of the rows, or for a mean cross-entropy its counted targets (class-weighted:
their weights) / the batch's
(`runtime.loss_shares`: padding spread unevenly), and the schedules leave the gradients
unscaled: the losses and gradients sum to the full batch's mean, as on one device.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as pp_schedules
from torch.distributed.tensor import Shard

from autopar.capture import Captured
from autopar.devices import device_mesh
from autopar.passes.precision import ParamBoundary, flat_shard
from autopar.passes.stages import split_stages
from autopar.plan import SCHEDULES, Plan, mixed_shapes, parse_spec, stage_ranks
from autopar.runtime.loss_shares import loss_shares, target_counter, weighted_mean_loss
from autopar.runtime.memory_stats import optimizer_state_tensors
from autopar.runtime.optimizer import LossScaler, ParamGather, ParamState
from autopar.runtime.parallel_model import OptimizerFactory, TrainingSteps
from autopar.runtime.pipeline import StageModule, _example, boundary_spec
from autopar.runtime.shards import gather_full, local_chunk, mesh_device
from autopar.runtime.stage_grads import GradientScatter, GradientSync, SyncingStage
from autopar.search.schedules import TORCH_CLASSES


class PipelineModel(TrainingSteps):
    """`.plan`, `.step(*batch)`, `.forward_backward`, `.optimizer_step`, `.full_state_dict`."""

    def __init__(
        self,
        model: nn.Module,
        captured: Captured,
        plan: Plan,
        world_mesh: DeviceMesh,
        optimizer: OptimizerFactory | None = None,
        smaller: SmallerMicrobatches | None = None,
    ):
        self.plan, self.captured, self.world_mesh = plan, captured, world_mesh
        # fp16: dynamic loss scaling (runtime.optimizer)
        self.scaler = LossScaler() if plan.memory.loss_scaling else None
        self.pp_group = world_mesh.get_group("pp")
        self.pp_rank = world_mesh.get_local_rank("pp")
        self.mesh = _stage_mesh(world_mesh, plan, self.pp_rank)  # this rank's stage submesh
        self.device = mesh_device(world_mesh)  # where stage buffers and shards live
        pp = world_mesh.size(0)
        graphs = split_stages(captured, list(plan.stage_cuts))
        owners = stage_ranks(plan.schedule, pp)
        full = _full_state(model, captured)
        self.modules = {
            s: StageModule(graphs[s], plan, self.mesh, full)
            for s in range(len(graphs))
            if owners[s] == self.pp_rank
        }
        # ZeRO: flat fp32 master shards stepped by `ParamState`; the stage modules hold
        # the working parameters (compute dtype), filled by its all-gather
        self.zero = _zero_state(self.modules, plan, self.mesh, optimizer)
        self._tied = _tied_params(graphs)
        # replicated parameters' gradients: each stage's all-reduced (ZeRO: reduce-scattered)
        # from its last backward on (`runtime.stage_grads`)
        modules = list(self.modules.values())
        self.sync = (
            GradientSync(modules, self.mesh)
            if self.zero is None
            else GradientScatter(modules, self.mesh, _master_dtype(self.zero), self._tied)
        )
        if self.zero is not None and mixed_shapes(plan.pipeline.rank_meshes):
            self.sync.complete = set(self._tied)  # summed whole (`_sync_tied_grads`)
        # ZeRO: the working parameters gathered after each step, each stage's waited at
        # its next forward
        self.gather = _param_gather(self.modules, self.zero, self.mesh)
        for m in self.modules.values():
            m.ready = self.gather.wait if self.gather is not None else None
        self.stages = [
            self._pipeline_stage(graphs[s], m, len(graphs)) for s, m in self.modules.items()
        ]
        rows = _captured_rows(captured)
        _check_microbatch_rows(plan, captured, smaller)
        count = plan.microbatches - (smaller.count if smaller is not None else 0)
        self.runs = [_Run(_make_schedule(plan, self.stages, self._loss, count), count, rows)]
        if smaller is not None:  # uneven microbatches: the smaller ones' own programs
            self.runs.append(self._smaller_run(smaller, full))
        # a microbatch's share of the batch's mean loss: its rows, or its counted targets
        self.counters = [target_counter(captured, full)] + (
            [target_counter(smaller.captured, _full_state(model, smaller.captured))]
            if smaller is not None
            else []
        )
        if None in self.counters and weighted_mean_loss(captured):
            warnings.warn(_ROWS_FOR_WEIGHTS, stacklevel=3)
        params = [p for m in self.modules.values() for p in m.shards]
        if self.zero is not None:
            self.optimizer = self.zero.optimizer
        else:
            self.optimizer = optimizer(params) if optimizer else None
        self._is_last = (len(graphs) - 1) in self.modules
        self._first = 0 in self.modules

    def _pipeline_stage(self, graph, module: StageModule, num: int) -> PipelineStage:
        return SyncingStage(
            module,
            graph.index,
            num,
            self.device,
            input_args=_example(graph, self.plan, graph.inputs, self.mesh, graph.index > 0),
            output_args=_example(graph, self.plan, graph.outputs, self.mesh, True)
            if graph.outputs != ["loss"]
            else torch.zeros((), device=self.device),
            group=self.pp_group,
            # zero-bubble schedules: the stage program's backward runs its input-gradient
            # half at I and hands its weight-gradient half to W (`runtime.zero_bubble`);
            # the other schedules run it whole (search.schedules.replay prices both so)
            dw_builder=module.weight_grads.builder
            if module.weight_grads is not None
            else _nothing_left,
            sync=self.sync,
        )

    # ---- training --------------------------------------------------------------------
    def forward_backward(self, *batch: torch.Tensor) -> torch.Tensor:
        """Each run's microbatches through its schedule (one run, or two when the batch
        does not divide: the larger microbatches, then the smaller); microbatch i's loss
        weighted by its share of the batch's rows, so that the losses and the gradients
        sum to the full batch's mean (the schedules do not scale the gradients)."""
        rows = [r.rows for r in self.runs for _ in range(r.count)]
        if sum(rows) != batch[0].shape[0]:
            raise ValueError(
                f"the batch has {batch[0].shape[0]} rows but this pipeline was compiled for "
                f"{sum(rows)} (microbatches of {rows} rows); compile it for this batch"
            )
        share = self._shares(rows, batch).to(self.device)
        losses: list[torch.Tensor] = []
        first = 0  # the run's first microbatch (and row)
        for run in self.runs:
            self.sync.armed = run is self.runs[-1]  # the batch's last backward is in it
            end = first + run.count
            args = [
                self._microbatched_local(name, t[sum(rows[:first]) : sum(rows[:end])], run.count)
                for name, t in zip(self.captured.user_inputs, batch, strict=True)
            ]
            kwargs = {"return_outputs": False}
            mine: list[torch.Tensor] = []  # the schedule empties the list it is given
            if self._is_last:  # microbatch i's target: its share of the batch
                kwargs.update(target=share[first:end], losses=mine)
            run.schedule.step(*args, **kwargs) if self._first else run.schedule.step(**kwargs)
            losses += mine
            first = end
        if self.zero is None:
            self.sync.wait()  # launched at each stage's last backward
            self._sync_tied_grads()
        else:
            self.gather.wait_all()  # every stage ran a forward: nothing left, normally
            self._sync_tied_grads()  # unreduced: `GradientScatter` left them for `wait`
            self._scatter_gradients()
        if self.scaler is not None:
            self.scaler.unscale(g for g in self.local_grads().values() if g is not None)
        local = (
            torch.stack([loss.detach().float() for loss in losses]).sum()
            if losses and self._stage_coord_zero()
            else torch.zeros((), device=self.device)
        )
        dist.all_reduce(local)
        return local / self.scaler.scale if self.scaler is not None else local

    def optimizer_step(self) -> None:
        """fp16: skip the step if any rank's gradients overflowed (`LossScaler`). ZeRO:
        step the flat masters, issue their all-gathers into the working parameters (each
        stage waits for its own at its next forward, `ParamGather`)."""
        if self.scaler is not None and self.optimizer is not None:
            grads = [g for g in self.local_grads().values() if g is not None]
            finite = self.scaler.all_finite(grads)
            self.scaler.update(finite)
            if not finite:
                self.optimizer.zero_grad(set_to_none=True)
                self._clear_working_grads()
                return
        if self.zero is not None:
            self.zero.step(gather=False)  # steps, clears the flat and full gradients
            self.gather.launch()
            return
        super().optimizer_step()

    def _scatter_gradients(self) -> None:
        """ZeRO: the microbatches' gradients reduce-scattered into the flat shards
        (`GradientScatter.wait`; ZeRO-2 then frees the full-size gradients)."""
        assert self.zero is not None
        self.sync.wait()
        for (s, i), g in self.sync.shards.items():
            self.zero.flats[_key(s, i)].grad = g
            if self.plan.memory.shard_gradients:
                self.modules[s].shards[i].grad = None
        self.sync.shards.clear()

    def _clear_working_grads(self) -> None:
        for m in self.modules.values():
            for p in m.shards:
                p.grad = None

    def _shares(self, rows: list[int], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Each microbatch's share of the batch's mean loss (`runtime.loss_shares`)."""
        bounds = [sum(rows[:i]) for i in range(len(rows) + 1)]
        microbatches = [tuple(t[a:b] for t in batch) for a, b in itertools.pairwise(bounds)]
        runs, first = [], 0
        for run in self.runs:
            runs.append(microbatches[first : first + run.count])
            first += run.count
        return loss_shares(rows, self.counters, runs)

    def _loss(self, output: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
        """The last stage's program already computes the microbatch's mean loss: weighted
        by the microbatch's share of the batch's rows (fp16: scaled)."""
        share = share.reshape(())  # a microbatch without targets (its mean 0/0) adds 0
        weighted = torch.where(share > 0, output.float() * share, 0.0)
        return weighted * self.scaler.scale if self.scaler is not None else weighted

    # ---- state -------------------------------------------------------------------------
    def local_grads(self) -> dict[str, torch.Tensor | None]:
        """This rank's gradient per parameter FQN: the local shard, or under ZeRO the flat
        shard (`expected_grad` cuts a reference so)."""
        out = {}
        for s, m in self.modules.items():
            for i, (name, p) in enumerate(zip(m.stage.params, m.shards, strict=True)):
                g = self.zero.flats[_key(s, i)].grad if self.zero is not None else p.grad
                out[self.captured.params[name]] = g
        return out

    def expected_grad(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """The piece of a full gradient of parameter `fqn` that `local_grads()` holds."""
        name = next(n for n, f in self.captured.params.items() if f == fqn)
        t = self.plan.tensor(name)
        local = local_chunk(full, parse_spec(t.spec), self.mesh)
        if self.zero is None:
            return local
        return flat_shard(local, parse_spec(t.spec), self.mesh)

    def predicted_memory(self) -> tuple[float, dict[str, float]]:
        """This pipeline rank's prediction (`plan.solver["predicted_memory_per_pp_rank"]`)."""
        ranks = self.plan.solver.get("predicted_memory_per_pp_rank")
        if not ranks:
            return super().predicted_memory()
        mine = dict(ranks[self.pp_rank])
        return sum(mine.values()), mine

    def held_tensors(self) -> dict[str, list[torch.Tensor | None]]:
        return {
            "parameters": [p for m in self.modules.values() for p in m.shards],
            "buffers": [b for m in self.modules.values() for b in m.buffers()],
            "gradients": self.zero.held_gradients()
            if self.zero is not None
            else list(self.local_grads().values()),
            "optimizer_state": [
                *optimizer_state_tensors(self.optimizer),
                *(self.zero.masters() if self.zero is not None else []),
            ],
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {t.name: t for t in self.plan.tensors}
        mine: dict[str, torch.Tensor] = {}
        for s, m in self.modules.items():
            for i, (name, p) in enumerate(zip(m.stage.params, m.shards, strict=True)):
                t = tensors[name]
                local = p.detach() if self.zero is None else self.zero.master_local(_key(s, i))
                full = gather_full(local, parse_spec(t.spec), self.mesh, t.shape)
                for fqn in [t.fqn, *self.captured.aliases.get(t.fqn, [])]:
                    mine[fqn] = full
            for i, name in enumerate(m.stage.buffers):  # whole, as the parameters
                if name in self.captured.buffers:  # not a lifted constant
                    t, local = tensors[name], getattr(m, f"b{i}")
                    full = gather_full(local, parse_spec(t.spec), self.mesh, t.shape)
                    mine[self.captured.buffers[name]] = full
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, mine if self._stage_coord_zero() else {})
        return {k: v for part in gathered for k, v in part.items()}

    # ---- helpers -----------------------------------------------------------------------
    def _smaller_run(self, smaller: SmallerMicrobatches, full: dict[str, torch.Tensor]) -> _Run:
        """The smaller microbatches' stage programs, on the larger ones' parameter shards
        and buffers (their gradients accumulate in the same tensors), and their schedule."""
        graphs = split_stages(smaller.captured, list(self.plan.stage_cuts))
        stages = []
        for s, module in self.modules.items():
            if graphs[s].inputs != module.stage.inputs or graphs[s].params != module.stage.params:
                raise ValueError(f"stage {s} of the smaller microbatch differs from the planned")
            twin = StageModule(graphs[s], self.plan, self.mesh, full)
            twin.shards = module.shards
            twin.ready = module.ready
            for i in range(len(module.stage.buffers)):
                setattr(twin, f"b{i}", getattr(module, f"b{i}"))
            stages.append(self._pipeline_stage(graphs[s], twin, len(graphs)))
        schedule = _make_schedule(self.plan, stages, self._loss, smaller.count)
        return _Run(schedule, smaller.count, _captured_rows(smaller.captured))

    def _microbatched_local(self, name: str, full: torch.Tensor, count: int) -> torch.Tensor:
        """`count` equal microbatches of `full`, each cut to this rank's shard, end to end
        (the schedule splits them again: microbatch i is the same rows on every rank)."""
        spec = boundary_spec(self.plan, name)
        dtype = self.plan.memory.param_dtype
        if dtype is not None and full.is_floating_point():  # the policy casts float inputs
            full = full.to(getattr(torch, dtype))
        chunks = full.tensor_split(count, dim=0)
        return torch.cat([local_chunk(c, spec, self.mesh) for c in chunks])

    def _sync_tied_grads(self) -> None:
        """A parameter read by several stages: their gradients summed over the pipeline
        axis (non-holders add zeros), as local shards, or where the pipeline ranks' stage
        meshes differ in shape (whose shards differ), as whole gradients."""
        tensors = {t.name: t for t in self.plan.tensors}
        whole = mixed_shapes(self.plan.pipeline.rank_meshes)
        for name in self._tied:
            held = []
            for m in self.modules.values():
                for i, (n, p) in enumerate(zip(m.stage.params, m.shards, strict=True)):
                    if n == name:
                        held.append(p)
                        if whole and self.zero is not None and p.grad is not None:
                            _complete(m, i, p.grad, self.mesh)
            grads = [p.grad for p in held if p.grad is not None]
            total = torch.stack(grads).sum(0) if grads else None
            spec, shape = parse_spec(tensors[name].spec), tensors[name].shape
            if total is None:
                meta = torch.empty(shape, device="meta")
                local = shape if whole else local_chunk(meta, spec, self.mesh).shape
                total = torch.zeros(local, dtype=self._grad_dtype(), device=self.device)
            elif whole:
                total = gather_full(total, spec, self.mesh, shape)
            dist.all_reduce(total, group=self.pp_group)
            if whole:
                total = local_chunk(total, spec, self.mesh)
            for p in held:
                p.grad = total.clone()

    def _grad_dtype(self) -> torch.dtype:
        """The dtype the parameters (and their gradients) are held in on this rank."""
        held = (p.dtype for m in self.modules.values() for p in m.shards)
        return next(held, torch.get_default_dtype())

    def _stage_coord_zero(self) -> bool:
        return all(c == 0 for c in self.mesh.get_coordinate())


def _complete(module: StageModule, index: int, grad: torch.Tensor, mesh: DeviceMesh) -> None:
    """ZeRO leaves a gradient partial on the axes its placements name (for
    `GradientScatter`); where the ranks' stage meshes differ, the partial sums of two
    shapes do not add up over the pipeline axis: summed here over its own stage mesh first
    (in place), and the scatter only cuts its flat shard (`GradientScatter.complete`)."""
    for axis, q in enumerate(module.grad_placements.get(index, ())):
        if q.is_partial():
            dist.all_reduce(grad, group=mesh.get_group(axis))


_ROWS_FOR_WEIGHTS = (
    "the loss is a class-weighted mean whose weights autopar cannot read before the step "
    "(a parameter, or computed from one): each microbatch weighs by its rows, not by its "
    "targets' weights, so the loss and gradients differ from one device's where the "
    "microbatches' targets weigh differently. Fix: hold the class weights in a buffer "
    "(register_buffer) or a constant tensor"
)


def _full_state(model: nn.Module, captured: Captured) -> dict[str, torch.Tensor]:
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    out = {
        name: state[fqn].detach() for name, fqn in {**captured.params, **captured.buffers}.items()
    }
    out.update(captured.constants)
    return out


def _key(stage: int, index: int) -> str:
    return f"{stage}.{index}"


def _zero_state(
    modules: dict[int, StageModule], plan: Plan, mesh: DeviceMesh, optimizer
) -> ParamState | None:
    """ZeRO on a pipeline rank: a `ParamState` over every stage's local shards (flat
    masters, optimizer), whose working parameters become the stage modules' parameters.
    The pipeline's own `LossScaler` scales and unscales (not the state's)."""
    if not plan.memory.shard_optimizer:
        return None
    shards = {_key(s, i): p.detach() for s, m in modules.items() for i, p in enumerate(m.shards)}
    specs = {
        _key(s, i): parse_spec(plan.tensor(n).spec)
        for s, m in modules.items()
        for i, n in enumerate(m.stage.params)
    }
    boundary = dataclasses.replace(ParamBoundary.of(plan), loss_scaling=False)
    state = ParamState(shards, specs, mesh, boundary, optimizer)
    for s, m in modules.items():
        for i in range(len(m.shards)):
            m.shards[i] = nn.Parameter(state.params[_key(s, i)].detach())
            state.params[_key(s, i)] = m.shards[i]  # gathered into, its .grad cleared
    return state


def _param_gather(
    modules: dict[int, StageModule], state: ParamState | None, mesh: DeviceMesh
) -> ParamGather | None:
    if state is None:
        return None
    keys = [(s, i) for s, m in modules.items() for i in range(len(m.shards))]
    return ParamGather(
        {k: state.params[_key(*k)] for k in keys},
        {k: state.flats[_key(*k)] for k in keys},
        {k: state.specs[_key(*k)] for k in keys},
        mesh,
    )


def _master_dtype(state: ParamState) -> torch.dtype | None:
    return next((f.dtype for f in state.flats.values()), None)


def _tied_params(graphs) -> list[str]:
    """Parameters read by more than one stage, in a fixed order (every rank iterates it)."""
    count: dict[str, int] = {}
    for g in graphs:
        for name in g.params:
            count[name] = count.get(name, 0) + 1
    return sorted(n for n, c in count.items() if c > 1)


@dataclass(frozen=True)
class SmallerMicrobatches:
    """A batch the microbatch count does not divide (`search.schedules.microbatch_rows`):
    the graph of its last, one row smaller microbatches and how many there are."""

    captured: Captured
    count: int


def _check_microbatch_rows(plan: Plan, captured: Captured, smaller) -> None:
    """Every rank's piece of every microbatch holds a row (torch's schedules cannot split
    an empty one): else a ValueError on every rank alike, before any collective (the
    first stage's mesh cuts the batch)."""
    rows = _captured_rows(smaller.captured) if smaller is not None else _captured_rows(captured)
    shape, names = plan.pipeline.mesh_of(0), plan.stage_axis_names
    for name in captured.user_inputs:
        spec = boundary_spec(plan, name)
        axes = [a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == 0]
        ranks = math.prod(shape[a] for a in axes)
        if rows < ranks:
            most = max(rows * plan.microbatches // ranks, 1)
            raise ValueError(
                f"microbatches of {rows} row(s) cannot give each of the {ranks} ranks that "
                f"split the batch ('{name}' over {[names[a] for a in axes]}) a "
                f"row; use at most {most} microbatches, or a larger batch"
            )


def _stage_mesh(world_mesh: DeviceMesh, plan: Plan, pp_rank: int) -> DeviceMesh:
    """This pipeline rank's stage submesh. Where the ranks' stage meshes differ in shape
    (`PipelinePlan.rank_meshes`), every process builds the world mesh of each shape (its
    groups are made collectively), in one order, and takes its own rank's."""
    pipeline, names = plan.pipeline, plan.stage_axis_names
    if not mixed_shapes(pipeline.rank_meshes):
        return world_mesh[names]
    meshes = {}
    for shape in sorted(set(pipeline.rank_meshes)):
        ranks = world_mesh.mesh.reshape(pipeline.pp, *shape)
        meshes[shape] = device_mesh(world_mesh.device_type, ranks, ("pp", *names))
    return meshes[pipeline.mesh_of(pp_rank)][names]  # the submesh holding this process


@dataclass(frozen=True)
class _Run:
    """`count` microbatches of `rows` rows through one schedule step."""

    schedule: object
    count: int
    rows: int


def _captured_rows(captured: Captured) -> int:
    """The rows of the microbatch `captured` was captured on."""
    first = next(n for n in captured.placeholders() if n.name == captured.user_inputs[0])
    return first.meta["val"].shape[0]


def _make_schedule(plan: Plan, stages: list[PipelineStage], loss_fn, microbatches: int):
    """The plan's schedule over `stages`; the gradients left unscaled (`_loss` weights
    each microbatch by its rows)."""
    name = plan.schedule
    if SCHEDULES[name] == 1:
        if name == "1f1b" and microbatches < stages[0].num_stages:
            # torch's 1F1B asks a microbatch per stage; with fewer, GPipe's order (what
            # `search.schedules.simulate` prices for 1F1B so: its warm-up holds them all)
            name = "gpipe"
        cls = getattr(pp_schedules, TORCH_CLASSES[name])
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = getattr(pp_schedules, TORCH_CLASSES[name])
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)


def _nothing_left():
    return lambda: None

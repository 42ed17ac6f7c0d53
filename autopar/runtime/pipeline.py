"""Pipeline-parallel runtime: stage programs under torch.distributed.pipelining schedules.

The world mesh is `(pp, *stage_mesh)`. Each pipeline rank holds one stage (GPipe, 1F1B) or
several virtual stages (interleaved: stages r, r+pp, ...; V-shaped schedules: r and
2pp-1-r). A stage is a `StageModule`: its local parameter shards and a program made by
AOTAutograd from the same DTensor interpretation as the non-pipelined lowering (forward and
backward graphs of local ops and functional collectives on the stage's submesh, no DTensor
dispatch when it runs). Activations travel between stages as local shards in the
producing node's placement; the receiving program wraps them back and reshards if its plan
says so. The global batch is cut into microbatches *before* sharding, so microbatch i is
the same rows whatever the data-parallel degree.

Gradients are synchronized once per step: a stage program's backward leaves each
parameter's gradient unreduced on the axes where the parameter is replicated and its
gradient partial (`_DeferGradSync`), the microbatches' local gradients accumulate, and
after a stage's last backward `GradientSync` all-reduces them without waiting, one flat
buffer per (axes, dtype), while the schedule goes on (what the planner prices: one
gradient reduction per step, on the rank's communication channel from that moment). Under ZeRO
(`shard_optimizer`) `scatter_gradients` reduce-scatters them instead, bucketed, into the
flat shards `runtime.optimizer.ParamState` steps (the working parameters are then in the
compute dtype, and so are the gradients the microbatches accumulate).
A parameter used by two stages (a tied embedding and head) lives in both; after the
schedule ran, its gradients are summed over the pipeline axis (non-owners add zeros).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar._compat import aot_function, cached_sharding_propagation, default_partition
from autopar.passes.comm import CommOptions, optimize_comm, options_of
from autopar.passes.lower import PlacedInterpreter, _wrap
from autopar.passes.precision import ParamBoundary, flat_spec
from autopar.passes.recompute import recompute_activations, recomputed_nodes
from autopar.passes.stages import StageGraph
from autopar.plan import MemoryPlan, Plan, parse_spec
from autopar.runtime.inductor import aot_compiler
from autopar.runtime.shards import local_chunk, mesh_device
from autopar.runtime.zero_bubble import WeightGradients
from autopar.search.schedules import ZERO_BUBBLE


def _identity_compiler(gm, _example_inputs):
    return gm


def _comm_compiler(inner, comm: CommOptions, backward: bool):
    """An AOTAutograd compiler: `passes.comm` on the graph (a backward one tagged as such),
    then `inner`."""

    def compile_(gm: fx.GraphModule, example_inputs):
        optimize_comm(gm, comm, backward=backward)
        return inner(gm, example_inputs)

    return compile_


class StageModule(nn.Module):
    """One pipeline stage: local shards as parameters, an AOTAutograd-compiled program."""

    def __init__(
        self, stage: StageGraph, plan: Plan, mesh: DeviceMesh, full_state: dict[str, torch.Tensor]
    ):
        super().__init__()
        self.stage = stage
        tensors = {t.name: t for t in plan.tensors}
        self.shards = nn.ParameterList(
            nn.Parameter(local_chunk(full_state[n], parse_spec(tensors[n].spec), mesh))
            for n in stage.params
        )
        for i, n in enumerate(stage.buffers):
            self.register_buffer(
                f"b{i}",
                local_chunk(full_state[n], parse_spec(tensors[n].spec), mesh),
                persistent=False,
            )
        self._specs = [boundary_spec(plan, n) for n in stage.params + stage.buffers + stage.inputs]
        self._shapes = [global_shape(stage, n) for n in stage.params + stage.buffers + stage.inputs]
        self._out_specs = [None if n == "loss" else boundary_spec(plan, n) for n in stage.outputs]
        # parameter index -> its gradient's placements as the backward leaves it (known
        # once AOTAutograd traced the backward, at the first call)
        self.grad_placements: dict[int, tuple] = {}
        pending = self.grad_placements
        interp = PlacedInterpreter(stage.gm, plan, mesh)
        # mixed precision: parameters cast at the boundary (passes.precision); ZeRO's
        # reduce-scatter runs after the last microbatch (`scatter_gradients`), so the
        # program reads the working parameters as a plain (or casting) boundary
        boundary = replace(ParamBoundary.of(plan), shard_optimizer=False, shard_gradients=False)
        n_params = len(stage.params)
        self.reduce_dtype = boundary.reduce_dtype  # what `GradientSync` reduces in

        def program(*locals_):
            env = [
                boundary.wrap(x, spec, shape, mesh)
                if i < n_params and not boundary.plain
                else _wrap(x, spec, shape, mesh)
                for i, (x, spec, shape) in enumerate(
                    zip(locals_, self._specs, self._shapes, strict=True)
                )
            ]
            for i in range(n_params):
                env[i] = _DeferGradSync.apply(env[i], tuple(self._specs[i]), i, pending, mesh)
            outs = interp.run(*env, enable_io_processing=False)
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            return tuple(
                _to_local(o, spec, mesh) for o, spec in zip(outs, self._out_specs, strict=True)
            )

        # fusion="inductor": the stage's forward and backward graphs go to torch.compile
        compiler = aot_compiler if plan.fusion == "inductor" else _identity_compiler
        # passes.comm on each forward and backward graph (a zero-bubble backward's halves
        # each), with the plan's options (`Plan.comm`; None: off); every collective is
        # issued and waited inside its own graph, in the order it was traced
        comm = options_of(plan.comm)
        forward, backward = (_comm_compiler(compiler, comm, b) for b in (False, True))
        n_state = len(stage.params) + len(stage.buffers)
        # nodes the joint graph re-emits in backward (known after the first call)
        self.recomputed: list[int] = []
        partition = _recompute_partition(plan.memory, n_state, len(stage.inputs), self.recomputed)
        # zero-bubble schedules: the backward cut into its input- and weight-gradient
        # halves, run at the schedule's I and W actions (runtime.zero_bubble)
        self.weight_grads = (
            WeightGradients(lambda: self.shards) if plan.schedule in ZERO_BUBBLE else None
        )
        if self.weight_grads is not None:
            backward = self.weight_grads.compiler(backward, n_params, n_state)
        self._program = aot_function(
            program, fw_compiler=forward, bw_compiler=backward, partition_fn=partition
        )

    def forward(self, *inputs: torch.Tensor):
        buffers = [getattr(self, f"b{i}") for i in range(len(self.stage.buffers))]
        with cached_sharding_propagation():  # the first call traces through DTensor
            outs = self._program(*self.shards, *buffers, *inputs)
        return outs[0] if len(outs) == 1 else outs


class _DeferGradSync(torch.autograd.Function):
    """Identity on a parameter as the program reads it; backward leaves the gradient
    unreduced (the local partial sum) on the axes where the parameter is replicated and the
    gradient a sum-Partial, and records its placements in `pending[index]` for
    `GradientSync`. The gradient goes on labelled with the parameter's own placements so
    that the boundary below converts nothing; any other mismatch is redistributed here."""

    @staticmethod
    def forward(ctx, dt, spec, index, pending, mesh):
        ctx.spec, ctx.index, ctx.pending, ctx.mesh = spec, index, pending, mesh
        return dt.view_as(dt)

    @staticmethod
    def backward(ctx, grad):
        spec, mesh = ctx.spec, ctx.mesh
        keep = tuple(
            gp if isinstance(sp, Replicate) and _is_sum_partial(gp) else sp
            for sp, gp in zip(spec, grad.placements, strict=True)
        )
        if tuple(grad.placements) != keep:
            grad = grad.redistribute(mesh, keep)
        ctx.pending[ctx.index] = keep
        if keep != spec:
            grad = DTensor.from_local(
                grad.to_local(),
                mesh,
                spec,
                run_check=False,
                shape=grad.shape,
                stride=grad.stride(),
            )
        return grad, None, None, None, None


def _is_sum_partial(p) -> bool:
    return type(p) is Partial and p.reduce_op == "sum"


class GradientSync:
    """The gradients the stage programs left partial, reduced once per step, each stage's
    as soon as its last backward is done: the schedule's REDUCE_GRAD action (torch puts it
    right after a stage's last B or W) calls `launch(module)` (`SyncingStage`), which
    flattens the stage's gradients into one buffer per (placements, dtype), in the
    policy's reduce dtype, and issues its all-reduce over the first partial axis
    without waiting; the schedule goes on with the rank's other stages meanwhile. `wait()`
    (after the schedule, before the optimizer) waits them in launch order, reduces a
    buffer over its further partial axes (a parameter replicated on two axes: rare and
    small, the norms under sequence parallelism), copies the sums back and frees the
    buffers. `search.inter_op.price_schedule` prices each stage's reduction on the
    rank's communication channel from that stage's last backward, `search.peak` holds
    every stage's buffers at once. Only the last schedule step of a batch launches
    (`armed`: uneven microbatches run two); a stage whose action never came is launched
    by `wait`, in stage order."""

    def __init__(self, modules: list[StageModule], mesh: DeviceMesh):
        self.modules, self.mesh = modules, mesh
        self.armed = False
        self.late = 0  # stages `wait` launched: their REDUCE_GRAD never came (tests read it)
        self._launched: set[int] = set()
        self._pending: list[tuple] = []  # (work, flat, remaining axes, gradients)

    def launch(self, module: StageModule) -> None:
        # a stage's index: the smaller microbatches' twin module shares its gradients
        if not self.armed or module.stage.index in self._launched:
            return
        self._launched.add(module.stage.index)
        for (axes, dtype), grads in _partial_buckets(module).items():
            flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
            work = dist.all_reduce(flat, group=self.mesh.get_group(axes[0]), async_op=True)
            self._pending.append((work, flat, axes[1:], grads))

    def wait(self) -> None:
        for module in self.modules:
            if self.armed and module.stage.index not in self._launched:
                self.late += 1
                self.launch(module)
        for work, flat, rest, grads in self._pending:
            work.wait()
            for axis in rest:
                dist.all_reduce(flat, group=self.mesh.get_group(axis))
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self._pending.clear()
        self._launched.clear()
        self.armed = False


def _partial_buckets(module: StageModule) -> dict[tuple, list[torch.Tensor]]:
    """(partial axes, reduce dtype) -> the stage's gradients its program left partial
    there, in parameter order."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for i, p in enumerate(module.shards):
        keep = module.grad_placements.get(i)
        if p.grad is None or keep is None or not any(q.is_partial() for q in keep):
            continue
        assert all(_is_sum_partial(q) for q in keep if q.is_partial()), keep
        axes = tuple(a for a, q in enumerate(keep) if q.is_partial())
        dtype = module.reduce_dtype or p.grad.dtype
        buckets.setdefault((axes, dtype), []).append(p.grad)
    return buckets


class SyncingStage(PipelineStage):
    """torch's `PipelineStage` whose REDUCE_GRAD action (after its last backward) hands
    the stage's gradients to `GradientSync.launch`."""

    def __init__(self, *args, sync: GradientSync | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sync = sync

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        super().perform_reduce_grad(grad_scale_factor)
        if self.sync is not None:
            self.sync.launch(self.submod)


def scatter_gradients(
    modules: list[StageModule], mesh: DeviceMesh, master: torch.dtype | None
) -> list[list[torch.Tensor | None]]:
    """ZeRO: reduce-scatter the gradients the stage programs left partial into each
    parameter's flat shard (`passes.precision.flat_shard`'s padded layout), once, bucketed
    per (placements, flat placements, dtype). A bucket is the `R x sum(L_i / R)` matrix
    whose row r is every parameter's r-th chunk of its padded flat gradient (`R` replicas,
    rows in the nested `Shard(0)` order of the replicated axes), so the reduce-scatter
    hands rank r its row: the concatenation of its flat shards. Returns, per module and
    parameter, the shard in `master` dtype (None where no gradient was made)."""
    out: list[list[torch.Tensor | None]] = [[None] * len(m.shards) for m in modules]
    buckets: dict[tuple, list[tuple[int, int, torch.Tensor]]] = {}
    for j, module in enumerate(modules):
        for i, p in enumerate(module.shards):
            keep = module.grad_placements.get(i)
            if p.grad is None or keep is None:
                continue
            src = tuple(q if q.is_partial() else Replicate() for q in keep)
            dst = flat_spec(module._specs[i])
            dtype = module.reduce_dtype or p.grad.dtype
            buckets.setdefault((src, dst, dtype), []).append((j, i, p.grad))
    for (src, dst, dtype), grads in buckets.items():
        r = math.prod(mesh.size(a) for a, q in enumerate(dst) if isinstance(q, Shard))
        widths = [-(-g.numel() // r) for _, _, g in grads]
        rows = torch.zeros(r, sum(widths), dtype=dtype, device=grads[0][2].device)
        offset = 0
        for (_, _, g), w in zip(grads, widths, strict=True):
            _fill_rows(rows[:, offset : offset + w], g)
            offset += w
        flat = rows.view(-1)
        dt = DTensor.from_local(flat, mesh, src, run_check=False, shape=flat.shape, stride=(1,))
        mine = dt.redistribute(mesh, dst).to_local()
        del rows, flat, dt
        offset = 0
        for (j, i, _), w in zip(grads, widths, strict=True):
            shard = mine[offset : offset + w]
            out[j][i] = shard.to(master) if master is not None and shard.dtype != master else shard
            offset += w
    return out


def _fill_rows(block: torch.Tensor, grad: torch.Tensor) -> None:
    """Row k of `block` (R x w): chunk k of the gradient's flat, zero-padded to R * w."""
    flat = grad.reshape(-1)
    w = block.shape[1]
    full, rest = divmod(flat.numel(), w)
    if full:
        block[:full].copy_(flat[: full * w].view(full, w))
    if rest:
        block[full, :rest].copy_(flat[full * w :])


def _recompute_partition(memory: MemoryPlan, n_state: int, n_inputs: int, counts: list[int]):
    """AOTAutograd's default partition of the joint graph, after `recompute_activations`
    moved what the memory plan recomputes into its backward half: the forward graph then
    saves only what backward still reads (the kept values).

    The joint graph's first placeholders are the stage program's arguments (shards,
    buffers, then the activations entering the stage); its forward half ends at the last
    node AOTAutograd tagged forward."""

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        nodes = list(joint.graph.nodes)
        primals = [n for n in nodes if n.op == "placeholder"][: n_state + n_inputs]
        forward_end = max(
            i
            for i, n in enumerate(nodes)
            if n in primals or n.meta.get("partitioner_tag") == "is_forward"
        )
        activations = [n.name for n in primals[n_state:]]
        joint = recompute_activations(joint, memory, activations, forward_end + 1)
        counts.append(recomputed_nodes(joint))
        return default_partition(joint, joint_inputs, **kwargs)

    return partition


def _to_local(value, spec, mesh: DeviceMesh) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return value
    if spec is None:  # the loss: one replicated scalar
        return value.full_tensor()
    if tuple(value.placements) != tuple(spec):
        value = value.redistribute(mesh, spec)
    return value.to_local()


def boundary_spec(plan: Plan, name: str):
    """How a value crossing a stage boundary (or entering one) is sharded: its producer's
    planned output, with a Partial reduced (stages exchange complete values)."""
    for t in plan.tensors:
        if t.name == name:
            return parse_spec(t.spec)
    node = plan.node(name)
    spec = parse_spec(node.outputs[0])
    return tuple(Replicate() if p.is_partial() else p for p in spec)


def global_shape(stage: StageGraph, name: str) -> tuple[int, ...]:
    node = next(n for n in stage.gm.graph.nodes if n.op == "placeholder" and n.name == name)
    return tuple(node.meta["val"].shape)


def _example(stage: StageGraph, plan: Plan, names: list[str], mesh: DeviceMesh):
    out = []
    vals = {n.name: n.meta.get("val") for n in stage.gm.graph.nodes}
    for name in names:
        val = vals[name]
        # this rank's own piece: an uneven split (a microbatch of 3 rows on dp=2) differs
        # from rank to rank, and PipelineStage checks what it receives against the example
        meta = torch.empty(tuple(val.shape), device="meta")
        shape = local_chunk(meta, boundary_spec(plan, name), mesh).shape
        example = torch.zeros(shape, dtype=val.dtype, device=mesh_device(mesh))
        # PipelineStage reads requires_grad off the examples: activations carry gradients
        out.append(example.requires_grad_(val.dtype.is_floating_point))
    return tuple(out)

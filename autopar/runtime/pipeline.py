"""Pipeline-parallel runtime: stage programs under torch.distributed.pipelining schedules.

The world mesh is `(pp, *stage_mesh)` (where the pipeline ranks' stage meshes differ in
shape, `PipelinePlan.rank_meshes`, each rank runs on the world mesh of its own shape and
activations cross "canonical", `boundary_spec`). Each pipeline rank holds one stage (GPipe, 1F1B) or
several virtual stages (interleaved: stages r, r+pp, ...; V-shaped schedules: r and
2pp-1-r). A stage is a `StageModule`: its local parameter shards and a program made by
AOTAutograd from the same DTensor interpretation as the non-pipelined lowering (forward and
backward graphs of local ops and functional collectives on the stage's submesh, no DTensor
dispatch when it runs). Activations travel between stages as local shards in the
producing node's placement, or split over the stage mesh's replicated axes too where the
plan's pipeline boundary is "scattered" (`boundary_spec`: each rank sends 1/n of it); the
receiving program wraps them back and reshards (gathers) if its plan says so. The global
batch is cut into microbatches *before* sharding, so microbatch i is the same rows whatever
the data-parallel degree.

Gradients are synchronized once per step: a stage program's backward leaves each
parameter's gradient unreduced on the axes where the parameter is replicated and its
gradient partial (`_DeferGradSync`), the microbatches' local gradients accumulate, and
after a stage's last backward `runtime.stage_grads.GradientSync` all-reduces them
without waiting, one flat buffer per (axes, dtype), while the schedule goes on (what the
planner prices: one gradient reduction per step, on the rank's communication channel from
that moment). Under ZeRO (`shard_optimizer`) `GradientScatter` reduce-scatters them
instead, bucketed, into the flat shards `runtime.optimizer.ParamState` steps (the working
parameters are then in the compute dtype, and so are the gradients the microbatches
accumulate).
A parameter used by two stages (a tied embedding and head) lives in both; after the
schedule ran, its gradients are summed over the pipeline axis (non-owners add zeros).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autopar._compat import (
    aot_function,
    cached_sharding_propagation,
    default_partition,
    make_boxed_func,
)
from autopar.passes.comm import CommOptions, optimize_comm, options_of
from autopar.passes.lower import PlacedInterpreter, _wrap
from autopar.passes.precision import ParamBoundary
from autopar.passes.recompute import recompute_activations, recomputed_nodes
from autopar.passes.stages import StageGraph
from autopar.passes.strategies import summed_spec
from autopar.plan import MemoryPlan, Plan, canonical_spec, parse_spec, scattered_spec
from autopar.runtime.inductor import aot_compiler
from autopar.runtime.shards import local_chunk, mesh_device
from autopar.runtime.stage_grads import is_sum_partial
from autopar.runtime.zero_bubble import WeightGradients
from autopar.search.schedules import ZERO_BUBBLE


def _identity_compiler(gm, _example_inputs):
    """The graph as it is, called with AOTAutograd's boxed argument list (a plain callable
    makes AOTAutograd warn on every rank at its first call)."""
    return make_boxed_func(gm)


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
        names = stage.params + stage.buffers + stage.inputs
        self._shapes = [global_shape(stage, n) for n in names]
        received = len(stage.params) + len(stage.buffers) if stage.index > 0 else len(names)
        self._specs = [
            boundary_spec(plan, n, shape, crossing=i >= received)
            for i, (n, shape) in enumerate(zip(names, self._shapes, strict=True))
        ]
        self._out_specs = [
            None if n == "loss" else boundary_spec(plan, n, global_shape(stage, n), True)
            for n in stage.outputs
        ]
        self.ready: Callable[[int], None] | None = None  # called with the stage's index
        # parameter index -> its gradient's placements as the backward leaves it (known
        # once AOTAutograd traced the backward, at the first call)
        self.grad_placements: dict[int, tuple] = {}
        pending = self.grad_placements
        interp = PlacedInterpreter(stage.gm, plan, mesh)
        # mixed precision: parameters cast at the boundary (passes.precision); ZeRO's
        # reduce-scatter runs after the last microbatch (`GradientScatter`), so the
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
        if self.ready is not None:  # ZeRO: this stage's parameters gathered after the step
            self.ready(self.stage.index)
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
            gp if isinstance(sp, Replicate) and is_sum_partial(gp) else sp
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


def boundary_spec(
    plan: Plan, name: str, shape: tuple[int, ...] | None = None, crossing: bool = False
):
    """How a value crossing a stage boundary (or entering one) is sharded: a model input,
    parameter or buffer as stored; an activation (of global `shape`) as its producer's
    planned output with a Partial reduced (stages exchange complete values), and split
    over the replicated axes too where the plan's pipeline boundary is "scattered"
    (`plan.scattered_spec`): the sender and the receiver derive the same spec. Where the
    boundary is "canonical", whatever crosses (`crossing`: a stage's output, or what a
    stage after the first receives, forwarded user inputs too) is split alike on every
    stage mesh shape (`plan.canonical_spec`)."""
    pipeline = plan.pipeline
    if crossing and pipeline is not None and pipeline.boundary == "canonical":
        assert shape is not None, f"the crossing of '{name}' needs its shape"
        devices = math.prod(pipeline.stage_mesh)
        return canonical_spec(shape, devices, len(pipeline.stage_axis_names))
    for t in plan.tensors:
        if t.name == name:
            return parse_spec(t.spec)
    node = plan.node(name)
    spec = parse_spec(node.outputs[0])
    spec = summed_spec(spec)
    if pipeline is not None and pipeline.boundary == "scattered" and shape is not None:
        return scattered_spec(spec, shape, plan.stage_mesh_shape)
    return spec


def global_shape(stage: StageGraph, name: str) -> tuple[int, ...]:
    """The global shape of the value `name` in the stage's graph (an input or an output)."""
    node = next(n for n in stage.gm.graph.nodes if n.name == name)
    return tuple(node.meta["val"].shape)


def _example(stage: StageGraph, plan: Plan, names: list[str], mesh: DeviceMesh, crossing: bool):
    """PipelineStage's example of what the stage receives or sends (`crossing`: not the
    first stage's user inputs)."""
    out = []
    vals = {n.name: n.meta.get("val") for n in stage.gm.graph.nodes}
    for name in names:
        val = vals[name]
        # this rank's own piece: an uneven split (a microbatch of 3 rows on dp=2) differs
        # from rank to rank, and PipelineStage checks what it receives against the example
        meta = torch.empty(tuple(val.shape), device="meta")
        spec = boundary_spec(plan, name, tuple(val.shape), crossing)
        shape = local_chunk(meta, spec, mesh).shape
        example = torch.zeros(shape, dtype=val.dtype, device=mesh_device(mesh))
        # PipelineStage reads requires_grad off the examples: activations carry gradients
        out.append(example.requires_grad_(val.dtype.is_floating_point))
    return tuple(out)

"""Lowering: apply a plan and capture each rank's local training step as a plain FX graph.

`lower_plan(captured, plan, mesh) -> LocalStep`

How: the captured loss graph is interpreted once on DTensors. Parameters, buffers and
inputs enter as DTensors with their planned storage placement; before each node runs, every
tensor argument is redistributed to the placement the plan chose for that input (this is
where all-gathers, reduce-scatters, all-reduces and all-to-alls appear). After it runs, an
output whose placements differ from the plan's (DTensor picked another strategy) is not an
error: it is logged (debug) and redistributed to the planned placements, unless it is
Partial on some axis, in which case it is kept as is and its consumers' input
redistribution reduces it. The scalar loss is made replicated, and `torch.autograd.grad` of
it with respect to the *local* parameter shards produces gradients already reduced to each
parameter's storage placement (DTensor's `from_local` backward redistributes the gradient
back to the placement it was created with: Partial -> Replicate is the DP all-reduce,
Partial -> Shard the ZeRO/FSDP reduce-scatter). Each node computed from the batch has its
gradient pinned to its own placements, Partials made Replicate (`pin_gradient`): the
backward then runs the moves the search priced on each edge, not ones DTensor picks for a
gradient it kept Partial (checked in tests/test_priced_backward.py).

The whole forward + backward is traced with `make_fx` on fake tensors. DTensor dispatch
happens only while tracing: the resulting graph holds local ATen ops and
`_c10d_functional` collectives, so the training loop never dispatches through DTensor.
autopar's own DTensor strategies (:func:`autopar.passes.strategies.register_dtensor_rules`)
are registered before the first node runs.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autopar._compat import (
    cached_sharding_propagation,
    local_tensor,
    make_fx,
    strided_shards_as_split,
    tree_flatten,
    tree_unflatten,
)
from autopar.capture import Captured
from autopar.capture.analysis import computed_from
from autopar.capture.export import layer_of
from autopar.cost_models.rearrange import through_source, transposed_dims
from autopar.passes.comm import CommOptions, optimize_comm, options_of
from autopar.passes.precision import ParamBoundary
from autopar.passes.recompute import backward_phase, recompute_activations, tag_layer
from autopar.passes.strategies import register_dtensor_rules, summed_spec
from autopar.plan import Plan, parse_spec

log = logging.getLogger(__name__)


@dataclass
class LocalStep:
    """A rank's training step: `gm(*params, *buffers, *inputs) -> (loss, *param_grads,
    *new_buffers)`, the last `len(buffer_updates)` outputs being this rank's local values
    of the buffers the forward updates (`Captured.mutated_buffers`) in their storage spec."""

    gm: fx.GraphModule
    param_names: list[str]  # placeholder names, in the order gm takes them
    buffer_names: list[str]
    input_names: list[str]
    # after the inputs: flat master shards (ZeRO), the loss scale (`passes.precision`)
    extra_names: list[str] = field(default_factory=list)
    buffer_updates: list[str] = field(default_factory=list)  # the trailing outputs


class PlacedInterpreter(fx.Interpreter):
    """Runs the captured graph on DTensors, redistributing inputs as the plan says."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, mesh: DeviceMesh):
        super().__init__(gm)
        register_dtensor_rules()  # e.g. the CPU flash-attention kernels sdpa dispatches to
        self.mesh = mesh
        self.node_plans = {n.name: n for n in plan.nodes}
        self.replicated = tuple(Replicate() for _ in range(mesh.ndim))
        # id of a transposed DTensor -> (it, its source, the permutation): where a gather of
        # it splits an inner dim, the source is gathered instead (`_gathered_then_permuted`)
        self.permuted: dict[int, tuple[DTensor, DTensor, list[int]]] = {}
        self.batch_side = batch_side(gm)

    def run_node(self, n: fx.Node):
        tag_layer(layer_of(n))  # what recompute_activations reads off the traced nodes
        if n.op != "call_function" or n.target is operator.getitem:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        node_plan = self.node_plans.get(n.name)
        if n.target is SDPA and node_plan is not None:
            check_context_parallel_runs(n, node_plan.inputs[0], self.mesh.device_type)
        flat, spec = tree_flatten((args, kwargs))
        tensor_positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        wanted = node_plan.inputs if node_plan else (None,) * len(tensor_positions)
        has_dtensor = any(isinstance(flat[i], DTensor) for i in tensor_positions)
        for i, want in zip(tensor_positions, wanted, strict=False):
            flat[i] = self._place(flat[i], parse_spec(want), has_dtensor)
        args, kwargs = tree_unflatten(flat, spec)
        if n.target in VIEWS and isinstance(args[0], DTensor):
            out = _ShardSafeView.apply(_viewable(args[0]), args[1])
        else:
            out = n.target(*args, **kwargs)
        out = self._check_output(n, out, node_plan)
        if n.name in self.batch_side:
            out = pin_gradient(out)
        dims = permutation(n, args)
        if dims is not None and isinstance(out, DTensor) and isinstance(args[0], DTensor):
            self.permuted[id(out)] = (out, args[0], dims)
        return out

    def _place(self, value: torch.Tensor, want, has_dtensor: bool) -> torch.Tensor:
        if not isinstance(value, DTensor):
            if not has_dtensor:
                return value  # constants computed from constants stay plain tensors
            value = DTensor.from_local(value, self.mesh, self.replicated, run_check=False)
        if want is None or tuple(value.placements) == tuple(want):
            return value
        if any(
            w.is_partial() and c == Replicate() for w, c in zip(want, value.placements, strict=True)
        ):
            value = _ReplicateToPartial.apply(value, want)
        if all(
            w.is_partial() == c.is_partial() and (w.is_partial() or w == c)
            for w, c in zip(want, value.placements, strict=True)
        ):
            return value  # a Partial of another kind (e.g. the embedding's masked sum) is kept
        found = self.permuted.get(id(value))
        if found is not None and found[0] is value:
            moved = _gathered_then_permuted(found[1], value, found[2], want)
            if moved is not None:
                return moved
        return value.redistribute(self.mesh, want)

    def _check_output(self, n: fx.Node, out, node_plan) -> object:
        if node_plan is None or not isinstance(out, DTensor) or not node_plan.outputs:
            return out
        want = parse_spec(node_plan.outputs[0])
        if want is not None and tuple(out.placements) != tuple(want):
            log.debug(
                "%s: DTensor chose %s, plan says %s; redistributing", n.name, out.placements, want
            )
            if not any(p.is_partial() for p in out.placements):
                out = out.redistribute(self.mesh, want)
        return out


def batch_side(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes computed from the batch (a user input, or a pipeline stage's
    received activation). The rest (a weight's transpose or cast, a position embedding)
    depends on parameters and constants only: its gradient is a parameter's, reduced where
    the plan reduces a parameter's (once per step, bucketed, reduce-scattered under ZeRO),
    as the search prices it (`CostContext.is_weight`)."""

    def received(n: fx.Node) -> bool:
        return n.op == "placeholder" and n.meta.get("autopar_role") not in ("param", "buffer")

    return {n.name for n in computed_from(gm.graph, received)}


def pin_gradient(out):
    """`out`, its gradient made to arrive in `out`'s placements with its Partials Replicate:
    the placement the search prices each node's backward from (`CostContext._grad_source`).
    Left alone, DTensor's backward keeps a gradient Partial for as long as its ops allow
    (a row-parallel product's gradient flows down the residual stream unreduced) and each
    backward op then picks its own strategy for what arrives: gathering weights,
    reduce-scattering activations, moves the plan never priced. With the gradient in the
    forward's placement, every backward op finds the strategy mirroring its forward's."""
    if not isinstance(out, DTensor) or not out.requires_grad:
        return out
    want = summed_spec(out.placements)
    mesh = out.device_mesh

    def placed(grad):
        if isinstance(grad, DTensor) and tuple(grad.placements) != want:
            return grad.redistribute(mesh, want)
        return grad

    out.register_hook(placed)
    return out


class _ReplicateToPartial(torch.autograd.Function):
    """``value`` as the Partial ``want`` asks for on each axis where it is Replicate (a
    complete value entering a pipeline stage whose plan keeps it partial, e.g. a running
    loss sum): a sum keeps the value on the axis's first rank and zeros elsewhere (exact),
    an average keeps it everywhere. Its gradient is the output's, made Replicate (each
    partial counts once). DTensor refuses the forward step as internal."""

    @staticmethod
    def forward(ctx, value: DTensor, want) -> DTensor:
        coordinate = value.device_mesh.get_coordinate()
        assert coordinate is not None, "this rank is not in the mesh"
        local, placements = local_tensor(value), list(value.placements)
        for axis, (w, c) in enumerate(zip(want, value.placements, strict=True)):
            if w.is_partial() and c == Replicate():
                placements[axis] = w
                if w.reduce_op == "sum" and coordinate[axis] != 0:
                    local = torch.zeros_like(local)
        ctx.placements = tuple(value.placements)
        mesh, shape, stride = value.device_mesh, value.shape, value.stride()
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )

    @staticmethod
    def backward(ctx, grad: DTensor):
        return grad.redistribute(grad.device_mesh, ctx.placements), None


VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def permutation(n: fx.Node, args) -> list[int] | None:
    """Output dim i = input dim `dims[i]` of a transposing node (None for any other)."""
    ndim = args[0].ndim if args and isinstance(args[0], torch.Tensor) else 0
    return transposed_dims(n.target, args, ndim)


def _gathered_then_permuted(source: DTensor, value: DTensor, dims: list[int], want):
    """`value` (= `source` permuted by `dims`) redistributed to `want` as `source`
    gathered, then permuted, where that spares DTensor's copies
    (`cost_models.rearrange.through_source`: a gather of an inner dim cuts and re-joins
    the result along that dim, its backward the same around the reduce-scatter; a
    Linear's `t(weight)` under FSDP, split on dim 1 where the weight is split on dim 0,
    gathered as the weight is read in place); None where the value is moved itself. The
    same collectives of the same bytes: priced alike, the copies priced as they run."""
    mapped = through_source(value.placements, want, dims, source.placements)
    if mapped is None:
        return None
    return torch.ops.aten.permute.default(source.redistribute(source.device_mesh, mapped), dims)


SDPA = torch.ops.aten.scaled_dot_product_attention.default


def check_context_parallel_runs(n: fx.Node, q_spec: str | None, device_type: str) -> None:
    """Context parallelism (attention's queries split on the sequence) runs through the CPU
    flash-attention kernels' DTensor handlers (`rules.attention`, `rules.ring`); CUDA's
    kernels have none yet, and DTensor would gather the sequence instead of running what the
    plan priced: refuse, naming the fix."""
    seq_split = any(p == "S(2)" for p in (q_spec or "").split(","))
    if seq_split and device_type != "cpu":
        raise NotImplementedError(
            f"{n.name}: the plan splits attention on the sequence (context parallelism), which "
            f"autopar runs only on CPU flash-attention kernels so far, not on {device_type}. "
            "Fix: plan without context parallelism (pin the axes, e.g. strategy=('dp', 'tp'))."
        )


def _contiguous_local(x):
    """A view of the global tensor need not be a view of a shard (a head-sharded attention
    output is not contiguous where the global one is): copy the shard only then."""
    if isinstance(x, DTensor) and not local_tensor(x).is_contiguous():
        # _to_copy keeps a Partial partial (DTensor's clone reduces it first)
        return torch.ops.aten._to_copy.default(x, memory_format=torch.contiguous_format)
    return x


def _viewable(x: DTensor) -> DTensor:
    """`x` with a contiguous shard and contiguous global strides. A view's values depend
    only on the logical order of elements, but DTensor checks a view against the global
    strides it tracks, and those can say "permuted" where the captured graph's tensor was
    contiguous (the CPU flash kernel's output is laid out [B, T, H, D] and permuted back, so
    Hugging Face's `transpose(1, 2).reshape(...)` was captured as a view): relabel them."""
    x = _contiguous_local(x)
    if x.is_contiguous():
        return x
    return DTensor.from_local(
        x.to_local(),
        x.device_mesh,
        x.placements,
        run_check=False,
        shape=x.shape,
        stride=_contiguous_stride(x.shape),
    )


class _ShardSafeView(torch.autograd.Function):
    """view() whose backward copies a gradient shard that is not contiguous.

    DTensor's global strides describe the unsharded tensor; a redistribution (e.g. the
    all-gather of a head-sharded attention gradient) can return a shard laid out otherwise,
    and autograd's `grad.reshape(...)` would then pick a view the shard cannot take."""

    @staticmethod
    def forward(ctx, x: DTensor, shape):
        ctx.in_shape = x.shape
        return torch.ops.aten.view.default(x, shape)

    @staticmethod
    def backward(ctx, grad):
        # a fused projection's gradient flattened back: strided as its weight is, so that
        # its matmuls stay partial (column-parallel QKV's input gradient)
        return strided_shards_as_split(_view_back(grad, ctx.in_shape)), None


def _view_back(grad, shape):
    grad = _contiguous_local(grad)
    if isinstance(grad, DTensor) and not grad.is_contiguous():
        try:  # a gradient laid out otherwise globally (einsum's bmm) may still view
            return torch.ops.aten.view.default(grad, shape)
        except RuntimeError:  # DTensor's propagation refuses: copy to a contiguous one
            grad = torch.ops.aten._to_copy.default(grad, memory_format=torch.contiguous_format)
    return torch.ops.aten.view.default(grad, shape)


def _wrap(local: torch.Tensor, spec, shape: Sequence[int], mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(
        local,
        mesh,
        spec,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def lower_plan(
    captured: Captured,
    plan: Plan,
    mesh: DeviceMesh,
    example_locals: dict[str, torch.Tensor],
    comm: CommOptions | None = None,
) -> LocalStep:
    """Trace the planned step into a per-rank graph of local ops and functional collectives.

    `example_locals` maps every placeholder name to this rank's local tensor (parameters
    with requires_grad); only shapes and dtypes are used (tracing runs on fake tensors).
    `comm`: how `passes.comm` buckets the gradient reductions and overlaps the collectives
    (`passes.comm.OFF`: the program as traced, one collective per tensor waited at once);
    default: the plan's (`Plan.comm`, what its step time was priced with; None: OFF).
    """
    comm = options_of(plan.comm) if comm is None else comm
    tensors = {t.name: t for t in plan.tensors}
    params = [n for n in captured.params if n in example_locals]
    buffers = [n for n in list(captured.buffers) + list(captured.constants)]
    inputs = list(captured.user_inputs)
    order = params + buffers + inputs
    interp = PlacedInterpreter(captured.gm, plan, mesh)
    # mixed precision / ZeRO / loss scaling at the parameters (passes.precision)
    boundary = ParamBoundary.of(plan)
    extras = boundary.extra_names(params)

    def step(*locals_: torch.Tensor):
        given, extra = locals_[: len(order)], locals_[len(order) :]
        env = {}
        for i, (name, local) in enumerate(zip(order, given, strict=True)):
            t = tensors[name]
            if i < len(params) and not boundary.plain:
                flat = extra[i] if boundary.shard_optimizer else None
                env[name] = boundary.wrap(local, parse_spec(t.spec), t.shape, mesh, flat)
            else:
                env[name] = _wrap(local, parse_spec(t.spec), t.shape, mesh)
        outs = interp.run(
            *[env[ph.name] for ph in captured.placeholders()], enable_io_processing=False
        )
        loss, *updates = outs if isinstance(outs, (tuple, list)) else (outs,)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        new_buffers = [
            _stored(v, parse_spec(tensors[name].spec), mesh)
            for name, v in zip(captured.mutated_buffers, updates, strict=True)
        ]
        targets = boundary.grad_targets(given[: len(params)], extra)
        with backward_phase():
            grads = torch.autograd.grad(
                boundary.scaled_loss(loss, extra), targets, allow_unused=True
            )
        grads = [
            torch.zeros_like(p) if g is None else g for g, p in zip(grads, targets, strict=True)
        ]
        return (loss.detach(), *grads, *new_buffers)

    examples = [example_locals[n] for n in order + extras]
    with fx_traceback.preserve_node_meta(), cached_sharding_propagation():
        gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=False)(*examples)
    gm = recompute_activations(gm, plan.memory, _placeholder_names(gm, order, inputs))
    optimize_comm(gm, comm)
    return LocalStep(
        gm=gm,
        param_names=params,
        buffer_names=buffers,
        input_names=inputs,
        extra_names=extras,
        buffer_updates=list(captured.mutated_buffers),
    )


def _stored(value: torch.Tensor, spec, mesh: DeviceMesh) -> torch.Tensor:
    """A buffer's new value as this rank stores it: redistributed (detached) from the
    placement its node was planned with to the buffer's storage placement."""
    value = value.detach()
    if not isinstance(value, DTensor):  # computed from constants alone: whole everywhere
        replicated = tuple(Replicate() for _ in range(mesh.ndim))
        value = DTensor.from_local(value, mesh, replicated, run_check=False)
    return local_tensor(value.redistribute(mesh, spec))


def _placeholder_names(gm: fx.GraphModule, order: list[str], names: list[str]) -> list[str]:
    """The traced program's placeholder names (arg0_1, ...) of the captured ones `names`."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [placeholders[order.index(name)] for name in names]

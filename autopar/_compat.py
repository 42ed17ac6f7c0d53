"""The one place where autopar touches private PyTorch APIs.

A torch upgrade that moves one of these breaks this file only. The rest of autopar sees a
small interface, grouped by the stage that uses it, each group saying why the public API
does not suffice:

* types and tracing helpers re-exported as they are (``OpOverload``, ``make_fx``, the
  pytree flatten/unflatten, ...), listed in ``__all__``;
* DTensor's sharding-strategy registry behind functions: :func:`single_dim_rule`,
  :func:`op_strategy_func`, :func:`op_schema_info` and :func:`decomp_strategy` look an op
  up; :func:`register_op_strategy` adds one; :func:`clear_sharding_cache` forgets cached
  propagations; :func:`no_dtensor_redistribute_costs` disables DTensor's own resharding
  prices while autopar enumerates; :data:`NO_STRATEGY_ERRORS` are the exceptions with
  which DTensor says "no strategy for these arguments";
* DTensor tensors and placements: :func:`local_tensor`, :func:`is_mask_partial`;
* ops: :func:`is_collective_op`.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

# pipeline stages: AOTAutograd splits a stage's traced program into forward and backward
# graphs behind one autograd.Function (the schedules drive forward and backward separately);
# a compiler it calls returns a function of one boxed argument list (make_boxed_func).
from torch._functorch.aot_autograd import aot_function, make_boxed_func

# pipeline stages with recompute: the joint graph rewritten by passes/recompute, then split
# by AOTAutograd's default partitioner (saves what backward reads of the forward)
from torch._functorch.partitioners import default_partition

# fusion pass (passes/fusion): the fake mode of a graph's FakeTensor values, to run a new
# op's fake implementation on them.
from torch._guards import detect_fake_mode

# fusion="inductor" (runtime/inductor.py): importing torch._dynamo already fills
# TORCHINDUCTOR_CACHE_DIR with torch's default (a folder in the system's temp directory);
# its default is what tells that value apart from one the user chose.
from torch._inductor.runtime.cache_dir_utils import (
    default_cache_dir as default_inductor_cache_dir,
)

# fusion pass, plan assembly, rules: the type of `torch.ops.<namespace>.<op>.<overload>`
# (no public alias).
from torch._ops import OpOverload

# lowering: DTensor's redistribution costs computed outside the tracing fake mode
# (`cached_sharding_propagation`); capture: the shapes of a graph made concrete at a
# microbatch size (`capture.rows.at_rows`) are fake tensors like those export records.
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

# strategies (autopar/passes/strategies): the schema types DTensor's strategy functions
# take and return (autopar reads DTensor's strategies and writes its own for the fused and
# CPU flash-attention ops), placeholder dims in DTensor's single-mesh-dim rules, the
# full-mesh expansion helper, and LocalTensorMode (N ranks in one process) for the strategy
# tests, the vocab-parallel embedding's masked partial. None has a public equivalent.
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._decompositions import DecompShardingStrategy
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
from torch.distributed.tensor._ops import _math_ops, _matrix_ops, _tensor_ops, _view_ops
from torch.distributed.tensor._ops import utils as _ops_utils
from torch.distributed.tensor._ops.single_dim_strategy import (
    _ShardingPlaceholder as ShardingPlaceholder,
)
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.placement_types import Placement
from torch.distributed.tensor.placement_types import _MaskPartial as MaskPartial

# a column-split fused projection (`passes.strategies.strided`): a dim of k pieces, each split
# over the axis (DTensor's own layout for it; no public name).
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# capture: graph modules whose Python code is generated when first run or read, not when
# made (the planner reads the graph of each it makes, a 32-block model's ~0.1 s each).
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule

# capture / lowering: tracing a DTensor program into a plain per-rank graph. make_fx is the
# tracer for this (torch.export cannot trace through a tensor subclass's dispatch).
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

# planning at scale and tests: the fake process group's store.
from torch.testing._internal.distributed.fake_pg import FakeStore

# measured memory (runtime/memory_stats.py): a dispatch mode that sees every op's outputs
# (public only under this private module).
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# lowering: an op's (args, kwargs) flattened to leaves and rebuilt (torch 2.13 has no public
# torch.utils.pytree).
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "NO_STRATEGY_ERRORS",
    "DTensorSpec",
    "FakeTensorMode",
    "FakeStore",
    "LazyGraphModule",
    "LocalTensorMode",
    "MaskPartial",
    "StridedShard",
    "OpOverload",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "RuntimeSchemaInfo",
    "ShardingPlaceholder",
    "TensorMeta",
    "TorchDispatchMode",
    "TupleStrategy",
    "aot_function",
    "clear_sharding_cache",
    "decomp_strategy",
    "default_partition",
    "default_inductor_cache_dir",
    "detect_fake_mode",
    "dispatch_with_local",
    "expand_to_full_mesh_op_strategy",
    "implicit_redistributions",
    "is_collective_op",
    "is_mask_partial",
    "local_tensor",
    "make_boxed_func",
    "make_fx",
    "merge_collective_bucket",
    "no_dtensor_redistribute_costs",
    "op_schema_info",
    "op_strategy_func",
    "register_dtensor_handler",
    "register_op_strategy",
    "shape_only_mesh",
    "single_dim_rule",
    "tree_flatten",
    "tree_unflatten",
]

# ------------------------------------------------------------------ DTensor's registry

# How DTensor's strategy functions say "no strategy for these arguments" (or for this op):
# most `raise AssertionError(...)`, the view ops RuntimeError ("requires redistribution",
# "unevenly sharded"), the math ops and mesh checks ValueError, the decomposition path
# NotImplementedError. Anything else (TypeError, ...) is a bug in how autopar called it, and
# propagates (but for the lookups `from_dtensor.REJECTED` adds for OpStrategy functions).
NO_STRATEGY_ERRORS: tuple[type[Exception], ...] = (
    AssertionError,
    NotImplementedError,
    RuntimeError,
    ValueError,
)


def _propagator() -> Any:
    return DTensor._op_dispatcher.sharding_propagator


def single_dim_rule(op: object) -> Callable[..., list] | None:
    """DTensor's single-mesh-dim rule function of ``op`` (None: none registered).

    Called as ``rule(op, args, kwargs)`` with ``TensorMeta`` in place of tensors, it returns
    rules ``[out..., in...]`` for one mesh axis, ``ShardingPlaceholder(d)`` meaning
    ``Shard(d)``; the all-Replicate rule is implied."""
    return _propagator().op_single_dim_strategy_funcs.get(op)


def op_strategy_func(op: object) -> Callable[[OpSchema], Any] | None:
    """DTensor's op-strategy function of ``op`` (None: none registered): called with an
    ``OpSchema`` whose tensor args are ``OpStrategy`` objects, it returns an ``OpStrategy``
    (or ``TupleStrategy``)."""
    return _propagator().op_strategy_funcs.get(op)


def op_schema_info(op: object) -> RuntimeSchemaInfo | None:
    """The ``RuntimeSchemaInfo`` registered with ``op``'s strategy function, if any."""
    return _propagator().op_to_schema_info.get(op)


def decomp_strategy(op: object, args: tuple, kwargs: dict) -> OpStrategy | None:
    """DTensor's decomposition-based strategy for ``op`` on args whose tensors are
    ``DTensorSpec``s: DTensor traces the op's decomposition once per single-axis input
    placement. None when ``op`` has no decomposition (or no tensor argument); raises one of
    :data:`NO_STRATEGY_ERRORS` when the propagation fails."""
    if not isinstance(op, OpOverload) or not DecompShardingStrategy.has_decomp(op):
        return None
    decomp = _propagator().decomp_strategy
    decomp.ensure_schema_info(op)
    return decomp.propagate_strategy(OpSchema(op, args, kwargs))


def register_op_strategy(
    op: OpOverload, strategy: Callable[[OpSchema], OpStrategy], schema_info: RuntimeSchemaInfo
) -> None:
    """Make DTensor run ``op`` with ``strategy`` (replacing any it had), and forget cached
    propagations so that the next dispatch sees it."""
    _propagator().register_op_strategy(op, strategy, schema_info=schema_info)
    clear_sharding_cache()


def clear_sharding_cache() -> None:
    """Forget DTensor's cached sharding propagations (they key on the op, not its rule)."""
    _propagator().propagate_op_sharding.cache_clear()


def _zero_costs(src_strategy: OpStrategy, dst_spec: DTensorSpec) -> list[float]:
    return [0.0] * len(src_strategy.strategies)


# The modules whose strategy functions call `generate_redistribute_costs` by its
# module-level name (each imported it from `utils`, so each binding is patched).
_COST_HOOK_MODULES = (_math_ops, _matrix_ops, _ops_utils, _tensor_ops, _view_ops)


@contextlib.contextmanager
def no_dtensor_redistribute_costs() -> Iterator[None]:
    """Within the context, DTensor's strategy functions price no resharding (all zero).

    They price every (input candidate, strategy) pair, which is quadratic in the candidates
    and 95% of the enumeration's time on a 3-D mesh; autopar's search prices resharding
    itself. The previous functions are restored on exit."""
    saved = [(m, m.generate_redistribute_costs) for m in _COST_HOOK_MODULES]
    try:
        for m, _ in saved:
            m.generate_redistribute_costs = _zero_costs
        yield
    finally:
        for m, fn in saved:
            m.generate_redistribute_costs = fn


def untraced_strided_offsets() -> None:
    """DTensor computes a ``_StridedShard``'s local sizes and offsets with an index tensor
    and ``.tolist()`` (``local_shard_size_and_offset``, run by every redistribution of a
    strided shard). Traced inside a pipeline stage's AOTAutograd program that is a
    data-dependent read of a functional tensor, which fails; for plain int sizes it is
    index arithmetic on the host, so it runs here with the tracing and dispatch modes off.
    Idempotent."""
    original = StridedShard.local_shard_size_and_offset
    if getattr(original, "autopar_untraced", False):
        return

    @functools.wraps(original)
    def untraced(self, *args: Any, **kwargs: Any):
        if any(not isinstance(a, (int, enum.Enum)) for a in (*args, *kwargs.values())):
            return original(self, *args, **kwargs)  # symbolic or per-rank sizes
        with _disable_current_modes(), disable_proxy_modes_tracing():
            return original(self, *args, **kwargs)

    untraced.autopar_untraced = True  # type: ignore[attr-defined]
    StridedShard.local_shard_size_and_offset = untraced


@contextlib.contextmanager
def cached_sharding_propagation() -> Iterator[None]:
    """Within the context, DTensor reuses its cached sharding propagations, redistribution
    plans and redistribution costs while a graph is being traced (make_fx), as it does in
    eager mode.

    DTensor skips its caches under tracing because symbolic shapes must not be specialised;
    autopar's lowering traces with static fake shapes, where the cached answer is the same.
    Recomputing every op's propagation was a third of the lowering's time; recomputing the
    cost of every candidate redistribution (a graph search per pair of specs where a fused
    QKV projection is split, `_StridedShard`) was 80% of a Hugging Face GPT-2's."""
    from torch.distributed.tensor import _redistribute, _sharding_prop
    from torch.distributed.tensor._ops import utils

    saved = _sharding_prop._are_we_tracing, _redistribute._are_we_tracing, utils.redistribute_cost
    _sharding_prop._are_we_tracing = _redistribute._are_we_tracing = lambda: False

    @functools.cache  # specs hash their mesh, placements, shape and dtype
    def redistribute_cost(current, target) -> float:
        # a cost reads specs only; its own index arithmetic (strided shards' offsets) must
        # not run on fake tensors or be traced into the program
        with disable_proxy_modes_tracing(), unset_fake_temporarily():
            return saved[2](current, target)

    utils.redistribute_cost = redistribute_cost
    try:
        yield
    finally:
        _sharding_prop._are_we_tracing, _redistribute._are_we_tracing, utils.redistribute_cost = (
            saved
        )


@contextlib.contextmanager
def implicit_redistributions() -> Iterator[list[tuple[str, tuple[int, ...], tuple, tuple]]]:
    """Within the context, each move over the network that DTensor's sharding propagation
    chose for an op's input (one not asked for with `redistribute`) is recorded as (the op
    with its arguments' specs, global shape, source placements, destination placements) in
    the list the context gives. DTensor reports them to its private
    `ExplicitRedistributionContext`; this wraps that report."""
    from torch.distributed.tensor._ops.utils import redistribute_cost
    from torch.distributed.tensor._utils import ExplicitRedistributionContext as Context

    moves: list[tuple[str, tuple[int, ...], tuple, tuple]] = []
    saved = Context.__dict__["observe_redistribution"]

    def observe(cls, src, dst, message) -> None:
        if redistribute_cost(src, dst) > 0:
            moves.append((str(message), tuple(src.shape), src.placements, dst.placements))

    Context.observe_redistribution = classmethod(observe)
    try:
        yield moves
    finally:
        Context.observe_redistribution = saved


# ------------------------------------------------------------------ DTensor tensors


def local_tensor(dt: DTensor) -> torch.Tensor:
    """This rank's shard of ``dt`` as stored (no autograd node, unlike ``to_local()``)."""
    return dt._local_tensor


def dtensor_spec(dt: DTensor) -> DTensorSpec:
    """``dt``'s layout (mesh, placements, global shape) as DTensor's dispatch sees it."""
    return dt._spec


def strided_shards_as_split(dt: torch.Tensor) -> torch.Tensor:
    """``dt`` with its ``_StridedShard`` placements read as ``from_local`` reads them (same
    local tensor, no communication). DTensor's view propagation marks a strided shard it
    makes from a flattened split (a fused projection's q, k, v gradients stacked back) as
    "a regular Shard" (``use_strided_shard_as_shard_order=False``); its matmul strategies
    then do not match it against a parameter's ``_StridedShard`` of the same split, and
    gather both to compute the whole product instead of a partial one."""
    if not isinstance(dt, DTensor):
        return dt
    spec = dt._spec
    if spec.use_strided_shard_as_shard_order is not False or not any(
        isinstance(p, StridedShard) for p in spec.placements
    ):
        return dt
    return DTensor.from_local(
        dt._local_tensor,
        spec.mesh,
        spec.placements,
        run_check=False,
        shape=dt.shape,
        stride=dt.stride(),
    )


def is_mask_partial(p: Placement) -> bool:
    """``p`` is DTensor's masked partial sum (the vocab-parallel embedding's output)."""
    return isinstance(p, MaskPartial)


# ------------------------------------------------------------------ collectives

# the namespaces of torch.distributed's collective ops (functional ones in traced programs)
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


def is_collective_op(func: object) -> bool:
    """``func`` is a torch.distributed collective (its outputs are communication buffers)."""
    return isinstance(func, OpOverload) and func.namespace in _COLLECTIVE_NAMESPACES


def merge_collective_bucket(
    graph: torch.fx.Graph, nodes: list[torch.fx.Node], insert_before: torch.fx.Node
) -> dict[torch.fx.Node, torch.fx.Node]:
    """Replace the functional collectives ``nodes`` (all all_reduce, reduce_scatter_tensor or
    all_gather_into_tensor, same group and dtype, each waited once) by one collective on their
    flat concatenation whose split views replace their waits, inserted before
    ``insert_before``; returns each old wait's replacement (erased wait -> new node). Inductor's
    bucketing pass does exactly this (no public API); imported here on first use (it loads
    inductor, ~1-3 s)."""
    from torch._inductor.fx_passes import bucketing

    merge = {
        "all_reduce": bucketing.merge_all_reduce_bucket,
        "reduce_scatter_tensor": bucketing.merge_reduce_scatter_bucket,
        "all_gather_into_tensor": bucketing.merge_all_gather_bucket,
    }[nodes[0].target._schema.name.split("::")[-1]]
    _, replacements = merge(graph, nodes, mode="default", insert_before=insert_before)
    return replacements


# ------------------------------------------------------------------ pipeline schedules


def pipeline_order(class_name: str, pp: int, stages_of: list[list[int]], microbatches: int):
    """The per-rank action order torch.distributed.pipelining's multi-stage schedule
    ``class_name`` executes (its ``pipeline_order``, computed on stand-in stages): per rank,
    a list of steps, each a tuple of (kind, stage, microbatch) run one after the other, kind
    "F", "I" (input gradient), "W" (weight gradient) or "B" (full backward). Raises
    ValueError where torch rejects the microbatch count."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    num = sum(len(s) for s in stages_of)
    stand_ins = [
        SimpleNamespace(
            num_stages=num,
            group_size=pp,
            group_rank=0,
            stage_index=s,
            submod=torch.nn.Identity(),
            is_first=s == 0,
            is_last=s == num - 1,
        )
        for s in stages_of[0]
    ]
    # the compute order only: torch's constructor also lowers it to a schedule with
    # communication actions (`_prepare_schedule_with_comms`, quadratic in the actions: ~4 s
    # for 32 ranks and 256 microbatches), which nothing here reads; its validation is kept
    cls = getattr(schedules, class_name)
    lean = type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": _compute_order_only})
    sched = lean(stand_ins, microbatches)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    out = []
    for rank in range(pp):
        steps = []
        for act in sched.pipeline_order[rank]:
            if act is None:
                continue
            subs = act.sub_actions or (act,)
            steps.append(
                tuple(
                    (kinds[a.computation_type.name], a.stage_index, a.microbatch_index)
                    for a in subs
                )
            )
        out.append(steps)
    return out


def _compute_order_only(self, actions, format="compute_only") -> None:  # noqa: A002
    self._validate_and_set_stage_mapping(actions)


# ------------------------------------------------------------------ DTensor op handlers


def register_dtensor_handler(op: OpOverload, handler: Callable[..., object]) -> None:
    """Route DTensor's dispatch of `op` to `handler(op_call, args, kwargs)` (idempotent)."""
    DTensor._op_dispatcher._custom_op_handlers[op] = handler


def dispatch_with_local(
    op_call: OpOverload,
    args: tuple,
    kwargs: dict,
    local_call: Callable[[tuple, dict, Any, tuple], object],
) -> object:
    """DTensor's own dispatch of `op_call` (propagate, redistribute the inputs, wrap the
    outputs), with the local computation `local_call(local_args, local_kwargs,
    output_spec, input_specs)` in place of `op_call(*local_args, **local_kwargs)`;
    `input_specs` are the tensor args' `DTensorSpec`s as the op receives them."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    assert sharding is not None
    if sharding.needs_redistribute:
        assert sharding.redistribute_schema is not None
        dispatcher.redistribute_local_args(
            op_info, sharding.redistribute_schema, sharding.use_val_from_redistribute_schema
        )
    local_args = (
        tree_unflatten(list(op_info.local_args), op_info.args_tree_spec)
        if op_info.args_tree_spec
        else tuple(op_info.local_args)
    )
    schema = sharding.redistribute_schema if sharding.needs_redistribute else op_info.schema
    assert schema is not None
    result = local_call(
        tuple(local_args), dict(op_info.local_kwargs), sharding.output_spec, schema.args_spec
    )
    return dispatcher.wrap(result, sharding.output_spec)


def shape_only_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A DeviceMesh of `shape` that creates no process groups (`_init_backend=False`):
    planning reads only shapes, so rank 0 of a running job can price meshes the job never
    builds. torch reads `_dim_group_names` when slicing; empty, its slices have no groups
    either."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(math.prod(shape)).reshape(shape)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names, _init_backend=False)
    mesh._dim_group_names = []
    return mesh


def process_group_named(group_name: str) -> Any:
    """The ProcessGroup registered under ``group_name`` (as traced collectives name it)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def all_to_all_autograd(
    x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: Any
) -> torch.Tensor:
    """Differentiable all-to-all with variable splits on ``group`` (its backward is the
    reverse exchange); torch's functional collective, waited."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x, recv_splits, send_splits, group))

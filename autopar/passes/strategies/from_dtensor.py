"""Strategies read from DTensor's own sharding registry.

Three sources, tried in this order by :func:`dtensor_strategies`:

1. *Single-mesh-dim rules* (``op_single_dim_strategy_funcs``: mm, addmm, pointwise ops,
   layer norm, embedding, ...). A rule ``[out..., in...]`` holds for one mesh axis, with
   ``_ShardingPlaceholder(d)`` meaning ``Shard(d)``; DTensor adds the all-Replicate rule
   implicitly. An N-D strategy picks one rule per axis (the Cartesian product), exactly as
   DTensor's ``expand_to_full_mesh_op_strategy`` does at run time.
2. *Op-strategy functions* (``op_strategy_funcs``: views, reductions, softmax, nll_loss,
   split, cat, ...). These take an ``OpSchema`` whose tensor args are ``OpStrategy`` objects
   and mostly *follow* their inputs, so each input is offered the distinct output specs of
   its producer's strategies; we read back each returned ``OpSpec``'s input/output specs.
   An ``OpSpec`` whose inputs differ from what the producer offers is kept: the search
   prices that resharding on the edge.
3. *Decomposition-based propagation* (``DecompShardingStrategy``) for ops in neither table:
   DTensor traces the op's decomposition once per single-axis input placement.

Every result is filtered by :func:`~autopar.passes.strategies.spec.is_valid_spec` (no
strided shards, no max/min partials, avg only on 0-d tensors, even division). Strategy
functions also price every (candidate, strategy) pair with DTensor's redistribute-cost
model, quadratic in the candidates; :func:`no_redistribute_costs` stubs that out while
enumerating (the search prices resharding with autopar's own cost model).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._compat import (
    DecompShardingStrategy,
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    ShardingPlaceholder,
    TensorMeta,
    TupleStrategy,
    dtensor_math_ops,
    dtensor_matrix_ops,
    dtensor_ops_utils,
    dtensor_tensor_ops,
    dtensor_view_ops,
    sharding_propagator,
)
from autopar.passes.strategies.spec import (
    NodeStrategy,
    Spec,
    is_allowed,
    is_valid_spec,
    output_vals,
    tensor_inputs,
)

Candidates = dict[fx.Node, list[Spec]]  # per producer node: the output specs it may have
MAX_COMBOS = 512


_COST_HOOK_MODULES = (
    dtensor_math_ops,
    dtensor_matrix_ops,
    dtensor_ops_utils,
    dtensor_tensor_ops,
    dtensor_view_ops,
)


def _zero_costs(src_strategy: OpStrategy, dst_spec: DTensorSpec) -> list[float]:
    return [0.0] * len(src_strategy.strategies)


@contextlib.contextmanager
def no_redistribute_costs() -> Iterator[None]:
    """Stub out DTensor's redistribute-cost estimate while enumerating.

    Strategy functions price every (input candidate, strategy) pair, which is quadratic in
    the candidates and 95% of the time on a 3-D mesh; the search prices resharding itself.
    """
    saved = [(m, m.generate_redistribute_costs) for m in _COST_HOOK_MODULES]
    try:
        for m, _ in saved:
            m.generate_redistribute_costs = _zero_costs
        yield
    finally:
        for m, fn in saved:
            m.generate_redistribute_costs = fn


def tensor_meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=val.shape, stride=val.stride(), dtype=val.dtype)


def _map_args(node: fx.Node, fn: Callable[[fx.Node], Any]) -> tuple[tuple, dict]:
    """``node``'s (args, kwargs) with each tensor input replaced by ``fn(input)``.

    Lists made only of tensor inputs become ``TupleStrategy`` when ``fn`` builds
    ``OpStrategy``s (DTensor's own wrapping); non-tensor inputs become their value.
    """

    def conv(a: Any) -> Any:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            return fn(a) if isinstance(val, torch.Tensor) else val
        if isinstance(a, (list, tuple)):
            items = [conv(x) for x in a]
            if items and all(isinstance(x, OpStrategy) for x in items):
                return TupleStrategy(items)
            return type(a)(items) if isinstance(a, tuple) else items
        return a

    return tuple(conv(a) for a in node.args), {k: conv(v) for k, v in node.kwargs.items()}


def _node_shapes(node: fx.Node) -> tuple[list[Sequence[int] | None], list[Sequence[int] | None]]:
    ins = [
        i.meta["val"].shape if isinstance(i.meta.get("val"), torch.Tensor) else None
        for i in tensor_inputs(node)
    ]
    outs = [None if v is None else v.shape for v in output_vals(node)]
    return ins, outs


def make_strategy(
    node: fx.Node,
    inputs: Sequence[Spec | None],
    outputs: Sequence[Spec | None],
    mesh_shape: Sequence[int],
) -> NodeStrategy | None:
    """A NodeStrategy if every spec is valid for its operand's shape, else None."""
    in_shapes, out_shapes = _node_shapes(node)
    if len(inputs) != len(in_shapes) or len(outputs) != len(out_shapes):
        return None
    for spec, shape in zip((*inputs, *outputs), (*in_shapes, *out_shapes), strict=True):
        if spec is not None and (shape is None or not is_valid_spec(spec, shape, mesh_shape)):
            return None
    return NodeStrategy(tuple(inputs), tuple(outputs))


def expand_per_axis(
    node: fx.Node, rules: Sequence[Sequence[Placement | None]], n_out: int, mesh: DeviceMesh
) -> list[NodeStrategy]:
    """N-D strategies from single-axis rules ``[out_0..out_{n_out-1}, in_0, ...]``.

    One rule per mesh axis (Cartesian product); a position that is None on any axis (a
    masked-off output) stays None. Invalid combinations are dropped.
    """
    found: list[NodeStrategy] = []
    for combo in itertools.product(rules, repeat=mesh.ndim):
        specs: list[Spec | None] = []
        for pos in range(len(combo[0])):
            col = tuple(rule[pos] for rule in combo)
            specs.append(None if any(p is None for p in col) else col)  # type: ignore[misc]
        strat = make_strategy(node, specs[n_out:], specs[:n_out], mesh.shape)
        if strat is not None:
            found.append(strat)
    return found


def _fill_rule(rule: Sequence[Any]) -> list[Placement | None] | None:
    """Placeholders -> Shard; None if the rule uses a placement plans never use."""
    out: list[Placement | None] = []
    for p in rule:
        p = Shard(p.dim) if isinstance(p, ShardingPlaceholder) else p
        if p is not None and not is_allowed(p):
            return None
        out.append(p)
    return out


def single_dim_strategies(node: fx.Node, mesh: DeviceMesh, info: Any) -> list[NodeStrategy]:
    """Strategies of an op registered with a single-mesh-dim rule function."""
    args, kwargs = _map_args(node, lambda n: tensor_meta(n.meta["val"]))
    raw = info(node.target, args, kwargs)
    n_in = len(tensor_inputs(node))
    n_out = len(output_vals(node))
    rules = [r for r in (_fill_rule(rule) for rule in raw) if r is not None]
    if raw and len(raw[0]) != n_in + n_out:
        raise AssertionError(f"{node.target}: rule length {len(raw[0])} != {n_in}+{n_out}")
    outs = output_vals(node)
    replicate: list[Placement | None] = [None if v is None else Replicate() for v in outs]
    rules.insert(0, replicate + [Replicate()] * n_in)
    return expand_per_axis(node, rules, n_out, mesh)


def _specs_of(spec: DTensorSpec | Sequence[DTensorSpec | None] | None, n: int) -> list:
    if isinstance(spec, DTensorSpec):
        return [tuple(spec.placements)] * n
    if spec is None:
        return [None] * n
    return [None if s is None else tuple(s.placements) for s in spec]


def _op_strategy(spec_list: list[Spec], val: torch.Tensor, mesh: DeviceMesh) -> OpStrategy:
    meta = tensor_meta(val)
    return OpStrategy([OpSpec(DTensorSpec(mesh, s, tensor_meta=meta)) for s in spec_list])


def _call_op_strategy(
    node: fx.Node, mesh: DeviceMesh, func: Callable, cands: Candidates
) -> list[OpSpec]:
    args, kwargs = _map_args(node, lambda n: _op_strategy(cands[n], n.meta["val"], mesh))
    info = sharding_propagator().op_to_schema_info.get(node.target)
    result = func(OpSchema(node.target, args, kwargs, schema_info=info))
    # TupleStrategy: foreach-style ops, not met in training forwards
    return result.strategies if isinstance(result, OpStrategy) else []


def _op_specs(node: fx.Node, mesh: DeviceMesh, func: Callable, cands: Candidates) -> list[OpSpec]:
    """Call ``func`` with every input's candidates at once; if it fails (some functions
    zip their inputs' candidate lists), once per combination of single candidates, as
    DTensor does at run time (up to ``MAX_COMBOS`` combinations)."""
    try:
        return _call_op_strategy(node, mesh, func, cands)
    except Exception:  # noqa: BLE001 - retried below with one candidate per input
        pass
    inputs = list(dict.fromkeys(cands))
    found: list[OpSpec] = []
    for combo in itertools.islice(itertools.product(*(cands[i] for i in inputs)), MAX_COMBOS):
        single = {i: [spec] for i, spec in zip(inputs, combo, strict=True)}
        try:
            found.extend(_call_op_strategy(node, mesh, func, single))
        except Exception:  # noqa: BLE001 - DTensor rejects this input combination
            continue
    return found


def op_strategy_strategies(
    node: fx.Node, mesh: DeviceMesh, func: Callable, cands: Candidates
) -> list[NodeStrategy]:
    """Strategies of an op registered with an OpStrategy function, given input candidates."""
    n_in, n_out = len(tensor_inputs(node)), len(output_vals(node))
    found = []
    for op_spec in _op_specs(node, mesh, func, cands):
        outs = _specs_of(op_spec.output_specs, n_out)
        ins = (
            [outs[0]] * n_in
            if op_spec.input_specs is None
            else [tuple(s.placements) for s in op_spec.input_specs]
        )
        strat = make_strategy(node, ins, outs, mesh.shape)
        if strat is not None:
            found.append(strat)
    return found


def _seed_spec(val: torch.Tensor, mesh: DeviceMesh) -> DTensorSpec:
    """A spec whose placements make DTensor's decomposition path try Shard and Partial."""
    seeds: list[Placement] = [Shard(0) if val.ndim else Replicate(), Partial()]
    placements = tuple(seeds[i % 2] if i < 2 else Replicate() for i in range(mesh.ndim))
    return DTensorSpec(mesh, placements, tensor_meta=tensor_meta(val))


def decomp_strategies(node: fx.Node, mesh: DeviceMesh) -> list[NodeStrategy]:
    """Strategies found by tracing the op's decomposition (empty when that fails)."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or not DecompShardingStrategy.has_decomp(op):
        return []
    args, kwargs = _map_args(node, lambda n: _seed_spec(n.meta["val"], mesh))
    # _map_args only wraps OpStrategy lists; DTensorSpec lists stay lists, as DTensor expects.
    sp = sharding_propagator()
    sp.decomp_strategy.ensure_schema_info(op)
    try:
        result = sp.decomp_strategy.propagate_strategy(OpSchema(op, args, kwargs))
    except Exception:  # noqa: BLE001 - any failure means "no strategies from here"
        return []
    if result is None:
        return []
    n_out = len(output_vals(node))
    found = []
    for op_spec in result.strategies:
        outs = _specs_of(op_spec.output_specs, n_out)
        ins = [tuple(s.placements) for s in op_spec.input_specs or ()]
        strat = make_strategy(node, ins, outs, mesh.shape)
        if strat is not None:
            found.append(strat)
    return found


def dtensor_strategies(node: fx.Node, mesh: DeviceMesh, cands: Candidates) -> list[NodeStrategy]:
    """Strategies for ``node`` from DTensor's registry, or [] if DTensor knows nothing."""
    sp = sharding_propagator()
    info = sp.op_single_dim_strategy_funcs.get(node.target)
    if info is not None:
        return single_dim_strategies(node, mesh, info)
    func = sp.op_strategy_funcs.get(node.target)
    if func is not None:
        return op_strategy_strategies(node, mesh, func, cands)
    return decomp_strategies(node, mesh)

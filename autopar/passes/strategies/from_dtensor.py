"""Strategies read from DTensor's own sharding registry.

Three sources, tried in this order by :func:`dtensor_strategies`:

1. *Single-mesh-dim rules* (:func:`~autopar._compat.single_dim_rule`: mm, addmm,
   pointwise ops, layer norm, embedding, ...). A rule ``[out..., in...]`` holds for one
   mesh axis, with ``ShardingPlaceholder(d)`` meaning ``Shard(d)``; DTensor adds the
   all-Replicate rule implicitly. An N-D strategy picks one rule per axis (the Cartesian
   product), exactly as DTensor's ``expand_to_full_mesh_op_strategy`` does at run time.
2. *Op-strategy functions* (:func:`~autopar._compat.op_strategy_func`: views, reductions,
   softmax, nll_loss, split, cat, ...). These take an ``OpSchema`` whose tensor args are
   ``OpStrategy`` objects and mostly *follow* their inputs, so each input is offered the
   distinct output specs of its producer's strategies; we read back each returned
   ``OpSpec``'s input/output specs. An ``OpSpec`` whose inputs differ from what the
   producer offers is kept: the search prices that resharding on the edge.
3. *Decomposition-based propagation* (:func:`~autopar._compat.decomp_strategy`) for ops in
   neither table: DTensor traces the op's decomposition once per single-axis input
   placement.

Every result is filtered by :func:`~autopar.passes.strategies.spec.is_valid_spec` (strided
shards only unnested, no max/min partials, avg only on 0-d tensors, torch.chunk shards); the
strategy stage keeps strided shards only on fused projections (:mod:`.strided`). Strategy
functions also price every (candidate, strategy) pair with DTensor's redistribute-cost
model, quadratic in the candidates; :func:`dtensor_enumeration` turns that off while
enumerating (the search prices resharding with autopar's own cost model).

DTensor is reached only through :mod:`autopar._compat`. A source that rejects the node's
arguments with one of :data:`~autopar._compat.NO_STRATEGY_ERRORS` contributes nothing; any
other exception is a bug and propagates. An op DTensor knows (a rule, a strategy function
or a decomposition) whose sources all reject the node's arguments is planned replicated and
reported by :func:`report_replicated`, once per op and per enumeration, with the user's
source line. An op DTensor does not know at all (:func:`dtensor_strategies` returns None)
cannot run on DTensors even replicated: planning stops with :class:`UnsupportedOpError`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._compat import (
    NO_STRATEGY_ERRORS,
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    ShardingPlaceholder,
    StridedShard,
    TensorMeta,
    TupleStrategy,
    decomp_strategy,
    no_dtensor_redistribute_costs,
    op_schema_info,
    op_strategy_func,
    single_dim_rule,
)
from autopar.passes.strategies.spec import (
    NodeStrategy,
    Spec,
    is_allowed,
    is_valid_spec,
    output_vals,
    tensor_inputs,
)

log = logging.getLogger(__name__)
Candidates = dict[fx.Node, list[Spec]]  # per producer node: the output specs it may have
MAX_COMBOS = 512


# op targets already reported as planned replicated, per enumeration (None: outside one)
_reported: ContextVar[set[object] | None] = ContextVar("autopar_reported", default=None)


@contextlib.contextmanager
def dtensor_enumeration() -> Iterator[None]:
    """The context one enumeration of a graph runs in: DTensor's redistribute costs off
    (:func:`~autopar._compat.no_dtensor_redistribute_costs`), and each op planned
    replicated for want of a strategy reported once (:func:`report_replicated`)."""
    token = _reported.set(set())
    try:
        with no_dtensor_redistribute_costs():
            yield
    finally:
        _reported.reset(token)


def report_replicated(node: fx.Node) -> None:
    """Warn that ``node``'s op has no sharding strategy and is planned replicated: once per
    op target within :func:`dtensor_enumeration`, naming the op and the user's line."""
    seen = _reported.get()
    if seen is not None:
        if node.target in seen:
            return
        seen.add(node.target)
    log.warning(
        "no sharding strategy for %s: planned replicated (every rank computes it whole)%s",
        node.target,
        source_line(node),
    )


# library frames by package directory (a user's checkout may itself be named autopar)
_LIBRARIES = (
    str(Path(torch.__file__).resolve().parent) + os.sep,
    str(Path(__file__).resolve().parents[2]) + os.sep,  # the autopar package
)
_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+)')


def source_line(node: fx.Node) -> str:
    """The user's frame that produced ``node`` (the innermost frame of its export stack
    trace outside torch and autopar) as a new line ``  at file:line: code``; "" if unknown."""
    frames: list[list[str]] = []  # [file, line, code]
    for text in (node.meta.get("stack_trace") or "").splitlines():
        match = _FRAME.match(text)
        if match:
            frames.append([match.group(1), match.group(2), ""])
        elif frames and not frames[-1][2]:
            frames[-1][2] = text.strip()
    user = [f for f in frames if not str(Path(f[0]).resolve()).startswith(_LIBRARIES)]
    if not user:
        return ""
    path, line, code = user[-1]
    return f"\n  at {path}:{line}: {code}"


class UnsupportedOpError(ValueError):
    """An op of the model has no sharding strategy (no autopar rule, nothing in DTensor)."""


GENERIC_FIX = (
    "write the model with ops DTensor supports, register a strategy for the op "
    "(autopar.passes.strategies.register_rule and DTensor's register_op_strategy), or give "
    "a custom op a decomposition into supported ops"
)
# opaque custom ops of libraries whose models have another way to run them, and that way
KNOWN_FIXES = {
    # Hugging Face's MoE experts (transformers.integrations.moe): the default grouped_mm
    # runs a custom op on CPU and in fp32; batched_mm is plain gathers and bmm
    "transformers::grouped_mm": "a Hugging Face MoE model: set "
    'config._experts_implementation = "batched_mm" before building it (its experts then '
    "run as gathers and batched matmuls, which autopar plans)",
}


def unsupported_op(node: fx.Node) -> UnsupportedOpError:
    """The planning-time error for ``node``'s op, naming it and the user's source line."""
    name = getattr(getattr(node.target, "_schema", None), "name", "")
    fix = next((fix for op, fix in KNOWN_FIXES.items() if name.startswith(op)), GENERIC_FIX)
    return UnsupportedOpError(
        f"autopar cannot plan {node.target}: it has no sharding strategy (no autopar rule "
        f"and none in DTensor's registry, not even a decomposition){source_line(node)}\n"
        f"Fix: {fix}."
    )


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
    even: bool = False,
) -> NodeStrategy | None:
    """A NodeStrategy if every spec is valid for its operand's shape (``even``: every
    shard of equal size, see :func:`is_valid_spec`), else None."""
    in_shapes, out_shapes = _node_shapes(node)
    if len(inputs) != len(in_shapes) or len(outputs) != len(out_shapes):
        return None
    for spec, shape in zip((*inputs, *outputs), (*in_shapes, *out_shapes), strict=True):
        if spec is not None and (
            shape is None or not is_valid_spec(spec, shape, mesh_shape, even=even)
        ):
            return None
    return NodeStrategy(tuple(inputs), tuple(outputs))


def expand_per_axis(
    node: fx.Node,
    rules: Sequence[Sequence[Placement | None]],
    n_out: int,
    mesh: DeviceMesh,
    even: bool = True,
) -> list[NodeStrategy]:
    """N-D strategies from single-axis rules ``[out_0..out_{n_out-1}, in_0, ...]``.

    One rule per mesh axis (Cartesian product); a position that is None on any axis (a
    masked-off output) stays None. Invalid combinations are dropped; ``even`` (autopar's
    own rules, whose index arithmetic assumes equal shards) also drops uneven shards.
    """
    found: list[NodeStrategy] = []
    for combo in itertools.product(rules, repeat=mesh.ndim):
        specs: list[Spec | None] = []
        for pos in range(len(combo[0])):
            col = tuple(rule[pos] for rule in combo)
            specs.append(None if any(p is None for p in col) else col)  # type: ignore[misc]
        strat = make_strategy(node, specs[n_out:], specs[:n_out], mesh.shape, even)
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


def _strided_rules(node: fx.Node, raw: Sequence[Sequence[Any]], cands: Candidates) -> list:
    """Each rule with shards again with every shard ``_StridedShard(d, k)``, for each ``k``
    an input is offered (:mod:`.strided`), where the rule's sharded dims are one index (all
    of one size): the op works on each index of that dim alone, so any partition of the
    indices that every operand shares gives the same result."""
    factors = {
        p.split_factor
        for specs in cands.values()
        for spec in specs
        for p in spec
        if isinstance(p, StridedShard)
    }
    if not factors:
        return []
    ins, outs = _node_shapes(node)
    shapes = [*outs, *ins]
    found = []
    for rule in raw:
        dims = [(i, p.dim) for i, p in enumerate(rule) if isinstance(p, ShardingPlaceholder)]
        sizes = {shapes[i][d] for i, d in dims if shapes[i] is not None}
        if not dims or len(sizes) != 1:
            continue
        for k in sorted(factors):
            found.append(
                [StridedShard(p.dim, split_factor=k) if isinstance(p, ShardingPlaceholder) else p
                 for p in rule]
            )  # fmt: skip
    return [r for r in (_fill_rule(rule) for rule in found) if r is not None]


def single_dim_strategies(
    node: fx.Node, mesh: DeviceMesh, info: Any, cands: Candidates | None = None
) -> list[NodeStrategy]:
    """Strategies of an op registered with a single-mesh-dim rule function (and, where
    an input is offered a strided shard, the rule's strided forms: :func:`_strided_rules`)."""
    args, kwargs = _map_args(node, lambda n: tensor_meta(n.meta["val"]))
    try:
        raw = info(node.target, args, kwargs)
    except NO_STRATEGY_ERRORS:
        log.debug("DTensor's rule rejects %s", node.format_node(), exc_info=True)
        return []
    n_in = len(tensor_inputs(node))
    n_out = len(output_vals(node))
    rules = [r for r in (_fill_rule(rule) for rule in raw) if r is not None]
    rules += _strided_rules(node, raw, cands or {})
    if raw and len(raw[0]) != n_in + n_out:
        raise AssertionError(f"{node.target}: rule length {len(raw[0])} != {n_in}+{n_out}")
    outs = output_vals(node)
    replicate: list[Placement | None] = [None if v is None else Replicate() for v in outs]
    rules.insert(0, replicate + [Replicate()] * n_in)
    return expand_per_axis(node, rules, n_out, mesh, even=False)


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
    info = op_schema_info(node.target)
    result = func(OpSchema(node.target, args, kwargs, schema_info=info))
    # TupleStrategy: foreach-style ops, not met in training forwards
    return result.strategies if isinstance(result, OpStrategy) else []


# What DTensor's OpStrategy functions raise for arguments they have no strategy for: its
# own `NO_STRATEGY_ERRORS`, and lookups made past what they were written for. Some zip
# their inputs' candidate lists (`nll_loss_forward` reads the target's candidate at each of
# the input's indices: offered fewer, IndexError); the view rules map each input shard's
# dim to an output dim, and a shard of a dim the op broadcasts has none (`expand` of a
# ViT's [1, 1, D] class token stored split on its size-1 dim, one rank's shard empty:
# KeyError).
REJECTED = (*NO_STRATEGY_ERRORS, IndexError, KeyError)


def _op_specs(node: fx.Node, mesh: DeviceMesh, func: Callable, cands: Candidates) -> list[OpSpec]:
    """Call ``func`` with every input's candidates at once; if it fails, once per
    combination of single candidates, as DTensor does at run time (up to ``MAX_COMBOS``
    combinations); `REJECTED` says a function has none for its arguments."""
    try:
        return _call_op_strategy(node, mesh, func, cands)
    except REJECTED:
        pass  # retried below with one candidate per input
    inputs = list(dict.fromkeys(cands))
    found: list[OpSpec] = []
    for combo in itertools.islice(itertools.product(*(cands[i] for i in inputs)), MAX_COMBOS):
        single = {i: [spec] for i, spec in zip(inputs, combo, strict=True)}
        try:
            found.extend(_call_op_strategy(node, mesh, func, single))
        except REJECTED:
            continue  # DTensor rejects this input combination
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


def decomp_strategies(node: fx.Node, mesh: DeviceMesh) -> list[NodeStrategy] | None:
    """Strategies found by tracing the op's decomposition ([] when DTensor rejects the
    arguments, None when the op has no decomposition)."""
    # _map_args only wraps OpStrategy lists; DTensorSpec lists stay lists, as DTensor expects.
    args, kwargs = _map_args(node, lambda n: _seed_spec(n.meta["val"], mesh))
    try:
        result = decomp_strategy(node.target, args, kwargs)
    except NO_STRATEGY_ERRORS:
        log.debug("DTensor's decomposition rejects %s", node.format_node(), exc_info=True)
        return []
    if result is None:
        return None
    n_out = len(output_vals(node))
    found = []
    for op_spec in result.strategies:
        outs = _specs_of(op_spec.output_specs, n_out)
        ins = [tuple(s.placements) for s in op_spec.input_specs or ()]
        strat = make_strategy(node, ins, outs, mesh.shape)
        if strat is not None:
            found.append(strat)
    return found


def dtensor_strategies(
    node: fx.Node, mesh: DeviceMesh, cands: Candidates
) -> list[NodeStrategy] | None:
    """Strategies for ``node`` from DTensor's registry: [] if DTensor rejects every
    sharding of these arguments, None if it knows nothing of the op (no rule, no strategy
    function, no decomposition)."""
    rule = single_dim_rule(node.target)
    if rule is not None:
        return single_dim_strategies(node, mesh, rule, cands)
    func = op_strategy_func(node.target)
    if func is not None:
        return op_strategy_strategies(node, mesh, func, cands)
    return decomp_strategies(node, mesh)

"""torch.export of the training forward, roles of placeholders, layer identity, fingerprint.

Contract of the captured graph: ``gm(*placeholders) -> (loss, *new_buffer_values)``. The
first output is the scalar loss; then, in the order of ``Captured.mutated_buffers``, the
new value of every buffer the forward updates in place (BatchNorm's running statistics and
batch counter, any ``self.buf.copy_(...)``): torch.export's ``graph_signature`` lists them as
``BUFFER_MUTATION`` outputs, and they are state, not outputs of the model.

Ops whose only job is a runtime check (:data:`RUNTIME_CHECKS`: ``_assert_async``,
``_assert_scalar``, ``sym_constrain_range*``, ``_assert_tensor_metadata``) are dropped with the
computation that only feeds them: they check the traced global values (``one_hot``'s index
range, export's shape guards), which a shard cannot check and the example batch already
passed. BatchNorm is decomposed into per-channel sums (:mod:`autopar.capture.batch_norm`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import traceback
import warnings
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, OutputSpec

from autopar._compat import LazyGraphModule
from autopar.capture.batch_norm import BATCH_NORM_DECOMPOSITIONS
from autopar.capture.splits import unflatten_equal_splits

aten = torch.ops.aten

# Ops planned as one unit (strategies exist for them) rather than decomposed.
KEPT_OPS = (aten.scaled_dot_product_attention.default, aten.nll_loss_forward.default)


class CaptureError(ValueError):
    """The model could not be traced; the message names the cause and the user's line."""


@dataclass
class Captured:
    """The traced training forward and what each placeholder is.

    `gm` computes the scalar loss from placeholders named in `params`, `buffers` and
    `user_inputs`, and returns `(loss, *new values of mutated_buffers)`. `params` maps
    placeholder name -> parameter FQN (first name of a tied parameter); `aliases` lists the
    other FQNs of tied parameters.
    """

    gm: fx.GraphModule
    params: dict[str, str]
    buffers: dict[str, str]
    constants: dict[str, torch.Tensor]
    user_inputs: list[str]
    aliases: dict[str, list[str]] = field(default_factory=dict)
    fingerprint: str = ""
    # buffer placeholder names updated by the forward: output i + 1 is the new value of
    # mutated_buffers[i] (output 0 is the loss)
    mutated_buffers: list[str] = field(default_factory=list)
    # built from a template rather than traced (`Template.whole_model`)
    from_template: bool = False
    # `search.intra_op.solve_intra`'s answers on this graph, by its arguments: the same ILP
    # asked again (a pipeline winner's stage mesh, again among its stage-mesh variants and
    # in its final plan) is solved once
    solved: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def loss_node(self) -> fx.Node:
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        return out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]

    def buffer_updates(self) -> dict[str, fx.Node]:
        """Buffer placeholder name -> the node computing its value after the step."""
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        return dict(zip(self.mutated_buffers, out.args[0][1:], strict=True))

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def layer_of(self, node: fx.Node) -> str | None:
        return layer_of(node)


class _WithLoss(nn.Module):
    """model(batch[0]) -> outputs; loss_fn(outputs, *batch[1:]) -> scalar loss."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch):
        return self.loss_fn(self.model(batch[0]), *batch[1:])


@dataclass
class Traced:
    """An exported, decomposed graph with its signature, before autopar's clean-up
    (`finish`): what `autopar.capture.expand` repeats a block of."""

    gm: fx.GraphModule
    input_specs: list[InputSpec]
    output_specs: list[OutputSpec]
    constants: dict[str, torch.Tensor]

    def copy(self) -> Traced:
        """The same graph in new nodes (metadata dicts copied, values shared)."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.gm.graph, {}))
        specs = (deepcopy(self.input_specs), deepcopy(self.output_specs))
        return Traced(LazyGraphModule(self.gm, graph), *specs, dict(self.constants))


def capture(
    model: nn.Module,
    args: Sequence,
    loss_fn: Callable | None = None,
    tracer: Callable | None = None,
) -> Captured:
    """Export `model` on the example batch `args` and return the decomposed loss graph
    (`tracer(root, args)` traces it when given: `autopar.capture.rows.AnyRows`)."""
    root = _WithLoss(model, loss_fn) if loss_fn is not None else model
    return finish((tracer or trace)(root, args), root, loss_fn is not None)


def trace(root: nn.Module, args: Sequence) -> Traced:
    """torch.export of `root` on `args`, decomposed to ATen but for `KEPT_OPS`."""
    ep = _export(root, tuple(args))
    with warnings.catch_warnings():  # torch's own deepcopy of its pytree specs: not the
        # user's to fix, and it would print on every capture
        warnings.filterwarnings("ignore", _TREESPEC_DEPRECATION, FutureWarning)
        ep = ep.run_decompositions(decompositions())
    sig = ep.graph_signature
    return Traced(ep.graph_module, sig.input_specs, sig.output_specs, ep.constants)


def decompositions() -> dict:
    """The table `trace` decomposes with: core ATen but `KEPT_OPS`, BatchNorm as sums, and
    `copy` as the ops it is (`_copy_as_values`)."""
    table = torch.export.default_decompositions()
    for op in KEPT_OPS:
        table.pop(op, None)
    table.update(BATCH_NORM_DECOMPOSITIONS)
    table[aten.copy.default] = _copy_as_values
    return table


def _copy_as_values(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
    """`aten.copy(dst, src)`, what functionalization makes of an assignment into a slice
    (`y[..., 1:] = x[..., :-1]`, Hugging Face T5's `_shift_right`): `src`'s values in
    `dst`'s dtype and shape, ops every strategy table knows (copy has none in DTensor)."""
    out = src if src.dtype == dst.dtype else aten._to_copy.default(src, dtype=dst.dtype)
    if tuple(out.shape) != tuple(dst.shape):
        out = aten.expand.default(out, list(dst.shape))
    return aten.clone.default(out)


def finish(traced: Traced, root: nn.Module, wrapped: bool) -> Captured:
    """The `Captured` of a traced graph (changed in place): the loss first, tied parameters
    merged, runtime checks and clones dropped, equal splits unflattened, the blocks'
    weights marked, nodes renumbered (the graph module made once, at the end); `wrapped`:
    `root` is the loss wrapper (its prefix is stripped)."""
    _check_scalar_loss(traced)
    captured = _roles(traced)
    _merge_tied(captured, root)
    _drop_runtime_checks(captured.gm)
    _drop_clones(captured.gm)
    unflatten_equal_splits(captured.gm)
    _assign_weight_layers(captured.gm)
    captured.gm = _renumbered(captured.gm)
    if wrapped:
        _strip_prefix(captured, "model.")
    captured.fingerprint = graph_fingerprint(captured)
    return captured


_TREESPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def _export(root: nn.Module, args: tuple) -> ExportedProgram:
    try:
        return torch.export.export(root, args, strict=False)
    except Exception as exc:  # re-raised with the user's line; the cause stays chained
        where = _user_frame(exc)
        raise CaptureError(
            f"autopar could not trace the model with torch.export: {type(exc).__name__}: "
            f"{_first_line(exc)}{where}\nFix: make forward traceable (no data-dependent "
            "Python control flow on tensor values, no .item()/.tolist(), no in-place ops on "
            "inputs), or wrap the offending part with torch.cond."
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def _user_frame(exc: BaseException) -> str:
    """The innermost frame outside torch: the model's line that failed."""
    frames = traceback.extract_tb(exc.__traceback__)
    # library frames by package directory (a user's checkout may itself be named autopar)
    libraries = (
        str(Path(torch.__file__).resolve().parent) + os.sep,
        str(Path(__file__).resolve().parents[1]) + os.sep,  # the autopar package
    )
    user = [f for f in frames if not str(Path(f.filename).resolve()).startswith(libraries)]
    if user:
        f = user[-1]
        return f"\n  at {f.filename}:{f.lineno}: {(f.line or '').strip()}"
    match = re.search(r'File "([^"]+)", line (\d+)', str(exc))
    return f"\n  at {match.group(1)}:{match.group(2)}" if match else ""


def _check_scalar_loss(traced: Traced) -> None:
    """One user output, a floating scalar; buffer mutations aside, nothing else."""
    specs = traced.output_specs
    outputs = [n for n in traced.gm.graph.nodes if n.op == "output"][0].args[0]
    mutated_inputs = [s.target for s in specs if s.kind == OutputKind.USER_INPUT_MUTATION]
    if mutated_inputs:
        raise CaptureError(
            f"the model updates its input(s) {mutated_inputs} in place. Fix: compute a new "
            "tensor instead (x = x + 1, not x.add_(1)); a batch shard cannot be written back."
        )
    outs = [o for o, s in zip(outputs, specs, strict=True) if s.kind == OutputKind.USER_OUTPUT]
    vals = [o.meta.get("val") if isinstance(o, fx.Node) else o for o in outs]
    if len(outs) != 1 or not isinstance(vals[0], torch.Tensor) or vals[0].numel() != 1:
        shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in vals]
        raise CaptureError(
            f"the model must return one scalar loss, but it returns {len(outs)} output(s) "
            f"with shapes {shapes}. Fix: return the loss from forward, or pass "
            "loss_fn=lambda outputs, *targets: ... to autopar.compile."
        )
    if not vals[0].dtype.is_floating_point:
        raise CaptureError(f"the loss has dtype {vals[0].dtype}; a floating-point loss is needed")


def _roles(traced: Traced) -> Captured:
    params: dict[str, str] = {}
    buffers: dict[str, str] = {}
    constants: dict[str, torch.Tensor] = {}
    user_inputs: list[str] = []
    for spec in traced.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            params[name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = spec.target
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constants[name] = traced.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
        else:
            raise CaptureError(f"unsupported graph input kind {spec.kind} for {name}")
    gm = traced.gm
    mutated_buffers = _loss_first(traced, {fqn: name for name, fqn in buffers.items()})
    roles = {
        **dict.fromkeys(params, "param"),
        **dict.fromkeys(buffers, "buffer"),
        **dict.fromkeys(constants, "buffer"),
        **dict.fromkeys(user_inputs, "input"),
    }
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["autopar_role"] = roles[node.name]
    return Captured(
        gm=gm,
        params=params,
        buffers=buffers,
        constants=constants,
        user_inputs=user_inputs,
        mutated_buffers=mutated_buffers,
    )


def _loss_first(traced: Traced, placeholder_of: dict[str, str]) -> list[str]:
    """Reorder the graph's outputs to ``(loss, *new buffer values)``; returns the buffer
    placeholder names in that order (export puts the mutations first)."""
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    loss, updates, names = None, [], []
    for value, spec in zip(out.args[0], traced.output_specs, strict=True):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            updates.append(value)
            names.append(placeholder_of[spec.target])
        else:
            loss = value
    out.args = ((loss, *updates),)
    return names


def _merge_tied(captured: Captured, root: nn.Module) -> None:
    """One placeholder per parameter tensor: replace a tied twin's uses by the first name."""
    by_fqn = dict(root.named_parameters(remove_duplicate=False))
    first_of: dict[int, str] = {}
    nodes = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    for ph_name, fqn in list(captured.params.items()):
        key = id(by_fqn[fqn])
        if key not in first_of:
            first_of[key] = ph_name
            continue
        keep = first_of[key]
        nodes[ph_name].replace_all_uses_with(nodes[keep])
        captured.gm.graph.erase_node(nodes[ph_name])
        captured.aliases.setdefault(captured.params[keep], []).append(fqn)
        del captured.params[ph_name]
    captured.gm.graph.lint()


RUNTIME_CHECKS = (
    aten._assert_async.default,
    aten._assert_async.msg,
    aten._assert_scalar.default,
    aten._assert_tensor_metadata.default,
    aten.sym_constrain_range.default,
    aten.sym_constrain_range_for_size.default,
    aten._functional_assert_async.msg,
    aten._functional_sym_constrain_range.default,
    aten._functional_sym_constrain_range_for_size.default,
    aten._functional_assert_scalar.default,
)


def _drop_runtime_checks(gm: fx.GraphModule) -> None:
    """Drop the runtime checks and then every node left without a use (the ``any``/``ge``
    chains that only computed a checked condition). Export's metadata assertions and
    ``one_hot``'s index-range check test the traced global values: meaningless per shard,
    and DTensor has no strategy for them. The graph is functional (mutations are outputs),
    so a node without users computes nothing the step needs."""
    for node in reversed(list(gm.graph.nodes)):  # a check's token users go first
        if node.op == "call_function" and node.target in RUNTIME_CHECKS and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()


def _drop_clones(gm: fx.GraphModule) -> None:
    """The graph is functional, so clone() only fixes memory layout, which depends on the
    device (CPU flash attention returns a transposed layout, meta does not): dropping it
    makes the graph, and its fingerprint, the same on every device. Lowering copies a shard
    where a view needs it."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten.clone.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _strip_prefix(captured: Captured, prefix: str) -> None:
    """Names as the user's model has them (not the loss wrapper's)."""
    captured.params = {k: v.removeprefix(prefix) for k, v in captured.params.items()}
    captured.buffers = {k: v.removeprefix(prefix) for k, v in captured.buffers.items()}
    captured.aliases = {
        k.removeprefix(prefix): [a.removeprefix(prefix) for a in v]
        for k, v in captured.aliases.items()
    }


def layer_of(node: fx.Node) -> str | None:
    """The outermost repeated block (an nn.ModuleList/Sequential child) a node belongs to.

    A placeholder belongs to the block of its users when they are all in one block (a
    block's own weights), see `_assign_weight_layers`."""
    meta = node.meta
    if "autopar_layer" in meta:
        return meta["autopar_layer"]
    stack = meta.get("nn_module_stack") or {}
    cached = meta.get("_autopar_layer_of")  # (the stack it was read from, its layer)
    if cached is not None and cached[0] is stack:
        return cached[1]
    layer = next((path for path, _cls in stack.values() if _BLOCK_PATH.search(path)), None)
    meta["_autopar_layer_of"] = (stack, layer)
    return layer


_BLOCK_PATH = re.compile(r"(^|\.)\d+$")


def _assign_weight_layers(gm: fx.GraphModule) -> None:
    """Placeholders carry no module stack; a parameter used inside one block only (through
    casts and views too) is that block's, so its state is priced, shared and staged with it."""
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        layers, todo, seen = set(), list(n.users), set()
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            layer = layer_of(u)
            if layer is None and u.op == "call_function" and len(u.all_input_nodes) == 1:
                todo.extend(u.users)  # a weight-only view/cast outside any block: look on
            else:
                layers.add(layer)
        if len(layers) == 1 and None not in layers:
            n.meta["autopar_layer"] = layers.pop()


def _renumbered(gm: fx.GraphModule) -> fx.GraphModule:
    """The same graph with its nodes named in graph order by FX's namer (`mul`, `mul_1`,
    ...; placeholders keep export's names). Tracing leaves gaps where it removed nodes (a
    layer norm's unused statistics), and `autopar.capture.expand` builds graphs it never
    traced: numbered so, a graph's names follow from its ops and order alone, the same
    whichever way it was made (a plan names its nodes)."""
    graph = fx.Graph()
    new: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            graph.output(fx.node.map_arg(n.args[0], new.__getitem__))
            continue
        name = n.name if n.op == "placeholder" else base_name(n.name)
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), new.__getitem__)
        new[n] = graph.create_node(n.op, n.target, args, kwargs, name=name)
        new[n].meta = n.meta
    return LazyGraphModule(gm, graph)


def base_name(name: str) -> str:
    """The name FX's namer numbers (`mul_7` -> `mul`, `pow_1` -> `pow`)."""
    return _NUMBER.sub("", name)


_NUMBER = re.compile(r"_\d+$")


def graph_fingerprint(captured: Captured) -> str:
    """sha256 of the graph's structure: ops, shapes, dtypes, wiring and parameter names."""
    index = {n: i for i, n in enumerate(captured.gm.graph.nodes)}
    rows = []
    for n in captured.gm.graph.nodes:
        val = n.meta.get("val")
        meta = (list(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else None
        args = _arg_repr(n, index)
        role = captured.params.get(n.name) or captured.buffers.get(n.name) or ""
        rows.append([n.op, str(n.target) if n.op != "placeholder" else role, meta, args])
    return hashlib.sha256(json.dumps(rows, default=str).encode()).hexdigest()[:16]


def _arg_repr(n: fx.Node, index: dict[fx.Node, int]) -> str:
    """Arguments by position; devices left out (a plan made on the meta device applies to
    the same model on CPU or GPU)."""
    flat: list[str] = []

    def one(a):
        if isinstance(a, fx.Node):
            flat.append(f"%{index[a]}")
        elif not isinstance(a, torch.device):
            flat.append(repr(a))
        return a

    fx.node.map_aggregate((n.args, n.kwargs), one)
    return ",".join(flat)

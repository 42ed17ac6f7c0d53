"""A plan's nodes by layer and its edges as collectives (data for the tables in `tables`).

Layers: nodes grouped by `NodePlan.layer` in graph order; layers whose nodes (op, input and
output specs) and parameters (relative name, spec, shape, dtype) are identical collapse into
one group, shown once.

Edges: a node's input `k` comes from `NodePlan.args[k]` (a node, `node[i]` for one output of
a multi-output node, or a placeholder). Where the producer's output spec differs from the
input spec the node needs, the redistribution is the sequence of per-axis steps DTensor
takes (`redistribute_plan`); each step is priced at the bytes of the tensor unsharded over
that step's axis, the cost model's convention.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate

from autopar.cost_models.comm import Collective, redistribute_plan, transition_kind
from autopar.cost_models.memory import local_numel
from autopar.plan import NodePlan, Plan, TensorPlan, parse_spec

OUTSIDE = "(outside layers)"


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers with identical plans: the first one's nodes and parameters stand for all."""

    layers: tuple[str | None, ...]
    nodes: tuple[NodePlan, ...]
    params: tuple[TensorPlan, ...]

    @property
    def title(self) -> str:
        first = self.layers[0]
        if first is None:
            return OUTSIDE
        if len(self.layers) == 1:
            return f"layer {first}"
        return f"layer {first}  ×{len(self.layers)} identical: {_compact(self.layers)}"


def _compact(names: Sequence[str | None], keep: int = 3) -> str:
    shown = [str(n) for n in names]
    if len(shown) <= keep + 1:
        return ", ".join(shown)
    return ", ".join(shown[:keep]) + f", …, {shown[-1]}"


def _layer_of_param(fqn: str, layers: Iterable[str]) -> str | None:
    owners = [lay for lay in layers if fqn.startswith(lay + ".")]
    return max(owners, key=len) if owners else None


def relative_name(fqn: str, layer: str | None) -> str:
    return fqn if layer is None else fqn[len(layer) + 1 :]


def group_layers(plan: Plan) -> list[LayerGroup]:
    """Nodes grouped by `NodePlan.layer` (in graph order); identical layers collapsed."""
    nodes: dict[str | None, list[NodePlan]] = {}
    for n in plan.nodes:
        nodes.setdefault(n.layer, []).append(n)
    layers = [lay for lay in nodes if lay is not None]
    params: dict[str | None, list[TensorPlan]] = {lay: [] for lay in nodes}
    for t in plan.tensors:
        if t.kind == "param":
            params.setdefault(_layer_of_param(t.fqn, layers), []).append(t)
    same: dict[tuple, list[str | None]] = {}
    for lay in params:
        sig = (OUTSIDE,) if lay is None else _signature(nodes.get(lay, []), params[lay], lay)
        same.setdefault(sig, []).append(lay)
    return [
        LayerGroup(tuple(group), tuple(nodes.get(group[0], [])), tuple(params[group[0]]))
        for group in same.values()
    ]


def _signature(nodes: Sequence[NodePlan], params: Sequence[TensorPlan], layer: str) -> tuple:
    return (
        tuple((n.op, n.inputs, n.outputs) for n in nodes),
        tuple((relative_name(t.fqn, layer), t.spec, t.shape, t.dtype) for t in params),
    )


def fmt_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def edge_steps(
    src: str, dst: str, shape: Sequence[int] | None, dtype: str | None, mesh_shape: Sequence[int]
) -> list[tuple[int, Collective | None, float]]:
    """(axis, collective, bytes) per step DTensor takes from `src` to `dst` (local steps left
    out; collective None: a step DTensor cannot take). Bytes are those of the tensor
    unsharded over that step's axis (the cost model's convention), 0 when `shape` is
    unknown."""
    out: list[tuple[int, Collective | None, float]] = []
    itemsize = getattr(torch, dtype).itemsize if dtype else 0
    for axis, before, cur, tgt in redistribute_plan(parse_spec(src), parse_spec(dst), mesh_shape):
        kind = transition_kind(cur, tgt)
        if kind is Collective.LOCAL:
            continue
        nbytes = 0.0
        if shape is not None and itemsize:
            full = list(before)
            full[axis] = Replicate()
            nbytes = float(local_numel(shape, full, mesh_shape) * itemsize)
        out.append((axis, kind, nbytes))
    return out


def edge_collectives(
    src: str,
    dst: str,
    shape: Sequence[int] | None,
    dtype: str | None,
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
) -> str:
    """`S(0)→R all_gather@gpu 1.5 MiB`: the steps DTensor takes from `src` to `dst`.

    Bytes per step are those of the tensor unsharded over that step's axis (the cost model's
    convention); they are left out when `shape` is unknown.
    """
    parts = []
    for axis, kind, nbytes in edge_steps(src, dst, shape, dtype, mesh_shape):
        if kind is None:
            return f"{src}→{dst} unsupported"
        text = f"{kind}@{axis_names[axis]}"
        if nbytes:
            text += f" {fmt_bytes(nbytes)}"
        parts.append(text)
    return f"{src}→{dst} " + (", ".join(parts) or "local")


def axis_traffic(plan: Plan) -> dict[str, dict[str, float]]:
    """Bytes per mesh axis and collective kind over the forward edges of one step (the
    backward runs the transposed collectives: all-gather <-> reduce-scatter, all-to-all
    back)."""
    produced = producers(plan)
    out: dict[str, dict[str, float]] = {}
    for node in plan.nodes:
        for producer, dst in zip(node.args, node.inputs, strict=False):
            src = produced.get(producer) if producer else None
            if src is None or src.spec is None or dst is None or src.spec == dst:
                continue
            steps = edge_steps(src.spec, dst, src.shape, src.dtype, plan.stage_mesh_shape)
            for axis, kind, nbytes in steps:
                if kind is None:  # no collective to name (the node tables say "unsupported")
                    continue
                per_axis = out.setdefault(plan.stage_axis_names[axis], {})
                per_axis[str(kind)] = per_axis.get(str(kind), 0.0) + nbytes
    return out


@dataclass(frozen=True, slots=True)
class Produced:
    spec: str | None
    shape: tuple[int, ...] | None
    dtype: str | None


def producers(plan: Plan) -> dict[str, Produced]:
    """Output of every node (`name`, `name[k]`) and every placeholder, by name."""
    out = {t.name: Produced(t.spec, t.shape, t.dtype) for t in plan.tensors}
    for n in plan.nodes:
        shapes = n.shapes or (None,) * len(n.outputs)
        dtypes = n.dtypes or (None,) * len(n.outputs)
        for k, (spec, shape, dtype) in enumerate(zip(n.outputs, shapes, dtypes, strict=False)):
            item = Produced(spec, tuple(shape) if shape else None, dtype)
            out[f"{n.name}[{k}]"] = item
            if k == 0:
                out[n.name] = item
    return out


def has_edges(plan: Plan) -> bool:
    """Whether the plan links node inputs to their producers (`NodePlan.args`; plans saved
    before that field existed do not)."""
    return any(n.args for n in plan.nodes)


def node_edges(plan: Plan, node: NodePlan, produced: dict[str, Produced]) -> list[tuple[str, str]]:
    """(producer, collective text) per input edge whose placement changes."""
    out = []
    for producer, dst in zip(node.args, node.inputs, strict=False):
        src = produced.get(producer) if producer else None
        if src is None or src.spec is None or dst is None or src.spec == dst:
            continue
        text = edge_collectives(
            src.spec, dst, src.shape, src.dtype, plan.stage_mesh_shape, plan.stage_axis_names
        )
        out.append((producer, text))
    return out


def param_uses(
    plan: Plan, group: LayerGroup, produced: dict[str, Produced]
) -> dict[str, list[str]]:
    """Per parameter, the distinct collectives that bring it to its consumers' specs."""
    names = {t.name for t in group.params}
    uses: dict[str, list[str]] = {}
    for n in plan.nodes:
        for producer, text in node_edges(plan, n, produced):
            if producer in names and text not in uses.setdefault(producer, []):
                uses[producer].append(text)
    return uses

"""Turn the search's chosen strategy per node into a `Plan` (pure data)."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.capture import Captured
from autopar.capture.export import layer_of
from autopar.cluster import Cluster
from autopar.passes.lower import tensor_args
from autopar.passes.strategies import NodeStrategy
from autopar.plan import NodePlan, Plan, TensorPlan, spec_str


def assemble_plan(
    captured: Captured,
    cluster: Cluster,
    chosen: dict[fx.Node, NodeStrategy],
    strategy: str,
    step_time: float,
    peak_memory: float,
    solver: dict,
) -> Plan:
    nodes = []
    tensors = []
    names = {**captured.params, **captured.buffers}
    for n in captured.gm.graph.nodes:
        s = chosen.get(n)
        if s is None:
            continue
        if n.op == "placeholder":
            val = n.meta["val"]
            kind = n.meta.get("autopar_role", "input")
            tensors.append(
                TensorPlan(
                    name=n.name,
                    fqn=names.get(n.name, n.name),
                    kind=kind,
                    spec=spec_str(s.outputs[0]),
                    shape=tuple(val.shape),
                    dtype=str(val.dtype).removeprefix("torch."),
                )
            )
        elif n.op == "call_function":
            nodes.append(
                NodePlan(
                    name=n.name,
                    op=_op_name(n),
                    inputs=tuple(spec_str(i) for i in s.inputs),
                    outputs=tuple(spec_str(o) for o in s.outputs),
                    layer=layer_of(n),
                    args=tuple(a.name for a in tensor_args(n)),
                    shapes=tuple(_shape(v) for v in _vals(n)),
                    dtypes=tuple(_dtype(v) for v in _vals(n)),
                )
            )
    return Plan(
        graph_fingerprint=captured.fingerprint,
        cluster=cluster.to_dict(),
        strategy=strategy,
        nodes=tuple(nodes),
        tensors=tuple(tensors),
        predicted_step_time=float(step_time),
        predicted_peak_memory=float(peak_memory),
        solver=solver,
    )


def _vals(n: fx.Node) -> tuple:
    val = n.meta.get("val")
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def _shape(v) -> tuple[int, ...] | None:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _dtype(v) -> str | None:
    return str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else None


def _op_name(n: fx.Node) -> str:
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target).removeprefix("aten.")
    return getattr(target, "__name__", str(target))

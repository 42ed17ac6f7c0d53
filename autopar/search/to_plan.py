"""Turn the search's chosen strategy per node into a `Plan` (pure data), and check it.

`assemble_plan(captured, cluster, chosen, ..., priced) -> Plan`

Each call node's `NodePlan.args` names the producer of each operand
(`autopar.capture.operands`, aligned with `inputs`); `arg_outputs` says which output of a
multi-output producer an operand reads (empty when no operand reads one).

The check (an invariant, so an `AssertionError`): for every tensor operand, the spec the
node takes equals the spec its producer's chosen strategy gives that output, or the
redistribution between them was priced in the ILP's objective, i.e. the node is a decision
head (`priced`) whose operands are all edges. The positions of such priced redistributions
are recorded in `NodePlan.reshards`: that is where lowering moves data between nodes.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.fx as fx

from autopar._compat import OpOverload
from autopar.capture import Captured
from autopar.capture.export import layer_of
from autopar.capture.operands import operands, tensor_operands
from autopar.capture.regions import spec_of
from autopar.cluster import Cluster
from autopar.passes.strategies import NodeStrategy
from autopar.plan import CommPlan, MemoryPlan, NodePlan, Plan, TensorPlan, spec_str
from autopar.search.costs import same_spec


def assemble_plan(
    captured: Captured,
    cluster: Cluster,
    chosen: dict[fx.Node, NodeStrategy],
    strategy: str,
    step_time: float,
    peak_memory: float,
    solver: dict,
    *,
    priced: Collection[fx.Node],
    memory: MemoryPlan | None = None,
    comm: CommPlan | None = None,
) -> Plan:
    """The plan of `chosen`; `step_time`: the step as the program runs it (`search.step`,
    or a pipeline's schedule); `priced`: the nodes whose input redistributions the objective
    includes (the ILP's decision heads, `IntraOpResult.priced`); `memory`: the levers the
    search chose (recompute, reshard after forward); `comm`: the communication pass
    `step_time` was priced with (None: none, as pipeline stages run)."""
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
            nodes.append(_node_plan(n, s, chosen, n in priced))
    return Plan(
        graph_fingerprint=captured.fingerprint,
        cluster=cluster.to_dict(),
        strategy=strategy,
        nodes=tuple(nodes),
        tensors=tuple(tensors),
        predicted_step_time=float(step_time),
        predicted_peak_memory=float(peak_memory),
        solver=solver,
        memory=memory or MemoryPlan(),
        comm=comm,
    )


def _node_plan(
    n: fx.Node, s: NodeStrategy, chosen: dict[fx.Node, NodeStrategy], priced: bool
) -> NodePlan:
    ops = operands(n)
    indices = tuple(op.output_index for op in ops)
    return NodePlan(
        name=n.name,
        op=_op_name(n),
        inputs=tuple(spec_str(i) for i in s.inputs),
        outputs=tuple(spec_str(o) for o in s.outputs),
        layer=layer_of(n),
        args=tuple(op.producer.name for op in ops),
        shapes=tuple(_shape(v) for v in _vals(n)),
        dtypes=tuple(_dtype(v) for v in _vals(n)),
        arg_outputs=indices if any(i is not None for i in indices) else (),
        reshards=reshards(n, s, chosen, priced),
        exchange_bytes=_exchange_bytes(n),
    )


def _exchange_bytes(n: fx.Node) -> float:
    region = spec_of(n.target)
    if region is None or not region.shards_experts:
        return 0.0
    return float(region.module.exchanged_bytes(*[a.meta["val"] for a in n.args[: region.n_inputs]]))


def reshards(
    n: fx.Node, s: NodeStrategy, chosen: dict[fx.Node, NodeStrategy], priced: bool
) -> tuple[int, ...]:
    """Positions of the tensor operands of `n` whose spec differs from what their producer
    gives; asserts that each such redistribution is priced (see the module docstring)."""
    out = []
    for pos, op in tensor_operands(n):
        assert op.producer in chosen, f"{n.name}: producer {op} has no chosen strategy"
        src = op.select(chosen[op.producer].outputs)
        dst = s.inputs[pos] if pos < len(s.inputs) else None
        if src is None or dst is None or same_spec(src, dst):
            continue
        assert priced, (
            f"{n.name} takes operand {op} as {spec_str(dst)} but it is {spec_str(src)}, "
            "and the search did not price that redistribution"
        )
        out.append(pos)
    return tuple(out)


def _vals(n: fx.Node) -> tuple:
    val = n.meta.get("val")
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def _shape(v) -> tuple[int, ...] | None:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _dtype(v) -> str | None:
    return str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else None


def _op_name(n: fx.Node) -> str:
    target = n.target
    if isinstance(target, OpOverload):
        return str(target).removeprefix("aten.")
    return getattr(target, "__name__", str(target))

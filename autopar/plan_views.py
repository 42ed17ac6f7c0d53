"""Human views of a plan: `describe()` (JSON-able) and `summary()` (text).

Axis roles are derived from placements, never stored: on each mesh axis,
- all user inputs sharded on the batch dim, parameters replicated    -> "dp"
- user inputs sharded on the batch dim and parameters mostly sharded -> "fsdp"
- user inputs replicated and parameters sharded                      -> "tp"
  (+ "sp" when activations are sharded on the sequence dim there)
- nothing sharded                                                    -> "replicated"
"""

from __future__ import annotations

from collections import Counter

from autopar.plan import Plan, parse_spec
from torch.distributed.tensor import Shard


def axis_roles(plan: Plan) -> list[str]:
    roles = []
    inputs = [t for t in plan.tensors if t.kind == "input"]
    params = [t for t in plan.tensors if t.kind == "param"]
    for axis in range(len(plan.mesh_shape)):
        batch = bool(inputs) and all(parse_spec(t.spec)[axis] == Shard(0) for t in inputs)
        sharded = sum(_numel(t.shape) for t in params if isinstance(parse_spec(t.spec)[axis], Shard))
        total = sum(_numel(t.shape) for t in params) or 1
        if batch:
            roles.append("fsdp" if sharded > total / 2 else "dp")
        elif sharded:
            roles.append("tp+sp" if _seq_sharded(plan, axis) else "tp")
        else:
            roles.append("replicated")
    return roles


def _seq_sharded(plan: Plan, axis: int) -> bool:
    return any(o is not None and o.split(",")[axis] == "S(1)" and n.op.startswith("native_layer")
               for n in plan.nodes for o in n.outputs[:1])


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def describe(plan: Plan) -> dict:
    roles = axis_roles(plan)
    return {
        "strategy": plan.strategy,
        "graph_fingerprint": plan.graph_fingerprint,
        "content_hash": plan.content_hash,
        "stages": [{
            "stage": 0,
            "devices": list(range(_numel(plan.mesh_shape))),
            "mesh": list(plan.mesh_shape),
            "axis_names": list(plan.axis_names),
            "axis_roles": dict(zip(plan.axis_names, roles, strict=True)),
        }],
        "predicted_step_time": plan.predicted_step_time,
        "predicted_peak_memory": plan.predicted_peak_memory,
        "parameters": {t.fqn: t.spec for t in plan.tensors if t.kind == "param"},
        "inputs": {t.fqn: t.spec for t in plan.tensors if t.kind == "input"},
        "solver": plan.solver,
    }


def summary(plan: Plan) -> str:
    d = describe(plan)
    stage = d["stages"][0]
    lines = [
        f"autopar plan {d['content_hash']} for graph {d['graph_fingerprint']} "
        f"(strategy={d['strategy']})",
        f"mesh {tuple(stage['mesh'])} axes " + ", ".join(
            f"{a}={r}" for a, r in stage["axis_roles"].items()),
        f"predicted step time {plan.predicted_step_time * 1e3:.3f} ms, "
        f"peak memory {plan.predicted_peak_memory / 2**30:.3f} GiB per device",
        "parameter placements: " + ", ".join(
            f"{spec}×{n}" for spec, n in Counter(d["parameters"].values()).most_common()),
        "inputs: " + ", ".join(f"{k}={v}" for k, v in d["inputs"].items()),
    ]
    if plan.solver:
        s = plan.solver
        lines.append(f"solver: {s.get('status')} gap {s.get('gap', 0):.2g} in "
                     f"{s.get('solve_time_s', 0):.2f}s ({s.get('ilp_decisions')} decisions, "
                     f"{s.get('edges')} edges; search {s.get('search_time_s', 0):.2f}s)")
    return "\n".join(lines)

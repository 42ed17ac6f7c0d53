"""Memory of `passes.comm`'s fused collectives in one rank's step (part of `search.liveness`).

* Gradient buckets (`Buckets`): the gradient reductions fused as `passes.comm` fuses them
  (`cost_models.buckets.bucket_plan`, DDP's caps 1 MiB then 25 MiB; one bucket sequence per
  set of reduced mesh axes, one for the reduce-scatters of sharded parameters). A complete
  gradient (cast to the reduce dtype where it completes) is held until its bucket closes;
  then the bucket's flat input of B = sum of its members' bytes is allocated beside them
  (the concatenation), the members die, the bucket is reduced (each parameter's reduced
  gradient as `param_state.reduce_param_grad` prices it) and the flat input dies:
  peak at a close = held gradients + B.
* Fused layer gathers (`gather_groups`, `alloc_gathered`): `passes.comm` gathers a layer's
  weights in one collective per phase and unpacks the flat result (B = sum of the members'
  gathered bytes) into every member at its wait, so all members are made when the first is
  needed, with the flat buffer alive while they are copied: peak there = members + B.

`step` is `search.liveness._Step` (duck-typed here: this module sits below it).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.capture.export import layer_of
from autopar.capture.operands import tensor_operands
from autopar.cost_models.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES
from autopar.search.param_state import Param, reduce_param_grad

__all__ = ["Buckets", "alloc_gathered", "gather_groups", "num_outputs", "resolve"]


def num_outputs(n: fx.Node) -> int:
    val = n.meta.get("val")
    return len(val) if isinstance(val, (tuple, list)) else 1


def resolve(op) -> tuple[fx.Node, int]:
    node, index = op.producer, op.output_index or 0
    if node.op == "call_function" and node.target is operator.getitem:
        node, index = node.args[0], node.args[1]
    return node, index


def gather_groups(step) -> dict[object, tuple[object, ...]]:
    """A layer's weight gathers (its redistributed inputs computed from parameters only),
    which `passes.comm` fuses into one collective per layer and phase: each storage key ->
    its layer's keys. The fused result is one flat buffer unpacked into every member's
    copy at once, so the layer's gathered weights are all made when the first is needed,
    with the flat buffer alive while they are copied out."""
    param_only = {
        (n.name, 0)
        for n in step.captured.gm.graph.nodes
        if n.op == "placeholder" and n.name not in step.captured.user_inputs
    }
    groups: dict[str, list[object]] = {}
    root = {v: v[0] for v in param_only}  # a parameter-only value -> its parameter
    reads: dict[str, list[tuple[str, int]]] = {}  # parameter -> its redistributed reads
    for n in step.nodes:
        ops = tensor_operands(n)
        if ops and all(step.value(op) in param_only for _, op in ops):
            param_only.update((n.name, j) for j in range(num_outputs(n)))
            root.update(((n.name, j), root[step.value(ops[0][1])]) for j in range(num_outputs(n)))
        layer = layer_of(n)
        for k, (pos, op) in enumerate(ops):
            key = step.in_keys[n.name][k]
            if key[0] == "comm" and step.value(op) in param_only:
                reads.setdefault(root[step.value(op)], []).append(step.value(op))
            if layer is not None and key[0] == "comm" and step.value(op) in param_only:
                step.comm_bytes[key] = step.value_bytes(*resolve(op), step.input_spec(n, pos))
                groups.setdefault(layer, []).append(key)
    # a parameter's gradient reduce-scattered from one read goes to the output alone (a
    # bucket's member); from several, the shards are summed (reduced at once, unfused)
    step.scattered = {r[0] for r in reads.values() if len(r) == 1}
    return {key: tuple(keys) for keys in groups.values() if len(keys) > 1 for key in keys}


def alloc_gathered(step, key: object, nbytes: float, again: bool = False) -> None:
    """A redistributed input; a fused layer gather makes its whole layer's (see above)."""
    live, group = step.live, step.groups.get(key, ())
    if key in live.bytes or not group:
        live.alloc(key, nbytes, "communication")
        return
    members = [k for k in group if not again or k in step.recompute]
    live.alloc(("flat", key), sum(step.comm_bytes[k] for k in members), "communication")
    for k in members:
        live.alloc(k, step.comm_bytes[k], "communication")
    live.free(("flat", key))


class Buckets:
    """Gradient reductions fused as `passes.comm` fuses them (`cost_models.buckets`'
    `bucket_plan`, DDP's caps; one bucket sequence per set of reduced mesh axes, one for
    the reduce-scatters of sharded parameters): a complete gradient (cast to the reduce
    dtype) is held until its bucket closes; the bucket is then concatenated into one flat
    buffer (communication), the gradients die, the bucket is reduced and the flat input
    dies after the collective."""

    def __init__(self, step) -> None:
        self.step = step
        self.open: dict[tuple, tuple[list, float, int]] = {}  # axes -> members, bytes, index
        self.deferred: set[object] = set()  # reduce-scattered gradients not yet reduced

    def add(self, name: str, partial: object, p: Param) -> None:
        step, mem = self.step, self.step.plan.memory
        spec = step.specs[name]
        axes = tuple(
            a
            for a, (q, k) in enumerate(zip(spec, step.mesh, strict=True))
            if q.is_replicate() and k > 1
        )
        if partial in self.deferred:  # its reduce-scatter waits for its bucket
            self.hold(("scatter",), (name, p), partial, 0.0)
            return
        if not axes:  # nothing to reduce
            reduce_param_grad(step, name, partial, p)
            return
        reduce = getattr(torch, mem.reduce_dtype or "float32").itemsize
        reduce = reduce if mem.param_dtype else p.compute
        held_key = partial
        if reduce != p.compute and not mem.shard_optimizer:  # cast where it completes
            held_key = ("gradcast", name)
            step.live.alloc(held_key, p.numel * reduce, "activations")
            step.live.free(partial)
        self.hold(axes, (name, p), held_key, p.numel * reduce)

    def hold(self, axes: tuple, param: tuple | None, key: object, nbytes: float) -> None:
        """`key` (`nbytes`) waits for its bucket; `param` (name, Param): reduced at its close
        (None: a parameter's full gradient reduce-scattered into its shard, which the
        simulation holds as reduced already)."""
        members, held, index = self.open.get(axes, ([], 0.0, 0))
        members.append((param, key))
        held += nbytes
        self.open[axes] = (members, held, index)
        if held >= (FIRST_BUCKET_BYTES if index == 0 else BUCKET_BYTES):
            self.close(axes)

    def close(self, axes: tuple) -> None:
        members, held, index = self.open.pop(axes, ([], 0.0, 0))
        live, key = self.step.live, ("bucket", axes, index)
        if members:
            live.alloc(key, held, "communication")
            for param, partial in members:
                live.free(partial)
                if param is not None:
                    reduce_param_grad(self.step, param[0], partial, param[1])
            live.free(key)
        self.open[axes] = ([], 0.0, index + 1)

    def close_all(self) -> None:
        for axes in list(self.open):
            self.close(axes)

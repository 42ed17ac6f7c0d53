"""Liveness simulation of one training step on one rank (the engine of `search.peak`).

`simulate_step(captured, plan, nodes, probes, optimizer_states, foreach) -> PeakMemory`

What autograd keeps comes from `search.probe` (each node run on meta tensors); bytes are
those of the plan's local shards on the stage mesh. The step, as the runtime runs it
(FX frees a value after its last use), in `runtime.memory_stats`' categories:

* held: parameter and buffer shards, optimizer state (`optimizer_states` tensors per
  parameter + a 4-byte step counter), the global batch and this rank's shard of it;
  mixed precision and ZeRO as `runtime.optimizer` tabulates (fp32 master, compute-dtype
  working copies cast before the program starts, flat master/gradient shards);
* forward, graph order: an input whose planned spec differs from its producer's output is
  redistributed into a new buffer (communication); non-view outputs are allocated; a
  value dies after its last forward use unless a backward reads it (then after the
  backward of its first reader);
* backward, reverse order: a gradient per differentiable input (in the input's spec, moved
  back into the producer's spec if redistributed from a source not Partial), summed into a
  new buffer when a value has two readers; output gradients and saved values freed after
  their last reader; a parameter's complete gradient cast to the reduce dtype and reduced
  out of place into its storage (or reduce-scattered into the ZeRO flat shard), in
  `passes.comm`'s buckets (`search.fused_comm`: a bucket's gradients held until it
  closes, then concatenated);
* fused gathers (`search.fused_comm`): a layer's gathered weights all made when the first
  is needed, the fused collective's flat result alive while they are copied out;
* levers (`Plan.memory`): a recomputed layer keeps what `recomputed(policy, op)` keeps
  and its outputs; the rest is made again before its first backward reader (or before
  that of a recomputed value computed from it) as `passes.recompute` emits it; a layer in
  `reshard_after_forward` gathers its weights again in backward;
* while a node runs (`transient_bytes`, allocated and freed at the node, forward and
  backward): ring attention's K/V blocks in flight, a sharded random op's whole draw;
* optimizer: single-tensor AdamW (CPU) allocates two temporaries of the largest tensor it
  updates, foreach (GPU) one per tensor at once; ZeRO all-gathers the updated masters;
  then the gradients are freed.

Pipeline stages run as AOTAutograd programs: saved values live until the end of the stage
backward and parameter gradients are reduced at its end. The peak is the largest live sum
at any event; the breakdown is taken there.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.capture import Captured
from autopar.capture.export import layer_of
from autopar.capture.operands import tensor_operands
from autopar.capture.recompute_policy import recomputed
from autopar.cost_models.memory import local_shape
from autopar.cost_models.reshard import same_spec
from autopar.passes.strategies.rules.attention import valid_ring
from autopar.passes.strategies.rules.random_ops import whole_draw_bytes
from autopar.plan import MEMORY_CATEGORIES as CATEGORIES
from autopar.plan import Plan, parse_spec
from autopar.search.fused_comm import Buckets, alloc_gathered, gather_groups
from autopar.search.fused_comm import num_outputs as _num_outputs
from autopar.search.fused_comm import resolve as _resolve
from autopar.search.param_state import Param, hold, optimizer_update, reduce_param_grad
from autopar.search.probe import NodeProbe, probe_graph

__all__ = ["CATEGORIES", "NodeProbe", "PeakMemory", "probe_graph", "simulate_step"]


@dataclass(frozen=True, slots=True)
class PeakMemory:
    """Predicted peak bytes on one rank, its breakdown and the phase it falls in."""

    peak: float
    breakdown: dict[str, float]
    phase: str  # "forward" | "backward" | "optimizer"
    # what one microbatch keeps from its forward to its backward (saved activations,
    # gathered weights, stage outputs): the pipeline's in-flight multiplier applies to it
    kept: float = 0.0
    gradients: float = 0.0  # every parameter gradient of the step (all microbatches done)
    batch: float = 0.0  # the user inputs counted (global batch + this rank's shard)


class _Live:
    """Live bytes per storage key and the largest sum seen (with its breakdown)."""

    def __init__(self) -> None:
        self.bytes: dict[object, tuple[float, str]] = {}
        self.sizes: dict[object, float] = {}  # every storage ever made (for recomputation)
        self.by_category = dict.fromkeys(CATEGORIES, 0.0)
        self.total = 0.0
        self.peak = PeakMemory(0.0, dict(self.by_category), "forward")
        self.phase = "forward"

    def alloc(self, key: object, nbytes: float, category: str) -> None:
        if key in self.bytes or nbytes <= 0:
            return
        self.bytes[key] = (nbytes, category)
        self.sizes[key] = nbytes
        self.total += nbytes
        self.by_category[category] += nbytes
        if self.total > self.peak.peak:
            self.peak = PeakMemory(self.total, dict(self.by_category), self.phase)

    def free(self, key: object) -> None:
        entry = self.bytes.pop(key, None)
        if entry is not None:
            self.total -= entry[0]
            self.by_category[entry[1]] -= entry[0]


class _Step:
    """The simulation of one rank's step (see the module docstring)."""

    def __init__(self, captured: Captured, plan: Plan, nodes: list[fx.Node], probes):
        self.plan, self.captured, self.probes = plan, captured, probes
        self.nodes = [n for n in nodes if n.name in probes]
        self.mesh = plan.stage_mesh_shape
        self.specs = {t.name: parse_spec(t.spec) for t in plan.tensors}
        self.plans = {p.name: p for p in plan.nodes}
        self.live = _Live()
        self.storage: dict[tuple[str, int], object] = {}  # value -> storage key
        self.later: set[fx.Node] = set()  # nodes of later pipeline stages
        # a pipeline stage's AOTAutograd backward: the saved tensors are its inputs, held
        # by the autograd node until it returns; it reduces the gradients at its end
        self.aot = False
        self.recompute: set[object] = set()  # storages made again in backward
        self.comm_bytes: dict[object, float] = {}  # a fused layer gather's member sizes
        self.groups: dict[object, tuple[object, ...]] = {}  # member -> its layer's members
        self.scattered: set[tuple[str, int]] = set()  # values whose gradient is bucketed

    # ---- sizes --------------------------------------------------------------------------
    def value_bytes(self, node: fx.Node, index: int, spec=None) -> float:
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            val = val[index]
        if not isinstance(val, torch.Tensor):
            return 0.0
        if spec is None:
            spec = self.output_spec(node, index)
        if not spec:  # None: a value without a plan entry; (): the global tensor
            return float(val.numel() * val.dtype.itemsize)
        return float(math.prod(local_shape(val.shape, spec, self.mesh)) * val.dtype.itemsize)

    def output_spec(self, node: fx.Node, index: int):
        if node.op == "placeholder":
            return self.specs.get(node.name)
        if node.target is operator.getitem:
            return self.output_spec(node.args[0], node.args[1])
        p = self.plans.get(node.name)
        if p is None or not p.outputs:
            return None
        return parse_spec(p.outputs[min(index, len(p.outputs) - 1)])

    def input_spec(self, node: fx.Node, pos: int):
        p = self.plans.get(node.name)
        if p is None or pos >= len(p.inputs):
            return None
        return parse_spec(p.inputs[pos])

    # ---- values and their storages --------------------------------------------------------
    def value(self, op) -> tuple[str, int]:
        node, index = _resolve(op)
        return node.name, index

    def node_spec(self, name: str, index: int):
        node = self.by_name[name]
        return self.output_spec(node, index)

    def redistributed(self, n: fx.Node, pos: int, op) -> bool:
        specs = self._specs(n, pos, op)
        return specs is not None and not same_spec(*specs)

    def gradient_moved(self, n: fx.Node, pos: int, op) -> bool:
        """Whether the backward of input `pos`'s redistribution moves its gradient: not
        where the source was Partial (a row-parallel product summed into Replicate: the
        gradient stays Replicate, or Partial where the consumer splits, DTensor's
        `Redistribute.backward`), only where a source axis was split or replicated and the
        consumer wanted it otherwise."""
        specs = self._specs(n, pos, op)
        return specs is not None and any(
            not a.is_partial() and a != b for a, b in zip(*specs, strict=True)
        )

    def _specs(self, n: fx.Node, pos: int, op) -> tuple | None:
        """(the value's spec, the one input `pos` of `n` wants); None where either is
        unknown."""
        dst = self.input_spec(n, pos)
        src = self.node_spec(*self.value(op))
        return None if dst is None or src is None else (src, dst)

    def layout(self) -> None:
        """Storage keys of every input and output, and when each storage dies."""
        self.by_name = {n.name: n for n in self.captured.gm.graph.nodes}
        self.in_keys: dict[str, list[object]] = {}
        self.out_keys: dict[str, dict[int, object]] = {}
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        storage: dict[tuple[str, int], object] = {}
        for n in self.captured.gm.graph.nodes:
            if n.op == "placeholder":
                storage[(n.name, 0)] = ("held", n.name)
        self.last_use: dict[object, int] = {}
        self.savers: dict[object, list[int]] = {}
        for i, n in enumerate(self.nodes):
            probe = self.probes[n.name]
            keys = []
            for k, (pos, op) in enumerate(tensor_operands(n)):
                key = storage.get(self.value(op), ("recv", *self.value(op)))
                if self.redistributed(n, pos, op):
                    key = ("comm", n.name, k)
                keys.append(key)
                self.last_use[key] = i
                if k in probe.saved_inputs:
                    self.savers.setdefault(key, []).append(i)
            self.in_keys[n.name] = keys
            outs = {}
            for j in range(_num_outputs(n)):
                key = keys[probe.view_of[j]] if j in probe.view_of else (n.name, j)
                storage[(n.name, j)] = outs[j] = key
                self.last_use.setdefault(key, i)
                if j in probe.saved_outputs:
                    self.savers.setdefault(key, []).append(i)
            self.out_keys[n.name] = outs
        self.storage = storage
        # where backward starts: the loss, or the values a later pipeline stage reads
        mine = {n.name for n in self.nodes}
        loss = _resolve_node(self.captured.loss_node)
        self.seeds = [loss] if loss[0] in mine else []
        for n in self.nodes:
            for u in n.users:
                reader = _reader(u)
                if (
                    reader.op == "call_function"
                    and reader.name not in mine
                    and reader in self.later
                ):
                    j = u.args[1] if u.target is operator.getitem else 0
                    if self.probes[n.name].requires_grad and (n.name, j) not in self.seeds:
                        self.seeds.append((n.name, j))


def _resolve_node(n: fx.Node) -> tuple[str, int]:
    if n.op == "call_function" and n.target is operator.getitem:
        return n.args[0].name, n.args[1]
    return n.name, 0


def _recompute_sets(step: _Step) -> set[object]:
    """Storage keys a backward reads that the plan's levers do not keep (recomputed)."""
    memory = step.plan.memory
    if not memory.recompute and not memory.reshard_after_forward:
        return set()
    layers = {n.name: layer_of(n) for n in step.nodes}
    param_only: set[tuple[str, int]] = {
        (n.name, 0)
        for n in step.captured.gm.graph.nodes
        if n.op == "placeholder" and n.name not in step.captured.user_inputs
    }
    out: set[object] = set()
    for n in step.nodes:
        ops = tensor_operands(n)
        if ops and all(step.value(op) in param_only for _, op in ops):
            param_only.update((n.name, j) for j in range(_num_outputs(n)))
        layer = layers[n.name]
        policy = memory.recompute_of(layer)
        reshard = layer is not None and layer in memory.reshard_after_forward
        for k, (_, op) in enumerate(ops):
            key = step.in_keys[n.name][k]
            if isinstance(key, tuple) and key[0] == "comm":
                if policy == "full" or (reshard and step.value(op) in param_only):
                    out.add(key)
        if policy == "none" or not recomputed(policy, n.target):
            continue
        readers = [u for u in n.users if u.op == "call_function"]
        if any(layers.get(_reader(u).name, layer) != layer for u in readers):
            continue  # a layer output: the next layer's input is kept
        out.update(k for k in step.out_keys[n.name].values() if k == (n.name, k[1]))
    return out


def _reader(u: fx.Node) -> fx.Node:
    """The node that reads a value (a getitem stands for its own readers' layer)."""
    if u.target is operator.getitem and u.users:
        return next(iter(u.users))
    return u


def _deaths(step: _Step, recompute: set[object]) -> tuple[dict, dict]:
    """When each storage dies (time: forward node i at i, backward of node s at 2N - s) and
    when recomputed storages are made again ({time: [(key, dies)]}).

    A recomputed value is made again before its first backward reader, and before that of
    any recomputed value computed from it (the rewrite emits each recomputed node once:
    a layer recomputed for its last op's backward keeps its other saved values from then
    until their own backward readers)."""
    two_n = 2 * len(step.nodes)
    death = dict(step.last_use)
    made: dict[object, int] = {}
    for key, savers in step.savers.items():
        if key in recompute:
            made[key] = two_n - max(savers)
        else:
            death[key] = max(death[key], two_n if step.aot else two_n - min(savers))
    walks = {key: _walk(step, key, recompute) for key in made}
    for key, (deps, _) in walks.items():
        for dep in deps:
            if dep in made:
                made[dep] = min(made[dep], made[key])
    again: dict[int, list[tuple[object, int]]] = {}
    for key, when in made.items():
        again.setdefault(when, []).append((key, two_n - min(step.savers[key])))
        for src in walks[key][1]:
            death[src] = max(death.get(src, 0), when)
    return death, again


def _walk(step: _Step, key: object, recompute: set[object]) -> tuple[set, set]:
    """(recomputed storages, kept storages) a recomputed storage is computed from."""
    deps: set[object] = set()
    kept: set[object] = set()
    todo = [key]
    while todo:
        for s in _inputs_of(step, todo.pop()):
            if s in recompute:
                if s not in deps:
                    deps.add(s)
                    todo.append(s)
            elif s is not None:
                kept.add(s)
    return deps, kept


def _inputs_of(step: _Step, key: object) -> list[object]:
    if isinstance(key, tuple) and key[0] == "comm":
        n, k = step.by_name[key[1]], key[2]
        return [step.storage.get(step.value(tensor_operands(n)[k][1]))]
    return step.in_keys.get(key[0], []) if isinstance(key, tuple) else []


def _forward(step: _Step) -> None:
    """Graph order: redistributed inputs, outputs, then the storages dying here."""
    live = step.live
    for i, n in enumerate(step.nodes):
        probe = step.probes[n.name]
        for k, (pos, op) in enumerate(tensor_operands(n)):
            key = step.in_keys[n.name][k]
            if isinstance(key, tuple) and key[0] == "comm":
                nbytes = step.value_bytes(*_resolve(op), step.input_spec(n, pos))
                alloc_gathered(step, key, nbytes)
        for j, key in step.out_keys[n.name].items():
            if j not in probe.view_of:
                extra = probe.extra_saved if j == 0 else 0.0
                live.alloc(key, step.value_bytes(n, j) * (1 + extra), "activations")
        _while_running(live, n, transient_bytes(step, n, backward=False))
        for key in step.dies_at.get(i, ()):
            live.free(key)


def _backward(step: _Step, again: dict, param_bytes: dict[str, Param]) -> None:
    """Reverse order: recompute, gradients of inputs (summed, moved back), frees."""
    live, two_n = step.live, 2 * len(step.nodes)
    grads: dict[tuple[str, int], object] = {}
    pending: dict[tuple[str, int], int] = {}
    done: list[tuple[str, object]] = []  # complete parameter gradients, not yet reduced
    buckets = Buckets(step)
    for n in step.nodes:
        for k in step.probes[n.name].grad_inputs:
            v = step.value(tensor_operands(n)[k][1])
            pending[v] = pending.get(v, 0) + 1
    for v in step.seeds:  # the loss's gradient, or those the next stage sends back
        key = ("seedgrad", *v)
        live.alloc(key, step.value_bytes(step.by_name[v[0]], v[1]), "activations")
        grads[v] = key
    for i in reversed(range(len(step.nodes))):
        n, t = step.nodes[i], two_n - i
        probe = step.probes[n.name]
        for key, dies in again.get(t, ()):
            if key in step.groups:
                alloc_gathered(step, key, live.sizes.get(key, 0.0), again=True)
            else:
                live.alloc(key, live.sizes.get(key, 0.0), "activations")
            step.dies_at.setdefault(dies, []).append(key)
        ops = tensor_operands(n)
        passed = set()
        for k in sorted(probe.grad_inputs):
            pos, op = ops[k]
            v = step.value(op)
            view = next((j for j, src in probe.view_of.items() if src == k), None)
            if view is not None and (n.name, view) in grads and not step.redistributed(n, pos, op):
                key = grads[(n.name, view)]
                passed.add(view)
            else:
                key = ("grad", n.name, k)
                live.alloc(
                    key, step.value_bytes(*_resolve(op), step.input_spec(n, pos)), "activations"
                )
                if step.gradient_moved(n, pos, op):
                    moved = ("gradcomm", n.name, k)
                    # a bucketed reduce-scatter (in a stage's backward program too, when
                    # the plan runs `passes.comm` there)
                    if v in step.scattered and (not step.aot or step.plan.comm is not None):
                        buckets.hold(("scatter",), None, key, live.sizes.get(key, 0.0))
                        buckets.deferred.add(moved)
                    else:
                        live.alloc(moved, step.value_bytes(*_resolve(op)), "communication")
                        live.free(key)
                    key = moved
            if v in grads:  # a second reader's gradient: summed into a new buffer
                total = ("gradsum", n.name, k)
                live.alloc(total, step.value_bytes(*_resolve(op)), "activations")
                live.free(grads[v])
                live.free(key)
                key = total
            grads[v] = key
            pending[v] -= 1
            if pending[v] == 0 and v[0] in param_bytes:
                done.append((v[0], grads.pop(v)))
                if not step.aot:
                    buckets.add(*done.pop(), param_bytes[v[0]])
        _while_running(live, n, transient_bytes(step, n, backward=True))
        for j in range(_num_outputs(n)):
            key = grads.pop((n.name, j), None)
            if key is not None and j not in passed:
                live.free(key)
        for key in step.dies_at.get(t, ()):
            live.free(key)
    buckets.close_all()
    for name, partial in done:  # a pipeline stage's backward program reduces at its end
        reduce_param_grad(step, name, partial, param_bytes[name])


# ring attention's K/V blocks in flight besides its own (`rules.ring`): forward, the block
# computed on, the next pass's flat buffer and its receive buffer; backward, as many for
# the K/V pass and again for the travelling dK/dV accumulator
RING_BLOCKS_IN_FLIGHT = {False: 3, True: 6}


def transient_bytes(step: _Step, n: fx.Node, backward: bool) -> float:
    """Bytes a node holds only while it runs (forward or backward): ring attention's K/V
    blocks in flight, a sharded random op's whole draw (`rules.random_ops`)."""
    if n.target == torch.ops.aten.scaled_dot_product_attention.default:
        q, k = step.input_spec(n, 0), step.input_spec(n, 1)
        if k and any(p == Shard(2) for p in k) and valid_ring(q, k):
            ops = tensor_operands(n)[1:3]
            kv = sum(step.value_bytes(*_resolve(op), step.input_spec(n, pos)) for pos, op in ops)
            return kv * RING_BLOCKS_IN_FLIGHT[backward]
    spec = step.output_spec(n, 0)
    if not backward and spec and any(isinstance(p, Shard) for p in spec):
        return whole_draw_bytes(n)
    return 0.0


def _while_running(live: _Live, n: fx.Node, nbytes: float) -> None:
    live.alloc(("transient", n.name), nbytes, "activations")
    live.free(("transient", n.name))


def simulate_step(
    captured: Captured,
    plan: Plan,
    nodes: list[fx.Node],
    probes: dict[str, NodeProbe],
    optimizer_states: int,
    foreach: bool,
    later: frozenset[fx.Node] = frozenset(),
) -> PeakMemory:
    """Forward, backward and optimizer step of `nodes` (graph order) on one rank; `later`:
    the nodes of later pipeline stages (the values they read are sent and their gradients
    come back; values of earlier stages are received)."""
    step = _Step(captured, plan, nodes, probes)
    step.later = set(later)
    step.aot = plan.pipeline is not None
    step.layout()
    step.used = {
        op.producer.name
        for n in step.nodes
        for _, op in tensor_operands(n)
        if op.producer.op == "placeholder"
    }
    recompute = _recompute_sets(step)
    step.recompute = recompute
    step.groups = gather_groups(step)
    death, again = _deaths(step, recompute)
    mem = plan.memory
    casts = mem.param_dtype is not None and not mem.shard_optimizer  # die after last use
    keep = {
        k for k in death if k[0] in ("held", "recv") and not (casts and k[1] in captured.params)
    }
    keep |= {step.storage[v] for v in step.seeds}
    step.dies_at = {}
    for key, t in death.items():
        if key not in keep:
            step.dies_at.setdefault(t, []).append(key)
    param_bytes = hold(step, optimizer_states)
    for key in {k for keys in step.in_keys.values() for k in keys if k[0] == "recv"}:
        step.live.alloc(key, step.value_bytes(step.by_name[key[1]], key[2]), "activations")
    _forward(step)
    kept = sum(
        b
        for k, (b, c) in step.live.bytes.items()
        if c in ("activations", "communication") and k[0] not in ("held", "global")
    )
    step.live.phase = "backward"
    _backward(step, again, param_bytes)
    grads = sum(b for b, c in step.live.bytes.values() if c == "gradients")
    step.live.phase = "optimizer"
    optimizer_update(step, param_bytes, foreach)
    batch = sum(
        b
        for k, (b, _) in step.live.bytes.items()
        if k[0] == "global" or (k[0] == "held" and k[1] in captured.user_inputs)
    )
    return replace(step.live.peak, kept=float(kept), gradients=float(grads), batch=float(batch))

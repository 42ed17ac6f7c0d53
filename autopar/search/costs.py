"""Prices of strategies and resharding edges for the intra-op ILP, in seconds and bytes.

node cost  = roofline(flops * (1 + backward_factor) / split, bytes * (1 + backward_bytes_factor)
                      / split, the op's measured rate: `compute.rated_seconds`) where
             `split` = product of the sizes of the mesh axes on which the strategy divides the
             work (some input or output Shard or Partial on that axis), over
             `rules.attention.work_factor` (2 for causal attention split on the sequence
             with all-gathered K/V, 1 on the load-balanced ring); ring attention adds its
             K/V passes as it runs them, overlapped step by step, and its causal split's
             swaps with the partner rank, not overlapped (`cost_models.ring`); a region
             whose experts are split on an axis adds its all-to-alls (`REGION_EXCHANGES`).
forward    = its forward share: `forward_time`, what recomputing it costs (`search.levers`).
edge cost  = redistribute(producer output -> consumer input), plus one link latency per
             collective for its launch and synchronization (why DDP's one all-reduce
             beats FSDP's all-gather + reduce-scatter of the same volume when both fit)
           + redistribute(gradient at consumer input -> gradient placement at producer):
             the gradient of an input the consumer takes Replicate on an axis where its work
             is split is Partial there; a Partial forward output receives a Replicate grad.
             Under mixed precision a weight's gradient reduced where the parameter enters
             the program (edges without a forward reshard: the DP all-reduce, ZeRO's
             reduce-scatter) moves `reduce_itemsize` bytes per element; a gathered
             weight's (FSDP's reduce-scatter) and every other value its captured dtype's.
             The ILP's terms are conservative: every collective is priced on its own and
             waited at once (a gradient reduction that `passes.comm` buckets pays its own
             latency terms, an upper bound on its share of the bucket: tests/
             test_cost_model_invariants.py). The exact price of the program the runtime
             runs (gradient buckets on one channel behind the backward, FSDP gathers
             prefetched a layer ahead) is `autopar.search.step.predicted_step_time`
             (`cost_models.buckets`); `grad_reductions` lists a weight's reductions for it.
memory     = placeholders: `cost_models.memory.param_state_bytes` (local shard x (param +
             grad + optimizer states), as the runtime holds them: fp32 master under the
             mixed-precision policy, ZeRO with `shard_optimizer` / `shard_gradients`);
             other nodes: `activation_bytes` of their outputs (saved for backward), 0 for
             views and getitems (the producer counts its outputs).

Inputs are operands (`autopar.capture.operands`): an edge joins the producer of an operand
to its consumer at the operand's position, and prices the value the operand reads (the
selected output of a multi-output producer, for a getitem).

Weights (`CostWeights`) say how often the graph's parts count in the ILP objective and
memory: a captured *template* of a few layers stands for all of them (`layer`, per layer
name), activations are held for several in-flight microbatches under a pipeline
(`activation`), and the all-reduces of replicated parameters' gradients run once per step,
not once per microbatch (`sync` = 1 / microbatches; `sync_weight`: a sharded axis's
reduce-scatter runs per microbatch). The raw per-node figures stay unweighted.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

from autopar.capture.export import layer_of
from autopar.capture.operands import Operand, tensor_operands
from autopar.cluster import Cluster
from autopar.cost_models import comm, compute, memory, optimizer
from autopar.cost_models.reshard import Move, move_of, same_spec
from autopar.cost_models.ring import ring_attention_time, ring_forward_time
from autopar.passes.strategies import NodeStrategy, Spec, summed_spec
from autopar.passes.strategies.rules import attention, random_ops, regions
from autopar.search.edge_collectives import EdgeCollectives
from autopar.search.edge_matrices import EdgeMatrices, EdgeValue

aten = torch.ops.aten

# Ops whose output aliases their input: no new activation memory.
VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.permute.default,
    aten.t.default,
    aten.transpose.int,
    aten.expand.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.alias.default,
    aten.select.int,
    aten.reshape.default,
}


# all-to-alls of a region with split experts: dispatch and combine, in forward, again in
# backward's re-run of the forward, and their reverses carrying the gradients
REGION_FORWARD_EXCHANGES = 2
REGION_EXCHANGES = 6


@dataclass(frozen=True, slots=True)
class CostWeights:
    layer: Mapping[str, float] = field(default_factory=dict)  # layer name -> multiplicity
    activation: float = 1.0  # saved activations held at once (in-flight microbatches)
    sync: float = 1.0  # parameter-gradient reductions per microbatch

    def of(self, n: fx.Node) -> float:
        layer = layer_of(n)
        return self.layer.get(layer, 1.0) if layer is not None else 1.0


class CostContext(EdgeMatrices, EdgeCollectives):
    def __init__(
        self,
        cluster: Cluster,
        optimizer_states: int = 2,
        weights: CostWeights | None = None,
        shard_optimizer: bool = False,
        batch_dependent: set[fx.Node] | None = None,
        *,
        shard_gradients: bool = False,
        mixed_precision: bool = False,
        reduce_itemsize: int | None = None,
    ):
        self.cluster = cluster
        self.mesh_shape = cluster.mesh_shape
        self.optimizer_states = optimizer_states
        self.shard_optimizer = shard_optimizer
        self.shard_gradients = shard_gradients
        self.mixed_precision = mixed_precision
        self.reduce_itemsize = reduce_itemsize
        self.batch_dependent = batch_dependent
        self.weights = weights or CostWeights()
        self._inputs: dict[fx.Node, list[tuple[int, Operand]]] = {}
        self._flops: dict[fx.Node, tuple[float, float, str]] = {}
        self._forward_work: dict[fx.Node, tuple[float, float]] = {}
        self._parts: dict[tuple, tuple[float, float]] = {}  # `edge_parts` memo, by id
        self._alive: dict[int, object] = {}  # the objects `_parts` keys by id
        self._priced: dict[tuple, tuple[float, float]] = {}  # `edge_parts` by content
        self._redistributed: dict[tuple, float] = {}  # `_redistribute` memo
        self._moves: dict[tuple, Move] = {}  # `reshard.move_of` by spec numbers
        self._grad_src_numbers: dict[int, tuple[int, tuple]] = {}
        self._vias: dict[tuple, tuple | None] = {}  # `EdgeValue.through_source`, by numbers
        self._grad_specs: dict[tuple[int, int], tuple] = {}
        self._grad_srcs: dict[tuple, tuple] = {}  # `_grad_source` memo, by placements
        self._memories: dict[tuple[fx.Node, int], float] = {}
        self._byte_parts: dict[fx.Node, tuple | None] = {}  # `local_bytes`' table
        self._spec_shards: dict[int, int] = {}  # by `_spec_number`
        self._matmul_dims: dict[fx.Node, tuple | None] = {}
        self._keys: dict[fx.Node, tuple | None] = {}
        EdgeMatrices.__init__(self)

    # ---- graph helpers -------------------------------------------------------------------
    def operands(self, n: fx.Node) -> list[tuple[int, Operand]]:
        """(position in `NodeStrategy.inputs`, operand) per tensor operand of a call."""
        if n not in self._inputs:
            self._inputs[n] = tensor_operands(n) if n.op == "call_function" else []
        return self._inputs[n]

    @staticmethod
    def output_spec(op: Operand, s: NodeStrategy) -> Spec | None:
        """The spec of the value `op` reads when its producer runs strategy `s`."""
        return op.select(s.outputs)

    # ---- node ------------------------------------------------------------------------------
    def node_cost(self, n: fx.Node, s: NodeStrategy) -> float:
        if n.op != "call_function" or n.target in VIEW_OPS or n.target is operator.getitem:
            return 0.0
        flops, _, dtype = self._work(n)
        split = self._split(s) / attention.work_factor(n, s, self.mesh_shape)
        # a sharded random op draws the whole tensor on every rank (rules.random_ops)
        drawn = random_ops.whole_draw_bytes(n) * max(0.0, 1.0 - 1.0 / split)
        t = compute.compute_time(
            flops / split,
            self.local_bytes(n, s) * (1.0 + compute.backward_bytes_factor(n)) + drawn,
            dtype,
            self.cluster,
            op=compute.op_class(n),
            kernels=compute.training_kernels(n),
            dims=self._matmul_sides(n, s),
            keys=self._attention_keys(n),
            rated=compute.rated_seconds(n, self.cluster.device, 1 / split, backward=True),
        )
        t += REGION_EXCHANGES * self._region_exchange(n, s)
        ring = attention.ring_axis(n, s)
        if ring is None:
            return t
        kv = attention.ring_kv_bytes(n, s, self.mesh_shape)
        halves = attention.ring_half_bytes(n, s, self.mesh_shape)
        ring_n, link = self.mesh_shape[ring], self.cluster.link(ring)
        return ring_attention_time(t, compute.backward_factor(n), ring_n, kv, link, halves)

    def forward_time(self, n: fx.Node, s: NodeStrategy) -> float:
        """The forward share of `node_cost` (what recomputing it in backward costs)."""
        if n.op != "call_function" or n.target in VIEW_OPS or n.target is operator.getitem:
            return 0.0
        _, _, dtype = self._work(n)
        fwd, _ = self._forward_work[n]
        split = self._split(s) / attention.work_factor(n, s, self.mesh_shape)
        t = compute.compute_time(
            fwd / split,
            self.local_bytes(n, s),
            dtype,
            self.cluster,
            op=compute.op_class(n),
            dims=self._matmul_sides(n, s),
            keys=self._attention_keys(n),
            rated=compute.rated_seconds(n, self.cluster.device, 1 / split, backward=False),
        )
        t += REGION_FORWARD_EXCHANGES * self._region_exchange(n, s)
        ring = attention.ring_axis(n, s)
        if ring is None:
            return t
        kv = attention.ring_kv_bytes(n, s, self.mesh_shape)
        halves = attention.ring_half_bytes(n, s, self.mesh_shape)
        return ring_forward_time(t, self.mesh_shape[ring], kv, self.cluster.link(ring), halves)

    def _region_exchange(self, n: fx.Node, s: NodeStrategy) -> float:
        """One all-to-all of a region whose experts are split on an axis under ``s``
        (``Region.exchanged_bytes`` of the whole batch, over the other axes' split); 0
        for any other node or strategy."""
        axis = regions.experts_axis_of(n, s)
        if axis is None:
            return 0.0
        region = regions.spec_of(n.target)
        assert region is not None
        whole = [a.meta["val"] for a in n.args[: region.n_inputs]]
        on_axis = region.module.exchanged_bytes(*whole) * self.mesh_shape[axis] / self._split(s)
        return comm.collective_time(comm.Collective.ALL_TO_ALL, on_axis, axis, self.cluster)

    def _work(self, n: fx.Node) -> tuple[float, float, str]:
        if n not in self._flops:
            fwd, fwd_bytes = compute.node_flops(n), compute.node_bytes(n)
            self._forward_work[n] = (fwd, fwd_bytes)
            flops = fwd * (1.0 + compute.backward_factor(n))
            nbytes = fwd_bytes * (1.0 + compute.backward_bytes_factor(n))
            val = _first_tensor(n.meta.get("val"))
            dtype = str(val.dtype).removeprefix("torch.") if val is not None else "float32"
            self._flops[n] = (flops, nbytes, dtype)
        return self._flops[n]

    def local_bytes(self, n: fx.Node, s: NodeStrategy) -> float:
        """Bytes one rank's forward kernel of `n` moves under `s`: each operand and output
        at its local size (`compute.entry_bytes`: a replicated weight is read whole)."""
        parts = self._byte_parts.get(n)
        if parts is None:
            self._work(n)
            parts = self._byte_parts[n] = compute.entry_bytes(n)
        if parts is None:
            return self._forward_work[n][1] / self._split(s)
        total = 0.0
        for specs, sizes in zip((s.inputs, s.outputs), parts, strict=True):
            for spec, nbytes in zip(specs, sizes, strict=False):
                total += nbytes / self._shards(spec) if nbytes else 0.0
        return total

    def _attention_keys(self, n: fx.Node) -> tuple | None:  # `compute.attention_keys`, once
        if n not in self._keys:
            self._keys[n] = compute.attention_keys(n)
        return self._keys[n]

    def _matmul_sides(self, n: fx.Node, s: NodeStrategy) -> tuple[float, ...] | None:
        """A plain matmul's local sides under `s` (`compute.matmul_dims`)."""
        if (dims := self._matmul_dims.get(n, ())) == ():
            dims = self._matmul_dims[n] = compute.matmul_dims(n)
        return None if dims is None else compute.local_matmul_dims(dims, s.inputs, self.mesh_shape)

    def _shards(self, spec: Spec | None) -> int:
        if spec is None:
            return 1
        number = self._spec_number(spec)
        found = self._spec_shards.get(number)
        if found is None:
            found = self._spec_shards[number] = compute.shard_count(spec, self.mesh_shape)
        return found

    def _split(self, s: NodeStrategy) -> int:
        split = 1
        for axis, size in enumerate(self.mesh_shape):
            specs = [sp for sp in (*s.inputs, *s.outputs) if sp is not None]
            if any(type(sp[axis]) is not Replicate for sp in specs):  # no subclass: exact
                split *= size
        return split

    def node_memory(self, n: fx.Node, s: NodeStrategy) -> float:
        """Bytes per device (see `autopar.cost_models.memory`), unweighted."""
        key = (n, id(s))
        found = self._memories.get(key)
        if found is None:
            self._alive[id(s)] = s
            found = self._memories[key] = self._node_memory(n, s)
        return found

    def _node_memory(self, n: fx.Node, s: NodeStrategy) -> float:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if not isinstance(val, torch.Tensor) or not s.outputs:
                return 0.0
            return memory.param_state_bytes(
                val.shape,
                val.dtype,
                s.outputs[0],
                self.mesh_shape,
                optimizer=self.optimizer_states,
                trained=is_param(n),
                shard_optimizer=self.shard_optimizer,
                shard_gradients=self.shard_gradients,
                mixed_precision=self.mixed_precision,
            )
        if n.target in VIEW_OPS or n.target is operator.getitem or n.op != "call_function":
            return 0.0
        total = 0.0
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for v, spec in zip(vals, s.outputs, strict=False):
            if isinstance(v, torch.Tensor) and spec is not None:
                total += memory.activation_bytes(v.shape, v.element_size(), spec, self.mesh_shape)
        return total

    def update_time(self, n: fx.Node, s: NodeStrategy) -> float:
        """The optimizer's update of parameter `n` placed as `s`, once per step, seconds
        (`cost_models.optimizer`); 0 for anything but a trained parameter."""
        val, spec = n.meta.get("val"), (s.outputs or (None,))[0]
        if n.op != "placeholder" or not is_param(n) or spec is None:
            return 0.0
        mesh, states, zero = self.mesh_shape, self.optimizer_states, self.shard_optimizer
        return optimizer.update_time(
            val.shape, val.dtype, spec, mesh, self.cluster, states, zero, self.mixed_precision
        )

    def is_weight(self, n: fx.Node) -> bool:
        """A parameter or a value computed from parameters only (a transposed or cast
        weight): its gradient is a parameter gradient, reduced once per step."""
        if self.batch_dependent is None:
            return is_param(n)
        return is_param(n) or (n.op != "placeholder" and n not in self.batch_dependent)

    def is_activation(self, n: fx.Node) -> bool:
        return n.op == "call_function"

    def memory_weight(self, n: fx.Node) -> float:
        """How often `n`'s memory counts in the ILP (see `CostWeights`)."""
        return self.weights.of(n) * (self.weights.activation if self.is_activation(n) else 1.0)

    def weighted_memory(self, n: fx.Node, s: NodeStrategy) -> float:
        """Memory as the ILP counts it (see `CostWeights`)."""
        return self.memory_weight(n) * self.node_memory(n, s)

    # ---- edges -----------------------------------------------------------------------------
    def edge_cost(self, op: Operand, src, v: fx.Node, s: NodeStrategy, pos: int) -> float:
        """Forward reshard plus backward transpose, seconds (one microbatch, unweighted)."""
        return sum(self.edge_parts(op, src, v, s, pos))

    def weighted_edge_cost(self, op: Operand, src, v: fx.Node, s: NodeStrategy, pos: int):
        """The edge as the ILP counts it: gradient sync scaled by `CostWeights.sync`."""
        fwd, bwd = self.edge_parts(op, src, v, s, pos)
        return self.weights.of(v) * (fwd + self.sync_weight(op, src, v, s, pos) * bwd)

    def counted_in_full(self, op: Operand) -> bool:
        """Every backward part of an edge reading `op` counts once per microbatch
        (`sync_weight` 1, whatever the specs): not a weight's, or no pipeline weights."""
        return not self.is_weight(op.producer) or self.weights.sync == 1.0

    def sync_weight(self, op: Operand, src, v: fx.Node, s: NodeStrategy, pos: int) -> float:
        """How often the backward part of an edge reading `op` (spec `src`) as input `pos`
        of `v` running `s` counts per microbatch, as the pipeline runtime reduces weight
        gradients: an all-reduce (the gradient of a parameter replicated on that axis, left
        partial by `runtime.pipeline._DeferGradSync`) once per step (`CostWeights.sync`),
        any other collective (a sharded axis's reduce-scatter) in every microbatch's
        backward. A mixed edge counts each part at its rate (by its time). A Megatron TP
        weight, sharded on tp and replicated on dp, is all-reduced on dp once per step:
        priced per microbatch, the ILP stored it replicated on tp too, or FSDP-sharded."""
        if self.counted_in_full(op):
            return 1.0
        grads = self.grad_reductions(op, src, v, s, pos)
        times = [
            (kind, comm.collective_time(kind, nbytes, axis, self.cluster))
            for _, kind, axis, nbytes in grads
        ]
        total = sum(t for _, t in times)
        deferred = sum(t for kind, t in times if kind == comm.Collective.ALL_REDUCE)
        if not deferred or deferred == total:  # all at one rate (exactly)
            return self.weights.sync if deferred else 1.0
        return (deferred * self.weights.sync + total - deferred) / total

    def edge_parts(self, op: Operand, src, v: fx.Node, s: NodeStrategy, pos: int):
        """(forward reshard, backward gradient reshard) in seconds of the value `op` reads
        (from spec `src`) as input `pos` of `v` running `s`. Memoized per (strategy, input,
        source spec, shape, dtype size, weight or not): repeated layers and ops of one
        shape ask for the same pair again."""
        val = op.tensor
        if val is None:
            return 0.0, 0.0
        return self._parts_of(EdgeValue.of(self, op, val, v, pos), src, s, pos)

    def _parts_of(self, edge: EdgeValue, src, s: NodeStrategy, pos: int):
        dst = s.inputs[pos] if pos < len(s.inputs) else None
        if src is None or dst is None:
            return 0.0, 0.0
        # by identity (placements hash in Python); `_alive` holds every object keyed by
        # its id, so no id is reused while the memo lives
        key = (
            id(s),
            pos,
            id(src),
            edge.shape,
            edge.dtype,
            edge.memo_weight,
            edge.into_partial,
            edge.transposed,
        )
        found = self._parts.get(key)
        if found is None:  # by content: the same specs of another node (a repeated block's)
            self._alive[id(s)], self._alive[id(src)] = s, src
            grad = self._grad_spec_at_consumer(dst, s)  # all `_edge_parts` reads of `s`
            numbers = (self._spec_number(src), self._spec_number(dst), self._spec_number(grad))
            found = self._parts[key] = self._numbered_parts(edge, *numbers, src, s, pos)
        return found

    def _numbered_parts(self, edge: EdgeValue, n_src, n_dst, n_grad, src, s, pos: int):
        """`_parts_of` by the numbers of the source spec, the spec input `pos` of `s`
        wants and its gradient's there (`_spec_number`), memoized by them."""
        content = (
            n_src,
            n_dst,
            n_grad,
            edge.dims,
            edge.itemsize,
            edge.memo_weight,
            edge.into_partial,
            edge.transposed,
        )
        found = self._priced.get(content)
        if found is None:
            dst = s.inputs[pos]
            grad = self._grad_spec_at_consumer(dst, s)
            numbers = (n_src, n_dst, n_grad)
            found = self._priced[content] = self._edge_parts(edge, numbers, src, dst, grad)
        return found

    def _edge_parts(self, edge: EdgeValue, specs, src, dst, grad) -> tuple[float, float]:
        """`specs`: the numbers (`_spec_number`) of `src`, `dst` and `grad` (the gradient's
        spec at the consumer), by which the seconds are memoized."""
        n_src, n_dst, n_grad = specs
        n_grad_src, grad_src = self._numbered_grad_source(n_src, src)
        grad_size = size = edge.itemsize
        if self.reduce_itemsize and edge.weight and same_spec(src, dst):
            # a weight's gradient not reduced by a forward gather's backward reaches the
            # parameter partial and is reduced there, in reduce_dtype (`passes.precision`)
            grad_size = self.reduce_itemsize
        via = None  # or the permutation of a transposed value moved as its source
        if edge.transposed is not None:
            key = (n_src, n_dst, edge.transposed)
            if (via := self._vias.get(key, ())) == ():
                via = self._vias[key] = edge.through_source(src, dst)
        fwd = self._redistribute(
            (n_src, n_dst, edge.dims, size, edge.into_partial, via), src, dst, edge.into_partial
        )
        bwd = self._redistribute(
            (n_grad, n_grad_src, edge.dims, grad_size, False, via), grad, grad_src
        )
        return fwd, bwd

    def _numbered_grad_source(self, number: int, src) -> tuple[int, tuple]:
        """(number, spec) of `_grad_source(src)`, `src` numbered `number`."""
        if (found := self._grad_src_numbers.get(number)) is None:
            spec = self._grad_source(tuple(src))
            found = self._grad_src_numbers[number] = (self._spec_number(spec), spec)
        return found

    def _grad_source(self, src: tuple) -> tuple:
        """The gradient's placement at the producer (`summed_spec`)."""
        if (found := self._grad_srcs.get(src)) is None:  # by content: `src` is a fresh tuple
            found = self._grad_srcs[src] = summed_spec(src)
        return found

    def _grad_spec_at_consumer(self, dst, s: NodeStrategy):
        key = (id(s), id(dst))  # dst is one of s.inputs: alive while s is
        found = self._grad_specs.get(key)
        if found is None:
            self._alive[id(s)] = s
            found = self._grad_specs[key] = self._grad_spec(dst, s)
        return found

    def _grad_spec(self, dst, s: NodeStrategy):
        out = []
        for axis, p in enumerate(dst):
            split = any(
                sp is not None and not isinstance(sp[axis], Replicate)
                for sp in (*s.inputs, *s.outputs)
            )
            out.append(
                Partial()
                if isinstance(p, Replicate) and split
                else (Replicate() if p.is_partial() else p)
            )
        return tuple(out)

    def _redistribute(self, key: tuple, src, dst, into_partial: bool = False) -> float:
        """`reshard_seconds`, memoized by `key`: (source and destination spec numbers,
        shape, item size, into a Partial, the transpose of a value moved as its source);
        what the move runs is read once per pair of numbers (`reshard.Move`)."""
        found = self._redistributed.get(key)
        if found is None:
            n_src, n_dst, shape, itemsize, _, via = key
            pair = (n_src, n_dst, into_partial, via)
            if (move := self._moves.get(pair)) is None:
                move = self._moves[pair] = move_of(
                    self.cluster, tuple(src), tuple(dst), into_partial, via
                )
            found = self._redistributed[key] = move.seconds(self.cluster, shape, itemsize)
        return found


def is_param(n: fx.Node) -> bool:
    return n.op == "placeholder" and n.meta.get("autopar_role") == "param"


def _first_tensor(val):
    if isinstance(val, torch.Tensor):
        return val
    if isinstance(val, (tuple, list)):
        return next((v for v in val if isinstance(v, torch.Tensor)), None)
    return None

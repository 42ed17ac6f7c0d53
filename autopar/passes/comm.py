"""Communication pass: bucket gradient reductions and overlap collectives with compute.

`optimize_comm(gm, options) -> CommStats` rewrites a lowered per-rank program (local ATen ops
and `_c10d_functional` collectives, each collective's only user its `wait_tensor`) in place,
and each pipeline stage's forward and backward graph with the plan's options
(`runtime.pipeline`; `backward=True` tags an AOTAutograd backward graph as backward).
Every collective is issued and waited in the graph it was traced in, so none is in flight
across a program's boundary (a schedule's sends and receives run between programs).

Peers issue their collectives in one order, even where their programs differ: uneven
shards make rank-dependent graphs (DTensor pads a piece before a collective and narrows
its result on some ranks only; a pp x dp fsdp stage once hung so, one dp peer in an
all-gather, the other in a reduce-scatter). What every peer's program has alike is the
sequence of collectives as traced (op, group, bytes, layer, phase) and which nodes read
their results. So the pass (a) decides its buckets from that alone, walking the
collectives in traced order, following reads through the pieces' pads and narrows
(`PIECES`) as through views, and putting a bucket where one of its members stood; and (b)
never changes the issue order of the collectives among themselves: after bucketing, each
collective is issued after the one before it in the program (on any process group),
while waits still sink to their first reader and compute still moves. With one issue
order on every rank and every wait after its issue, no group can wait on a peer that
waits on it. Every plan runs the pass, pipelined or not,
even or uneven:

1. Bucketing. Backward all-reduces and reduce-scatters read by the output only (gradient
   reductions) with the same (op, reduce op, group, dtype, kept as a copy or not: a
   bucket's slices live while any does) are fused DDP-style: in traced order (the order
   their inputs become ready), a bucket takes collectives until its bytes reach the cap
   (`first_bucket_bytes` for a key's first bucket, `bucket_bytes` after: DDP's 1 MiB and
   25 MiB), issued where its last member stood. A step of a reduction that the next step
   alone reads (an FSDP x TP norm weight's gradient, reduce-scattered over dp, then
   all-reduced over tp in a bucket) is bucketed so too, its first read taken where that
   step's bucket is issued (16 reduce-scatters of 1 KiB -> one on GPT small's fsdp x tp;
   one per tensor before, each paying its latency). All-gathers are fused per layer (FSDP's
   unit: one per layer group and phase, forward or backward re-gather): a layer's parameter
   gathers (inputs from placeholders only, their copy-ins made first) where the first
   member stood; its other gathers (activations') where the last one stood, taking a gather
   only while no member's result is read before it (no consumer waits longer, no cycle
   forms; readers of a member that stood between move after the bucket). A bucket is one
   collective on the flat concatenation (inductor's merge functions through
   `autopar._compat`), split back into views; a piece that is not contiguous (a gather's
   column block of the (ranks, total) result) is copied out contiguous, as the unfused
   result was (left strided, it raised in one pipeline half's stage program and left the
   other half waiting: the pp x dp x tp "deadlock"). A fused all-gather is exact and
   gathers into a fresh result (inductor's preallocated `_out` buffer is held by the
   backend's work past its last reader); a fused reduction's last bit may differ (a ring's
   summation order depends on where an element sits, as in DDP's buckets): within the
   parity tolerances, not bit for bit.
2. Scheduling. A stable re-ordering that keeps the collectives' issue order: a
   `wait_tensor` (and the views reading the result) sinks to just before the first node
   that needs it; a fused result's unpacking (split views, contiguous copies) runs at its
   wait, so the flat buffer dies there. Gradient reductions are issued as soon as their
   inputs exist and the collective before them is issued (a bucket's flat input, its
   members' views and their concatenation, made then, not where the bucket stood after
   its last member in traced order). So is a backward all-reduce of an activation's
   gradient that is reduced in its own buffer (`in_place.reducible_in_place`: a
   column-parallel Linear's input gradient): the Linear's weight gradient, traced after
   it, is computed while it runs (Megatron's asynchronous tensor-parallel all-reduce;
   in place, it holds no buffer longer). Forward gathers of parameters
   are prefetched one ahead (issued when the previous one's wait runs, FSDP2's order, or
   when the collective before it is issued if later), never at the program's start;
   backward (re-)gathers, recomputed nodes and every other collective (the forward's
   activation collectives, the loss's, backward ones that allocate) stay where the
   lowered program (`passes.recompute` included) has them, so no buffer lives longer
   than priced. Before that, a mean loss's count of targets (a scalar the backward's
   first op reads) is counted from the targets and all-reduced at the program's start,
   the first collective issued (`passes.loss_weight`: as traced, every rank waited there
   for the slowest one's forward). Communication then overlaps compute wherever the
   backend runs collectives asynchronously (gloo's worker threads, NCCL's stream).
   Scheduling changes no number (the same ops on the same values, in another order).

What the cost model must price so (`cost_models.buckets.bucket_plan` is the bucket
assignment as a pure function): per gradient-reduction key, sum(sizes) bytes in
len(buckets) collectives (latency once per bucket); a bucket's time overlaps the backward
compute after its last gradient; the last bucket is exposed. Memory (`search.liveness`):
a bucket's gradients live until it closes, its flat input beside them at the
concatenation; a layer's fused gather makes all its members when the first is needed.
A pipeline stage (`search.layer_costs.stage_time`): each microbatch's programs priced as
`search.step` prices a step, an fsdp stage's gradient reduce-scatters (every microbatch's
backward) bucketed behind the backward; replicated parameters' all-reduces once per step
from the stage's last backward (`runtime.stage_grads.GradientSync`). Not priced: a
forward gather's flat result issued one layer ahead (alive during the previous layer's
forward); ZeRO's copied flat shards (a chunk's, a cast's) bucketed apart from the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.passes.comm_buckets import (  # noqa: F401 - the pass's vocabulary, read here too
    _F,
    ALL_GATHER,
    ALL_REDUCE,
    COPIES,
    PIECES,
    REDUCE_SCATTER,
    UNPACK,
    VIEWS,
    _collectives,
    _first_use,
    _is_start,
    _reads_only_state,
    _reorder,
    _sliced,
    bucket,
)
from autopar.passes.in_place import reduce_in_place, reducible_in_place
from autopar.passes.loss_weight import global_mean_loss, hoist_loss_weight
from autopar.passes.recompute import PHASE, RECOMPUTED, is_backward
from autopar.passes.shape_reads import WAITS, unchain_shape_reads
from autopar.plan import CommPlan

# what makes a bucket's flat input from its members (`_feeding_only`)
PACKING = VIEWS | COPIES | PIECES | {torch.ops.aten.cat.default}
# the pass's options are the plan's record of them (`plan.CommPlan`: what the step was
# priced with; defaults DDP's bucket sizes, overlap on)
CommOptions = CommPlan
DEFAULT = CommOptions()
OFF = CommOptions(bucket=False, overlap=False)


def options_of(comm: CommPlan | None) -> CommOptions:
    """The pass's options for a plan's `comm` (what its step was priced with; None: OFF)."""
    return OFF if comm is None else comm


@dataclass(frozen=True, slots=True)
class CommStats:
    """Collectives before and after the pass, and the buckets formed."""

    collectives_before: int
    collectives_after: int
    buckets: tuple[int, ...]  # members per fused collective


def optimize_comm(
    gm: fx.GraphModule, options: CommOptions = DEFAULT, backward: bool = False
) -> CommStats:
    """Bucket and schedule the collectives of `gm` in place (see the module docstring).

    `backward=True`: `gm` is a backward program as a whole (an AOTAutograd backward graph,
    whose nodes `passes.recompute.backward_phase` did not tag): every node is tagged so."""
    if backward:
        for n in gm.graph.nodes:
            n.meta["custom"] = {**(n.meta.get("custom") or {}), PHASE: "backward"}
    global_mean_loss(gm.graph)  # the batch's mean loss, not the ranks' means' mean
    before = len(_collectives(gm.graph))
    sizes: list[int] = []
    if options.bucket and before:
        sizes = bucket(gm.graph, options)
    if options.overlap and before:
        hoist_loss_weight(gm.graph)  # the loss's count all-reduced at the start
        unchain_shape_reads(gm.graph)  # `ones_like(loss)` waits on no loss all-reduce
        _schedule(gm.graph)
    reduce_in_place(gm.graph)  # a fresh bucket is reduced in its own buffer
    gm.graph.lint()
    gm.recompile()
    return CommStats(before, len(_collectives(gm.graph)), tuple(sizes))


# ---- scheduling --------------------------------------------------------------------------
def _schedule(graph: fx.Graph) -> None:
    """Re-order `graph`: the collectives in their order as they stand (each issued after the
    one before it); gradient reductions issued once their inputs exist, forward parameter
    gathers one ahead, the rest where it stands; waits (with the unpacking of their results)
    just before their first reader."""
    nodes = list(graph.nodes)
    starts = [c for c in nodes if c.op == "call_function" and _is_start(c)]
    lazy, tails = _lazy_nodes(nodes)
    after = _mutation_edges(nodes)  # node -> nodes that must come first (in-place writes)
    for previous, c in zip(starts, starts[1:], strict=False):  # the issue order: as traced
        after.setdefault(c, []).append(previous)
    followers: dict[fx.Node, list[fx.Node]] = {}
    for n, firsts in after.items():
        for f in firsts:
            followers.setdefault(f, []).append(n)
    pos = {n: i for i, n in enumerate(nodes)}
    prefetch = sorted(
        (c for c in starts if _is_gather(c) and _reads_only_state(c)),
        key=lambda c: _first_use(next(iter(c.users)), pos),
    )
    chained = set(prefetch)
    # a parameter gather (and its copy-in) is issued by the chain or, at the latest, when
    # its result is first needed: never where the inputs exist (the program's start)
    copy_in = _feeding_only(nodes, chained)
    lazy |= chained | copy_in
    # the forward's chain only: a backward (re-)gather stays where `passes.recompute` put
    # it, just before its first reader, as resharding and recomputation are priced
    next_of_wait = {
        next(iter(a.users)): b
        for a, b in zip(prefetch, prefetch[1:], strict=False)
        if not is_backward(a) and not is_backward(b)
    }
    # gradient reductions (read by the output only) are issued once their inputs exist (and
    # the collective before them is issued); any other collective (activations', the
    # loss's) where it stands, so that its buffers live no longer than the program as
    # lowered keeps them (what `search.liveness` prices)
    end = len(nodes) - 1
    eager = {c for c in starts if c.users and all(_first_use(w, pos) == end for w in c.users)}
    # a backward all-reduce of an activation's gradient reduced in place (a column-parallel
    # Linear's input gradient): issued once that gradient exists, so the weight gradient
    # traced after it is computed while it runs (Megatron's asynchronous tensor-parallel
    # all-reduce); in place, it holds no buffer longer
    eager |= {c for c in starts if reducible_in_place(c) and _phase(c) == (True, False)}
    eager -= chained
    # a bucket's flat input (its members' views and their concatenation, made where the
    # bucket stood: after its last member) is made with it, as soon as its members exist
    packing = _feeding_only(nodes, eager, PACKING)
    lazy |= packing
    needs = _needs_beyond(eager, packing, after)  # bucket -> what its packing reads
    waiting: dict[fx.Node, list[fx.Node]] = {}
    for c, outside in needs.items():
        for a in outside:
            waiting.setdefault(a, []).append(c)
    order: list[fx.Node] = []
    done: set[fx.Node] = set()

    def issuable(n: fx.Node) -> bool:  # all it needs is emitted, or is its own copy-in
        if n in needs:
            return all(a in done for a in needs[n])
        return all(
            a in done or (a in copy_in and issuable(a))
            for a in [*n.all_input_nodes, *after.get(n, ())]
        )

    def issue(c: fx.Node) -> None:
        if c in eager and c not in done and issuable(c):
            emit(c)

    def emit(n: fx.Node) -> None:
        if n in done:
            return
        for a in [*n.all_input_nodes, *after.get(n, ())]:
            emit(a)
        if n in done:  # emitted while its inputs were
            return
        order.append(n)
        done.add(n)
        for t in tails.get(n, ()):  # a fused result's members, made at once
            emit(t)
        if n in packing:  # made by its collective's `emit`, which issues it next
            return
        for u in [*n.users, *followers.get(n, ()), *waiting.get(n, ())]:  # what this lets
            issue(u)  # be issued
        if n in next_of_wait:  # prefetch the next parameter gather
            eager.add(next_of_wait[n])
            issue(next_of_wait[n])

    for n in nodes:  # the program's arguments keep their order
        if n.op == "placeholder":
            emit(n)
    if prefetch and not is_backward(prefetch[0]):
        eager.add(prefetch[0])
        issue(prefetch[0])
    for n in nodes:
        if n.op == "output":
            continue
        if n not in lazy:
            emit(n)
    for n in nodes[:-1]:  # what nothing reads (a dead view): where it stood, at the end
        emit(n)
    emit(nodes[-1])
    assert len(order) == len(nodes), "scheduling lost nodes"
    _reorder(graph, order)


def _is_gather(node: fx.Node) -> bool:
    return node.target in (ALL_GATHER, _F.all_gather_into_tensor_out.default)


def _lazy_nodes(nodes: list[fx.Node]) -> tuple[set[fx.Node], dict[fx.Node, list[fx.Node]]]:
    """Waits and what unpacks (only) them: emitted when first needed, a wait's unpacking
    (`tails`: wait -> its views and copies, in program order) right after it."""
    lazy: set[fx.Node] = set()
    owner: dict[fx.Node, fx.Node] = {}  # unpacking node -> its wait
    tails: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        if n.target in WAITS:
            lazy.add(n)
            owner[n] = n
            continue
        waits = {owner.get(a) for a in n.all_input_nodes}
        wait = waits.pop() if len(waits) == 1 else None
        if n.target in UNPACK and wait is not None and _phase(n) == _phase(wait):
            lazy.add(n)
            owner[n] = wait
            tails.setdefault(wait, []).append(n)
        elif n.target in VIEWS and n.all_input_nodes and all(a in lazy for a in n.all_input_nodes):
            lazy.add(n)  # a later phase's view (a recomputed one): where first needed
    return lazy, tails


def _phase(node: fx.Node) -> tuple[bool, bool]:
    return is_backward(node), bool((node.meta.get("custom") or {}).get(RECOMPUTED))


def _feeding_only(
    nodes: list[fx.Node], sinks: set[fx.Node], ops: set | None = None
) -> set[fx.Node]:
    """Nodes (of `ops`, or any call) read only on the way to `sinks`: a prefetched
    collective's copy-in (computed from parameters only as the collective is), a gradient
    bucket's flat input (its members' views, pads, copies and concatenation, made where
    the bucket stood: after its last member, often at the backward's end); emitted with
    their collective, not where they stand (a backward re-gather's copy-in stays in
    backward with it)."""
    inputs: set[fx.Node] = set()
    for n in reversed(nodes):
        if (
            n.op == "call_function"
            and (ops is None or n.target in ops)
            and n.users
            and all(u in sinks or u in inputs for u in n.users)
        ):
            inputs.add(n)
    return inputs


def _needs_beyond(
    eager: set[fx.Node], packing: set[fx.Node], after: dict[fx.Node, list[fx.Node]]
) -> dict[fx.Node, set[fx.Node]]:
    """For each collective with a flat input made by `packing` nodes: the nodes outside
    them that it and they read (or must follow): what must be emitted to issue it."""
    needs: dict[fx.Node, set[fx.Node]] = {}
    for c in eager:
        seen: set[fx.Node] = set()
        outside: set[fx.Node] = set()
        todo = [c]
        while todo:
            n = todo.pop()
            for a in [*n.all_input_nodes, *after.get(n, ())]:
                if a not in packing:
                    outside.add(a)
                elif a not in seen:
                    seen.add(a)
                    todo.append(a)
        if seen:
            needs[c] = outside
    return needs


def _mutation_edges(nodes: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """For an op writing one of its arguments in place, the readers of that argument after
    it must follow it (data edges alone do not say so)."""
    pos = {n: i for i, n in enumerate(nodes)}
    edges: dict[fx.Node, list[fx.Node]] = {}
    for m in nodes:
        schema = getattr(m.target, "_schema", None)
        if m.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, m.args, strict=False):
            if arg.is_write and isinstance(value, fx.Node):
                for u in value.users:
                    if u is not m and pos[u] > pos[m]:
                        edges.setdefault(u, []).append(m)
    return edges

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
   25 MiB), issued where its last member stood. All-gathers are fused per layer (FSDP's
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
   inputs exist and the collective before them is issued. Forward gathers of parameters
   are prefetched one ahead (issued when the previous one's wait runs, FSDP2's order, or
   when the collective before it is issued if later), never at the program's start;
   backward (re-)gathers, recomputed nodes and every other collective (activations', the
   loss's) stay where the lowered program (`passes.recompute` included) has them, so no
   buffer lives longer than priced. Communication then overlaps compute wherever the
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

import heapq
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar._compat import merge_collective_bucket
from autopar.passes.in_place import reduce_in_place
from autopar.passes.recompute import PHASE, RECOMPUTED, is_backward, layer_of
from autopar.passes.shape_reads import WAITS, unchain_shape_reads
from autopar.plan import CommPlan

MIB = 1024 * 1024
_F = torch.ops._c10d_functional
ALL_REDUCE = _F.all_reduce.default
REDUCE_SCATTER = _F.reduce_scatter_tensor.default
ALL_GATHER = _F.all_gather_into_tensor.default
# ops that only re-label a result (the split views of a bucket, reshapes): they sink with
# the wait they read
VIEWS = {
    *(operator.getitem, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default),
    *(torch.ops.aten.reshape.default, torch.ops.aten.alias.default),
    *(torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default),
    *(torch.ops.aten.unbind.int, torch.ops.aten.permute.default, torch.ops.aten.t.default),
    *(torch.ops.aten.squeeze.dim, torch.ops.aten.unsqueeze.default),
}
# what unpacks a fused collective's result into its members' tensors (a view, then a
# contiguous copy): emitted together right after the wait, so the flat buffer dies there
UNPACK = VIEWS | {torch.ops.aten.clone.default}
COPIES = {torch.ops.aten.clone.default, torch.ops.aten._to_copy.default}  # `_copied`
# what makes a rank's piece of an unevenly sharded value around a collective (the pad of
# its input, the narrow of its result): some ranks' programs have them, others not
PIECES = {
    *(torch.ops.aten.constant_pad_nd.default, torch.ops.aten.slice.Tensor),
    torch.ops.aten.narrow.default,
}


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
    before = len(_collectives(gm.graph))
    sizes: list[int] = []
    if options.bucket and before:
        sizes = _bucket(gm.graph, options)
    if options.overlap and before:
        unchain_shape_reads(gm.graph)  # `ones_like(loss)` waits on no loss all-reduce
        _schedule(gm.graph)
    reduce_in_place(gm.graph)  # a fresh bucket is reduced in its own buffer
    gm.graph.lint()
    gm.recompile()
    return CommStats(before, len(_collectives(gm.graph)), tuple(sizes))


# ---- bucketing -------------------------------------------------------------------------
def _collectives(graph: fx.Graph) -> list[fx.Node]:
    kinds = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, _F.all_reduce_.default)
    return [
        n
        for n in graph.nodes
        if n.target in kinds and len(n.users) == 1 and next(iter(n.users)).target in WAITS
    ]


def _key(node: fx.Node) -> tuple | None:
    """What a collective may be fused with (None: left alone)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or node.args[0].meta.get("val") is None:
        return None
    if node.target is ALL_GATHER:  # one per layer and phase (FSDP's unit)
        layer = layer_of(node)
        if layer is None:
            return None
        return ("ag", layer, is_backward(node), _reads_only_state(node), *node.args[1:])
    if not is_backward(node):
        return None  # forward reductions (TP activations, the loss) are needed at once
    # backward: gradient reductions (`_bucket` keeps those read only by the output)
    return (str(node.target), *node.args[1:], val.dtype, _copied(next(iter(node.users))))


def _bucket(graph: fx.Graph, options: CommOptions) -> list[int]:
    """Fuse the collectives (module docstring, 1.), deciding from what every peer's program
    has alike: the collectives in traced order, their keys and bytes, and where each
    member's result is first read (through a piece's narrow)."""
    _hoist_state_inputs(graph)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    first_use = {c: _first_use(next(iter(c.users)), pos) for c in _collectives(graph)}
    open_: dict[tuple, tuple[list[fx.Node], int, int]] = {}  # key -> members, bytes, index
    done: list[list[fx.Node]] = []
    end = len(pos) - 1  # the output node: what gradient reductions feed
    for c in first_use:  # traced order
        key = _key(c)
        if key is None or (key[0] != "ag" and first_use[c] != end):
            continue
        members, held, index = open_.get(key, ([], 0, 0))
        # a member's result read (or c's input made from it) before c: c starts another
        # bucket (a parameter gather's bucket is issued at its first member: never)
        state_gather = key[0] == "ag" and key[3]
        if members and not state_gather and min(first_use[m] for m in members) <= pos[c]:
            done.append(members)
            members, held, index = [], 0, index + 1
        members.append(c)
        held += _bytes(c)
        cap = options.first_bucket_bytes if index == 0 else options.bucket_bytes
        if key[0] != "ag" and held >= cap:
            done.append(members)
            members, held, index = [], 0, index + 1
        open_[key] = (members, held, index)
    done += [m for m, _, _ in open_.values() if m]
    for members in done:
        if len(members) > 1:
            _merge(graph, members)
    _stable_topological(graph)
    _gather_into_fresh(graph)
    return [len(m) for m in done if len(m) > 1]


def _copied(node: fx.Node) -> bool:
    """Whether `node`'s readers keep a copy of its result (ZeRO's flat gradient shard in the
    master dtype or a storage of its own, `passes.precision`): bucketed beside members kept
    as slices, its slice would live on beside its copy (`_key` puts them apart)."""
    return any(
        u.target in COPIES or (u.target in VIEWS | PIECES and _copied(u))
        for u in node.users
        if u.op == "call_function"
    )


def _first_use(node: fx.Node, pos: dict[fx.Node, int]) -> int:
    """Position of the first node reading `node` other than by a view or copy of it, or by
    the narrow or pad of an uneven piece (which some ranks' programs have, others not)."""
    uses = [
        _first_use(u, pos) if u.op == "call_function" and u.target in UNPACK | PIECES else pos[u]
        for u in node.users
    ]
    return min(uses, default=len(pos))


def _hoist_state_inputs(graph: fx.Graph) -> None:
    """Move the preparation of gathers that read parameters only (a transposed shard's
    copy) up to the placeholders, so that a layer's gathers can be fused; `_schedule`
    later emits each just before its collective."""
    nodes = list(graph.nodes)
    anchor = [n for n in nodes if n.op == "placeholder"][-1]
    cone: list[fx.Node] = []
    for c in _collectives(graph):
        if c.target is ALL_GATHER and _reads_only_state(c):
            cone += _ancestors(c)
    for n in sorted(set(cone), key=nodes.index):
        anchor.append(n)
        anchor = n


def _ancestors(node: fx.Node) -> list[fx.Node]:
    out, stack = [], list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n.op == "call_function" and n not in out:
            out.append(n)
            stack.extend(n.all_input_nodes)
    return out


def _bytes(node: fx.Node) -> int:
    vals = [node.meta["val"], node.args[0].meta["val"]]
    return max(v.numel() * v.element_size() for v in vals)


def _merge(graph: fx.Graph, members: list[fx.Node]) -> None:
    """One collective for `members` (traced order), issued where its first member stood
    when it gathers parameters (whose copy-ins `_hoist_state_inputs` made first), else
    where its last member stood (no member's result is read before: `_bucket`); each
    member's piece of the flat result made contiguous where it is not, as an unfused
    collective's result is (a fused gather's piece is a column block of the (ranks, total)
    result: a reader's `view` fails on it)."""
    key = _key(members[0])
    slot = members[0] if key is not None and key[0] == "ag" and key[3] else members[-1]
    for piece in merge_collective_bucket(graph, members, slot).values():
        val = piece.meta.get("val")
        assert isinstance(val, torch.Tensor), piece
        if not val.is_contiguous():
            _make_contiguous(graph, piece, val)


def _stable_topological(graph: fx.Graph) -> None:
    """Every node after its inputs, as early as they allow and otherwise in the order it
    stands (a view of a merged collective's piece that stood between the members moves
    after the merged collective; no collective moves)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    if all(pos[a] < pos[n] for n in nodes for a in n.all_input_nodes):
        return
    missing = {n: len(n.all_input_nodes) for n in nodes}
    ready = [pos[n] for n in nodes if not missing[n]]
    order: list[fx.Node] = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for u in n.users:
            missing[u] -= 1
            if not missing[u]:
                heapq.heappush(ready, pos[u])
    assert len(order) == len(nodes), "a cycle among the merged collectives"
    _reorder(graph, order)


def _make_contiguous(graph: fx.Graph, piece: fx.Node, val: torch.Tensor) -> None:
    """Readers of `piece` read a contiguous copy of it instead (part of the unpacking)."""
    readers = list(piece.users)
    with graph.inserting_after(piece):
        copy = graph.call_function(
            torch.ops.aten.clone.default, (piece,), {"memory_format": torch.contiguous_format}
        )
    copy.meta = {**piece.meta, "val": val.clone(memory_format=torch.contiguous_format)}
    for r in readers:
        r.replace_input_with(piece, copy)


def _gather_into_fresh(graph: fx.Graph) -> None:
    """A fused all-gather writes into a preallocated buffer (`empty`, this rank's slice
    copied in, `all_gather_into_tensor_out`); the backend's work holds such a buffer past
    the program's last reader. Gather the copied-in flat input into a fresh result
    instead (the same values, rank-major), as an unfused gather does."""
    out_op = _F.all_gather_into_tensor_out.default
    for n in [n for n in graph.nodes if n.target is out_op]:
        copy, out = n.args[0], n.kwargs.get("out")
        if copy.target is not torch.ops.aten.copy_.default or len(copy.users) != 1:
            continue
        window = copy.args[0]
        if window.all_input_nodes != [out] or len(window.users) != 1 or len(out.users) != 2:
            continue
        with graph.inserting_before(n):
            fresh = graph.call_function(ALL_GATHER, (copy.args[1], *n.args[1:]))
        fresh.meta = dict(n.meta)
        n.replace_all_uses_with(fresh)
        for dead in (n, copy, window, out):
            graph.erase_node(dead)


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
    copy_in = _prefetch_inputs(nodes, chained)
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
    eager -= chained
    order: list[fx.Node] = []
    done: set[fx.Node] = set()

    def issuable(n: fx.Node) -> bool:  # all it needs is emitted, or is its own copy-in
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
        for u in [*n.users, *followers.get(n, ())]:  # what this lets be issued
            issue(u)
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


def _reorder(graph: fx.Graph, order: list[fx.Node]) -> None:
    """Move the nodes into `order` (placeholders stay first: the order keeps them so)."""
    anchor = order[0]
    for n in order[1:]:
        anchor.append(n)
        anchor = n


def _is_gather(node: fx.Node) -> bool:
    return node.target in (ALL_GATHER, _F.all_gather_into_tensor_out.default)


def _is_start(node: fx.Node) -> bool:
    namespace = getattr(node.target, "namespace", None)
    return namespace in ("_c10d_functional", "c10d_functional") and node.target not in WAITS


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


def _prefetch_inputs(nodes: list[fx.Node], chained: set[fx.Node]) -> set[fx.Node]:
    """Nodes read only on the way to a prefetched collective (its copy-in, computed from
    parameters only as the collective is): emitted with it, not where they stand (a
    backward re-gather's copy-in stays in backward with it)."""
    inputs: set[fx.Node] = set()
    for n in reversed(nodes):
        if (
            n.op == "call_function"
            and n.users
            and all(u in chained or u in inputs for u in n.users)
        ):
            inputs.add(n)
    return inputs


def _reads_only_state(node: fx.Node) -> bool:
    """The collective's inputs derive from placeholders (and constants) alone: a parameter's
    gather (an empty piece some rank makes from nothing counts as one too)."""
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        if n.op != "call_function" or _is_start(n) or n.target in WAITS:
            return False
        stack.extend(n.all_input_nodes)
    return True


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

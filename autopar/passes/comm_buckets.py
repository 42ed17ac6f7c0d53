"""The communication pass, part 1: bucketing (`passes.comm`'s docstring, 1.).

`bucket(graph, options) -> members per fused collective`: gradient reductions fused
DDP-style by size, a layer's all-gathers per layer and phase, decided from what every
peer's program has alike (the collectives in traced order, their keys, bytes and first
reads), never changing their issue order. The collective ops and the node kinds both parts
of the pass read are defined here.
"""

from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx

from autopar._compat import merge_collective_bucket
from autopar.passes.recompute import is_backward, layer_of
from autopar.passes.shape_reads import WAITS
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
COPIES = {torch.ops.aten.clone.default, torch.ops.aten._to_copy.default}
# what makes a rank's piece of an unevenly sharded value around a collective (the pad of
# its input, the narrow of its result): some ranks' programs have them, others not
PIECES = {
    *(torch.ops.aten.constant_pad_nd.default, torch.ops.aten.slice.Tensor),
    torch.ops.aten.narrow.default,
}


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
        # one dtype per flat buffer: a norm weight gathered after its `1 + w.float()`
        # (Gemma's) beside a layer's bf16 weights would promote the whole buffer to fp32
        return ("ag", layer, is_backward(node), _reads_only_state(node), *node.args[1:], val.dtype)
    if not is_backward(node):
        return None  # forward reductions (TP activations, the loss) are needed at once
    # backward: gradient reductions (`_bucket` keeps those read only by the output)
    return (str(node.target), *node.args[1:], val.dtype, _sliced(next(iter(node.users))))


def bucket(graph: fx.Graph, options: CommPlan) -> list[int]:
    """Fuse the collectives (module docstring, 1.), deciding from what every peer's program
    has alike: the collectives in traced order, their keys and bytes, and where each
    member's result is first read (through a piece's narrow)."""
    _hoist_state_inputs(graph)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    first_use = {c: _first_use(next(iter(c.users)), pos) for c in _collectives(graph)}
    end = len(pos) - 1  # the output node: what gradient reductions feed
    eligible = [
        c for c in first_use if (k := _key(c)) is not None and (k[0] == "ag" or first_use[c] == end)
    ]
    done = _fill(eligible, first_use, pos, options)
    # a reduction's step that the next step reads (an FSDP x TP norm weight's reduce-scatter
    # over dp, then its all-reduce over tp): read where that one's bucket is issued
    slot = {m: pos[_slot(members)] for members in done for m in members}
    chained = {}
    for c in first_use:
        key, readers = _key(c), _readers(next(iter(c.users)))
        if key is None or key[0] == "ag" or len(readers) != 1:
            continue
        (d,) = readers
        if d in slot and _key(d)[0] != "ag":
            chained[c] = slot[d]
    done += _fill(list(chained), chained, pos, options)
    for members in done:
        if len(members) > 1:
            _merge(graph, members)
    _stable_topological(graph)
    _gather_into_fresh(graph)
    return [len(m) for m in done if len(m) > 1]


def _fill(colls: list[fx.Node], first_use: dict, pos: dict, options: CommPlan) -> list[list]:
    """The buckets of `colls` (traced order) by key: a member's result read (or c's input
    made from it) before c closes its bucket (a parameter gather's bucket is issued at its
    first member: never); a reduction's bucket also closes at its bytes' cap."""
    open_: dict[tuple, tuple[list[fx.Node], int, int]] = {}  # key -> members, bytes, index
    done: list[list[fx.Node]] = []
    for c in colls:
        key = _key(c)
        members, held, index = open_.get(key, ([], 0, 0))
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
    return done + [m for m, _, _ in open_.values() if m]


def _slot(members: list[fx.Node]) -> fx.Node:
    """Where a bucket's collective is issued: its first member for a parameter gather
    (whose copy-ins `_hoist_state_inputs` made first), else its last (`_merge`)."""
    key = _key(members[0])
    return members[0] if key is not None and key[0] == "ag" and key[3] else members[-1]


def _sliced(node: fx.Node) -> bool:
    """Whether the output reads `node`'s result through views (a gradient kept as a slice of
    its bucket's result: the whole bucket lives on). A member only copied (ZeRO's flat
    shard in the master dtype, a chunk made contiguous for its storage) leaves its slot
    dead; bucketed beside members kept as slices, that slot would live on with theirs
    (`_key` puts them apart)."""
    return any(u.op == "output" or (u.target in VIEWS | PIECES and _sliced(u)) for u in node.users)


def _readers(node: fx.Node) -> set[fx.Node]:
    """The nodes reading `node` other than by a view or copy of it, or a piece's narrow."""
    out: set[fx.Node] = set()
    for u in node.users:
        out |= _readers(u) if u.op == "call_function" and u.target in UNPACK | PIECES else {u}
    return out


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
    for piece in merge_collective_bucket(graph, members, _slot(members)).values():
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


def _is_start(node: fx.Node) -> bool:
    namespace = getattr(node.target, "namespace", None)
    return namespace in ("_c10d_functional", "c10d_functional") and node.target not in WAITS


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


def _reorder(graph: fx.Graph, order: list[fx.Node]) -> None:
    """Move the nodes into `order` (placeholders stay first: the order keeps them so)."""
    anchor = order[0]
    for n in order[1:]:
        anchor.append(n)
        anchor = n

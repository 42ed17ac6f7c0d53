"""The price of one redistribution between two specs, as lowering runs it.

`reshard_seconds(cluster, src, dst, shape, itemsize)`, `reshard_parts(...)` (its
collectives), `rearrange_seconds(...)` (its local copies, `cost_models.rearrange`) and
`same_spec(src, dst)` (nothing moves). Memoized over (cluster, specs,
shape, item size): a model's ops ask for the same few moves again and again. What a move
runs (its collectives, launches and copies) depends on the specs and the mesh alone: it is
read once per pair of specs (`move_of` -> `Move`) and sized per shape (`Move.seconds`; the
search keeps the `Move` by its specs' numbers, `search.costs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from torch.distributed.tensor import Partial

from autopar.cluster import Cluster
from autopar.cost_models import comm
from autopar.cost_models.compute import compute_time
from autopar.cost_models.memory import shard_splits, split_shape
from autopar.cost_models.rearrange import copied_bytes, copy_plan, source_shape, source_spec


def same_spec(src, dst) -> bool:
    """No redistribution between the specs: equal, or partial on the same axes (lowering keeps
    a Partial of another kind, e.g. the embedding's masked sum, as it is)."""
    return all((a.is_partial() and b.is_partial()) or a == b for a, b in zip(src, dst, strict=True))


@lru_cache(maxsize=200_000)
def reshard_seconds(
    cluster: Cluster, src, dst, shape, itemsize, into_partial=False, via=None
) -> float:
    """Seconds of moving a value of `shape` from spec `src` to `dst` as lowering does
    (`comm.redistribute_time`, plus one link latency per collective for its launch, plus
    the local copies around them, `rearrange_seconds`); inf
    where lowering cannot (a re-split strided shard; into a Partial, but from Replicate
    where `into_partial`: see `_kept_partial`)."""
    return move_of(cluster, src, dst, into_partial, via).seconds(cluster, shape, itemsize)


@lru_cache(maxsize=200_000)
def rearrange_seconds(
    cluster: Cluster, src, dst, shape, itemsize, into_partial=False, via=None
) -> float:
    """Seconds of the local copies of the move (`rearrange`: DTensor's layout around its
    collectives on dims other than 0, its local chunks), included in `reshard_seconds`;
    0 where it moves nothing or cannot. `via`: the permutation of a transposed value that
    lowering moves as its source (`rearrange.through_source`), whose copies are the
    source's (the collectives are the same)."""
    move = move_of(cluster, src, dst, into_partial, via)
    return 0.0 if move.same else move.copy_seconds(cluster, shape, itemsize)


@lru_cache(maxsize=200_000)
def reshard_parts(cluster: Cluster, src, dst, shape, itemsize, into_partial=False):
    """`comm.redistribute_parts` of the same move: (axis, collective, bytes) per step; ()
    when nothing moves, None where lowering cannot."""
    return move_of(cluster, src, dst, into_partial, None).parts(shape, itemsize)


@dataclass(frozen=True, slots=True)
class Move:
    """What moving a value from one spec to another runs, whatever its shape (`move_of`):
    each collective's (axis, kind, `memory.shard_splits` of the value whole over its axis;
    None where lowering cannot: a pair it does not redistribute, or one DTensor cannot),
    their launches' seconds, and the local copies' `rearrange.copy_plan` (of the source's
    specs where `via`)."""

    same: bool  # nothing moves (`same_spec`)
    steps: tuple | None = ()
    launches: float = 0.0
    copies: tuple = ()
    via: tuple | None = None

    def seconds(self, cluster: Cluster, shape, itemsize) -> float:
        """`reshard_seconds` of a value of `shape` (`cluster`: the one `move_of` read)."""
        if self.steps is None:
            return math.inf
        if self.same:
            return 0.0
        seconds = sum(
            comm.collective_time(kind, nbytes, axis, cluster)
            for axis, kind, nbytes in self.parts(shape, itemsize)
        )
        return seconds + self.launches + self.copy_seconds(cluster, shape, itemsize)

    def parts(self, shape, itemsize) -> tuple | None:
        """(axis, collective, bytes of the value whole over the axis) per collective."""
        if self.steps is None:
            return None
        return tuple(
            (axis, kind, float(math.prod(split_shape(shape, splits)) * itemsize))
            for axis, kind, splits in self.steps
        )

    def copy_seconds(self, cluster: Cluster, shape, itemsize) -> float:
        if not self.copies:
            return 0.0
        if self.via is not None:
            shape = source_shape(shape, self.via)
        moved = copied_bytes(self.copies, shape, itemsize)
        if not moved:
            return 0.0  # each copy reads and writes its bytes, one kernel each
        return compute_time(
            0.0, 2.0 * sum(moved), "float32", cluster, op="memory", kernels=len(moved)
        )


@lru_cache(maxsize=65_536)
def move_of(cluster: Cluster, src: tuple, dst: tuple, into_partial=False, via=None) -> Move:
    """The `Move` of `src -> dst` on `cluster`. Specs only: one answer for every shape
    (the search keeps it per pair of spec numbers, `search.costs`)."""
    src = _kept_partial(src, dst, into_partial)
    if src is None:
        return Move(False, None)  # lowering does not redistribute into this Partial
    if same_spec(src, dst):
        return Move(True)
    mesh = tuple(cluster.mesh_shape)
    moves = comm.redistribute_moves(tuple(src), tuple(dst), mesh)
    steps = launches = None
    if moves is not None:
        steps = tuple((axis, kind, shard_splits(full, mesh)) for axis, kind, full in moves)
        launches = sum(launch(kind, axis, cluster) for axis, kind, _ in moves)
    if via is not None:
        src, dst = source_spec(src, via), source_spec(dst, via)
    copies = copy_plan(tuple(src), tuple(dst), mesh, cluster.backend)
    return Move(False, steps, launches, copies, via)


@lru_cache(maxsize=4096)
def launch(kind, axis: int, cluster: Cluster) -> float:
    """Seconds of one collective's launch and synchronization: one step of its kind (as
    priced, `comm.volume_kind`); read once per (kind, axis, cluster)."""
    moved = comm.volume_kind(comm.Collective(kind), cluster.backend).value
    return cluster.links[axis].latency_of(moved)


def _kept_partial(src, dst, into_partial):
    """`src` with the axes where lowering moves no data set to `dst`'s placement, or None
    where it cannot go into `dst`'s Partials. A Partial into a Partial of another kind (the
    embedding's masked sum) is kept as it is. A Replicate goes into a sum or an average
    only where `into_partial` (a Linear's bias, `addmm`'s first input: a row-parallel
    Linear adds it once to the partial sums before their all-reduce) and the value is partial on
    no axis: `passes.lower._ReplicateToPartial` keeps it on the axis's first rank and
    zeros elsewhere (or everywhere for an average), and its gradient comes back
    Replicate; a value partial on another axis would need its gradient redistributed
    into a Partial, which DTensor refuses."""
    out, whole = [], not any(a.is_partial() for a in src)
    for a, b in zip(src, dst, strict=True):
        if b.is_partial() and not a.is_partial():
            if not (into_partial and whole and a.is_replicate() and type(b) is Partial):
                return None
            if b.reduce_op not in ("sum", "avg"):
                return None
            a = b
        out.append(b if a.is_partial() and b.is_partial() else a)
    return tuple(out)

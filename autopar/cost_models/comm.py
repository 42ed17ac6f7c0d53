"""Communication cost model: alpha-beta per mesh axis, ring/tree/pairwise collectives.

Collectives (``collective_time``)
---------------------------------
For a collective over mesh axis ``a`` of size ``n`` with link ``(alpha = latency,
beta = bus bandwidth = Link.bandwidth * Link.efficiency)`` and ``B`` = ``nbytes``, the bytes
of the tensor *unsharded over this axis* (the all-reduce input, the all-gather output, the
reduce-scatter input, the all-to-all's global tensor over this axis)::

    all_reduce       min(ring, tree)
      ring          2(n-1) alpha + 2(n-1)/n   * B / beta     (reduce-scatter + all-gather)
      tree     2 ceil(log2 n) alpha + 2       * B / beta     (reduce up, broadcast down a
                                                              binary tree: small messages)
    all_gather       (n-1) alpha +  (n-1)/n   * B / beta     (ring)
    reduce_scatter   (n-1) alpha +  (n-1)/n   * B / beta     (ring)
    all_to_all       (n-1) alpha +  (n-1)/n^2 * B / beta     (pairwise: each device holds B/n
                                                              and sends (n-1)/n of it)

On a process group whose tensors live on the CPU (gloo), DTensor has no all-to-all and runs
``Shard(i) -> Shard(j)`` as an all-gather followed by a local chunk (it logs "CPU process
group does not support alltoall yet"), so there ``all_to_all`` is priced as the all-gather
(``volume_kind``: its factors and its bandwidth).

``alpha`` is the link's latency times the kind's factor (``Link.kind_latency``: a
calibrated gloo's reduce-scatter steps take longer than its all-gather's). ``n == 1`` or
``B == 0`` cost 0. The volume factors are NCCL's "bus bandwidth" conventions,
so ``beta`` is what nccl-tests report as busbw: the link's line rate times the efficiency
the presets take from published nccl-tests runs (or ``autopar calibrate`` measures). As
NCCL's tuner does, an all-reduce takes the cheaper algorithm, so it never costs more than a
reduce-scatter plus an all-gather of the same bytes. ``alpha`` is the per-step (per
message) latency. Point-to-point: ``send_recv_time = alpha + B / beta`` (the "p2p" latency
and bandwidth).

Overlap: what the runtime overlaps (bucketed gradient reductions, prefetched FSDP
gathers: `autopar.passes.comm`) is priced from that schedule in
``autopar.cost_models.buckets``; a collective priced here is its whole time.

Redistribution (``redistribute_time``, ``redistribute_steps``)
--------------------------------------------------------------
A redistribution ``src -> dst`` (one placement per mesh axis) is a sequence of per-axis
steps, ordered exactly as DTensor's default (greedy) planner orders them, so that the cost
predicts what ``DTensor.redistribute`` executes: if ``src`` is sharded, axes are visited
inner to outer (last axis first) and every differing axis is transformed, except that a
target ``Shard(d)`` whose outer axes shard ``d`` differently than the target does (nested
sharding) is first taken to ``Replicate``; then axes are visited outer to inner to finish.
Per step ``cur -> tgt`` on axis ``a``:

    Partial   -> Replicate : all_reduce         Shard(i) -> Replicate : all_gather
    Partial   -> Shard(j)  : reduce_scatter     Shard(i) -> Shard(j)  : all_to_all
    Replicate -> Shard/Partial : local (free)   equal                 : nothing
    Shard -> Partial, Partial(op1) -> Partial(op2) : unsupported by DTensor (cost = inf)

``_MaskPartial`` is a ``Partial`` and is treated as one. The bytes of a step are those of the
tensor as sharded by the *other* axes at that moment (``memory.local_shape`` with axis ``a``
replaced by ``Replicate``), i.e. ``B`` above. DTensor's merging of equal collectives on
adjacent axes into one flattened collective is not modelled (the cost is the same to first
order: same bytes, fewer latency terms).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from functools import lru_cache
from typing import Any

from torch.distributed.tensor import Replicate, Shard

from autopar._compat import StridedShard
from autopar.cluster import Cluster, Link
from autopar.cost_models.memory import local_numel, shard_dim
from autopar.devices import device_for_backend

__all__ = [
    "Collective",
    "collective_time",
    "redistribute_parts",
    "redistribute_plan",
    "redistribute_steps",
    "redistribute_time",
    "ring_factors",
    "send_recv_time",
    "transition_kind",
    "volume_kind",
]


class Collective(str, Enum):
    """Kind of one redistribution step (``LOCAL`` moves no data between devices)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    LOCAL = "local"

    def __str__(self) -> str:
        return self.value


def ring_factors(kind: Collective, n: int) -> tuple[float, float]:
    """(latency steps, volume factor on B) of ``kind``'s ring/pairwise algorithm over ``n``."""
    if kind is Collective.ALL_REDUCE:
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return float(n - 1), (n - 1) / n
    if kind is Collective.ALL_TO_ALL:
        return float(n - 1), (n - 1) / (n * n)
    return 0.0, 0.0


def volume_kind(kind: Collective, backend: str) -> Collective:
    """The collective whose factors price ``kind`` on ``backend``: an all-to-all runs as an
    all-gather (plus a local chunk) on CPU process groups (module docstring)."""
    if kind is Collective.ALL_TO_ALL and device_for_backend(backend) == "cpu":
        return Collective.ALL_GATHER
    return kind


def collective_time(
    kind: Collective | str, nbytes: float, axis: int | str, cluster: Cluster
) -> float:
    """Seconds for collective ``kind`` on ``nbytes`` (unsharded over ``axis``) along ``axis``."""
    terms = _algorithm_terms(kind, axis, cluster)
    if not terms or nbytes <= 0:
        return 0.0
    return min(latency + volume * float(nbytes) / beta for latency, volume, beta in terms)


@lru_cache(maxsize=4096)
def _algorithm_terms(kind, axis, cluster: Cluster) -> tuple[tuple[float, float, float], ...]:
    """(seconds of latency, volume factor, bytes/s) of each algorithm of ``kind`` along
    ``axis`` (`algorithm_factors`); () where it moves nothing (one rank, a local step).
    Read once per (kind, axis, cluster): the search prices collectives by the million."""
    try:
        kind = Collective(kind)
    except ValueError:
        kinds = [k.value for k in Collective]
        raise ValueError(f"unknown collective {kind!r}; expected one of {kinds}") from None
    n = cluster.axis_size(axis)
    if n == 1 or kind is Collective.LOCAL:
        return ()
    link = cluster.link(axis)
    moved = volume_kind(kind, cluster.backend).value
    beta, alpha = link.kind_bandwidth(moved), link.latency_of(moved)
    return tuple(
        (steps * alpha, volume, beta)
        for steps, volume in algorithm_factors(kind, n, cluster.backend)
    )


def algorithm_factors(kind: Collective, n: int, backend: str) -> tuple[tuple[float, float], ...]:
    """(latency steps, volume factor on B) of each algorithm `collective_time` prices
    ``kind`` with over ``n`` ranks (it takes the cheapest): the ring/pairwise one, and for
    an all-reduce a tree too."""
    ring = ring_factors(volume_kind(kind, backend), n)
    if kind is not Collective.ALL_REDUCE:
        return (ring,)
    return ring, (2.0 * math.ceil(math.log2(n)), 2.0)


def send_recv_time(nbytes: float, link: Link) -> float:
    """Seconds for one point-to-point transfer of ``nbytes`` over ``link`` (0 bytes: free)."""
    if nbytes <= 0:
        return 0.0
    return link.latency_of("p2p") + float(nbytes) / link.kind_bandwidth("p2p")


def transition_kind(cur: Any, tgt: Any) -> Collective | None:
    """Step kind of one axis going ``cur -> tgt`` (``None``: unsupported by DTensor)."""
    if cur == tgt:
        return Collective.LOCAL
    cur_dim, tgt_dim = shard_dim(cur), shard_dim(tgt)
    if tgt.is_replicate():
        return Collective.ALL_REDUCE if cur.is_partial() else Collective.ALL_GATHER
    if tgt_dim is not None:
        if cur.is_replicate():
            return Collective.LOCAL
        if cur.is_partial():
            # A _StridedShard target is reached by reduce-then-slice.
            return Collective.REDUCE_SCATTER if isinstance(tgt, Shard) else Collective.ALL_REDUCE
        plain = isinstance(cur, Shard) and isinstance(tgt, Shard)
        return Collective.ALL_TO_ALL if plain and cur_dim != tgt_dim else Collective.ALL_GATHER
    # Target is a Partial: only Replicate -> Partial exists.
    return Collective.LOCAL if cur.is_replicate() else None


def redistribute_plan(
    src: Sequence[Any], dst: Sequence[Any], mesh_shape: Sequence[int] | None
) -> list[tuple[int, tuple[Any, ...], Any, Any]]:
    """DTensor's greedy step order: ``(axis, spec before the step, cur, tgt)`` per step
    (memoized: a move's collectives and its copies read the same walk)."""
    mesh = tuple(mesh_shape) if mesh_shape is not None else None
    return list(_planned(tuple(src), tuple(dst), mesh))


@lru_cache(maxsize=65_536)
def _planned(src: tuple, dst: tuple, mesh_shape: tuple[int, ...] | None) -> tuple:
    if len(src) != len(dst):
        raise ValueError(f"src {tuple(src)} and dst {tuple(dst)} have different mesh ranks")
    if mesh_shape is not None and len(mesh_shape) != len(src):
        raise ValueError(f"spec {tuple(src)} does not match mesh {tuple(mesh_shape)}")
    cur, tgt = list(src), list(dst)
    steps: list[tuple[int, tuple[Any, ...], Any, Any]] = []

    def step(axis: int, to: Any) -> None:
        if cur[axis] != to:
            steps.append((axis, tuple(cur), cur[axis], to))
            cur[axis] = to

    sizes = mesh_shape if mesh_shape is not None else [2] * len(src)
    sharded = math.prod(n for p, n in zip(src, sizes, strict=True) if shard_dim(p) is not None) > 1
    if len(src) > 1 and sharded:
        for axis in reversed(range(len(cur))):
            to = tgt[axis]
            if isinstance(to, Shard):
                d = to.dim
                before_cur = [i for i in range(axis) if cur[i].is_shard(d)]
                before_tgt = [i for i in range(axis) if tgt[i].is_shard(d)]
                if before_cur != before_tgt:  # nested sharding misaligned: unshard first
                    to = Replicate()
            step(axis, to)
    for axis in range(len(cur)):
        step(axis, tgt[axis])
    return tuple(steps)


def strided_reachable(src: Sequence[Any], dst: Sequence[Any]) -> bool:
    """A ``_StridedShard`` target is reached only from a spec holding its axis replicated
    or partial and splitting its dim on no other axis: DTensor's redistribution of nested
    or re-split strided layouts fails inside it (found by the fsdp x tp parity case)."""
    for axis, tgt in enumerate(dst):
        if isinstance(tgt, StridedShard) and src[axis] != tgt:
            if shard_dim(src[axis]) is not None or any(shard_dim(p) == tgt.dim for p in src):
                return False
    return True


def redistribute_steps(
    src: Sequence[Any],
    dst: Sequence[Any],
    mesh_shape: Sequence[int] | None = None,
    *,
    include_local: bool = False,
) -> list[tuple[int, Collective]]:
    """``(axis, kind)`` per step of ``src -> dst`` in execution order (see module docstring).

    Free local steps are left out unless ``include_local``. ``mesh_shape`` only matters for
    the order when ``src`` shards solely over size-1 axes (DTensor then skips the inner pass).
    Raises ``ValueError`` for transitions DTensor cannot perform (Shard -> Partial, ...).
    """
    if not strided_reachable(src, dst):
        raise ValueError(f"autopar does not redistribute {tuple(src)} -> {tuple(dst)}")
    out = []
    for axis, _, cur, tgt in redistribute_plan(src, dst, mesh_shape):
        kind = transition_kind(cur, tgt)
        if kind is None:
            raise ValueError(f"DTensor cannot redistribute {cur} -> {tgt} (mesh axis {axis})")
        if include_local or kind is not Collective.LOCAL:
            out.append((axis, kind))
    return out


def redistribute_parts(
    src: Sequence[Any],
    dst: Sequence[Any],
    shape: Sequence[int],
    itemsize: int,
    cluster: Cluster,
) -> list[tuple[int, Collective, float]] | None:
    """``(axis, kind, B bytes)`` per collective of ``src -> dst`` in execution order (free
    local steps left out); ``None`` when DTensor cannot perform the transition."""
    moves = redistribute_moves(tuple(src), tuple(dst), tuple(cluster.mesh_shape))
    if moves is None:
        return None
    mesh = cluster.mesh_shape
    return [
        (axis, kind, float(local_numel(shape, full, mesh) * itemsize)) for axis, kind, full in moves
    ]


@lru_cache(maxsize=65_536)
def redistribute_moves(
    src: tuple, dst: tuple, mesh_shape: tuple[int, ...]
) -> tuple[tuple[int, Collective, tuple], ...] | None:
    """``(axis, kind, spec)`` per collective of ``src -> dst`` in execution order, ``spec``
    the placements the collective's whole value has (the step's axis replicated: the bytes
    it moves are that spec's local shard); ``None`` when DTensor cannot perform it. What a
    redistribution does depends on the specs and the mesh, not on the tensor: one answer
    for every shape (`redistribute_parts` sizes it)."""
    if not strided_reachable(src, dst):
        return None
    out = []
    for axis, before, cur, tgt in redistribute_plan(src, dst, mesh_shape):
        kind = transition_kind(cur, tgt)
        if kind is None:
            return None
        if kind is not Collective.LOCAL and mesh_shape[axis] > 1:  # DTensor skips an axis of 1
            full_over_axis = list(before)
            full_over_axis[axis] = Replicate()
            out.append((axis, kind, tuple(full_over_axis)))
    return tuple(out)


def redistribute_time(
    src: Sequence[Any],
    dst: Sequence[Any],
    shape: Sequence[int],
    itemsize: int,
    cluster: Cluster,
) -> float:
    """Seconds to redistribute a global ``shape`` tensor from ``src`` to ``dst`` on ``cluster``.

    Returns ``math.inf`` when DTensor cannot perform the transition (callers forbid the pair).
    """
    parts = redistribute_parts(src, dst, shape, itemsize, cluster)
    if parts is None:
        return math.inf
    return sum(collective_time(kind, nbytes, axis, cluster) for axis, kind, nbytes in parts)

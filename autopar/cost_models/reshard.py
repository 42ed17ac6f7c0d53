"""The price of one redistribution between two specs, as lowering runs it.

`reshard_seconds(cluster, src, dst, shape, itemsize)`, `reshard_parts(...)` (its
collectives) and `same_spec(src, dst)` (nothing moves). Memoized over (cluster, specs,
shape, item size): a model's ops ask for the same few moves again and again.
"""

from __future__ import annotations

import math
from functools import lru_cache

from autopar.cluster import Cluster
from autopar.cost_models import comm


def same_spec(src, dst) -> bool:
    """No redistribution between the specs: equal, or partial on the same axes (lowering keeps
    a Partial of another kind, e.g. the embedding's masked sum, as it is)."""
    return all((a.is_partial() and b.is_partial()) or a == b for a, b in zip(src, dst, strict=True))


@lru_cache(maxsize=200_000)
def reshard_seconds(cluster: Cluster, src, dst, shape, itemsize) -> float:
    """Seconds of moving a value of `shape` from spec `src` to `dst` as lowering does
    (`comm.redistribute_time`, plus one link latency per collective for its launch); inf
    where DTensor cannot (into a Partial, a re-split strided shard)."""
    if same_spec(src, dst):
        return 0.0
    if any(b.is_partial() and not a.is_partial() for a, b in zip(src, dst, strict=True)):
        return math.inf  # DTensor does not redistribute into Partial: forbidden pair
    # a Partial of another kind (the embedding's masked sum) is kept as it is by lowering
    src = tuple(
        b if a.is_partial() and b.is_partial() else a for a, b in zip(src, dst, strict=True)
    )
    seconds = comm.redistribute_time(src, dst, shape, itemsize, cluster)
    if math.isinf(seconds):
        return seconds  # a transition DTensor cannot perform (a re-split strided shard)
    launches = sum(
        cluster.links[axis].latency
        for axis, _ in comm.redistribute_steps(src, dst, cluster.mesh_shape)
    )
    return seconds + launches


@lru_cache(maxsize=200_000)
def reshard_parts(cluster: Cluster, src, dst, shape, itemsize):
    """`comm.redistribute_parts` of the same move: (axis, collective, bytes) per step; ()
    when nothing moves, None where DTensor cannot."""
    if same_spec(src, dst):
        return ()
    if any(b.is_partial() and not a.is_partial() for a, b in zip(src, dst, strict=True)):
        return None
    src = tuple(
        b if a.is_partial() and b.is_partial() else a for a, b in zip(src, dst, strict=True)
    )
    parts = comm.redistribute_parts(src, dst, shape, itemsize, cluster)
    return None if parts is None else tuple(parts)

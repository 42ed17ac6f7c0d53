"""Bucketed collectives and their overlap with compute, priced as `autopar.passes.comm` runs them.

Bucket assignment (``bucket_plan``): DDP's ``_compute_bucket_assignment_by_size``. Sizes (bytes)
in the order the gradients become ready (backward order); a bucket closes once it holds at
least its cap (``first_bucket_bytes`` = 1 MiB for the first, ``bucket_bytes`` = 25 MiB after).
The runtime pass (`passes.comm`) imports this function, so the search and the program form
the same buckets. One bucket per key (process group, reduce op, dtype).

Price of a bucket (``bucket_times``): one collective on the bucket's total bytes ``B``::

    t(bucket) = collective_time(kind, B, axis) + launch(axis)
              = steps * alpha + volume * B / beta + alpha          (ring; see `comm`)

so the bandwidth term is per byte as before and the latency terms (ring steps x alpha plus
one launch/synchronization alpha, the term `search.costs` adds per collective) are paid once
per bucket, never per tensor. Hence a bucketed reduction's collectives never cost more than
one collective per tensor (``bucketed_time <= sum of per-tensor times``); its copies in and
out of the flat buffer (below) are the price of that.

ILP: a linear program cannot count buckets; `search.costs` prices each gradient reduction
as its own collective, waited at once, an upper bound on the bucketed, overlapped price
(``bucket_times`` never sums above it). ``latency_terms`` is the size-independent part of one
collective.

Fused collectives (``fused_time``): one collective per key on the summed bytes, plus one
launch. A layer's FSDP all-gathers (one per layer and phase), and a pipeline rank's gradients:
a rank reduces its gradients once per step, after its
last backward, one flat buffer per key: ``collective_time(kind, sum B) + alpha`` per key,
waited in full.

Copies (``copy_time``, ``fused_copies``): a collective of two or more tensors runs on a flat
buffer, and the bytes go in and out of it on the device, at its memory-bound rate, beside
the compute (not under the collective): a reduction's inputs are concatenated (``B`` read
and written; its results are views of the buffer, as a pipeline's `GradientSync` leaves them
too unless it reduced in another dtype and casts the sums back: ``B`` again), an
all-gather's local shards are copied in (``B / n``) and each member copied out of the
``(ranks, total)`` result (``B``). One tensor alone is not copied. On an H100 the copies of
a reduction take ~1/5 of its all-reduce over NVLink (HBM at ~3 TB/s against ~370 GB/s of bus
bandwidth) and a few % of one across nodes; on a CPU, whose memory-bound ops run at a few
GB/s per process, they were most of what FSDP's step measured beyond dp's. (Megatron-Core's
contiguous gradient buffers avoid the copy in too: the backward writes the gradients into
the buffer; the runtime does not.)

Exposure (``serial_exposure``): one serial communication channel. Bucket ``k`` starts at
``max(ready_k, done_{k-1})`` (``ready_k``: its last gradient's ready time) and takes ``t_k``;
the step waits for ``max(0, done_last - end)`` after the backward ends at ``end``.

Overlap efficiency (``DeviceSpec.overlap_efficiency``, ``e``): of the communication the
schedule hides under compute, the device hides the share ``e``; ``(1 - e)`` of it still adds
to the step (1: NCCL on its own SMs, the GPU presets'; CPU processes sharing cores with
gloo's threads, measured by ``autopar calibrate``, hide little).

FSDP prefetch (``prefetch_exposure``): one all-gather per layer and phase; gather ``L+1`` is
issued when gather ``L``'s wait runs and overlaps layer ``L``'s compute, so it shows
``max(0, g_{L+1} - c_L)``; the forward's first gather (the first part that gathers at all)
shows in full.

Step (``overlapped_step``), per phase with layers in execution order: forward compute +
forward gather exposure + backward compute + backward re-gathers + gradient exposure +
``exposed_comm`` (TP activation collectives, loss reductions: waited at once). A backward
re-gather (reshard after forward, full recompute) is waited in full: the pass prefetches
the forward's gathers only and leaves a backward one just before its first reader
(`passes.comm._schedule`).
Gradient readiness is approximated from the layer order: a layer's gradients are ready when
its backward compute ends (backward runs the layers in reverse).

The program's options (`plan.CommPlan`, what `passes.comm` runs): the bucket caps are
``bucket_bytes`` / ``first_bucket_bytes``; ``bucket=False`` runs one collective per tensor
(gradients and gathers alike: ``collective_times``); ``overlap=False`` waits every
collective at once (exposure = the sum of their times). With neither, the step is the ILP's
price of the same collectives (``search.costs``: one per tensor, waited at once).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from autopar.cluster import Cluster
from autopar.cost_models.comm import Collective, collective_time, ring_factors, volume_kind
from autopar.cost_models.compute import compute_time
from autopar.cost_models.reshard import launch
from autopar.plan import DEFAULT_COMM, CommPlan

MIB = 1024 * 1024
BUCKET_BYTES = 25 * MIB
FIRST_BUCKET_BYTES = 1 * MIB

__all__ = [
    "BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "bucket_plan",
    "bucket_times",
    "collective_times",
    "copy_time",
    "fused_copies",
    "fused_time",
    "latency_terms",
    "overlapped_step",
    "prefetch_exposure",
    "serial_exposure",
]

# one gradient tensor as the step prediction sees it: (key, kind, mesh axis, bytes); the key
# (group, reduce op, dtype) decides which tensors may share a bucket
Grad = tuple[Hashable, Collective, int, float]


def bucket_plan(
    sizes: Sequence[float],
    bucket_bytes: float = BUCKET_BYTES,
    first_bucket_bytes: float = FIRST_BUCKET_BYTES,
) -> list[list[int]]:
    """Indices of `sizes` (bytes, in ready order) per bucket: a bucket closes once it holds at
    least its cap (`first_bucket_bytes` for the first, `bucket_bytes` after), as DDP's
    `_compute_bucket_assignment_by_size` does."""
    buckets: list[list[int]] = [[]]
    held = 0.0
    for i, size in enumerate(sizes):
        buckets[-1].append(i)
        held += size
        if held >= (first_bucket_bytes if len(buckets) == 1 else bucket_bytes):
            buckets.append([])
            held = 0.0
    return [b for b in buckets if b]


def latency_terms(kind: Collective | str, axis: int, cluster: Cluster) -> float:
    """Seconds one collective pays whatever its size: ring steps x alpha plus one launch
    (the ring's, an upper bound on the tree's for an all-reduce)."""
    kind = Collective(kind)
    n = cluster.axis_size(axis)
    if n == 1 or kind is Collective.LOCAL:
        return 0.0
    moved = volume_kind(kind, cluster.backend)
    steps, _ = ring_factors(moved, n)
    return (steps + 1.0) * cluster.links[axis].latency_of(moved.value)


def bucket_times(
    kind: Collective | str,
    sizes: Sequence[float],
    axis: int,
    cluster: Cluster,
    bucket_bytes: float = BUCKET_BYTES,
    first_bucket_bytes: float = FIRST_BUCKET_BYTES,
) -> list[float]:
    """Seconds of each bucket's collective, `sizes` in ready order (module doc)."""
    out = []
    for bucket in bucket_plan(sizes, bucket_bytes, first_bucket_bytes):
        total = sum(sizes[i] for i in bucket)
        t = collective_time(kind, total, axis, cluster)
        out.append(t + launch(kind, axis, cluster) if t > 0 else 0.0)
    return out


def copy_time(
    kind: Collective | str, nbytes: float, axis: int, cluster: Cluster, back: bool = False
) -> float:
    """Seconds of copying one fused buffer of ``nbytes`` (unsharded over ``axis``) in and out
    (module doc); ``back``: a reduction's result cast back into its members too (a
    pipeline stage's `GradientSync` and `GradientScatter` where they reduce in another
    dtype than the gradients; else the members are the result's slices)."""
    n = cluster.axis_size(axis)
    if n == 1 or nbytes <= 0:
        return 0.0
    kind = Collective(kind)
    moved = nbytes / n + nbytes if kind is Collective.ALL_GATHER else nbytes
    if back and kind is not Collective.ALL_GATHER:  # the result: whole, or a 1/n shard
        moved += nbytes / n if kind is Collective.REDUCE_SCATTER else nbytes
    return compute_time(0.0, 2.0 * moved, "float32", cluster, op="memory")


def fused_copies(grads: Sequence[Grad], cluster: Cluster, back: bool = False) -> float:
    """Seconds of the copies of `fused_time`'s buffers: one per key of two or more tensors."""
    total: dict[tuple, list[float]] = {}
    for key, kind, axis, nbytes in grads:
        total.setdefault((key, Collective(kind), axis), []).append(nbytes)
    return sum(
        copy_time(kind, sum(sizes), axis, cluster, back)
        for (_, kind, axis), sizes in total.items()
        if len(sizes) > 1
    )


def collective_times(grads: Sequence[Grad], cluster: Cluster, fused: bool = True) -> float:
    """Seconds of `grads` waited at once: one collective per key (`fused_time`), or with
    `fused=False` one per tensor (bandwidth and latency terms each)."""
    if fused:
        return fused_time(grads, cluster)
    return sum(fused_time([g], cluster) for g in grads)


def fused_time(grads: Sequence[Grad], cluster: Cluster) -> float:
    """Seconds of `grads` run as one collective (flat buffer) per key: bandwidth on the
    summed bytes, latency terms once per buffer. A pipeline rank's gradient sync after its
    last backward, and a layer's fused FSDP all-gather."""
    total: dict[tuple, float] = {}
    for key, kind, axis, nbytes in grads:
        k = (key, Collective(kind), axis)
        total[k] = total.get(k, 0.0) + nbytes
    return sum(
        collective_time(kind, b, axis, cluster) + launch(kind, axis, cluster)
        for (_, kind, axis), b in total.items()
        if collective_time(kind, b, axis, cluster) > 0
    )


def serial_exposure(ready: Sequence[float], durations: Sequence[float], end: float) -> float:
    """Seconds the step waits after `end` for collectives issued at `ready` (one channel,
    in issue order) lasting `durations`."""
    assert len(ready) == len(durations)
    done = float("-inf")
    for r, t in sorted(zip(ready, durations, strict=True), key=lambda p: p[0]):
        done = max(r, done) + t
    return max(0.0, done - end) if ready else 0.0


def prefetch_exposure(gathers: Sequence[float], computes: Sequence[float]) -> float:
    """Exposed seconds of one gather per layer (execution order, 0: none), each prefetched
    under the previous layer's compute; the first non-zero one is waited in full."""
    assert len(gathers) == len(computes)
    first = next((i for i, g in enumerate(gathers) if g > 0), len(gathers))
    if first == len(gathers):
        return 0.0
    pairs = zip(gathers[first + 1 :], computes[first:-1], strict=True)
    return gathers[first] + sum(max(0.0, g - c) for g, c in pairs)


def overlapped_step(
    forward: Sequence[float],
    backward: Sequence[float],
    gathers: Sequence[float],
    regathers: Sequence[float],
    grads: Sequence[Sequence[Grad]],
    cluster: Cluster,
    exposed_comm: float = 0.0,
    comm: CommPlan | None = DEFAULT_COMM,
    hide: Sequence[float] | None = None,
) -> float:
    """Step seconds of layers (forward order) with the runtime's overlap (module doc).

    `forward`/`backward`: compute per layer; `gathers`/`regathers`: its weight all-gather in
    forward / backward (0: none; fused or not as `comm.bucket` says, `collective_times`);
    `grads`: its gradient reductions; `exposed_comm`: the collectives waited at once;
    `comm`: the program's options (default `plan.DEFAULT_COMM`; None: no pass, nothing overlaps);
    `hide`: per layer, the forward compute the next layer's prefetched gather can hide under
    (default its whole forward; `search.step`: what follows its last activation collective)."""
    comm = CommPlan(bucket=False, overlap=False) if comm is None else comm
    order = list(reversed(range(len(forward))))  # backward order
    bwd = [backward[i] for i in order]
    ready_at, clock = {}, 0.0
    for i, t in zip(order, bwd, strict=True):
        clock += t
        ready_at[i] = clock
    by_key: dict[tuple, list[tuple[float, float]]] = {}
    for i in order:
        for key, kind, axis, nbytes in grads[i]:
            by_key.setdefault((key, Collective(kind), axis), []).append((ready_at[i], nbytes))
    # without bucketing every tensor closes its own bucket (caps below any size)
    caps = (comm.bucket_bytes, comm.first_bucket_bytes) if comm.bucket else (0.0, 0.0)
    ready, durations, copies = [], [], 0.0
    for (_, kind, axis), items in by_key.items():
        sizes = [b for _, b in items]
        for bucket in bucket_plan(sizes, *caps):  # as `bucket_times` prices them
            total = sum(sizes[i] for i in bucket)
            t = collective_time(kind, total, axis, cluster)
            ready.append(items[bucket[-1]][0])
            durations.append(t + launch(kind, axis, cluster) if t > 0 else 0.0)
            if len(bucket) > 1:  # concatenated into its flat buffer (module doc)
                copies += copy_time(kind, total, axis, cluster)
    clock += copies
    if not comm.overlap:
        waited = sum(gathers) + sum(regathers) + sum(durations)
        return sum(forward) + clock + waited + exposed_comm
    grad_wait = serial_exposure(ready, durations, clock)
    fwd_wait = prefetch_exposure(list(gathers), list(forward if hide is None else hide))
    overlap = cluster.device.overlap_efficiency
    if overlap < 1:  # what the schedule hides, the device hides only that share of
        grad_wait += (1 - overlap) * (sum(durations) - grad_wait)
        fwd_wait += (1 - overlap) * (sum(gathers) - fwd_wait)
    # backward re-gathers are issued at their first reader (not prefetched): waited in full
    return sum(forward) + fwd_wait + clock + sum(regathers) + grad_wait + exposed_comm

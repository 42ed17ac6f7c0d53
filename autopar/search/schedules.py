"""Pipeline schedules priced by their timelines, in the order the runtime runs them.

`simulate(schedule, stage_times, microbatches, pp) -> Timeline`; `microbatch_rows` /
`microbatch_groups`: a batch the microbatch count does not divide (uneven microbatches)

Each stage s has forward time f[s] and backward time b[s] per microbatch. Each rank's
actions come in the order torch.distributed.pipelining executes them: for GPipe and 1F1B
the textbook orders (`_orders`: all forwards then all backwards; warm-up,
one-forward-one-backward, cool-down), for the multi-stage schedules the `pipeline_order`
of torch's own schedule object (`torch_order`). `replay` list-schedules those orders under
the dependencies F(s, m) after F(s-1, m) and the backward of (s, m) after F(s, m) and the
backward of (s+1, m), plus `p2p` seconds per crossing between ranks. Durations are what
the runtime runs (`runtime.zero_bubble`): the zero-bubble schedules' input-gradient action
I runs the part of the stage's backward that the input gradients depend on and the
weight-gradient action W the rest, the weight gradients' matmuls (`wgrad` seconds of the
backward `b`: I = b - wgrad, W = wgrad). The first stage's inputs (the batch) take no
gradient, so its I is empty and its W runs its whole backward. A full backward B (the other
schedules, and DualPipeV's overlapped forward+backward, whose two halves torch runs back to
back) runs both at once.
The result: step time, bubble fraction, each rank's end and each stage's last B or W (its
gradients complete: `synced_end` puts its reduction on the rank's channel from there),
and the peak activations a rank holds at once, in microbatches (the in-flight memory
multiplier): a microbatch's forward adds 1, its backward
B subtracts 1; between its I and W a fraction `stash` of it stays (what the W half reads:
the weight matmuls' inputs and output gradients; the first stage keeps all of it).

`weight_gradient_work(ctx, node, strategy) -> (seconds, bytes)`: what one node adds to its
stage's W: a matmul with a weight operand computes its weight gradient there (a matmul as
long as its forward) and holds its activation input and its output's gradient until then
(`weight_gradient_reads`; `search.peak` sizes the same values with the plan's specs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.fx as fx

from autopar._compat import pipeline_order
from autopar.capture.operands import Operand
from autopar.cost_models import compute
from autopar.cost_models.memory import activation_bytes
from autopar.plan import SCHEDULES, V_SHAPED, stage_ranks


@dataclass(frozen=True)
class Timeline:
    step_time: float
    bubble: float  # idle fraction of the busiest rank
    in_flight: tuple[float, ...]  # per rank: peak microbatches of saved activations
    orders: tuple[tuple[tuple[str, int, int], ...], ...]  # per rank: its actions, in order
    ends: tuple[float, ...] = ()  # per rank: when its last action ends, seconds
    # per stage: when its last B or W ends (its gradients complete: the runtime's
    # REDUCE_GRAD action, `runtime.pipeline.GradientSync`)
    grads_done: tuple[float, ...] = ()

    @property
    def rows(self) -> tuple[str, ...]:
        """Text timeline per rank (`F3.7`: stage 3's forward of microbatch 7)."""
        return tuple(" ".join(f"{k}{s}.{i}" for k, s, i in order) for order in self.orders)


def _orders(schedule: str, pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per pipeline rank, its actions ("F"|"B", stage, microbatch) in execution order."""
    ranks = stage_ranks(schedule, pp)
    orders = []
    for rank in range(pp):
        stages = [s for s, r in enumerate(ranks) if r == rank]
        if schedule == "gpipe" or (schedule == "1f1b" and m < pp):
            # 1F1B on fewer microbatches than stages: torch refuses it, the runtime runs
            # GPipe (`runtime.pipeline_model._make_schedule`)
            st = stages[0]
            orders.append([("F", st, i) for i in range(m)] + [("B", st, i) for i in range(m)])
            continue
        # microbatches in rounds of pp, each round through the rank's stages in order
        # (Megatron's interleaving); backward visits the stages in reverse
        fwd = [
            (st, i) for r0 in range(0, m, pp) for st in stages for i in range(r0, min(r0 + pp, m))
        ]
        bwd = [
            (st, i)
            for r0 in range(0, m, pp)
            for st in reversed(stages)
            for i in range(r0, min(r0 + pp, m))
        ]
        warmup = (pp - rank - 1) + (len(stages) - 1) * pp + 1
        if schedule in V_SHAPED:
            warmup = 2 * (pp - rank) - 1
        warmup = min(warmup, len(fwd))
        order = [("F", *a) for a in fwd[:warmup]]
        rest = fwd[warmup:]
        for k, b in enumerate(bwd):
            order.append(("B", *b))
            if k < len(rest):
                order.append(("F", *rest[k]))
        orders.append(order)
    return orders


ZERO_BUBBLE = {"interleavedzb", "zbv", "dualpipev"}

# torch.distributed.pipelining's class for each schedule of the plan's vocabulary (the
# runtime builds these; the multi-stage ones are priced by replaying their own order)
TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "interleavedzb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def weight_gradient_reads(
    n: fx.Node, operands: list[tuple[int, Operand]], is_weight: Callable[[fx.Node], bool]
) -> list[tuple[int, Operand]]:
    """The activation operands (position, operand) that `n`'s weight gradient reads at W:
    those of a matmul reading a weight and an activation; none for every other node."""
    if n.op != "call_function" or compute.training_kernels(n) != 3:
        return []
    acts = [(p, op) for p, op in operands if not is_weight(op.producer)]
    return acts if len(acts) < len(operands) else []


def weight_gradient_work(ctx, n: fx.Node, s) -> tuple[float, float]:
    """(seconds, bytes) node `n` under strategy `s` adds to its stage's W action (module
    docstring), priced with a `search.costs` context: the weight-gradient matmul costs its
    forward, and the activation (as `s` reads it) and the output gradient are held."""
    acts = weight_gradient_reads(n, ctx.operands(n), ctx.is_weight)
    if not acts:
        return 0.0, 0.0
    held = [(op.tensor, s.inputs[pos]) for pos, op in acts] + [(n.meta["val"], s.outputs[0])]
    nbytes = sum(
        activation_bytes(t.shape, t.element_size(), spec, ctx.mesh_shape) for t, spec in held
    )
    return ctx.forward_time(n, s), float(nbytes)


def microbatch_rows(rows: int, microbatches: int) -> tuple[int, ...]:
    """The rows of each microbatch of a batch of `rows`, as `torch.tensor_split` cuts it
    (and torch.distributed.pipelining): exactly `microbatches` pieces, the first
    `rows % microbatches` one row larger (`torch.chunk` could give fewer: 5 rows in 4 are
    2, 2, 1). The largest, `ceil(rows / microbatches)` rows, is the one captured and priced."""
    if not 1 <= microbatches <= rows:
        raise ValueError(
            f"microbatches={microbatches} cannot split a batch of {rows} rows: give a count "
            f"from 1 to {rows}"
        )
    size, extra = divmod(rows, microbatches)
    return (size + 1,) * extra + (size,) * (microbatches - extra)


def microbatch_groups(rows: int, microbatches: int) -> tuple[int, ...]:
    """How many microbatches of each size, largest first: one count when the batch
    divides, else two. The runtime runs each group as one schedule step, one after the
    other (a stage program has one shape), and `simulate` prices them so."""
    sizes = microbatch_rows(rows, microbatches)
    return tuple(sizes.count(n) for n in sorted(set(sizes), reverse=True))


def simulate(
    schedule: str,
    fwd: list[float],
    bwd: list[float],
    microbatches: int | tuple[int, ...],
    pp: int,
    p2p: float | Sequence[float] = 0.0,
    wgrad: list[float] | None = None,
    stash: list[float] | None = None,
    ready: list[float] | None = None,
) -> Timeline:
    """List-schedule the actions; `p2p`: seconds of a crossing between ranks, or per stage
    cut (stage s to s + 1); `fwd`/`bwd`: per stage, seconds per microbatch; `ready`:
    per stage, when its parameters are there (ZeRO's gather; default 0); `wgrad`:
    the part of `bwd` a zero-bubble schedule runs at W (default none); `stash`: the
    fraction of a microbatch's activations held from I to W (default 1). `microbatches`
    may be a tuple of group counts (`microbatch_groups`): each rank runs the groups'
    schedules one after the other, every microbatch priced at the largest one's times."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule '{schedule}'; choose from {sorted(SCHEDULES)}")
    groups = (microbatches,) if isinstance(microbatches, int) else tuple(microbatches)
    orders = _group_orders(schedule, pp, groups)
    ranks = stage_ranks(schedule, pp)
    return replay(orders, fwd, bwd, ranks, p2p, schedule, wgrad, stash, ready)


@functools.lru_cache(maxsize=256)
def _group_orders(schedule: str, pp: int, groups: tuple[int, ...]):
    """Per rank, its actions (kind, stage, microbatch) over the groups' schedules run one
    after the other (the same for every candidate priced with that schedule and count)."""
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(pp)]
    first = 0  # the group's first microbatch index
    for count in groups:
        if SCHEDULES[schedule] == 1:
            group = _orders(schedule, pp, count)
        else:
            group = [[a for step in o for a in step] for o in torch_order(schedule, pp, count)]
        for rank, order in enumerate(group):
            orders[rank] += [(k, s, first + i) for k, s, i in order]
        first += count
    return tuple(tuple(order) for order in orders)


def torch_order(schedule: str, pp: int, microbatches: int) -> list[list[tuple]]:
    """Per rank, the steps torch's schedule object runs (each a tuple of (kind, stage,
    microbatch) actions run back to back; DualPipeV's overlapped forward+backward is one
    step of two). Raises ValueError where torch rejects the microbatch count."""
    try:
        return _torch_order(schedule, pp, microbatches)
    except ValueError as exc:
        raise ValueError(
            f"{schedule} cannot run {microbatches} microbatches on {pp} pipeline ranks "
            f"({exc}): choose another microbatch count or schedule"
        ) from None


@functools.lru_cache(maxsize=256)
def _torch_order(schedule: str, pp: int, microbatches: int) -> list[list[tuple]]:
    ranks = stage_ranks(schedule, pp)
    stages_of = [[s for s, r in enumerate(ranks) if r == rank] for rank in range(pp)]
    return pipeline_order(TORCH_CLASSES[schedule], pp, stages_of, microbatches)


_F, _B, _I, _W = range(4)  # `replay`'s action kinds


def replay(
    orders: list[list[tuple[str, int, int]]],
    fwd: list[float],
    bwd: list[float],
    owner: list[int],
    p2p: float | Sequence[float] = 0.0,
    schedule: str = "",
    wgrad: list[float] | None = None,
    stash: list[float] | None = None,
    ready: list[float] | None = None,
) -> Timeline:
    """Each rank runs its actions in order, each starting once the rank is free and its
    inputs exist (F(s, m) after F(s-1, m); the backward of (s, m) after F(s, m) and the
    backward of (s+1, m); W after I), plus `p2p` per crossing between ranks (or the
    cut's own, per cut). Durations as the runtime runs them (module docstring): F = fwd,
    B = bwd, I = bwd - wgrad, W = wgrad (stage 0: I = 0, W = bwd). A stage's forwards start
    no earlier than its `ready`. Activations are held from F until B, or until I but for
    the `stash` fraction held until W."""
    num, pp = len(fwd), len(orders)
    w = [min(x, b) for x, b in zip(wgrad or [0.0] * num, bwd, strict=True)]
    keep = list(stash or [1.0] * num)
    w[0], keep[0] = bwd[0], 1.0  # the batch takes no gradient: the first stage's I is empty
    cost = {"F": fwd, "B": bwd, "I": [b - x for b, x in zip(bwd, w, strict=True)], "W": w}
    held_by = {"F": [1.0] * num, "B": [-1.0] * num, "I": [k - 1.0 for k in keep]}
    held_by["W"] = [-k for k in keep]
    # when each (stage, microbatch)'s forward and input gradient (B or I) end; None: not yet
    count = 1 + max((i for order in orders for _, _, i in order), default=-1)
    forward = [[None] * count for _ in range(num)]
    gradient = [[None] * count for _ in range(num)]
    # p2p added to a dependency on the stage before / after (another rank's)
    hops = [p2p] * (num - 1) if isinstance(p2p, (int, float)) else list(p2p)  # per cut
    hop_before = [hops[s - 1] if s and owner[s - 1] != owner[s] else 0.0 for s in range(num)]
    hop_after = [hops[s] if s < num - 1 and owner[s + 1] != owner[s] else 0.0 for s in range(num)]
    starts = list(ready) if ready else [0.0] * num
    clock, busy = [0.0] * pp, [0.0] * pp
    held, peak = [0.0] * pp, [0.0] * pp
    grads_done = [0.0] * num
    # per rank, its actions as (kind code, stage, microbatch, seconds, held change): read
    # once, not looked up per visit (the loop below visits an action until it can run)
    code = {"F": _F, "B": _B, "I": _I, "W": _W}
    steps = [[(code[k], s, i, cost[k][s], held_by[k][s]) for k, s, i in order] for order in orders]
    at = [0] * pp
    left = sum(map(len, orders))
    last = num - 1
    while left:
        progressed = False
        for rank in range(pp):
            order, now, n = steps[rank], clock[rank], at[rank]
            size, busy_r, held_r, peak_r = len(order), busy[rank], held[rank], peak[rank]
            while n < size:
                kind, s, i, seconds, change = order[n]
                if kind == _F:  # start = max(now, starts[s], dep + hop_before[s])
                    dep = forward[s - 1][i] if s else 0.0
                    if dep is None:
                        break
                    start, other = now, starts[s]
                    if other > start:
                        start = other
                    other = dep + hop_before[s]
                    if other > start:
                        start = other
                elif kind == _W:  # start = max(now, dep)
                    dep = gradient[s][i]
                    if dep is None:
                        break
                    start = dep if dep > now else now
                else:  # B or I: after this stage's forward and the next stage's gradient
                    dep = forward[s][i]
                    after = gradient[s + 1][i] if s < last else 0.0
                    if dep is None or after is None:
                        break
                    start = dep if dep > now else now
                    other = after + hop_after[s]
                    if other > start:
                        start = other
                now = start + seconds
                busy_r += seconds
                if kind == _F:
                    forward[s][i] = now
                elif kind != _W:
                    gradient[s][i] = now
                if kind == _B or kind == _W:
                    grads_done[s] = now
                held_r += change
                if held_r > peak_r:
                    peak_r = held_r
                n += 1
            if n != at[rank]:
                progressed, left = True, left - (n - at[rank])
                clock[rank], at[rank] = now, n
                busy[rank], held[rank], peak[rank] = busy_r, held_r, peak_r
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks on {pp} ranks")
    total = max(clock)
    bubble = 1.0 - max(busy) / total if total else 0.0
    actions = tuple(tuple(order) for order in orders)
    return Timeline(total, bubble, tuple(peak), actions, tuple(clock), tuple(grads_done))


def synced_end(end: float, done: list[float], syncs: list[float], overlap: float = 1.0) -> float:
    """When a pipeline rank is done: its last action ends at `end`, and each of its stages'
    gradient all-reduce (`syncs`, seconds) goes out when that stage's last backward is done
    (`done`) on the rank's one communication channel, in that order
    (`runtime.pipeline.GradientSync`); the optimizer waits for the last. Of what hides
    under the rank's remaining actions, the share `overlap` does
    (`DeviceSpec.overlap_efficiency`)."""
    channel = 0.0
    for ready, seconds in sorted(zip(done, syncs, strict=True)):
        if seconds:
            channel = max(channel, ready) + seconds
    if overlap >= 1:
        return max(end, channel)
    exposed = max(0.0, channel - end)
    return end + exposed + (1 - overlap) * (sum(syncs) - exposed)


def default_microbatches(rows: int, pp: int) -> int:
    """2*pp microbatches (a small bubble), or the largest divisor of the batch below it;
    when that leaves a stage idle (a prime batch: 5 rows on 2 stages), min(rows, 2*pp)
    uneven ones (`microbatch_rows`: 2, 1, 1, 1)."""
    even = next(m for m in range(min(rows, 2 * pp), 0, -1) if rows % m == 0)
    return even if even >= min(rows, pp) else min(rows, 2 * pp)

"""Pipeline schedules priced by their timelines.

`simulate(schedule, stage_times, microbatches, pp) -> Timeline`

Each stage s has forward time f[s] and backward time b[s] per microbatch (b = input-grad
+ weight-grad; zero-bubble schedules split it as b = bi + bw with bw = b/2). The timeline
is built by list scheduling the schedule's per-rank order of actions (the same orders
torch.distributed.pipelining executes: all forwards then all backwards for GPipe; warm-up,
one-forward-one-backward, cool-down for 1F1B; round-robin over virtual stages for
interleaved; V placement for ZBV/DualPipeV) under the dependencies F(s, m) after F(s-1, m)
and B(s, m) after B(s+1, m) and F(s, m), plus `p2p` seconds per boundary crossing.
The result: step time, bubble fraction, and the peak number of microbatches whose
activations a rank holds at once (the in-flight memory multiplier).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.plan import SCHEDULES, V_SHAPED, stage_ranks


@dataclass(frozen=True, slots=True)
class Timeline:
    step_time: float
    bubble: float  # idle fraction of the busiest rank
    in_flight: tuple[int, ...]  # per rank: peak microbatches with saved activations
    rows: tuple[str, ...]  # text timeline per rank


def _orders(schedule: str, pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per pipeline rank, its actions ("F"|"B", stage, microbatch) in execution order."""
    ranks = stage_ranks(schedule, pp)
    orders = []
    for rank in range(pp):
        stages = [s for s, r in enumerate(ranks) if r == rank]
        if schedule == "gpipe":
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


def simulate(
    schedule: str, fwd: list[float], bwd: list[float], microbatches: int, pp: int, p2p: float = 0.0
) -> Timeline:
    """List-schedule the actions; `fwd`/`bwd`: per stage, seconds per microbatch."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule '{schedule}'; choose from {sorted(SCHEDULES)}")
    if schedule in ZERO_BUBBLE:
        return _greedy(schedule, fwd, bwd, microbatches, pp, p2p)
    num = len(fwd)
    orders = _orders(schedule, pp, microbatches)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    busy = [0.0] * pp
    held, peak = [0] * pp, [0] * pp
    rows = [[] for _ in range(pp)]
    pending = [list(o) for o in orders]
    while any(pending):
        progressed = False
        for rank in range(pp):
            if not pending[rank]:
                continue
            kind, s, i = pending[rank][0]
            deps = _deps(kind, s, i, num)
            if any(d not in done for d in deps):
                continue
            start = max([clock[rank]] + [done[d] + (p2p if d[1] != s else 0.0) for d in deps])
            dur = fwd[s] if kind == "F" else bwd[s]
            done[(kind, s, i)] = clock[rank] = start + dur
            busy[rank] += dur
            held[rank] += 1 if kind == "F" else -1
            peak[rank] = max(peak[rank], held[rank])
            rows[rank].append(f"{kind}{s}.{i}")
            pending[rank].pop(0)
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks for pp={pp}, m={microbatches}")
    total = max(clock)
    bubble = 1.0 - max(busy) / total if total else 0.0
    return Timeline(total, bubble, tuple(peak), tuple(" ".join(r) for r in rows))


def _deps(kind: str, s: int, i: int, num: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    deps = [("F", s, i)]
    if s < num - 1:
        deps.append(("B", s + 1, i))
    return deps


def _greedy(
    schedule: str, fwd: list[float], bwd: list[float], m: int, pp: int, p2p: float
) -> Timeline:
    """Zero-bubble family: backward split into input-grad B (on the critical path) and
    weight-grad W (b/2 each), W deferred to fill idle time. Event-driven list scheduling:
    the globally earliest startable action runs next, B before F before W, at most 2*pp
    microbatches in flight per rank (their activation memory). Per stage, each kind of
    action proceeds in microbatch order, so only the next one of each is a candidate."""
    ranks = stage_ranks(schedule, pp)
    num = len(fwd)
    mine = [[s for s, r in enumerate(ranks) if r == rank] for rank in range(pp)]
    nxt = {(k, s): 0 for s in range(num) for k in "FBW"}
    dur = {"F": fwd, "B": [b / 2 for b in bwd], "W": [b / 2 for b in bwd]}
    done: dict[tuple[str, int, int], float] = {}
    clock, busy = [0.0] * pp, [0.0] * pp
    held, peak = [0] * pp, [0] * pp
    rows: list[list[str]] = [[] for _ in range(pp)]
    for _ in range(3 * num * m):
        best = _pick(mine, nxt, m, done, num, p2p, clock, held, 2 * pp) or _pick(
            mine, nxt, m, done, num, p2p, clock, held, 1 << 30
        )  # the cap would deadlock
        if best is None:
            raise RuntimeError(f"schedule {schedule} deadlocks for pp={pp}, m={m}")
        (start, *_), rank, act = best
        kind, s, i = act
        done[act] = clock[rank] = start + dur[kind][s]
        busy[rank] += dur[kind][s]
        held[rank] += {"F": 1, "B": 0, "W": -1}[kind]
        peak[rank] = max(peak[rank], held[rank])
        rows[rank].append(f"{kind}{s}.{i}")
        nxt[(kind, s)] += 1
    total = max(clock)
    return Timeline(
        total,
        1.0 - max(busy) / total if total else 0.0,
        tuple(peak),
        tuple(" ".join(r) for r in rows),
    )


def _pick(mine, nxt, m, done, num, p2p, clock, held, cap):
    """The globally earliest startable action: ((start, priority...), rank, action)."""
    best = None
    for rank, stages in enumerate(mine):
        for s in stages:
            for kind in "FBW":
                i = nxt[(kind, s)]
                if i >= m:
                    continue
                ready = _ready((kind, s, i), done, num, p2p, clock[rank], held[rank], cap)
                if ready is not None:
                    key = (ready, "BFW".index(kind), i, -s)
                    if best is None or key < best[0]:
                        best = (key, rank, (kind, s, i))
    return best


def _ready(act, done, num: int, p2p: float, clock: float, held: int, cap: int):
    kind, s, i = act
    if kind == "F":
        if held >= cap:
            return None
        deps = [("F", s - 1, i)] if s > 0 else []
    elif kind == "B":
        deps = [("F", s, i)] + ([("B", s + 1, i)] if s < num - 1 else [])
    else:
        deps = [("B", s, i)]
    if any(d not in done for d in deps):
        return None
    return max([clock] + [done[d] + (p2p if d[1] != s else 0.0) for d in deps])

"""How `autopar calibrate` times a call (`autopar.calibration` says what it measures).

`timed(fn, device, reps, group=None)`: the median seconds per call over `reps`
repetitions, each a loop of calls lasting `SUSTAIN_S[mode]` on every rank at once (the same
count everywhere, after `loops_for(mode)`); `timed_in_turns` the same for several calls, one
repetition of each per round; `agree(flag, device)`: the flag on any rank.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MAX_CALLS", "SUSTAIN_S", "agree", "loops_for", "sync", "timed", "timed_in_turns"]

# a timed rep: a loop of calls lasting this long, per size mode (`loops_for` sets it). Where
# processes share cores, loops of 0.05 s measured a 512^2 matmul at 56-62 GF/s per rank
# and loops of 0.25-1 s at 51-54 (4 processes, 2 cores, alternated): a short loop's rate
# gains from the ranks that finish first (their cores go to the others); a training step's
# matmuls of a layer's shapes ran at ~50 there
SUSTAIN_S = {"tiny": 0.05, "quick": 0.25, "gpu": 0.25}
MAX_CALLS = 5000
_loop_s = 0.05


def loops_for(mode: str) -> None:
    """Time this process's loops as size mode ``mode`` asks (`SUSTAIN_S`)."""
    global _loop_s
    _loop_s = SUSTAIN_S[mode]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, reps: int, group=None) -> float:
    """Median seconds per call of ``fn`` after a warm-up, each repetition a loop of calls
    lasting at least ``SUSTAIN_S`` of the mode on every rank at once (the same count everywhere): with
    a ``group`` (a collective) the slowest of its ranks' (it ends when its last rank does),
    else the mean over all ranks: the rate a rank sustains while the others compute too,
    as in training (one call of a few milliseconds may run while another rank waits for a
    core: where processes share cores one call measured up to twice the rate a training
    step gets, and one collective of a few KiB anywhere from 0.5 to 11 ms)."""
    return timed_in_turns([fn], device, reps, group)[0]


def timed_in_turns(fns: list[Callable[[], Any]], device: str, reps: int, group=None) -> list[float]:
    """`_timed` of several calls in turns, one repetition of each per round: a slower
    spell of a shared machine falls on all of them alike, so their ratios (what the
    attention's fit reads) hold where times taken one after the other did not (two
    calibrations minutes apart fitted a key tile of 637 and 228 tokens)."""
    calls = []
    for fn in fns:
        fn()  # warm-up (a collective's first call may set up its connections)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        calls.append(calls_lasting(time.perf_counter() - t0, device))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, n, own in zip(fns, calls, times, strict=True):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync(device)
            own.append((time.perf_counter() - t0) / n)
    t = torch.tensor([statistics.median(own) for own in times], dtype=torch.float64, device=device)
    slowest = group is not None
    dist.all_reduce(t, op=dist.ReduceOp.MAX if slowest else dist.ReduceOp.SUM, group=group)
    return [float(x) / (1 if slowest else dist.get_world_size()) for x in t.tolist()]


def calls_lasting(one_call_s: float, device: str) -> int:
    """Calls of a ``one_call_s`` op that last ``_loop_s``, the same on every rank (the
    fewest any rank asks for)."""
    t = torch.tensor([math.ceil(_loop_s / max(one_call_s, 1e-7))], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(min(max(t.item(), 1), MAX_CALLS))


def agree(flag: bool, device: str) -> bool:
    """``flag`` on any rank (so that every rank runs the same benchmarks)."""
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())

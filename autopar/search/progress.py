"""Where a search spends its time, and what it has found so far.

    with recording(listener) as rec:   # `autopar plan --profile` / `--progress`, the bench
        ... plan ...
    rec.phases   # phase -> seconds (exclusive: a nested phase's time is not its parent's)
    rec.cpu      # phase -> CPU seconds of this process, likewise (a loaded machine's
                 # wall time overstates the work; compare changes by CPU time)

The search marks its phases with `phase(name)` (`PHASES`: capture, strategies, costs, ILP,
layout search, assembly) and reports each priced layout with `candidate(key, seconds)`.
Without a recording both are free no-ops. A `listener(rec, event)` is called on every phase
start and every candidate (event = the phase name or "candidate"): the CLI's progress line.
Single-threaded by design (one search per process at a time); a search's forked processes
(`search.workers`) report their candidates and phases to this one's recording.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from autopar.forked import children_cpu

PHASES = ("capture", "strategies", "costs", "ILP", "layout search", "assembly")


@dataclass
class Recording:
    listener: Callable[[Recording, str], None] | None = None
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    candidates: int = 0
    best: tuple[str, float] | None = None  # (layout key, step seconds)
    last: tuple[str, float | None] | None = None  # the latest candidate (key, step or None)
    current: str = ""
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    started_cpu: float = field(default_factory=time.process_time)
    ended_cpu: float | None = None
    other_cpu: float = 0.0  # CPU seconds of the search's forked processes (`absorb`)
    # and of the `autopar.forked` children whose answers it took (a template's other trace,
    # the three-block check): `children_cpu` at the start and the end
    started_children: float = field(default_factory=children_cpu)
    ended_children: float | None = None
    # [name, start, time in children, CPU start, CPU time in children]
    _stack: list[list] = field(default_factory=list)

    @property
    def total(self) -> float:
        return (self.ended or time.perf_counter()) - self.started

    @property
    def total_cpu(self) -> float:
        ended = children_cpu() if self.ended_children is None else self.ended_children
        children = ended - self.started_children
        return (
            (self.ended_cpu or time.process_time()) - self.started_cpu + self.other_cpu + children
        )

    def _notify(self, event: str) -> None:
        if self.listener is not None:
            self.listener(self, event)


_active: list[Recording] = []


@contextmanager
def recording(listener: Callable[[Recording, str], None] | None = None) -> Iterator[Recording]:
    rec = Recording(listener)
    _active.append(rec)
    try:
        yield rec
    finally:
        rec.ended = time.perf_counter()
        rec.ended_cpu = time.process_time()
        rec.ended_children = children_cpu()
        _active.remove(rec)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Attribute the time of the block to `name` (minus the phases nested in it)."""
    if not _active:
        yield
        return
    rec = _active[-1]
    frame = [name, time.perf_counter(), 0.0, time.process_time(), 0.0]
    rec._stack.append(frame)
    outer = rec.current
    rec.current = name
    rec._notify(name)
    try:
        yield
    finally:
        rec._stack.pop()
        spent = time.perf_counter() - frame[1]
        cpu = time.process_time() - frame[3]
        rec.phases[name] = rec.phases.get(name, 0.0) + spent - frame[2]
        rec.cpu[name] = rec.cpu.get(name, 0.0) + cpu - frame[4]
        if rec._stack:
            rec._stack[-1][2] += spent
            rec._stack[-1][4] += cpu
        rec.current = outer


def candidate(key: str, step_time: float | None) -> None:
    """One layout priced (`step_time` None: it does not fit)."""
    if not _active:
        return
    rec = _active[-1]
    rec.candidates += 1
    rec.last = (key, step_time)
    if step_time is not None and (rec.best is None or step_time < rec.best[1]):
        rec.best = (key, step_time)
    rec._notify("candidate")


def absorb(phases: dict[str, float], cpu: dict[str, float], total_cpu: float) -> None:
    """Add a forked search process's phase times and CPU seconds (`search.workers`) to the
    recording: the phases then sum the work of every process (more than the wall time
    when they ran at once), the total stays this process's wall time."""
    if not _active:
        return
    rec = _active[-1]
    for name, secs in phases.items():
        rec.phases[name] = rec.phases.get(name, 0.0) + secs
    for name, secs in cpu.items():
        rec.cpu[name] = rec.cpu.get(name, 0.0) + secs
    rec.other_cpu += total_cpu


def forget() -> None:
    """In a forked process: the parent's recordings are the parent's to report."""
    _active.clear()


def format_phases(rec: Recording) -> str:
    """One line per phase and the total, seconds; then the CPU seconds of this process and
    of the search's forked ones."""
    rows = [f"  {name:<14} {secs:7.2f} s" for name, secs in rec.phases.items()]
    rows.append(f"  {'total':<14} {rec.total:7.2f} s")
    cpu = ", ".join(f"{name} {rec.cpu.get(name, 0.0):.2f}" for name in rec.phases)
    rows.append(f"  cpu seconds: {cpu}, total {rec.total_cpu:.2f}")
    return "\n".join(rows)

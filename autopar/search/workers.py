"""The layout search's degrees priced on this process and forked ones at once.

    results = price_in_processes(count, price, processes_for(count))

The search's Python (a candidate's strategies, prices, ILP problems and schedules) runs on
one core; HiGHS runs beside it only while a solve does (`search.ahead`). On a machine of
several cores the degrees are shared out: `processes - 1` processes are forked when the
pricing starts; this one takes the degrees from the first in pricing order on (the ones
without a pipeline, whose answer is the bar the others must beat), the forked ones from
the last back (the deepest pipelines on the widest tensor parallelism, where the largest
models find their best), each the next no process has taken, until they meet. Each prices
a degree with `price(i, nxt, bar)`: `nxt` the degree it will take next (what it prepares
ahead), `bar` the best step any process has found so far (`Bar`, read as each layout
starts, lowered as each is priced). A forked process sends what each
degree gave (`price`'s picklable answer) and its progress events (`search.progress`:
candidates, then its phases' times) to this one (a thread here reads each child's pipe as
it comes, so a child never waits on a full pipe), which returns the answers in pricing
order. What a degree gives depends on the bar it was priced under (which layouts were
pruned before their ILP or schedules), so only that, not the winner, depends on how the
processes' work interleaved: a layout pruned under another process's bar has a lower bound
at or above a step some layout reached.

Forking is safe here because it happens before this search solves anything and because
nothing the child runs needs a thread the parent had: `ilp` runs HiGHS with one thread per
problem (a HiGHS task executor with worker threads does not survive a fork: the child's
next solve would wait on them forever), the solver thread of `search.ahead` is forgotten in
the child (`ahead.forget`), and torch runs on one thread there. A forked process that fails
or dies leaves its unreported degrees to this one, which prices them again (a warning names
the failure; an error of the degree itself is then raised here, with its traceback).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import threading
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.devices import local_cores
from autopar.forked import can_fork
from autopar.search import ahead, progress

# fewer degrees than this are priced on one process: forking and capturing the templates
# again on the other side cost more than their pricing saves (a test model's few degrees)
MIN_DEGREES = 8
PROCESSES_ENV = "AUTOPAR_SEARCH_PROCESSES"  # "1": price every degree on this process


class Bar:
    """The best step found so far by any process (shared memory when processes share it)."""

    def __init__(self, shared=None) -> None:
        self._shared = shared
        self._value = math.inf

    @property
    def value(self) -> float:
        return self._shared.value if self._shared is not None else self._value

    def lower(self, step: float) -> None:
        if self._shared is None:
            self._value = min(self._value, step)
            return
        with self._shared.get_lock():
            self._shared.value = min(self._shared.value, step)


def processes_for(degrees: int) -> int:
    """How many processes price `degrees` degrees: one per core where processes can be
    forked and the degrees are `MIN_DEGREES` or more, or as many as
    `AUTOPAR_SEARCH_PROCESSES` asks (at most one per degree)."""
    if not can_fork() or degrees < MIN_DEGREES:
        return 1
    asked = os.environ.get(PROCESSES_ENV)
    return max(1, min(int(asked) if asked else local_cores(), degrees))


@dataclass
class _Child:
    process: multiprocessing.process.BaseProcess
    reader: threading.Thread  # moves what it sends into the inbox (its pipe never fills)
    done: bool = False
    failure: str | None = None


@dataclass
class _Run:
    price: Callable
    ends: object  # shared (first, last) of the degrees no process has taken yet
    bar: Bar
    results: dict[int, object] = field(default_factory=dict)

    def claim(self, from_back: bool) -> int | None:
        """The first (this process) or the last (a forked one) degree not yet taken."""
        with self.ends.get_lock():
            first, last = self.ends[0], self.ends[1]
            if first > last:
                return None
            self.ends[1 if from_back else 0] = last - 1 if from_back else first + 1
        return last if from_back else first

    def walk(self, report: Callable[[int, object], None], from_back: bool) -> None:
        """Take degrees from one end until none is left, each priced and reported."""
        cur = self.claim(from_back)
        while cur is not None:
            nxt = self.claim(from_back)
            report(cur, self.price(cur, nxt, self.bar))
            cur = nxt


def price_in_processes(count: int, price: Callable, processes: int) -> list:
    """`price(i, nxt, bar)` of every degree index `i` in `range(count)`, in that order, on
    `processes` processes (this one and forked ones)."""
    if processes <= 1:
        bar, out = Bar(), []
        for i in range(count):
            out.append(price(i, i + 1 if i + 1 < count else None, bar))
        return out
    ctx = multiprocessing.get_context("fork")
    run = _Run(price, ctx.Array("i", [0, count - 1]), Bar(ctx.Value("d", math.inf)))
    inbox: queue.Queue = queue.Queue()
    children = [_fork(ctx, run, inbox, k) for k in range(processes - 1)]
    try:

        def report(i: int, result: object) -> None:
            run.results[i] = result
            _drain(children, run, inbox, wait=False)

        run.walk(report, from_back=False)
        with progress.phase("waiting"):
            while not all(c.done for c in children):
                _drain(children, run, inbox, wait=True)
    finally:
        for c in children:
            if c.process.is_alive() and not c.done:
                c.process.terminate()
            c.process.join()
            c.reader.join()
    for c in children:
        if c.failure:
            warnings.warn(
                f"a search process failed ({c.failure}); its degrees were priced again here",
                RuntimeWarning,
                stacklevel=2,
            )
    missing = [i for i in range(count) if i not in run.results]
    for i in missing:  # a failed or dead process's degrees
        run.results[i] = price(i, None, run.bar)
    return [run.results[i] for i in range(count)]


def _fork(ctx, run: _Run, inbox: queue.Queue, k: int) -> _Child:
    """Forked process `k`, and the thread here that reads what it sends into `inbox`."""
    parent_end, child_end = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(run, child_end), daemon=True)
    process.start()
    child_end.close()
    reader = threading.Thread(target=_read, args=(parent_end, k, inbox), daemon=True)
    reader.start()
    return _Child(process, reader)


def _read(conn, k: int, inbox: queue.Queue) -> None:
    """Child `k`'s messages into `inbox` as they come, then ("eof",) if it ended unheard."""
    with conn:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                inbox.put((k, ("eof",)))
                return
            inbox.put((k, message))
            if message[0] in ("done", "failed"):
                return


def _child_main(run: _Run, conn) -> None:
    """A forked process: take degrees and send each one's answer, its candidates as they
    are priced, then its phases' times."""
    import torch

    torch.set_num_threads(1)
    ahead.forget()
    progress.forget()

    def relay(rec: progress.Recording, event: str) -> None:
        if event == "candidate":
            conn.send(("candidate", *rec.last))

    try:
        with progress.recording(relay) as rec:
            run.walk(lambda i, result: conn.send(("degree", i, result)), from_back=True)
        conn.send(("done", dict(rec.phases), dict(rec.cpu), rec.total_cpu))
    except BaseException as exc:  # noqa: BLE001 - the parent prices the degree again
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        conn.send(("failed", last))
    finally:
        conn.close()


def _drain(children: list[_Child], run: _Run, inbox: queue.Queue, wait: bool) -> None:
    """Handle what the children sent (waiting up to a moment for a first message when
    `wait`): their candidates to this process's progress, their degrees' answers to `run`."""
    try:
        k, message = inbox.get(timeout=0.1) if wait else inbox.get_nowait()
    except queue.Empty:
        return
    while True:
        c = children[k]
        kind, *rest = message
        if kind == "candidate":
            progress.candidate(*rest)
        elif kind == "degree":
            run.results[rest[0]] = rest[1]
        elif kind == "done":
            progress.absorb(*rest)
            c.done = True
        elif not c.done:  # "failed", or "eof": it died without a word
            c.done, c.failure = True, rest[0] if rest else "it exited unexpectedly"
        try:
            k, message = inbox.get_nowait()
        except queue.Empty:
            return

"""A function run in a forked process while this one goes on, its answer taken later.

    call = Forked.start(fn)     # fn() runs in a child forked now (or later, here);
                                # nice=19: at the lowest priority, on idle cycles
    ...                         # this process works meanwhile
    value = call.result()       # fn's picklable answer (its error raised here)

Planning's last steps are serial: the layout search's processes have ended, and the check
that the whole graph built from the template is the model's (`Template._repeats`, a trace
of three blocks, ~1 s on Llama-3-8B) would run on one core while the other idles. Forked,
it runs beside the final plan's own work. Where this process cannot fork (`can_fork`) or
the child fails, `fn` runs here when the answer is asked for: the same answer, later.
`children_cpu()`: the CPU seconds the children whose answers were taken spent (a search's
recording, `search.progress`, counts them in its total).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch


def can_fork() -> bool:
    """Forked processes behave: on Linux (macOS's system libraries do not survive a fork),
    in a process that has not initialized CUDA (a forked child cannot use it) and may have
    children (a multiprocessing pool's worker is daemonic: it may not)."""
    forks = sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
    daemonic = multiprocessing.current_process().daemon
    return forks and not daemonic and not torch.cuda.is_initialized()


_children_cpu = [0.0]  # CPU seconds of the children whose answers `result` took


def children_cpu() -> float:
    """CPU seconds the forked children of this process spent on the answers taken here."""
    return _children_cpu[0]


class Forked:
    """`fn()` in a forked child (started by `start`), or here when it cannot be."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._conn = None
        self._process = None

    @classmethod
    def start(cls, fn: Callable[[], object], nice: int = 0) -> Forked:
        """`fn` started in a child; `nice` > 0 lowers its scheduling priority by that much
        (19: it runs on the cycles this machine's other work leaves idle)."""
        call = cls(fn)
        if can_fork():
            ctx = multiprocessing.get_context("fork")
            parent_end, child_end = ctx.Pipe(duplex=False)
            args = (fn, child_end, nice)
            call._process = ctx.Process(target=_child, args=args, daemon=True)
            call._process.start()
            child_end.close()
            call._conn = parent_end
        return call

    def result(self) -> object:
        """`fn()`'s answer: the child's, or computed here if there was none or it failed
        (an error of `fn` itself is then raised here, with its traceback)."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                kind, value, cpu = conn.recv()
                _children_cpu[0] += cpu
            except (EOFError, OSError):
                kind, value = "failed", None
            finally:
                conn.close()
                self._process.join()
            if kind == "ok":
                return value
        return self._fn()

    def cancel(self) -> None:
        """The answer is not wanted: the child is stopped."""
        if self._conn is not None:
            self._process.terminate()
            self._process.join()
            self._conn.close()
            self._conn = None


def _child(fn: Callable[[], object], conn, nice: int = 0) -> None:
    torch.set_num_threads(1)  # beside this process's own work
    if nice > 0:
        os.nice(nice)
    start = time.process_time()
    try:
        value = fn()
        conn.send(("ok", value, time.process_time() - start))
    except BaseException:  # noqa: BLE001 - the parent runs fn again and raises its error
        conn.send(("failed", traceback.format_exc(limit=1), time.process_time() - start))
    finally:
        conn.close()

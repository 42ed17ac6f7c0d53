"""Work done ahead: the next candidate's Python work while the solver runs the current one.

    with meanwhile(lambda: prepare(next_candidate)):   # the layout search
        price(candidate)       # its first `solve_intra` runs the work while HiGHS solves

HiGHS solves in C++ without the GIL (`ilp.solve_all` runs it on threads), so on a machine of
two cores the search's own Python (the next candidate's template capture, strategies and
prices) can run beside it, and the next candidate's ILPs start (`start`) as soon as its
problems are built: its `solve_intra` then waits on that solve instead of starting one. What
is prepared ahead is what the candidate's own call would compute with the same arguments
(`intra_op.prepare_intra` keeps it under their key, taken by that call), and the search
decides which candidates to price exactly as it would without it (in order, each with the
bar of those before), so plans do not change: work prepared for a candidate that is then
pruned is only lost time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from autopar.devices import local_cores

_KEPT: dict[Hashable, object] = {}  # key -> prepared work, oldest first
KEPT_AT_MOST = 2  # a candidate prepared ahead, and the one being priced
_MEANWHILE: list[Callable[[], None]] = []
_STARTED: list[Future] = []  # solves started ahead (`start`), oldest first
_SOLVER: ThreadPoolExecutor | None = None


def keep(key: Hashable, value: object) -> None:
    _KEPT[key] = value
    while len(_KEPT) > KEPT_AT_MOST:
        _KEPT.pop(next(iter(_KEPT)))


def take(key: Hashable) -> object | None:
    """The work kept under `key` (once), or None."""
    return _KEPT.pop(key, None)


def kept(key: Hashable) -> bool:
    return key in _KEPT


@contextmanager
def meanwhile(work: Callable[[], None]) -> Iterator[None]:
    """`work` runs (once) while the next solve in this block waits on its solver."""
    _MEANWHILE.append(work)
    try:
        yield
    finally:
        if work in _MEANWHILE:
            _MEANWHILE.remove(work)


def take_meanwhile() -> Callable[[], None] | None:
    """The work to run while a solver runs (once), or None."""
    return _MEANWHILE.pop() if _MEANWHILE else None


def spare_core() -> bool:
    """Whether a solve started ahead can run on a core of its own (two or more cores)."""
    return local_cores() > 1


def start(solve: Callable[..., object], *args: object) -> Future:
    """`solve(*args)` on the thread that solves ahead (one at a time, beside the solver of
    the candidate being priced): the next candidate's ILPs start as soon as its problems
    are built, instead of after the current candidate's finish."""
    global _SOLVER
    if _SOLVER is None:
        _SOLVER = ThreadPoolExecutor(1, thread_name_prefix="autopar-ahead")
    future = _SOLVER.submit(solve, *args)
    _STARTED.append(future)
    return future


def run_safely(work: Callable[[], None]) -> None:
    """Work done ahead for a later call that will do it again if it fails here: its
    error is that call's to raise (with that call's context), not this one's."""
    try:
        work()
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def forget() -> None:
    """In a forked process: the parent's solver thread and what it kept are not here (a
    thread does not survive a fork), so nothing of them is waited on or taken."""
    global _SOLVER
    _SOLVER = None
    _KEPT.clear()
    _MEANWHILE.clear()
    _STARTED.clear()


def clear() -> None:
    """Drop what was kept (a search ends: its captures and prices go with it), after the
    solves started ahead (none runs on after the search)."""
    _KEPT.clear()
    while _STARTED:
        future = _STARTED.pop()
        if not future.cancel():
            future.exception()  # waits; a solve's error is a value (`ilp.solve_all`)

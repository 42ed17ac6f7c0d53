"""Work done ahead: the next candidate's Python work while the solver runs the current one.

    with meanwhile(lambda: prepare(next_candidate)):   # the layout search
        price(candidate)       # its first `solve_intra` runs the work while HiGHS solves

HiGHS solves in C++ without the GIL (`ilp.solve_all` runs it on threads), so on a machine of
two cores the search's own Python (the next candidate's template capture, strategies and
prices) can run beside it. What is prepared ahead is what the candidate's own call would
compute with the same arguments (`intra_op.prepare_intra` keeps it under their key, taken
by that call), and the search decides which candidates to price exactly as it would
without it (in order, each with the bar of those before), so plans do not change: work
prepared for a candidate that is then pruned is only lost time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

_KEPT: dict[Hashable, object] = {}  # key -> prepared work, oldest first
KEPT_AT_MOST = 2  # a candidate prepared ahead, and the one being priced
_MEANWHILE: list[Callable[[], None]] = []


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


def clear() -> None:
    """Drop what was kept (a search ends: its captures and prices go with it)."""
    _KEPT.clear()

"""Measured memory: the peak bytes of live tensor storages on this rank during one step.

`track_memory(state)` is a context manager around a training step. It counts storages, not
processes: the same figure on CPU and GPU, free of allocator caching and of Python's own
heap, which is what the plan's memory prediction describes.

How: a dispatch mode sees every op's outputs. A storage seen for the first time is charged
its bytes to a category and released when its Python object is collected (storages keep
one Python object while alive, so a `weakref.finalize` fires exactly when the memory is
freed; a collective's buffers are released by the backend as soon as the program drops
them, see `_settle`). Tensors alive before the step (parameters, buffers, optimizer
state, gradients of the previous step) are charged to the category the caller names. Each
allocation and free is an event on one clock; the breakdown at the peak is rebuilt from
those events after the step, so tracking costs O(1) per op.

Categories follow the plan's memory terms: parameters, gradients, optimizer_state,
buffers, activations (everything the step computes and does not return as a gradient),
communication (outputs of collectives).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from autopar._compat import TorchDispatchMode, is_collective_op
from autopar.plan import MEMORY_CATEGORIES as CATEGORIES


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Peak live bytes of one step and their breakdown at that moment (this rank)."""

    peak_bytes: int
    breakdown: Mapping[str, int]
    predicted_bytes: float | None = None
    predicted_breakdown: Mapping[str, float] = field(default_factory=dict)

    def with_prediction(self, total: float | None, breakdown: Mapping[str, float]) -> MemoryStats:
        """These measurements beside a plan's prediction (`Plan.predicted_peak_memory`,
        `Plan.predicted_memory`)."""
        return replace(self, predicted_bytes=total, predicted_breakdown=dict(breakdown))

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None without a prediction)."""
        if not self.predicted_bytes:
            return None
        return self.peak_bytes / self.predicted_bytes


@dataclass
class _Storage:
    nbytes: int
    category: str
    born: int
    died: int | None = None


class _LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.clock = 0
        self.live = 0
        self.peak = 0
        self.peak_at = 0
        self.storages: dict[int, _Storage] = {}  # live or last storage per Python id
        self.history: list[_Storage] = []  # every storage seen (ids are reused after a free)

    def charge(self, t: torch.Tensor, category: str) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.storages and self.storages[key].died is None:
            return
        self.clock += 1
        entry = _Storage(storage.nbytes(), category, self.clock)
        self.storages[key] = entry
        self.history.append(entry)
        self.live += storage.nbytes()
        if self.live > self.peak:
            self.peak, self.peak_at = self.live, self.clock
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        entry = self.storages.get(key)
        if entry is None or entry.died is not None:
            return
        self.clock += 1
        entry.died = self.clock
        self.live -= entry.nbytes

    def recategorize(self, t: torch.Tensor, category: str) -> None:
        entry = self.storages.get(id(t.untyped_storage()))
        if entry is not None and entry.died is None:
            entry.category = category

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_collective_op(func):
            _settle(func, args, out)
        category = "communication" if is_collective_op(func) else "activations"
        for t in _tensors(out):
            self.charge(t, category)
        return out

    def breakdown_at_peak(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for entry in self.history:
            alive = entry.born <= self.peak_at and (entry.died is None or entry.died > self.peak_at)
            if alive:
                out[entry.category] = out.get(entry.category, 0) + entry.nbytes
        return out


class MemoryTracker:
    """Handle of a tracked step: charge what existed before, name the gradients after."""

    def __init__(self, mode: _LiveBytes):
        self._mode = mode
        self.stats: MemoryStats | None = None

    def gradients(self, grads: Iterable[torch.Tensor | None]) -> None:
        """The step's outputs that are parameter gradients (charged as activations until
        the step returned them)."""
        self.recategorize(grads, "gradients")

    def recategorize(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Charge live `tensors` made during the step (gradients, optimizer state created by
        the first step) to `category` for the whole of their life."""
        assert category in CATEGORIES, category
        for t in tensors:
            if t is not None:
                self._mode.recategorize(t, category)


@contextmanager
def track_memory(state: Mapping[str, Iterable[torch.Tensor | None]]) -> Iterator[MemoryTracker]:
    """Track the step run inside; `state` maps a category to the tensors alive before it."""
    mode = _LiveBytes()
    for category, tensors in state.items():
        assert category in CATEGORIES, category
        for t in tensors:
            if t is not None:
                mode.charge(t, category)
    tracker = MemoryTracker(mode)
    with mode:
        yield tracker
    tracker.stats = MemoryStats(mode.peak, mode.breakdown_at_peak())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor an optimizer holds for its parameters (exp_avg, exp_avg_sq, step, ...)."""
    if optimizer is None:
        return []
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _settle(func, args: tuple, out: object) -> None:
    """A functional collective's fresh outputs, waited for at once and held by nothing but
    the program: the backend's worker thread keeps its work (and the work's tensors) for a
    moment after completing it, so without this a buffer the program already dropped is
    freed at a random later time. The tracked step waits for that release (bounded);
    the program's own `wait_tensor` then finds the work done. Allocations are unchanged:
    the output exists from the collective's issue to its last reader either way."""
    if func.namespace != "_c10d_functional" or func is _WAIT:
        return
    inputs = {id(t.untyped_storage()) for t in _tensors(args)}
    fresh = [t for t in _tensors(out) if id(t.untyped_storage()) not in inputs]
    for t in fresh:
        _WAIT(t)
    deadline = time.monotonic() + _SETTLE_SECONDS
    while any(t._use_count() > 1 for t in fresh) and time.monotonic() < deadline:
        time.sleep(0)


_WAIT = torch.ops._c10d_functional.wait_tensor.default
_SETTLE_SECONDS = 1.0


def _tensors(out: object) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)

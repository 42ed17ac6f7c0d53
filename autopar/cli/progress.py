"""`autopar plan --progress` / `--profile`: what the search is doing, on stderr.

The progress line (phase, layouts priced, best so far, elapsed) is redrawn in place on
every phase change and every priced layout; it is shown when stderr is a terminal or
with `--progress`, and erased when the search ends. `--profile` prints the per-phase
seconds (`autopar.search.progress.PHASES`) after the plan.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from autopar.search.progress import Recording, format_phases, recording

MIN_INTERVAL_S = 0.1  # redraws at most this often


def progress_line(rec: Recording) -> str:
    best = f"best {rec.best[0]} {rec.best[1]:.3f} s" if rec.best else "best -"
    return (
        f"searching: {rec.current or 'start':<13} {rec.candidates} layouts priced, "
        f"{best}, {rec.total:.1f} s"
    )


def _drawer(stream) -> Callable[[Recording, str], None]:
    last = [0.0]

    def draw(rec: Recording, event: str) -> None:
        now = time.perf_counter()
        if now - last[0] < MIN_INTERVAL_S and event == "candidate":
            return
        last[0] = now
        stream.write("\r\x1b[2K" + progress_line(rec))
        stream.flush()

    return draw


@contextmanager
def search_progress(show: bool | None, profile: bool) -> Iterator[Recording]:
    """Record the search; draw the progress line when `show` (None: stderr is a TTY);
    print the profile to stdout afterwards when `profile`."""
    stream = sys.stderr
    if show is None:
        show = stream.isatty()
    with recording(_drawer(stream) if show else None) as rec:
        try:
            yield rec
        finally:
            if show:
                stream.write("\r\x1b[2K")
                stream.flush()
    if profile:
        print(f"search profile ({rec.candidates} layouts priced):")
        print(format_phases(rec))

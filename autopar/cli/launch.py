"""`autopar run`'s launcher: torchrun (`torch.distributed.run`), its report of a failed rank
cut to one line.

`python -m autopar.cli.launch TORCHRUN_ARGS...` runs torchrun in this process. When a rank
fails, torchrun's agent logs each stopped process and raises `ChildFailedError`, whose
traceback and banner name torch's launcher frames, not the cause. A rank that stopped on an
error of the user's (a model it cannot trace, a pipeline that does not fit) wrote it to
`$AUTOPAR_ERROR_DIR` (`autopar.cli.worker.report`) and `autopar run` prints that; so here
the agent's own logs are off (`LOGLEVEL` CRITICAL unless the user set one) and the
exception becomes the exit code, with one line naming the rank that failed first and how
(an exit code, or a signal: SIGKILL is often the host's out-of-memory killer) where no rank
wrote an error (a crash). The ranks' own output passes through unchanged.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

from autopar.cli.args import ERROR_DIR

_KILLED_BY_AGENT = "SIGTERM"  # what torchrun sends the other ranks once one has failed


def main(argv: Sequence[str] | None = None) -> int:
    quiet = os.environ.setdefault("LOGLEVEL", "CRITICAL")  # read as torchrun's are made
    logging.getLogger("torch.distributed.elastic").setLevel(quiet)  # those made already
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(list(argv) if argv is not None else None)
    except ChildFailedError as exc:
        rank, failure = root_failure(exc.failures)
        folder = os.environ.get(ERROR_DIR)
        if not (folder and any(f.name.startswith("rank") for f in os.scandir(folder))):
            print(f"error: {failure_line(rank, failure.exitcode)}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def root_failure(failures: dict) -> tuple[int, object]:
    """The rank that failed first, not one torchrun stopped after it (SIGTERM)."""
    own = {r: f for r, f in failures.items() if f.signal_name() != _KILLED_BY_AGENT}
    pool = own or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    return rank, pool[rank]


def failure_line(rank: int, exitcode: int) -> str:
    if exitcode >= 0:
        return f"rank {rank} exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    hint = " (the host's out-of-memory killer sends it)" if name == "SIGKILL" else ""
    return f"rank {rank} was killed by {name}{hint}"


if __name__ == "__main__":
    sys.exit(main())

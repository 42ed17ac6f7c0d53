"""Run a function on every rank of a local process group: `on_ranks(world, fn, *args)`.

Spawning 4 ranks cost ~14 s on 2 cores (each imported torch and joined the process group)
before any work ran; kept ranks fork from a server that imported autopar once (~6 s). Inside `kept_ranks()` (the test session opens it in
`tests/conftest.py`), the ranks stay up between calls, one set per (world size, backend):
each call hands them `fn` and its arguments, and whatever a rank process caches (the parity
harness keeps its captured models) serves later calls. Outside it, each call spawns its
ranks and they exit after it.

`fn` must be importable by name (a module-level function) and return JSON-able data; it runs
after the default process group is up. A rank that dies (a native crash) or a call that
outlives `timeout_s` breaks the pool: the call raises naming each rank that died, its
signal and the crashed thread's Python stack (faulthandler's report, kept per rank; a peer
of a crashed rank fails in its next collective, which names nothing), the processes are
killed, and the next call starts a fresh pool.
"""

from __future__ import annotations

import faulthandler
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.devices import free_port, init_rank

JOB_TIMEOUT_S = 1800.0  # one call, all its work
_POOLS: dict[tuple[int, str], RankPool] | None = None  # None: not inside kept_ranks()


def on_ranks(world: int, backend: str, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """`fn(*args)` on each of `world` ranks of `backend`; the results in rank order."""
    if _POOLS is not None:
        return _pool(world, backend).run(fn, args)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(world, free_port(), backend, fn, args, tmp), nprocs=world)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def _spawned(rank: int, world: int, port: int, backend: str, fn, args, out_dir: str) -> None:
    faulthandler.enable()  # a native crash on a rank prints every thread's Python stack
    init_rank(rank, world, port, backend)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(fn(*args)))
    finally:
        dist.destroy_process_group()


def _context():
    """Ranks fork from one server process that has imported torch and autopar once (each
    spawned rank paid ~7 s of CPU for those imports). The server imports nothing that starts
    threads or touches a GPU, so forking from it is safe."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["autopar.testing.parity"])
    return ctx


class RankPool:
    def __init__(self, world: int, backend: str):
        ctx = _context()
        self.world = world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        # each rank's faulthandler report of a native crash, read into the error it causes
        self.crash_dir = Path(tempfile.mkdtemp(prefix="autopar-ranks-"))
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world, port, backend, self.jobs[rank], self.results, self.crash_dir),
                daemon=False,  # a daemon may not start processes (inductor's compile workers)
            )
            for rank in range(world)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float = JOB_TIMEOUT_S):
        for q in self.jobs:
            q.put((fn, args))
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world:
            try:
                rank, result, error = self.results.get(timeout=5.0)
            except queue.Empty:
                timed_out = time.monotonic() > deadline
                if self.alive() and not timed_out:
                    continue
                died, codes = self._died(wait_s=0.0), [_exit_name(p.exitcode) for p in self.procs]
                self.close()
                why = f"timed out after {timeout_s:.0f} s" if timed_out else "a rank died"
                raise RuntimeError(
                    f"{died}the ranks stopped before finishing ({why}; exit codes by rank: "
                    f"{codes}); see their output above"
                ) from None
            if error is not None:
                died = self._died(wait_s=5.0)
                self.close()
                raise RuntimeError(f"{died}rank {rank} failed:\n{error}")
            got[rank] = result
        return [got[r] for r in range(self.world)]

    def _died(self, wait_s: float) -> str:
        """Which ranks died (a native crash), waiting up to `wait_s` for one to: a rank
        whose peer crashed fails in its next collective ("Connection closed by peer"),
        and the crash, not that, is the cause."""
        deadline = time.monotonic() + wait_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        out = ""
        for r, p in enumerate(self.procs):
            if p.exitcode is None:
                continue
            log = self.crash_dir / f"rank{r}.crash"
            text = log.read_text(errors="replace") if log.exists() else ""
            if text.strip():  # every thread's stack, for the record
                print(f"[rank {r}] {text}", file=sys.stderr)
            report = _crash_report(text)
            out += (
                f"rank {r} died ({_exit_name(p.exitcode)}; its native error is in the output above)"
            )
            out += f":\n{report}\n" if report else "\n"
        return out

    def close(self) -> None:
        for q, p in zip(self.jobs, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.crash_dir, ignore_errors=True)


def _exit_name(code: int | None) -> str:
    """A process's exit code in words: the signal that killed it (SIGSEGV, SIGABRT: a native
    crash), else the code ("running": not exited)."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return f"exit code {code}"


def _crash_report(text: str, lines: int = 40) -> str:
    """Of what faulthandler wrote at a rank's native crash, the fatal error and the crashed
    thread's Python stack (its first `lines` lines); "" if it wrote nothing."""
    if not text.strip():
        return ""
    head = text.splitlines()[0]
    current = text[text.find("Current thread") :] if "Current thread" in text else text
    stack = current.split("\n\n")[0]  # up to the list of extension modules
    return "\n".join([head, *stack.splitlines()[:lines]])


def _rank_main(
    rank: int, world: int, port: int, backend: str, jobs, results, crash_dir: Path
) -> None:
    # a native crash on a rank writes every thread's Python stack there (`_crash_report`);
    # faulthandler holds the file open for the process's life
    faulthandler.enable(file=open(crash_dir / f"rank{rank}.crash", "w"))
    parent = os.getppid()  # the fork server, which exits with the process that started it
    try:
        init_rank(rank, world, port, backend)
        while (job := _next_job(jobs, parent)) is not None:
            fn, args = job
            try:
                out = (rank, json.loads(json.dumps(fn(*args))), None)
            except Exception:
                out = (rank, None, traceback.format_exc())
            results.put(out)
    except Exception:
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _next_job(jobs, parent: int):
    """The next (fn, args); None to stop (asked to, or the parent is gone)."""
    while True:
        try:
            return jobs.get(timeout=10.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _pool(world: int, backend: str) -> RankPool:
    assert _POOLS is not None
    pool = _POOLS.get((world, backend))
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[(world, backend)] = RankPool(world, backend)
    return pool


@contextmanager
def kept_ranks() -> Iterator[None]:
    """Within the context, `on_ranks` reuses one pool of ranks per (world size, backend)."""
    global _POOLS
    outer, _POOLS = _POOLS, {}
    try:
        yield
    finally:
        pools, _POOLS = _POOLS, outer
        for pool in pools.values():
            pool.close()

"""Test-wide settings: temp files stay inside the project's build area; Triton interprets
when there is no GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

_BUILD = Path(__file__).resolve().parent.parent / "build" / "tmp"
_BUILD.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("TMPDIR", str(_BUILD))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_BUILD / "inductor"))

# The layout search prices its degrees on one process in tests: the suite's two workers
# already take both cores, where a forked search process only competes for them. The tests
# of `search.workers` ask for two.
os.environ.setdefault("AUTOPAR_SEARCH_PROCESSES", "1")

# Without a GPU, Triton kernels run in the interpreter; it must be chosen before the first
# `import triton` anywhere in the session (see autopar/kernels/_triton.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist with `--dist loadgroup` (the README's test command), every
    multi-process test runs in one worker, so they share its kept ranks and their cached
    results, while the other worker runs the single-process tests on the core the ranks
    leave idle (rank 0 plans while the others wait). Tests marked `own_ranks` share no
    ranks or caches with others, so they balance the two workers instead."""
    for item in items:
        if item.get_closest_marker("multiproc") and not item.get_closest_marker("own_ranks"):
            item.add_marker(pytest.mark.xdist_group("ranks"))


@pytest.fixture(scope="session", autouse=True)
def _kept_parity_ranks():
    """One set of rank processes per world size for every parity run of the session
    (`autopar.testing.rank_pool`): spawning ranks costs more than most cases."""
    from autopar.testing.rank_pool import kept_ranks

    with kept_ranks():
        yield

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

# Without a GPU, Triton kernels run in the interpreter; it must be chosen before the first
# `import triton` anywhere in the session (see autopar/kernels/_triton.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _kept_parity_ranks():
    """One set of rank processes per world size for every parity run of the session
    (`autopar.testing.rank_pool`): spawning ranks costs more than most cases."""
    from autopar.testing.rank_pool import kept_ranks

    with kept_ranks():
        yield

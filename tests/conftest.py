"""Test-wide settings: temp files stay inside the project's build area; Triton interprets
when there is no GPU."""

from __future__ import annotations

import os
from pathlib import Path

import torch

_BUILD = Path(__file__).resolve().parent.parent / "build" / "tmp"
_BUILD.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("TMPDIR", str(_BUILD))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_BUILD / "inductor"))

# Without a GPU, Triton kernels run in the interpreter; it must be chosen before the first
# `import triton` anywhere in the session (see autopar/kernels/_triton.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

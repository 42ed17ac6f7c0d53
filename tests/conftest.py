"""Test-wide settings: temp files stay inside the project's build area."""

from __future__ import annotations

import os
from pathlib import Path

_BUILD = Path(__file__).resolve().parent.parent / "build" / "tmp"
_BUILD.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("TMPDIR", str(_BUILD))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_BUILD / "inductor"))

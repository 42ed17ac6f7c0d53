"""``fusion="inductor"``: each rank's step program (or each pipeline stage's forward and
backward graphs) is handed to ``torch.compile(backend="inductor")``, which fuses it as a
whole (C++ through the host compiler on CPU, Triton on GPU).

The programs are the lowered graphs themselves (local ATen ops and ``_c10d_functional``
collectives, static shapes), so compiling them changes no placement and no collective:
inductor keeps the collectives and fuses the local ops between them. The plan records the
choice as its fusion mode (``Plan.fusion == "inductor"``, no fused regions); the captured
graph itself is not rewritten.

Inductor writes its caches under ``TORCHINDUCTOR_CACHE_DIR``. When the user left it unset
(torch fills in its default, a folder in the system's temp directory, as soon as
``torch._dynamo`` is imported) and autopar runs from a source checkout,
:func:`compile_program` points it at the checkout's ``build/inductor``. A cold compile of
a small GPT step takes tens of seconds on CPU, a warm one a few.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from autopar._compat import default_inductor_cache_dir, make_boxed_func
from autopar.passes.in_place import out_of_place

_CHECKOUT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path | None:
    """The checkout's ``build/inductor``, or None when autopar is not run from a checkout."""
    if not (_CHECKOUT / "pyproject.toml").is_file():
        return None
    return _CHECKOUT / "build" / "inductor"


def compile_program(program: Callable) -> Callable:
    """``torch.compile(program, backend="inductor")``, static shapes, the whole graph.

    Compilation happens on the first call (inductor needs real inputs' metadata); the
    program must not break the graph (lowered programs are plain ATen + collectives);
    its in-place all-reduces are made functional again (`passes.in_place.out_of_place`)."""
    if isinstance(program, torch.fx.GraphModule):
        program = out_of_place(program)
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    unset = current is None or os.path.abspath(current) == default_inductor_cache_dir()
    if unset and (where := cache_dir()) is not None:
        where.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(where)
    return torch.compile(program, backend="inductor", dynamic=False, fullgraph=True)


def aot_compiler(gm: torch.fx.GraphModule, _example_inputs) -> Callable:
    """An AOTAutograd forward/backward compiler that hands the graph to inductor."""
    return make_boxed_func(compile_program(gm))

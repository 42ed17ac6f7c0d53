"""Whether autopar's Triton kernels can run in this process.

Triton kernels run on a CUDA device, or on CPU tensors under Triton's interpreter, which is
selected by ``TRITON_INTERPRET=1`` in the environment *before* ``triton`` is first imported
(``@triton.jit`` reads it at decoration time, and triton's own library functions such as
``tl.sigmoid`` are decorated when triton is imported: setting it later gives a mix that fails
at launch, which :func:`require` reports). The fusion pass swaps graph regions for
kernels only when :func:`available` is true; kernel entry points call :func:`require` so that
a direct call elsewhere fails with a clear message instead of a driver error.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch


def interpreting() -> bool:
    """True when Triton's CPU interpreter is selected (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_consistent() -> bool:
    """False when triton was imported before ``TRITON_INTERPRET=1`` was set."""
    triton = sys.modules.get("triton")
    if triton is None or not interpreting():
        return True
    return type(triton.language.standard.sigmoid).__name__ == "InterpretedFunction"


def available() -> bool:
    """True when Triton is installed and a CUDA device exists or the interpreter is on.

    Under ``TRITON_INTERPRET=1`` it is false if triton was imported before the variable was
    set (the kernels would fail at launch).
    """
    if importlib.util.find_spec("triton") is None:
        return False
    if interpreting():
        return _interpreter_consistent()
    return torch.cuda.is_available()


def require(*tensors: torch.Tensor) -> None:
    """Raise ``RuntimeError`` unless the kernels can run on ``tensors``' device."""
    if not _interpreter_consistent():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported: set it before the first "
            "`import triton` (e.g. at the top of the test module or in the environment)"
        )
    if not available():
        raise RuntimeError(
            "autopar Triton kernels need a CUDA device or TRITON_INTERPRET=1 "
            "(set before triton is imported); use the PyTorch reference instead"
        )
    for t in tensors:
        if t.device.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"autopar Triton kernels got a tensor on {t.device}; they run on CUDA "
                "tensors, or on CPU tensors only under TRITON_INTERPRET=1"
            )

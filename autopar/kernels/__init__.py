"""Triton kernels (forward + backward) registered as ``autopar::*`` custom ops.

Importing this package registers the ops (``torch.ops.autopar``); each forward op is
differentiable through its backward op (``torch.library.register_autograd``), so forward and
backward are one graph node each under make_fx / torch.export / AOT autograd. Kernels run
only when :func:`available` is true.

Fused by :mod:`autopar.passes.fusion` (matched patterns, with sharding rules in
:mod:`autopar.passes.strategies.rules.fused`): ``add_layer_norm``, ``add_rms_norm``,
``bias_gelu``, ``swiglu``, ``linear_cross_entropy``. Available as ops but not yet matched by
the fusion pass: ``rope``, and ``moe_permute`` / ``moe_unpermute``, which the drop-less MoE
region (``samples/_moe_dropless.py``) calls on CUDA: their pattern needs per-expert row
counts, a data-dependent shape that no captured graph holds, so it appears only inside a
region (:mod:`autopar.capture.regions`), never in a graph the fusion pass could match.

The row-wise kernels share their tiling, launch, checks and autograd registration
(:mod:`autopar.kernels._rowwise`).
"""

from autopar.kernels import (
    add_layer_norm,
    add_rms_norm,
    bias_gelu,
    linear_cross_entropy,
    moe_permute,
    rope,
    swiglu,
)
from autopar.kernels._triton import available

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "available",
    "bias_gelu",
    "linear_cross_entropy",
    "moe_permute",
    "rope",
    "swiglu",
]

"""What autopar's row-wise Triton kernels share: row tiling, launch, checks and autograd.

The row-wise kernels (residual LayerNorm/RMSNorm, bias-GELU, SwiGLU) hold only their Triton
code and their op registration; this module does the rest.

Rows. A kernel sees each input as a contiguous ``(n_rows, n_cols)`` matrix: ``n_cols`` is
the last dim, ``n_rows`` the product of the leading dims. A program owns a tile of
``BLOCK_M`` whole rows by ``BLOCK_N = next_power_of_2(n_cols)`` columns (masked beyond
``n_cols``), so a row's reductions never leave the program. ``BLOCK_M`` packs several short
rows into one tile of about ``TILE_ELEMS`` elements (one row when rows are long), which keeps
each program's register footprint bounded on a GPU. Under Triton's CPU interpreter the cost
is per program and per op rather than per element, so tiles there are 16x larger
(``INTERPRETER_TILE_ELEMS``): same masking code, ~8x faster tests.

Launch (:func:`launch`). A row-wise kernel's arguments come in this order::

    *rows, *params, *outputs, *partials, n_rows, n_cols, *scalars, **flags, BLOCK_M, BLOCK_N

``rows`` are tensors shaped like the op's main input, ``params`` per-column tensors of shape
``(n_cols,)`` (weight, bias), ``outputs`` new contiguous tensors with the main input's shape
and dtype. An absent (``None``) row or param is passed as a dummy pointer that the kernel
must not read (a ``HAS_*`` flag tells it). A kernel that also reduces over rows (dweight,
dbias) is persistent: a grid of :func:`reduction_programs` programs strides over the tiles,
accumulates its share in fp32 and writes one row of each ``(programs, n_cols)`` fp32
``partials`` buffer; the launcher sums the partials over programs and casts the sum to the
parameter's dtype. Other kernels get one program per tile.

Autograd (:func:`register_autograd`). Each forward op ``f`` is differentiated by a Python
function ``backward(*grads, *saved) -> one gradient per input of f`` that calls ``f``'s
backward op, so forward and backward are one graph node each under make_fx / torch.export /
AOT autograd. ``saved`` is what ``f``'s registration picks from its inputs and outputs, in
the backward op's argument order (tensors are saved for backward, other values kept as is).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton

from autopar.kernels._triton import interpreting, require

Tensor = torch.Tensor

# Largest last dim a single tile may span (as Liger-Kernel's MAX_FUSED_SIZE).
MAX_BLOCK_N = 65536
TILE_ELEMS = 4096
INTERPRETER_TILE_ELEMS = 65536


@dataclass(frozen=True, slots=True)
class RowTiling:
    """Launch geometry for a ``(n_rows, n_cols)`` row-wise kernel."""

    n_rows: int
    n_cols: int
    block_m: int
    block_n: int
    num_warps: int

    @property
    def n_tiles(self) -> int:
        return triton.cdiv(self.n_rows, self.block_m)


def _num_warps(block_elems: int) -> int:
    if block_elems >= 32768:
        return 32
    if block_elems >= 8192:
        return 16
    if block_elems >= 2048:
        return 8
    return 4


def row_tiling(n_rows: int, n_cols: int) -> RowTiling:
    """Tile sizes for ``n_rows`` rows of ``n_cols`` (``ValueError`` if a row is too long)."""
    block_n = triton.next_power_of_2(max(n_cols, 1))
    if block_n > MAX_BLOCK_N:
        raise ValueError(f"last dim {n_cols} exceeds the fused kernels' limit {MAX_BLOCK_N}")
    tile_elems = INTERPRETER_TILE_ELEMS if interpreting() else TILE_ELEMS
    block_m = max(1, min(triton.next_power_of_2(max(n_rows, 1)), tile_elems // block_n))
    return RowTiling(n_rows, n_cols, block_m, block_n, _num_warps(block_m * block_n))


def reduction_programs(tiling: RowTiling, device: torch.device) -> int:
    """Programs for a persistent backward kernel: one per SM on CUDA, a few otherwise."""
    if device.type == "cuda":
        slots = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        slots = 4
    return max(1, min(tiling.n_tiles, slots))


def as_rows(t: Tensor) -> Tensor:
    """``t`` as a contiguous ``(n_rows, n_cols)`` matrix over its last dim."""
    n_cols = t.shape[-1] if t.dim() else 1
    return t.contiguous().view(-1, n_cols)


def launch(
    kernel: Any,
    rows: Sequence[Tensor | None],
    params: Sequence[Tensor | None] = (),
    *,
    like: Tensor,
    outputs: int = 1,
    reductions: Sequence[torch.dtype] = (),
    scalars: Sequence[float] = (),
    **flags: bool,
) -> tuple[list[Tensor], list[Tensor]]:
    """Run the Triton ``kernel`` over the rows of ``like``; return ``(outs, sums)``.

    ``outs``: ``outputs`` new contiguous tensors with ``like``'s shape and dtype. ``sums``:
    per dtype in ``reductions``, the ``(n_cols,)`` sum over programs of one partials buffer
    the kernel wrote, in that dtype (zeros when there are no rows).
    """
    present = [t for t in rows if t is not None]
    require(*present)
    n_cols = like.shape[-1]
    n_rows = math.prod(like.shape[:-1])
    outs = [torch.empty(like.shape, dtype=like.dtype, device=like.device) for _ in range(outputs)]
    if n_rows * n_cols == 0:
        return outs, [like.new_zeros(n_cols, dtype=d) for d in reductions]
    row_args = [as_rows(t) if t is not None else None for t in rows]
    dummy = next(t for t in row_args if t is not None)
    row_args = [t if t is not None else dummy for t in row_args]
    param_args = [p.contiguous() if p is not None else dummy for p in params]
    t = row_tiling(n_rows, n_cols)
    grid = reduction_programs(t, like.device) if reductions else t.n_tiles
    partials = [
        torch.empty(grid, n_cols, dtype=torch.float32, device=like.device) for _ in reductions
    ]
    kernel[(grid,)](
        *row_args, *param_args, *outs, *partials, n_rows, n_cols, *scalars, **flags,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps,
    )  # fmt: skip
    return outs, [p.sum(0).to(d) for p, d in zip(partials, reductions, strict=True)]


def param_dtype(param: Tensor | None, like: Tensor) -> torch.dtype:
    """dtype of a parameter's gradient: the parameter's, ``like``'s when there is none."""
    return param.dtype if param is not None else like.dtype


def check_rows(op: str, **tensors: Tensor) -> None:
    """``ValueError`` unless the row inputs share shape and dtype and have a last dim."""
    (name0, t0), *rest = tensors.items()
    for name, t in rest:
        if t.shape != t0.shape or t.dtype != t0.dtype:
            raise ValueError(
                f"{op}: {name0} {tuple(t0.shape)}/{t0.dtype} and {name} "
                f"{tuple(t.shape)}/{t.dtype} must match"
            )
    if t0.dim() == 0:
        raise ValueError(f"{op} needs at least one dim, got a 0-dim {name0}")


def check_params(op: str, n_cols: int, **params: Tensor | None) -> None:
    """``ValueError`` unless each given per-column parameter has shape ``(n_cols,)``."""
    for name, p in params.items():
        if p is not None and tuple(p.shape) != (n_cols,):
            raise ValueError(f"{op}: {name} shape {tuple(p.shape)} != ({n_cols},)")


def register_autograd(
    op: Any,
    backward: Callable[..., tuple[Tensor | None, ...]],
    save: Callable[[tuple[Any, ...], Any], tuple[Any, ...]],
    *,
    unused_grads_as_none: bool = False,
) -> None:
    """Differentiate the custom op ``op`` by ``backward(*grads, *save(inputs, output))``.

    ``backward`` returns one gradient per input of ``op``; the gradient of an input that is
    ``None`` or not a tensor is dropped. With ``unused_grads_as_none`` the gradient of an
    output read nowhere arrives as ``None`` rather than as zeros (``set_materialize_grads``):
    a final norm's sum is read nowhere else, and materialized zeros would be a plain tensor
    beside DTensors (and a wasted load in the kernel).
    """

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        saved = save(inputs, output)
        ctx.is_tensor = [isinstance(a, Tensor) or a is None for a in saved]
        ctx.save_for_backward(*(a for a, t in zip(saved, ctx.is_tensor, strict=True) if t))
        ctx.constants = [a for a, t in zip(saved, ctx.is_tensor, strict=True) if not t]
        ctx.differentiable = [isinstance(a, Tensor) for a in inputs]
        ctx.set_materialize_grads(not unused_grads_as_none)

    def backward_fn(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        tensors, constants = iter(ctx.saved_tensors), iter(ctx.constants)
        saved = [next(tensors) if t else next(constants) for t in ctx.is_tensor]
        grad_inputs = backward(*grads, *saved)
        return tuple(g if d else None for g, d in zip(grad_inputs, ctx.differentiable, strict=True))

    op.register_autograd(backward_fn, setup_context=setup_context)

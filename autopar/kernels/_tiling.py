"""Row tiling shared by autopar's row-wise Triton kernels (norms, bias-GELU, SwiGLU).

Every kernel here sees its input as a contiguous ``(n_rows, n_cols)`` matrix: ``n_cols`` is
the last dim, ``n_rows`` the product of the leading dims. A program owns a tile of
``BLOCK_M`` whole rows by ``BLOCK_N = next_power_of_2(n_cols)`` columns (masked beyond
``n_cols``), so a row's reductions never leave the program. ``BLOCK_M`` packs several short
rows into one tile of about ``TILE_ELEMS`` elements (one row when rows are long), which keeps
each program's register footprint bounded on a GPU. Under Triton's CPU interpreter the cost
is per program and per op rather than per element, so tiles there are 16x larger
(``INTERPRETER_TILE_ELEMS``): same masking code, ~8x faster tests.

Backward kernels that also reduce over rows (dweight, dbias) are persistent: a grid of
``reduction_programs`` programs strides over the tiles, accumulates its share in fp32, and
writes one partial row; the launcher sums the ``(programs, n_cols)`` partials with torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from autopar.kernels._triton import interpreting

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


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous ``(n_rows, n_cols)`` matrix over its last dim."""
    n_cols = t.shape[-1] if t.dim() else 1
    return t.contiguous().view(-1, n_cols)

"""The local copies a redistribution makes around its collectives, as DTensor runs them.

`rearranged_bytes(src, dst, shape, itemsize, mesh_shape, backend) -> (bytes per copy, ...)`

A collective moves a contiguous buffer along dim 0. DTensor's steps on another dim lay the
data out around it (`torch._utils._maybe_view_chunk_cat`, `_chunk_or_narrow_cat`, its
`Shard` and `_StridedShard` placements), and the lowered programs run those copies
(a Llama tp step on 4 CPU processes: ~80 `cat`s, ~15% of its time). Per step `cur -> tgt`
on a mesh axis of `n` ranks, `B` the bytes of the value whole over that axis (the
collective's, `comm.redistribute_parts`), the value's local shape before the step `x`:

    Shard(d) -> Replicate   all-gather along dim 0, then the chunks re-cat along d: B
                            copied unless d == 0 or x's dims before d are all 1 (a view)
    _StridedShard -> Replicate   all-gather, then an index_select of the whole: B
    Partial -> Shard(d)     the input's chunks along d cat along dim 0 first: B (d > 0)
    Shard(a) -> Shard(b)    (gloo: an all-gather along a, as above, then the chunk along b
                            made contiguous: B / n unless the gathered dims before b are
                            all 1; NCCL's all-to-all lays its input out by b and its output
                            back by a: B / n each, where those dims are not leading)
    Replicate -> Shard(d)   the local chunk is cloned: B / n

(checked against DTensor's own traces on a fake process group: tests/test_rearrange.py).
A copy reads and writes its bytes at the device's memory-bound rate
(`compute.compute_time`, op "memory"), one kernel each.

A transposed value (a Linear's `t(weight)` under FSDP: split on dim 1 where the weight is
split on dim 0) is gathered as its source where that spares the re-join (`through_source`,
the decision `passes.lower` takes): its copies, and its gradient's, are the source's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar._compat import StridedShard
from autopar.cost_models.comm import (
    Collective,
    redistribute_plan,
    strided_reachable,
    transition_kind,
)
from autopar.cost_models.memory import shard_dim, shard_splits, split_shape
from autopar.devices import device_for_backend


def rearranged_bytes(
    src: Sequence[Any],
    dst: Sequence[Any],
    shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    backend: str,
) -> tuple[float, ...]:
    """Bytes of each local copy `src -> dst` makes (module docstring); () where it makes
    none or DTensor cannot perform the move."""
    return copied_bytes(
        copy_plan(tuple(src), tuple(dst), tuple(mesh_shape), backend), shape, itemsize
    )


def copied_bytes(plan: tuple, shape: Sequence[int], itemsize: int) -> tuple[float, ...]:
    """`rearranged_bytes` of a value of `shape` by its move's `copy_plan`."""
    out = []
    for rule, before, after, n, dims, cpu in plan:
        whole = math.prod(split_shape(shape, after)) * itemsize
        if rule == "scatter":
            out.append(whole)
        elif rule == "chunk":
            out.append(whole / n)
        elif rule == "gather":
            if dims[0] is None or _inner(dims[0], split_shape(shape, before)):
                out.append(whole)
        else:  # all_to_all
            x, gathered = split_shape(shape, before), split_shape(shape, after)
            out += _all_to_all(dims, whole, n, x, gathered, cpu)
    return tuple(float(b) for b in out if b > 0)


def _all_to_all(dims, whole, n, x, gathered, cpu: bool) -> list[float]:
    """`x`, `gathered`: the local shapes before the step and whole over its axis."""
    a, b = dims
    if cpu:  # gloo: an all-gather along a, a chunk along b
        return [whole] * _strided_or_inner(a, x) + [whole / n] * _inner(b, gathered)
    return [whole / n for d, s in ((b, x), (a, gathered)) if _inner(d, s)]


def _inner(d: int, shape: Sequence[int]) -> bool:
    """Chunks along dim `d` of a contiguous tensor of `shape` are not contiguous (a copy
    moves them): some dim before `d` holds more than one element."""
    return math.prod(shape[: d % len(shape)]) > 1 if shape else False


def _strided_or_inner(d, shape: Sequence[int]) -> bool:
    return d is None or _inner(d, shape)


@lru_cache(maxsize=65_536)
def copy_plan(src: tuple, dst: tuple, mesh_shape: tuple[int, ...], backend: str) -> tuple:
    """(rule, splits before, splits whole over the axis, the axis's size, dims, on a CPU
    group) per step that may copy, each spec as its `memory.shard_splits`: "gather"
    (dims: the gathered dim, None for a strided shard), "scatter", "chunk" (a local
    Replicate -> Shard) and "all_to_all" (dims: from, to). Specs only: one answer for
    every shape (`copied_bytes` sizes it)."""
    if not strided_reachable(src, dst):
        return ()
    cpu = device_for_backend(backend) == "cpu"
    out = []
    for axis, before, cur, tgt in redistribute_plan(src, dst, mesh_shape):
        kind = transition_kind(cur, tgt)
        if kind is None or mesh_shape[axis] == 1:
            continue
        whole = list(before)
        whole[axis] = Replicate()
        d_cur, d_tgt = shard_dim(cur), shard_dim(tgt)
        if kind is Collective.ALL_GATHER:
            dim = None if isinstance(cur, StridedShard) else d_cur
            if dim == 0:  # along dim 0: the collective's own layout, never a copy
                continue
            rule, dims = "gather", (dim,)
        elif kind is Collective.REDUCE_SCATTER and d_tgt:
            rule, dims = "scatter", (d_tgt,)
        elif kind is Collective.ALL_TO_ALL:
            rule, dims = "all_to_all", (d_cur, d_tgt)
        elif kind is Collective.LOCAL and cur.is_replicate() and d_tgt is not None:
            rule, dims = "chunk", (d_tgt,)
        else:
            continue
        splits = shard_splits(before, mesh_shape), shard_splits(whole, mesh_shape)
        out.append((rule, *splits, mesh_shape[axis], dims, cpu))
    return tuple(out)


def transposed_dims(target, args: Sequence, ndim: int) -> list[int] | None:
    """Output dim i = input dim `dims[i]` of a transposing op `target(*args)` on an input
    of `ndim` dims (None for any other op)."""
    aten = torch.ops.aten
    if target is aten.permute.default:
        return [d % len(args[1]) for d in args[1]]
    if target is aten.t.default and ndim == 2:
        return [1, 0]
    if target is aten.transpose.int:
        a, b = args[1] % ndim, args[2] % ndim
        dims = list(range(ndim))
        dims[a], dims[b] = b, a
        return dims
    return None


def through_source(placements: Sequence, want: Sequence, dims: Sequence[int], source=None):
    """The spec to move the source of a transposed value to (then transposed: the value at
    `want`), or None where the value itself is moved. The source is gathered instead where
    every move gathers a shard of an inner dim that is the source's dim 0 (read in place,
    no re-join, the gradient reduce-scattered along dim 0 and reaching the weight in its
    own layout), its placements are plain and split distinct dims. Another axis may split
    the source too (FSDP x TP's weights: the tp-split dim stays split); without this the
    gradient of such a weight came out transposed in memory, and the optimizer's
    elementwise update ran ~10x slower on it (mlp:medium fsdp x tp on 4 gloo ranks: 395 ->
    260 ms a step). `source`: the source's placements (default: `placements` through
    `dims`, as a transpose maps them)."""
    source = tuple(source) if source is not None else source_spec(placements, dims)
    moves = [(p, w) for p, w in zip(placements, want, strict=True) if p != w]
    inner = all(
        type(p) is Shard and p.dim != 0 and dims[p.dim] == 0 and w == Replicate() for p, w in moves
    )
    plain = all(type(p) in (Shard, Replicate) for p in source)
    split = [p.dim for p in source if type(p) is Shard]
    if not (moves and inner and plain) or len(set(split)) != len(split):
        return None  # (nested splits of one dim: DTensor orders them, strided shards)
    return source_spec(want, dims)


def source_spec(placements: Sequence, dims: Sequence[int]) -> tuple:
    """A transposed value's spec as its source's (a shard of value dim d is one of source
    dim `dims[d]`)."""
    return tuple(Shard(dims[p.dim]) if type(p) is Shard else p for p in placements)


def source_shape(shape: Sequence[int], dims: Sequence[int]) -> tuple[int, ...]:
    out = [0] * len(shape)
    for i, d in enumerate(dims):
        out[d] = shape[i]
    return tuple(out)

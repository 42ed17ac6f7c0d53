"""A pipeline rank's once-per-step gradient reduction (`runtime.stage_grads`) on real ranks:
each (axes, dtype) group of two or more gradients goes through one flat buffer, whose
slices the gradients then are; a group's lone contiguous gradient is reduced in its own
storage, no copy in or back (as `cost_models.buckets.fused_copies` prices both)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate

from autopar.devices import process_group_device
from autopar.runtime.stage_grads import GradientScatter, GradientSync
from autopar.testing.parity import test_backend
from autopar.testing.rank_pool import on_ranks

WORLD = 2
# (shape, dtype) of each parameter; float32 alone in its group, float64 two of them
PARAMS = [((3, 4), torch.float32), ((5,), torch.float64), ((2, 3), torch.float64)]


def _stage(device: str, rank: int) -> SimpleNamespace:
    shards = []
    for i, (shape, dtype) in enumerate(PARAMS):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        p.grad = _grad(i, rank, device)
        shards.append(p)
    return SimpleNamespace(
        shards=shards,
        grad_placements={i: (Partial(),) for i in range(len(PARAMS))},
        reduce_dtype=None,
        stage=SimpleNamespace(index=0, params=[f"p{i}" for i in range(len(PARAMS))]),
        _specs=[(Replicate(),)] * len(PARAMS),
    )


def _grad(i: int, rank: int, device: str) -> torch.Tensor:
    shape, dtype = PARAMS[i]
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=dtype, device=device) * (i + 1) + rank).reshape(shape)


def _expected(i: int, device: str) -> torch.Tensor:
    return sum(_grad(i, r, device) for r in range(WORLD))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _reduce(kind: str) -> dict:
    device = process_group_device()
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh(device, (WORLD,), mesh_dim_names=("dp",))
    stage = _stage(device, rank)
    sync = (
        GradientSync([stage], mesh) if kind == "sync" else GradientScatter([stage], mesh, None, [])
    )
    sync.armed = True
    sync.launch(stage)
    # what each collective in flight reads: the flat buffer (sync) or the rows (scatter)
    buffers = [entry[1] if kind == "sync" else entry[2] for entry in sync._pending]
    read_in_place = [any(_storage(b) == _storage(p.grad) for b in buffers) for p in stage.shards]
    sync.wait()
    report = {"read_in_place": read_in_place, "late": sync.late}
    if kind == "sync":
        equal = [torch.equal(p.grad, _expected(i, device)) for i, p in enumerate(stage.shards)]
        # after the wait: which gradients are slices of which buffer
        held = [[_storage(b) == _storage(p.grad) for b in buffers] for p in stage.shards]
        return {**report, "equal": equal, "held_in": held}
    out = []
    for i in range(len(PARAMS)):  # the rank's chunk of the padded flat sum
        flat = _expected(i, device).reshape(-1)
        w = -(-flat.numel() // WORLD)
        want = torch.nn.functional.pad(flat, (0, w * WORLD - flat.numel()))[rank * w : rank * w + w]
        out.append(torch.equal(sync.shards[0, i], want))
    return {**report, "equal": out}


@pytest.mark.multiproc
def test_gradient_sync_reduces_a_lone_gradient_in_its_own_storage() -> None:
    for rank in on_ranks(WORLD, test_backend(WORLD), _reduce, "sync"):
        assert rank["equal"] == [True, True, True] and rank["late"] == 0, rank
        # the float32 gradient alone in its group: reduced where it lies; the float64
        # pair: summed in a flat buffer of their own, whose slices they then are (no copy
        # back, DDP's gradient_as_bucket_view)
        assert rank["read_in_place"] == [True, False, False], rank
        assert rank["held_in"] == [[True, False], [False, True], [False, True]], rank


@pytest.mark.multiproc
def test_gradient_scatter_hands_each_rank_its_flat_shard() -> None:
    # p0 (12 elements) is scattered from its own storage; the float64 pair, 5 and 6
    # elements, padded to 3 + 3 columns, through one zero-padded buffer
    for rank in on_ranks(WORLD, test_backend(WORLD), _reduce, "scatter"):
        assert rank["equal"] == [True, True, True] and rank["late"] == 0, rank
        assert rank["read_in_place"] == [True, False, False], rank

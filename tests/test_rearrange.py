"""The local copies priced around a redistribution's collectives (`cost_models.rearrange`)
are the copies DTensor's redistribution runs: traced on a fake process group of 4 ranks,
the bytes of its `cat`, `clone` and `index_select` nodes (the data's dtype: a strided
shard's index arithmetic aside) equal `rearranged_bytes`, copy for copy."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autopar._compat import FakeStore, StridedShard
from autopar.cluster import Cluster
from autopar.cost_models.memory import local_shape
from autopar.cost_models.rearrange import rearranged_bytes, through_source
from autopar.cost_models.reshard import rearrange_seconds, reshard_seconds

aten = torch.ops.aten
COPIES = {aten.cat.default, aten.clone.default, aten.index_select.default}
R, P = Replicate(), Partial()

# (mesh, src, dst, global shape)
CASES = {
    "gather dim 0": ((4,), (Shard(0),), (R,), (8, 8)),
    "gather dim 1": ((4,), (Shard(1),), (R,), (8, 8)),
    "gather dim 1 behind a dim of 1": ((4,), (Shard(1),), (R,), (1, 8, 8)),
    "gather dim 2": ((4,), (Shard(2),), (R,), (2, 3, 8)),
    "reduce-scatter to dim 0": ((4,), (P,), (Shard(0),), (8, 8)),
    "reduce-scatter to dim 1": ((4,), (P,), (Shard(1),), (8, 8)),
    "all-reduce": ((4,), (P,), (R,), (8, 8)),
    "local chunk": ((4,), (R,), (Shard(1),), (8, 8)),
    "dim 0 to dim 1": ((4,), (Shard(0),), (Shard(1),), (8, 8)),
    "dim 1 to dim 0": ((4,), (Shard(1),), (Shard(0),), (8, 8)),
    "2-D gather": ((2, 2), (Shard(0), Shard(1)), (R, R), (8, 8)),
    "2-D inner gather": ((2, 2), (Shard(1), Shard(0)), (R, Shard(0)), (8, 8)),
    "strided gather": ((2, 2), (R, StridedShard(0, split_factor=2)), (R, R), (8, 4)),
}


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def _traced_copies(mesh_shape, src, dst, shape) -> list[float]:
    mesh = init_device_mesh("cpu", mesh_shape)

    def move(x):
        return DTensor.from_local(x, mesh, src, run_check=False).redistribute(mesh, dst).to_local()

    local = torch.randn(local_shape(shape, src, mesh_shape))
    gm = make_fx(move, tracing_mode="fake")(local)
    return sorted(
        float(n.meta["val"].numel() * n.meta["val"].element_size())
        for n in gm.graph.nodes
        if n.target in COPIES and n.meta["val"].dtype == local.dtype
    )


@pytest.mark.parametrize("case", CASES)
def test_the_priced_copies_are_those_dtensor_runs(fake_world, case: str) -> None:
    mesh_shape, src, dst, shape = CASES[case]
    priced = rearranged_bytes(src, dst, shape, 4, mesh_shape, "gloo")
    assert sorted(priced) == _traced_copies(mesh_shape, src, dst, shape)


def test_a_move_with_copies_costs_them_on_top_of_its_collective() -> None:
    """`reshard_seconds` holds `rearrange_seconds`: a gather along dim 1 costs what the
    same bytes along dim 0 cost plus its copy; more bytes copy longer; nothing moved or a
    view copies nothing."""
    cluster = Cluster.preset("cpu", mesh=(4,))
    along_0 = reshard_seconds(cluster, (Shard(0),), (R,), (64, 64), 4)
    along_1 = reshard_seconds(cluster, (Shard(1),), (R,), (64, 64), 4)
    copy = rearrange_seconds(cluster, (Shard(1),), (R,), (64, 64), 4)
    assert copy > 0 and along_1 == pytest.approx(along_0 + copy)
    assert rearrange_seconds(cluster, (Shard(1),), (R,), (64, 128), 4) > copy
    assert rearrange_seconds(cluster, (Shard(0),), (R,), (64, 64), 4) == 0.0
    assert rearrange_seconds(cluster, (Shard(1),), (Shard(1),), (64, 64), 4) == 0.0
    assert rearrange_seconds(cluster, (Shard(1),), (R,), (1, 64, 64), 4) == 0.0


def test_a_transposed_weight_moved_as_its_source_copies_nothing() -> None:
    """A Linear's `t(weight)` under FSDP is split on dim 1 where the weight is split on
    dim 0: lowering gathers the weight and transposes (`passes.lower`, the shared
    `through_source`), so neither the gather nor its gradient's reduce-scatter copies."""
    cluster = Cluster.preset("cpu", mesh=(4,))
    shape, flip = (64, 128), (1, 0)
    assert through_source((Shard(1),), (R,), flip) == (R,)
    assert rearrange_seconds(cluster, (Shard(1),), (R,), shape, 4, via=flip) == 0.0
    assert rearrange_seconds(cluster, (P,), (Shard(1),), shape, 4, via=flip) == 0.0
    assert rearrange_seconds(cluster, (Shard(1),), (R,), shape, 4) > 0.0  # moved itself
    plain = reshard_seconds(cluster, (Shard(1),), (R,), shape, 4)
    via = reshard_seconds(cluster, (Shard(1),), (R,), shape, 4, via=flip)
    assert via == pytest.approx(plain - rearrange_seconds(cluster, (Shard(1),), (R,), shape, 4))
    # where another axis splits the source's other dim (FSDP x TP), that split stays
    assert through_source((Shard(1), Shard(0)), (R, Shard(0)), flip) == (R, Shard(1))
    # both axes splitting the gathered dim (nested: DTensor orders them): moved itself
    assert through_source((Shard(1), Shard(1)), (R, Shard(1)), flip) is None

"""Any device: the device and backend come from the process group, never from a constant.

Checked on the CPU: which backend N local processes get (NCCL only with a GPU each, with a
clear error otherwise), which device a backend runs on, which preset `Cluster.local` prices
a GPU with, that under a live gloo group `Cluster.local` and `device_mesh` give the CPU
(whatever machine the cluster describes) and is built once per process, that local shards land on the mesh's device,
that a plan splitting attention on the sequence is refused off the CPU (its kernels'
handlers exist for the CPU flash kernels only), that a CPU process keeps its freed host
memory (`cache_host_memory`),
and that `autopar run --backend` and the test harness follow the same choice. The NCCL
runs themselves are `test_parity.py`'s `multigpu` test.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from typer.testing import CliRunner

from autopar.cli import app
from autopar.cli.worker import parse_args
from autopar.cluster import Cluster
from autopar.devices import (
    bind_local_device,
    choose_backend,
    device_for_backend,
    local_preset,
    process_group_device,
)
from autopar.passes.lower import check_context_parallel_runs
from autopar.runtime.shards import local_chunk, mesh_device
from autopar.testing.parity import test_backend as harness_backend


@pytest.fixture
def gloo_group(tmp_path):
    """A real one-rank gloo process group in this process, torn down after."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    yield
    dist.destroy_process_group()


def test_backend_device() -> None:
    assert device_for_backend("nccl") == "cuda"
    assert device_for_backend("gloo") == "cpu"
    assert device_for_backend("cpu:gloo,cuda:nccl") == "cuda"


def test_choose_backend() -> None:
    assert choose_backend(None, 4, gpus=0) == "gloo"
    assert choose_backend(None, 4, gpus=2) == "gloo"  # not a GPU for every process
    assert choose_backend(None, 4, gpus=4) == "nccl"
    assert choose_backend(None, 2, gpus=8) == "nccl"
    assert choose_backend("gloo", 4, gpus=8) == "gloo"
    assert choose_backend("NCCL", 2, gpus=2) == "nccl"
    with pytest.raises(ValueError, match="nccl needs one GPU per process: 4 processes but 2"):
        choose_backend("nccl", 4, gpus=2)
    with pytest.raises(ValueError, match="unknown backend 'mpi'; choose from gloo, nccl"):
        choose_backend("mpi", 2, gpus=2)


def test_harness_backend_follows_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("AUTOPAR_TEST_BACKEND", raising=False)
    assert harness_backend(4, gpus=0) == "gloo"
    assert harness_backend(4, gpus=4) == "nccl"
    monkeypatch.setenv("AUTOPAR_TEST_BACKEND", "gloo")
    assert harness_backend(4, gpus=4) == "gloo"
    monkeypatch.setenv("AUTOPAR_TEST_BACKEND", "nccl")
    assert harness_backend(4, gpus=4) == "nccl"
    with pytest.raises(ValueError, match="one GPU per process"):
        harness_backend(4, gpus=1)


def test_local_preset_follows_the_gpu() -> None:
    assert local_preset("cpu") == "cpu"
    assert local_preset("cuda", "NVIDIA H100 80GB HBM3") == "dgx-h100"
    assert local_preset("cuda", "NVIDIA A100-SXM4-80GB") == "dgx-a100-80g"
    assert local_preset("cuda", "Tesla V100-SXM2-16GB") == "p3.16xlarge"
    assert local_preset("cuda", "Some Future GPU") == "dgx-h100"


def test_bind_local_device_leaves_cpu_alone() -> None:
    assert bind_local_device("gloo", 3) == "cpu"  # no GPU touched, whatever the rank


def test_device_without_a_group_comes_from_the_backend() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    assert process_group_device("nccl") == "cuda"
    assert process_group_device("gloo") == "cpu"
    assert Cluster.local(mesh=(1,), axis_names=("dp",)).backend == "gloo"


def test_local_under_gloo_is_cpu(gloo_group) -> None:
    c = Cluster.local(mesh=(1,), axis_names=("dp",))
    assert (c.backend, c.device.name) == ("gloo", "cpu")
    assert c.device_mesh().device_type == "cpu"
    # a GPU cluster priced on this box still runs on the box's device (the live group's)
    h100 = Cluster.local(mesh=(1,), axis_names=("dp",), preset="dgx-h100")
    assert h100.backend == "nccl" and h100.device_mesh().device_type == "cpu"
    assert process_group_device("nccl") == "cpu"  # the live group wins over the fallback


def test_local_chunk_lands_on_the_mesh_device(gloo_group) -> None:
    mesh = Cluster.local(mesh=(1,), axis_names=("dp",)).device_mesh()
    assert mesh_device(mesh) == torch.device("cpu")
    full = torch.arange(8.0).reshape(4, 2)
    local = local_chunk(full, (Shard(0),), mesh)
    assert local.device == torch.device("cpu") and torch.equal(local, full)
    assert local.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    meta = local_chunk(torch.empty(4, 2, device="meta"), (Replicate(),), mesh)
    assert meta.is_meta and meta.shape == (4, 2)  # shapes only: stays on meta


def test_a_mesh_and_its_process_groups_are_built_once_per_default_group() -> None:
    """Compiling again in a process reuses the mesh of the same shape and names (each gloo
    group holds threads and sockets until the process ends); a new default group, new ones."""
    from autopar._compat import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("dp", "tp"))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        first = cluster.device_mesh("cpu")
        groups = len(dist.distributed_c10d._world.pg_map)
        assert cluster.device_mesh("cpu") is first
        assert len(dist.distributed_c10d._world.pg_map) == groups
        other = Cluster.preset("cpu", mesh=(2, 2), axis_names=("tp", "dp")).device_mesh("cpu")
        assert other is not first and len(dist.distributed_c10d._world.pg_map) > groups
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        assert cluster.device_mesh("cpu") is not first
    finally:
        dist.destroy_process_group()


def test_run_backend_option() -> None:
    runner = CliRunner()
    too_many = torch.cuda.device_count() + 1  # always more processes than GPUs
    result = runner.invoke(
        app, ["run", "mlp", "--nproc", str(too_many), "--mesh", str(too_many), "--backend", "nccl"]
    )
    assert result.exit_code == 2, result.output
    assert f"--backend: backend nccl needs one GPU per process: {too_many} processes" in (
        result.output
    )
    result = runner.invoke(app, ["run", "mlp", "--nproc", "2", "--mesh", "2", "--backend", "mpi"])
    assert result.exit_code == 2 and "unknown backend 'mpi'" in result.output, result.output
    assert parse_args(["--model", "mlp", "--backend", "nccl"]).backend == "nccl"
    assert parse_args(["--model", "mlp"]).backend is None


def test_context_parallel_on_a_gpu_is_refused_with_the_fix() -> None:
    graph = torch.fx.Graph()
    node = graph.call_function(torch.ops.aten.scaled_dot_product_attention.default, ())
    check_context_parallel_runs(node, "S(0),S(2)", "cpu")  # the CPU kernels' handlers
    check_context_parallel_runs(node, "S(0),R", "cuda")  # no sequence split
    with pytest.raises(NotImplementedError, match="context parallelism.*Fix: plan without"):
        check_context_parallel_runs(node, "R,S(2)", "cuda")


_FAULTS = """
import resource, sys, torch
from autopar.devices import cache_host_memory
applied = cache_host_memory()
assert cache_host_memory() is applied  # once per process
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        t = torch.ones(16 * 2**20)  # 64 MiB, written whole
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()  # the first allocation maps its pages either way
print(applied, faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("mode", ["cache", "system"])
def test_a_cpu_process_keeps_its_freed_host_memory(mode: str) -> None:
    """`cache_host_memory`: glibc maps a 64 MiB tensor afresh each time (a page fault per
    4 KiB page written, ~16k) unless the process keeps its freed memory; with
    AUTOPAR_HOST_MALLOC=system the allocator is left alone."""
    env = {**os.environ, "AUTOPAR_HOST_MALLOC": mode}
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    applied, faults = out[0] == "True", int(out[1])
    if mode == "system":
        assert not applied and faults > 4 * 10_000
        return
    if not applied:
        pytest.skip("this C library is not glibc: its allocator is left as it is")
    assert faults < 4 * 1_000  # the pages are the ones freed, already mapped

"""Cluster: presets, per-axis link selection, validation, JSON round trip, Cluster.local."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from autopar.cluster import PRESETS, Cluster, DeviceSpec, Link


@pytest.fixture
def fake_pg():
    """A fake process group of ``world_size`` ranks (no communication), torn down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("nodes", [1, 2])
def test_presets_build(name: str, nodes: int) -> None:
    kw = {"mesh": (2 * nodes, 2)} if name == "cpu" else {}
    c = Cluster.preset(name, nodes=nodes, **kw)
    assert c.world_size == nodes * c.devices_per_node
    assert len(c.links) == len(c.mesh_shape) == len(c.axis_names)
    if name != "cpu":
        assert c.backend == "nccl"
        assert c.mesh_shape == ((nodes, 8) if nodes > 1 else (8,))
        assert c.axis_names == (("node", "gpu") if nodes > 1 else ("gpu",))
    else:
        assert c.backend == "gloo"
    assert hash(c) == hash(Cluster.preset(name, nodes=nodes, **kw))


def test_dgx_h100_links_per_axis() -> None:
    c = Cluster.preset("dgx-h100", nodes=8, mesh=(8, 8), axis_names=("dp", "tp"))
    line = [(lk.bandwidth, lk.latency) for lk in c.links]
    assert line[0] == (50e9, 10e-6)  # crosses nodes: one 400Gb/s NIC per GPU
    assert line[1] == (450e9, 5e-6)  # inside a node: NVLink
    assert c.links[1] == c.fabric.intra  # its efficiency too
    assert c.links[0].efficiency == c.fabric.inter_efficiency
    assert c.link("tp") is c.links[1]
    # (2, 2) fits in a node; the outer axis of 16 crosses nodes with only 4 concurrent
    # groups per node, so each group gets two of the node's eight NICs.
    c3 = Cluster.preset("dgx-h100", nodes=8, mesh=(16, 2, 2))
    assert [lk.bandwidth for lk in c3.links] == [100e9, 450e9, 450e9]
    # A flat axis over 2 nodes: a single ring striped over all 8 NICs of a node.
    flat = Cluster.preset("dgx-h100", nodes=2, mesh=(16,))
    assert flat.links[0].bandwidth == 400e9


def test_a100_and_v100_numbers() -> None:
    a100 = Cluster.preset("dgx-a100-80g", nodes=2)
    assert a100.device.peak_flops_for(torch.bfloat16) == 312e12
    assert a100.device.peak_flops_for("float32") == 19.5e12
    assert a100.device.peak_flops_for(torch.int64) == 19.5e12  # falls back to float32
    assert [(lk.bandwidth, lk.latency) for lk in a100.links] == [(25e9, 10e-6), (300e9, 5e-6)]
    p3 = Cluster.preset("p3.16xlarge", nodes=2)
    assert p3.links[0].bandwidth == pytest.approx(25e9 / 8 / 8)  # 25 Gb/s shared by 8 GPUs
    assert p3.device.memory_bytes == 16 * 2**30


def test_preset_errors() -> None:
    with pytest.raises(ValueError, match=r"known presets: \['cpu', 'dgx-a100-80g'"):
        Cluster.preset("tpu-v9")
    with pytest.raises(ValueError, match=r"mesh \(4, 4\) has 16 devices .* 1x8 = 8"):
        Cluster.preset("dgx-h100", mesh=(4, 4))
    with pytest.raises(ValueError, match="nodes must be a positive int"):
        Cluster.preset("dgx-h100", nodes=0)


def test_validation() -> None:
    dev = PRESETS["cpu"].device
    link = Link(1e9, 1e-5)
    with pytest.raises(ValueError, match="one entry per mesh axis"):
        Cluster(dev, (2, 2), ("a",), (link, link))
    with pytest.raises(ValueError, match="one entry per mesh axis"):
        Cluster(dev, (2, 2), ("a", "b"), (link,))
    # a preset or a re-mesh says it in the caller's words (no links given there)
    with pytest.raises(ValueError, match=r"give 1 name\(s\) but mesh \(2, 2\) has 2 axes"):
        Cluster.preset("cpu", mesh=(2, 2), axis_names=("dp",))
    with pytest.raises(ValueError, match="give one name per mesh axis"):
        Cluster.preset("dgx-h100", nodes=1).reshaped((2, 4), ("dp", "tp", "pp"))
    with pytest.raises(ValueError, match="positive ints"):
        Cluster(dev, (2, 0), ("a", "b"), (link, link))
    with pytest.raises(ValueError, match="unique"):
        Cluster(dev, (2, 2), ("a", "a"), (link, link))
    with pytest.raises(ValueError, match="devices_per_node"):
        Cluster(dev, (2,), ("a",), (link,), devices_per_node=0)
    with pytest.raises(ValueError, match="Link.bandwidth"):
        Link(0, 1e-6)
    with pytest.raises(ValueError, match="float32"):
        DeviceSpec("x", {"bfloat16": 1e12}, 1e9, 1e9)
    with pytest.raises(TypeError):
        dev.peak_flops["float32"] = 1.0  # read-only


def test_axis_queries_and_str() -> None:
    c = Cluster.preset("cpu", mesh=(2, 3), axis_names=("dp", "tp"))
    assert c.world_size == 6
    assert c.axis_index("tp") == 1 and c.axis_index(-1) == 1
    assert c.axis_size("dp") == 2 and c.axis_size(1) == 3
    with pytest.raises(ValueError, match=r"unknown mesh axis 'pp'; axes are \('dp', 'tp'\)"):
        c.axis_size("pp")
    with pytest.raises(ValueError, match="out of range"):
        c.axis_size(2)
    kinds = "all_gather x0.17 reduce_scatter x0.1"
    assert (
        str(c)
        == f"cpu x6 mesh(dp=2, tp=3) links(dp: 1 GB/s 50 us {kinds}, tp: 1 GB/s 50 us {kinds}) gloo"
    )


def test_dict_round_trip() -> None:
    for c in (
        Cluster.preset("dgx-a100-80g", nodes=4, mesh=(4, 2, 4), axis_names=("pp", "dp", "tp")),
        Cluster.preset("p3.16xlarge", nodes=2),
        Cluster.preset("cpu", mesh=(2, 2)),
        replace(
            cpu := Cluster.preset("cpu", mesh=(4,)), device=replace(cpu.device, core_share=0.5)
        ),
    ):
        d = json.loads(json.dumps(c.to_dict()))
        back = Cluster.from_dict(d)
        assert back == c
        assert back.to_dict() == c.to_dict()
    with pytest.raises(ValueError, match="not a Cluster dict"):
        Cluster.from_dict({"mesh_shape": [2]})
    # a file from before the efficiency figures: every efficiency 1, nothing overlapped
    old = Cluster.preset("cpu", mesh=(2,)).to_dict()
    for key in ("matmul_efficiency", "memory_efficiency", "launch_overhead"):
        del old["device"][key]
    old["links"] = [{"bandwidth": 1e9, "latency": 5e-5}]
    del old["device"]["core_share"]
    back = Cluster.from_dict(old)
    assert back.device.matmul_efficiency == 1.0 and back.links[0].efficiency == 1.0
    assert back.device.core_share == 1.0  # a process a core: as before
    # a file that set the uniform overlap autopar no longer reads: loaded, with a warning
    old["comm_overlap"] = 0.5
    with pytest.warns(UserWarning, match="comm_overlap=0.5, which autopar no longer reads"):
        assert Cluster.from_dict(old) == back


def test_save_and_load(tmp_path) -> None:

    c = Cluster.preset("dgx-h100", nodes=2)
    path = tmp_path / "cluster.json"
    c.save(path, calibration={"note": "extra keys ride along"})
    assert Cluster.load(path) == c
    assert Cluster.load(path).reshaped((4, 4), ("dp", "tp")) == c.reshaped((4, 4), ("dp", "tp"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read cluster file"):
        Cluster.load(tmp_path / "bad.json")


def test_efficiency_validation() -> None:
    with pytest.raises(ValueError, match="Link.efficiency"):
        Link(1e9, 0.0, 1.5)
    with pytest.raises(ValueError, match="matmul_efficiency"):
        DeviceSpec("x", {"float32": 1e12}, 1e9, 1e9, matmul_efficiency=0.0)
    with pytest.raises(ValueError, match="launch_overhead"):
        DeviceSpec("x", {"float32": 1e12}, 1e9, 1e9, launch_overhead=-1.0)
    for curve in (((2e6, 1.0), (1e6, 0.5)), ((1e6, 0.5), (2e6, 0.6)), ((1e6, 1.5),)):
        with pytest.raises(ValueError, match="memory_curve"):
            DeviceSpec("x", {"float32": 1e12}, 1e9, 1e9, memory_curve=curve)
    for rate in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="op_rates"):
            DeviceSpec("x", {"float32": 1e12}, 1e9, 1e9, op_rates=(("gelu", rate),))
        with pytest.raises(ValueError, match="update_rates rate"):
            DeviceSpec("x", {"float32": 1e12}, 1e9, 1e9, update_rates=((2, 2**16, rate),))
    with pytest.raises(ValueError, match="update_rates size"):
        DeviceSpec("x", {"float32": 1e12}, 1e9, 1e9, update_rates=((2, -1.0, 1e9),))
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="core_share"):
            DeviceSpec("x", {"float32": 1e12}, 1e9, 1e9, core_share=share)


def test_local_without_process_group(monkeypatch) -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 4"):
        Cluster.local(mesh=(2, 2))
    c = Cluster.local(mesh=(1,), axis_names=("dp",))
    assert c.world_size == 1 and c.backend == "gloo"


def test_local_checks_world_size(fake_pg, monkeypatch) -> None:
    fake_pg(2)
    with pytest.raises(
        ValueError, match=r"mesh \(2, 2\) has 4 devices but the process group has 2 ranks; "
    ):
        Cluster.local(mesh=(2, 2), axis_names=("dp", "tp"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two nodes of one device each
    c = Cluster.local(mesh=(2,), axis_names=("dp",), preset="dgx-h100")
    assert (c.world_size, c.devices_per_node, c.backend) == (2, 1, "nccl")
    assert c.links[0].latency == 10e-6  # inter-node


def test_device_mesh(fake_pg) -> None:
    fake_pg(4)
    mesh = Cluster.preset("cpu", mesh=(2, 2), axis_names=("dp", "tp")).device_mesh()
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert tuple(mesh.shape) == (2, 2)

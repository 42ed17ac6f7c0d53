"""`autopar calibrate`: measurements -> a cluster file that `Cluster.load` and `--cluster` read.

The fit is checked on synthetic measurements made by the cost model itself (it must give the
link back); the command runs once on 2 local processes with the tiny sizes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopar.calibration import calibration_age_hours
from autopar.calibration_fit import (
    _fit_link,
    _update_rates,
    cluster_from_measurements,
    overlap_efficiency,
)
from autopar.cli import app
from autopar.cli.args import make_cluster
from autopar.cluster import Cluster, DeviceSpec, Link
from autopar.cost_models.comm import collective_time, send_recv_time
from autopar.cost_models.compute import RATED_BACKWARD
from autopar.cost_models.reshard import launch as launch_time
from autopar.devices import choose_backend


def _synthetic(link: Link, n: int) -> list[list]:
    cluster = Cluster.preset("cpu", mesh=(n,))
    cluster = Cluster(cluster.device, (n,), ("dp",), (link,), "gloo", n)
    rows = []
    for nbytes in (2**10, 2**16, 2**20, 2**24):
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            # one call, as a plan prices it: the collective and one launch
            launch = launch_time(kind, 0, cluster)
            rows.append([kind, nbytes, collective_time(kind, nbytes, 0, cluster) + launch])
        rows.append(["p2p", nbytes, send_recv_time(nbytes, link)])
    return rows


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kinds", [(), (("all_gather", 0.25), ("reduce_scatter", 0.1))])
@pytest.mark.parametrize("steps", [(), (("all_reduce", 2.0), ("reduce_scatter", 4.0))])
def test_fit_recovers_the_link(n: int, kinds: tuple, steps: tuple) -> None:
    """Each kind's bandwidth fraction and latency factor, from calls priced by a link."""
    truth = Link(3e9, 40e-6, kind_efficiency=kinds, kind_latency=steps)
    fitted = _fit_link(_synthetic(truth, n), n, "gloo")
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-3)
    assert fitted.latency == pytest.approx(truth.latency, rel=1e-3)
    for got, want in ((fitted.kind_efficiency, kinds), (fitted.kind_latency, steps)):
        assert [k for k, _ in got] == [k for k, _ in want]
        for (_, g), (_, w) in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=1e-3)
    assert Link.from_dict(fitted.to_dict()) == fitted


def test_a_kind_latency_prices_its_steps_only() -> None:
    """`Link.kind_latency` multiplies one kind's steps and launch, no other kind's; a
    factor below 1 (the link's latency is the fastest kind's) is refused."""
    plain = Link(3e9, 1e-3)
    slow = Link(3e9, 1e-3, kind_latency=(("reduce_scatter", 3.0),))
    for link in (plain, slow):
        assert link.latency_of("all_gather") == 1e-3
    assert slow.latency_of("reduce_scatter") == pytest.approx(3e-3)
    base = Cluster.preset("cpu", mesh=(4,))
    a, b = (Cluster(base.device, (4,), ("dp",), (x,), "gloo", 4) for x in (plain, slow))
    assert collective_time("all_gather", 1e3, 0, a) == collective_time("all_gather", 1e3, 0, b)
    extra = collective_time("reduce_scatter", 1e3, 0, b) - collective_time(
        "reduce_scatter", 1e3, 0, a
    )
    assert extra == pytest.approx(3 * 2e-3)  # 3 ring steps, each 2 ms longer
    with pytest.raises(ValueError, match="kind_latency"):
        Link(3e9, 1e-3, kind_latency=(("p2p", 0.5),))


def test_cluster_from_measurements_takes_the_largest_sizes_rates() -> None:
    """Compute and memory rates are those of the largest sizes (a CPU's cache serves the
    middle sizes faster than a training step's large matmuls run)."""
    m = {
        "device_name": "x",
        "memory_bytes": 1e9,
        "launch_s": 5e-6,
        "matmul": {
            "float32": [[1e6, 1e-4, 1e10], [1e8, 1e-3, 1e11], [1e9, 2e-2, 5e10]],
            "bfloat16": [[1e6, 2e-4, 5e9], [1e9, 4e-2, 2.5e10]],
        },
        "memory": [[1e6, 1e-5, 1e11], [1e8, 5e-3, 2e10]],  # the largest size counts
        "attention_flops": 2.5e10,
        "comm": {"dp": _synthetic(Link(2e9, 30e-6), 2)},
    }
    c = cluster_from_measurements(m, (2,), ("dp",), "gloo")
    assert c.device.peak_flops["float32"] == 5e10 and c.device.memory_bandwidth == 2e10
    assert c.device.attention_efficiency == pytest.approx(0.5)
    assert c.device.launch_overhead == 5e-6 and c.device.matmul_half_flops >= 0
    assert c.links[0].bandwidth == pytest.approx(2e9, rel=1e-3)
    assert c.reshaped((2,), ("tp",)).links == c.links  # the fabric re-meshes it
    assert c.device.overlap_efficiency == 1.0  # no overlap measured: as the presets
    assert c.device.core_share == 1.0  # no share recorded: a core each
    m["core_share"] = 0.5  # 4 processes on 2 cores
    assert cluster_from_measurements(m, (2,), ("dp",), "gloo").device.core_share == 0.5
    # compute 30 ms, all-reduce 20 ms, both 40 ms: half the all-reduce hidden
    m["overlap"] = [0.03, 0.02, 0.04]
    assert cluster_from_measurements(m, (2,), ("dp",), "gloo").device.overlap_efficiency == (
        pytest.approx(0.5)
    )
    assert c.device.matmul_half_dim == 0.0  # no thin matmul measured: no shape effect
    # [d, 2048] @ [2048, 2048] at d / (d + 20) * (2048 / 2068) ** 2 of the peak (each
    # side's share): the fit finds 20
    share = (2048 / 2068) ** 2
    m["skinny"] = [
        [d, 2.0 * d * 2048**2, 2.0 * d * 2048**2 / (5e10 * d / (d + 20) * share) + 5e-6]
        for d in (16, 32, 64)
    ]
    thin = cluster_from_measurements(m, (2,), ("dp",), "gloo").device
    assert thin.matmul_half_dim == pytest.approx(20.0, rel=1e-3)
    assert thin.matmul_half_flops <= c.device.matmul_half_flops  # thin squares explained
    assert overlap_efficiency(0.03, 0.02, 0.06) == 0.0  # slower together: nothing hidden
    assert overlap_efficiency(0.03, 0.02, 0.03) == 1.0
    # attention: the long run's rate alone (an older file) is the efficiency, no length
    # curve, ideal causal skipping
    assert (c.device.attention_half_seq, c.device.attention_block) == (0.0, 0.0)
    # rates of eff * peak * kv / (kv + h), eff 0.6, h 64, over 1024 and 128 keys; the
    # causal run took 0.75 of the full one's time: a key tile of 512 tokens
    seq, eff, h = 1024, 0.6, 64.0
    rate = lambda kv: eff * 5e10 * kv / (kv + h)  # noqa: E731
    f_small = 4.0 * 8 * 4 * (seq // 8) ** 2 * 64
    m |= {
        "attention_flops": rate(seq),
        "attention_seq": seq,
        "attention_causal_share": 0.75,
        "attention_small": [f_small, f_small / rate(seq // 8)],
    }
    fit = cluster_from_measurements(m, (2,), ("dp",), "gloo").device
    assert fit.attention_efficiency == pytest.approx(eff)
    assert fit.attention_half_seq == pytest.approx(h)
    assert fit.attention_block == pytest.approx(512)


def test_calibrate_command_writes_a_loadable_cluster(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    backend = choose_backend(None, 2)
    args = ["calibrate", "--nproc", "2", "--sizes", "tiny", "--backend", backend, "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    cluster = Cluster.load(out)
    assert cluster.mesh_shape == (2,) and cluster.backend == backend
    assert all(v > 0 for v in cluster.device.peak_flops.values())
    assert cluster.links[0].bandwidth > 0 and cluster.device.launch_overhead > 0
    raw = json.loads(out.read_text())
    assert {"matmul", "skinny", "memory", "comm", "overlap", "taken_at"} <= set(raw["calibration"])
    # every rated op and its backward measured (`cost_models.compute.RATED_BACKWARD`)
    rated = {*RATED_BACKWARD, *RATED_BACKWARD.values()}
    assert {op for op, rate in cluster.device.op_rates if rate > 0} == rated
    assert {k for k, _, _ in cluster.device.update_rates} == {0, 1, 2}  # SGD, momentum, AdamW
    assert cluster.device.matmul_half_dim >= 0
    assert cluster.device.attention_half_seq >= 0 and cluster.device.attention_block >= 0
    assert 0.0 <= calibration_age_hours(out) < 1.0  # dated: a calibration is of its day
    assert 0.0 <= cluster.device.overlap_efficiency <= 1.0
    cores = len(os.sched_getaffinity(0)) if backend == "gloo" else 2
    assert cluster.device.core_share == min(1.0, cores / 2)
    assert len(raw["calibration"]["comm"]["dp"]) == 2 * 5  # 2 sizes x (4 collectives + p2p)
    assert make_cluster(str(out), 1, None, "tp").axis_names == ("tp",)
    # the fitted rates printed beside the cluster (`views.device.device_lines`)
    for line in ("matmul: float32", "memory-bound:", "elementwise arithmetic", "AdamW"):
        assert line in result.output


def test_streamed_memory_runs_give_a_size_curve() -> None:
    """Memory-bound runs streamed as a step streams them (`calibration._streamed`) give a
    rate per size, never rising with size (a larger size measured faster is noise: pooled
    with its neighbour), over the fastest; runs from before (a hot ``x * 2``) give the
    largest size's rate, flat."""
    m = {
        "device_name": "x",
        "memory_bytes": 1e9,
        "launch_s": 5e-6,
        "matmul": {"float32": [[1e6, 1e-4, 1e10], [1e9, 2e-2, 5e10]]},
        "memory": [[1e6, 0, 8e9], [4e6, 0, 1.2e10], [1.6e7, 0, 9e9], [1.3e8, 0, 2.5e9]],
        "comm": {"dp": _synthetic(Link(2e9, 30e-6), 2)},
    }
    old = cluster_from_measurements(m, (2,), ("dp",), "gloo").device
    assert old.memory_bandwidth == 2.5e9 and old.memory_curve == ()
    assert old.memory_rate(1e6) == old.memory_rate(1e9) == 2.5e9
    device = cluster_from_measurements(
        m | {"memory_method": "streamed"}, (2,), ("dp",), "gloo"
    ).device
    assert device.memory_bandwidth == pytest.approx(1e10)  # 8 and 12 GB/s pooled
    rates = [device.memory_rate(b) for b in (1e5, 1e6, 4e6, 1.6e7, 6e7, 1.3e8, 1e10)]
    assert rates == sorted(rates, reverse=True)
    assert rates[0] == rates[1] == rates[2] == pytest.approx(1e10)
    assert device.memory_rate(1.6e7) == pytest.approx(9e9)
    assert rates[-2] == rates[-1] == pytest.approx(2.5e9)  # flat past the largest size
    assert 2.5e9 < device.memory_rate(6e7) < 9e9  # log-log between the sizes
    assert device.memory_in_place == 0.0  # none measured: in place as any other kernel
    assert device.memory_rate(1e6, in_place=True) == device.memory_rate(1e6)
    rates = [[1e6, 0, 1.7e10], [1.6e7, 0, 1.9e10], [1.3e8, 0, 2.9e10]]
    fast = cluster_from_measurements(
        m | {"memory_method": "streamed", "memory_in_place": rates}, (2,), ("dp",), "gloo"
    ).device
    assert fast.memory_in_place == 1.9e10  # the median over the sizes
    assert fast.memory_rate(1.3e8, in_place=True) == 1.9e10 > fast.memory_rate(1.3e8)
    again = Cluster.from_dict(
        cluster_from_measurements(
            m | {"memory_method": "streamed"}, (2,), ("dp",), "gloo"
        ).to_dict()
    )
    assert again.device == device and again.device.memory_curve == device.memory_curve


def test_op_rates_are_elements_per_second_without_the_launch() -> None:
    """Each measured op's rate is its elements over one call's time less the launch; a
    file from before has none (every op priced by its bytes)."""
    m = {
        "device_name": "x",
        "memory_bytes": 1e9,
        "launch_s": 5e-6,
        "matmul": {"float32": [[1e6, 1e-4, 1e10], [1e9, 2e-2, 5e10]]},
        "memory": [[1e6, 0, 8e9], [1.3e8, 0, 2.5e9]],
        "comm": {"dp": _synthetic(Link(2e9, 30e-6), 2)},
    }
    assert cluster_from_measurements(m, (2,), ("dp",), "gloo").device.op_rates == ()
    rates = {"gelu": [2**20, 5e-4 + 5e-6], "gelu_backward": [2**20, 4e-4 + 5e-6]}
    device = cluster_from_measurements(m | {"op_rates": rates}, (2,), ("dp",), "gloo").device
    assert device.op_rate("gelu") == pytest.approx(2**20 / 5e-4)
    assert device.op_rate("gelu_backward") == pytest.approx(2**20 / 4e-4)
    assert device.op_rate("exp") == 0.0  # not measured
    assert (
        Cluster.from_dict(
            Cluster(device, (2,), ("dp",), (Link(1e9, 0),), "gloo", 2).to_dict()
        ).device
        == device
    )


def test_update_rates_are_elements_per_second_by_state_count_and_size() -> None:
    """Each timed set's elements over its time, per state count and tensor size; between
    the sizes log-log, flat beyond; more states never fit faster than fewer at a size."""
    runs = {"0": [(2**16, 32, 32 * 2**16 / 3e9), (2**22, 4, 4 * 2**22 / 2e9)]}
    runs["2"] = [(2**16, 32, 32 * 2**16 / 4e8), (2**22, 4, 4 * 2**22 / 1e8)]
    fit = _update_rates(runs)
    expected = ((0, 2**16, 3e9), (0, 2**22, 2e9), (2, 2**16, 4e8), (2, 2**22, 1e8))
    assert [row[:2] for row in fit] == [row[:2] for row in expected]
    assert [row[2] for row in fit] == pytest.approx([row[2] for row in expected])
    device = DeviceSpec("x", {"float32": 1e12}, 1e9, 1e9, update_rates=fit)
    assert DeviceSpec.from_dict(device.to_dict()) == device
    assert device.update_rate(2, 2**10) == pytest.approx(4e8)  # flat below the smallest
    assert device.update_rate(2, 2**30) == pytest.approx(1e8)  # and past the largest
    assert device.update_rate(2, 2**19) == pytest.approx(2e8)  # log-log halfway
    assert device.update_rate(1, 2**19) == 0.0  # not measured: priced by its passes
    # AdamW measured faster than SGD on the small set (noise): taken as slow as SGD there
    runs["2"][0] = (2**16, 32, 32 * 2**16 / 5e9)
    assert _update_rates(runs)[2] == pytest.approx((2, 2**16, 3e9))

"""Invariants of the cost models that must hold for any device figures (no hard-coded ones).

For every preset and for a random-ish custom machine: a ring all-reduce never costs more
than a reduce-scatter plus an all-gather of the same bytes; every collective's cost grows
with its bytes; a faster axis (more bandwidth, less latency) never costs more; achieved
efficiencies stay in (0, 1]; compute time grows with FLOPs and bytes; a device that hides
less of the communication under compute (``overlap_efficiency``) never steps faster. Bucketed gradient reductions
(``cost_models.buckets``, as ``passes.comm`` runs them) never cost more than one collective per
tensor (the ILP's price); what the step waits for never exceeds the
communication, and more compute to hide it under never lengthens the step beyond that
compute; an all-to-all on a CPU (gloo) group is priced as the all-gather DTensor runs; the
optimizer's update grows with what a device updates and shrinks with sharding. Pure
functions (and one plan priced on a fake group): no processes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.cluster import PRESETS, Cluster, DeviceSpec, Fabric, Link
from autopar.cost_models import buckets, comm, compute
from autopar.cost_models.comm import Collective, collective_time
from autopar.search.schedules import synced_end

KINDS = [k for k in Collective if k is not Collective.LOCAL]
SIZES = [0.0, 1.0, 1e3, 6.5e4, 1e6, 3e7, 1e9, 4e10]
FLOPS = [0.0, 1e3, 1e6, 1e9, 1e12, 1e15]
CUSTOM = DeviceSpec(
    "custom",
    {"float32": 3e13, "bfloat16": 2e14},
    1e10,
    1.5e12,
    matmul_efficiency=0.6,
    matmul_half_flops=3e8,
    attention_efficiency=0.4,
    memory_efficiency=0.7,
    launch_overhead=7e-6,
    attention_half_seq=64.0,
    attention_block=256.0,
)


def _clusters() -> list[Cluster]:
    out = [Cluster.preset(name, nodes=2, mesh=(2, 2, 4)) for name in PRESETS if name != "cpu"]
    out.append(Cluster.preset("cpu", nodes=2, mesh=(2, 2, 2)))
    fabric = Fabric(Link(2e11, 3e-6, 0.7), 8e10, 2e-5, 0.85)
    links = fabric.axis_links((4, 2, 2), 4)
    out.append(Cluster(CUSTOM, (4, 2, 2), ("a", "b", "c"), links, "nccl", 4, fabric))
    # as `autopar calibrate` fits gloo on a CPU: each kind's bytes at its own fraction
    kinds = (("all_gather", 0.1), ("all_reduce", 0.58), ("reduce_scatter", 0.06))
    cpu = Cluster.preset("cpu", mesh=(2, 4))
    slow = Link(3.6e9, 1e-3, kind_efficiency=kinds)
    # and its memory-bound kernels by size (`DeviceSpec.memory_curve`): a few MiB stream
    # from memory, a fresh 64 MiB output is mapped page by page
    curve = ((5e5, 1.0), (2e6, 1.0), (8e6, 0.9), (1.3e8, 0.25))
    # and its arithmetic-bound elementwise ops (`DeviceSpec.op_rates`, elements/s)
    rates = (("gelu", 2e9), ("gelu_backward", 2.2e9), ("_softmax", 2.3e9))
    # and its optimizer's loop as timed (`DeviceSpec.update_rates`: by state count and size)
    updates = tuple(
        (k, n, r)
        for k, rates in ((0, (3e9, 2e9)), (1, (1e9, 5e8)), (2, (3.5e8, 1.2e8)))
        for n, r in zip((2**16, 2**22), rates, strict=True)
    )
    device = replace(
        cpu.device,
        name="calibrated",
        memory_curve=curve,
        memory_in_place=2e10,
        op_rates=rates,
        update_rates=updates,
        core_share=0.5,  # measured on 4 processes sharing 2 cores
    )
    out.append(replace(cpu, device=device, links=(slow, slow)))
    return out


CLUSTERS = _clusters()
IDS = [c.device.name for c in CLUSTERS]


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_all_reduce_never_above_reduce_scatter_plus_all_gather(cluster: Cluster) -> None:
    for axis, nbytes in itertools.product(range(cluster.ndim), SIZES):
        ar = collective_time("all_reduce", nbytes, axis, cluster)
        rs = collective_time("reduce_scatter", nbytes, axis, cluster)
        ag = collective_time("all_gather", nbytes, axis, cluster)
        assert ar <= (rs + ag) * (1 + 1e-12)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_cost_grows_with_bytes(cluster: Cluster) -> None:
    for kind, axis in itertools.product(KINDS, range(cluster.ndim)):
        times = [collective_time(kind, b, axis, cluster) for b in SIZES]
        assert times[0] == 0.0
        assert all(b >= a for a, b in itertools.pairwise(times)), (kind, axis, times)
        if cluster.mesh_shape[axis] > 1:
            assert times[-1] > times[1] > 0
    link = cluster.links[0]
    p2p = [comm.send_recv_time(b, link) for b in SIZES]
    assert p2p[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(p2p))


def _with_link(cluster: Cluster, axis: int, link: Link) -> Cluster:
    links = list(cluster.links)
    links[axis] = link
    return replace(cluster, links=tuple(links))


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_faster_axis_never_costs_more(cluster: Cluster) -> None:
    for axis in range(cluster.ndim):
        slow = cluster.links[axis]
        faster = [
            Link(slow.bandwidth * 2, slow.latency, slow.efficiency),
            Link(slow.bandwidth, slow.latency / 2, slow.efficiency),
            Link(slow.bandwidth, slow.latency, min(1.0, slow.efficiency * 1.2)),
        ]
        for fast, kind, nbytes in itertools.product(faster, KINDS, SIZES):
            quick = _with_link(cluster, axis, fast)
            assert collective_time(kind, nbytes, axis, quick) <= collective_time(
                kind, nbytes, axis, cluster
            )
            assert comm.send_recv_time(nbytes, fast) <= comm.send_recv_time(nbytes, slow)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_efficiency_in_unit_interval(cluster: Cluster) -> None:
    d = cluster.device
    for value in (d.matmul_efficiency, d.attention_efficiency, d.memory_efficiency):
        assert 0 < value <= 1
    for link in (*cluster.links, *((cluster.fabric.intra,) if cluster.fabric else ())):
        assert 0 < link.efficiency <= 1
        assert link.bus_bandwidth <= link.bandwidth
        assert all(0 < f <= 1 for _, f in link.kind_efficiency)
        assert all(link.kind_bandwidth(k.value) <= link.bus_bandwidth for k in KINDS)
    for op, f in itertools.product(compute.OP_CLASSES, FLOPS):
        assert 0 < compute.compute_efficiency(f, op, cluster) <= 1
    # the size curve never decreases with the kernel's size
    effs = [compute.compute_efficiency(f, "matmul", cluster) for f in FLOPS]
    assert all(b >= a for a, b in itertools.pairwise(effs))
    for f, kv, causal in itertools.product(FLOPS, (64, 1024, 8192), (False, True)):
        assert 0 < compute.compute_efficiency(f, "attention", cluster, keys=(kv, causal)) <= 1
    # attention's rate never falls as its key length grows (unmasked)
    lengths = (1, 64, 1024, 8192, 1 << 20)
    effs = [compute.compute_efficiency(1e9, "attention", cluster, keys=(k, False)) for k in lengths]
    assert all(b >= a for a, b in itertools.pairwise(effs))


@pytest.mark.parametrize("block", [0, 128, 512])
def test_a_causal_attention_runs_what_its_key_tiles_leave(block: int) -> None:
    """Under a causal mask a flash kernel skips only the key tiles wholly above the
    diagonal: its share of the unmasked work is 1/2 (ideal) to 1 (the keys fit one tile),
    never growing with the sequence; the counted (halved) FLOPs are priced at least half
    the unmasked attention's time, at most all of it, and a larger tile never runs faster."""
    device = replace(Cluster.preset("cpu").device, attention_block=block)
    cluster = replace(Cluster.preset("cpu"), device=device)
    lengths = (64, 128, 512, 1024, 4096, 65536)
    shares = [compute.causal_share(kv, block) for kv in lengths]
    assert all(0.5 <= x <= 1 for x in shares)
    assert all(b <= a for a, b in itertools.pairwise(shares))
    assert compute.causal_share(block or 1, block) == (1.0 if block else 0.5)
    for kv in lengths:
        full = 4.0 * 8 * kv * kv * 64  # the unmasked attention's FLOPs
        unmasked = compute.compute_time(
            full, 0.0, "float32", cluster, op="attention", keys=(kv, False)
        )
        causal = compute.compute_time(
            full / 2, 0.0, "float32", cluster, op="attention", keys=(kv, True)
        )
        assert unmasked / 2 <= causal * (1 + 1e-9) and causal <= unmasked * (1 + 1e-9)
        wider = replace(cluster, device=replace(device, attention_block=block + 256))
        assert compute.compute_time(
            full / 2, 0.0, "float32", wider, op="attention", keys=(kv, True)
        ) >= causal * (1 - 1e-9)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_compute_time_grows_with_work(cluster: Cluster) -> None:
    for op, dtype, kernels in itertools.product(
        compute.OP_CLASSES, ("float32", "bfloat16"), (1, 3)
    ):
        by_flops = [
            compute.compute_time(f, 1e6, dtype, cluster, op=op, kernels=kernels) for f in FLOPS
        ]
        assert all(b >= a for a, b in itertools.pairwise(by_flops)), (op, dtype, by_flops)
        by_bytes = [compute.compute_time(1e9, b, dtype, cluster, op=op) for b in SIZES]
        assert all(b >= a for a, b in itertools.pairwise(by_bytes)), (op, dtype, by_bytes)
        # never faster than the peaks allow
        f, b = 1e12, 1e9
        floor = max(f / cluster.device.peak_flops_for(dtype), b / cluster.device.memory_bandwidth)
        assert compute.compute_time(f, b, dtype, cluster, op=op) >= floor
    assert compute.compute_time(0.0, 0.0, "float32", cluster) == 0.0


def test_a_measured_op_rate_bounds_its_op_from_below() -> None:
    """An op with a measured rate (and its backward's) costs at least its elements at
    those rates, never less than by its bytes alone; an op without one, and every op on a
    device without rates (the GPU presets), as before; a plan on a device whose gelu is
    slower predicts a slower step."""
    import autopar
    from autopar.capture import capture
    from autopar.planning import fake_group
    from samples import get_sample

    sample = get_sample("gpt")
    model = sample.build("tiny", device="meta")
    batch = sample.example_batch(model, 8, device="meta")
    gm = capture(model, batch).gm
    gelu = next(n for n in gm.graph.nodes if getattr(n.target, "_opname", "") == "gelu")
    add = next(n for n in gm.graph.nodes if getattr(n.target, "_opname", "") == "add")
    cpu = Cluster.preset("cpu", mesh=(4,))
    # GPT-2's gelu is the tanh approximation: its own rate, not the exact gelu's
    exact = replace(cpu.device, op_rates=(("gelu", 1e8), ("gelu_backward", 5e7)))
    assert compute.rated_seconds(gelu, exact, 1.0, backward=True) == 0.0
    rates = (("gelu[tanh]", 1e8), ("gelu_backward[tanh]", 5e7))
    slow = replace(cpu, device=replace(cpu.device, op_rates=rates))
    elements = gelu.meta["val"].numel()
    both = compute.rated_seconds(gelu, slow.device, 0.5, backward=True)
    assert both == pytest.approx(elements / 2 / 1e8 + elements / 2 / 5e7)
    forward = compute.rated_seconds(gelu, slow.device, 0.5, backward=False)
    assert forward == pytest.approx(elements / 2 / 1e8)
    assert compute.rated_seconds(add, slow.device, 1.0, backward=True) == 0.0
    for name in PRESETS:
        assert compute.rated_seconds(gelu, Cluster.preset(name).device, 1.0, True) == 0.0
    by_bytes = compute.compute_time(1e6, 8e6, "float32", slow, op="memory")
    rated = compute.compute_time(1e6, 8e6, "float32", slow, op="memory", rated=both)
    assert rated >= max(by_bytes, both) and rated >= both
    steps = []
    for cluster in (cpu, slow):
        with fake_group(4):
            plan = autopar.plan(model, batch, cluster=cluster, strategy="dp")
        steps.append(plan.predicted_step_time)
    assert steps[1] > steps[0]


MIB = 1024 * 1024
GRADS = [  # gradient sizes in backward order: biases, norms, weights, an embedding
    [4e3] * 30,
    [MIB / 2, MIB / 2, 10 * MIB, 20 * MIB, 1.0],
    [3 * MIB, 64e3, 40 * MIB, 4e3, 9 * MIB, 9 * MIB, 9 * MIB, 120 * MIB],
]
REDUCTIONS = [Collective.ALL_REDUCE, Collective.REDUCE_SCATTER]


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_bucketed_reduction_never_costs_more_than_per_tensor(cluster: Cluster) -> None:
    for kind, axis, sizes in itertools.product(REDUCTIONS, range(cluster.ndim), GRADS):
        alpha = cluster.links[axis].latency
        per_tensor = sum(collective_time(kind, b, axis, cluster) + alpha for b in sizes)
        bucketed = buckets.bucket_times(kind, sizes, axis, cluster)
        assert sum(bucketed) <= per_tensor * (1 + 1e-12)
        # one bucket saves at least the launch of every tensor but one
        if cluster.mesh_shape[axis] > 1 and len(bucketed) == 1 and len(sizes) > 1:
            assert sum(bucketed) <= (per_tensor - (len(sizes) - 1) * alpha) * (1 + 1e-9)
        # a pipeline's one flat buffer never costs more than the buckets
        grads = [(("k",), kind, axis, b) for b in sizes]
        assert buckets.fused_time(grads, cluster) <= sum(bucketed) * (1 + 1e-12)


def _step(cluster: Cluster, scale: float) -> tuple[float, float, float]:
    """(overlapped step, its compute, all its communication) of a 4-layer FSDP-like step."""
    layers = 4
    forward = [scale * 1e-3 * (i + 1) for i in range(layers)]
    backward = [2 * f for f in forward]
    gathers = [collective_time("all_gather", 8 * MIB, 0, cluster)] * layers
    # layer 0 (the last in backward) has no gradients: with ample compute all buckets hide
    grads = [[]] + [[(("rs",), Collective.REDUCE_SCATTER, 0, b) for b in s] for s in GRADS]
    grads[2].append((("ar",), Collective.ALL_REDUCE, 0, 3 * MIB))
    exposed = 1e-4
    step = buckets.overlapped_step(forward, backward, gathers, gathers, grads, cluster, exposed)
    compute_s = sum(forward) + sum(backward)
    comm_s = 2 * sum(gathers) + exposed
    for key, kind in ((("rs",), Collective.REDUCE_SCATTER), (("ar",), Collective.ALL_REDUCE)):
        sizes = [b for layer in reversed(grads) for k, _, _, b in layer if k == key]
        comm_s += sum(buckets.bucket_times(kind, sizes, 0, cluster))
        for bucket in buckets.bucket_plan(sizes):  # concatenated on the device: compute
            if len(bucket) > 1:
                compute_s += buckets.copy_time(kind, sum(sizes[i] for i in bucket), 0, cluster)
    return step, compute_s, comm_s


def _with_overlap(cluster: Cluster, overlap: float) -> Cluster:
    return replace(cluster, device=replace(cluster.device, overlap_efficiency=overlap))


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_a_device_that_hides_less_never_steps_faster(cluster: Cluster) -> None:
    """`DeviceSpec.overlap_efficiency`: hiding a smaller share of what the schedule hides
    never shortens the step; at 1 it is the schedule's overlap, at 0 every collective is
    waited (the same buckets, issued and waited at once)."""
    if cluster.backend == "nccl":  # the GPU presets: NCCL on its own SMs, fully hidden
        assert cluster.device.overlap_efficiency == 1.0
    for scale in (0.01, 1.0, 100.0):
        steps = [_step(_with_overlap(cluster, e), scale)[0] for e in (1.0, 0.75, 0.3, 0.0)]
        assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(steps)), steps
        step, compute_s, comm_s = _step(_with_overlap(cluster, 0.0), scale)
        assert step == pytest.approx(compute_s + comm_s, rel=1e-9)
    # a pipeline rank's gradient syncs: the share hidden under its remaining actions
    assert synced_end(10.0, [4.0, 9.0], [2.0, 3.0], overlap=1.0) == 12.0
    assert synced_end(10.0, [4.0, 9.0], [2.0, 3.0], overlap=0.0) == 15.0  # 10 + 2 + 3
    assert synced_end(10.0, [4.0, 9.0], [2.0, 3.0], overlap=0.5) == 13.5
    with pytest.raises(ValueError, match="overlap_efficiency"):
        _with_overlap(cluster, 1.5)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_exposed_communication_within_bounds(cluster: Cluster) -> None:
    previous = math.inf
    for scale in (0.0, 0.01, 1.0, 100.0, 1e4):
        step, compute_s, comm_s = _step(cluster, scale)
        waited = step - compute_s
        assert -1e-12 <= waited <= comm_s * (1 + 1e-9)
        assert step >= compute_s and step <= compute_s + comm_s * (1 + 1e-9)
        # more compute to hide under never shows more communication
        assert waited <= previous * (1 + 1e-9)
        previous = waited
    # with compute dwarfing communication only the forward's first gather, the backward
    # re-gathers (issued at their first reader, not prefetched) and the exposed term show
    # (the buckets end before the backward does), where the device hides all the schedule
    # hides (below, `test_a_device_that_hides_less_never_steps_faster`)
    step, compute_s, _ = _step(_with_overlap(cluster, 1.0), 1e6)
    first = collective_time("all_gather", 8 * MIB, 0, cluster)
    assert step - compute_s == pytest.approx((1 + 4) * first + 1e-4, rel=1e-6)


def test_serial_channel_and_prefetch() -> None:
    # one channel: the second bucket waits for the first; 1 s after the backward ends
    assert buckets.serial_exposure([1.0, 1.0], [2.0, 2.0], 4.0) == pytest.approx(1.0)
    assert buckets.serial_exposure([0.0, 3.0], [1.0, 1.0], 5.0) == 0.0
    assert buckets.serial_exposure([], [], 1.0) == 0.0
    # the first gather is waited in full; the next hides under the previous layer
    assert buckets.prefetch_exposure([2.0, 2.0, 2.0], [1.0, 3.0, 0.0]) == pytest.approx(3.0)
    assert buckets.prefetch_exposure([], []) == 0.0
    # parts without a gather (the head's backward) hide nothing of the first one
    assert buckets.prefetch_exposure([0.0, 2.0, 2.0], [5.0, 1.0, 0.0]) == pytest.approx(3.0)


def test_all_to_all_on_cpu_groups_is_an_all_gather() -> None:
    cpu = Cluster.preset("cpu", mesh=(4,))
    assert cpu.backend == "gloo"
    for nbytes in SIZES:
        a2a = collective_time("all_to_all", nbytes, 0, cpu)
        assert a2a == collective_time("all_gather", nbytes, 0, cpu)
    gpu = Cluster.preset("dgx-h100", nodes=1)
    assert collective_time("all_to_all", 1e9, 0, gpu) < collective_time("all_gather", 1e9, 0, gpu)
    nccl_cpu = replace(cpu, backend="nccl")
    assert collective_time("all_to_all", 1e9, 0, nccl_cpu) < collective_time(
        "all_gather", 1e9, 0, cpu
    )


def test_plan_prediction_prices_overlap_below_the_ilp() -> None:
    """The step the search ranks by (overlap as the runtime runs it, `IntraOpResult.step_time`)
    never exceeds the ILP's bound (every collective waited at once, one per tensor) and
    equals it without collectives; priced with no communication pass it is the bound
    exactly; and a template predicts as the full graph."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.capture import capture
    from autopar.capture.template import capture_template
    from autopar.plan import DEFAULT_COMM, CommPlan
    from autopar.planning import fake_group
    from autopar.search.costs import CostWeights
    from autopar.search.intra_op import solve_intra
    from autopar.search.pins import SearchOptions
    from autopar.search.step import predicted_step_time
    from samples import get_sample

    sample = get_sample("gpt")
    model = sample.build("tiny", device="meta")
    batch = sample.example_batch(model, 8, device="meta")
    one, four = Cluster.preset("cpu", mesh=(1,)), Cluster.preset("cpu", mesh=(4,))
    unbucketed = CommPlan(bucket=False, overlap=False)
    for cluster, strategy in ((one, "auto"), (four, "auto"), (four, "fsdp")):
        options = SearchOptions(strategy=strategy, reshard_after_forward=strategy == "fsdp")
        with fake_group(cluster.world_size):
            names = cluster.axis_names
            mesh = init_device_mesh("cpu", cluster.mesh_shape, mesh_dim_names=names)
            full_graph = capture(model, batch)
            full = solve_intra(full_graph, cluster, mesh, options, comm=DEFAULT_COMM)
            tpl = capture_template(model, batch)
            weights = CostWeights(tpl.weights)
            small = solve_intra(tpl.captured, cluster, mesh, options, weights, comm=DEFAULT_COMM)
        assert full.step_time == predicted_step_time(full_graph, full, DEFAULT_COMM)
        assert full.step_time == pytest.approx(small.step_time, rel=1e-9)
        # no pass, or one that neither buckets nor overlaps: every collective as the ILP
        for program in (None, unbucketed):
            assert predicted_step_time(full_graph, full, program) == pytest.approx(
                full.objective, rel=1e-9
            )
        if cluster.world_size == 1:  # no collective
            assert full.step_time == pytest.approx(full.objective, rel=1e-9)
        else:
            assert 0 < full.step_time <= full.objective * (1 + 1e-9)
            if strategy == "fsdp":  # gathers and reductions: the overlap hides some
                assert full.step_time < full.objective
            for program in (DEFAULT_COMM, CommPlan(overlap=False), CommPlan(bucket=False)):
                assert predicted_step_time(full_graph, full, program) <= full.objective * (1 + 1e-9)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_optimizer_update_grows_with_what_a_device_updates(cluster: Cluster) -> None:
    """The optimizer step's update (`cost_models.optimizer`): more elements never cost less;
    a sharded parameter, or ZeRO's flat shard of a replicated one, never costs more than
    the replicated update; more optimizer states never cost less; mixed precision (fp32
    masters for a bf16 parameter) never less than the bf16 update alone."""
    from torch.distributed.tensor import Replicate, Shard

    from autopar.cost_models.optimizer import update_time

    mesh = cluster.mesh_shape
    rep, shard = (Replicate(),) * len(mesh), (Shard(0),) + (Replicate(),) * (len(mesh) - 1)
    sizes = [(1,), (1024,), (4096, 1024), (16384, 4096)]
    times = [update_time(s, torch.float32, rep, mesh, cluster) for s in sizes]
    assert all(b >= a > 0 for a, b in itertools.pairwise(times))
    for shape in sizes[1:]:
        full = update_time(shape, torch.float32, rep, mesh, cluster)
        assert update_time(shape, torch.float32, shard, mesh, cluster) <= full
        assert update_time(shape, torch.float32, rep, mesh, cluster, 2, True) <= full
        assert update_time(shape, torch.float32, rep, mesh, cluster, 0) <= full
        bf16 = update_time(shape, torch.bfloat16, rep, mesh, cluster)
        assert update_time(shape, torch.bfloat16, rep, mesh, cluster, 2, False, True) >= bf16
    rate = cluster.device.update_rate(2, 4096 * 1024)
    if rate:  # the loop as timed: its elements at the rate measured for its size
        assert times[2] == pytest.approx(4096 * 1024 / rate)
        small, large = (cluster.device.update_rate(2, n) for n in (1024, 2**30))
        assert small >= rate >= large  # flat past the measured sizes, falling between


GLOO_LINKS = [  # as `autopar calibrate` fit gloo on 4 CPU processes
    Link(3.6e9, 1e-3, kind_efficiency=(("all_gather", 0.1), ("all_reduce", 0.58),
                                       ("reduce_scatter", 0.06))),
    # per kind: an all-gather's bytes faster than an all-reduce's, every step ~1 ms
    Link(2.4e9, 2.7e-4, kind_efficiency=(("all_gather", 0.69), ("all_reduce", 0.62),
                                         ("reduce_scatter", 0.25)),
         kind_latency=(("all_gather", 2.9), ("all_reduce", 3.5), ("reduce_scatter", 4.3))),
]  # fmt: skip


@pytest.mark.parametrize("link", GLOO_LINKS, ids=["gathers-dearer", "latency-bound"])
def test_auto_never_loses_to_a_pinned_role_on_a_gloo_like_cluster(link: Link) -> None:
    """Where gathers and reductions cost very differently, or each collective's latency is
    ~1 ms (gloo as `autopar calibrate` fits it, a slow optimizer update), the ILP's bound
    (every collective waited, each small gradient's all-reduce with its own latency)
    prefers plans whose collectives cannot overlap or bucket: the candidate whose gradient
    reductions lean on the overlap but whose gathers do not (`intra_op.DP_SCALES`) is DP's,
    which the overlapped step ranks first."""
    from autopar.cli.sources import load_model

    cpu = Cluster.preset("cpu", mesh=(4,), axis_names=("dp",))
    flops = {"float32": 54e9, "bfloat16": 25e9, "float16": 25e9}
    device = replace(cpu.device, peak_flops=flops, memory_bandwidth=2.6e9)
    cluster = replace(cpu, device=device, links=(link,))
    model, batch = load_model("gpt", "small", 16, seed=0)[:2]
    auto = autopar.plan(model, batch, cluster=cluster).predicted_step_time
    for role in ("dp", "fsdp", "tp"):
        pinned = autopar.plan(model, batch, cluster=cluster, strategy=role).predicted_step_time
        assert auto <= pinned * (1 + 1e-3), (role, auto, pinned)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_fused_buffers_pay_their_copies(cluster: Cluster) -> None:
    """A collective of two or more tensors copies them in and out of its flat buffer on the
    device (`buckets.copy_time`, as `passes.comm` and the pipeline's gradient sync run it);
    one tensor alone is not copied."""
    n, nbytes = cluster.mesh_shape[0], 8 * MIB

    def moved(b: float) -> float:
        return compute.compute_time(0.0, b, "float32", cluster, op="memory")

    copy = buckets.copy_time
    assert copy("all_reduce", nbytes, 0, cluster) == pytest.approx(moved(2 * nbytes))
    assert copy("reduce_scatter", nbytes, 0, cluster) == pytest.approx(moved(2 * nbytes))
    gather = moved(2 * (nbytes / n + nbytes))  # the shards in, every member out
    assert copy("all_gather", nbytes, 0, cluster) == pytest.approx(gather)
    back = copy("all_reduce", nbytes, 0, cluster, back=True)
    assert back == pytest.approx(moved(4 * nbytes))
    scatter_back = copy("reduce_scatter", nbytes, 0, cluster, back=True)
    assert scatter_back == pytest.approx(moved(2 * (nbytes + nbytes / n)))
    assert copy("all_reduce", 0.0, 0, cluster) == 0.0
    one = Cluster.preset("cpu", mesh=(1,))
    assert copy("all_reduce", nbytes, 0, one) == 0.0  # nothing moves between devices
    for kind in REDUCTIONS:
        assert copy(kind, 2 * nbytes, 0, cluster) >= copy(kind, nbytes, 0, cluster)
        alone = [(("k",), kind, 0, nbytes)]
        assert buckets.fused_copies(alone, cluster) == 0.0
        pair = [(("k",), kind, 0, nbytes), (("k",), kind, 0, 3 * nbytes)]
        assert buckets.fused_copies(pair, cluster) == pytest.approx(
            copy(kind, 4 * nbytes, 0, cluster)
        )
        # two keys of one tensor each: nothing fused
        apart = [(("k",), kind, 0, nbytes), (("j",), kind, 0, nbytes)]
        assert buckets.fused_copies(apart, cluster) == 0.0


@pytest.mark.parametrize("cluster", CLUSTERS, ids=IDS)
def test_prefetched_gathers_hide_only_what_the_device_hides(cluster: Cluster) -> None:
    """A step's FSDP gathers, prefetched a layer ahead (`search.step.overlapped_time`): a
    device that hides nothing (`overlap_efficiency` 0) waits every gather in full, and
    hiding less never steps faster."""
    from autopar.plan import DEFAULT_COMM
    from autopar.search.step import Part, overlapped_time

    def parts() -> list[Part]:
        out = []
        for i in range(4):  # two weights per layer, gathered as one fused collective
            gathers = [(("ag",), Collective.ALL_GATHER, 0, 4 * MIB)] * 2
            out.append(Part(forward=1e-2 * (i + 1), backward=2e-2 * (i + 1), gathers=gathers))
        return out

    steps = []
    for e in (1.0, 0.5, 0.0):
        steps.append(overlapped_time(parts(), _with_overlap(cluster, e), DEFAULT_COMM))
    assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(steps)), steps
    none = _with_overlap(cluster, 0.0)
    compute_s = sum(p.forward + p.backward for p in parts())
    gather = buckets.fused_time(parts()[0].gathers, none)
    copies = buckets.fused_copies(parts()[0].gathers, none)
    assert steps[-1] == pytest.approx(compute_s + 4 * (gather + copies), rel=1e-9)


def test_an_axis_of_one_device_moves_nothing() -> None:
    """DTensor skips the redistribution on a mesh axis of size 1 (no collective is
    issued), so no price, not even a launch: a (4, 1) mesh prices like a (4,) one."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from autopar.cost_models.reshard import reshard_seconds

    wide = Cluster.preset("cpu", mesh=(4, 1), axis_names=("dp", "tp"))
    flat = Cluster.preset("cpu", mesh=(4,), axis_names=("dp",))
    s0, r = Shard(0), Replicate()
    shape = (8, 64, 256)
    assert reshard_seconds(wide, (s0, Partial()), (s0, r), shape, 4) == 0.0
    assert reshard_seconds(wide, (s0, r), (s0, Shard(2)), shape, 4) == 0.0
    both = reshard_seconds(wide, (Partial(), Partial()), (r, r), shape, 4)
    assert both == reshard_seconds(flat, (Partial(),), (r,), shape, 4) > 0.0


def test_a_tp_input_gradient_all_reduce_hides_under_the_weight_gradient() -> None:
    """`passes.comm` issues a column-parallel Linear's input-gradient all-reduce as soon as
    that gradient exists, so the weight gradient computed after it runs meanwhile: the
    predicted step of a TP plan hides it (`Part.hideable`, never more than half of a
    matmul's backward nor more than what the part waits for), in proportion to how much
    the device hides, and not at all without the pass's overlap."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.capture import capture
    from autopar.plan import DEFAULT_COMM, CommPlan
    from autopar.planning import fake_group
    from autopar.search.intra_op import solve_intra
    from autopar.search.pins import SearchOptions
    from autopar.search.step import overlapped_time, program_parts
    from samples import get_sample

    sample = get_sample("gpt")
    model = sample.build("tiny", device="meta")
    batch = sample.example_batch(model, 8, device="meta")
    h100 = Cluster.preset("dgx-h100", nodes=1)
    cluster = replace(h100, mesh_shape=(8,), axis_names=("tp",), links=h100.links[-1:])
    with fake_group(8):
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
        graph = capture(model, batch)
        result = solve_intra(graph, cluster, mesh, SearchOptions(strategy="tp"))
    parts = program_parts(graph, result)
    hideable = sum(p.hideable * p.weight for p in parts)
    assert 0 < hideable <= sum(p.exposed * p.weight for p in parts)
    assert all(p.hideable <= p.backward / 2 * (1 + 1e-12) for p in parts)
    steps = {
        e: overlapped_time(parts, _with_overlap(cluster, e), DEFAULT_COMM) for e in (1, 0.5, 0)
    }
    assert steps[1] < steps[0.5] < steps[0]
    assert steps[0] - steps[1] == pytest.approx(hideable, rel=1e-9)
    # waited at once without the pass's overlap: nothing hidden
    waited = overlapped_time(parts, cluster, CommPlan(overlap=False))
    assert waited - steps[1] >= hideable * (1 - 1e-9)

"""autopar's layouts for Megatron-Core's H100 weak-scaling runs, priced beside Megatron's own.

    python benchmarks/megatron_weak_scaling.py [--rows 1.7b,7.1b] [--csv out.csv] [--full-plan]
                                               [--device-from h100.json]

Rows (GPT, seq 4096, vocab 131072, bf16, the cross-entropy on fp32 logits as Megatron-Core
computes it, 48-way data parallel in Megatron's runs): the
cluster is `dgx-h100` with 48 * TP * PP GPUs on its own mesh, so autopar's default call
searches the layout (`autopar.planning.searches_layout`). For each row the layout search
(`autopar.search.layouts`) picks pp / dp / tp / microbatches / schedule, and the same
pricer prices Megatron's (TP, PP) with dp = 48, one sequence per microbatch (the rest,
placements and schedule, left to the same search; without a pipeline, Megatron's rows
accumulate gradients over 4 microbatches, priced as autopar runs that: a pipeline of one
rank, each stage's gradient reduction after its last backward). Both are priced as Megatron
trains them: the bf16 mixed-precision policy (fp32 master and Adam states, bf16 compute, fp32
gradient reduction), ZeRO-1 (Megatron's distributed optimizer, `shard_optimizer=True`),
and activation recompute per layer where it pays (searched), by autopar's cost model:
roofline at the achieved efficiencies of the `dgx-h100` preset (GEMM, attention,
memory-bound kernels, launches), collectives at nccl-tests bus bandwidth (ring/tree), and
the overlap autopar's runtime gets (`passes.comm`: bucketed gradient reductions issued
during backward, prefetched gathers; `cost_models.buckets`; a column-parallel Linear's
input-gradient all-reduce issued before its weight gradient is computed, as Megatron's
asynchronous TP all-reduce, `search.step`). Megatron-Core's H100 runs also overlap the
forward's tensor-parallel collectives with the GEMMs (`--tp-comm-overlap`: each split into
chunks pipelined with the GEMM's), which autopar does not run, so the priced Megatron rows
with TP 8 and no pipeline (32b) are slower than measured by about that communication, and
by more: its published step is below the floor of its configuration (below).
"error" is priced / published - 1. "peak" is the memory a rank
really holds under that plan (parameters, states, gradients, saved and gathered tensors).

`--device-from FILE` prices every row with the device of a cluster file (what `autopar
calibrate --nproc 8 -o h100.json` measures on one DGX H100 under NCCL: GEMM rates by shape,
attention, memory-bound kernels, optimizer updates, launches) in place of the preset's
published efficiencies; the links stay the preset's (one node cannot measure the fabric
between nodes).

TFLOP/s per GPU use the model FLOPs of Megatron's formula without recompute:
72 * B * s * L * h^2 * (1 + s / (6h) + V / (12 L h)) per step.
"ok": autopar's layout is at least as fast as Megatron's under the same cost model, with
TP inside a node.

"published_s" is the step the published TFLOP/s imply; for the rows without a pipeline,
"floor_fp32_s" / "floor_bf16_s" are the fastest step Megatron's configuration admits with
its gradients reduced in fp32 (what the pricing assumes: Megatron-LM's default for bf16,
`accumulate_allreduce_grads_in_fp32`) or in bf16 (`--grad-reduce-in-bf16`), whatever the
kernels: every hardware FLOP (attention under its causal mask) at the preset's large-GEMM
rate, no memory-bound op, every tensor-parallel collective hidden, and the data-parallel
traffic of a rank's parameters (ZeRO-1: gradient reduce-scatter, bf16 parameter all-gather,
at the preset's link rates) hidden only where Megatron overlaps it: the reduce-scatter
under the last microbatch's backward (2/3 of its compute), the all-gather under the first
one's forward (1/3). A published step below its floor says the run was not configured as
priced. `--full-plan` also times the default `autopar.plan(...)` end to end
(layout search, full capture, final ILP) on the largest row selected.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.cluster import Cluster  # noqa: E402
from autopar.cost_models.comm import Collective, collective_time  # noqa: E402
from autopar.planning import fake_group  # noqa: E402
from autopar.search.layouts import Layout, _Pricer, search_layout  # noqa: E402
from autopar.search.pins import SearchOptions  # noqa: E402
from autopar.views.bench import write_rows_csv  # noqa: E402
from samples import get_sample  # noqa: E402
from samples.gpt import MEGATRON_SHAPES  # noqa: E402

# row -> (Megatron TP, PP, global batch, measured TFLOP/s per GPU)
MEGATRON = {
    "1.7b": (1, 1, 192, 409),
    "7.1b": (2, 1, 192, 466),
    "16b": (4, 1, 192, 489),
    "32b": (8, 1, 192, 460),
    "70b": (8, 2, 384, 420),
    "177b": (8, 6, 1152, 433),
    "462b": (8, 16, 3072, 460),
}
DP = 48
SEQ, VOCAB = 4096, 131072
GiB = 2**30


def model_flops(row: str, batch: int) -> float:
    h, layers, _ = MEGATRON_SHAPES[row]
    return 72 * batch * SEQ * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (12 * layers * h))


def hardware_flops(row: str, batch: int) -> float:
    """`model_flops` with attention's score and value products under their causal mask
    (half the square: what a flash kernel that skips masked tiles computes)."""
    h, layers, _ = MEGATRON_SHAPES[row]
    return 72 * batch * SEQ * layers * h * h * (1 + SEQ / (12 * h) + VOCAB / (12 * layers * h))


def floor_seconds(row: str, model, cluster: Cluster, grad_bytes: int) -> float:
    """The fastest step Megatron's layout of `row` admits without a pipeline (module
    docstring): compute C = a rank's hardware FLOPs at the large-GEMM rate, and what of the
    data-parallel reduce-scatter and all-gather exceeds its overlap window (the last
    microbatch's backward, 2/3 of C / M, and the first one's forward, 1/3 of C / M)."""
    tp, pp, batch, _ = MEGATRON[row]
    if pp > 1:
        return float("nan")
    layout = Layout(pp, DP, tp, batch // DP)
    mesh = layout.cluster(cluster)
    device = cluster.device
    compute = hardware_flops(row, batch) / (DP * tp)
    compute /= device.peak_flops_for("bfloat16") * device.matmul_efficiency
    per_microbatch = compute / layout.microbatches
    params = sum(p.numel() for p in model.parameters()) / tp  # vocab-parallel embeddings too
    scatter = collective_time(Collective.REDUCE_SCATTER, params * grad_bytes, "dp", mesh)
    gather = collective_time(Collective.ALL_GATHER, params * 2, "dp", mesh)
    return (
        compute
        + max(0.0, scatter - 2 / 3 * per_microbatch)
        + max(0.0, gather - 1 / 3 * per_microbatch)
    )


def row_cluster(row: str, device_from: str | None) -> Cluster:
    """The row's `dgx-h100` cluster; with `device_from`, that cluster file's device."""
    tp, pp, _, _ = MEGATRON[row]
    cluster = Cluster.preset("dgx-h100", nodes=DP * tp * pp // 8)
    if device_from is None:
        return cluster
    return dataclasses.replace(cluster, device=Cluster.load(device_from).device)


def run_row(row: str, device_from: str | None = None) -> dict:
    tp, pp, batch, measured = MEGATRON[row]
    world = DP * tp * pp
    cluster = row_cluster(row, device_from)
    sample = get_sample("gpt")
    model = sample.build(f"megatron-{row}", device="meta")
    inputs = sample.example_batch(model, batch, device="meta")
    # the bf16 policy on a model captured in its compute dtype (what the policy captures)
    options = SearchOptions(shard_optimizer=True, mixed_precision=True, reduce_itemsize=4)
    with fake_group(world):
        t0 = time.perf_counter()
        ours = search_layout(model, inputs, cluster, options)
        search_s = time.perf_counter() - t0
        pricer = _Pricer(model, inputs, cluster, options, None)
        megatron = Layout(pp, DP, tp, batch // DP)  # pp 1: accumulating 1-row microbatches
        try:
            m_step, m_peak, m_layout = pricer.price(megatron, None)
        except ValueError as exc:  # does not fit under this cost model
            m_step, m_peak, m_layout = float("inf"), float("nan"), megatron
            print(f"  {row}: Megatron's layout does not fit: {str(exc)[:160]}")
    best = ours.best
    tp_link = best.cluster(cluster).link("tp") if best.tp > 1 else None
    flops = model_flops(row, batch)
    return {
        "row": row,
        "gpus": world,
        "tp": best.tp,
        "pp": best.pp,
        "dp": best.dp,
        "schedule": best.schedule or "-",
        "microbatches": best.microbatches,
        "step_s": ours.step_time,
        "peak_gib": ours.peak_memory / GiB,
        "tflops": flops / ours.step_time / world / 1e12,
        "megatron_layout": m_layout.key,
        "megatron_step_s": m_step,
        "megatron_peak_gib": m_peak / GiB,
        "megatron_priced_tflops": flops / m_step / world / 1e12,
        "megatron_measured_tflops": measured,
        "error": flops / m_step / world / 1e12 / measured - 1,
        "x_megatron": ours.step_time / m_step,
        "published_s": flops / (measured * 1e12 * world),
        "floor_fp32_s": floor_seconds(row, model, cluster, 4),
        "floor_bf16_s": floor_seconds(row, model, cluster, 2),
        "tp_inside_node": tp_link is None or tp_link == cluster.fabric.intra,
        "fits": ours.peak_memory <= cluster.device.memory_bytes,
        "search_s": search_s,
        "ok": ours.step_time <= m_step * (1 + 1e-9)
        and (tp_link is None or tp_link == cluster.fabric.intra),
    }


def full_plan_seconds(row: str, device_from: str | None = None) -> tuple[float, str]:
    _, _, batch, _ = MEGATRON[row]
    cluster = row_cluster(row, device_from)
    sample = get_sample("gpt")
    model = sample.build(f"megatron-{row}", device="meta").float()  # the user's fp32 model
    inputs = sample.example_batch(model, batch, device="meta")
    t0 = time.perf_counter()
    plan = autopar.plan(  # the default call: the layout is searched on the preset's mesh
        model,
        inputs,
        cluster=cluster,
        shard_optimizer=True,
        mixed_precision="bf16",
    )
    return time.perf_counter() - t0, plan.solver["layout"]


COLUMNS = [
    ("row", "{}"),
    ("gpus", "{}"),
    ("tp", "{}"),
    ("pp", "{}"),
    ("dp", "{}"),
    ("schedule", "{}"),
    ("microbatches", "{}"),
    ("step_s", "{:.2f}"),
    ("peak_gib", "{:.1f}"),
    ("tflops", "{:.0f}"),
    ("megatron_layout", "{}"),
    ("megatron_step_s", "{:.2f}"),
    ("megatron_priced_tflops", "{:.0f}"),
    ("megatron_measured_tflops", "{}"),
    ("error", "{:+.0%}"),
    ("published_s", "{:.3f}"),
    ("floor_fp32_s", "{:.3f}"),
    ("floor_bf16_s", "{:.3f}"),
    ("x_megatron", "{:.3f}"),
    ("tp_inside_node", "{}"),
    ("fits", "{}"),
    ("search_s", "{:.1f}"),
    ("ok", "{}"),
]


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(MEGATRON))
    parser.add_argument("--csv", default="build/megatron_weak_scaling.csv")
    parser.add_argument("--full-plan", action="store_true")
    parser.add_argument("--device-from", help="a cluster file whose device prices the rows")
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    results = []
    print(" | ".join(name for name, _ in COLUMNS))
    for row in rows:
        r = run_row(row, args.device_from)
        results.append(r)
        print(" | ".join(fmt.format(r[name]) for name, fmt in COLUMNS), flush=True)
    write_rows_csv(args.csv, results)
    print(f"wrote {args.csv}")
    within = sum(abs(r["error"]) <= 0.15 for r in results)
    print(f"Megatron's layouts priced within 15% of the published TFLOP/s: {within}/{len(results)}")
    below = [r["row"] for r in results if r["published_s"] < r["floor_fp32_s"]]
    if below:
        print(
            f"published step below the floor of its priced configuration (fp32 gradient "
            f"reduction): {', '.join(below)}: those runs reduced fewer bytes or overlapped "
            f"more than priced"
        )
    ok = sum(r["ok"] for r in results)
    print(f"autopar at least as fast as Megatron's layout, TP inside a node: {ok}/{len(results)}")
    if args.full_plan:
        seconds, layout = full_plan_seconds(rows[-1], args.device_from)
        print(f"autopar.plan end to end for {rows[-1]}: {seconds:.1f} s -> {layout}")


if __name__ == "__main__":
    main()

"""autopar's step time against torch's own DDP, FSDP2 and tensor parallelism, in one run.

    python benchmarks/bench_runtime.py [--sample gpt] [--config small] [--batch 16]
                                       [--families dp,fsdp,tp] [--warmup 3] [--steps 10]
                                       [--profile 3] [--csv build/bench_runtime.csv]
                                       [--compare-off] [--cluster build/cluster.json]

The defaults are issue 10's setup: the GPT sample's "small" config (4 layers, d=256,
vocab 512, sequence 128), a global batch of 16, on 4 local gloo processes (one spawn for
every run, one thread per process). Each family trains the same seeded model on the same
batch with AdamW (lr `autopar.testing.reference.LR`, activation checkpointing off):

    dp    autopar.compile(strategy="dp")   vs  DistributedDataParallel
    fsdp  autopar.compile(strategy="fsdp", reshard_after_forward=True)
                                           vs  fully_shard per block, then the root (FSDP2)
    tp    autopar.compile(strategy="tp")   vs  parallelize_module: ColwiseParallel on c_attn /
                                               c_fc, RowwiseParallel on attn.c_proj / mlp.c_proj
                                               (c_attn's rows regrouped so each rank's chunk is
                                               its heads' q, k, v; the attention runs on the
                                               local heads), the rest replicated

A step is forward + backward + optimizer step, synchronised by `float(loss)`; its time is
the slowest rank's. A family's implementations train in rounds, one step of each per round
(`run_family`), so that the machine's load falls on both alike; the table shows the median
over `--steps` after `--warmup`, the ratio
torch / autopar (speed: > 1 means autopar is faster), the CPU seconds a step takes on all
ranks together (each rank's median `time.process_time()` over its steps, its collective
threads' included, summed) and their ratio torch / autopar, and autopar's predicted step
time (`plan.predicted_step_time`). Where processes share cores (4 ranks on a 2-core box) a
step is CPU bound and the ranks' scheduling moves its wall time by several %; the CPU
column is the one to compare there (2026-11-30: dp 0.96-0.98x DDP in wall time, 0.99x
in CPU; 2026-11-30 evening, 20 steps: 1.00x in both). Both run in processes that keep
their freed host memory (`autopar.devices.cache_host_memory`, set by `init_rank` and by
`autopar.compile` on a CPU mesh). The losses of each pair must agree at every step (`--tol`,
relative): the bench exits 1 when a run diverges.

`--cluster FILE` plans autopar's runs on a calibrated cluster (`autopar calibrate`: gloo's
collectives as measured, each kind at its own rate) instead of the "cpu" preset's.

`--compare-off` also times autopar's program without the communication pass
(`autopar.passes.comm`: gradient buckets, collectives issued early and waited late), as
"autopar-off", in the same run: before/after on the same load.

`--profile N` runs N more steps of every run under torch.profiler on rank 0 and splits the
step into compute (self time of aten ops), collectives (launch + wait: c10d / gloo /
functional collectives), and the rest (Python: the FX program's glue, the optimizer loop),
with the number of collectives per step; for autopar also the collectives its lowered
program issues (static count) -- where autopar's extra time goes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.cli.sources import load_model  # noqa: E402
from autopar.devices import free_port  # noqa: E402
from autopar.passes.comm import OFF as COMM_OFF  # noqa: E402
from autopar.runtime.parallel_model import ParallelModel  # noqa: E402
from autopar.testing.reference import LR  # noqa: E402
from autopar.views.bench import write_rows_csv  # noqa: E402

WORLD = 4
FAMILIES = ("dp", "fsdp", "tp")
# family -> (autopar mesh axis, strategy, extra compile keywords)
AUTOPAR = {
    "dp": ("dp", "dp", {}),
    "fsdp": ("dp", "fsdp", {"reshard_after_forward": True}),
    "tp": ("tp", "tp", {}),
}
TORCH_NAME = {"dp": "DDP", "fsdp": "FSDP2", "tp": "TP"}
COMM_KEYS = ("c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather", "allgather",
             "reduce_scatter", "wait_tensor", "broadcast")  # fmt: skip


# ---- the torch baselines -------------------------------------------------------------------
def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _local_rows(batch, rank: int, world: int):
    n = batch[0].shape[0] // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def _tp_attention_forward(self, x):
    """The GPT sample's attention on this rank's heads (n_head / n_embd are local counts)."""
    B, T, _ = x.shape
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    hd = self.n_embd // self.n_head
    q, k, v = (t.view(B, T, self.n_head, hd).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_embd))


def _regroup_qkv(linear: torch.nn.Linear, world: int) -> None:
    """Rows [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: rank r's colwise chunk holds the
    q, k and v of its heads."""
    d = linear.out_features // 3
    c = d // world
    idx = torch.cat(
        [torch.arange(r * c, (r + 1) * c) + j * d for r in range(world) for j in range(3)]
    )
    with torch.no_grad():
        linear.weight.copy_(linear.weight[idx])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[idx])


def torch_runner(family: str, model, batch, rank: int, world: int):
    """`(step_fn, phases)`: step_fn() -> local loss tensor; phases = (fwd_bwd, optimizer)."""
    from torch.distributed.device_mesh import init_device_mesh

    blocks = getattr(model, "h", None)
    if blocks is None or not all(hasattr(b, "attn") and hasattr(b, "mlp") for b in blocks):
        raise ValueError(
            f"the torch baselines wrap the GPT sample's layout (model.h[i].attn.c_attn, "
            f".mlp.c_fc, ...); {type(model).__name__} has another one: run with --sample gpt"
        )
    if family == "dp":
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model)
        inputs = _local_rows(batch, rank, world)
    elif family == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        module = fully_shard(model, mesh=mesh)
        inputs = _local_rows(batch, rank, world)
    elif family == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,))
        for block in model.h:
            attn = block.attn
            if attn.n_head % world:
                raise ValueError(f"tp: n_head={attn.n_head} is not divisible by {world}")
            _regroup_qkv(attn.c_attn, world)
            parallelize_module(
                block,
                mesh,
                {
                    "attn.c_attn": ColwiseParallel(),
                    "attn.c_proj": RowwiseParallel(),
                    "mlp.c_fc": ColwiseParallel(),
                    "mlp.c_proj": RowwiseParallel(),
                },
            )
            attn.n_head //= world
            attn.n_embd //= world
            attn.forward = types.MethodType(_tp_attention_forward, attn)
        module = model
        inputs = batch
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    opt = _optimizer(module.parameters())

    def fwd_bwd():
        loss = module(*inputs)
        loss.backward()
        return loss

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return fwd_bwd, opt_step


def autopar_runner(family: str, model, batch, comm: bool = True, cluster_file: str = ""):
    """autopar's compiled model; `comm=False`: its program without the communication pass
    (`autopar.passes.comm.OFF`: one collective per tensor, each waited at once);
    `cluster_file`: plan on that calibrated cluster (`autopar calibrate`), else the "cpu"
    preset's."""
    axis, strategy, extra = AUTOPAR[family]
    if cluster_file:
        cluster = autopar.Cluster.load(cluster_file).reshaped((WORLD,), (axis,))
    else:
        cluster = autopar.Cluster.local(mesh=(WORLD,), axis_names=(axis,))
    pm = autopar.compile(
        model,
        batch,
        cluster=cluster,
        strategy=strategy,
        optimizer=_optimizer,
        activation_checkpointing="none",
        **extra,
    )
    if not comm:
        pm = ParallelModel(model, pm.captured, pm.plan, pm.mesh, _optimizer, comm=COMM_OFF)
    return pm, (lambda: pm.forward_backward(*batch)), pm.optimizer_step


# ---- one run on every rank -------------------------------------------------------------------
def _global_loss(family: str, impl: str, loss: torch.Tensor) -> torch.Tensor:
    loss = loss.detach().clone()
    if impl == "torch" and family in ("dp", "fsdp"):  # each rank's loss is its rows' mean
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss


def prepare(family: str, impl: str, args, rank: int):
    """(row, forward-backward, optimizer step) of one implementation of a family."""
    model, batch = load_model(args.sample, args.config, args.batch, seed=0)
    out: dict = {"family": family, "impl": impl, "ms": [], "cpu": [], "losses": []}
    if impl.startswith("autopar"):
        pm, fwd_bwd, opt_step = autopar_runner(
            family, model, batch, impl == "autopar", args.cluster
        )
        out["predicted_ms"] = 1e3 * pm.plan.predicted_step_time
        gm = pm.program.gm
        out["program_collectives"] = sum(
            1
            for n in gm.graph.nodes
            if n.op == "call_function"
            and "c10d" in str(getattr(n.target, "namespace", n.target))
            and "wait" not in str(n.target)
        )
    else:
        fwd_bwd, opt_step = torch_runner(family, model, batch, rank, WORLD)
    return out, fwd_bwd, opt_step


def run_family(family: str, impls: tuple[str, ...], args, rank: int) -> list[dict]:
    """Every implementation of `family` prepared, then trained in rounds, one step of each
    per round (so that a slower spell of the shared machine falls on all alike: one
    implementation's steps run after the other's measured the same program up to 15%
    apart from one run to the next); each keeps its own model, so the losses are those of
    its own training."""
    runs = [prepare(family, impl, args, rank) for impl in impls]
    for i in range(args.warmup + args.steps):
        for out, fwd_bwd, opt_step in runs:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            loss = fwd_bwd()
            opt_step()
            float(loss.detach())  # synchronise (a no-op on CPU, a device sync on GPU)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            out["losses"].append(float(_global_loss(family, out["impl"], loss)))
            if i >= args.warmup:
                out["ms"].append(dt)
                out["cpu"].append(cpu)
    for out, fwd_bwd, opt_step in runs:
        slowest = torch.tensor(out["ms"], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out["ms"] = [1e3 * t for t in slowest.tolist()]
        cpu = torch.tensor([statistics.median(out["cpu"])], dtype=torch.float64)
        dist.all_reduce(cpu)  # every rank's (its threads' too): what the machine spent
        out["cpu_ms"] = 1e3 * cpu.item()
        if args.profile:
            out["profile"] = profile_steps(args.profile, fwd_bwd, opt_step, rank)
    dist.barrier()
    return [out for out, _, _ in runs]


def profile_steps(n: int, fwd_bwd, opt_step, rank: int) -> dict | None:
    from torch.profiler import ProfilerActivity, profile, record_function

    dist.barrier()
    if rank != 0:
        for _ in range(n):
            float(fwd_bwd().detach())
            opt_step()
        return None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            with record_function("bench::step"):
                with record_function("bench::fwd_bwd"):
                    float(fwd_bwd().detach())
                with record_function("bench::optimizer"):
                    opt_step()
    comm = compute = 0.0
    comm_calls = aten_calls = 0
    phases, comm_events, compute_events = {}, {}, {}
    for ev in prof.key_averages():
        name = ev.key
        if name.startswith("bench::"):
            phases[name[7:]] = ev.cpu_time_total / n / 1e3
            continue
        low = name.lower()
        if any(k in low for k in COMM_KEYS):
            comm += ev.self_cpu_time_total
            comm_events[name] = (ev.count / n, round(ev.self_cpu_time_total / n / 1e3, 2))
            # one event per collective: the process group's call (c10d::allreduce_, ...)
            if low.startswith("c10d::"):
                comm_calls += ev.count
        elif name.startswith("aten::"):
            compute += ev.self_cpu_time_total
            aten_calls += ev.count
            compute_events[name] = (ev.count / n, round(ev.self_cpu_time_total / n / 1e3, 2))
    step = phases.get("step", 0.0)
    comm_ms, compute_ms = comm / n / 1e3, compute / n / 1e3
    return {
        "step_ms": step,
        "fwd_bwd_ms": phases.get("fwd_bwd", 0.0),
        "optimizer_ms": phases.get("optimizer", 0.0),
        "comm_ms": comm_ms,
        "compute_ms": compute_ms,
        "other_ms": step - comm_ms - compute_ms,
        "comm_calls_per_step": comm_calls / n,
        "aten_calls_per_step": aten_calls / n,  # dispatched ops (nested ones included)
        "comm_events": comm_events,  # name -> (calls per step, self ms per step)
        "compute_events": compute_events,  # the same, aten ops
    }


def _worker(rank: int, world: int, port: int, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900)
    )
    try:
        results = []
        for family in args.families:
            impls = ("autopar", "torch") + (("autopar-off",) if args.compare_off else ())
            for r in run_family(family, impls, args, rank):
                results.append(r)
                if rank == 0:
                    ms = statistics.median(r["ms"])
                    print(f"  {family:5s} {r['impl']:8s} {ms:9.1f} ms", flush=True)
        if rank == 0:
            Path(out_dir, "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# ---- report --------------------------------------------------------------------------------
def check_losses(results: list[dict], tol: float) -> list[str]:
    """Each family's autopar and torch loss curves agree within `tol` (relative) everywhere."""
    by = {(r["family"], r["impl"]): r["losses"] for r in results}
    bad = []
    for family in dict.fromkeys(r["family"] for r in results):
        a, t = by[(family, "autopar")], by[(family, "torch")]
        for i, (x, y) in enumerate(zip(a, t, strict=True)):
            if not abs(x - y) <= tol * max(1.0, abs(y)):
                bad.append(f"{family}: step {i} autopar loss {x:.6f} vs torch {y:.6f}")
                break
    return bad


def rows_of(results: list[dict], args) -> list[dict]:
    med = {(r["family"], r["impl"]): statistics.median(r["ms"]) for r in results}
    cpu = {(r["family"], r["impl"]): r["cpu_ms"] for r in results}
    rows = []
    for r in results:
        fam, impl = r["family"], r["impl"]
        rows.append(
            {
                "family": fam,
                "impl": impl if impl.startswith("autopar") else TORCH_NAME[fam],
                "ms_median": round(med[(fam, impl)], 2),
                "ms_min": round(min(r["ms"]), 2),
                "speed_vs_torch": round(med[(fam, "torch")] / med[(fam, impl)], 3)
                if impl.startswith("autopar")
                else "",
                "cpu_ms": round(r["cpu_ms"], 1),
                "cpu_vs_torch": round(cpu[(fam, "torch")] / r["cpu_ms"], 3)
                if impl.startswith("autopar")
                else "",
                "predicted_ms": round(r["predicted_ms"], 2) if "predicted_ms" in r else "",
                "loss_first": round(r["losses"][0], 6),
                "loss_last": round(r["losses"][-1], 6),
                "config": f"{args.sample}/{args.config} batch {args.batch} x{WORLD} gloo",
                "steps": f"{args.warmup}+{args.steps}",
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'family':6s} {'impl':8s} {'ms/step':>9s} {'min':>9s} {'torch/ap':>9s} "
          f"{'cpu ms':>8s} {'cpu t/ap':>9s} {'predicted':>10s} {'loss0':>9s} "
          f"{'lossN':>9s}")  # fmt: skip
    for r in rows:
        ratio = f"{r['speed_vs_torch']:.2f}x" if r["speed_vs_torch"] != "" else ""
        cpu = f"{r['cpu_vs_torch']:.2f}x" if r["cpu_vs_torch"] != "" else ""
        pred = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] != "" else ""
        print(
            f"{r['family']:6s} {r['impl']:8s} {r['ms_median']:9.1f} {r['ms_min']:9.1f} "
            f"{ratio:>9s} {r['cpu_ms']:8.1f} {cpu:>9s} {pred:>10s} {r['loss_first']:9.4f} "
            f"{r['loss_last']:9.4f}"
        )


def print_profile(results: list[dict]) -> None:
    print("\nprofile (rank 0, ms per step): step = compute (aten self) + collectives + other")
    print(f"{'family':6s} {'impl':8s} {'step':>8s} {'fwd+bwd':>8s} {'optim':>8s} {'compute':>8s} "
          f"{'comm':>8s} {'other':>8s} {'colls':>6s} {'program':>8s}")  # fmt: skip
    for r in results:
        p = r.get("profile")
        if not p:
            continue
        impl = r["impl"] if r["impl"].startswith("autopar") else TORCH_NAME[r["family"]]
        print(
            f"{r['family']:6s} {impl:8s} {p['step_ms']:8.1f} {p['fwd_bwd_ms']:8.1f} "
            f"{p['optimizer_ms']:8.1f} {p['compute_ms']:8.1f} {p['comm_ms']:8.1f} "
            f"{p['other_ms']:8.1f} {p['comm_calls_per_step']:6.0f} "
            f"{r.get('program_collectives', ''):>8} {p['aten_calls_per_step']:9.0f}"
        )
    _print_events(results, "collective", "comm_events", 5)
    _print_events(results, "compute", "compute_events", 8)


def _print_events(results: list[dict], what: str, key: str, top: int) -> None:
    print(f"\n{what} events (calls/step, self ms/step), largest first:")
    for r in results:
        p = r.get("profile")
        if p:
            largest = sorted(p[key].items(), key=lambda kv: -kv[1][1])[:top]
            text = ", ".join(
                f"{k.removeprefix('aten::')} {c:g}x {ms:.1f}" for k, (c, ms) in largest
            )
            print(f"  {r['family']:5s} {r['impl']:8s} {text}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sample", default="gpt")
    p.add_argument("--config", default="small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--profile", type=int, default=0, help="profile N more steps on rank 0")
    p.add_argument("--tol", type=float, default=2e-3, help="relative loss agreement")
    p.add_argument("--csv", default="build/bench_runtime.csv")
    p.add_argument(
        "--cluster",
        default="",
        help="plan on this calibrated cluster file (autopar calibrate), else the cpu preset",
    )
    p.add_argument(
        "--compare-off",
        action="store_true",
        help="also run autopar without the communication pass (autopar-off)",
    )
    args = p.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if args.batch % WORLD:
        p.error(f"--batch {args.batch} is not divisible by the {WORLD} processes")

    print(f"{args.sample}/{args.config}, batch {args.batch}, {WORLD} gloo processes, "
          f"{args.warmup} warmup + {args.steps} timed steps")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(WORLD, free_port(), args, tmp), nprocs=WORLD, join=True)
        results = json.loads(Path(tmp, "results.json").read_text())
    rows = rows_of(results, args)
    print_table(rows)
    if args.profile:
        print_profile(results)
    write_rows_csv(args.csv, rows)
    print(f"\nwrote {args.csv}")
    bad = check_losses(results, args.tol)
    for line in bad:
        print(f"DIVERGED {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

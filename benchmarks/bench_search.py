"""How long the default `autopar.plan` takes at scale, and where the time goes.

    python benchmarks/bench_search.py [--rows llama3-8b,gpt3-175b,1t] [--out build/bench_search]
                                      [--pipeline-stages N]

Each row is timed end to end, from a model built on the meta device to a saved plan
(`Plan.save`), with `autopar.plan(model, batch, cluster=..., pipeline_stages="auto")`:
every dimension searched (pipeline degree, stage meshes, microbatches, schedule, then the
sharding and memory levers); `--pipeline-stages 1` times the intra-op search alone. Per-phase seconds come from
`autopar.search.progress` (capture, strategies, costs, ILP, layout search, assembly;
exclusive: a nested phase's time is not its parent's; with the layout search's degrees
priced on several processes, `search.workers`, a phase sums every process's time, so the
phases can add up to more than the total); the "cpu" line under each row is the CPU
seconds of this process and the search's forked ones (its pricing processes, and the
`autopar.forked` children: the template's trace at half the rows, the three-block check;
the total only, not per phase, and not before 2026-11-29's runs), the figure to compare
on a loaded machine. `AUTOPAR_SEARCH_PROCESSES=1` times the search on one process.

Rows (the issue's goals on a 2-core machine in brackets):
- llama3-8b: Llama-3-8B, batch 16 x 8192, 64 H100 in 8 nodes (<= 5 s)
- gpt3-175b: GPT-3 175B (96 layers, h 12288, seq 2048, batch 1536, bf16) on 1024 A100 (<= 20 s)
- 1t: 1T parameters (128 layers, h 25600, 160 heads, seq 2048, batch 3072, bf16) on
  3072 A100 (Megatron's 1T run, Narayanan et al. 2021) (<= 60 s)
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.search.progress import PHASES, recording  # noqa: E402
from samples import gpt, llama  # noqa: E402

GPT_ROWS = {  # name -> (config, global batch, preset, nodes)
    "gpt3-175b": (
        gpt.GPTConfig(50304, 2048, 96, 96, 12288, bias=False, dtype="bfloat16"),
        1536,
        "dgx-a100-80g",
        128,
    ),
    "1t": (
        gpt.GPTConfig(50304, 2048, 128, 160, 25600, bias=False, dtype="bfloat16"),
        3072,
        "dgx-a100-80g",
        384,
    ),
}
ROWS = ("llama3-8b", *GPT_ROWS)


def build_row(row: str):
    """(meta model, meta batch, cluster) of one row."""
    if row == "llama3-8b":
        with torch.device("meta"):
            model = llama.build("llama3-8b")
        batch = llama.example_batch("llama3-8b", 16, device="meta")
        return model, batch, autopar.Cluster.preset("dgx-h100", nodes=8)
    config, rows, preset, nodes = GPT_ROWS[row]
    with torch.device("meta"):
        model = gpt.GPT(config)
    idx = torch.zeros(rows, config.block_size, dtype=torch.long, device="meta")
    return model, (idx, idx), autopar.Cluster.preset(preset, nodes=nodes)


def run_row(row: str, out: Path, options: dict) -> dict:
    t0 = time.perf_counter()
    with recording() as rec:
        model, batch, cluster = build_row(row)
        plan = autopar.plan(model, batch, cluster=cluster, **options)
        plan.save(out / f"{row}.json")
    layout = plan.solver.get("layout") or (
        f"pp{plan.pipeline.pp} m{plan.pipeline.microbatches} {plan.pipeline.schedule}"
        if plan.pipeline
        else "pp1"
    )
    return {
        "row": row,
        "total_s": time.perf_counter() - t0,
        "total_cpu_s": rec.total_cpu,  # the search's forked processes' too
        **{p: rec.phases.get(p, 0.0) for p in PHASES},
        **{f"{p} cpu": rec.cpu.get(p, 0.0) for p in PHASES},
        "layout": layout,
        "mesh": "x".join(map(str, plan.mesh_shape)),
        "step_s": plan.predicted_step_time,
        "peak_gib": plan.predicted_peak_memory / 2**30,
        "candidates": rec.candidates,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out", default="build/bench_search")
    parser.add_argument("--pipeline-stages", default="auto")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ps = args.pipeline_stages
    options = {"pipeline_stages": ps if ps == "auto" else int(ps)}
    if options["pipeline_stages"] == 1:
        options["pipeline_stages"] = None  # no pipeline
    warnings.filterwarnings("ignore")
    head = f"{'row':<10} {'total':>7} " + " ".join(f"{p[:9]:>9}" for p in PHASES)
    print(head + "  layout / mesh / step / peak / candidates")
    for row in args.rows.split(","):
        r = run_row(row, out, options)
        phases = " ".join(f"{r[p]:9.2f}" for p in PHASES)
        print(
            f"{row:<10} {r['total_s']:7.2f} {phases}  {r['layout']} / {r['mesh']} / "
            f"{r['step_s']:.3f} s / {r['peak_gib']:.1f} GiB / {r['candidates']}",
            flush=True,
        )
        cpu = " ".join(f"{r[p + ' cpu']:9.2f}" for p in PHASES)
        print(f"{'  cpu':<10} {r['total_cpu_s']:7.2f} {cpu}", flush=True)


if __name__ == "__main__":
    main()

"""Lowering time (plan -> per-rank program) with autopar's tracing caches and without, in one run.

    python benchmarks/bench_lowering.py [--models gpt,llama,tests/models/hf_gpt2.py:build]
                                        [--world 4] [--csv build/bench_lowering.csv]

For each model ("tiny" config, batch 8) on a dp x tp mesh of `--world` local gloo processes
(2 x 2 by default; one thread each), planned with strategy ("dp", "tp"), every rank builds
the `ParallelModel` (lowering is nearly all of it) in two runs on fresh processes: with
DTensor as it ships under tracing (every op's sharding propagation, redistribution plan and
redistribution cost recomputed, the costs' own index arithmetic traced on fake tensors) and
with `autopar._compat.cached_sharding_propagation` (what `passes/lower.py` uses: DTensor's
eager caches, each cost computed once per pair of specs outside the fake mode). Each run
first lowers the MLP sample untimed and uncached (the process's warm-up). The table shows
the slowest rank's CPU seconds, the ratio, and each program's node count: without the
caches, the index arithmetic of every cost between strided shards is traced into the
program too (a Hugging Face GPT-2 block: 15,540 nodes instead of 660, every one run at each
step). That the programs compute the same numbers is the parity tests' subject.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.cli.sources import load_model  # noqa: E402
from autopar.options import PlanOptions  # noqa: E402
from autopar.rank_plans import plan_for_ranks  # noqa: E402
from autopar.runtime.parallel_model import ParallelModel  # noqa: E402
from autopar.testing.rank_pool import on_ranks  # noqa: E402

DEFAULT_MODELS = "gpt,llama,tests/models/hf_gpt2.py:build"


def _lower_seconds(model, batch, plan, captured, mesh, cached: bool) -> tuple[float, int]:
    import autopar.passes.lower as lower

    context = (
        contextlib.nullcontext()
        if cached
        else mock.patch.object(lower, "cached_sharding_propagation", contextlib.nullcontext)
    )
    with context:
        t = time.process_time()
        pm = ParallelModel(model, captured, plan, mesh, lambda ps: torch.optim.SGD(ps, lr=0.0))
        seconds = time.process_time() - t
    return seconds, len(pm.program.gm.graph.nodes)


def rank_times(models: list[str], mesh_shape: list[int], cached: bool) -> list[dict]:
    """On fresh ranks: one untimed lowering without the caches (the process's warm-up,
    which fills no cache), then each model's, timed, with or without them."""
    torch.set_num_threads(1)
    cluster = autopar.Cluster.local(mesh=tuple(mesh_shape), axis_names=("dp", "tp"))
    options = PlanOptions(strategy=("dp", "tp"))
    rows = []
    for i, source in enumerate(["mlp", *models]):
        model, batch = load_model(source, "tiny", 8)
        plan, captured, mesh = plan_for_ranks(model, batch, cluster, None, options, None)
        seconds, nodes = _lower_seconds(model, batch, plan, captured, mesh, cached and i > 0)
        rows.append({"model": source, "seconds": seconds, "nodes": nodes})
    return rows[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--csv", default="build/bench_lowering.csv")
    args = parser.parse_args()
    models = args.models.split(",")
    mesh = [2, args.world // 2]
    runs = {
        key: on_ranks(args.world, "gloo", rank_times, models, mesh, key == "cached")
        for key in ("uncached", "cached")
    }
    print(f"lowering on {args.world} gloo processes, mesh {mesh} (dp, tp), CPU s, slowest rank")
    print(f"{'model':40} {'uncached':>9} {'cached':>8} {'speedup':>8} {'nodes':>14}")
    out = []
    for k, source in enumerate(models):
        slow = {key: max(rank[k]["seconds"] for rank in r) for key, r in runs.items()}
        nodes = {key: r[0][k]["nodes"] for key, r in runs.items()}
        ratio = slow["uncached"] / slow["cached"]
        print(
            f"{source:40} {slow['uncached']:9.2f} {slow['cached']:8.2f} {ratio:7.2f}x "
            f"{nodes['uncached']:>6} -> {nodes['cached']:<6}"
        )
        row = {"model": source, "speedup": ratio}
        row.update({f"{key}_s": v for key, v in slow.items()})
        row.update({f"{key}_nodes": v for key, v in nodes.items()})
        out.append(row)
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)


if __name__ == "__main__":
    main()

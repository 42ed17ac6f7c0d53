"""Measured against predicted memory per rank: `pm.memory_stats()` beside the plan's peak.

    python benchmarks/bench_memory.py [--samples gpt,llama] [--config tiny] [--batch 8]
                                      [--plans dp,fsdp,...] [--csv build/bench_memory.csv]

Every plan runs on 4 local gloo processes (one spawn for all plans,
`autopar.testing.memory`): the sample is compiled under the plan's mesh, strategy and
memory levers, trained 2 AdamW steps, and the 2nd step is measured by the storage-counting
mode of `autopar.runtime.memory_stats` (live tensor bytes, the same on CPU and GPU, not
RSS). The prediction is `plan.predicted_peak_memory` / `plan.predicted_memory`
(`autopar.search.peak`). A plan whose lever `autopar.compile` does not take prints
"n/a: not implemented". Goal: measured / predicted within 10% on every rank. The V-shaped
pipeline plans (two stages a rank) need 4 layers: `--config tiny4 --plans pp2xdp2+zbv,
pp2xdp2+zbv+zero1` (not in the default list).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.runtime.memory_stats import CATEGORIES  # noqa: E402
from autopar.testing.memory import MemoryCase, RankMemory, run_memory  # noqa: E402
from autopar.views.bench import write_rows_csv  # noqa: E402

WORLD = 4
# name -> (mesh, axis names, strategy, extra compile keywords, pipeline (schedule, M))
PLANS: dict[str, tuple] = {
    "dp": ((4,), ("dp",), "dp", {}, None),
    "fsdp": ((4,), ("dp",), "fsdp", {"activation_checkpointing": "none"}, None),
    "fsdp+ac": ((4,), ("dp",), "fsdp", {"activation_checkpointing": "full"}, None),
    "fsdp+reshard": ((4,), ("dp",), "fsdp", {"reshard_after_forward": True}, None),
    "tp": ((4,), ("tp",), "tp", {}, None),
    "dpxtp": ((2, 2), ("dp", "tp"), ("dp", "tp"), {}, None),
    "dp+bf16": ((4,), ("dp",), "dp", {"mixed_precision": "bf16"}, None),
    "dp+zero1": ((4,), ("dp",), "dp", {"shard_optimizer": True}, None),
    "dp+zero2": ((4,), ("dp",), "dp", {"shard_optimizer": True, "shard_gradients": True}, None),
    "pp2xdp2": ((2, 2), ("pp", "dp"), "dp", {}, ("1f1b", 2)),
    "pp2xdp2+zero1": ((2, 2), ("pp", "dp"), "dp", {"shard_optimizer": True}, ("1f1b", 2)),
    # gradient accumulation: a pipeline axis of 1, two microbatches of one row a replica
    "dpx4+acc2": ((1, 4), ("pp", "dp"), "dp", {}, ("1f1b", 2)),
    # two stages a rank: each stage's gradient buffers alive from its last backward on
    "pp2xdp2+zbv": ((2, 2), ("pp", "dp"), "dp", {}, ("zbv", 4)),
    "pp2xdp2+zbv+zero1": ((2, 2), ("pp", "dp"), "dp", {"shard_optimizer": True}, ("zbv", 4)),
}


def missing_levers(options: dict) -> list[str]:
    """The keywords of `options` that `autopar.compile` does not take (yet)."""
    taken = inspect.signature(autopar.compile).parameters
    return [k for k in options if k not in taken]


def make_cases(samples: list[str], plans: list[str], config: str, batch: int):
    cases, skipped = [], []
    for sample in samples:
        for name in plans:
            mesh, axes, strategy, options, pipe = PLANS[name]
            label = f"{sample}/{name}"
            if missing_levers(options):
                skipped.append(label)
                continue
            schedule, micro = pipe if pipe else (None, None)
            cases.append(
                MemoryCase(
                    label,
                    sample,
                    mesh,
                    axes,
                    strategy,
                    config=config,
                    batch_size=batch,
                    schedule=schedule,
                    microbatches=micro,
                    options=tuple(options.items()),
                )
            )
    return cases, skipped


def rows_of(results: list[list[RankMemory]]) -> list[dict]:
    rows = []
    for per_rank in results:
        for r in per_rank:
            row = {"plan": r.label, "rank": r.rank, "error": (r.error or "").strip()[-300:]}
            row.update(measured=r.peak, predicted=r.predicted_peak, ratio=r.ratio)
            for c in CATEGORIES:
                row[f"measured_{c}"] = r.measured.get(c, 0)
                row[f"predicted_{c}"] = r.predicted.get(c, 0.0)
            rows.append(row)
    return rows


def print_table(rows: list[dict], skipped: list[str]) -> None:
    short = {c: c[:5] for c in CATEGORIES}
    head = f"{'plan':<18}{'rank':>4}{'measured':>10}{'predicted':>10}{'ratio':>7}  "
    print(head + "  ".join(f"{short[c]:>13}" for c in CATEGORIES) + "   (KiB: meas/pred)")
    for row in rows:
        if row["error"]:
            print(f"{row['plan']:<18}{row['rank']:>4}  error: {row['error'].splitlines()[-1]}")
            continue
        cats = "  ".join(
            f"{row[f'measured_{c}'] / 1024:>6.1f}/{row[f'predicted_{c}'] / 1024:<6.1f}"
            for c in CATEGORIES
        )
        flag = "" if 0.9 <= row["ratio"] <= 1.1 else "  <-- off by >10%"
        print(
            f"{row['plan']:<18}{row['rank']:>4}{row['measured']:>10}{row['predicted']:>10.0f}"
            f"{row['ratio']:>7.3f}  {cats}{flag}"
        )
    for label in skipped:
        print(f"{label:<18}   -  n/a: not implemented")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", default="gpt,llama")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    # the V-shaped plans run 4 stages: 4 layers (`--config tiny4 --plans pp2xdp2+zbv,...`)
    ap.add_argument("--plans", default=",".join(p for p in PLANS if "zbv" not in p))
    ap.add_argument("--csv", default="build/bench_memory.csv")
    args = ap.parse_args()
    cases, skipped = make_cases(
        args.samples.split(","), args.plans.split(","), args.config, args.batch
    )
    rows = rows_of(run_memory(cases, WORLD)) if cases else []
    print_table(rows, skipped)
    if rows:
        write_rows_csv(args.csv, rows)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()

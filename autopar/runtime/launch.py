"""Per-rank entry point of `autopar run` (launched by torchrun: `-m autopar.runtime.launch`).

Every rank builds the sample with `torch.manual_seed(0)` and the same global batch; rank 0
also trains a copy on one device (AdamW, lr 1e-3, the same batch every step) for reference.
Then `autopar.compile` (pipelined with `--pipeline-stages`/a mesh axis named "pp",
`--microbatches`, `--schedule`) and `steps` training steps; rank 0 prints the plan summary
(and the pipeline timeline), one line per step comparing the loss with the single-device
loss, and the largest difference.
A failing rank raises, so torchrun exits non-zero.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

LR = 1e-3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="autopar.runtime.launch")
    p.add_argument("--sample", required=True)
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--mesh", default="2x2", help="e.g. 2x2")
    p.add_argument("--axis-names", default="dp,tp")
    p.add_argument("--strategy", default="auto", help="auto|dp|fsdp|tp or per axis: dp,tp")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plan", default=None, help="apply this saved plan instead of searching")
    p.add_argument("--pipeline-stages", type=int, default=None, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches")
    p.add_argument("--schedule", default=None, help="pipeline schedule, e.g. 1f1b")
    return p.parse_args(argv)


def reference_losses(model: nn.Module, batch: Sequence[torch.Tensor], steps: int) -> list[float]:
    """Single-device training of a copy of `model` on `batch`, `steps` AdamW steps."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train(args: argparse.Namespace, rank: int) -> None:
    import autopar
    from autopar.plan_views import timeline_text
    from samples import get_sample

    sample = get_sample(args.sample)
    torch.manual_seed(0)
    model = sample.build(args.config)
    batch = tuple(sample.example_batch(model, args.batch_size, seed=0))
    ref = reference_losses(model, batch, args.steps) if rank == 0 else []
    mesh = tuple(int(s) for s in args.mesh.lower().split("x"))
    strategy = tuple(args.strategy.split(","))
    cluster = autopar.Cluster.local(mesh=mesh, axis_names=tuple(args.axis_names.split(",")))
    pm = autopar.compile(
        model,
        batch,
        cluster=cluster,
        strategy=strategy[0] if len(strategy) == 1 else strategy,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
        plan=args.plan,
        pipeline_stages=args.pipeline_stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
    )
    if rank == 0:
        print(pm.plan.summary(), flush=True)
        if pm.plan.pipeline is not None:
            print(timeline_text(pm.plan), flush=True)
    worst = 0.0
    for step in range(args.steps):
        loss = pm.step(*batch)
        if rank == 0:
            diff = abs(loss - ref[step])
            worst = max(worst, diff) if not math.isnan(diff) else math.inf
            print(
                f"step {step + 1}  loss {loss:.6f}  single-device {ref[step]:.6f}  "
                f"|diff| {diff:.1e}",
                flush=True,
            )
    if rank == 0:
        print(f"max |loss - single-device| = {worst:.1e}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train(args, dist.get_rank())
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    main()

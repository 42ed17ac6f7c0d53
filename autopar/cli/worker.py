"""Per-rank entry point of `autopar run` (torchrun runs `-m autopar.cli.worker` on each rank).

Every rank builds the model from `--model` (a source as `autopar.cli.sources` reads it) with
the same seed and the same global batch; rank 0 also trains a copy on one device
(`autopar.testing.reference`: AdamW, lr 1e-3, the same batch every step). Then
`autopar.compile` (pipelined with `--pipeline-stages`/a mesh axis named "pp",
`--microbatches`, `--schedule`) and `--steps` training steps; rank 0 prints the plan summary
(and the pipeline timeline), one line per step comparing the loss with the single-device
loss, and the largest difference. A failing rank raises, so torchrun exits non-zero.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

import autopar
from autopar.cli.args import ERROR_DIR
from autopar.cli.sources import load_model
from autopar.devices import bind_local_device, choose_backend
from autopar.search.ilp import SolverTimeout
from autopar.testing.reference import LR, train_single_device
from autopar.views import summary, timeline_text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="autopar.cli.worker")
    p.add_argument("--model", required=True, help="sample name, module:factory or file.py:factory")
    p.add_argument("--config", default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--mesh", default="2x2", help="e.g. 2x2")
    p.add_argument("--axis-names", default="dp,tp")
    p.add_argument("--strategy", default="auto", help="auto|dp|fsdp|tp or per axis: dp,tp")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plan", default=None, help="apply this saved plan instead of searching")
    p.add_argument("--pipeline-stages", type=int, default=None, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches")
    p.add_argument("--schedule", default=None, help="pipeline schedule, e.g. 1f1b")
    p.add_argument("--mixed-precision", default=None, help="bf16 or fp16")
    p.add_argument("--shard-optimizer", action="store_true", help="ZeRO-1")
    p.add_argument("--shard-gradients", action="store_true", help="ZeRO-2")
    p.add_argument("--activation-checkpointing", default="auto", help="auto|none|selective|full")
    p.add_argument("--backend", default=None, help="gloo|nccl (default: nccl with a GPU per rank)")
    return p.parse_args(argv)


class PlanError(Exception):
    """What `autopar.compile` raised on this rank (`train`): its message is the user's
    (a model it cannot trace, a pipeline that does not fit, memory no plan fits)."""


def report(exc: PlanError, rank: int) -> None:
    """The message in `$AUTOPAR_ERROR_DIR/rank{rank}.txt`, which `autopar run` prints once
    for all ranks after torchrun exits; on stderr where no directory is given."""
    folder = os.environ.get(ERROR_DIR)
    if folder:
        with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
            f.write(str(exc))
    else:
        print(f"error: rank {rank}: {exc}", file=sys.stderr, flush=True)


def train(args: argparse.Namespace, rank: int) -> None:
    model, batch = load_model(args.model, args.config, args.batch_size)
    mp = args.mixed_precision
    # every rank's generator as it was before rank 0's reference and the planning drew from
    # it: the parallel run draws the reference's dropout masks, on every rank alike
    rng = torch.random.get_rng_state()
    ref, failed = [], None
    if rank == 0:  # on a copy of the model
        try:
            ref = train_single_device(
                model, batch, args.steps, grads=False, mixed_precision=mp
            ).losses
        except Exception as exc:  # noqa: BLE001 - the planner says why first, where it can
            failed = exc
    try:
        pm = compile_model(args, model, batch)
    except (ValueError, SolverTimeout) as exc:  # the planner's and capture's errors
        raise PlanError(str(exc).strip()) from exc
    if failed is not None:  # a model that trains on no device
        why = f"{type(failed).__name__}: {str(failed).strip()}"
        raise PlanError(f"the model does not train on one device: {why}") from failed
    torch.random.set_rng_state(rng)
    if rank == 0:
        print(summary(pm.plan), flush=True)
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


def compile_model(args: argparse.Namespace, model: torch.nn.Module, batch: tuple):
    """`autopar.compile` of the model as the arguments ask."""
    mesh = tuple(int(s) for s in args.mesh.lower().split("x"))
    strategy = tuple(args.strategy.split(","))
    cluster = autopar.Cluster.local(mesh=mesh, axis_names=tuple(args.axis_names.split(",")))
    return autopar.compile(
        model,
        batch,
        cluster=cluster,
        strategy=strategy[0] if len(strategy) == 1 else strategy,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
        plan=args.plan,
        pipeline_stages=args.pipeline_stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        mixed_precision=args.mixed_precision,
        shard_optimizer=args.shard_optimizer or args.shard_gradients,
        shard_gradients=args.shard_gradients,
        activation_checkpointing=args.activation_checkpointing,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = choose_backend(args.backend, local_world)
    bind_local_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        train(args, dist.get_rank())
        dist.barrier()
    except PlanError as exc:  # a message for the user, not a traceback per rank
        report(exc, dist.get_rank())
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    main()

"""Parity harness: a compiled model must train exactly like the single-device model.

`run_parity(cases, world_size)` spawns `world_size` local gloo processes; in each, for every
case it builds the model (a sample name or any model source `autopar.cli.sources` reads),
trains it on one device (the reference, `autopar.testing.reference`, computed locally by
every rank) and with autopar under the case's mesh and strategy, for `steps` AdamW steps on
the same global batch, and records the largest deviations of loss, gradients (this rank's
shard against the same shard of the reference gradient) and final parameters. It also
trains torch's own DDP on the same model and batch: DDP's parameter deviation is the
yardstick for parameters (Adam divides by sqrt(v), so float noise in near-zero gradients
moves a parameter by up to ~lr per step whatever the parallelization).

Used by the multi-process tests (parity, pipelining, fusion, inductor).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.cli.sources import load_model
from autopar.plan import Plan
from autopar.testing.reference import LR, train_single_device


@dataclass(frozen=True)
class ParityCase:
    sample: str  # a sample name or a model source (module:factory, file.py:factory)
    mesh: tuple[int, ...]
    axis_names: tuple[str, ...]
    strategy: str | tuple[str, ...] = "auto"
    config: str = "tiny"
    batch_size: int = 8
    steps: int = 3
    seed: int = 0
    schedule: str | None = None  # pipelining: mesh axis "pp" first
    microbatches: int | None = None
    fusion: str = "none"

    @property
    def label(self) -> str:
        strat = self.strategy if isinstance(self.strategy, str) else "x".join(self.strategy)
        label = f"{self.sample}-{'x'.join(map(str, self.mesh))}-{'x'.join(self.axis_names)}-{strat}"
        label += f"-{self.schedule}" if self.schedule else ""
        return label + (f"-fused-{self.fusion}" if self.fusion != "none" else "")


@dataclass
class ParityResult:
    label: str
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    loss_rel_err: float = 0.0
    grad_err: float = 0.0  # max |g - g_ref| / (|g_ref|_max + tiny), over params and steps
    grad_abs_err: float = 0.0
    param_err: float = 0.0  # max |p - p_ref| after the last step
    ddp_param_err: float = 0.0
    roles: dict[str, str] = field(default_factory=dict)
    param_specs: dict[str, str] = field(default_factory=dict)
    fusion: list[str] = field(default_factory=list)  # fused kernels, else the fusion mode
    step_program: str = ""  # type of what each step ran (ParallelModel only)
    error: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_parity(cases: list[ParityCase], world_size: int) -> list[ParityResult]:
    """Run every case on `world_size` spawned gloo ranks; rank results merged (worst)."""
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        mp.spawn(
            _worker,
            args=(world_size, port, [asdict(c) for c in cases], tmp),
            nprocs=world_size,
            join=True,
        )
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
    return [_merge([ParityResult(**rank[i]) for rank in per_rank]) for i in range(len(cases))]


def _merge(results: list[ParityResult]) -> ParityResult:
    out = results[0]
    for r in results[1:]:
        out.grad_err = max(out.grad_err, r.grad_err)
        out.grad_abs_err = max(out.grad_abs_err, r.grad_abs_err)
        out.param_err = max(out.param_err, r.param_err)
        out.error = out.error or r.error
    return out


def _worker(rank: int, world: int, port: int, cases: list[dict], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a rank that fails mid-collective must not leave the others waiting for 30 minutes
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    results = []
    try:
        for raw in cases:
            case = ParityCase(
                **{
                    **raw,
                    "mesh": tuple(raw["mesh"]),
                    "axis_names": tuple(raw["axis_names"]),
                    "strategy": raw["strategy"]
                    if isinstance(raw["strategy"], str)
                    else tuple(raw["strategy"]),
                }
            )
            try:
                results.append(asdict(run_case(case)))
            except Exception:
                results.append(asdict(ParityResult(case.label, error=traceback.format_exc())))
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def ddp_param_error(model, batch, steps: int, ref_params) -> float:
    """How far torch's DDP (world = all ranks, batch split on dim 0) lands from the reference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    local = copy.deepcopy(model)
    ddp = DDP(local)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    shard = [t.chunk(dist.get_world_size(), 0)[dist.get_rank()] for t in batch]
    for _ in range(steps):
        ddp(*shard).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = local.state_dict()
    return max((state[k] - v).abs().max().item() for k, v in ref_params.items())


def fused_kernels(plan: Plan) -> list[str]:
    """The kernel of each fused region, or ["inductor"] when torch.compile runs the program."""
    if plan.fusion == "inductor":
        return ["inductor"]
    return [r.kernel for r in plan.fused_regions]


def run_case(case: ParityCase) -> ParityResult:
    import autopar
    from autopar.plan import parse_spec
    from autopar.runtime.shards import local_chunk
    from autopar.views import axis_roles

    model, batch = load_model(case.sample, case.config, case.batch_size, seed=case.seed)
    ref = train_single_device(model, batch, case.steps)
    cluster = autopar.Cluster.local(mesh=case.mesh, axis_names=case.axis_names)
    pm = autopar.compile(
        model,
        batch,
        cluster=cluster,
        strategy=case.strategy,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
        schedule=case.schedule,
        microbatches=case.microbatches,
        fusion=case.fusion,
    )
    res = ParityResult(
        case.label,
        ref_losses=ref.losses,
        roles=dict(zip(pm.plan.stage_axis_names, axis_roles(pm.plan), strict=True)),
        param_specs={t.fqn: t.spec for t in pm.plan.tensors if t.kind == "param"},
        fusion=fused_kernels(pm.plan),
        step_program=type(getattr(pm, "step_program", None)).__name__,
    )
    specs = {t.fqn: parse_spec(t.spec) for t in pm.plan.tensors if t.kind == "param"}
    for step in range(case.steps):
        loss = float(pm.forward_backward(*batch))
        res.losses.append(loss)
        for fqn, grad in pm.local_grads().items():
            want = local_chunk(ref.grads[step][fqn], specs[fqn], pm.mesh)
            err = (grad - want).abs().max().item()
            res.grad_abs_err = max(res.grad_abs_err, err)
            res.grad_err = max(res.grad_err, err / (want.abs().max().item() + 1e-12))
        pm.optimizer_step()
    res.loss_rel_err = max(abs(a - b) / abs(b) for a, b in zip(res.losses, ref.losses, strict=True))
    full = pm.full_state_dict()
    res.param_err = max((full[k] - v).abs().max().item() for k, v in ref.state.items())
    res.ddp_param_err = ddp_param_error(model, batch, case.steps, ref.state)
    return res

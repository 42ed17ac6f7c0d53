"""Parity harness: a compiled model must train exactly like the single-device model.

`run_parity(cases)` runs each case on as many local processes as its mesh has devices, on
the backend `test_backend` picks (NCCL, one GPU per rank, when `AUTOPAR_TEST_BACKEND=nccl`
or when there is a GPU per rank; gloo on CPU otherwise); in each, for every case it builds
the model (a sample name or any model source `autopar.cli.sources` reads),
trains it on one device (the reference, `autopar.testing.reference`, computed locally by
every rank) and with autopar under the case's mesh and strategy, for `steps` AdamW steps on
the same global batch, and records the largest deviations of loss, gradients (this rank's
shard against the same shard of the reference gradient) and final parameters. It also
trains torch's own DDP on the same model and batch: DDP's parameter deviation is the
yardstick for parameters (Adam divides by sqrt(v), so float noise in near-zero gradients
moves a parameter by up to ~lr per step whatever the parallelization).

Within a worker, cases whose model comes from the same source (sample, config, batch size,
seed) share one captured graph (`shared_capture`): every case loads an identical model, and
capture reads only its structure, shapes and dtypes, so capturing it again per case (and per
rank) would only repeat work. `check` holds a run's results to a `Tolerance`.

Used by the multi-process tests (parity, pipelining, fusion, inductor).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from unittest import mock

import torch
import torch.distributed as dist

from autopar import planning
from autopar.cli.sources import load_model
from autopar.devices import choose_backend, process_group_device
from autopar.plan import MemoryPlan, Plan
from autopar.testing.deviations import loss_deviation, unbounded_if_nan
from autopar.testing.rank_pool import on_ranks
from autopar.testing.reference import LR, grads_at, train_single_device


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
    # memory levers applied on top of the searched plan (recompute, reshard_after_forward)
    memory: MemoryPlan | None = None
    # compile options: mixed-precision policy (the reference applies the same casts), ZeRO
    mixed_precision: str | None = None
    shard_optimizer: bool = False
    shard_gradients: bool = False
    placements: tuple[tuple[str, str], ...] = ()  # pinned (parameter, spec) pairs
    boundary: str | None = None  # a pipeline's boundary pinned on the searched plan
    # per pipeline rank, its stage mesh's shape (`compile(stage_meshes=)`)
    rank_meshes: tuple[tuple[int, ...], ...] = ()

    @property
    def label(self) -> str:
        strat = self.strategy if isinstance(self.strategy, str) else "x".join(self.strategy)
        label = f"{self.sample}-{'x'.join(map(str, self.mesh))}-{'x'.join(self.axis_names)}-{strat}"
        label += f"-{self.config}" if self.config != "tiny" else ""
        label += f"-b{self.batch_size}" if self.batch_size != 8 else ""
        label += f"-{self.schedule}" if self.schedule else ""
        label += f"-m{self.microbatches}" if self.microbatches else ""
        label += f"-fused-{self.fusion}" if self.fusion != "none" else ""
        if self.memory is not None:
            policies = sorted({p for _, p in self.memory.recompute})
            label += "-ac-" + "+".join(policies) if policies else ""
            label += "-reshard" if self.memory.reshard_after_forward else ""
        label += f"-{self.mixed_precision}" if self.mixed_precision else ""
        zero = 2 if self.shard_gradients else 1 if self.shard_optimizer else 0
        label += "-pinned" if self.placements else ""
        label += f"-{self.boundary}" if self.boundary else ""
        label += "".join(f"-r{'x'.join(map(str, m))}" for m in self.rank_meshes)
        return label + (f"-zero{zero}" if zero else "")


@dataclass
class ParityResult:
    label: str
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    loss_rel_err: float = 0.0
    # max |g - g_ref| / max(|g_ref|_max, GRAD_NOISE_FLOOR x the step's largest |g_ref|),
    # over params and steps
    grad_err: float = 0.0
    grad_abs_err: float = 0.0
    param_err: float = 0.0  # max |p - p_ref| after the last step
    # max |b - b_ref| over the buffers after the last step (BatchNorm statistics, counters)
    buffer_err: float = 0.0
    ddp_param_err: float = 0.0
    roles: dict[str, str] = field(default_factory=dict)
    param_specs: dict[str, str] = field(default_factory=dict)
    fusion: list[str] = field(default_factory=list)  # fused kernels, else the fusion mode
    step_program: str = ""  # type of what each step ran (ParallelModel only)
    recomputed: int = 0  # nodes the step program(s) recompute in backward
    # pipelines: stage gradient reductions launched after the schedule rather than at the
    # stage's last backward, ZeRO parameter gathers waited after it rather than at the
    # stage's forward (`runtime.stage_grads`: `late`)
    late_syncs: int = 0
    # mixed precision: the same run against the fp32 reference (no casts)
    fp32_loss_rel_err: float = 0.0
    fp32_param_err: float = 0.0
    # bytes this rank holds for its parameters before the last optimizer step, by category,
    # and what `cost_models.memory.param_state_breakdown` prices (ParallelModel only)
    held: dict[str, int] = field(default_factory=dict)
    priced: dict[str, float] = field(default_factory=dict)
    error: str | None = None


# A parameter whose reference gradient stays below this fraction of the step's largest is
# compared against that floor, not its own maximum: an attention key's bias has a gradient
# of exactly zero in exact arithmetic (softmax ignores a constant added to every score), so
# both runs hold float noise (~1e-11 where the largest gradient is ~0.1) and its relative
# error would be noise over noise (Hugging Face BERT and OPT under tensor parallelism: 0.4-1.5).
GRAD_NOISE_FLOOR = 1e-4


def grad_scale(grads: dict[str, torch.Tensor]) -> float:
    """The largest finite |gradient| entry of one step's reference gradients."""
    return max(
        (
            float(g.abs().max())
            for g in grads.values()
            if g is not None and g.numel() and g.isfinite().all()
        ),
        default=0.0,
    )


def test_backend(world_size: int, gpus: int | None = None) -> str:
    """The backend the multi-process tests run on: `AUTOPAR_TEST_BACKEND` (gloo|nccl) if
    set, else NCCL when every rank has a GPU, else gloo (`autopar.devices.choose_backend`)."""
    requested = os.environ.get("AUTOPAR_TEST_BACKEND") or None
    return choose_backend(requested, world_size, gpus)


test_backend.__test__ = False  # a helper, not a pytest test


def run_parity(cases: list[ParityCase], backend: str | None = None) -> list[ParityResult]:
    """Run every case on as many ranks as its mesh has devices, of `backend` (default
    `test_backend`; `testing.rank_pool`: spawned for this call, or kept alive by the test
    session), cases of one world size on one set of ranks; rank results merged (worst)."""
    out: dict[int, ParityResult] = {}
    for world in sorted({math.prod(c.mesh) for c in cases}):
        index = [i for i, c in enumerate(cases) if math.prod(c.mesh) == world]
        job = [asdict(cases[i]) for i in index]
        per_rank = on_ranks(world, backend or test_backend(world), rank_results, job)
        for k, i in enumerate(index):
            out[i] = _merge([ParityResult(**rank[k]) for rank in per_rank])
    return [out[i] for i in range(len(cases))]


def _merge(results: list[ParityResult]) -> ParityResult:
    out = results[0]
    for r in results[1:]:
        out.grad_err = max(out.grad_err, r.grad_err)
        out.grad_abs_err = max(out.grad_abs_err, r.grad_abs_err)
        out.param_err = max(out.param_err, r.param_err)
        out.buffer_err = max(out.buffer_err, r.buffer_err)
        out.error = out.error or r.error
    return out


# live as long as the rank process: shared_capture's cache, and each case's result (a case
# is deterministic, and tests share cases: test_recompute's bases are test_parity's runs)
RANK_CAPTURES: dict = {}
_RESULTS: dict[ParityCase, dict] = {}


def rank_results(cases: list[dict]) -> list[dict]:
    """This rank's results for `cases` (`asdict(ParityCase)`), in order; a case that raises
    gives a result with its traceback (also printed on stderr at once)."""
    results, plans = [], {}
    for raw in cases:
        case = ParityCase(
            **{
                **raw,
                "mesh": tuple(raw["mesh"]),
                "rank_meshes": tuple(tuple(m) for m in raw.get("rank_meshes", ())),
                "axis_names": tuple(raw["axis_names"]),
                "strategy": raw["strategy"]
                if isinstance(raw["strategy"], str)
                else tuple(raw["strategy"]),
                "memory": MemoryPlan.from_dict(raw["memory"]) if raw.get("memory") else None,
            }
        )
        if case in _RESULTS:  # every rank runs the same jobs: all skip it together
            results.append(copy.deepcopy(_RESULTS[case]))
            continue
        try:
            with shared_capture(RANK_CAPTURES, source_key(case)):
                results.append(asdict(run_case(case, plans)))
        except Exception:
            error = traceback.format_exc()
            # shown now: a case failing on some ranks only leaves the others waiting in a
            # collective, and the harness then dies on the backend's timeout, not here
            print(f"[rank {dist.get_rank()}] {case.label} failed:\n{error}", file=sys.stderr)
            results.append(asdict(ParityResult(case.label, error=error)))
        _RESULTS[case] = copy.deepcopy(results[-1])
        dist.barrier()
    return results


def source_key(case: ParityCase) -> tuple | None:
    """What makes two cases' models identical (None: never share its capture; fused cases
    rewrite their captured graph in place)."""
    if case.fusion != "none":
        return None
    return (case.sample, case.config, case.batch_size, case.seed)


@contextmanager
def shared_capture(cache: dict, source: tuple | None) -> Iterator[None]:
    """While it is open, `autopar.compile` captures a model from `source` once per batch
    shapes and dtypes and parameter dtypes (a pipeline captures a microbatch, mixed
    precision a cast copy) and hands every later call the same `Captured`, which planning
    and lowering only read. `cache` lives as long as the worker."""
    if source is None:
        yield
        return
    real = planning.capture

    def capture(model, batch: Sequence[torch.Tensor], loss_fn: Callable | None = None):
        dtypes = tuple(sorted({str(p.dtype) for p in model.parameters()}))
        shapes = tuple((tuple(t.shape), t.dtype) for t in batch)
        key = (source, shapes, dtypes, loss_fn)
        if key not in cache:
            cache[key] = real(model, batch, loss_fn)
        return cache[key]

    with mock.patch.object(planning, "capture", capture):
        yield


def ddp_param_error(model, batch, steps: int, ref_params) -> float:
    """How far torch's DDP (world = all ranks, batch split on dim 0) lands from the reference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if batch[0].shape[0] % dist.get_world_size():
        return float("nan")  # DDP averages equal shards only: no yardstick for this batch
    device = _rank_device()
    local = copy.deepcopy(model).to(device)
    ddp = DDP(local, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    shard = [t.chunk(dist.get_world_size(), 0)[dist.get_rank()].to(device) for t in batch]
    for _ in range(steps):
        ddp(*shard).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = local.state_dict()
    return max((state[k].cpu() - v).abs().max().item() for k, v in ref_params.items())


def _rank_device() -> torch.device:
    """This rank's device: its current GPU under NCCL, else the CPU."""
    if process_group_device() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fused_kernels(plan: Plan) -> list[str]:
    """The kernel of each fused region, or ["inductor"] when torch.compile runs the program."""
    if plan.fusion == "inductor":
        return ["inductor"]
    return [r.kernel for r in plan.fused_regions]


def recomputed_nodes(pm) -> int:
    """How many nodes the step program (or this rank's stage programs, after a step)
    re-emits in backward (`passes.recompute`)."""
    from autopar.passes.recompute import recomputed_nodes as count

    if hasattr(pm, "program"):
        return count(pm.program.gm)
    return sum(sum(m.recomputed) for m in getattr(pm, "modules", {}).values())


def held_bytes(pm) -> dict[str, int]:
    """Storage bytes of what `pm.held_tensors()` lists, per category (shared storage once)."""
    out = {}
    for category, tensors in pm.held_tensors().items():
        seen: dict[int, int] = {}
        for t in tensors:
            if t is not None:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        out[category] = sum(seen.values())
    return out


def priced_bytes(plan: Plan, mesh_shape: tuple[int, ...]) -> dict[str, float]:
    """The memory model's parameter and buffer state for `plan` on this rank (AdamW), per
    category, without the mixed-precision working copy, which lives inside the step only."""
    from autopar.cost_models.memory import local_numel, param_state_breakdown
    from autopar.plan import parse_spec

    m = plan.memory
    out: dict[str, float] = {}
    for t in plan.tensors:
        if t.kind == "input":
            continue
        dtype, spec = getattr(torch, t.dtype), parse_spec(t.spec)
        parts = param_state_breakdown(
            t.shape,
            dtype,
            spec,
            mesh_shape,
            trained=t.kind == "param",
            mixed_precision=m.param_dtype is not None,
            shard_optimizer=m.shard_optimizer,
            shard_gradients=m.shard_gradients,
        )
        if t.kind == "param" and m.param_dtype is not None and not m.shard_optimizer:
            parts["parameters"] -= local_numel(t.shape, spec, mesh_shape) * dtype.itemsize
        for k, v in parts.items():
            out[k] = out.get(k, 0.0) + v
    return out


def held_mismatches(res: ParityResult) -> list[str]:
    """Categories where the held bytes differ from the memory model's (AdamW's step
    counters, one small tensor per parameter, aside)."""
    out = []
    for category in ("parameters", "gradients", "optimizer_state"):
        held, priced = res.held.get(category, 0), res.priced.get(category, 0.0)
        slack = 64 * 8 if category == "optimizer_state" else 0
        if not priced <= held <= priced + slack:
            out.append(f"{res.label}: {category} holds {held} B, priced {priced:.0f} B")
    return out


@dataclass(frozen=True, slots=True)
class Tolerance:
    """The largest deviations a case may show: the loss relative to the reference's, a
    gradient shard relative to max |g_ref| (per parameter and step), a final parameter in
    absolute terms."""

    loss: float
    grad: float
    param: float

    def exceeded(self, res: ParityResult) -> bool:  # a NaN deviation exceeds any bound
        errs = (res.loss_rel_err, res.grad_err, res.param_err)
        return not all(
            e <= b for e, b in zip(errs, (self.loss, self.grad, self.param), strict=True)
        )


def summary(res: ParityResult) -> str:
    """One line with a result's deviations (and what else it recorded)."""
    line = (
        f"{res.label}: loss {res.loss_rel_err:.1e} grad {res.grad_err:.1e} "
        f"param {res.param_err:.1e} (ddp {res.ddp_param_err:.1e})"
    )
    if res.fp32_loss_rel_err or res.fp32_param_err:
        line += f"; fp32: loss {res.fp32_loss_rel_err:.1e} param {res.fp32_param_err:.1e}"
    line += f"; roles {res.roles}"
    return line + (f"; held {res.held}" if res.held else "")


def check(
    cases: Sequence[ParityCase],
    results: Sequence[ParityResult],
    tol: Tolerance | Callable[[ParityCase], Tolerance],
    more: Callable[[ParityCase, ParityResult], list[str]] | None = None,
) -> None:
    """Assert that every case ran and stayed within `tol` (a `Tolerance`, or one per case);
    `more(case, result)` lists a test's own failures for a case that ran. Prints one
    `summary` line per case; the assertion lists every failure."""
    failures = []
    for case, res in zip(cases, results, strict=True):
        if res.error:
            failures.append(f"{res.label}: {res.error}")
            continue
        line = summary(res)
        print(line)
        if (tol(case) if callable(tol) else tol).exceeded(res):
            failures.append("tolerance exceeded: " + line)
        failures += more(case, res) if more is not None else []
    assert not failures, "\n".join(failures)


def _compiled(case: ParityCase, model, batch, plans: dict):
    """autopar.compile for `case`: searched, or with memory levers (or a pipeline boundary)
    the searched plan (its base case's when `plans` has it) with the case's recompute and
    reshard (or boundary)."""
    import autopar

    cluster = autopar.Cluster.local(mesh=case.mesh, axis_names=case.axis_names)
    base = dataclasses.replace(case, memory=None, boundary=None)
    pinned = case.memory is not None or case.boundary is not None
    plan = plans.get(base) if pinned else None
    if plan is None:
        pm = autopar.compile(
            model,
            batch,
            cluster=cluster,
            strategy=case.strategy,
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
            schedule=case.schedule,
            microbatches=case.microbatches,
            fusion=case.fusion,
            mixed_precision=case.mixed_precision,
            shard_optimizer=case.shard_optimizer,
            shard_gradients=case.shard_gradients,
            placements=dict(case.placements) or None,
            stage_meshes=case.rank_meshes or None,
        )
        plan = plans[base] = pm.plan
        if not pinned:
            return pm
    if case.memory is not None:
        levers = {"recompute": case.memory.recompute}
        levers["reshard_after_forward"] = case.memory.reshard_after_forward
        plan = dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, **levers))
    if case.boundary is not None:
        pipeline = dataclasses.replace(plan.pipeline, boundary=case.boundary)
        plan = dataclasses.replace(plan, pipeline=pipeline)
    return autopar.compile(
        model, batch, cluster=cluster, plan=plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR)
    )


def run_case(case: ParityCase, plans: dict | None = None) -> ParityResult:
    """Train `case` on this rank against the single-device reference and DDP. `plans`
    (per worker) keeps each searched plan by its case without memory levers: a case with
    levers reuses its base case's plan (the same search) instead of searching it again."""
    from autopar.plan import parse_spec
    from autopar.runtime.shards import local_chunk
    from autopar.views import axis_roles

    model, batch = load_model(case.sample, case.config, case.batch_size, seed=case.seed)
    rng = torch.random.get_rng_state()  # the parallel run draws the reference's masks
    ref = train_single_device(model, batch, case.steps, mixed_precision=case.mixed_precision)
    pm = _compiled(case, model, batch, {} if plans is None else plans)
    torch.random.set_rng_state(rng)
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
        ref_grads = ref.grads[step]
        if step and case.mixed_precision != "fp16":
            # Later steps' gradients are compared at the run's own weights: after an AdamW
            # step, float noise in near-zero gradients moves weights by up to ~lr under any
            # parallelization (test_parity's yardstick), and gradients at weights that moved
            # differ from the reference trajectory's by more than the gradient tolerance.
            # (fp16: the loss scale's history decides the reference's gradients; kept.)
            here = {k: v.cpu() for k, v in pm.full_state_dict().items()}
            ref_grads = grads_at(model, batch, here, case.mixed_precision)
        loss = float(pm.forward_backward(*batch))
        res.losses.append(loss)
        floor = GRAD_NOISE_FLOOR * grad_scale(ref_grads)
        for fqn, grad in pm.local_grads().items():
            full_ref = ref_grads[fqn]
            if hasattr(pm, "expected_grad"):  # ZeRO: the flat shard this rank holds
                want = pm.expected_grad(fqn, full_ref)
            else:
                want = local_chunk(full_ref, specs[fqn], pm.mesh)
            if not want.isfinite().all():  # fp16: a step the loss scaler skips
                continue
            if want.numel() == 0:  # an empty shard (3 rows over 4 ranks: 1, 1, 1, 0)
                if grad.numel():
                    raise ValueError(f"{fqn}: a gradient of {tuple(grad.shape)} for an empty shard")
                continue
            err = unbounded_if_nan((grad - want.to(grad.device)).abs().max().item())
            res.grad_abs_err = max(res.grad_abs_err, err)
            res.grad_err = max(res.grad_err, err / max(want.abs().max().item(), floor, 1e-12))
        if step == case.steps - 1 and hasattr(pm, "state"):
            res.held, res.priced = held_bytes(pm), priced_bytes(pm.plan, tuple(pm.mesh.shape))
        pm.optimizer_step()
    res.recomputed = recomputed_nodes(pm)
    if hasattr(pm, "sync"):
        res.late_syncs = pm.sync.late + (pm.gather.late if pm.gather is not None else 0)
    pairs = zip(res.losses, ref.losses, strict=True)
    res.loss_rel_err = max(loss_deviation(a, b) for a, b in pairs)
    full = pm.full_state_dict()
    full = {k: v.cpu() for k, v in full.items()}  # the reference trains on the CPU
    res.param_err = max(
        unbounded_if_nan((full[k] - v).abs().max().item()) for k, v in ref.state.items()
    )
    buffers = {k for k, _ in model.named_buffers()} & set(ref.state)
    res.buffer_err = max(
        ((full[k] - ref.state[k]).abs().max().item() for k in buffers), default=0.0
    )
    res.ddp_param_err = ddp_param_error(model, batch, case.steps, ref.state)
    if case.mixed_precision:
        ref32 = train_single_device(model, batch, case.steps, grads=False)
        pairs = zip(res.losses, ref32.losses, strict=True)
        res.fp32_loss_rel_err = max(loss_deviation(a, b) for a, b in pairs)
        res.fp32_param_err = max((full[k] - v).abs().max().item() for k, v in ref32.state.items())
    return res

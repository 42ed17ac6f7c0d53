"""Memory harness: the measured peak of a compiled model's step beside the plan's prediction.

`run_memory(cases, world_size)` spawns `world_size` local gloo processes (one spawn for all
cases, as `autopar.testing.parity` does); in each, for every case it compiles the sample
under the case's mesh, strategy and memory levers (`options`: extra keywords of
`autopar.compile`, e.g. `mixed_precision="bf16"`), trains `steps` AdamW steps with
`pm.track_memory(True)` and records this rank's `pm.memory_stats()` of the last step
(steady state: the optimizer state exists before it, as on every step after the first).

Used by `benchmarks/bench_memory.py` and `tests/test_memory_prediction.py`.
"""

from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from autopar.cli.sources import load_model
from autopar.runtime.memory_stats import CATEGORIES
from autopar.testing.parity import RANK_CAPTURES, shared_capture, test_backend
from autopar.testing.rank_pool import on_ranks
from autopar.testing.reference import LR


@dataclass(frozen=True)
class MemoryCase:
    label: str
    sample: str  # a sample name or a model source
    mesh: tuple[int, ...]
    axis_names: tuple[str, ...]
    strategy: str | tuple[str, ...] = "auto"
    config: str = "tiny"
    batch_size: int = 8
    steps: int = 2
    schedule: str | None = None  # pipelining: mesh axis "pp" first
    microbatches: int | None = None
    options: tuple[tuple[str, object], ...] = ()  # extra autopar.compile keywords


@dataclass
class RankMemory:
    """One rank's figures for one case (bytes)."""

    label: str
    rank: int
    peak: int = 0
    measured: dict[str, int] = field(default_factory=dict)
    predicted_peak: float = 0.0
    predicted: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def ratio(self) -> float:
        return self.peak / self.predicted_peak if self.predicted_peak else float("nan")


def run_memory(cases: list[MemoryCase], world_size: int) -> list[list[RankMemory]]:
    """Per case, every rank's `RankMemory` (rank order)."""
    backend = test_backend(world_size)  # NCCL with a GPU per rank, else gloo
    per_rank = on_ranks(world_size, backend, rank_memory, [asdict(c) for c in cases])
    return [[RankMemory(**rank[i]) for rank in per_rank] for i in range(len(cases))]


def _case(raw: dict) -> MemoryCase:
    strategy = raw["strategy"]
    return MemoryCase(
        **{
            **raw,
            "mesh": tuple(raw["mesh"]),
            "axis_names": tuple(raw["axis_names"]),
            "strategy": strategy if isinstance(strategy, str) else tuple(strategy),
            "options": tuple((k, v) for k, v in raw["options"]),
        }
    )


def rank_memory(cases: list[dict]) -> list[dict]:
    """This rank's `RankMemory` for each case (as dicts), in order."""
    results, rank = [], dist.get_rank()
    for raw in cases:
        case = _case(raw)
        fused = dict(case.options).get("fusion", "none") != "none"  # rewrites its graph
        source = None if fused else (case.sample, case.config, case.batch_size)
        try:
            with shared_capture(RANK_CAPTURES, source):  # cases of one model: one capture
                results.append(asdict(measure_case(case)))
        except Exception:
            results.append(asdict(RankMemory(case.label, rank, error=traceback.format_exc())))
        dist.barrier()
    return results


def measure_case(case: MemoryCase) -> RankMemory:
    """Compile the case on this rank and measure its last step (see the module docstring)."""
    import autopar

    model, batch = load_model(case.sample, case.config, case.batch_size)
    cluster = autopar.Cluster.local(mesh=case.mesh, axis_names=case.axis_names)
    pm = autopar.compile(
        model,
        batch,
        cluster=cluster,
        strategy=case.strategy,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
        schedule=case.schedule,
        microbatches=case.microbatches,
        **dict(case.options),
    )
    del model
    for step in range(case.steps):
        pm.track_memory(step == case.steps - 1)
        pm.step(*batch)
    stats = pm.memory_stats()
    assert stats is not None
    return RankMemory(
        label=case.label,
        rank=dist.get_rank(),
        peak=stats.peak_bytes,
        measured={c: int(stats.breakdown.get(c, 0)) for c in CATEGORIES},
        predicted_peak=float(stats.predicted_bytes or 0.0),
        predicted={c: float(stats.predicted_breakdown.get(c, 0.0)) for c in CATEGORIES},
    )

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

import json
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.cli.sources import load_model
from autopar.devices import free_port, init_rank
from autopar.runtime.memory_stats import CATEGORIES
from autopar.testing.parity import shared_capture, test_backend
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
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _worker,
            args=(world_size, free_port(), [asdict(c) for c in cases], tmp, backend),
            nprocs=world_size,
            join=True,
        )
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
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


def _worker(
    rank: int, world: int, port: int, cases: list[dict], out_dir: str, backend: str = "gloo"
) -> None:
    init_rank(rank, world, port, backend)
    results, captures = [], {}
    try:
        for raw in cases:
            case = _case(raw)
            fused = dict(case.options).get("fusion", "none") != "none"  # rewrites its graph
            source = None if fused else (case.sample, case.config, case.batch_size)
            try:
                with shared_capture(captures, source):  # cases of one model: one capture
                    results.append(asdict(measure_case(case)))
            except Exception:
                results.append(asdict(RankMemory(case.label, rank, error=traceback.format_exc())))
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


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

"""Runtime on real gloo processes: the per-rank program, saved plans, plan-hash agreement."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch.distributed as dist

import autopar
from autopar.cli.sources import load_model
from autopar.testing.rank_pool import on_ranks


def _spawn(fn, world: int, tmp_path: Path) -> list[str]:
    return on_ranks(world, "gloo", _entry, fn, str(tmp_path))


def _entry(fn, out: str) -> str:
    try:
        return fn(dist.get_rank(), Path(out))
    except Exception:
        return "ERROR " + traceback.format_exc()


def _gpt():
    return load_model("gpt", "tiny", 8)


def _program_and_saved_plan(rank: int, out: Path) -> str:
    model, batch = _gpt()
    cluster = autopar.Cluster.local(mesh=(2,), axis_names=("dp",))
    pm = autopar.compile(model, batch, cluster=cluster, strategy="fsdp")
    targets = {str(n.target) for n in pm.program.gm.graph.nodes if n.op == "call_function"}
    assert not any("DTensor" in t or "redistribute" in t for t in targets), targets
    assert any("all_gather" in t for t in targets) and any("reduce_scatter" in t for t in targets)
    full = pm.full_state_dict()
    assert list(full) == list(model.state_dict()), "state_dict names differ"
    if rank == 0:
        pm.save_plan(out / "plan.json")
    dist.barrier()
    again = autopar.compile(model, batch, cluster=cluster, plan=out / "plan.json")
    assert again.plan == pm.plan
    return f"ok {pm.step(*batch):.6f} {again.step(*batch):.6f}"


@pytest.mark.multiproc
def test_local_program_state_dict_and_saved_plan(tmp_path: Path) -> None:
    results = _spawn(_program_and_saved_plan, 2, tmp_path)
    assert all(r.startswith("ok") for r in results), results
    assert len(set(results)) == 1  # every rank reports the same global loss


def _mismatched_plans(rank: int, out: Path) -> str:
    model, batch = _gpt()
    cluster = autopar.Cluster.local(mesh=(2,), axis_names=("dp",))
    plan = autopar.plan(model, batch, cluster=cluster, strategy="dp" if rank == 0 else "fsdp")
    try:
        autopar.compile(model, batch, cluster=cluster, plan=plan)
    except ValueError as exc:
        return f"refused: {exc}"
    return "accepted"


@pytest.mark.multiproc
def test_ranks_with_different_plans_fail_before_training(tmp_path: Path) -> None:
    results = _spawn(_mismatched_plans, 2, tmp_path)
    assert all(r.startswith("refused") and "ranks [1]" in r for r in results), results


def test_compile_without_process_group_explains() -> None:
    model, batch = _gpt()
    with pytest.raises(RuntimeError, match="torchrun"):
        autopar.compile(model, batch, cluster=autopar.Cluster.preset("cpu", mesh=(2,)))

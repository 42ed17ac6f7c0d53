"""The DTensor adapter (``autopar._compat``) and how strategy enumeration uses it.

* ``import autopar`` leaves DTensor's sharding registry alone (checked in a fresh process);
  ``register_dtensor_rules()`` adds autopar's strategies, idempotently.
* An op DTensor knows nothing of fails at planning time with one ValueError naming the op
  and the user's source line; an op whose DTensor strategies reject the arguments is
  planned replicated, with one warning per op and planning call naming the same.
* Only the exceptions DTensor uses to reject arguments mean "no strategy"; any other one
  propagates.
* ``no_dtensor_redistribute_costs()`` zeroes DTensor's resharding prices inside and
  restores them on exit.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar._compat import (
    DTensorSpec,
    FakeStore,
    OpSchema,
    OpSpec,
    OpStrategy,
    TensorMeta,
    no_dtensor_redistribute_costs,
    op_strategy_func,
)
from autopar.capture import capture
from autopar.cluster import Cluster
from autopar.passes.strategies import enumerate_strategies, from_dtensor
from autopar.passes.strategies.from_dtensor import UnsupportedOpError

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parent.parent


@torch.library.custom_op("autopar_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    """An op DTensor knows nothing about: no strategy, no decomposition."""
    return x * 2


@twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


TWICE = torch.ops.autopar_test.twice.default


class Twice(nn.Module):
    """Two nodes of the strategy-less op, one below the other (two source lines)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = twice(self.a(x))  # first use
        return twice(self.b(y)).square().mean()


FIRST_USE = next(
    i
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
    if line.strip().endswith("# first use")
)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield init_device_mesh("cpu", (2, 2))
    dist.destroy_process_group()


def _replicated_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "no sharding strategy for" in r.getMessage()]


# ---------------------------------------------------------------- registration


def test_import_leaves_dtensor_registry_alone() -> None:
    """In a fresh process: the tables before ``import autopar`` and after are the same up
    to torch's own lazy registrations (inductor prims), nothing maps to autopar code, and
    ``register_dtensor_rules()`` then adds the CPU flash-attention strategies once."""
    script = textwrap.dedent(
        """
        import torch
        from torch.distributed.tensor import DTensor

        sp = DTensor._op_dispatcher.sharding_propagator
        TABLES = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_schema_info",
                  "op_to_schema_info_for_single_dim_strategy", "op_to_rules")

        def snapshot():
            return {t: dict(getattr(sp, t)) for t in TABLES}

        def autopar_entries(tables):
            return sorted(
                f"{t}[{op}]" for t, table in tables.items() for op, v in table.items()
                if getattr(getattr(v, "func", v), "__module__", "").startswith("autopar")
            )

        before = snapshot()
        import autopar  # noqa: F401
        after = snapshot()
        changed = [f"{t}[{op}]" for t in TABLES for op, v in before[t].items()
                   if after[t].get(op) is not v]
        assert not changed, changed
        assert not autopar_entries(after), autopar_entries(after)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        assert flash not in after["op_strategy_funcs"]

        from autopar.passes.strategies import register_dtensor_rules
        register_dtensor_rules()
        once = snapshot()
        assert autopar_entries(once) == [
            "op_strategy_funcs[aten._scaled_dot_product_flash_attention_for_cpu.default]",
            "op_strategy_funcs[aten._scaled_dot_product_flash_attention_for_cpu_backward."
            "default]",
            "op_strategy_funcs[autopar.batch_norm_stats.default]",
            "op_strategy_funcs[autopar.batch_norm_stats_backward.default]",
        ], autopar_entries(once)
        register_dtensor_rules()
        assert snapshot() == once
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# ---------------------------------------------------------------- no strategy: replicated


def test_op_without_strategy_fails_at_planning(mesh: DeviceMesh) -> None:
    """An op DTensor knows nothing of stops enumeration with one ValueError naming the op
    and the user's line (never a NotImplementedError from every rank at run time)."""
    torch.manual_seed(0)
    captured = capture(Twice(), (torch.randn(4, 8),))
    assert len([n for n in captured.gm.graph.nodes if n.target is TWICE]) == 2
    with pytest.raises(UnsupportedOpError) as info:
        enumerate_strategies(captured.gm, mesh)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "autopar_test.twice.default" in message and "no sharding strategy" in message
    assert f"{Path(__file__).resolve()}:{FIRST_USE}: y = twice(self.a(x))" in message


def test_plan_of_op_without_strategy(mesh: DeviceMesh) -> None:
    """Through the public planner: the same ValueError, before any process runs the op."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"cannot plan autopar_test\.twice\.default"):
        autopar.plan(Twice(), (torch.randn(4, 8),), cluster=Cluster.preset("cpu", mesh=mesh.shape))


def test_only_dtensor_rejections_mean_no_strategy(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A strategy function raising AssertionError (DTensor's "not these arguments") leaves
    the op replicated; a TypeError (a bug) reaches the caller."""
    torch.manual_seed(0)
    captured = capture(Twice(), (torch.randn(4, 8),))
    lookup = from_dtensor.op_strategy_func

    def raising(exc: Exception):
        def strategy(schema: OpSchema) -> OpStrategy:
            raise exc

        monkeypatch.setattr(
            from_dtensor, "op_strategy_func", lambda op: strategy if op is TWICE else lookup(op)
        )

    raising(AssertionError("no strategy for these placements"))
    with caplog.at_level(logging.WARNING, logger=from_dtensor.__name__):
        table = enumerate_strategies(captured.gm, mesh)
    assert all(len(table[n]) == 1 for n in table if n.target is TWICE)
    assert len(_replicated_records(caplog)) == 1
    raising(TypeError("a bug in how the strategy was called"))
    with pytest.raises(TypeError, match="a bug"):
        enumerate_strategies(captured.gm, mesh)


# ---------------------------------------------------------------- redistribute costs


def test_no_dtensor_redistribute_costs(mesh: DeviceMesh) -> None:
    """DTensor's softmax strategy prices resharding a Shard(1) input to the softmax dim;
    inside the context every price is 0, and the pricing is back after it."""
    meta = TensorMeta(shape=torch.Size([8, 8]), stride=(8, 1), dtype=torch.float32)
    placements = [(Shard(1), Replicate()), (Shard(0), Replicate()), (Replicate(), Replicate())]
    specs = [OpSpec(DTensorSpec(mesh, p, tensor_meta=meta)) for p in placements]
    strategy = op_strategy_func(aten._softmax.default)
    assert strategy is not None

    def costs() -> list[float]:
        out = strategy(OpSchema(aten._softmax.default, (OpStrategy(specs), 1, False), {}))
        return [c for s in out.strategies for row in s.redistribute_cost for c in row]

    assert max(costs()) > 0
    with no_dtensor_redistribute_costs():
        assert costs() and max(costs()) == 0
    assert max(costs()) > 0
    with pytest.raises(KeyError), no_dtensor_redistribute_costs():
        raise KeyError("restored on error too")
    assert max(costs()) > 0

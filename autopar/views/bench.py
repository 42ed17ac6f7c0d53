"""`autopar bench` as a table and a CSV: one row per strategy, its predicted step time and
peak memory per device, and the ratio of its step time to the searched plan's ("auto")."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from autopar.plan import Plan
from autopar.views.describe import axis_roles
from autopar.views.layers import fmt_bytes

CSV_COLUMNS = (
    "strategy",
    "axis_roles",
    "predicted_step_time_s",
    "predicted_peak_memory_bytes",
    "ratio_vs_auto",
    "error",
)


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One strategy's prediction, or why it has none (`error`: the search's message)."""

    strategy: str
    roles: str = ""
    step_time: float = math.nan
    peak_memory: float = math.nan
    error: str = ""

    @classmethod
    def of(cls, strategy: str, plan: Plan) -> BenchRow:
        roles = ", ".join(
            f"{n}={r}" for n, r in zip(plan.stage_axis_names, axis_roles(plan), strict=True)
        )
        return cls(strategy, roles, plan.predicted_step_time, plan.predicted_peak_memory)

    def ratio(self, base: float) -> float:
        """Step time over `base` (the searched plan's); NaN without both."""
        if self.error or not base > 0:
            return math.nan
        return self.step_time / base


def bench_table(rows: Sequence[BenchRow], base: float, title: str) -> Table:
    """The rows that have a prediction (those with an error are reported apart)."""
    table = Table(title=title)
    for col in ("strategy", "axis roles", "step time (ms)", "peak memory/device", "vs auto"):
        table.add_column(col, justify="left" if col in ("strategy", "axis roles") else "right")
    for r in rows:
        if r.error:
            continue
        table.add_row(
            r.strategy,
            r.roles,
            f"{r.step_time * 1e3:.3f}",
            fmt_bytes(r.peak_memory),
            f"{r.ratio(base):.2f}×",
        )
    return table


def write_bench_csv(path: Path, rows: Sequence[BenchRow], base: float) -> None:
    """`CSV_COLUMNS`; a row with an error has only its strategy and the error."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(CSV_COLUMNS)
        for r in rows:
            ratio = r.ratio(base)
            out.writerow(
                [
                    r.strategy,
                    r.roles,
                    "" if r.error else r.step_time,
                    "" if r.error else r.peak_memory,
                    "" if math.isnan(ratio) else ratio,
                    r.error,
                ]
            )


def write_rows_csv(path: Path | str, rows: Sequence[dict], fields: Sequence[str] = ()) -> None:
    """A benchmark's rows (dicts) as CSV at `path` (parent made): `fields`, or the first row's
    keys; keys outside `fields` are left out."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields or rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)

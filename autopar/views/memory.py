"""Measured beside predicted memory: `pm.memory_stats()` as text.

`memory_lines(stats) -> list[str]`: one line per category (parameters, gradients,
optimizer_state, buffers, activations, communication) with the measured bytes at the
measured peak, the predicted bytes at the predicted peak and their ratio, then the total.
The two peaks need not fall at the same moment, so per-category ratios are indicative;
the total is what `MemoryStats.ratio` compares.
"""

from __future__ import annotations

from autopar.runtime.memory_stats import CATEGORIES, MemoryStats
from autopar.views.layers import fmt_bytes


def memory_lines(stats: MemoryStats) -> list[str]:
    rows = [f"{'':<16}{'measured':>12}{'predicted':>12}{'ratio':>8}"]
    pred = stats.predicted_breakdown
    for c in CATEGORIES:
        rows.append(_row(c, stats.breakdown.get(c, 0), pred.get(c) if pred else None))
    rows.append(_row("peak", stats.peak_bytes, stats.predicted_bytes))
    return rows


def _row(name: str, measured: float, predicted: float | None) -> str:
    ratio = f"{measured / predicted:.3f}" if predicted else "-"
    shown = fmt_bytes(predicted) if predicted is not None else "-"
    return f"{name:<16}{fmt_bytes(measured):>12}{shown:>12}{ratio:>8}"

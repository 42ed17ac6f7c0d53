"""Human views of a plan, in one place: dicts and text (`describe`, `summary`, the pipeline
timeline), layer groups and edge collectives (`layers`), rich tables (`tables`, `bench`),
measured beside predicted memory (`memory`).

Axis roles are derived from placements, never stored (see `describe.axis_roles`).
"""

from autopar.views.bench import BenchRow, bench_table, write_bench_csv
from autopar.views.describe import axis_roles, describe, summary, timeline_lines, timeline_text
from autopar.views.layers import LayerGroup, edge_collectives, fmt_bytes, group_layers
from autopar.views.memory import memory_lines
from autopar.views.tables import render_plan

__all__ = [
    "BenchRow",
    "LayerGroup",
    "axis_roles",
    "bench_table",
    "describe",
    "edge_collectives",
    "fmt_bytes",
    "group_layers",
    "memory_lines",
    "render_plan",
    "summary",
    "timeline_lines",
    "timeline_text",
    "write_bench_csv",
]

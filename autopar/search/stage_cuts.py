"""Stage cuts: where a pipeline's contiguous layer ranges start.

`balanced_cuts(costs, stages, span) -> first layer of each stage`: the dynamic program
that minimizes the slowest stage (`search.inter_op` prices each range as its programs run).
"""

from __future__ import annotations

from collections.abc import Callable


def balanced_cuts(
    costs: list[float], stages: int, span: Callable[[int, int], float] | None = None
) -> tuple[int, ...]:
    """First layer of each stage, minimizing the slowest stage (contiguous ranges; DP).
    `span(i, j)`: seconds of a stage of layers i..j-1 (default: the sum of their `costs`)."""
    n = len(costs)
    if stages > n:
        raise ValueError(
            f"{stages} pipeline stages need at least {stages} layers; the model "
            f"has {n}. Use fewer stages or a non-interleaved schedule."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    if span is None:
        span = lambda i, j: prefix[j] - prefix[i]  # noqa: E731
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], span(i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    cuts, j = [], n
    for s in range(stages, 0, -1):
        cuts.append(cut[s][j])
        j = cut[s][j]
    return tuple(reversed(cuts))

"""Stage cuts: where a pipeline's contiguous layer ranges start.

`balanced_cuts(costs, stages, span) -> first layer of each stage`: the dynamic program
that minimizes the slowest stage (`search.inter_op` prices each range as its programs run).
`range_prices(costs, span)`: its table of every range's price, which the schedules of one
candidate share.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def balanced_cuts(
    costs: list[float],
    stages: int,
    span: Callable[[int, int], float] | None = None,
    prices: np.ndarray | list[np.ndarray] | None = None,
) -> tuple[int, ...]:
    """First layer of each stage, minimizing the slowest stage (contiguous ranges; DP over
    the table of every range's price, vectorised: each range is priced once, however many
    stages). `span(i, j)`: seconds of a stage of layers i..j-1 (default: the sum of their
    `costs`); `prices`: that table made already (`range_prices`), or one per stage (its
    pipeline rank's stage mesh, `search.stage_meshes`)."""
    n = len(costs)
    if stages > n:
        raise ValueError(
            f"{stages} pipeline stages need at least {stages} layers; the model "
            f"has {n}. Use fewer stages or a non-interleaved schedule."
        )
    price = range_prices(costs, span) if prices is None else prices
    tables = price if isinstance(price, list) else [price] * stages
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros((stages + 1, n + 1), dtype=np.int64)
    for s in range(1, stages + 1):
        slowest = np.maximum(
            best[:, None], tables[s - 1]
        )  # [i][j]: stages so far to i, then i..j-1
        cut[s] = np.argmin(slowest, axis=0)  # the first i of the least (ties: earliest cut)
        best = slowest[cut[s], np.arange(n + 1)]
    cuts, j = [], n
    for s in range(stages, 0, -1):
        cuts.append(int(cut[s][j]))
        j = cuts[-1]
    return tuple(reversed(cuts))


def range_prices(costs: list[float], span: Callable[[int, int], float] | None = None) -> np.ndarray:
    """[i][j]: seconds of a stage of layers i..j-1 (`span`, default the sum of `costs`);
    inf where j <= i (a stage holds at least one layer)."""
    n = len(costs)
    if span is None:
        prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=np.float64))))
        price = prefix[None, :] - prefix[:, None]  # [i][j] = prefix[j] - prefix[i]
    else:  # each range priced once (a stage of layers i..j-1, i < j)
        price = np.full((n + 1, n + 1), np.inf)
        for i in range(n):
            price[i, i + 1 :] = [span(i, j) for j in range(i + 1, n + 1)]
    price[np.tril_indices(n + 1)] = np.inf
    return price

"""The order in which `elimination` minimises the decisions out, and its caps.

Variable elimination's time and memory are its buckets' entries (a decision's choices
times its neighbours' when it is eliminated), which the order decides. No one greedy
rule is best on every graph, so two run and the order whose buckets hold fewer entries
in all is kept:

- min-fill: next the decision whose elimination joins the fewest pairs of neighbours not
  yet joined (weighted by their choices), then the smallest bucket. It suits the long
  chains of a decoder's blocks.
- least separator: next the decision with the fewest entries over its neighbours. It
  suits a decision of many choices among few neighbours: Hugging Face's Falcon-40B
  template in bf16 on 64 H100 holds 3.3M entries so where min-fill's hold 10.4M (one
  bucket of 6.6M: a 48-choice decision eliminated beside four others), and its stage
  ILPs settle in ~0.65 s where they took ~1.1 s.

Orders are kept by the problem's structure (its factors' scopes and its decisions'
choice counts): the cost scales of a template, and a hub's branches, share one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.search.elimination import _Factors

MAX_BUCKET = 8_000_000  # entries of the largest bucket (a decision and its neighbours)
# entries of all buckets together (what variable fixing keeps: ~8 bytes each). Hugging Face's
# Llama-3-8B in bf16 on 64 H100 holds 32.3M in its dp8 x tp8 stage ILPs (the rotary cos /
# sin every layer reads join them): eliminated in ~0.8 s each, where HiGHS takes ~1.4 s
MAX_BUCKETS = 48_000_000
_KEPT = 256  # structures whose orders are kept (one search sees a few dozen)

Scope = tuple[int, ...]  # decisions, ascending: a factor's axes in this order
Adjacency = dict[int, set[int]]

_orders: dict[tuple, list[int] | None] = {}


def order_of(fs: _Factors) -> list[int] | None:
    """The elimination order of `fs` (module docstring); None when every order found
    passes a cap: `MAX_BUCKET` entries in one bucket or `MAX_BUCKETS` in all (an
    elimination's time; the memory variable fixing holds)."""
    key = (tuple(fs.cost), tuple(fs.sizes.items()), MAX_BUCKET, MAX_BUCKETS)
    if key not in _orders:
        if len(_orders) >= _KEPT:
            _orders.clear()
        _orders[key] = _least_entries(fs.sizes, list(fs.cost))
    return _orders[key]


def _least_entries(sizes: dict[int, int], scopes: list[Scope]) -> list[int] | None:
    def fill(adj: Adjacency, i: int) -> tuple[int, int, int]:
        joins = sum(
            sizes[a] * sizes[b] for a, b in itertools.combinations(adj[i], 2) if b not in adj[a]
        )
        return joins, _bucket(sizes, adj, i), i

    def separator(adj: Adjacency, i: int) -> tuple[int, int]:
        return math.prod(sizes[a] for a in adj[i]), i

    found = [_greedy(sizes, scopes, score) for score in (fill, separator)]
    fitting = [o for o in found if o is not None]
    return min(fitting, key=lambda o: o[1])[0] if fitting else None


def _greedy(
    sizes: dict[int, int], scopes: list[Scope], score: Callable[[Adjacency, int], tuple]
) -> tuple[list[int], int] | None:
    """The order that eliminates next the decision of least `score(adj, i)`, with its
    buckets' entries in all; None past a cap."""
    adj: Adjacency = {i: set() for i in sizes}
    for scope in scopes:
        for a, b in itertools.combinations(scope, 2):
            adj[a].add(b)
            adj[b].add(a)
    order, total = [], 0
    while adj:
        i = min(adj, key=lambda i: score(adj, i))
        bucket = _bucket(sizes, adj, i)
        total += bucket
        if bucket > MAX_BUCKET or total > MAX_BUCKETS:
            return None
        for a in adj[i]:
            adj[a] |= adj[i] - {a}
            adj[a].discard(i)
        del adj[i]
        order.append(i)
    return order, total


def _bucket(sizes: dict[int, int], adj: Adjacency, i: int) -> int:
    return math.prod(sizes[a] for a in adj[i]) * sizes[i]

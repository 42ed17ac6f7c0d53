"""Calibration, part 2: the cluster that `autopar.calibration`'s measurements describe.

`cluster_from_measurements(measured, mesh, names, backend) -> Cluster`: the device's
rates and efficiencies (matmul peak and size curves, memory bandwidth, launch overhead,
fused attention's rate, size curve and key tile, overlap) and, per mesh axis, the link
fitted to its collectives (see `autopar.calibration`'s docstring for what is measured and
how each figure follows).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from autopar.cluster import Cluster, DeviceSpec, Fabric, Link
from autopar.cost_models.comm import Collective, algorithm_factors, volume_kind

__all__ = ["cluster_from_measurements", "overlap_efficiency"]


def cluster_from_measurements(
    m: dict[str, Any], mesh: tuple[int, ...], names: tuple[str, ...], backend: str
) -> Cluster:
    """The cluster the measurements describe (see the module docstring)."""
    peaks = {k: rows[-1][2] for k, rows in m["matmul"].items()}  # the largest size's rate
    fp32 = m["matmul"]["float32"]
    launch = m["launch_s"]
    thin = _half_dim(m.get("skinny", []), peaks["float32"], launch)
    sides = [(f / 2) ** (1 / 3) for f, _, _ in fp32]  # a square matmul's time beyond its
    fixed = [  # FLOPs at the rate its three sides n allow
        max(t - f * ((n + thin) / n) ** 3 / peaks["float32"] - launch, 0.0)
        for (f, t, _), n in zip(fp32, sides, strict=True)
    ]
    half = statistics.median(fixed) * peaks["float32"]
    attention, attention_half, block = _attention_fit(m, peaks["float32"])
    bandwidth, curve = _memory_curve(m)
    device = DeviceSpec(
        f"calibrated {m['device_name']}",
        peaks,
        m["memory_bytes"],
        bandwidth,
        memory_curve=curve,
        memory_in_place=_in_place_rate(m),
        matmul_half_flops=half,
        matmul_half_dim=thin,
        attention_efficiency=max(attention, 1e-6),
        attention_half_seq=attention_half,
        attention_block=block,
        launch_overhead=launch,
        overlap_efficiency=overlap_efficiency(*m["overlap"]) if "overlap" in m else 1.0,
        # elements/s of each measured op, its launch taken out (a file from before: none)
        op_rates=tuple(
            (op, n / max(t - launch, 1e-12)) for op, (n, t) in m.get("op_rates", {}).items()
        ),
        update_rates=_update_rates(m.get("update", {})),
        core_share=m.get("core_share", 1.0),
    )
    links = tuple(
        _fit_link(m["comm"][name], n, backend) for name, n in zip(names, mesh, strict=True)
    )
    widest = max(range(len(mesh)), key=lambda i: mesh[i])
    fabric = Fabric(links[widest], math.inf, links[widest].latency)
    return Cluster(device, mesh, names, links, backend, math.prod(mesh), fabric)


def _attention_fit(m: dict[str, Any], peak: float) -> tuple[float, float, float]:
    """(attention_efficiency, attention_half_seq, attention_block) from the long and the
    short attention's rates (``rate = eff * peak * kv / (kv + h)`` through both, in their
    key lengths) and the causal run's share of the full one's time (``causal_share``'s
    ``(1 + block / seq) / 2``; a share of 1 says only that the tile is at least the
    sequence). A file without the short and causal runs (older calibrations) gives the long
    rate alone."""
    rate = m.get("attention_flops") or 0.0
    if not rate:
        return 1.0, 0.0, 0.0
    seq = float(m.get("attention_seq", 0))
    half = 0.0
    if "attention_small" in m and seq:
        f_small, t_small = m["attention_small"]
        short = seq // 8
        ratio = (f_small / t_small) / rate  # the short attention's rate over the long one's
        if ratio < 1 and ratio * seq > short:
            half = short * seq * (1 - ratio) / (ratio * seq - short)
    eff = min(1.0, rate * ((seq + half) / seq if seq else 1.0) / peak)
    share = m.get("attention_causal_share")
    block = 0.0
    if share is not None and seq:
        block = min(max(seq * (2.0 * share - 1.0), 0.0), seq)
    return eff, half, block


def _memory_curve(m: dict[str, Any]) -> tuple[float, tuple[tuple[float, float], ...]]:
    """(memory_bandwidth, memory_curve) of the memory-bound runs: streamed as a step
    streams (``memory_method``), the rates made never rising with size (pooled adjacent
    violators: a larger kernel measured faster than a smaller one is noise, both priced at
    their mean) over the fastest; a file from before (a hot ``x * 2``, faster than a step
    from a cache up to a few MiB) gives its largest size's rate, flat."""
    rows = sorted((float(b), float(r)) for b, _, r in m["memory"])
    if m.get("memory_method") != "streamed" or len(rows) < 2:
        return rows[-1][1], ()
    blocks: list[list[float]] = []  # [rate, weight] per block of pooled sizes
    for _, rate in rows:
        blocks.append([rate, 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            rate, weight = blocks.pop()
            blocks[-1] = [
                (blocks[-1][0] * blocks[-1][1] + rate * weight) / (blocks[-1][1] + weight),
                blocks[-1][1] + weight,
            ]
    rates = [rate for rate, weight in blocks for _ in range(int(weight))]
    top = rates[0]
    curve = tuple((b, min(1.0, r / top)) for (b, _), r in zip(rows, rates, strict=True))
    return top, curve


def _in_place_rate(m: dict[str, Any]) -> float:
    """`DeviceSpec.memory_in_place`: the median rate of the in-place runs (0: none)."""
    runs = m.get("memory_in_place") or []
    return statistics.median(rate for _, _, rate in runs) if runs else 0.0


def _half_dim(skinny: list, peak: float, launch: float) -> float:
    """`DeviceSpec.matmul_half_dim`: per measured ``[d, n] @ [n, n]``, the ``d_half`` with
    ``rate / peak = d / (d + d_half) * (n / (n + d_half)) ** 2`` (each side's share,
    `compute.compute_efficiency`; a few fixed-point rounds: the wide sides' share is near
    1); their median (0 where none is slower than peak)."""
    fits = []
    for d, f, t in skinny:
        ratio = peak / (f / max(t - launch, 1e-12))  # peak / rate
        n, half = math.sqrt(f / (2.0 * d)), 0.0
        for _ in range(4):
            half = d * (ratio * (n / (n + half)) ** 2 - 1.0)
        fits.append(half)
    return max(statistics.median(fits), 0.0) if fits else 0.0


def overlap_efficiency(compute: float, collective: float, both: float) -> float:
    """The share of the shorter of `compute` and `collective` (seconds, each alone) hidden
    when they run at once and take `both`: (compute + collective - both) / the shorter,
    in [0, 1]."""
    shorter = min(compute, collective)
    if shorter <= 0:
        return 1.0
    return min(1.0, max(0.0, (compute + collective - both) / shorter))


def _fit_link(rows: list[list[Any]], n: int, backend: str) -> Link:
    """The link whose prices of the measured calls are closest in ratio: per kind, least
    squares of log(priced / measured) over its latency ``alpha_k`` and ``x_k = 1 / beta_k``
    (a 2-D grid, `_grid_min`), each collective priced as the cost model prices one call of
    it on ``backend`` (its algorithms' steps plus one launch, `comm.algorithm_factors`; the
    cheapest algorithm), a point-to-point as `comm.send_recv_time`. Ratios, so that small
    messages weigh as much as large ones and a latency-bound backend (gloo on a CPU: ~1 ms
    a step) is not fit as a bandwidth-bound one. The link's latency is the fastest kind's
    step and its bandwidth the fastest kind's; the others are fractions of it
    (`Link.kind_efficiency`) and multiples of the step (`Link.kind_latency`): on 4 gloo
    processes a send's step fit ~0.3 ms and a reduce-scatter's ~1.2 ms, which one shared
    latency priced 2.5x too slow and 1.7x too fast. A kind the cost model prices as another
    on ``backend`` (gloo: the all-to-all as DTensor runs it, an all-gather) is left out:
    its own call is not what runs."""
    by_kind: dict[str, list[tuple[list[tuple[float, float]], float]]] = {}
    for kind, nbytes, seconds in rows:
        if seconds <= 0 or (kind != "p2p" and n == 1):
            continue
        if kind != "p2p" and volume_kind(Collective(kind), backend).value != kind:
            continue
        if kind == "p2p":
            algos = [(1.0, float(nbytes))]
        else:
            algos = [
                (s + 1.0, v * nbytes) for s, v in algorithm_factors(Collective(kind), n, backend)
            ]
        by_kind.setdefault(kind, []).append((algos, seconds))
    if not by_kind:  # a size-1 axis moves nothing: any link prices it at 0
        return Link(1e12, 0.0)
    fits = {k: _fit_kind(terms) for k, terms in sorted(by_kind.items())}  # (log a, log x)
    log_a = min(a for a, _ in fits.values())
    log_x = min(x for _, x in fits.values())
    fraction = {k: 10.0 ** (log_x - x) for k, (_, x) in fits.items()}
    if {"all_reduce", "reduce_scatter", "all_gather"} <= fraction.keys():
        # never priced above a reduce-scatter and an all-gather of its bytes (what it could
        # run instead): its fraction at least their harmonic mean
        pair = 2.0 / (1.0 / fraction["reduce_scatter"] + 1.0 / fraction["all_gather"])
        fraction["all_reduce"] = max(fraction["all_reduce"], pair)
    slower = tuple((k, f) for k, f in fraction.items() if f < 1.0 - 1e-4)
    longer = tuple((k, 10.0 ** (a - log_a)) for k, (a, _) in fits.items() if a > log_a + 1e-4)
    return Link(10.0**-log_x, 10.0**log_a, kind_efficiency=slower, kind_latency=longer)


def _fit_kind(terms: list[tuple[list[tuple[float, float]], float]]) -> tuple[float, float]:
    """(log10 alpha, log10 x) of one kind's calls: per call its algorithms' (latency
    coefficient, byte coefficient), the cheapest priced, and the seconds measured."""
    width = max(len(a) for a, _ in terms)
    pad = [a + [a[0]] * (width - len(a)) for a, _ in terms]
    lat = torch.tensor([[c for c, _ in a] for a in pad], dtype=torch.float64)
    vol = torch.tensor([[b for _, b in a] for a in pad], dtype=torch.float64)
    log_t = torch.tensor([t for _, t in terms], dtype=torch.float64).log()

    def loss(log_a, log_x):  # grid tensors -> summed squared log ratios
        a, x = (10.0 ** t[..., None, None] for t in (log_a, log_x))
        priced = (lat * a + vol * x).amin(dim=-1)
        return ((priced.log() - log_t) ** 2).sum(dim=-1)

    return _grid_min(loss, (-8.0, -14.0))  # alpha from 10 ns, beta up to 100 TB/s


def _grid_min(loss: Callable[..., torch.Tensor], lows: tuple[float, ...], decades: float = 8.0):
    """The point (one log10 value per dimension) minimizing ``loss`` (a tensor of losses
    over a meshgrid of the dimensions' values): a grid of 161 points per dimension over
    ``decades`` from ``lows``, refined three times around its best (to ~1e-5 decades)."""
    offsets = torch.linspace(0.0, decades, 161, dtype=torch.float64)
    best = list(lows)
    for _ in range(4):
        axes = [b + offsets for b in best]
        values = loss(*torch.meshgrid(*axes, indexing="ij"))
        index = torch.unravel_index(values.argmin(), values.shape)
        best = [float(ax[i]) for ax, i in zip(axes, index, strict=True)]
        step = float(offsets[1] - offsets[0])
        offsets = torch.linspace(-2 * step, 2 * step, 41, dtype=torch.float64)
    return tuple(best)


def _update_rates(runs: dict[Any, list]) -> tuple[tuple[int, float, float], ...]:
    """Per optimizer-state count and tensor size, (states, elements a tensor, elements/s):
    each set's elements over its time. More states never update faster than fewer at a
    size (noise: each taken at least as slow)."""
    out: list[tuple[int, float, float]] = []
    fastest: dict[float, float] = {}  # size -> the rate of fewer states
    for states, rows in sorted(runs.items(), key=lambda kv: int(kv[0])):
        for n, count, t in sorted(rows):
            rate = min(n * count / t, fastest.get(n, math.inf))
            fastest[n] = rate
            out.append((int(states), float(n), rate))
    return tuple(out)

"""Calibrate a ``Cluster`` on the machine it runs on: short microbenchmarks -> a cluster file.

Contract
--------
``calibrate(nproc, mesh, axis_names, backend=None, sizes="quick")`` spawns ``nproc`` local
processes on ``backend`` (NCCL with one GPU per process where there are enough GPUs, else
gloo: ``autopar.devices.choose_backend``), measures, and returns ``(cluster, measurements)``.
``write_calibration`` saves both as one JSON file that ``Cluster.load(path)``,
``autopar.plan(..., cluster=Cluster.load(path))`` and the CLI's ``--cluster path.json``
read back. Nothing here names a device: tensors live on the process group's device
(``autopar.devices.process_group_device``).

What is measured (every rank at once, as training runs; each figure is the median of a few
repetitions after a warm-up, the mean over ranks for compute and the slowest rank for a
collective; a repetition is a loop of calls lasting ``_SUSTAIN_S``, timed per call, so
that the rate is the one a rank sustains while the others compute too, where processes
share cores: one gloo collective of a few KiB timed alone measured anywhere from 0.5 to
11 ms, and the kinds' fitted bandwidth fractions moved 4x from one calibration to the
next; timed as loops they agree within ~15%):

* matmul ``[n,n] @ [n,n]`` per dtype over sizes (a dtype stops growing once one matmul
  takes over ``_SLOW_S``): ``peak_flops[dtype]`` = the rate achieved at the largest size
  (so ``matmul_efficiency = 1``: the figures are achieved ones; not the best rate of all
  sizes: where a smaller matmul runs from a CPU's cache it measured up to twice the rate
  of the large ones a training step's layers run), and the per-kernel
  fixed time ``c`` of the fit ``t = f / peak + c`` gives ``matmul_half_flops = c * peak``
  (``autopar.cost_models.compute``: ``f / (peak * f / (f + h)) = (f + h) / peak``);
* matmul ``[d, n] @ [n, n]`` in float32 for a few thin ``d`` at a layer's width ``n``:
  ``matmul_half_dim`` = the median ``d_half`` of ``rate / peak = d / (d + d_half)``
  (a matmul with a small side runs far from peak whatever its FLOPs: 2-core CPU, n =
  2048, d = 32 ran at 0.62 of the large rate), taken out of the square sizes' fixed time;
* memory-bound ``y = x * 2`` over sizes: ``memory_bandwidth`` = the rate of read + write at
  the largest size (smaller ones may run from a cache; on CPU the largest, 64 MiB, is past
  glibc's mmap threshold, so each output is freshly mapped as a step's large tensors are:
  16 MiB measured 2.6 to 20 GB/s from one calibration to the next, 64 MiB 2.3-2.5);
* ``launch_overhead``: a one-element op;
* fused attention (``scaled_dot_product_attention``, 4 heads of 64) at twice the largest
  matmul side, and at an eighth of it with 8 times the batch: the two rates over the
  matmul peak fit ``attention_efficiency`` and ``attention_half_flops`` as the matmul
  curve does; the long one again under a causal mask: its share of the unmasked time
  gives the kernel's key tile, ``attention_block`` (``compute.causal_share``);
* ``overlap_efficiency``: a loop of matmuls and an all-reduce over every rank, each alone
  and then at once (the all-reduce issued without waiting, as gradient buckets are): the
  share of the shorter one the other hides (``overlap_efficiency``; 1 where the file has no
  such measurement);
* every collective (all-reduce, all-gather, reduce-scatter, all-to-all) on every mesh axis
  over message sizes, and point-to-point between axis neighbours. Per axis and kind, the
  least-squares fit of ``t = steps * alpha_k + volume * B / beta_k`` with the cost model's
  own ring/pairwise factors (``autopar.cost_models.comm``); the link takes the fastest
  kind's alpha and beta, the others as factors (``kind_latency``, ``kind_efficiency``),
  ``efficiency = 1``.

The fabric (what re-meshing uses) is the link of the largest axis on every axis: the
processes are local, so every axis is inside one node.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.cluster import Cluster, DeviceSpec, Fabric, Link
from autopar.cost_models.comm import Collective, algorithm_factors, volume_kind
from autopar.devices import choose_backend, free_port, init_rank, process_group_device

__all__ = ["SIZES", "calibrate", "write_calibration"]

# sizes per mode: matmul n, memory-bound elements, collective bytes, repetitions
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "matmul": (32, 64),
        "skinny": ((8, 16), 64),
        "memory": (2**12, 2**14),
        "comm": (2**10, 2**14),
        "reps": 2,
    },
    "quick": {
        "matmul": (64, 128, 256, 512),
        # [d, n] @ [n, n] at the widths of a training step's layers: how thin rows slow it
        "skinny": ((16, 32, 64, 128), 2048),
        # up to 64 MiB: above glibc's largest mmap threshold (32 MiB) a new output is a
        # fresh mapping, written page fault by page fault, as a step's large tensors are
        "memory": (2**16, 2**18, 2**20, 2**22, 2**24),
        "comm": (2**10, 2**14, 2**18, 2**21, 2**24),  # up to 16 MiB: the bandwidth shows
        "reps": 3,
    },
    "gpu": {
        "matmul": (512, 1024, 2048, 4096, 8192),
        "skinny": ((32, 64, 128, 256, 512), 8192),
        "memory": (2**20, 2**24, 2**27),
        "comm": (2**14, 2**20, 2**24, 2**27),
        "reps": 5,
    },
}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_SLOW_S = 0.02  # one matmul slower than this: larger sizes of its dtype are skipped
_SUSTAIN_S, _MAX_CALLS = 0.05, 1000  # a timed compute rep: a loop of calls this long


def calibrate(
    nproc: int,
    mesh: Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
    *,
    backend: str | None = None,
    sizes: str | None = None,
    progress: bool = True,
) -> tuple[Cluster, dict[str, Any]]:
    """Measure ``nproc`` local processes on ``mesh`` (default ``(nproc,)`` named ``"dp"``);
    ``sizes``: ``"tiny"``, ``"quick"`` (CPU default) or ``"gpu"`` (NCCL default)."""
    mesh = tuple(int(s) for s in (mesh or (nproc,)))
    names = tuple(
        axis_names or (("dp",) if len(mesh) == 1 else [f"axis{i}" for i in range(len(mesh))])
    )
    if math.prod(mesh) != nproc or len(names) != len(mesh):
        raise ValueError(
            f"mesh {mesh} with axes {names} does not describe {nproc} processes: give one name "
            f"per axis and sizes that multiply to {nproc}"
        )
    backend = choose_backend(backend, nproc)
    sizes = sizes or ("gpu" if backend == "nccl" else "quick")
    if sizes not in SIZES:
        raise ValueError(f"unknown calibration sizes {sizes!r}; choose from {sorted(SIZES)}")
    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-") as tmp:
        out = Path(tmp, "measurements.json")
        mp.spawn(
            _worker,
            args=(nproc, free_port(), backend, mesh, names, sizes, str(out), progress),
            nprocs=nproc,
            join=True,
        )
        measured = json.loads(out.read_text())
    # a calibration describes the machine on its day (load, clocks, what else runs)
    measured["taken_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return cluster_from_measurements(measured, mesh, names, backend), measured


def write_calibration(cluster: Cluster, measured: dict[str, Any], path: str | os.PathLike) -> None:
    cluster.save(path, calibration=measured)


def calibration_age_hours(path: str | os.PathLike) -> float | None:
    """Hours since the cluster file at `path` was calibrated (None: not a calibration, or
    one written before calibrations were dated)."""
    with open(path) as f:
        taken = json.load(f).get("calibration", {}).get("taken_at")
    if taken is None:
        return None
    return (datetime.now(timezone.utc) - datetime.fromisoformat(taken)).total_seconds() / 3600


# ------------------------------------------------------------------------------ fitting
def cluster_from_measurements(
    m: dict[str, Any], mesh: tuple[int, ...], names: tuple[str, ...], backend: str
) -> Cluster:
    """The cluster the measurements describe (see the module docstring)."""
    peaks = {k: rows[-1][2] for k, rows in m["matmul"].items()}  # the largest size's rate
    fp32 = m["matmul"]["float32"]
    launch = m["launch_s"]
    thin = _half_dim(m.get("skinny", []), peaks["float32"], launch)
    sides = [(f / 2) ** (1 / 3) for f, _, _ in fp32]  # a square matmul's time beyond its
    fixed = [  # FLOPs at the rate its side n allows
        max(t - f * (n + thin) / (peaks["float32"] * n) - launch, 0.0)
        for (f, t, _), n in zip(fp32, sides, strict=True)
    ]
    half = statistics.median(fixed) * peaks["float32"]
    attention, attention_half, block = _attention_fit(m, peaks["float32"])
    device = DeviceSpec(
        f"calibrated {m['device_name']}",
        peaks,
        m["memory_bytes"],
        m["memory"][-1][2],  # the largest size: streamed from memory, not from a cache
        matmul_half_flops=half,
        matmul_half_dim=thin,
        attention_efficiency=max(attention, 1e-6),
        attention_half_flops=attention_half,
        attention_block=block,
        launch_overhead=launch,
        overlap_efficiency=overlap_efficiency(*m["overlap"]) if "overlap" in m else 1.0,
    )
    links = tuple(
        _fit_link(m["comm"][name], n, backend) for name, n in zip(names, mesh, strict=True)
    )
    widest = max(range(len(mesh)), key=lambda i: mesh[i])
    fabric = Fabric(links[widest], math.inf, links[widest].latency)
    return Cluster(device, mesh, names, links, backend, math.prod(mesh), fabric)


def _attention_fit(m: dict[str, Any], peak: float) -> tuple[float, float, float]:
    """(attention_efficiency, attention_half_flops, attention_block) from the long and the
    short attention's rates (``rate = eff * peak * f / (f + h)`` through both) and the
    causal run's share of the full one's time (``causal_share``'s ``(1 + block / seq) / 2``;
    a share of 1 says only that the tile is at least the sequence). A file without the
    short and causal runs (older calibrations) gives the long rate alone."""
    rate = m.get("attention_flops") or 0.0
    if not rate:
        return 1.0, 0.0, 0.0
    seq = m.get("attention_seq", 0)
    f_big = 4.0 * 4 * seq * seq * 64
    half = 0.0
    if "attention_small" in m and seq:
        f_small, t_small = m["attention_small"]
        ratio = (f_small / t_small) / rate  # the short kernel's rate over the long one's
        if ratio < 1 and ratio * f_big > f_small:
            half = f_small * f_big * (1 - ratio) / (ratio * f_big - f_small)
    eff = min(1.0, rate * (f_big + half) / (f_big * peak)) if f_big else min(1.0, rate / peak)
    share = m.get("attention_causal_share")
    block = 0.0
    if share is not None and seq:
        block = min(max(seq * (2.0 * share - 1.0), 0.0), float(seq))
    return eff, half, block


def _half_dim(skinny: list, peak: float, launch: float) -> float:
    """`DeviceSpec.matmul_half_dim`: per measured ``[d, n] @ [n, n]``, the ``d_half`` with
    ``rate / peak = d / (d + d_half)``; their median (0 where none is slower than peak)."""
    fits = [d * (peak / (f / max(t - launch, 1e-12)) - 1.0) for d, f, t in skinny]
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


# ------------------------------------------------------------------------------ workers
class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled

    def step(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            end = "\n" if self.done == self.total else ""
            print(f"\r[{bar}] {self.done}/{self.total} {what:<40}", end=end, file=sys.stderr)
            sys.stderr.flush()


def _worker(
    rank: int, world: int, port: int, backend: str, mesh, names, sizes: str, out: str, show: bool
) -> None:
    init_rank(rank, world, port, backend)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        device = process_group_device(backend)
        dmesh = init_device_mesh(device, tuple(mesh), mesh_dim_names=tuple(names))
        cfg = SIZES[sizes]
        total = 2 + len(cfg["matmul"]) * len(_DTYPES) + len(cfg["memory"])
        total += len(cfg["skinny"][0])
        total += len(names) * len(cfg["comm"]) * (len(_KINDS) + 1) + 1
        bar = _Progress(total, show and rank == 0)
        measured = _measure(device, dmesh, names, cfg, bar)
        if rank == 0:
            Path(out).write_text(json.dumps(measured))
    finally:
        dist.destroy_process_group()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str, reps: int, group=None) -> float:
    """Median seconds per call of ``fn`` after a warm-up, each repetition a loop of calls
    lasting at least ``_SUSTAIN_S`` on every rank at once (the same count everywhere): with
    a ``group`` (a collective) the slowest of its ranks' (it ends when its last rank does),
    else the mean over all ranks: the rate a rank sustains while the others compute too,
    as in training (one call of a few milliseconds may run while another rank waits for a
    core: where processes share cores one call measured up to twice the rate a training
    step gets, and one collective of a few KiB anywhere from 0.5 to 11 ms)."""
    fn()  # warm-up (a collective's first call may set up its connections)
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    calls = _calls_lasting(time.perf_counter() - t0, device)
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / calls)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(
        t, op=dist.ReduceOp.MAX if group is not None else dist.ReduceOp.SUM, group=group
    )
    return float(t.item()) / (1 if group is not None else dist.get_world_size())


def _calls_lasting(one_call_s: float, device: str) -> int:
    """Calls of a ``one_call_s`` op that last ``_SUSTAIN_S``, the same on every rank (the
    fewest any rank asks for)."""
    t = torch.tensor([math.ceil(_SUSTAIN_S / max(one_call_s, 1e-7))], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(min(max(t.item(), 1), _MAX_CALLS))


def _agree(flag: bool, device: str) -> bool:
    """``flag`` on any rank (so that every rank runs the same benchmarks)."""
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _measure(device: str, dmesh, names, cfg: dict[str, Any], bar: _Progress) -> dict[str, Any]:
    reps = cfg["reps"]
    one = torch.ones(1, device=device)
    launch = _timed(lambda: one.mul(2), device, max(reps, 5) * 4)
    bar.step("launch overhead")
    matmul: dict[str, list] = {}
    for dtype in _DTYPES:
        key = str(dtype).removeprefix("torch.")
        matmul[key] = []
        slow = False  # a dtype without fast kernels here (fp16 on many CPUs): stop growing
        for n in cfg["matmul"]:
            if not slow:
                a = torch.randn(n, n, device=device).to(dtype)
                t = _timed(lambda a=a: a @ a, device, reps)
                matmul[key].append((2.0 * n**3, t, 2.0 * n**3 / t))
                slow = _agree(t > _SLOW_S, device)
            bar.step(f"matmul {key} n={n}")
    rows, width = cfg["skinny"]
    w = torch.randn(width, width, device=device)
    skinny = []
    for d in rows:
        a = torch.randn(d, width, device=device)
        skinny.append((d, 2.0 * d * width * width, _timed(lambda a=a: a @ w, device, reps)))
        bar.step(f"matmul float32 {d} x {width}")
    memory = []
    for numel in cfg["memory"]:
        x = torch.randn(numel, device=device)
        t = _timed(lambda x=x: x * 2, device, reps)
        memory.append((2.0 * numel * 4, t, 2.0 * numel * 4 / t))
        bar.step(f"memory-bound {numel * 4 >> 10} KiB")
    attention = _attention(device, cfg, reps)
    bar.step("attention")
    comm = {name: _measure_axis(device, dmesh, name, cfg, bar) for name in names}
    overlap = _overlap(device, cfg)
    bar.step("overlap")
    return {
        "device_name": _device_name(device),
        "memory_bytes": _memory_bytes(device, dist.get_world_size()),
        "launch_s": launch,
        "matmul": matmul,
        "skinny": skinny,
        "memory": memory,
        **attention,
        "comm": comm,
        "overlap": overlap,
    }


def _overlap(device: str, cfg: dict[str, Any]) -> list[float]:
    """(compute, all-reduce, both) seconds: a loop of matmuls alone, an all-reduce of the
    largest message over every rank alone, and the all-reduce issued without waiting while
    the same loop runs, then waited (as `passes.comm` overlaps a gradient bucket with the
    backward); the loop is sized to last about as long as the all-reduce."""
    n = max(cfg["matmul"])
    a = torch.randn(n, n, device=device)
    full = torch.randn(max(cfg["comm"]) // 4, device=device)
    reduce_s = _timed(lambda: dist.all_reduce(full), device, cfg["reps"], dist.group.WORLD)
    one = _timed(lambda: a @ a, device, cfg["reps"])
    t = torch.tensor([max(1, round(reduce_s / max(one, 1e-9)))], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the same loop on every rank
    calls = int(min(t.item(), _MAX_CALLS))

    def compute() -> None:
        for _ in range(calls):
            a @ a

    def both() -> None:
        work = dist.all_reduce(full, async_op=True)
        compute()
        work.wait()

    reps = max(cfg["reps"], 7)  # the difference of three times: more repetitions
    return [
        _timed(f, device, reps, dist.group.WORLD)
        for f in (compute, lambda: dist.all_reduce(full), both)
    ]


def _attention(device: str, cfg: dict[str, Any], reps: int) -> dict[str, Any]:
    """Fused attention, 4 heads of 64: FLOP/s at a long sequence (twice the largest
    matmul side), the time a causal mask leaves of it (`causal_share`), and (flops,
    seconds) at an eighth of the sequence with 8 times the batch (a kernel of 1/8 the
    FLOPs: the size curve)."""
    seq = 2 * max(cfg["matmul"])
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def timed(batch: int, length: int, causal: bool) -> tuple[float, float]:
        q = torch.randn(batch, 4, length, 64, device=device)
        t = _timed(lambda: sdpa(q, q, q, is_causal=causal), device, reps)
        return 4.0 * batch * 4 * length * length * 64, t

    flops, full = timed(1, seq, False)
    _, causal = timed(1, seq, True)
    return {
        "attention_flops": flops / full,
        "attention_seq": seq,
        "attention_causal_share": causal / full,
        "attention_small": timed(8, seq // 8, False),
    }


def _measure_axis(device: str, dmesh, name: str, cfg: dict[str, Any], bar: _Progress) -> list:
    group = dmesh.get_group(name)
    n = dist.get_world_size(group)
    rows: list[tuple[str, int, float]] = []
    for nbytes in cfg["comm"]:
        numel = max(n, nbytes // 4 // n * n)
        full = torch.randn(numel, device=device)
        spare = torch.empty_like(full)
        part = torch.randn(numel // n, device=device)
        ops = _collectives(full, spare, part, group)
        for kind, fn in ops.items():
            if n > 1:
                rows.append((kind, numel * 4, _timed(fn, device, cfg["reps"], group)))
            bar.step(f"{name}: {kind} {numel * 4 >> 10} KiB")
        if n > 1:
            rows.append(("p2p", numel * 4, _p2p(full, group, device, cfg["reps"])))
        bar.step(f"{name}: send/recv {numel * 4 >> 10} KiB")
    return rows


def _collectives(full, spare, part, group) -> dict[str, Callable[[], Any]]:
    return {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "all_gather": lambda: dist.all_gather_single(full, part, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_single(part, full, group=group),
        "all_to_all": lambda: dist.all_to_all_single(spare, full, group=group),
    }


def _p2p(buf: torch.Tensor, group, device: str, reps: int) -> float:
    """Even group ranks send to the next one (pipeline neighbours), odd ones receive."""
    me, n = dist.get_group_rank(group, dist.get_rank()), dist.get_world_size(group)
    peer = me + 1 if me % 2 == 0 else me - 1

    def exchange() -> None:
        if peer >= n:
            return
        other = dist.get_global_rank(group, peer)
        if me % 2 == 0:
            dist.send(buf, other)
        else:
            dist.recv(buf, other)

    return _timed(exchange, device, reps, group)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{device} ({os.cpu_count()} cores)"


def _memory_bytes(device: str, world: int) -> float:
    if device == "cuda":
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(pages) / world  # local processes share the host's memory

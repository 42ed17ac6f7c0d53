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
collective; a repetition is a loop of calls lasting 0.25 s, timed per call
(`autopar.calibration_timing`), so that the rate is the one a rank sustains while the
others compute too, where processes share cores: one gloo collective of a few KiB timed
alone measured anywhere from 0.5 to 11 ms, and the kinds' fitted bandwidth fractions moved
4x from one calibration to the next; timed as loops they agree within ~15%):

* matmul ``[n,n] @ [n,n]`` per dtype over sizes (a dtype stops growing once one matmul
  takes over ``_SLOW_S``): ``peak_flops[dtype]`` = the rate achieved at the largest size
  (so ``matmul_efficiency = 1``: the figures are achieved ones; not the best rate of all
  sizes: where a smaller matmul runs from a CPU's cache it measured up to twice the rate
  of the large ones a training step's layers run), and the per-kernel
  fixed time ``c`` of the fit ``t = f / peak + c`` gives ``matmul_half_flops = c * peak``
  (``autopar.cost_models.compute``: ``f / (peak * f / (f + h)) = (f + h) / peak``);
* matmul ``[d, n] @ [n, n]`` in float32 for a few thin ``d`` at a layer's width ``n``:
  ``matmul_half_dim`` = the median ``d_half`` of ``rate / peak = d / (d + d_half) *
  (n / (n + d_half)) ** 2`` (each side's share: a matmul with a small side runs far from
  peak whatever its FLOPs: 2-core CPU, n = 2048, d = 32 ran at 0.62 of the large rate),
  taken out of the square sizes' fixed time;
* memory-bound ``y = x * 2`` over sizes, streamed as a step streams them (``_streamed``:
  inputs from a pool beyond the caches, outputs new tensors): ``memory_curve``, the rate of
  read + write per size over the fastest (``memory_bandwidth``), never rising with size
  (on CPU the largest, 64 MiB, is past glibc's mmap threshold, so each output is freshly
  mapped as a step's large tensors are: 2.3-2.5 GB/s, where a few MiB streamed 8-14);
  the same in place (``x.mul_(2)``, as an optimizer's kernels write): the median rate
  over the sizes, ``memory_in_place`` (17-29 GB/s there, no fresh mapping at any size);
* the elementwise ops whose arithmetic may bound them (gelu, silu, sigmoid, tanh, softmax,
  log-softmax and their backwards: ``cost_models.compute.RATED_BACKWARD``), streamed as
  above at one size: ``op_rates``, elements/s less the launch (on a 2-core CPU gelu ran
  ~2 G elements/s where ``x * 2`` ran ~7: transcendental math, not bytes, bounds it);
* the optimizer's update as torch's loop runs it (SGD, SGD with momentum, AdamW) on sets
  of float32 parameters from many small tensors to a few large ones: ``update_rates``,
  elements/s per state count and tensor size (on a CPU 256 KiB tensors ran ~2x the rate
  of 16 MiB ones, whose new outputs are fresh mappings);
* ``launch_overhead``: a one-element op;
* fused attention (``scaled_dot_product_attention``, 4 heads of 64) at twice the largest
  matmul side, and at an eighth of it with 8 times the batch: the two rates over the
  matmul peak fit ``attention_efficiency`` and ``attention_half_seq`` (``rate = eff *
  peak * kv / (kv + half)`` in the key length ``kv``); the long one again under a causal
  mask: its share of the unmasked time gives the kernel's key tile, ``attention_block``
  (``compute.causal_share``);
* ``overlap_efficiency``: a loop of matmuls and an all-reduce over every rank, each alone
  and then at once (the all-reduce issued without waiting, as gradient buckets are): the
  share of the shorter one the other hides (``overlap_efficiency``; 1 where the file has no
  such measurement);
* ``core_share``: the share of a core each process had, all of them computing at once
  (min(1, cores / processes) on a CPU host, 1 on a GPU), which every rate above was
  measured under (`search.core_sharing` prices a pipeline's stages with it);
* every collective (all-reduce, all-gather, reduce-scatter, all-to-all) on every mesh axis
  over message sizes, and point-to-point between axis neighbours. Per axis and kind, the
  least-squares fit of ``t = steps * alpha_k + volume * B / beta_k`` with the cost model's
  own ring/pairwise factors (``autopar.cost_models.comm``); the link takes the fastest
  kind's alpha and beta, the others as factors (``kind_latency``, ``kind_efficiency``),
  ``efficiency = 1``.

The fabric (what re-meshing uses) is the link of the largest axis on every axis: the
processes are local, so every axis is inside one node. The fits live in
`autopar.calibration_fit` (`cluster_from_measurements`); this module measures.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.calibration_fit import cluster_from_measurements
from autopar.calibration_timing import MAX_CALLS, agree, loops_for, timed, timed_in_turns
from autopar.cluster import Cluster
from autopar.devices import (
    choose_backend,
    free_port,
    init_rank,
    local_cores,
    process_group_device,
)

__all__ = ["SIZES", "calibrate", "write_calibration"]

# sizes per mode: matmul n, memory-bound elements, collective bytes, repetitions
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "matmul": (32, 64),
        "skinny": ((8, 16), 64),
        "memory": (2**12, 2**14),
        "rated": 2**12,
        "update": ((2**8, 16), (2**12, 1)),
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
        "rated": 2**20,  # 4 MiB, a step's activation of a small layer
        # (elements, tensors): 256 KiB..16 MiB tensors, 64 MiB a set (beyond the caches, as a
        # step's update finds its states: 32 tensors of 256 KiB ran twice as fast from them)
        "update": ((2**16, 256), (2**19, 32), (2**22, 4)),
        "comm": (2**10, 2**14, 2**18, 2**21, 2**24),  # up to 16 MiB: the bandwidth shows
        "reps": 3,
    },
    "gpu": {
        "matmul": (512, 1024, 2048, 4096, 8192),
        "skinny": ((32, 64, 128, 256, 512), 8192),
        "memory": (2**20, 2**24, 2**27),
        "rated": 2**26,
        "update": ((2**18, 256), (2**21, 32), (2**24, 4)),
        "comm": (2**14, 2**20, 2**24, 2**27),
        "reps": 5,
    },
}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_SLOW_S = 0.02  # one matmul slower than this: larger sizes of its dtype are skipped
_POOL_BYTES = 64 * 2**20  # memory-bound inputs cycled beyond a CPU's or a GPU's last cache


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
    loops_for(sizes)
    init_rank(rank, world, port, backend)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        device = process_group_device(backend)
        dmesh = init_device_mesh(device, tuple(mesh), mesh_dim_names=tuple(names))
        cfg = SIZES[sizes]
        total = 4 + len(cfg["matmul"]) * len(_DTYPES) + len(cfg["memory"])
        total += len(cfg["skinny"][0])
        total += len(names) * len(cfg["comm"]) * (len(_KINDS) + 1) + 1
        bar = _Progress(total, show and rank == 0)
        measured = _measure(device, dmesh, names, cfg, bar)
        if rank == 0:
            Path(out).write_text(json.dumps(measured))
    finally:
        dist.destroy_process_group()


def _measure(device: str, dmesh, names, cfg: dict[str, Any], bar: _Progress) -> dict[str, Any]:
    reps = cfg["reps"]
    one = torch.ones(1, device=device)
    launch = timed(lambda: one.mul(2), device, max(reps, 5) * 4)
    bar.step("launch overhead")
    matmul: dict[str, list] = {}
    for dtype in _DTYPES:
        key = str(dtype).removeprefix("torch.")
        matmul[key] = []
        slow = False  # a dtype without fast kernels here (fp16 on many CPUs): stop growing
        for n in cfg["matmul"]:
            if not slow:
                a = torch.randn(n, n, device=device).to(dtype)
                t = timed(lambda a=a: a @ a, device, reps)
                matmul[key].append((2.0 * n**3, t, 2.0 * n**3 / t))
                slow = agree(t > _SLOW_S, device)
            bar.step(f"matmul {key} n={n}")
    rows, width = cfg["skinny"]
    w = torch.randn(width, width, device=device)
    skinny = []
    for d in rows:
        a = torch.randn(d, width, device=device)
        skinny.append((d, 2.0 * d * width * width, timed(lambda a=a: a @ w, device, reps)))
        bar.step(f"matmul float32 {d} x {width}")
    memory, in_place = [], []
    for numel in cfg["memory"]:
        memory.append(_streamed(numel, device, reps))
        in_place.append(_streamed(numel, device, reps, in_place=True))
        bar.step(f"memory-bound {numel * 4 >> 10} KiB")
    rated = _op_rates(cfg["rated"], device, reps)
    bar.step("elementwise ops' arithmetic")
    updates = _updates(cfg["update"], device, reps)
    bar.step("optimizer updates")
    attention = _attention(device, cfg, reps)
    bar.step("attention")
    comm = {name: _measure_axis(device, dmesh, name, cfg, bar) for name in names}
    overlap = _overlap(device, cfg)
    bar.step("overlap")
    return {
        "device_name": _device_name(device),
        "memory_bytes": _memory_bytes(device, dist.get_world_size()),
        "core_share": _core_share(device, dist.get_world_size()),
        "launch_s": launch,
        "matmul": matmul,
        "skinny": skinny,
        "memory": memory,
        "memory_method": "streamed",
        "memory_in_place": in_place,
        "op_rates": rated,
        "update": updates,
        **attention,
        "comm": comm,
        "overlap": overlap,
    }


def _streamed(
    numel: int, device: str, reps: int, in_place: bool = False
) -> tuple[float, float, float]:
    """(bytes, seconds, bytes/s) of ``y = x * 2`` on ``numel`` float32 elements as a
    training step's elementwise ops run: each input one of a pool read long ago (not from
    a cache), each output a new tensor while the pool's last outputs stay alive (the
    allocator hands out memory not touched lately; on CPU, past glibc's mmap threshold, a
    fresh mapping). A hot ``x * 2`` on one tensor ran 68-100 GB/s up to 8 MiB on a 2-core
    CPU, where a step's elementwise ops ran 8-14. ``in_place``: ``x.mul_(2)``, no new
    tensor (an optimizer's kernels)."""
    pool = _pool(numel, (numel,), device)
    op = (lambda x, _: x.mul_(2)) if in_place else (lambda x, _: x * 2)
    t = timed(_cycled(op, pool), device, reps)
    return 2.0 * numel * 4, t, 2.0 * numel * 4 / t


def _pool(numel: int, shape: tuple[int, ...], device: str) -> list[torch.Tensor]:
    """Inputs of ``numel`` float32 elements (as ``shape``) filling `_POOL_BYTES`, so that
    each call reads one read long ago, beyond the caches (at least two)."""
    count = max(2, -(-_POOL_BYTES // (numel * 4)))
    return [torch.randn(shape, device=device) for _ in range(count)]


def _cycled(op: Callable[[torch.Tensor, torch.Tensor], Any], pool: list) -> Callable[[], None]:
    """A call of ``op(x, g)`` on the pool's next input and the one before it, its output
    kept in that input's slot until the pool comes round (the allocator then hands out
    memory not touched lately, as in a step)."""
    kept: list[Any] = [None] * len(pool)
    turn = iter(range(1 << 62))

    def call() -> None:
        i = next(turn) % len(pool)
        kept[i] = op(pool[i], pool[i - 1])

    return call


def _overlap(device: str, cfg: dict[str, Any]) -> list[float]:
    """(compute, all-reduce, both) seconds: a loop of matmuls alone, an all-reduce of the
    largest message over every rank alone, and the all-reduce issued without waiting while
    the same loop runs, then waited (as `passes.comm` overlaps a gradient bucket with the
    backward); the loop is sized to last about as long as the all-reduce."""
    n = max(cfg["matmul"])
    a = torch.randn(n, n, device=device)
    full = torch.randn(max(cfg["comm"]) // 4, device=device)
    reduce_s = timed(lambda: dist.all_reduce(full), device, cfg["reps"], dist.group.WORLD)
    one = timed(lambda: a @ a, device, cfg["reps"])
    t = torch.tensor([max(1, round(reduce_s / max(one, 1e-9)))], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the same loop on every rank
    calls = int(min(t.item(), MAX_CALLS))

    def compute() -> None:
        for _ in range(calls):
            a @ a

    def both() -> None:
        work = dist.all_reduce(full, async_op=True)
        compute()
        work.wait()

    reps = max(cfg["reps"], 7)  # the difference of three times: more repetitions
    return [
        timed(f, device, reps, dist.group.WORLD)
        for f in (compute, lambda: dist.all_reduce(full), both)
    ]


def _op_rates(numel: int, device: str, reps: int) -> dict[str, tuple[int, float]]:
    """Per ATen op whose arithmetic may bound it (`cost_models.compute.RATED_BACKWARD`:
    gelu, silu, sigmoid, tanh, softmax, log-softmax and their backwards), (elements,
    seconds) of one call on ``numel`` float32 elements streamed as `_streamed` streams
    them (softmaxes over rows of 1024), timed in turns."""
    aten = torch.ops.aten
    pool = _pool(numel // 1024 * 1024, (numel // 1024, 1024), device)
    calls = {
        "gelu": lambda x, g: aten.gelu(x),
        "gelu_backward": lambda x, g: aten.gelu_backward(g, x),
        "gelu[tanh]": lambda x, g: aten.gelu(x, approximate="tanh"),
        "gelu_backward[tanh]": lambda x, g: aten.gelu_backward(g, x, approximate="tanh"),
        "silu": lambda x, g: aten.silu(x),
        "silu_backward": lambda x, g: aten.silu_backward(g, x),
        "sigmoid": lambda x, g: aten.sigmoid(x),
        "sigmoid_backward": lambda x, g: aten.sigmoid_backward(g, x),
        "tanh": lambda x, g: aten.tanh(x),
        "tanh_backward": lambda x, g: aten.tanh_backward(g, x),
        "_softmax": lambda x, g: aten._softmax(x, -1, False),
        "_softmax_backward_data": lambda x, g: aten._softmax_backward_data(g, x, -1, x.dtype),
        "_log_softmax": lambda x, g: aten._log_softmax(x, -1, False),
        "_log_softmax_backward_data": lambda x, g: aten._log_softmax_backward_data(
            g, x, -1, x.dtype
        ),
    }
    times = timed_in_turns([_cycled(op, pool) for op in calls.values()], device, reps)
    return {name: (numel // 1024 * 1024, t) for name, t in zip(calls, times, strict=True)}


def _updates(sets, device: str, reps: int) -> dict[int, list[tuple[int, int, float]]]:
    """Per optimizer-state count (0: SGD, 1: SGD with momentum, 2: AdamW), torch's
    ``step()`` timed on each set of ``(elements, tensors)`` float32 parameters with their
    gradients: ``(elements, tensors, seconds)`` per set, an optimizer's sets timed in
    turns (and freed before the next optimizer's)."""
    factories = {
        0: lambda ps: torch.optim.SGD(ps, lr=1e-6),
        1: lambda ps: torch.optim.SGD(ps, lr=1e-6, momentum=0.9),
        2: lambda ps: torch.optim.AdamW(ps, lr=1e-6),
    }
    out: dict[int, list[tuple[int, int, float]]] = {}
    for states, make in factories.items():
        steps = []
        for numel, count in sets:
            params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(count)]
            for p in params:
                p.grad = torch.randn_like(p)
            steps.append(make(params).step)
        times = timed_in_turns(steps, device, reps)
        out[states] = [(n, c, t) for (n, c), t in zip(sets, times, strict=True)]
    return out


def _attention(device: str, cfg: dict[str, Any], reps: int) -> dict[str, Any]:
    """Fused attention, 4 heads of 64: FLOP/s at a long sequence (twice the largest
    matmul side), the time a causal mask leaves of it (`causal_share`), and (flops,
    seconds) at an eighth of the sequence with 8 times the batch (the rate's curve in the
    key length)."""
    seq = 2 * max(cfg["matmul"])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    runs = ((1, seq, False), (1, seq, True), (8, seq // 8, False))  # (batch, keys, causal)
    qs = [(torch.randn(b, 4, n, 64, device=device), c) for b, n, c in runs]
    calls = [lambda q=q, c=c: sdpa(q, q, q, is_causal=c) for q, c in qs]
    full, causal, short = timed_in_turns(calls, device, max(reps, 7))
    flops = [4.0 * b * 4 * n * n * 64 for b, n, _ in runs]
    return {
        "attention_flops": flops[0] / full,
        "attention_seq": seq,
        "attention_causal_share": causal / full,
        "attention_small": (flops[2], short),
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
                rows.append((kind, numel * 4, timed(fn, device, cfg["reps"], group)))
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

    return timed(exchange, device, reps, group)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{device} ({os.cpu_count()} cores)"


def _core_share(device: str, world: int) -> float:
    """The share of a core each of the `world` local processes had (1 on a GPU: its own)."""
    return 1.0 if device != "cpu" else min(1.0, local_cores() / world)


def _memory_bytes(device: str, world: int) -> float:
    if device == "cuda":
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(pages) / world  # local processes share the host's memory

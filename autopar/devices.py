"""Which device and collective backend a run uses: from its process group, never a constant.

NCCL runs on CUDA, gloo on CPU (``device_for_backend``; ``process_group_device`` reads the
live group). ``choose_backend`` picks the backend for N local processes (NCCL when there is
a GPU for each, else gloo; NCCL without enough GPUs is a ValueError) and
``bind_local_device`` gives each process its own GPU before the group is initialized.
``local_preset`` names the cluster preset ``Cluster.local`` prices this device with.
``free_port`` and ``init_rank`` start a local multi-process job (tests, calibration,
benchmarks): one thread per rank, its own GPU under NCCL, a bounded collective timeout.
``device_mesh`` builds each DeviceMesh (and its process groups) once per process.
``cache_host_memory`` keeps a CPU run's freed tensors for reuse (as CUDA's caching
allocator keeps device memory).
Planning on the fake process group (shapes only) keeps CPU meshes: see ``planning``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import functools
import os
import socket
from typing import Any

import torch

# CUDA device names (torch.cuda.get_device_name) -> the preset of the machine they come in
_GPU_PRESETS = (("H100", "dgx-h100"), ("A100", "dgx-a100-80g"), ("V100", "p3.16xlarge"))


def device_for_backend(backend: str) -> str:
    """The device type a collective backend runs on: ``"cuda"`` for NCCL (also inside a
    multi-device backend string such as ``"cpu:gloo,cuda:nccl"``), ``"cpu"`` otherwise."""
    return "cuda" if "nccl" in backend.lower() else "cpu"


BACKENDS = ("gloo", "nccl")


def choose_backend(requested: str | None, nproc: int, gpus: int | None = None) -> str:
    """The collective backend for `nproc` local processes: `requested`, or without one
    NCCL when there are at least `nproc` GPUs (`gpus`, default this machine's count), else
    gloo. ValueError for an unknown backend, or NCCL with fewer GPUs than processes (NCCL
    needs one GPU per process)."""
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested is None:
        return "nccl" if gpus >= nproc and gpus > 0 else "gloo"
    backend = requested.lower()
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose from {', '.join(BACKENDS)}")
    if backend == "nccl" and gpus < nproc:
        raise ValueError(
            f"backend nccl needs one GPU per process: {nproc} processes but {gpus} GPU(s) "
            "visible; run fewer processes, or use backend gloo (CPU)"
        )
    return backend


def bind_local_device(backend: str, local_rank: int) -> str:
    """Before ``init_process_group(backend)``: a CUDA backend makes GPU `local_rank` this
    process's current device (one process per GPU). Returns the device type."""
    device = device_for_backend(backend)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    return device


def process_group_device(fallback_backend: str = "gloo") -> str:
    """The device type of the initialized default process group, else of `fallback_backend`.

    The fake group planning runs under (``backend == "fake"``) has no device: it falls back
    too, as does a process without torch.distributed."""
    import torch.distributed as dist

    backend = fallback_backend
    if dist.is_available() and dist.is_initialized():
        live = str(dist.get_backend())
        if live != "fake":
            backend = live
    return device_for_backend(backend)


def local_preset(device: str | None = None, device_name: str | None = None) -> str:
    """The preset ``Cluster.local`` prices a run with: ``"cpu"`` for CPU processes, else the
    GPU preset whose device matches ``device_name`` (this process's CUDA device by default;
    an unknown GPU gets ``"dgx-h100"``: calibrate for real figures)."""
    device = device or process_group_device()
    if device == "cpu":
        return "cpu"
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    upper = device_name.upper()
    return next((preset for key, preset in _GPU_PRESETS if key in upper), "dgx-h100")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the rendezvous of a local job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int, backend: str, timeout_s: float = 300.0) -> None:
    """Join a local job of `world` processes on `backend` at 127.0.0.1:`port`: one thread,
    this rank's GPU under NCCL (all ranks are local), collectives timing out after
    `timeout_s` (a rank that fails mid-collective must not leave the others waiting for
    torch's default 30 minutes); a CPU rank's freed memory kept (`cache_host_memory`)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if device_for_backend(backend) == "cpu":
        cache_host_memory()
    bind_local_device(backend, rank)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


# (the default group the meshes were built on, {(device type, ranks, axis names): mesh})
_MESHES: tuple[object, dict] = (None, {})


def device_mesh(device_type: str, ranks: torch.Tensor, names: tuple[str, ...]) -> Any:
    """The DeviceMesh over `ranks` (its shape is the mesh's) with axis `names`, built once
    per process and default group: building one makes a process group per axis, each with
    its own worker threads and sockets under gloo, and nothing ever frees them, so a
    process that compiles many plans (a benchmark's runs, the test suite's kept ranks:
    ~700 threads and ~1,200 open sockets a rank after 200 parity cases) would hold a set
    per compile. Collectives are ordered per group alike on every rank, so two programs
    may share a mesh's groups. Every rank must ask for the same meshes in the same order
    (the first ask builds its groups collectively)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    global _MESHES
    world = dist.group.WORLD
    if _MESHES[0] is not world:  # a new default group: the old meshes' groups are gone
        _MESHES = (world, {})
    key = (device_type, tuple(ranks.shape), tuple(ranks.flatten().tolist()), tuple(names))
    meshes = _MESHES[1]
    if key not in meshes:
        meshes[key] = DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names))
    return meshes[key]


def local_cores() -> int:
    """The CPU cores this process may run on."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return n or 1


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@functools.cache
def cache_host_memory() -> bool:
    """Keep this process's freed host memory for its next tensors, as CUDA's caching
    allocator keeps device memory: glibc's malloc otherwise maps each large tensor afresh
    and unmaps it when freed, so a CPU step writes its large outputs page fault by page
    fault (4 gloo processes on 2 cores: ``x * 2`` on 64 MiB ran 2.4 GB/s, 14 GB/s with this;
    AdamW's step on 16 MiB tensors 0.14-0.17 G elements/s, 0.24), and whether a tensor is
    mapped afresh depends on what the process freed before (glibc's threshold moves), which
    made a calibration's rates differ 2x from a run's. Here no allocation is mapped on its
    own (``M_MMAP_MAX`` 0) and the heap's free top is not given back (``M_TRIM_THRESHOLD``):
    the process holds its peak, as a GPU process holds its cached blocks. glibc only (not
    musl, macOS or Windows), once per process; ``AUTOPAR_HOST_MALLOC=system`` leaves the
    allocator as it is. Returns whether it is set."""
    if os.environ.get("AUTOPAR_HOST_MALLOC", "cache") == "system":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:  # no C library to load by that name
        return False
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)  # int mallopt(int, int)
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))

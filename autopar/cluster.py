"""The machine a plan is made for: one device type on an N-D mesh with one link per mesh axis.

Contract
--------
``Cluster`` is pure, frozen, hashable data: a ``DeviceSpec`` (peak FLOP/s per dtype, memory
per device, memory bandwidth, achieved efficiencies; ``autopar.hardware``), the logical ``mesh_shape`` with ``axis_names``, one ``Link``
(alpha-beta: per-device bus bandwidth in bytes/s, latency in s) per mesh axis, the
collective ``backend`` and ``devices_per_node``. What the runtime overlaps is priced from
its schedule (``autopar.cost_models.buckets``), not set here. ``to_dict``/
``from_dict`` round-trip exactly through JSON; ``save``/``load`` write and read a cluster
file (``autopar calibrate`` measures one). Nothing here talks to a process group except ``Cluster.local`` (which checks the
world size) and ``Cluster.device_mesh`` (which builds the DTensor ``DeviceMesh``).

The device a run uses comes from its process group, never from a constant
(``autopar.devices``): ``Cluster.local`` prices the local GPU's preset under NCCL, the
``cpu`` one under gloo, and ``device_mesh`` builds a mesh of the live group's device type.

Presets and per-axis links
--------------------------
Mesh axes are laid out row-major over ranks, ranks fill a node before the next one, so the
*last* axis is the fastest varying. For axis ``i`` let ``span = prod(mesh[i:])`` and
``inner = prod(mesh[i+1:])``:

* ``span <= devices_per_node``: every group of this axis lives inside one node, the link is
  the intra-node one (NVLink).
* otherwise the axis crosses nodes. ``min(devices_per_node, inner)`` groups of this axis run
  concurrently per node and share the node's NICs, so per-device bandwidth is
  ``min(intra_bw, node_nic_bw / min(devices_per_node, inner))`` with the inter-node latency.
  For the usual ``(node, gpu)`` mesh this is exactly the per-GPU NIC bandwidth (e.g. 8x400Gb/s
  -> 50 GB/s on a DGX H100); a flat 1-D axis over several nodes gets the whole node's NICs
  (NCCL stripes one ring over all of them).

Peak FLOP/s are dense tensor-core numbers. ``float32`` is *true* FP32 (PyTorch's default,
``torch.backends.cuda.matmul.allow_tf32 = False``), not TF32: build your own ``DeviceSpec``
if you enable TF32. Dtypes without an entry (int64, bool, float64) use the float32 peak.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.devices import device_mesh, local_preset, process_group_device
from autopar.hardware import DeviceSpec, Fabric, Link

__all__ = ["Cluster", "DeviceSpec", "Fabric", "Link", "PRESETS"]

_GiB = 2**30


@dataclass(frozen=True, slots=True)
class _Preset:
    device: DeviceSpec
    intra: Link  # inside a node (per device)
    nic_bandwidth_per_node: float  # bytes/s, all NICs of a node together
    inter_latency: float
    devices_per_node: int | None  # None: as many as the mesh asks for (cpu)
    backend: str
    device_label: str  # name of the per-node axis in default meshes
    inter_efficiency: float = 1.0

    @property
    def fabric(self) -> Fabric:
        return Fabric(
            self.intra, self.nic_bandwidth_per_node, self.inter_latency, self.inter_efficiency
        )


# Efficiency figures (fractions of the line rates above that real kernels and collectives
# reach), from published measurements:
#   GEMM: cuBLAS large bf16 GEMMs reach ~85% of peak on A100 and ~72% on H100 SXM (NVIDIA,
#     "New cuBLAS 12.0 Features and Matrix Multiplication Performance on NVIDIA Hopper
#     GPUs", 2023; CUTLASS profiler tables); a 1024^3 GEMM reaches ~2/3 of that, hence
#     matmul_half_flops ~ 1-2 GFLOP.
#   Attention: FlashAttention-2 (Dao, 2023) fwd+bwd ~65% of peak on A100; on H100 FA2 runs
#     at ~35% and FA3 at up to ~75% (Shah et al., 2024): cuDNN/FA-class kernels ~50%.
#     Their key tiles are 64-128 tokens (FA2's kBlockN; FA3 128): under a causal mask a
#     kernel runs ~(1 + 128 / seq) / 2 of the unmasked work (attention_block).
#   Memory-bound kernels: BabelStream/STREAM triad reaches ~85% of HBM bandwidth.
#   Collectives: nccl-tests ring busbw ~370 GB/s of NVLink4's 450 GB/s line rate
#     (NVIDIA/nccl-tests#212), ~230 GB/s of NVLink3's 300 (NVIDIA/nccl-tests#149 reports
#     200-230), ~90% of InfiniBand line rate across nodes.
#   Launch: ~3 us per CUDA kernel (launch latency plus the tail between kernels).
PRESETS: dict[str, _Preset] = {
    # 8x A100-SXM4-80GB, NVLink3 (~300 GB/s bus bw), 8x HDR 200Gb/s InfiniBand (25 GB/s/GPU).
    "dgx-a100-80g": _Preset(
        DeviceSpec(
            "A100-SXM4-80GB", {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}, 80 * _GiB, 2.0e12,
            matmul_efficiency=0.85, matmul_half_flops=1e9, attention_efficiency=0.65, attention_block=128,
            memory_efficiency=0.85, launch_overhead=3e-6,
        ),
        Link(300e9, 5e-6, 0.77), 8 * 25e9, 10e-6, 8, "nccl", "gpu", inter_efficiency=0.9,
    ),
    # 8x H100-SXM5-80GB, NVLink4 (~450 GB/s bus bw), 8x NDR 400Gb/s InfiniBand (50 GB/s/GPU).
    "dgx-h100": _Preset(
        DeviceSpec(
            "H100-SXM5-80GB", {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12}, 80 * _GiB, 3.35e12,
            matmul_efficiency=0.72, matmul_half_flops=2e9, attention_efficiency=0.5, attention_block=128,
            memory_efficiency=0.85, launch_overhead=3e-6,
        ),
        Link(450e9, 5e-6, 0.82), 8 * 50e9, 10e-6, 8, "nccl", "gpu", inter_efficiency=0.9,
    ),
    # 8x V100-SXM2-16GB, NVLink2 (~150 GB/s), one 25Gb/s Ethernet NIC per node. V100 has no
    # bf16 units: bf16 runs at the fp32 rate. (cuBLAS fp16 GEMMs ~80% of peak; NCCL over
    # TCP ~80% of the Ethernet line rate.)
    "p3.16xlarge": _Preset(
        DeviceSpec(
            "V100-SXM2-16GB", {"float32": 15.7e12, "bfloat16": 15.7e12, "float16": 125e12}, 16 * _GiB, 900e9,
            matmul_efficiency=0.8, matmul_half_flops=5e8, attention_efficiency=0.5, attention_block=128,
            memory_efficiency=0.85, launch_overhead=3e-6,
        ),
        Link(150e9, 5e-6, 0.85), 25e9 / 8, 30e-6, 8, "nccl", "gpu",  # 25 Gb/s = 3.125e9 B/s per node
        inter_efficiency=0.8,
    ),
    # This CPU box with gloo: every axis, inside or across "nodes", gets the same slow link.
    # Its figures are rough achieved rates already; `autopar calibrate` measures real ones.
    # gloo's all-gather and reduce-scatter move their bytes far slower than its all-reduce
    # (`autopar calibrate --nproc 4` on a 2-core box: bus bandwidth 0.096 and 0.058 of the
    # fitted line rate against the all-reduce's 0.58, the all-to-all's 0.58): priced alike,
    # a TP plan on gloo reduce-scatters and all-gathers where all-reducing is faster.
    # gloo's collectives run on the cores the compute runs on: an all-reduce issued without
    # waiting hides little under a matmul loop (`autopar calibrate --nproc 4` on a 2-core
    # box measured overlap_efficiency 0.06 and 0.0).
    "cpu": _Preset(
        DeviceSpec(
            "cpu", {"float32": 50e9, "bfloat16": 25e9, "float16": 25e9}, 24e9, 20e9,
            overlap_efficiency=0.1, attention_block=512,  # PyTorch's CPU flash kernel
        ),
        Link(1e9, 50e-6, kind_efficiency=(("all_gather", 0.17), ("reduce_scatter", 0.1))),
        math.inf, 50e-6, None, "gloo", "cpu",
    ),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Cluster:
    """``device`` x ``mesh_shape`` (named by ``axis_names``), one ``Link`` per mesh axis."""

    device: DeviceSpec
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    links: tuple[Link, ...]
    backend: str = "nccl"
    devices_per_node: int = 8
    fabric: Fabric | None = None  # presets know it; lets the search re-mesh the devices
    # the fields' hash, taken once: the cost models' memos key on the cluster per lookup
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # rebuilt where unpickled: string hashes differ between processes
        fields = (self.device, self.mesh_shape, self.axis_names, self.links, self.backend)
        return Cluster, (*fields, self.devices_per_node, self.fabric)

    def __post_init__(self) -> None:
        mesh = tuple(self.mesh_shape)
        names = tuple(self.axis_names)
        links = tuple(self.links)
        if not mesh:
            raise ValueError("Cluster.mesh_shape must have at least one axis")
        if any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in mesh):
            raise ValueError(f"Cluster.mesh_shape must be positive ints, got {mesh}")
        if not (len(mesh) == len(names) == len(links)):
            raise ValueError(
                f"mesh_shape {mesh}, axis_names {names} and links ({len(links)}) must have one "
                "entry per mesh axis"
            )
        if any(not isinstance(n, str) or not n for n in names):
            raise ValueError(f"axis_names must be non-empty strings, got {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"axis_names must be unique, got {names}")
        if any(not isinstance(link, Link) for link in links):
            raise ValueError("Cluster.links must be Link instances")
        if not self.backend:
            raise ValueError("Cluster.backend must be a non-empty string")
        if isinstance(self.devices_per_node, bool) or int(self.devices_per_node) <= 0:
            raise ValueError(f"devices_per_node must be > 0, got {self.devices_per_node!r}")
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "devices_per_node", int(self.devices_per_node))
        fields = (self.device, mesh, names, links, self.backend, self.devices_per_node)
        object.__setattr__(self, "_hash", hash((*fields, self.fabric)))

    # ---------------------------------------------------------------- queries
    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    def axis_index(self, axis: int | str) -> int:
        """Index of mesh axis ``axis`` (a name, or an int, negative counting from the end)."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise ValueError(f"unknown mesh axis {axis!r}; axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if not -self.ndim <= axis < self.ndim:
            raise ValueError(f"mesh axis {axis} out of range for a {self.ndim}-D mesh")
        return axis % self.ndim

    def axis_size(self, axis: int | str) -> int:
        return self.mesh_shape[self.axis_index(axis)]

    def link(self, axis: int | str) -> Link:
        return self.links[self.axis_index(axis)]

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict; ``Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c``."""
        return {
            "device": self.device.to_dict(),
            "mesh_shape": list(self.mesh_shape),
            "axis_names": list(self.axis_names),
            "links": [lk.to_dict() for lk in self.links],
            "backend": self.backend,
            "devices_per_node": self.devices_per_node,
            **({"fabric": self.fabric.to_dict()} if self.fabric else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        if float(data.get("comm_overlap") or 0.0):  # a file from before stop 31
            warnings.warn(
                f"this cluster file sets comm_overlap={data['comm_overlap']}, which autopar "
                "no longer reads: the communication the runtime hides under compute is "
                "priced from its schedule (autopar.cost_models.buckets). Remove the key.",
                stacklevel=2,
            )
        try:
            return cls(
                device=DeviceSpec.from_dict(data["device"]),
                mesh_shape=tuple(int(s) for s in data["mesh_shape"]),
                axis_names=tuple(data["axis_names"]),
                links=tuple(Link.from_dict(lk) for lk in data["links"]),
                backend=data.get("backend", "nccl"),
                devices_per_node=int(data.get("devices_per_node", 8)),
                fabric=Fabric.from_dict(data["fabric"]) if "fabric" in data else None,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"not a Cluster dict ({e!r}): {json.dumps(data, default=str)[:200]}"
            ) from e

    def save(self, path: str | os.PathLike[str], **extra: Any) -> None:
        """Write the cluster as JSON (``extra`` keys, e.g. calibration measurements, ride
        along and are ignored by ``load``)."""
        with open(path, "w") as f:
            json.dump({**self.to_dict(), **extra}, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        """A cluster file written by ``save`` or ``autopar calibrate``."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read cluster file {str(path)!r}: {e}") from e
        return cls.from_dict(data)

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.mesh_shape, strict=True))
        links = ", ".join(f"{n}: {lk}" for n, lk in zip(self.axis_names, self.links, strict=True))
        return f"{self.device.name} x{self.world_size} mesh({axes}) links({links}) {self.backend}"

    # ---------------------------------------------------------------- constructors
    @classmethod
    def preset(
        cls,
        name: str,
        nodes: int = 1,
        mesh: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        *,
        devices_per_node: int | None = None,
    ) -> Cluster:
        """A known machine type (see ``PRESETS``) times ``nodes``.

        Default mesh: ``(nodes, devices_per_node)`` named ``("node", "gpu")`` if ``nodes > 1``,
        else ``(devices_per_node,)``. A given ``mesh`` must use every device. The ``cpu`` preset
        has no fixed node size: it takes ``prod(mesh) // nodes`` (1 without a mesh).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; known presets: {sorted(PRESETS)}")
        p = PRESETS[name]
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes <= 0:
            raise ValueError(f"nodes must be a positive int, got {nodes!r}")
        dpn = devices_per_node or p.devices_per_node
        if dpn is None:
            total = math.prod(mesh) if mesh is not None else nodes
            if total % nodes:
                raise ValueError(
                    f"mesh {tuple(mesh or ())} does not split evenly over {nodes} nodes"
                )
            dpn = total // nodes
        if mesh is None:
            mesh = (nodes, dpn) if nodes > 1 else (dpn,)
            if axis_names is None:
                axis_names = ("node", p.device_label) if nodes > 1 else (p.device_label,)
        mesh = tuple(int(s) for s in mesh)
        if math.prod(mesh) != nodes * dpn:
            raise ValueError(
                f"mesh {mesh} has {math.prod(mesh)} devices but preset {name!r} with nodes={nodes} "
                f"has {nodes}x{dpn} = {nodes * dpn}; pass a mesh whose sizes multiply to "
                f"{nodes * dpn}, or change nodes="
            )
        if axis_names is None:
            axis_names = tuple(f"axis{i}" for i in range(len(mesh)))
        _check_names(mesh, axis_names)
        return cls(
            device=p.device,
            mesh_shape=mesh,
            axis_names=tuple(axis_names),
            links=p.fabric.axis_links(mesh, dpn),
            backend=p.backend,
            devices_per_node=dpn,
            fabric=p.fabric,
        )

    def reshaped(self, mesh_shape: Sequence[int], axis_names: Sequence[str]) -> Cluster:
        """The same devices on another logical mesh (row-major over ranks, nodes filled
        first), with each axis's link derived from the fabric."""
        mesh = tuple(int(s) for s in mesh_shape)
        if math.prod(mesh) != self.world_size:
            raise ValueError(
                f"mesh {mesh} has {math.prod(mesh)} devices; this cluster has {self.world_size}"
            )
        _check_names(mesh, axis_names)
        if self.fabric is None:
            raise ValueError(
                "this cluster was built from explicit per-axis links, so its devices cannot be "
                "re-meshed; build it with Cluster.preset(...) or pass the mesh you want"
            )
        return Cluster(
            self.device,
            mesh,
            tuple(axis_names),
            self.fabric.axis_links(mesh, self.devices_per_node),
            self.backend,
            self.devices_per_node,
            self.fabric,
        )

    @classmethod
    def local(
        cls,
        mesh: Sequence[int] = (2, 2),
        axis_names: Sequence[str] = ("dp", "tp"),
        preset: str | None = None,
    ) -> Cluster:
        """The cluster this process runs in (launched by torchrun), links from ``preset``.

        Checks ``prod(mesh)`` against the initialized process group; without one, only a
        single-device mesh is accepted. Devices per node come from ``LOCAL_WORLD_SIZE``.
        Without ``preset``, the process group's device picks one (``local_preset``): the
        GPU preset matching this CUDA device under NCCL, ``"cpu"`` under gloo.
        """
        import torch.distributed as dist

        if preset is None:
            preset = local_preset()

        mesh = tuple(int(s) for s in mesh)
        need = math.prod(mesh)
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            if need != world:
                raise ValueError(
                    f"mesh {mesh} has {need} devices but the process group has {world} ranks; "
                    f"pass a mesh whose sizes multiply to {world} (e.g. mesh=({world},)), or "
                    f"launch {need} processes (torchrun --nproc-per-node {need} ...)"
                )
        elif need != 1:
            raise RuntimeError(
                f"Cluster.local(mesh={mesh}) needs {need} processes but torch.distributed is not "
                f"initialized; launch with `torchrun --nproc-per-node {need} script.py` and call "
                "torch.distributed.init_process_group() first (backend 'gloo' on CPU), or use "
                "Cluster.preset(...) to plan without launching"
            )
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", need))
        if local_world <= 0 or need % local_world:
            local_world = need
        return cls.preset(
            preset,
            nodes=need // local_world,
            mesh=mesh,
            axis_names=tuple(axis_names),
            devices_per_node=local_world,
        )

    def device_mesh(self, device_type: str | None = None) -> Any:
        """The DeviceMesh over this cluster's mesh (needs an initialized process group; one
        per process: ``devices.device_mesh``).

        The device type is that of the running process group (``process_group_device``):
        ``"cuda"`` under NCCL, ``"cpu"`` under gloo, whatever machine the cluster describes
        (a plan for a DGX priced on a gloo box still runs on the box's CPUs)."""
        import torch

        if device_type is None:
            device_type = process_group_device(self.backend)
        ranks = torch.arange(math.prod(self.mesh_shape)).reshape(self.mesh_shape)
        return device_mesh(device_type, ranks, self.axis_names)


def with_pipeline_axis(cluster: Cluster, stages: int | None) -> Cluster:
    """The cluster with its pipeline axis named "pp" first, and at least one other axis.

    An axis already named "pp" is used as it is (it must be the first). Otherwise
    `stages` splits the first axis: (n, ...) -> (stages, n // stages, ...), dropping a
    resulting size-1 axis unless it is the only one left beside "pp"."""
    names = tuple(cluster.axis_names)
    if "pp" in names:
        if names[0] != "pp":
            raise ValueError(f"the pipeline axis 'pp' must be the first mesh axis; got {names}")
        if stages not in (None, cluster.mesh_shape[0]):
            raise ValueError(
                f"pipeline_stages={stages} but the 'pp' axis has size "
                f"{cluster.mesh_shape[0]}; drop one of the two"
            )
        base = cluster
    elif stages is None or stages == 1:
        return cluster
    else:
        first = cluster.mesh_shape[0]
        if first % stages:
            raise ValueError(
                f"pipeline_stages={stages} does not divide the first mesh axis "
                f"('{names[0]}' of size {first}); name a 'pp' axis in the mesh"
            )
        shape = (stages, first // stages, *cluster.mesh_shape[1:])
        links = (cluster.links[0], cluster.links[0], *cluster.links[1:])
        base = replace(cluster, mesh_shape=shape, axis_names=("pp", *names), links=links)
        if shape[1] == 1 and len(shape) > 2:
            base = replace(
                base,
                mesh_shape=(shape[0], *shape[2:]),
                axis_names=("pp", *names[1:]),
                links=(links[0], *links[2:]),
            )
    if len(base.mesh_shape) == 1:
        base = replace(
            base,
            mesh_shape=(*base.mesh_shape, 1),
            axis_names=(*base.axis_names, "stage"),
            links=base.links * 2,
        )
    return base


def _check_names(mesh: tuple[int, ...], axis_names: Sequence[str]) -> None:
    """One name per mesh axis (said in the caller's words, not the links' it derives)."""
    names = tuple(axis_names)
    if len(names) != len(mesh):
        raise ValueError(
            f"axis_names {names} give {len(names)} name(s) but mesh {mesh} has {len(mesh)} "
            "axes: give one name per mesh axis"
        )

"""Hardware figures a cluster is made of: one device (``DeviceSpec``), one link per mesh axis
(``Link``), the network links are derived from (``Fabric``).

Contract: pure, frozen, hashable, validated data (``ValueError`` naming the field). Peaks are
line rates (FLOP/s per dtype, bytes/s); the efficiencies are the fractions of them that
kernels and collectives achieve, each in (0, 1] (``autopar.cost_models`` prices with both).
``to_dict``/``from_dict`` round-trip through JSON; a dict without the efficiency keys (a file
from before they existed) loads with every efficiency 1 and no launch overhead.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["DeviceSpec", "Fabric", "Link"]

_DTYPE_KEYS = ("float32", "bfloat16", "float16")
_DEVICE_FIELDS = (
    "memory_bytes",
    "memory_bandwidth",
    "matmul_efficiency",
    "matmul_half_flops",
    "matmul_half_dim",
    "attention_efficiency",
    "attention_half_seq",
    "attention_block",
    "memory_efficiency",
    "launch_overhead",
    "overlap_efficiency",
    "memory_in_place",
    "core_share",
)


class _FrozenMap(Mapping[str, float]):
    """Read-only, hashable ``dict`` replacement (a frozen dataclass must stay hashable)."""

    __slots__ = ("_d", "_hash")

    def __init__(self, items: Mapping[str, float]) -> None:
        self._d = dict(items)
        self._hash = hash(frozenset(self._d.items()))  # read by every priced collective's memo

    def __getitem__(self, key: str) -> float:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # rebuilt where unpickled: string hashes differ between processes
        return _FrozenMap, (self._d,)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._d) == dict(other)

    def __repr__(self) -> str:
        return repr(self._d)


def _dtype_key(dtype: str | torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"


def _fraction(value: float, what: str) -> float:
    value = float(value)
    if not 0 < value <= 1:
        raise ValueError(f"{what} is a fraction: it must be in (0, 1], got {value!r}")
    return value


def _non_negative(value: float, what: str) -> float:
    value = float(value)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return value


def _positive(value: float, what: str) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return value


def _memory_curve(points) -> tuple[tuple[float, float], ...]:
    curve = tuple(
        (_positive(b, "memory_curve size"), _fraction(f, "memory_curve fraction"))
        for b, f in points
    )
    sizes, fractions = [b for b, _ in curve], [f for _, f in curve]
    if sizes != sorted(set(sizes)) or fractions != sorted(fractions, reverse=True):
        raise ValueError(
            f"memory_curve must list (bytes, fraction) by ascending size with fractions never "
            f"rising, got {curve}"
        )
    return curve


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype, memory (bytes) and memory bandwidth (bytes/s),
    and the fractions of those peaks kernels achieve (``autopar.cost_models.compute``)."""

    name: str
    peak_flops: Mapping[str, float]  # "float32"/"bfloat16"/"float16" -> FLOP/s
    memory_bytes: float
    memory_bandwidth: float
    matmul_efficiency: float = 1.0  # achieved / peak FLOP/s of a large matmul kernel
    matmul_half_flops: float = 0.0  # FLOPs of a kernel reaching half of matmul_efficiency
    attention_efficiency: float = 1.0  # achieved / peak FLOP/s of fused attention kernels
    memory_efficiency: float = 1.0  # achieved / peak bandwidth of memory-bound kernels
    launch_overhead: float = 0.0  # seconds per kernel (launch, dispatch, tail)
    # the fraction of a collective's time that hides under compute running meanwhile: 1
    # for NCCL on its own SMs (the GPU presets' assumption); processes sharing CPU cores
    # with gloo's threads hide little (`autopar calibrate` measures it)
    overlap_efficiency: float = 1.0
    # the side (rows, inner or columns) at which a matmul kernel runs at half its rate,
    # each side scaling it by d / (d + this) (0: no shape effect): a skinny matmul is far
    # from peak whatever its FLOPs
    matmul_half_dim: float = 0.0
    # the key length at which attention runs at half of attention_efficiency (0: no effect)
    attention_half_seq: float = 0.0
    # the key/value tile of the fused attention kernel, in tokens: a causal mask skips only
    # the tiles wholly above the diagonal (0: every masked score skipped, half the work)
    attention_block: float = 0.0
    # memory-bound kernels by size: (bytes a kernel moves, fraction of memory_bandwidth),
    # sizes ascending, fractions never rising (`autopar calibrate` measures them; empty:
    # every size at memory_efficiency). On a CPU a kernel of a few MiB streams from memory
    # 4x faster than one whose output is a fresh mapping (past glibc's mmap threshold).
    memory_curve: tuple[tuple[float, float], ...] = ()
    # bytes/s of a memory-bound kernel that writes into one of its inputs (an optimizer's
    # `mul_`, `lerp_`: no new tensor, so no fresh mapping at any size; 0: `memory_rate`).
    # 4 CPU processes on 2 cores: 17-29 GB/s, where a new output ran 10-13 (2.5 at 64 MiB)
    memory_in_place: float = 0.0
    # elements/s of the elementwise ops whose arithmetic, not their bytes, bounds them, by
    # ATen op name (`autopar calibrate` measures them; empty: every op by its bytes). A
    # CPU's gelu, silu, softmax run 2-4x below the rate their bytes allow (transcendental
    # math: 4 processes on 2 cores, gelu + gelu_backward 12.7 ms of a GPT step priced 3.4);
    # a GPU's special-function units keep them memory-bound
    op_rates: tuple[tuple[str, float], ...] = ()
    # the optimizer's update as torch's loop runs it here, per optimizer-state count (0 SGD,
    # 1 SGD with momentum, 2 AdamW) and tensor size: (states, float32 elements a tensor,
    # elements/s), `autopar calibrate` times the loop itself (empty: priced by its passes,
    # `cost_models.optimizer.LOOP_PASSES`). 4 CPU processes on 2 cores: AdamW ran 0.10-0.12 G
    # elements/s on 16 MiB tensors, where its 20 passes were priced ~0.24
    update_rates: tuple[tuple[int, float, float], ...] = ()
    # the share of a CPU core each process had while the rates above were measured, all
    # computing at once (min(1, cores / processes); 1: one each, as every GPU has): below
    # 1, a process computes faster while others on its cores wait (`search.core_sharing`)
    core_share: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("DeviceSpec.name must be a non-empty string")
        flops = {
            _dtype_key(k): _positive(v, f"peak_flops[{k!r}]") for k, v in self.peak_flops.items()
        }
        if "float32" not in flops:
            raise ValueError(f"DeviceSpec {self.name!r}: peak_flops needs a 'float32' entry")
        object.__setattr__(self, "peak_flops", _FrozenMap(flops))
        object.__setattr__(self, "memory_bytes", _positive(self.memory_bytes, "memory_bytes"))
        object.__setattr__(
            self, "memory_bandwidth", _positive(self.memory_bandwidth, "memory_bandwidth")
        )
        for name in (
            *("matmul_efficiency", "attention_efficiency", "memory_efficiency"),
            "core_share",
        ):
            object.__setattr__(self, name, _fraction(getattr(self, name), name))
        for name in (
            *("matmul_half_flops", "matmul_half_dim", "launch_overhead", "memory_in_place"),
            *("attention_half_seq", "attention_block"),
        ):
            object.__setattr__(self, name, _non_negative(getattr(self, name), name))
        overlap = float(self.overlap_efficiency)
        if not 0 <= overlap <= 1:
            raise ValueError(f"overlap_efficiency must be in [0, 1], got {overlap!r}")
        object.__setattr__(self, "overlap_efficiency", overlap)
        object.__setattr__(self, "memory_curve", _memory_curve(self.memory_curve))
        rates = {str(k): _positive(v, f"op_rates[{k!r}]") for k, v in dict(self.op_rates).items()}
        object.__setattr__(self, "op_rates", tuple(sorted(rates.items())))
        updates = sorted(
            (int(k), _positive(n, "update_rates size"), _positive(r, "update_rates rate"))
            for k, n, r in self.update_rates
        )
        object.__setattr__(self, "update_rates", tuple(updates))

    def update_rate(self, states: int, numel: float) -> float:
        """Elements/s of the update with ``states`` optimizer states on a tensor of ``numel``
        elements (``update_rates``: log-log between the measured sizes, flat beyond); 0:
        none measured."""
        rows = [(n, r) for k, n, r in self.update_rates if k == states]
        if not rows:
            return 0.0
        if numel <= rows[0][0]:
            return rows[0][1]
        for (n0, r0), (n1, r1) in itertools.pairwise(rows):
            if numel <= n1:
                return r0 * (r1 / r0) ** (math.log(numel / n0) / math.log(n1 / n0))
        return rows[-1][1]

    def op_rate(self, name: str) -> float:
        """Elements/s measured for the ATen op ``name`` (``op_rates``); 0: none measured."""
        for op, rate in self.op_rates:
            if op == name:
                return rate
        return 0.0

    def memory_rate(self, nbytes: float, in_place: bool = False) -> float:
        """Bytes/s a memory-bound kernel moving ``nbytes`` achieves: ``memory_curve``
        interpolated in log-log between its sizes (flat beyond its ends), or
        ``memory_efficiency`` of the bandwidth where the device has no curve; a kernel
        writing ``in_place`` at ``memory_in_place`` where the device has that figure."""
        if in_place and self.memory_in_place:
            return self.memory_in_place
        curve = self.memory_curve
        if not curve:
            return self.memory_bandwidth * self.memory_efficiency
        if nbytes <= curve[0][0]:
            return self.memory_bandwidth * curve[0][1]
        for (b0, f0), (b1, f1) in itertools.pairwise(curve):
            if nbytes <= b1:
                t = math.log(nbytes / b0) / math.log(b1 / b0)
                return self.memory_bandwidth * f0 * (f1 / f0) ** t
        return self.memory_bandwidth * curve[-1][1]

    def peak_flops_for(self, dtype: str | torch.dtype) -> float:
        """Peak FLOP/s for ``dtype``; dtypes without an entry fall back to float32."""
        return self.peak_flops.get(_dtype_key(dtype), self.peak_flops["float32"])

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            **{f: getattr(self, f) for f in _DEVICE_FIELDS},
        }
        if self.memory_curve:
            out["memory_curve"] = [list(point) for point in self.memory_curve]
        if self.op_rates:
            out["op_rates"] = dict(self.op_rates)
        if self.update_rates:
            out["update_rates"] = [list(row) for row in self.update_rates]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSpec:
        curve = tuple(tuple(point) for point in data.get("memory_curve", ()))
        fields = {f: data[f] for f in _DEVICE_FIELDS if f in data}
        fields["op_rates"] = tuple(dict(data.get("op_rates", {})).items())
        fields["update_rates"] = tuple(tuple(row) for row in data.get("update_rates", ()))
        return cls(data["name"], data["peak_flops"], **fields, memory_curve=curve)


@dataclass(frozen=True, slots=True)
class Link:
    """Alpha-beta link of one mesh axis: per-device bus ``bandwidth`` (bytes/s, line rate),
    ``latency`` (s per algorithm step) and ``efficiency``, the fraction of the line rate a
    collective's bus bandwidth reaches on large messages (nccl-tests' busbw / line rate).
    ``kind_efficiency``: (collective kind or "p2p", fraction) for the kinds whose bytes move
    slower than that on this backend (`autopar calibrate` fits them: gloo's all-gather on a
    CPU runs at a fraction of its all-reduce's bus bandwidth); the others at 1.
    ``kind_latency``: (kind or "p2p", factor) for the kinds whose steps take longer than
    ``latency`` (gloo on 4 CPU processes: a send ~0.3 ms, a reduce-scatter step ~1.2);
    the others at 1."""

    bandwidth: float
    latency: float
    efficiency: float = 1.0
    kind_efficiency: tuple[tuple[str, float], ...] = ()
    kind_latency: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", _positive(self.bandwidth, "Link.bandwidth"))
        object.__setattr__(self, "efficiency", _fraction(self.efficiency, "Link.efficiency"))
        latency = float(self.latency)
        if not (latency >= 0 and math.isfinite(latency)):
            raise ValueError(f"Link.latency must be a finite number >= 0, got {latency!r}")
        object.__setattr__(self, "latency", latency)
        kinds = tuple(
            (str(k), _fraction(v, f"Link.kind_efficiency[{k!r}]"))
            for k, v in sorted(dict(self.kind_efficiency).items())
        )
        object.__setattr__(self, "kind_efficiency", kinds)
        factors = []
        for k, v in sorted(dict(self.kind_latency).items()):
            v = float(v)
            if not (v >= 1.0 and math.isfinite(v)):
                raise ValueError(
                    f"Link.kind_latency[{k!r}] must be a finite number >= 1, got {v!r}"
                )
            factors.append((str(k), v))
        object.__setattr__(self, "kind_latency", tuple(factors))

    @property
    def bus_bandwidth(self) -> float:
        """Bytes/s a collective's bus moves on large messages: ``bandwidth * efficiency``."""
        return self.bandwidth * self.efficiency

    def kind_bandwidth(self, kind: str) -> float:
        """Bytes/s the bus of collective ``kind`` (or "p2p") moves on large messages."""
        for k, fraction in self.kind_efficiency:
            if k == kind:
                return self.bus_bandwidth * fraction
        return self.bus_bandwidth

    def latency_of(self, kind: str) -> float:
        """Seconds per step of collective ``kind`` (or "p2p")."""
        return self.latency * dict(self.kind_latency).get(kind, 1.0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bandwidth": self.bandwidth,
            "latency": self.latency,
            "efficiency": self.efficiency,
        }
        if self.kind_efficiency:
            out["kind_efficiency"] = dict(self.kind_efficiency)
        if self.kind_latency:
            out["kind_latency"] = dict(self.kind_latency)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Link:
        kinds = tuple(dict(data.get("kind_efficiency", {})).items())
        lat = tuple(dict(data.get("kind_latency", {})).items())
        return cls(data["bandwidth"], data["latency"], data.get("efficiency", 1.0), kinds, lat)

    def __str__(self) -> str:
        kinds = "".join(f" {k} x{v:.2g}" for k, v in self.kind_efficiency)
        kinds += "".join(f" {k} latency x{v:.2g}" for k, v in self.kind_latency)
        return f"{self.bus_bandwidth / 1e9:.4g} GB/s {self.latency * 1e6:.3g} us{kinds}"


@dataclass(frozen=True, slots=True)
class Fabric:
    """The network a mesh's per-axis links are derived from (see the module docstring)."""

    intra: Link  # inside a node (per device)
    nic_bandwidth_per_node: float  # bytes/s, all NICs of a node together
    inter_latency: float
    inter_efficiency: float = 1.0  # busbw / line rate of collectives across nodes

    def axis_links(self, mesh: Sequence[int], devices_per_node: int) -> tuple[Link, ...]:
        links = []
        for i in range(len(mesh)):
            if math.prod(mesh[i:]) <= devices_per_node:
                links.append(self.intra)
                continue
            concurrent = min(devices_per_node, math.prod(mesh[i + 1 :]))
            nic = self.nic_bandwidth_per_node / concurrent
            latency = max(self.inter_latency, self.intra.latency)
            if nic < self.intra.bandwidth:
                kinds = self.intra.kind_efficiency
                lat = self.intra.kind_latency
                links.append(Link(nic, latency, self.inter_efficiency, kinds, lat))
            else:
                links.append(replace(self.intra, latency=latency))
        return tuple(links)

    def to_dict(self) -> dict[str, Any]:
        return {
            "intra": self.intra.to_dict(),
            "nic_bandwidth_per_node": self.nic_bandwidth_per_node,
            "inter_latency": self.inter_latency,
            "inter_efficiency": self.inter_efficiency,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fabric:
        return cls(
            Link.from_dict(data["intra"]),
            float(data["nic_bandwidth_per_node"]),
            float(data["inter_latency"]),
            float(data.get("inter_efficiency", 1.0)),
        )

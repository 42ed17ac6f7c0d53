"""Compute cost model: FLOPs and bytes of an ATen FX node, roofline time.

FLOPs (``node_flops``), from the node's ``meta["val"]`` FakeTensors
--------------------------------------------------------------------
* Ops in ``torch.utils.flop_counter.flop_registry`` (mm, addmm, bmm, baddbmm, convolution,
  the fused sdpa kernels and their backwards, ...) use PyTorch's own formulas, e.g. mm
  ``[M,K] @ [K,N]`` = ``2*M*N*K``.
* ``aten.scaled_dot_product_attention`` (kept whole by capture) and the CPU flash kernel:
  ``QK^T`` and ``PV`` = ``2*B*Hq*T*S*D + 2*B*Hq*T*S*Dv`` (= ``4*B*H*T*S*D``; GQA broadcasts KV
  heads). With ``is_causal`` the count is halved (the scores a causal mask keeps); what
  a flash kernel runs of the rest depends on its key tile (``causal_share``, below).
  (PyTorch's counter does not halve.)
* View ops (``OpOverload.is_view``, ``_unsafe_view``, getitem) cost 0 FLOPs and 0 bytes.
* Everything else: 1 FLOP per element of the largest tensor it touches (the output for
  elementwise ops, the input for reductions).

Bytes (``node_bytes``): bytes of all tensor inputs + outputs (each read or written once).
Gathers (embedding, index_select, index, gather) read only the rows they output, so their
table input is charged at the output's size.

Time (``compute_time``): a roofline at the rates kernels achieve, plus launches::

    time = max(flops / (peak_flops[dtype] * eff), bytes / (mem_bandwidth * mem_eff))
           + kernels * launch_overhead

``eff`` depends on the op class (``op_class``): matmuls follow the size curve
``eff(f) = matmul_efficiency * f / (f + matmul_half_flops)`` in the FLOPs ``f`` of one kernel
(small matmuls are far from peak; the curve is a fixed ``half_flops / (peak * eff)`` seconds
per kernel added to the large-matmul rate), times ``d / (d + matmul_half_dim)`` for each
local side ``d`` of a plain matmul (``matmul_dims``: rows, inner dimension and columns; a
matmul with a small side, a few rows of a microbatch split many ways or a weight gradient
over them, is far from peak whatever its FLOPs: on a 2-core CPU ``[32, 2048] @ [2048,
2048]`` ran at 0.62 of the large rate, ``d_half`` ~19; and every small side slows it: 4
processes on 2 cores ran a GPT layer's ``[512, 256] @ [256, 768]`` at 0.86 of the large
rate, where its smallest side alone would have given 0.94), fused attention runs at
``attention_efficiency``, times ``kv / (kv + attention_half_seq)`` in its key length
``kv`` (a 128-token attention ran at ~0.7 of a 1024-token one's rate on a 2-core CPU,
whatever its batch and heads: the rate follows the sequence, not the FLOPs) and, under a
causal mask, ``1 / (2 * causal_share)``: the kernel skips only the key tiles
(``attention_block`` tokens) wholly above the diagonal, so it runs ``causal_share`` of the
unmasked work for the half of it counted; memory-bound ops (``"memory"``: everything
else, whose arithmetic intensity puts them on the bandwidth side; their FLOP side stays at
peak) stream at ``memory_efficiency`` of the HBM bandwidth, as every class's bytes do, or
at the rate ``DeviceSpec.memory_curve`` gives a kernel of their size (bytes / kernels). The
figures live on ``DeviceSpec`` (presets: published measurements; ``autopar calibrate``:
this machine's). All efficiencies are in (0, 1]. An elementwise op whose arithmetic is
slower than its bytes (a CPU's gelu, silu, softmax: transcendental math) takes at least
its elements at the rate the device measured for it and its backward's op
(``rated_seconds``, ``DeviceSpec.op_rates``; the GPU presets have none).
``backward_factor``: backward FLOPs / forward FLOPs: 2 for matmuls and convolutions (grad of
input and of weight), 2.5 for attention (flash backward recomputes ``QK^T``: 5 matmuls vs 2),
1 otherwise. ``backward_bytes_factor``: backward bytes / forward bytes: 2 for matmuls (each
backward kernel moves as much as the forward one: a small-batch matmul's three kernels are
each memory-bound), 2 for attention, 1 otherwise. A region (:mod:`autopar.capture.regions`)
counts its own forward FLOPs (``Region.flops``) and has a backward factor of 3
(:data:`REGION_BACKWARD_FACTOR`: its backward runs the forward again, then differentiates
it). ``entry_bytes``: ``node_bytes`` per operand and output, which a strategy's placements
divide (``search.costs.CostContext.local_bytes``: a replicated operand is read whole).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.fx import Node
from torch.fx.node import map_arg
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from autopar.capture.operands import operands
from autopar.capture.regions import spec_of
from autopar.cluster import Cluster
from autopar.hardware import DeviceSpec

# a region's backward runs its forward again (1) and differentiates it (2)
REGION_BACKWARD_FACTOR = 3.0

__all__ = [
    "OP_CLASSES",
    "backward_bytes_factor",
    "backward_factor",
    "compute_efficiency",
    "compute_time",
    "entry_bytes",
    "rated_seconds",
    "matmul_dims",
    "shard_count",
    "local_matmul_dims",
    "op_class",
    "training_kernels",
    "node_bytes",
    "node_dtype",
    "node_flops",
    "node_time",
]

aten = torch.ops.aten

_SDPA = {
    aten.scaled_dot_product_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
}
_SDPA_FUSED = {
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
}
_MATMUL = {
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten.matmul,
    aten.linear,
    aten.convolution,
    aten._convolution,
}
_FREE = {aten._unsafe_view, aten.sym_size, aten.sym_numel, aten.sym_stride}
_GATHERS = {aten.embedding, aten.index_select, aten.index, aten.gather}


def _packet(node: Node) -> Any:
    return getattr(node.target, "overloadpacket", None)


def _vals(node: Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``node.args``/``kwargs`` with every input node replaced by its ``meta["val"]``."""
    args = map_arg(node.args, lambda n: n.meta.get("val"))
    kwargs = map_arg(node.kwargs, lambda n: n.meta.get("val"))
    return args, kwargs


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _tensors(v)]
    if isinstance(val, dict):
        return [t for v in val.values() for t in _tensors(v)]
    return []


def _is_free(node: Node) -> bool:
    if node.op != "call_function" or node.target is operator.getitem:
        return True
    return bool(getattr(node.target, "is_view", False)) or _packet(node) in _FREE


def _arg(node: Node, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """Value of schema argument ``name`` (positional, keyword or its default)."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else a.default_value
    return None


def _sdpa_flops(node: Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    q, k, v = args[:3]
    flops = float(sdpa_flop_count(tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    return flops / 2 if _arg(node, args, kwargs, "is_causal") else flops


def attention_keys(node: Node) -> tuple[float, bool] | None:
    """(key length, causal) of a fused attention node; None for any other node."""
    packet = _packet(node)
    if packet not in _SDPA and packet not in _SDPA_FUSED:
        return None
    args, kwargs = _vals(node)
    k = args[1]
    if not isinstance(k, torch.Tensor) or k.dim() < 2:
        return None
    return float(k.shape[-2]), bool(_arg(node, args, kwargs, "is_causal"))


def causal_share(kv: float, block: float) -> float:
    """The share of its full (unmasked) work a fused attention kernel runs under a causal
    mask over `kv` keys when it skips only the key tiles of `block` tokens wholly above
    the diagonal: ~(1 + block / kv) / 2, at most 1 (0: ideal skipping, 1/2). PyTorch's CPU
    flash kernel tiles keys by 512 (a causal 128-token attention runs all of its work,
    a 1024-token one ~3/4: measured 0.76), FlashAttention-2 by 64-128."""
    if block <= 0 or kv <= 0:
        return 0.5
    return min(1.0, 0.5 + block / (2.0 * kv))


def node_flops(node: Node) -> float:
    """Forward FLOPs of one ATen FX node (see module docstring); 0 for non-compute nodes."""
    if _is_free(node):
        return 0.0
    packet = _packet(node)
    args, kwargs = _vals(node)
    region = spec_of(node.target)
    if region is not None:  # its own count, on the whole inputs
        return float(region.module.flops(*args[: region.n_inputs]))
    if packet in _SDPA:
        return _sdpa_flops(node, args, kwargs)
    if packet in flop_registry:
        try:
            return float(flop_registry[packet](*args, out_val=node.meta.get("val"), **kwargs))
        except (TypeError, ValueError, AssertionError, AttributeError):
            pass  # unusual overload signature: fall back to the element count
    if packet in _GATHERS:
        return float(sum(t.numel() for t in _tensors(node.meta.get("val"))))
    sizes = [t.numel() for t in _tensors((args, kwargs)) + _tensors(node.meta.get("val"))]
    return float(max(sizes, default=0))


def node_bytes(node: Node) -> float:
    """Bytes read + written by one ATen FX node (see module docstring); 0 for views."""
    if _is_free(node):
        return 0.0
    args, kwargs = _vals(node)
    outs = _tensors(node.meta.get("val"))
    ins = _tensors((args, kwargs))
    if _packet(node) in _GATHERS and ins:
        table = ins.pop(0)  # only the rows actually gathered are read
        ins.append(torch.empty(sum(t.numel() for t in outs), dtype=table.dtype, device="meta"))
    return float(sum(_bytes(t) for t in ins) + sum(_bytes(t) for t in outs))


def entry_bytes(node: Node) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """Bytes of each operand (``capture.operands.operands`` order: a strategy's inputs) and
    each output of ``node``, whole (0 where it is no tensor), adding up to ``node_bytes``;
    None for a gather (its table charged at the rows read) and for a node whose entries do
    not add up to it."""
    if _packet(node) in _GATHERS:
        return None
    ins = [_bytes(t) if t is not None else 0 for t in (op.tensor for op in operands(node))]
    val = node.meta.get("val")
    outs = [
        _bytes(v) if isinstance(v, torch.Tensor) else 0
        for v in (val if isinstance(val, (tuple, list)) else [val])
    ]
    if sum(ins) + sum(outs) != node_bytes(node):
        return None
    return tuple(map(float, ins)), tuple(map(float, outs))


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def node_dtype(node: Node) -> torch.dtype:
    """Dtype the node computes in: its first floating tensor input or output, else float32."""
    args, kwargs = _vals(node)
    for t in _tensors((args, kwargs)) + _tensors(node.meta.get("val")):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


OP_CLASSES = ("matmul", "attention", "memory")


def op_class(node: Node) -> str:
    """``"matmul"``, ``"attention"`` or ``"memory"`` (every other op: bandwidth-bound); a
    region (:mod:`autopar.capture.regions`) is priced as matmuls."""
    packet = _packet(node)
    if packet in _SDPA or packet in _SDPA_FUSED:
        return "attention"
    if spec_of(node.target) is not None:
        return "matmul"
    return "matmul" if packet in _MATMUL or packet in flop_registry else "memory"


_MATRIX_OPERANDS = {  # op -> positions of its two matrices among its operands
    aten.mm: (0, 1),
    aten.bmm: (0, 1),
    aten.addmm: (1, 2),
    aten.baddbmm: (1, 2),
}


def matmul_dims(node: Node) -> tuple[tuple[int, int, int], ...] | None:
    """(operand position, tensor dim, size) of a plain matmul's rows, inner dimension and
    columns (``a [.., M, K] @ b [.., K, N]``), what its three kernels' local sides
    are read from once a strategy shards them; None for any other node."""
    pair = _MATRIX_OPERANDS.get(_packet(node))
    if pair is None:
        return None
    ops = operands(node)
    if max(pair) >= len(ops):
        return None
    a, b = (ops[i].tensor for i in pair)
    if a is None or b is None or a.dim() < 2 or b.dim() < 2:
        return None
    i, j = pair
    return (
        (i, a.dim() - 2, int(a.shape[-2])),
        (i, a.dim() - 1, int(a.shape[-1])),
        (j, b.dim() - 1, int(b.shape[-1])),
    )


def local_matmul_dims(
    dims: tuple[tuple[int, int, int], ...], inputs: tuple, mesh_shape: tuple[int, ...]
) -> tuple[float, ...]:
    """`matmul_dims`' sizes (rows, inner, columns) once the specs `inputs` (a strategy's,
    per operand) shard them."""
    out = []
    for pos, dim, size in dims:
        spec = inputs[pos] if pos < len(inputs) else None
        out.append(size / shard_count(spec, mesh_shape, dim))
    return tuple(out)


def shard_count(spec, mesh_shape: tuple[int, ...], dim: int | None = None) -> int:
    """How many pieces `spec` cuts a tensor (its dim `dim`, where given) into: 1 where it
    is replicated or partial (None: no spec)."""
    out = 1
    for axis, p in enumerate(spec or ()):
        if p.is_shard(dim):
            out *= mesh_shape[axis]
    return out


def training_kernels(node: Node) -> int:
    """Kernels a node runs in forward + backward: a matmul's backward runs two (grad of the
    input and of the weight), attention's and every other op's one."""
    return 3 if _packet(node) in _MATMUL else 2


def compute_efficiency(
    flops_per_kernel: float,
    op: str,
    cluster: Cluster,
    dims: tuple[float, ...] | None = None,
    keys: tuple[float, bool] | None = None,
) -> float:
    """Achieved fraction of peak FLOP/s of one ``op``-class kernel of that size, in (0, 1];
    ``dims``: a matmul's local sides (rows, inner, columns: `local_matmul_dims`; None:
    unknown), each scaling it by ``d / (d + matmul_half_dim)``; ``keys``: an attention's
    (key length, causal) (`attention_keys`; None: unknown, the long unmasked rate)."""
    device = cluster.device
    if op == "attention":
        if keys is None:
            return device.attention_efficiency
        kv, causal = keys
        half = device.attention_half_seq
        size = kv / (kv + half) if half > 0 and kv > 0 else 1.0
        # the counted FLOPs of a causal attention are half the scores; it runs more
        share = causal_share(kv, device.attention_block) if causal else 0.5
        return max(device.attention_efficiency * size * 0.5 / share, 1e-9)
    if op not in OP_CLASSES:
        raise ValueError(f"unknown op class {op!r}; expected one of {OP_CLASSES}")
    if op == "memory":
        return 1.0  # priced by its bytes: the FLOP side only bounds it from below
    f = max(float(flops_per_kernel), 0.0)
    half = device.matmul_half_flops
    size = f / (f + half) if half > 0 else 1.0
    thin = device.matmul_half_dim
    if dims is not None and thin > 0:
        size *= math.prod(d / (d + thin) for d in dims)
    # a kernel too small to measure still makes progress: floor far below any real figure
    return max(device.matmul_efficiency * size, 1e-9)


def compute_time(
    flops: float,
    nbytes: float,
    dtype: str | torch.dtype,
    cluster: Cluster,
    *,
    op: str = "matmul",
    kernels: int = 1,
    dims: tuple[float, ...] | None = None,
    keys: tuple[float, bool] | None = None,
    in_place: bool = False,
    rated: float = 0.0,
) -> float:
    """Seconds of ``kernels`` kernels of class ``op`` doing ``flops`` and moving ``nbytes``
    in total (see the module docstring; ``dims``, ``keys``: `compute_efficiency`;
    ``in_place``: each writes into an input, `DeviceSpec.memory_rate`), or the ``rated``
    seconds their arithmetic takes where that is longer (`rated_seconds`); 0 work costs
    nothing."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    device = cluster.device
    k = max(int(kernels), 1)
    eff = compute_efficiency(flops / k, op, cluster, dims, keys)
    return (
        max(
            flops / (device.peak_flops_for(dtype) * eff),
            nbytes / device.memory_rate(nbytes / k, in_place),
            rated,
        )
        + k * device.launch_overhead
    )


# the ATen op each rated op's backward runs (both measured: `DeviceSpec.op_rates`)
RATED_BACKWARD = {
    "gelu": "gelu_backward",
    "gelu[tanh]": "gelu_backward[tanh]",  # GPT-2's tanh approximation: its own rate
    "silu": "silu_backward",
    "sigmoid": "sigmoid_backward",
    "tanh": "tanh_backward",
    "_softmax": "_softmax_backward_data",
    "_log_softmax": "_log_softmax_backward_data",
}


def rated_seconds(node: Node, device: DeviceSpec, fraction: float, backward: bool) -> float:
    """Seconds ``fraction`` of the node's output elements take at the rate the device
    measured for its op (and, with ``backward``, its backward's op: `RATED_BACKWARD`);
    0 where the device has no such rate (every GPU preset: their elementwise ops are
    bound by their bytes)."""
    if not device.op_rates or node.op != "call_function":
        return 0.0
    name = getattr(node.target, "_opname", "")
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "")
    if name == "gelu" and approximate == "tanh":
        name += "[tanh]"
    rates = [device.op_rate(name)]
    if backward:
        rates.append(device.op_rate(RATED_BACKWARD.get(name, "")))
    if not all(rates):
        return 0.0
    out = _tensors(node.meta.get("val"))
    elements = out[0].numel() * fraction if out else 0.0
    return sum(elements / rate for rate in rates)


def node_time(node: Node, cluster: Cluster, *, fraction: float = 1.0) -> float:
    """Forward seconds of a node doing ``fraction`` of its work (e.g. ``1/shards``)."""
    if not 0 <= fraction <= 1 or math.isnan(fraction):
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if _is_free(node):
        return 0.0
    return compute_time(
        node_flops(node) * fraction,
        node_bytes(node) * fraction,
        node_dtype(node),
        cluster,
        op=op_class(node),
        keys=attention_keys(node),
    )


def backward_factor(node: Node) -> float:
    """Backward FLOPs as a multiple of forward FLOPs (see module docstring)."""
    packet = _packet(node)
    if packet in _SDPA or packet in _SDPA_FUSED:
        return 2.5
    if spec_of(node.target) is not None:
        return REGION_BACKWARD_FACTOR
    return 2.0 if packet in _MATMUL else 1.0


def backward_bytes_factor(node: Node) -> float:
    """Backward bytes as a multiple of forward bytes: a matmul's backward runs two kernels
    (input and weight gradient) that each move as much as its forward (the weight read,
    or its gradient written, once more per kernel: a small-batch matmul's three kernels
    are each memory-bound, not their FLOPs summed against twice its bytes), fused attention
    reads its inputs, output and output gradient and writes the inputs' gradients (~2x),
    a region runs its forward again and differentiates it (`REGION_BACKWARD_FACTOR`),
    every other op reads its output's gradient and writes its input's (1x): the backward
    FLOPs factor but for attention, whose backward's extra FLOPs re-read nothing."""
    packet = _packet(node)
    return 2.0 if packet in _SDPA or packet in _SDPA_FUSED else backward_factor(node)

"""Fused kernels (``autopar::*`` custom ops placed by :mod:`autopar.passes.fusion`).

Row-wise norms ``add_layer_norm(x, r, w, b, eps) -> (y, s)`` and
``add_rms_norm(x, r, w, eps) -> (y, s)`` normalize each row of the last dim independently,
so on each mesh axis one of these holds:

* all Replicate;
* rows: ``Shard(d)`` for a leading dim ``d < ndim - 1``, the same on ``x``, ``r``, ``y``
  and ``s``; the weight and bias Replicate.

Splitting the normalized (last) dim would need the row statistics all-reduced inside the
kernel, which is not offered. In backward, ``*_backward(dy, ds, s, w, eps)`` follows the
same rules on ``dy``, ``ds``, ``s`` and ``dx``; the weight and bias gradients are sums over
rows, hence ``Partial`` when the rows are sharded (``Replicate`` otherwise).

``swiglu(a, b) -> y`` is elementwise: ``Shard(d)`` on any dim, the same on ``a``, ``b`` and
``y`` (and on ``dy``, ``da``, ``db`` for ``swiglu_backward``), or all Replicate.

``bias_gelu(x, bias, approximate) -> y`` is elementwise with a per-column ``bias`` (shape
``(N,)``, N the last dim): ``Shard(d)`` on any dim of ``x`` and ``y``; the bias is
``Shard(0)`` when the last dim is split (a column-parallel linear layer's bias) and
Replicate otherwise. ``bias_gelu_backward(dy, x, bias) -> (dx, dbias)``: ``dx`` like ``x``;
``dbias``, a sum over rows, is ``Partial`` when rows are split and ``Shard(0)`` when the
last dim is.

``linear_cross_entropy(x, weight, bias, target, ..., "sum") -> (loss, gx, gw, gb)``: rows
of ``x`` (and ``target``) split on ``Shard(0)`` with ``weight`` and ``bias`` Replicate: the
summed loss and the weight/bias gradients (computed in the forward) are then ``Partial``,
``gx`` is ``Shard(0)``; or all Replicate. A vocabulary-split weight would need the
log-sum-exp reduced across ranks inside the kernel: not offered (a tp axis gathers the
weight, or splits rows too).

In general a "param" is a per-column vector: Replicate, or ``Shard(0)`` with the last dim;
its gradient is ``Partial`` over split rows and ``Shard(0)`` with the last dim.

The custom ops exist only once :mod:`autopar.kernels` (hence triton) is imported, which the
strategy stage must not force on every ``import autopar`` (triton must see
``TRITON_INTERPRET`` before its first import). So :func:`register` adds the rules and the
DTensor strategies when called; :func:`autopar.passes.fusion.fuse_regions` calls it before
it puts a fused node in a graph. Registration is idempotent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._compat import (
    OpOverload,
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    expand_to_full_mesh_op_strategy,
    register_op_strategy,
)
from autopar.passes.strategies.from_dtensor import expand_per_axis
from autopar.passes.strategies.rules import RULES, register_rule
from autopar.passes.strategies.spec import NodeStrategy, output_vals

# role of each argument position: "row" (sharded with the rows), "param" (Replicate),
# None (not a tensor); and of each output: "row" or "grad" (Partial when rows are sharded)
ROW, PARAM, GRAD = "row", "param", "grad"
ROLES: dict[str, tuple[tuple[str | None, ...], tuple[str, ...]]] = {
    "add_layer_norm": ((ROW, ROW, PARAM, PARAM, None), (ROW, ROW)),
    "add_rms_norm": ((ROW, ROW, PARAM, None), (ROW, ROW)),
    "swiglu": ((ROW, ROW), (ROW,)),
    "add_layer_norm_backward": ((ROW, ROW, ROW, PARAM, None), (ROW, GRAD, GRAD)),
    "add_rms_norm_backward": ((ROW, ROW, ROW, PARAM, None), (ROW, GRAD)),
    "swiglu_backward": ((ROW, ROW, ROW), (ROW, ROW)),
    "bias_gelu": ((ROW, PARAM, None), (ROW,)),
    "bias_gelu_backward": ((ROW, ROW, PARAM, None), (ROW, GRAD)),
    # (x, weight, bias, target, ...) -> (loss, grad_x, grad_weight, grad_bias); its
    # backward is a product with the loss's gradient, which DTensor shards itself
    "linear_cross_entropy": ((ROW, PARAM, PARAM, ROW, *[None] * 5), (GRAD, ROW, GRAD, GRAD)),
}
# every dim may be split, the last one too
ELEMENTWISE = ("swiglu", "swiglu_backward", "bias_gelu", "bias_gelu_backward")


def split_dims(name: str, ndim: int) -> range:
    """The dims a row tensor of ``ndim`` dims may be sharded on for kernel ``name``."""
    return range(ndim) if name in ELEMENTWISE else range(ndim - 1)


def axis_rules(name: str, ndim: int, present: list[bool]) -> list[list[Placement]]:
    """Single-axis rules ``[outputs..., tensor inputs...]`` for kernel ``name``.

    ``present[i]``: argument ``i`` is a tensor (an optional weight, bias or ``ds`` may be
    None, and then has no position in the rule)."""
    arg_roles, out_roles = ROLES[name]
    roles = [r for r, p in zip(arg_roles, present, strict=False) if r is not None and p]
    rules: list[list[Placement]] = [[Replicate()] * (len(out_roles) + len(roles))]
    for d in split_dims(name, ndim):
        row: Placement = Shard(d)
        column = d == ndim - 1  # per-column params and their gradients split with it
        param: Placement = Shard(0) if column else Replicate()
        grad: Placement = Shard(0) if column else Partial()
        outs = [row if r == ROW else grad for r in out_roles]
        rules.append(outs + [row if r == ROW else param for r in roles])
    return rules


# ------------------------------------------------------------------ planning rules


def fused_rule(node: fx.Node, mesh: DeviceMesh) -> list[NodeStrategy]:
    """Strategies of a fused forward node (row-wise norms, elementwise SwiGLU and
    bias + GELU)."""
    name = node.target.__name__.split(".")[0]  # type: ignore[union-attr]
    present = [isinstance(a, fx.Node) for a in node.args]
    ndim = node.args[0].meta["val"].dim()  # type: ignore[union-attr]
    n_out = len(output_vals(node))
    return expand_per_axis(node, axis_rules(name, ndim, present), n_out, mesh)


# ------------------------------------------------------------------ DTensor strategies


def dtensor_strategy(name: str) -> Callable[[OpSchema], OpStrategy]:
    """DTensor strategy function for kernel ``name`` (forward or backward)."""
    n_out = len(ROLES[name][1])

    def strategy(op_schema: OpSchema) -> OpStrategy:
        args = op_schema.args_schema
        present = [isinstance(a, OpStrategy) for a in args]
        ndim = next(a for a in args if isinstance(a, OpStrategy)).ndim
        rules = axis_rules(name, ndim, present)
        mesh = op_schema.get_mesh_from_args(validate=False)
        return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=n_out)  # type: ignore[arg-type]

    strategy.__name__ = f"{name}_strategy"
    return strategy


def _ops() -> dict[str, OpOverload]:
    import autopar.kernels  # noqa: F401  (defines torch.ops.autopar.*)

    return {name: getattr(torch.ops.autopar, name).default for name in ROLES}


FORWARD = ("add_layer_norm", "add_rms_norm", "swiglu", "bias_gelu", "linear_cross_entropy")


def register() -> None:
    """Add the planning rules and DTensor strategies of the fused ops (idempotent).

    Imports :mod:`autopar.kernels` (and so triton)."""
    ops = _ops()
    forward = [ops[name] for name in FORWARD]
    if all(op in RULES for op in forward):
        return
    register_rule(*forward)(fused_rule)
    for name, op in ops.items():
        # every argument is hashed: None-ness of weight/bias/ds changes the rules
        register_op_strategy(op, dtensor_strategy(name), RuntimeSchemaInfo(static_argnum=0))

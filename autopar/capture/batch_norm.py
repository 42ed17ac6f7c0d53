"""BatchNorm as per-channel sums, so that a batch-sharded plan computes global statistics.

``BATCH_NORM_DECOMPOSITIONS`` replaces torch's decomposition of ``aten.batch_norm`` when
capture lowers the exported program to core ATen. In training mode, with ``x`` of shape
``[N, C, *S]``, ``n = N * prod(S)`` elements per channel and ``dims`` every dim but 1:

    sums = stack([sum_dims(x), sum_dims(x * x)])        # [2, C], the only reduction
    mean = sums[0] / n,   var = max(sums[1] / n - mean^2, 0)   (biased)
    y    = (x - mean) * rsqrt(var + eps) * weight + bias
    running_mean <- (1 - m) * running_mean + m * mean
    running_var  <- (1 - m) * running_var  + m * var * n / (n - 1)   (unbiased)

The reduction, one custom op ``autopar::batch_norm_stats(x) -> [2, C]`` (with its backward
``batch_norm_stats_backward(grad, x) = grad[0] + 2 x grad[1]`` per channel), is the only op
that reads across samples; its sharding rule is
:mod:`autopar.passes.strategies.rules.batch_norm`. When the batch (or a spatial dim) is
sharded its output is ``Partial`` (each rank sums its shard), and the consumers that need it
``Replicate`` all-reduce it: one all-reduce of ``2C`` floats forward (and one of ``2C`` for
the gradient of the statistics in backward) — SyncBatchNorm's semantics, hence the
single-device statistics, without gathering activations. That all-reduce is an ordinary
``Partial -> Replicate`` redistribution the search prices on the edge like any other, and
that lowering executes. A channel split (``Shard(1)``) needs no communication. Sums of ``x`` and ``x^2`` (rather than a
Welford merge of per-shard means and variances) keep it one collective of ``2C`` floats;
with equal shards both give the global mean and biased variance, the sums in one step.
Low-precision inputs are reduced in float32, as torch's kernels accumulate. (Without the
one op, the two sums would be planned apart and could be resharded one by one.)

In eval mode (``training=False`` with running statistics) BatchNorm is elementwise with the
running statistics. torch.export's functionalization hands BatchNorm over as
``_native_batch_norm_legit_functional``, whose last two outputs are the new running
statistics; export lists them as buffer mutations (``Captured.mutated_buffers``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar._compat import OpOverload

aten = torch.ops.aten


Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def batch_norm_functional(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """``_native_batch_norm_legit_functional``: (y, mean, rstd, new running mean, new
    running var); in eval mode the running statistics come back unchanged."""
    if not training:
        y, mean, rstd = batch_norm_eval(x, weight, bias, running_mean, running_var, momentum, eps)
        return y, mean, rstd, running_mean, running_var
    mean, var, n = _batch_statistics(x)
    y, rstd = _normalize(x, weight, bias, mean, var, eps)
    new_mean = running_mean * (1 - momentum) + mean.detach() * momentum
    unbiased = var.detach() * (n / max(n - 1, 1))
    new_var = running_var * (1 - momentum) + unbiased * momentum
    return y, mean, rstd, new_mean.to(running_mean.dtype), new_var.to(running_var.dtype)


def batch_norm_eval(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
) -> Outputs:
    """``_native_batch_norm_legit_no_training``: elementwise with the running statistics."""
    y, rstd = _normalize(x, weight, bias, running_mean, running_var, eps)
    return y, running_mean, rstd


def batch_norm_no_stats(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> Outputs:
    """``_native_batch_norm_legit.no_stats`` (``track_running_stats=False``)."""
    mean, var, _ = _batch_statistics(x)
    y, rstd = _normalize(x, weight, bias, mean, var, eps)
    return y, mean, rstd


def _batch_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean, biased variance (one ``[2, C]`` reduction) and count of ``x``."""
    n = x.numel() // x.shape[1]
    sums = STATS(x)
    mean = sums[0] / n
    var = torch.clamp_min(sums[1] / n - mean * mean, 0.0)
    return mean, var, n


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


@torch.library.custom_op("autopar::batch_norm_stats", mutates_args=())
def batch_norm_stats(x: torch.Tensor) -> torch.Tensor:
    """``stack([sum(x), sum(x * x)])`` over every dim but 1 (channels): ``[2, C]``."""
    dims = [0, *range(2, x.dim())]
    acc = _acc(x)
    return torch.stack([acc.sum(dims), (acc * acc).sum(dims)])


@batch_norm_stats.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((2, x.shape[1]), dtype=_acc(x).dtype)


@torch.library.custom_op("autopar::batch_norm_stats_backward", mutates_args=())
def batch_norm_stats_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`batch_norm_stats`: ``grad[0] + 2 x grad[1]`` per channel."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    return (grad[0].view(shape) + 2 * _acc(x) * grad[1].view(shape)).to(x.dtype)


@batch_norm_stats_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return STATS_BACKWARD(grad, x)


batch_norm_stats.register_autograd(_backward, setup_context=_setup)
STATS = torch.ops.autopar.batch_norm_stats.default
STATS_BACKWARD = torch.ops.autopar.batch_norm_stats_backward.default


def _normalize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x - mean) * rstd * weight + bias`` per channel (dim 1), and ``rstd``."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    rstd = torch.rsqrt(var + eps)
    y = (x - mean.view(shape).to(x.dtype)) * rstd.view(shape).to(x.dtype)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y, rstd


BATCH_NORM_DECOMPOSITIONS: dict[OpOverload, Callable] = {
    aten._native_batch_norm_legit_functional.default: batch_norm_functional,
    aten._native_batch_norm_legit_no_training.default: batch_norm_eval,
    aten._native_batch_norm_legit.no_stats: batch_norm_no_stats,
}

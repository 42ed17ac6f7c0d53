"""Sequence parallelism (Megatron-SP): norms and residuals sharded on the sequence dim.

Between two tensor-parallel blocks a transformer runs row-wise ops on activations
``x [B, T, D]``: the residual add, dropout and the norm (LayerNorm or RMSNorm, fused or
decomposed into ``pow``/``mean``/``rsqrt``/``mul``). Each normalizes or maps one row of the
last dim independently, so every one of them is correct with ``x`` sharded on any leading
dim, in particular the sequence dim ``Shard(1)``. No rule is needed for that: DTensor's own
strategies for ``native_layer_norm`` (and its backward), ``mean.dim``, ``rsqrt`` and the
pointwise ops offer every non-normalized dim, and autopar's fused norms offer every leading
dim (:mod:`autopar.passes.strategies.rules.fused`).

What makes it Megatron-SP is then pure sharding algebra, priced by the cost model:

* the row-parallel matmul (``wo``, ``w2``) leaves ``Partial``; where the residual add wants
  ``Shard(1)`` the step ``Partial -> Shard(1)`` is a reduce-scatter (instead of the
  all-reduce ``Partial -> Replicate``);
* the column-parallel matmul of the next block reads the normalized ``[B*T, D]`` rows
  replicated, so ``Shard(1) -> Replicate`` before it is an all-gather.

A reduce-scatter plus an all-gather move the bytes of one all-reduce, while the norm region
holds ``1/n`` of its activations and does ``1/n`` of its work: the search takes it whenever
activation memory binds (and, at equal communication, usually when it does not).

This module names the pattern for pins and views: :data:`NORM_OPS` (the op that computes a
norm's row statistic, by the name a plan records, ``autopar.search.to_plan._op_name``) and
:func:`seq_sharded` (a placement that splits a leading dim other than the batch).
"""

from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

# the op that computes (or applies) each norm's row statistic, by plan name: LayerNorm,
# torch's fused RMSNorm, autopar's fused norms, and the rsqrt of a decomposed RMSNorm /
# LayerNorm (``x * rsqrt(mean(x**2) + eps)``)
NORM_OPS = (
    "native_layer_norm.default",
    "_fused_rms_norm.default",
    "autopar.add_layer_norm.default",
    "autopar.add_rms_norm.default",
    "rsqrt.default",
)


def is_norm(op_name: str) -> bool:
    """Whether a node (by plan op name) computes a norm's row statistic."""
    return op_name in NORM_OPS


def seq_sharded(p: Placement | str, ndim: int) -> bool:
    """``p`` splits a sequence-like dim of a ``[B, T, ..., D]`` activation: a leading dim
    past the batch and before the normalized last dim (``Shard(1)`` of ``[B, T, D]``)."""
    if isinstance(p, str):
        if not (p.startswith("S(") and p.endswith(")")):
            return False
        dim = int(p[2:-1])
    elif isinstance(p, Shard):
        dim = p.dim
    else:
        return False
    return 0 < dim < ndim - 1

"""Which op outputs a layer keeps for backward under each activation-checkpointing policy.

One table for the search (which prices the memory kept and the time recomputed) and the
runtime (which frees and recomputes), so the two cannot disagree:

    none       every output a backward op reads is kept (plain autograd)
    selective  outputs of matmuls, convolutions and attention are kept; pointwise ops,
               norms, views and softmax are recomputed from them in backward; collectives
               are not re-run (their outputs are kept), random ops are never re-run
    full       only the layer's inputs are kept; everything inside the layer is recomputed
               in backward (collectives included), except random ops, whose outputs are
               kept so that a recomputed dropout draws the same mask

A random op is never recomputed (re-running it would draw other numbers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.capture.ring_merge import RING_MERGE, RING_SKIP

aten = torch.ops.aten

# The expensive producers selective checkpointing keeps (Megatron / torchtitan's "op"
# policy: recomputing a matmul costs as much as the forward did).
SAVED_BY_SELECTIVE = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.linear.default,
        aten.convolution.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten.scaled_dot_product_attention.default,
        RING_MERGE,  # ring attention's output (`capture.ring_merge`)
        RING_SKIP,
    }
)

# Ops that draw random numbers: never recomputed under any policy.
RANDOM = frozenset(
    {
        aten.native_dropout.default,
        aten.bernoulli.default,
        aten.bernoulli.p,
        aten.bernoulli_.float,
        aten.rand.default,
        aten.rand_like.default,
        aten.randn.default,
        aten.randn_like.default,
        aten.randint.default,
        aten.randint_like.default,
        aten.randperm.default,
        aten.multinomial.default,
        aten.normal.Tensor_float,
        aten.uniform.default,
    }
)


def is_collective(target: Callable | object) -> bool:
    """A functional collective of the lowered program (`_c10d_functional.*`)."""
    return getattr(target, "namespace", None) in ("_c10d_functional", "c10d_functional")


def recomputed(policy: str, target: Callable | object) -> bool:
    """Whether an op's output is recomputed in backward (not kept) under `policy`."""
    if policy == "none" or target in RANDOM:
        return False
    if policy == "full":
        return True
    assert policy == "selective", policy
    return target not in SAVED_BY_SELECTIVE and not is_collective(target)

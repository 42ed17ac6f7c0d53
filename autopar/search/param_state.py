"""What a rank holds per parameter in the liveness simulation (`search.liveness`): the
parameter boundary and the optimizer, as `runtime.optimizer` and `passes.precision` run
them (plain, mixed precision with fp32 masters, ZeRO-1/2 flat shards).

Per parameter of N local elements, R replicas, compute itemsize c, master itemsize m (4
under the policy, else the parameter's), k optimizer states:

    plain / policy   parameters N*m; the policy's cast working copy N*c (activations,
                     freed after its last use); gradients N*m; state k*N*m
    ZeRO-1           working parameters N*c; flat master ceil(N/R)*m (optimizer_state);
                     flat gradient ceil(N/R)*m and the full local gradient N*c
    ZeRO-2           as ZeRO-1 without the full local gradient
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from autopar.cost_models.memory import replicas

if TYPE_CHECKING:
    from autopar.search.liveness import _Step

STEP_COUNTER_BYTES = 4  # torch's Adam/AdamW keep `step` as a float32 scalar tensor


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter's bytes on this rank (see `runtime.optimizer`'s table)."""

    numel: int  # local elements at the storage spec
    compute: int  # itemsize the program computes with (the captured dtype)
    master: int  # itemsize of the copy the optimizer updates (fp32 under the policy)
    replicas: int  # devices holding the same shard (the ZeRO split)

    @property
    def flat(self) -> int:
        """Elements of the ZeRO flat shard (padded to the replicas)."""
        return -(-self.numel // self.replicas)


def hold(step: _Step, optimizer_states: int) -> dict[str, Param]:
    """What the rank holds between steps, allocated at time 0 (and, under the policy, the
    compute-dtype copies the program casts every parameter to before it starts)."""
    live, mem = step.live, step.plan.memory
    params: dict[str, Param] = {}
    for n in step.captured.gm.graph.nodes:
        if n.op != "placeholder" or n.name not in step.used:
            continue
        nbytes = step.value_bytes(n, 0)
        if n.name in step.captured.params:
            val = n.meta["val"]
            master = 4 if mem.param_dtype else val.dtype.itemsize
            r = replicas(step.specs[n.name], step.mesh) if mem.shard_optimizer else 1
            p = params[n.name] = Param(
                int(nbytes // val.dtype.itemsize), val.dtype.itemsize, master, r
            )
            if mem.shard_optimizer:  # working copy in the compute dtype + flat fp32 master
                live.alloc(("held", n.name), p.numel * p.compute, "parameters")
                live.alloc(("master", n.name), p.flat * p.master, "optimizer_state")
            else:
                live.alloc(("master", n.name), p.numel * p.master, "parameters")
                if mem.param_dtype:  # the cast working copy: freed after its last use
                    live.alloc(("held", n.name), p.numel * p.compute, "activations")
            states = optimizer_states * p.flat * p.master + STEP_COUNTER_BYTES
            live.alloc(("state", n.name), states, "optimizer_state")
        elif n.name in step.captured.user_inputs:
            # the caller's global batch and this rank's copy of its shard
            live.alloc(("global", n.name), step.value_bytes(n, 0, ()), "activations")
            live.alloc(("held", n.name), nbytes, "activations")
        else:
            live.alloc(("held", n.name), nbytes, "buffers")
    return params


def reduce_param_grad(step: _Step, name: str, partial: object, p: Param) -> None:
    """A parameter's complete gradient, reduced as `passes.precision` does it: cast to the
    reduce dtype, reduced into its storage spec (out of place) where the storage is
    replicated, or reduce-scattered into the flat shard (ZeRO; ZeRO-1 keeps the full local
    gradient too), then cast to the master dtype."""
    live, mem = step.live, step.plan.memory
    reduce = _itemsize(mem.reduce_dtype) if mem.param_dtype else p.compute
    source = partial
    if reduce != p.compute:
        live.alloc(("gradcast", name), p.numel * reduce, "activations")
        source = ("gradcast", name)
        if not mem.shard_optimizer:
            live.free(partial)
    if mem.shard_optimizer:
        live.alloc(("pgrad", name), p.flat * reduce, "gradients")
        live.free(source)
        live.free(partial)
        if not mem.shard_gradients:  # ZeRO-1: the full local gradient (same storage)
            live.alloc(("pfull", name), p.numel * p.compute, "gradients")
        numel = p.flat
    else:
        spec = step.specs[name]
        sync = any(q.is_replicate() and n > 1 for q, n in zip(spec, step.mesh, strict=True))
        if not sync:
            live.free(source)
        live.alloc(("pgrad", name), p.numel * reduce, "gradients")
        live.free(source)
        numel = p.numel
    if reduce != p.master:
        live.alloc(("pgrad32", name), numel * p.master, "gradients")
        live.free(("pgrad", name))
        live.bytes[("pgrad", name)] = live.bytes.pop(("pgrad32", name))


def _itemsize(dtype: str | None) -> int:
    return getattr(torch, dtype or "float32").itemsize


def optimizer_update(step: _Step, params: dict[str, Param], foreach: bool) -> None:
    """AdamW's temporaries (sqrt of the second moment, its quotient) over what it updates;
    ZeRO's all-gather of the updated flat masters into the working parameters; zero_grad."""
    live, zero = step.live, step.plan.memory.shard_optimizer
    sizes = [(p.flat if zero else p.numel) * p.master for p in params.values()]
    if sizes:
        live.alloc(("optimizer", "temp"), sum(sizes) if foreach else 2 * max(sizes), "activations")
        live.free(("optimizer", "temp"))
    if zero:
        for name, p in params.items():
            if p.master != p.compute:
                live.alloc(("gather_src", name), p.flat * p.compute, "activations")
            live.alloc(("gathered", name), p.flat * p.replicas * p.compute, "communication")
            live.free(("gathered", name))
            live.free(("gather_src", name))
    for name in params:
        live.free(("pgrad", name))
        live.free(("pfull", name))

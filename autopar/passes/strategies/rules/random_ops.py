"""Random ops on sharded DTensors draw what one device would draw.

Dropout's mask (``native_dropout``, and ``bernoulli_`` inside the math attention path),
``rand_like`` and the in-place fills (``uniform_``, ``normal_``, ...) on a DTensor that is
sharded on some axis draw, on every rank, the whole tensor with the generator (which every
rank holds in the same state, as the single-device run does) and keep this rank's shard. So
the value drawn for each element is the one the single-device run draws for it, whatever the
placement: training with dropout matches one device exactly, and every rank's generator
stays in step with the others'.

Why not DTensor's own answer: its offset-based generator exists only for CUDA, and only in
eager mode (it moves the generator's offset around each op; a traced per-rank program keeps
the op, not the offsets). What it costs: each rank draws the whole tensor, priced by the
search (``whole_draw_bytes``); the draw is freed as soon as the shard is kept.

A replicated operand draws its local tensor, which is the whole tensor already.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Shard

from autopar._compat import (
    dispatch_with_local,
    dtensor_spec,
    local_tensor,
    register_dtensor_handler,
)

aten = torch.ops.aten

DROPOUT = aten.native_dropout.default
# in-place fills `op(self, *args)`: self's values are replaced by the draw
FILLS = (
    aten.bernoulli_.float,
    aten.uniform_.default,
    aten.normal_.default,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.geometric_.default,
)
# `op(like, *args)` draws a new tensor of like's shape and dtype
LIKES = (aten.rand_like.default, aten.randn_like.default)
RANDOM_OPS = (DROPOUT, *FILLS, *LIKES)


def random_draws(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of `gm` that draw from the generator, in graph order: `RANDOM_OPS`, and
    attention whose kernel drops probabilities (`dropout_p` > 0)."""
    return [n for n in gm.graph.nodes if n.target in RANDOM_OPS or _drops_attention(n)]


def _drops_attention(node: fx.Node) -> bool:
    if node.target is not aten.scaled_dot_product_attention.default:
        return False
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return isinstance(p, (int, float)) and p > 0


def whole_draw_bytes(node: fx.Node) -> float:
    """Bytes a rank draws for a random op's node (0 for any other op): the whole tensor,
    whatever its placement. The search charges the part beyond the rank's shard."""
    if node.target not in RANDOM_OPS:
        return 0.0
    val = node.meta.get("val")
    drawn = val[0] if isinstance(val, (tuple, list)) else val
    return float(drawn.numel() * drawn.element_size()) if isinstance(drawn, torch.Tensor) else 0.0


def shard_of(full: torch.Tensor, spec) -> torch.Tensor:
    """This rank's piece of ``full`` laid out as ``spec`` (a ``DTensorSpec``): each
    ``Shard(d)`` in mesh order chunks dim ``d`` as ``torch.chunk`` (and DTensor) does."""
    coordinate = spec.mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the tensor's mesh"
    local = full
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            pieces = local.chunk(spec.mesh.size(axis), p.dim)
            index = coordinate[axis]
            local = pieces[index] if index < len(pieces) else local.narrow(p.dim, 0, 0)
    return local


def _whole(like: torch.Tensor, shape) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _sharded(spec) -> bool:
    return any(isinstance(p, Shard) for p in spec.placements)


def dropout_handler(op_call, args: tuple, kwargs: dict) -> object:
    """``native_dropout(x, p, train)``: the CPU kernel's mask (``bernoulli_(1 - p)`` on a
    tensor of x's shape), drawn whole and cut to this rank's shard."""

    def local(local_args: tuple, local_kwargs: dict, out_spec, in_specs) -> object:
        x, p = local_args[0], float(local_args[1])
        train = local_args[2] if len(local_args) > 2 else local_kwargs.get("train")
        if train is False or not _sharded(in_specs[0]):
            return op_call(*local_args, **local_kwargs)
        keep = 1.0 - p
        mask = shard_of(_whole(x, in_specs[0].shape).bernoulli_(keep), in_specs[0])
        scale = 0.0 if keep == 0 else 1.0 / keep
        return x.mul(mask).mul_(scale), mask.bool()

    return dispatch_with_local(op_call, args, kwargs, local)


def fill_handler(op_call, args: tuple, kwargs: dict) -> object:
    """An in-place random fill of a sharded DTensor: the whole tensor drawn, this rank's
    shard copied into its local tensor."""
    self = args[0]
    if any(p.is_partial() for p in self.placements):
        raise ValueError(f"{op_call}: a random fill of a Partial tensor has no meaning")
    local = local_tensor(self)
    rest = [local_tensor(a) if isinstance(a, DTensor) else a for a in args[1:]]
    if not _sharded(dtensor_spec(self)):  # the local tensor is the whole tensor
        op_call(local, *rest, **kwargs)
        return self
    whole = op_call(_whole(local, self.shape), *rest, **kwargs)
    local.copy_(shard_of(whole, dtensor_spec(self)))
    return self


def like_handler(op_call, args: tuple, kwargs: dict) -> object:
    """``rand_like(x)`` of a sharded DTensor: the whole tensor drawn, this rank's shard kept."""

    def local(local_args: tuple, local_kwargs: dict, out_spec, in_specs) -> object:
        if not _sharded(in_specs[0]):
            return op_call(*local_args, **local_kwargs)
        whole = op_call(_whole(local_args[0], in_specs[0].shape), *local_args[1:], **local_kwargs)
        return shard_of(whole, out_spec).clone()

    return dispatch_with_local(op_call, args, kwargs, local)


def register_dtensor() -> None:
    """Route DTensor's dispatch of the random ops here (idempotent)."""
    register_dtensor_handler(DROPOUT, dropout_handler)
    for op in FILLS:
        register_dtensor_handler(op, fill_handler)
    for op in LIKES:
        register_dtensor_handler(op, like_handler)

"""Search options and the pins they put on placeholder placements.

`strategy` names a role per mesh axis ("dp", "fsdp", "tp", "sp", "cp", "ep", "auto"); one
name applies to every axis. A role pins only what defines it and leaves the rest to the ILP:

    dp    user inputs Shard(0) (batch) on the axis; parameters Replicate; every tensor
          computed from the batch stays batch-sharded on the axis (else gathering the batch
          once and computing redundantly, or switching to TP, would pass for "DP")
    fsdp  as dp, but parameters Shard(0) (ZeRO-3: stored sharded, gathered for use; a fused
          projection split by heads on another axis: Shard(1), its bias Replicate)
    tp    user inputs Replicate; every parameter of 2+ dims sharded on the axis (which dim,
          column or row, is the ILP's choice); every matmul computed from the batch split
          over features on the axis (else token-splitting with gathered weights, i.e. FSDP,
          would pass for "TP")
    sp    tp, and every norm computed from the batch (its row statistic, `rules.sequence.
          NORM_OPS`) sequence-sharded on the axis: Megatron-SP (reduce-scatter into the
          norm region, all-gather out of it)
    cp    user inputs Shard(1) (sequence); parameters Replicate; every attention computed
          from the batch splits its queries on the sequence (`rules.attention`: ring or
          all-gathered K/V, the ILP's choice); the rest is the ILP's. "cp-ring" and
          "cp-gather" pin the variant (K split on the sequence, or K Replicate)
    ep    as dp, but stacked expert weights (3-D parameters `[E, ...]`) Shard(0): the
          expert matmuls run on the local experts, dispatched tokens reach them by an
          all-to-all (token-split Shard(1) -> expert-split Shard(0) of `[E, G*C, d]`);
          a region (`autopar.Region`) splits its experts on the axis (its own all-to-alls)
    auto  nothing pinned

`placements` pins single parameters (or inputs) by name: {"lm_head.weight": "S(0),R"}.

`SearchOptions` is what the search reads; `SearchOptions.from_options` derives it from the
user's validated `autopar.options.PlanOptions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from autopar._compat import StridedShard
from autopar.capture import Captured
from autopar.options import CP_ROLES, ROLES, PlanOptions
from autopar.passes.strategies import NodeStrategy
from autopar.passes.strategies.rules.regions import experts_axis_of, spec_of
from autopar.passes.strategies.rules.sequence import is_norm, seq_sharded
from autopar.plan import parse_spec, spec_str

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class SearchOptions:
    strategy: str | tuple[str, ...] = "auto"
    placements: dict[str, str] = field(default_factory=dict)
    memory_limit: float | None = None
    time_limit_s: float = 30.0
    share_layers: bool = True
    optimizer_states: int = 2
    # price ZeRO-1 / ZeRO-2 and the mixed-precision policy as the runtime holds them
    # (`cost_models.memory.param_state_breakdown`)
    shard_optimizer: bool = False
    shard_gradients: bool = False
    mixed_precision: bool = False
    # bytes per element of gradients reduced at a parameter (the policy's reduce_dtype)
    reduce_itemsize: int | None = None
    # memory levers searched per layer ("auto") or pinned (`autopar.search.levers`)
    activation_checkpointing: str = "auto"
    reshard_after_forward: bool | str = "auto"

    @classmethod
    def from_options(cls, options: PlanOptions) -> SearchOptions:
        """The search's share of what the user asked for."""
        return cls(
            strategy=options.strategy,
            placements=dict(options.placements),
            memory_limit=options.memory_limit,
            time_limit_s=options.time_limit_s,
            shard_optimizer=options.shard_optimizer,
            shard_gradients=options.shard_gradients,
            mixed_precision=options.mixed_precision is not None,
            reduce_itemsize=getattr(torch, options.reduce_dtype).itemsize
            if options.mixed_precision
            else None,
            activation_checkpointing=options.activation_checkpointing,
            reshard_after_forward=options.reshard_after_forward,
        )

    def roles(self, ndim: int) -> tuple[str, ...]:
        roles = (self.strategy,) * ndim if isinstance(self.strategy, str) else tuple(self.strategy)
        if len(roles) != ndim:
            raise ValueError(
                f"strategy={self.strategy!r} names {len(roles)} axis roles but the "
                f"mesh has {ndim} axes; give one role per axis or a single role"
            )
        for r in roles:
            if r not in ROLES:
                raise ValueError(f"unknown strategy '{r}'; choose from {', '.join(ROLES)}")
        return roles

    def strategy_name(self) -> str:
        return self.strategy if isinstance(self.strategy, str) else "x".join(self.strategy)


def apply_pins(
    captured: Captured,
    strats: dict[fx.Node, list[NodeStrategy]],
    options: SearchOptions,
    mesh: DeviceMesh,
) -> dict[fx.Node, list[NodeStrategy]]:
    # a role on an axis of one device pins nothing (its strategies are all replicated
    # there, `passes.strategies.enumerate.on_unit_axes`)
    roles = tuple(
        "auto" if n == 1 else r for r, n in zip(options.roles(mesh.ndim), mesh.shape, strict=True)
    )
    names = {**captured.params, **captured.buffers, **{n: n for n in captured.user_inputs}}
    unknown = set(options.placements) - set(names.values())
    if unknown:
        raise ValueError(
            f"placements= names {sorted(unknown)}, which the model does not have; "
            f"known names: {sorted(names.values())[:8]}..."
        )
    out = dict(strats)
    for n in captured.placeholders():
        if n not in strats:
            continue
        role = n.meta.get("autopar_role")
        fqn = names.get(n.name, n.name)
        allowed = [s for s in strats[n] if _allowed(s.outputs[0], role, roles, n)]
        if fqn in options.placements:
            want = parse_spec(options.placements[fqn])
            allowed = [s for s in strats[n] if tuple(s.outputs[0]) == tuple(want)]
        if not allowed:
            choices = sorted({spec_str(s.outputs[0]) for s in strats[n]})
            raise ValueError(
                f"no placement of '{fqn}' (shape {tuple(n.meta['val'].shape)}) "
                f"satisfies strategy={options.strategy!r} / placements=; "
                f"possible placements: {choices}"
            )
        out[n] = allowed
    _pin_compute(captured, out, roles)
    return out


MATMULS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.scaled_dot_product_attention.default,
}


def _pin_compute(
    captured: Captured, strats: dict[fx.Node, list[NodeStrategy]], roles: tuple[str, ...]
) -> None:
    """dp/fsdp axes keep every batch-derived tensor batch-sharded (Shard(0); a 0-d loss may be
    Partial), and on an ep axis a region (`autopar.Region`) splits its experts there; tp
    (and sp) axes split every batch-derived matmul over its features (column:
    output Shard(last), row: Partial); sp axes also shard every norm on the sequence dim;
    cp axes split every attention's queries on the sequence.
    A node with no such strategy keeps its choices."""
    for n in _batch_derived(captured):
        if n not in strats or n.op != "call_function":
            continue
        for axis, role in enumerate(roles):
            if axis_role_is_data(role):
                keep = [s for s in strats[n] if _batch_sharded(s, n, axis)]
                if role == "ep" and _shards_experts(n):  # a region: its experts split here
                    keep = [s for s in keep if experts_axis_of(n, s) == axis]
            elif role in ("tp", "sp") and n.target in MATMULS:
                keep = [s for s in strats[n] if _feature_split(s, axis)]
            elif role in CP_ROLES and n.target == aten.scaled_dot_product_attention.default:
                keep = [s for s in strats[n] if _cp_split(s, axis, role)]
            elif role == "sp" and is_norm(str(n.target).removeprefix("aten.")):
                keep = [s for s in strats[n] if _seq_split(s, n, axis)]
            else:
                continue
            if keep:
                strats[n] = keep


def _shards_experts(n: fx.Node) -> bool:
    region = spec_of(n.target)
    return region is not None and region.shards_experts


def _batch_sharded(s: NodeStrategy, n: fx.Node, axis: int) -> bool:
    vals = n.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    for spec, val in zip(s.outputs, vals, strict=False):
        if spec is None or not isinstance(val, torch.Tensor):
            continue
        p = spec[axis]
        if not (p == Shard(0) or (val.ndim == 0 and p.is_partial())):
            return False
    return True


def _cp_split(s: NodeStrategy, axis: int, role: str) -> bool:
    """Attention's queries split on the sequence on `axis`, K too for "cp-ring", K
    Replicate for "cp-gather"."""
    if not (s.outputs[0] and s.outputs[0][axis] == Shard(2)):
        return False
    k = s.inputs[1][axis] if len(s.inputs) > 1 and s.inputs[1] else None
    return role == "cp" or (k == Shard(2)) == (role == "cp-ring")


def _seq_split(s: NodeStrategy, n: fx.Node, axis: int) -> bool:
    """The norm's (first) output is split on a sequence-like dim on `axis`."""
    val = n.meta["val"]
    val = val[0] if isinstance(val, (tuple, list)) else val
    out = s.outputs[0] if s.outputs else None
    return out is not None and seq_sharded(out[axis], val.ndim)


def _feature_split(s: NodeStrategy, axis: int) -> bool:
    """Split over features (Shard of a dim past the token dim 0, or Partial), not tokens."""
    out = s.outputs[0] if s.outputs else None
    return out is not None and (
        out[axis].is_partial()
        or (isinstance(out[axis], (Shard, StridedShard)) and out[axis].dim > 0)
    )


def _splits(s: NodeStrategy, axis: int) -> bool:
    return any(
        sp is not None and not isinstance(sp[axis], Replicate) for sp in (*s.inputs, *s.outputs)
    )


def _batch_derived(captured: Captured) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [n for n in captured.placeholders() if n.name in captured.user_inputs]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return [n for n in captured.gm.graph.nodes if n in seen]


def axis_role_is_data(role: str) -> bool:
    """Roles that split the batch on their axis (and keep batch-derived tensors split)."""
    return role in ("dp", "fsdp", "ep")


def _allowed(spec: Sequence, role: str | None, roles: tuple[str, ...], n: fx.Node) -> bool:
    val = n.meta.get("val")
    ndim = val.ndim if isinstance(val, torch.Tensor) else 0
    for p, axis_role in zip(spec, roles, strict=True):
        if role == "input":
            if axis_role_is_data(axis_role) and p != Shard(0):
                return False
            if axis_role in ("tp", "sp") and p != Replicate():
                return False
            if axis_role in CP_ROLES and p != Shard(1):
                return False
        elif role == "param":
            if axis_role in ("dp", *CP_ROLES) and p != Replicate():
                return False
            if axis_role == "ep" and p != (Shard(0) if ndim == 3 else Replicate()):
                return False
            if axis_role == "fsdp" and p != Shard(0) and _divisible(val, 0, spec, n):
                if not _fsdp_beside_heads(p, spec, ndim):
                    return False
            if axis_role in ("tp", "sp") and ndim >= 2 and not isinstance(p, (Shard, StridedShard)):
                return False
    return True


def _fsdp_beside_heads(p, spec, ndim: int) -> bool:
    """FSDP beside a fused projection split by heads (dim 0 strided on another axis): the
    weight is sharded on dim 1 instead, the bias kept whole (DTensor does not nest a shard
    inside a strided one)."""
    if not any(isinstance(q, StridedShard) and q.dim == 0 for q in spec):
        return False
    return p == (Shard(1) if ndim >= 2 else Replicate())


def _divisible(val, dim: int, spec, n) -> bool:
    return isinstance(val, torch.Tensor) and val.ndim > dim and val.shape[dim] > 1

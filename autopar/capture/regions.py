"""Regions: a module autopar captures, plans and lowers as one unit, with declared
placements and its own sharded computation.

Why: torch.export needs static shapes, and some computations do not have them — a
drop-less mixture of experts sends each expert however many tokens the router picks. A
:class:`Region` subclass is traced as one opaque op instead of its ATen ops, so what runs
inside may use data-dependent shapes, Python loops and its own collectives.

Contract (a subclass of :class:`Region`, an ``nn.Module``):

* ``compute(*inputs) -> tensor or tuple of tensors``: the single-device computation, with
  ``self``'s parameters. Every input and output is split with the batch on its dim 0
  (``Shard(0)``) when the region runs on a batch shard; rows must be independent (what a
  row computes depends only on that row and the parameters).
* ``outputs_like(*inputs)``: empty tensors with the outputs' shapes and dtypes (from the
  inputs' shapes only: it runs on fake tensors while tracing).
* ``expert_params``: names of the parameters whose dim 0 indexes experts (may be empty).
* ``compute_expert_parallel(*inputs, group) -> outputs``: the same computation on this
  rank's rows with this rank's slice of the expert parameters (``Shard(0)`` over the ranks
  of ``group``, a ``ProcessGroup``), the rest of the parameters whole; it moves tokens to
  their experts' ranks itself (all-to-all). Optional: without it, no axis shards experts.
* ``flops(*inputs)`` (forward FLOPs) and ``exchanged_bytes(*inputs)`` (bytes one rank
  sends in one all-to-all when experts are sharded; ``inputs`` are the whole tensors, the
  cost model divides): what the search prices the region with.

Placements, per mesh axis (the search picks, :mod:`autopar.passes.strategies.rules.regions`):
all Replicate; rows ``Shard(0)`` with the parameters Replicate (a batch shard: parameter
gradients ``Partial``); or rows ``Shard(0)`` with the expert parameters ``Shard(0)``
(expert parallel on that axis; at most one axis; expert gradients ``Shard(0)``).

Ops: each region (class and non-tensor configuration) gets ``autopar::region_<key>(inputs...,
params..., str group) -> outputs`` and ``autopar::region_<key>_backward(inputs..., params...,
grad_outputs..., str group) -> grads``. ``group`` is ``""`` in the captured graph (the
single-device computation); lowering puts the name of the expert axis's process group
there. The backward runs the forward again under autograd and differentiates it (nothing
but the inputs is saved): the region costs one more forward in backward, which the search
prices (backward factor 3). Memory inside a region (its routed token buffers) is not priced.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from autopar._compat import OpOverload, all_to_all_autograd, process_group_named

_LIB = torch.library.Library("autopar", "FRAGMENT")
_CALL = threading.local()  # .compute: what Region.forward runs inside the op's body


class Region(nn.Module):
    """Base class of a region (module docstring); subclasses define ``compute``,
    ``outputs_like``, ``flops``, ``exchanged_bytes`` and, for expert parallelism,
    ``expert_params`` and ``compute_expert_parallel``."""

    expert_params: tuple[str, ...] = ()

    def compute(self, *inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        raise NotImplementedError

    def outputs_like(self, *inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        raise NotImplementedError

    def compute_expert_parallel(self, *inputs: Tensor, group: object) -> object:
        raise NotImplementedError(f"{type(self).__name__} does not shard its experts")

    def flops(self, *inputs: Tensor) -> float:
        raise NotImplementedError(
            f"{type(self).__name__}: define flops(*inputs) (forward FLOPs on the whole "
            "inputs) so that the search can price the region"
        )

    def exchanged_bytes(self, *inputs: Tensor) -> float:
        raise NotImplementedError(
            f"{type(self).__name__}: define exchanged_bytes(*inputs) (bytes of one "
            "all-to-all of the whole batch) so that the search can price split experts"
        )

    def forward(self, *inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        inside: Callable | None = getattr(_CALL, "compute", None)
        if inside is not None:  # the op's body: run the computation itself
            return inside(self, *inputs)
        spec = define(self, inputs)
        params = [p for _, p in spec.named_params(self)]
        out = spec.forward(*inputs, *params, "")
        return out if spec.n_outputs > 1 else out[0]


def all_to_all(x: Tensor, send_splits: list[int], recv_splits: list[int], group) -> Tensor:
    """For ``compute_expert_parallel``: send rows ``x`` in consecutive blocks of
    ``send_splits[r]`` to each rank ``r`` of ``group``, receiving ``recv_splits[r]`` rows
    from each; differentiable (the backward sends the gradients back the same way)."""
    return all_to_all_autograd(x.contiguous(), recv_splits, send_splits, group)


@dataclass(frozen=True)
class RegionSpec:
    """One region's ops and layout of arguments: ``inputs..., params..., group``."""

    key: str
    module: Region
    n_inputs: int
    param_names: tuple[str, ...]
    n_outputs: int
    forward: OpOverload
    backward: OpOverload

    @property
    def n_args(self) -> int:
        """Tensor arguments of the forward op (inputs and parameters)."""
        return self.n_inputs + len(self.param_names)

    def named_params(self, module: Region) -> list[tuple[str, Tensor]]:
        params = dict(module.named_parameters())
        return [(name, params[name]) for name in self.param_names]

    def is_expert(self, arg: int) -> bool:
        """Forward argument ``arg`` is an expert parameter."""
        if arg < self.n_inputs or arg >= self.n_args:
            return False
        return self.param_names[arg - self.n_inputs] in self.module.expert_params

    @property
    def shards_experts(self) -> bool:
        has = type(self.module).compute_expert_parallel is not Region.compute_expert_parallel
        return has and bool(self.module.expert_params)


REGIONS: dict[str, RegionSpec] = {}  # key -> spec
_BY_OP: dict[OpOverload, RegionSpec] = {}  # forward and backward op -> spec


def spec_of(op: object) -> RegionSpec | None:
    """The region whose forward or backward op ``op`` is; None for any other op."""
    return _BY_OP.get(op)  # type: ignore[call-overload]


def is_backward(op: object) -> bool:
    spec = spec_of(op)
    return spec is not None and spec.backward == op


def _config(module: Region) -> str:
    """The non-tensor state a region's computation may read (part of its op's key)."""
    plain = (int, float, str, bool, tuple, type(None))
    items = sorted(
        (k, repr(v))
        for k, v in vars(module).items()
        if not k.startswith("_") and k != "training" and (isinstance(v, plain) or _is_config(v))
    )
    return repr(items)


def _is_config(value: object) -> bool:
    return hasattr(value, "__dataclass_fields__")


def define(module: Region, inputs: Sequence[Tensor]) -> RegionSpec:
    """The ops of ``module`` called on ``inputs``, defined on first use (the same key, hence
    the same op names, in every process that builds the same model)."""
    if any(True for _ in module.buffers()):
        raise TypeError(
            f"{type(module).__name__}: a Region cannot hold buffers (its op takes its "
            "parameters only). Fix: move the buffer to the parent module and pass it in."
        )
    n_inputs = len(inputs)
    names = tuple(name for name, _ in module.named_parameters())
    shapes = [tuple(p.shape) for p in module.parameters()]
    cls = type(module)
    text = f"{cls.__module__}.{cls.__qualname__}|{n_inputs}|{names}|{shapes}|{_config(module)}"
    key = f"{cls.__name__.lower()}_{hashlib.sha1(text.encode()).hexdigest()[:10]}"
    if key in REGIONS:
        return REGIONS[key]
    outs = module.outputs_like(*inputs)
    n_out = len(outs) if isinstance(outs, (tuple, list)) else 1
    n_args = n_inputs + len(names)
    args = ", ".join(f"Tensor a{i}" for i in range(n_args))
    grads = ", ".join(f"Tensor g{i}" for i in range(n_out))
    returns = "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"
    grad_returns = "(" + ", ".join(["Tensor"] * n_args) + ")" if n_args > 1 else "Tensor"
    name = f"region_{key}"
    _LIB.define(f"{name}({args}, str group) -> {returns}")
    _LIB.define(f"{name}_backward({args}, {grads}, str group) -> {grad_returns}")
    forward = getattr(torch.ops.autopar, name).default
    backward = getattr(torch.ops.autopar, f"{name}_backward").default
    spec = RegionSpec(key, module, n_inputs, names, n_out, forward, backward)
    REGIONS[key] = spec
    _BY_OP[forward] = _BY_OP[backward] = spec
    _register(spec, name)
    return spec


def _register(spec: RegionSpec, name: str) -> None:
    n_in, n_args, n_out = spec.n_inputs, spec.n_args, spec.n_outputs
    qualname = f"autopar::{name}"

    def forward_impl(*args):
        *tensors, group = args
        return _outputs(_run(spec, tensors, group), n_out)

    def forward_fake(*args):
        *tensors, _ = args
        outs = spec.module.outputs_like(*tensors[:n_in])
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return _outputs([o.new_empty(o.shape) for o in outs], n_out)

    def backward_impl(*args):
        *tensors, group = args
        inputs, grads = tensors[:n_args], tensors[n_args:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
            outs = [o for o in _run(spec, leaves, group)]
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
            wrt = [t for t in leaves if t.requires_grad]
            found = torch.autograd.grad(
                [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
            )
        by_leaf = dict(zip(map(id, wrt), found, strict=True))
        result = [_grad_or_zeros(by_leaf.get(id(t)), t) for t in leaves]
        return result[0] if n_args == 1 else tuple(result)

    def backward_fake(*args):
        result = [t.new_empty(t.shape) for t in args[:n_args]]
        return result[0] if n_args == 1 else tuple(result)

    def setup_context(ctx, inputs, output):
        del output
        ctx.save_for_backward(*inputs[:n_args])
        ctx.group = inputs[-1]

    def backward(ctx, *grads):
        result = spec.backward(*ctx.saved_tensors, *grads, ctx.group)
        result = (result,) if n_args == 1 else tuple(result)
        kept = [
            g if t.is_floating_point() else None
            for g, t in zip(result, ctx.saved_tensors, strict=True)
        ]
        return (*kept, None)

    _LIB.impl(name, forward_impl, "CompositeExplicitAutograd")
    _LIB.impl(f"{name}_backward", backward_impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, forward_fake, lib=_LIB)
    torch.library.register_fake(f"{qualname}_backward", backward_fake, lib=_LIB)
    torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_LIB)


def _run(spec: RegionSpec, tensors: Sequence[Tensor], group: str) -> list[Tensor]:
    """The region's computation on (local) ``tensors``: single-device without a group,
    expert-parallel over the named process group with one."""
    inputs = tuple(tensors[: spec.n_inputs])
    params = dict(zip(spec.param_names, tensors[spec.n_inputs :], strict=True))
    if group:
        pg = process_group_named(group)

        def compute(module: Region, *xs: Tensor) -> object:
            return module.compute_expert_parallel(*xs, group=pg)
    else:

        def compute(module: Region, *xs: Tensor) -> object:
            return module.compute(*xs)

    _CALL.compute = compute
    try:
        outs = torch.func.functional_call(spec.module, params, inputs, strict=False)
    finally:
        _CALL.compute = None
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [o.contiguous() for o in outs]


def _outputs(outs: Sequence[Tensor], n_out: int) -> Tensor | tuple[Tensor, ...]:
    return outs[0] if n_out == 1 else tuple(outs)


def _grad_or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad.contiguous()

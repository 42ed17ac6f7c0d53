"""ParallelModel: a rank's share of the model and its compiled training step.

Each rank keeps only its local shard of every parameter (its storage placement from the
plan) and an optimizer over those shards. `step(*batch)` slices the global batch to this
rank's shard, runs the lowered graph (forward, backward and the gradient collectives), hands
the gradients, already reduced to each parameter's placement, to the optimizer, and
returns the global loss. Elementwise optimizers (SGD, Adam, AdamW) on shards give exactly
the update of the unsharded optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.passes.lower import LocalStep, lower_plan
from autopar.plan import Plan, parse_spec
from autopar.runtime.inductor import compile_program
from autopar.runtime.shards import gather_full, local_chunk

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class TrainingSteps:
    """What every compiled model does the same way around its own `forward_backward`."""

    plan: Plan
    optimizer: torch.optim.Optimizer | None

    def forward_backward(self, *batch: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def optimizer_step(self) -> None:
        """Apply the optimizer to the local shards and clear their gradients."""
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def step(self, *batch: torch.Tensor) -> float:
        """Forward + backward + optimizer step on the global batch; returns the global loss."""
        loss = self.forward_backward(*batch)
        self.optimizer_step()
        return float(loss)

    def save_plan(self, path: str) -> None:
        self.plan.save(path)


class ParallelModel(TrainingSteps):
    """The compiled model: `.plan`, `.step(*batch)`, `.full_state_dict()`, `.save_plan()`."""

    def __init__(
        self,
        model: nn.Module,
        captured: Captured,
        plan: Plan,
        mesh: DeviceMesh,
        optimizer: OptimizerFactory | None = None,
    ):
        self.plan = plan
        self.mesh = mesh
        self.captured = captured
        self._tensor_plans = {t.name: t for t in plan.tensors}
        self._model_state = _named_state(model)
        self.local_params = {
            name: self._shard(name).requires_grad_(True) for name in captured.params
        }
        self.local_buffers = {
            name: self._shard(name) for name in [*captured.buffers, *captured.constants]
        }
        self.optimizer = optimizer(list(self.local_params.values())) if optimizer else None
        example = {
            **self.local_params,
            **self.local_buffers,
            **{n: self._input_example(n) for n in captured.user_inputs},
        }
        self.program: LocalStep = lower_plan(captured, plan, mesh, example)
        # what each step runs: the traced program, or with fusion="inductor" the program
        # handed to torch.compile (compiled on the first call)
        self.step_program: Callable = self.program.gm
        if plan.fusion == "inductor":
            self.step_program = compile_program(self.program.gm)

    # ---- training ------------------------------------------------------------------------
    def forward_backward(self, *batch: torch.Tensor) -> torch.Tensor:
        """Run forward and backward; leaves each local shard's `.grad`; returns the loss."""
        if len(batch) != len(self.captured.user_inputs):
            raise ValueError(
                f"step() takes the batch the model was compiled with: "
                f"{len(self.captured.user_inputs)} tensors, got {len(batch)}"
            )
        inputs = [
            self._local_input(name, t)
            for name, t in zip(self.captured.user_inputs, batch, strict=True)
        ]
        params = [self.local_params[n].detach() for n in self.program.param_names]
        buffers = [self.local_buffers[n] for n in self.program.buffer_names]
        loss, *grads = self.step_program(*params, *buffers, *inputs)
        for name, grad in zip(self.program.param_names, grads, strict=True):
            self.local_params[name].grad = grad
        return loss

    # ---- state -----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters and buffers under the model's own state_dict names."""
        out: dict[str, torch.Tensor] = {}
        for name, local in {**self.local_params, **self.local_buffers}.items():
            t = self._tensor_plans[name]
            full = gather_full(local, parse_spec(t.spec), self.mesh, t.shape)
            for fqn in [t.fqn, *self.captured.aliases.get(t.fqn, [])]:
                out[fqn] = full
        return {k: out[k] for k in self._model_state if k in out}

    def local_grads(self) -> dict[str, torch.Tensor | None]:
        """This rank's gradient shard per parameter FQN (after `forward_backward`)."""
        return {self.captured.params[n]: p.grad for n, p in self.local_params.items()}

    # ---- helpers ---------------------------------------------------------------------------
    def _shard(self, name: str) -> torch.Tensor:
        t = self._tensor_plans[name]
        full = self._model_state.get(t.fqn)
        if full is None:
            full = self.captured.constants[name]
        if full.is_meta:
            raise ValueError(
                f"parameter '{t.fqn}' is on the meta device: autopar.compile needs "
                "real weights (use autopar.plan to plan a meta model)"
            )
        return local_chunk(full, parse_spec(t.spec), self.mesh)

    def _local_input(self, name: str, full: torch.Tensor) -> torch.Tensor:
        t = self._tensor_plans[name]
        if tuple(full.shape) != t.shape:
            raise ValueError(
                f"batch tensor '{name}' has shape {tuple(full.shape)} but the model "
                f"was compiled for {t.shape}; compile again for a new batch shape"
            )
        return local_chunk(full, parse_spec(t.spec), self.mesh)

    def _input_example(self, name: str) -> torch.Tensor:
        t = self._tensor_plans[name]
        full = torch.empty(
            t.shape, dtype=getattr(torch, t.dtype.removeprefix("torch.")), device="meta"
        )
        shape = local_chunk(full, parse_spec(t.spec), self.mesh).shape
        return torch.zeros(shape, dtype=full.dtype)


def _named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    return {k: v.detach() for k, v in state.items()}

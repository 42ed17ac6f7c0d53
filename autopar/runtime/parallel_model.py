"""ParallelModel: a rank's share of the model and its compiled training step.

Each rank keeps only its local shard of every parameter (its storage placement from the
plan) and an optimizer over those shards. `step(*batch)` slices the global batch to this
rank's shard, runs the lowered graph (forward, backward and the gradient collectives), hands
the gradients, already reduced to each parameter's placement, to the optimizer, and
returns the global loss. Elementwise optimizers (SGD, Adam, AdamW) on shards give exactly
the update of the unsharded optimizer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.passes.comm import CommOptions
from autopar.passes.lower import LocalStep, lower_plan
from autopar.passes.precision import ParamBoundary
from autopar.plan import Plan, parse_spec
from autopar.runtime.inductor import compile_program
from autopar.runtime.memory_stats import MemoryStats, optimizer_state_tensors, track_memory
from autopar.runtime.optimizer import OptimizerFactory, ParamState
from autopar.runtime.shards import gather_full, local_chunk, mesh_device


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
        """Forward + backward + optimizer step on the global batch; returns the global loss.
        With `track_memory(True)` the step's live-tensor peak is measured (`memory_stats`)."""
        if not self._track_memory:
            loss = self.forward_backward(*batch)
            self.optimizer_step()
            return float(loss)
        with track_memory(self.held_tensors()) as tracker:
            loss = self.forward_backward(*batch)
            tracker.gradients(self.held_tensors()["gradients"])
            self.optimizer_step()
            tracker.recategorize(optimizer_state_tensors(self.optimizer), "optimizer_state")
        assert tracker.stats is not None
        self._memory_stats = tracker.stats.with_prediction(*self.predicted_memory())
        return float(loss)

    # ---- measured memory (runtime.memory_stats) ----------------------------------------
    _track_memory = False
    _memory_stats: MemoryStats | None = None

    def track_memory(self, enabled: bool = True) -> None:
        """Measure the peak bytes of live tensors of every following `step` (off by default,
        when `step` runs untouched); read them with `memory_stats()`."""
        self._track_memory = enabled

    def memory_stats(self) -> MemoryStats | None:
        """This rank's measured peak of the last tracked `step` (parameters, gradients,
        optimizer_state, buffers, activations, communication at the peak) beside the plan's
        prediction; None before a tracked step."""
        return self._memory_stats

    def held_tensors(self) -> dict[str, list[torch.Tensor | None]]:
        """What this rank holds between steps, by memory category."""
        raise NotImplementedError

    def predicted_memory(self) -> tuple[float, dict[str, float]]:
        """The plan's predicted peak for this rank and its breakdown (`search.peak`)."""
        return self.plan.predicted_peak_memory, dict(self.plan.predicted_memory)

    def local_grads(self) -> dict[str, torch.Tensor | None]:
        raise NotImplementedError

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
        comm: CommOptions | None = None,
    ):
        """`comm`: how the program's collectives are bucketed and overlapped (`passes.comm`;
        `passes.comm.OFF` runs them as traced; default: the plan's, `Plan.comm`)."""
        self.plan = plan
        self.mesh = mesh
        self.captured = captured
        self._tensor_plans = {t.name: t for t in plan.tensors}
        self._model_state = _named_state(model)
        # the parameters, masters and optimizer: plain, mixed precision, ZeRO (optimizer.py)
        self.state = ParamState(
            {name: self._shard(name) for name in captured.params},
            {n: parse_spec(self._tensor_plans[n].spec) for n in captured.params},
            mesh,
            ParamBoundary.of(plan),
            optimizer,
        )
        self.local_params = self.state.params  # what the program reads as parameters
        self.local_buffers = {
            name: self._shard(name) for name in [*captured.buffers, *captured.constants]
        }
        self.optimizer = self.state.optimizer
        example = {
            **self.local_params,
            **self.local_buffers,
            **{n: self._input_example(n) for n in captured.user_inputs},
            **self.state.examples(ParamBoundary.of(plan).extra_names(list(captured.params))),
        }
        self.program: LocalStep = lower_plan(captured, plan, mesh, example, comm)
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
        params, extras = self.state.program_inputs(self.program.param_names)
        buffers = [self.local_buffers[n] for n in self.program.buffer_names]
        loss, *grads = self.step_program(*params, *buffers, *inputs, *extras)
        updated = self.program.buffer_updates
        if updated:  # buffers the forward updates (BatchNorm statistics): the new values
            grads, new = grads[: -len(updated)], grads[-len(updated) :]
            for name, value in zip(updated, new, strict=True):
                self.local_buffers[name] = value
        self.state.set_grads(self.program.param_names, grads)
        return loss

    def optimizer_step(self) -> None:
        """Update the parameters (`runtime.optimizer.ParamState.step`), clear gradients."""
        self.state.step()

    # ---- state -----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters and buffers under the model's own state_dict names."""
        out: dict[str, torch.Tensor] = {}
        masters = {n: self.state.master_local(n) for n in self.local_params}
        for name, local in {**masters, **self.local_buffers}.items():
            t = self._tensor_plans[name]
            full = gather_full(local, parse_spec(t.spec), self.mesh, t.shape)
            for fqn in [t.fqn, *self.captured.aliases.get(t.fqn, [])]:
                out[fqn] = full
        return {k: out[k] for k in self._model_state if k in out}

    def local_grads(self) -> dict[str, torch.Tensor | None]:
        """This rank's gradient shard per parameter FQN (after `forward_backward`): the
        local shard, or under ZeRO the flat shard (`expected_grad` cuts a reference so)."""
        return {self.captured.params[n]: g for n, g in self.state.grads().items()}

    def expected_grad(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """The piece of a full gradient of parameter `fqn` that `local_grads()` holds."""
        name = next(n for n, f in self.captured.params.items() if f == fqn)
        local = local_chunk(full, parse_spec(self._tensor_plans[name].spec), self.mesh)
        return self.state.expected_grad(name, local)

    def held_tensors(self) -> dict[str, list[torch.Tensor | None]]:
        return {
            "parameters": list(self.local_params.values()),
            "buffers": list(self.local_buffers.values()),
            "gradients": self.state.held_gradients(),
            "optimizer_state": [*optimizer_state_tensors(self.optimizer), *self.state.masters()],
        }

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
        local = local_chunk(full, parse_spec(t.spec), self.mesh)
        return _compute_dtype(local, t.dtype)

    def _input_example(self, name: str) -> torch.Tensor:
        t = self._tensor_plans[name]
        full = torch.empty(
            t.shape, dtype=getattr(torch, t.dtype.removeprefix("torch.")), device="meta"
        )
        shape = local_chunk(full, parse_spec(t.spec), self.mesh).shape
        return torch.zeros(shape, dtype=full.dtype, device=mesh_device(self.mesh))


def _named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    return {k: v.detach() for k, v in state.items()}


def _compute_dtype(local: torch.Tensor, planned: str) -> torch.Tensor:
    """A floating batch tensor in the dtype the graph was captured with (mixed precision
    casts floating inputs to the compute dtype, as FSDP2's policy does)."""
    dtype = getattr(torch, planned.removeprefix("torch."))
    if local.is_floating_point() and dtype.is_floating_point and local.dtype != dtype:
        return local.to(dtype)
    return local

"""Single-device reference training: what every parallel run is compared with.

A deep copy of the model takes `steps` AdamW steps (lr `LR`) on the same global batch; the
loss, every parameter's gradient at each step and the final state are recorded. The copy
leaves the caller's model untouched, so the parallel run starts from the same weights.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

LR = 1e-3


@dataclass(frozen=True, slots=True)
class Reference:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]  # per step, by parameter name
    state: dict[str, torch.Tensor]  # state_dict after the last step


def train_single_device(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    steps: int,
    *,
    grads: bool = True,
    mixed_precision: str | None = None,
) -> Reference:
    """`steps` AdamW steps of a copy of `model` on `batch`; `grads=False` keeps no gradients.
    `mixed_precision` ("bf16"/"fp16"): each step runs a copy whose parameters (not
    buffers) and floating inputs are cast to that dtype, its gradients cast to fp32 become
    the fp32 master's, AdamW updates the master (fp16: the loss scaled by 2**15 and the
    gradients unscaled; a step with an inf/nan gradient is skipped and the scale halved,
    as the runtime's `LossScaler` does)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, per_step = [], []
    scale = FP16_SCALE if mixed_precision == "fp16" else 1.0
    for _ in range(steps):
        loss = _loss_and_grads(model, batch, mixed_precision, scale)
        losses.append(loss.item())
        if grads:
            per_step.append({k: p.grad.clone() for k, p in model.named_parameters()})
        finite = all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
        if finite or mixed_precision != "fp16":
            opt.step()
        else:
            scale *= 0.5
        opt.zero_grad(set_to_none=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Reference(losses, per_step, state)


def grads_at(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    state: dict[str, torch.Tensor],
    mixed_precision: str | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter's single-device gradient on `batch` with `model`'s weights replaced by
    `state` (a state_dict): what a parallel run's gradients must equal at its own current
    weights. The random number stream is left as it was (a dropout mask drawn here is the
    one the parallel run draws next)."""
    model = copy.deepcopy(model)
    device = _device_of(model)
    # non-persistent buffers (RoPE tables) are in a full state but not in a state_dict
    model.load_state_dict({k: state[k].to(device) for k in model.state_dict() if k in state})
    with torch.random.fork_rng(devices=[]):
        _loss_and_grads(model, batch, mixed_precision, 1.0)
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 2.0**15


def _loss_and_grads(
    model: nn.Module, batch: Sequence[torch.Tensor], mixed_precision: str | None, scale: float
) -> torch.Tensor:
    """Forward + backward; leaves fp32 `.grad` on `model`'s parameters."""
    if mixed_precision is None:
        loss = model(*batch)
        loss.backward()
        return loss
    dtype = DTYPES[mixed_precision]
    work = copy.deepcopy(model)
    for p in work.parameters():
        p.data = p.data.to(dtype)
    cast = [t.to(dtype) if t.is_floating_point() else t for t in batch]
    loss = work(*cast)
    (loss.float() * scale).backward()
    for p, w in zip(model.parameters(), work.parameters(), strict=True):
        p.grad = None if w.grad is None else w.grad.float() / scale
    return loss

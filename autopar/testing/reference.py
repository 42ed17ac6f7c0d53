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
    model: nn.Module, batch: Sequence[torch.Tensor], steps: int, *, grads: bool = True
) -> Reference:
    """`steps` AdamW steps of a copy of `model` on `batch`; `grads=False` keeps no gradients."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, per_step = [], []
    for _ in range(steps):
        loss = model(*batch)
        loss.backward()
        losses.append(loss.item())
        if grads:
            per_step.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Reference(losses, per_step, state)

"""Layer templates: capture a few of a model's identical blocks to stand for all of them.

`capture_template(model, args, loss_fn=None, keep=2) -> Template`

Tracing a 112-block model takes tens of seconds, and the search prices many candidate
meshes and microbatch shapes. Identical blocks cost the same on a given mesh, so the search
captures the model with its block stack cut to the first `keep` blocks (the
`nn.ModuleList` with the most children, all of one class with the same parameter shapes),
and weighs the last captured block by the number of blocks it stands for
(`Template.weights`, used as `CostWeights.layer`). The model is restored before returning;
the stack is replaced only for the trace (`truncated_blocks`), never copied.

A model whose forward depends on the number of blocks other than by iterating over them
would trace differently; the final plan is always made on the full capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn

from autopar.capture.export import Captured, capture, layer_of


@dataclass
class Template:
    captured: Captured
    total_layers: int | None = None  # blocks of the full model (None: nothing was cut)
    weights: dict[str, float] = field(default_factory=dict)  # layer name -> blocks it stands for
    # what the search solved on this template, by problem (`autopar.search.template_plan`):
    # the layout search's winner is not solved again for the final plan
    solved: dict[str, object] = field(default_factory=dict, repr=False, compare=False)


def block_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's repeated-block stack: the largest ModuleList of identical children."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if _identical(module) and (best is None or len(module) > len(best[1])):
            best = (name, module)
    return best


def _identical(blocks: nn.ModuleList) -> bool:
    def shape(m: nn.Module):
        return type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())

    first = shape(blocks[0])
    return all(shape(b) == first for b in blocks)


@contextmanager
def truncated_blocks(model: nn.Module, path: str, keep: int) -> Iterator[None]:
    parent_name, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    full = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList(list(full)[:keep]))
    try:
        yield
    finally:
        setattr(parent, attr, full)


def capture_template(
    model: nn.Module, args: Sequence, loss_fn: Callable | None = None, keep: int = 2
) -> Template:
    stack = block_stack(model)
    if stack is None or len(stack[1]) <= keep:
        return Template(capture(model, args, loss_fn))
    path, blocks = stack
    with truncated_blocks(model, path, keep):
        captured = capture(model, args, loss_fn)
    layers = list(dict.fromkeys(filter(None, map(layer_of, captured.gm.graph.nodes))))
    if len(layers) != keep:  # the stack is not what forward iterates over: no shortcut
        return Template(capture(model, args, loss_fn))
    return Template(captured, len(blocks), {layers[-1]: float(len(blocks) - keep + 1)})

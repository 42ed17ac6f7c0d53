"""Operands: which value of which node each input of a node reads.

`operands(node) -> list[Operand]`, `tensor_operands(node) -> list[tuple[int, Operand]]`

An FX node names its inputs by producer node. A producer with several outputs
(`native_layer_norm`, `split`, `max_pool2d_with_indices`, ...) holds a tuple in
`meta["val"]` and is read only through `operator.getitem(producer, i)`: the getitem's one
operand is `Operand(producer, i)`, whose value is the producer's i-th output. Every other
input is `Operand(producer, None)` and reads the producer's whole value.

Order: the producers as `torch.fx.node.map_arg` visits `(args, kwargs)` (flattened, repeats
kept). This is the order of `NodeStrategy.inputs` and of `NodePlan.inputs`/`args`, so a
position means the same input in strategies, costs, the ILP's edges, plans and lowering.
Operands whose value is not a tensor (a SymInt node, a whole tuple read by a non-getitem)
are kept so that positions line up; `tensor_operands` drops them and keeps the positions.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.fx as fx

__all__ = ["Operand", "operands", "tensor_operands"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Operand:
    """One input of a node: its producer and, for a multi-output producer, which output."""

    producer: fx.Node
    output_index: int | None = None  # None: the producer has one output, read whole

    @property
    def value(self) -> object:
        """The `meta["val"]` this operand reads (None where the producer has none)."""
        val = self.producer.meta.get("val")
        if self.output_index is None:
            return val
        return val[self.output_index] if isinstance(val, (tuple, list)) else None

    @property
    def tensor(self) -> torch.Tensor | None:
        """The (fake) tensor this operand reads, or None when it reads no tensor."""
        val = self.value
        return val if isinstance(val, torch.Tensor) else None

    def select(self, outputs: Sequence[T]) -> T | None:
        """This operand's entry of a per-output sequence of the producer (e.g. the output
        specs of its strategy): entry `output_index`, or the only (first) one."""
        index = self.output_index or 0
        return outputs[index] if index < len(outputs) else None

    def __str__(self) -> str:
        if self.output_index is None:
            return self.producer.name
        return f"{self.producer.name}[{self.output_index}]"


def operands(node: fx.Node) -> list[Operand]:
    """Every input node of `node` as an operand, in flattened (args, kwargs) order."""
    if node.op == "call_function" and node.target is operator.getitem:
        producer, index = node.args
        assert isinstance(producer, fx.Node) and isinstance(index, int), node.format_node()
        multi = isinstance(producer.meta.get("val"), (tuple, list))
        return [Operand(producer, index if multi else None)]
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return [Operand(p) for p in found]


def tensor_operands(node: fx.Node) -> list[tuple[int, Operand]]:
    """`(position, operand)` for the operands that read a tensor (see the module docstring)."""
    return [(i, op) for i, op in enumerate(operands(node)) if op.tensor is not None]

"""The edge price tables of `search.costs.CostContext`: what an operand's edge reads of its
value (`EdgeValue`) and its matrices of prices over (source spec, consumer strategy)
pairs, memoized by identity and by content.

The intra-op ILP asks for one matrix per operand edge (and again per weight-edge scale and
for the levers); a template's blocks, and the q/k/v projections of one block, ask for
matrices with the same specs, shapes and kinds of value: their content key (each spec's
number, the value's dims, dtype size, weight or not, Linear bias or not) reads the twin's
matrix instead of pricing every cell again (llama3-8b planning: 688k cells priced -> 193k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.capture.operands import Operand
from autopar.passes.strategies import NodeStrategy


@dataclass(frozen=True, slots=True)
class EdgeValue:
    """What the prices of one operand's edges read of its value, read once per matrix."""

    shape: torch.Size
    dims: tuple[int, ...]
    dtype: torch.dtype
    itemsize: int
    weight: bool  # a parameter gradient (`CostContext.is_weight`)
    memo_weight: bool  # the gradient's size depends on `weight` (mixed precision)
    into_partial: bool  # a Linear's bias: may enter a Partial (`reshard._kept_partial`)

    @staticmethod
    def of(ctx, op: Operand, val: torch.Tensor, v: fx.Node, pos: int) -> EdgeValue:
        weight = ctx.is_weight(op.producer)
        return EdgeValue(
            val.shape,
            tuple(val.shape),
            val.dtype,
            val.element_size(),
            weight,
            bool(ctx.reduce_itemsize) and weight,
            weight and enters_partial(v, pos),
        )


def enters_partial(v: fx.Node, pos: int) -> bool:
    """Input `pos` of `v` is a Linear's bias (`addmm`'s first input): a weight there may go
    from Replicate into a Partial (`cost_models.reshard._kept_partial`)."""
    return pos == 0 and v.target is torch.ops.aten.addmm.default


class EdgeMatrices:
    """The matrix memos of `CostContext` (which provides `_parts_of`, `sync_weight`,
    `_grad_spec_at_consumer` and `_alive`)."""

    def __init__(self) -> None:
        self._specs: dict[int, int] = {}  # id of a spec -> its number in `_numbers`
        self._numbers: dict[tuple, int] = {}  # spec (placements) -> a number
        self._matrices: dict[tuple, list[list]] = {}  # by identity
        self._matrix_content: dict[tuple, list[list]] = {}  # by the specs' numbers

    def edge_part_matrices(
        self, op: Operand, srcs: list, v: fx.Node, ss: list[NodeStrategy], pos: int
    ) -> list[list[tuple[float, float]]]:
        """`edge_parts` of every (source spec i, consumer strategy j) pair, [i][j],
        memoized per (operand, consumer, position, srcs, ss): the ILPs of several
        weight-edge scales and the levers price the same edges."""
        return self._edge_matrix("parts", op, srcs, v, ss, pos)

    def edge_sync_matrix(
        self, op: Operand, srcs: list, v: fx.Node, ss: list[NodeStrategy], pos: int
    ) -> list[list[float]]:
        """`sync_weight` of every (source spec i, consumer strategy j) pair, [i][j]."""
        return self._edge_matrix("sync", op, srcs, v, ss, pos)

    def _edge_matrix(self, kind: str, op: Operand, srcs: list, v, ss: list, pos: int):
        """A matrix of `edge_parts` ("parts") or `sync_weight` ("sync"), memoized by
        identity and by content (the specs' numbers: another edge with the same specs,
        shape and kind of value, a repeated block's, reads the same matrix)."""
        key = (kind, op, v, pos, tuple(map(id, srcs)), tuple(map(id, ss)))
        found = self._matrices.get(key)
        if found is None:
            self._alive.update({id(x): x for x in (*srcs, *ss)})
            val = op.tensor
            empty = (0.0, 0.0) if kind == "parts" else 1.0
            if val is None:
                found = [[empty] * len(ss) for _ in srcs]
            else:  # what the operand is, read once for the whole matrix
                edge = EdgeValue.of(self, op, val, v, pos)
                content = (
                    kind,
                    tuple(self._spec_number(src) if src is not None else -1 for src in srcs),
                    tuple(self._consumer_numbers(s, pos) for s in ss),
                    edge.dims, edge.itemsize, edge.weight, edge.into_partial,
                )  # fmt: skip
                found = self._matrix_content.get(content)
                if found is None and kind == "parts":
                    found = [[self._parts_of(edge, src, s, pos) for s in ss] for src in srcs]
                elif found is None:
                    found = [[self.sync_weight(op, src, v, s, pos) for s in ss] for src in srcs]
                self._matrix_content[content] = found
            self._matrices[key] = found
        return found

    def _consumer_numbers(self, s: NodeStrategy, pos: int) -> tuple[int, int] | None:
        """What the prices of an edge read of its consumer's strategy `s`: the numbers of
        the spec input `pos` wants and of its gradient's there."""
        dst = s.inputs[pos] if pos < len(s.inputs) else None
        if dst is None:
            return None
        return self._spec_number(dst), self._spec_number(self._grad_spec_at_consumer(dst, s))

    def _spec_number(self, spec) -> int:
        """A number per distinct spec, read by the spec object's id (placements hash in
        Python: a spec is hashed once per object, not once per lookup)."""
        found = self._specs.get(id(spec))
        if found is None:
            self._alive[id(spec)] = spec
            found = self._numbers.setdefault(tuple(spec), len(self._numbers))
            self._specs[id(spec)] = found
        return found

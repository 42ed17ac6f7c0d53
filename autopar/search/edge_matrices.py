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
from autopar.cost_models.rearrange import through_source, transposed_dims
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
    transposed: tuple[int, ...] | None = None  # the producer's permutation, if it transposes

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
            producer_transpose(op.producer),
        )

    def through_source(self, src, dst) -> tuple[int, ...] | None:
        """The permutation where lowering moves the value `src -> dst` as its source
        (`rearrange.through_source`), else None."""
        if self.transposed is None or src is None or dst is None:
            return None
        return self.transposed if through_source(src, dst, self.transposed) else None


def producer_transpose(n: fx.Node) -> tuple[int, ...] | None:
    """The permutation of a transposing node (`rearrange.transposed_dims`), else None."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    val = n.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    dims = transposed_dims(n.target, n.args, val.ndim)
    return tuple(dims) if dims is not None else None


def enters_partial(v: fx.Node, pos: int) -> bool:
    """Input `pos` of `v` is a Linear's bias (`addmm`'s first input): a weight there may go
    from Replicate into a Partial (`cost_models.reshard._kept_partial`)."""
    return pos == 0 and v.target is torch.ops.aten.addmm.default


class EdgeMatrices:
    """The matrix memos of `CostContext` (which provides `_parts_of`, `sync_weight`,
    `counted_in_full`, `_grad_spec_at_consumer` and `_alive`)."""

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
            elif kind == "sync" and self.counted_in_full(op):
                found = [[1.0] * len(ss) for _ in srcs]  # `sync_weight`'s every cell
            else:  # what the operand is, read once for the whole matrix
                edge = EdgeValue.of(self, op, val, v, pos)
                content = (
                    kind,
                    tuple(self._spec_number(src) if src is not None else -1 for src in srcs),
                    tuple(self._consumer_numbers(s, pos) for s in ss),
                    edge.dims, edge.itemsize, edge.weight, edge.into_partial, edge.transposed,
                )  # fmt: skip
                found = self._matrix_content.get(content)
                if found is None:
                    found = self._cells(kind, op, edge, srcs, v, ss, pos, *content[1:3])
                self._matrix_content[content] = found
            self._matrices[key] = found
        return found

    def _cells(self, kind, op, edge, srcs, v, ss, pos, src_numbers, consumer_numbers):
        """The matrix, each distinct (source spec, consumer's specs) cell priced once: a
        price reads nothing else of the pair (`_parts_of`'s content key), and strategies
        of a node may want its input in the same specs (Llama-3-8B's search: 193k cells,
        157k distinct)."""
        rows: dict = {}
        cols: dict = {}
        for i, number in enumerate(src_numbers):
            rows.setdefault(number, i)
        for j, numbers in enumerate(consumer_numbers):
            cols.setdefault(numbers, j)
        if kind == "parts":  # by the numbers already read: `_parts_of` without its keys

            def price(i: int, j: int) -> tuple[float, float]:
                numbers = consumer_numbers[j]
                if srcs[i] is None or numbers is None:
                    return 0.0, 0.0
                return self._numbered_parts(edge, src_numbers[i], *numbers, srcs[i], ss[j], pos)
        else:
            price = lambda i, j: self.sync_weight(op, srcs[i], v, ss[j], pos)  # noqa: E731
        table = {(a, b): price(i, j) for a, i in rows.items() for b, j in cols.items()}
        return [[table[a, b] for b in consumer_numbers] for a in src_numbers]

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

"""The graph at any rows from two concrete traces: every size affine in the rows.

    desc = describe(trace(root, args[:half]))      # in a forked process, beside ...
    traced = trace(root, args)                     # ... this one's trace of every row
    rows_of = paired(traced, rows, desc, half)     # None where the two do not pair
    made = made_at(traced, rows_of, 4)             # the graph at 4 rows

A symbolic export of Llama-3-8B's two-block template (`capture.rows`) costs ~2.3 s on one
core, where a concrete trace costs ~1 s: two concrete traces, at the batch's rows and at
half of them, run on two cores at once, and the graph at any other rows follows from them
where every integer of the graph (an argument, a size, a stride) is the same in both or an
affine function of the rows with rational coefficients (`r * 128`, `r - 1`; a flattened
batch times its sequence): the same ops in the same order, the same node names, the same
floats, constants and signature. Two points fit a line through any two values, so a
made graph is also checked where it could be wrong: an integer whose value at the asked
rows is not a non-negative whole number, a graph whose ops, run again on its values, do
not give the shapes it holds (`rows.shapes_hold`, a `squeeze` of one row, a size clamped
by the batch), is not made: the caller traces it instead.

`describe` gives what pairing reads of a traced graph as plain data (the forked process
sends it through a pipe): per node its op, target, name, arguments (nodes by index) and the
sizes, strides and dtypes of its values; the constants' shapes and small values; the
signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.fx as fx

from autopar._compat import FakeTensorMode
from autopar.capture.export import Traced

_PLAIN = (
    bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format
)  # fmt: skip
SMALL_CONSTANT = 4096  # elements: constants up to this size are compared by value


class _Unpaired(Exception):  # noqa: N818 - not an error: the caller traces instead
    """The two traces do not pair (or a value does not exist at the asked rows)."""


@dataclass(frozen=True)
class _Tensor:
    """A tensor value as `describe` sends it."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class _NodeRef:
    index: int


@dataclass(frozen=True)
class _Opaque:
    """A value of another type (an unbacked symbol's, a slice): such a graph does not pair,
    its values are not made (`_follow`)."""

    text: str


def describe(traced: Traced) -> dict:
    """What `paired` reads of `traced`, as plain picklable data."""
    index = {n: i for i, n in enumerate(traced.gm.graph.nodes)}

    def plain(x):
        if isinstance(x, fx.Node):
            return _NodeRef(index[x])
        if isinstance(x, torch.Tensor):
            return _Tensor(tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
        if isinstance(x, (list, tuple)):  # fx's immutable lists, torch.Size: as list, tuple
            return (list if isinstance(x, list) else tuple)(plain(v) for v in x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (int, float, *_PLAIN)):
            return x
        return _Opaque(repr(x))

    nodes = [
        (n.op, str(n.target), n.name, plain((n.args, n.kwargs)), plain(n.meta.get("val")))
        for n in traced.gm.graph.nodes
    ]
    return {
        "nodes": nodes,
        "constants": {k: _constant(v) for k, v in traced.constants.items()},
        "signature": (repr(traced.input_specs), repr(traced.output_specs)),
    }


def _constant(value) -> tuple:
    if not isinstance(value, torch.Tensor):
        return ("object", repr(value))
    values = None
    if value.numel() <= SMALL_CONSTANT and value.device.type != "meta":
        try:
            values = value.tolist()
        except Exception:  # noqa: BLE001 - a fake tensor has no values: its shape is compared
            values = None
    return ("tensor", tuple(value.shape), value.dtype, values)


@dataclass
class RowsOf:
    """How each node's arguments and value follow the rows (`paired`'s answer)."""

    rows: tuple[int, int]  # the two traces' rows
    nodes: list[tuple[object, object]]  # per node: (arguments, value) as functions of rows


def paired(traced: Traced, rows: int, other: dict, other_rows: int) -> RowsOf | None:
    """How `traced` (at `rows`) follows the rows, given `describe` of the same root traced
    at `other_rows`; None where the two traces do not pair (module docstring)."""
    mine = describe(traced)
    if mine["signature"] != other["signature"] or mine["constants"] != other["constants"]:
        return None
    if len(mine["nodes"]) != len(other["nodes"]):
        return None
    span = (rows, other_rows)
    out = []
    try:
        for node, a, b in zip(traced.gm.graph.nodes, mine["nodes"], other["nodes"], strict=True):
            if a[:3] != b[:3]:  # op, target, name
                return None
            (args, kwargs), (other_args, other_kwargs) = a[3], b[3]
            sizes = _size_arguments(node)
            if len(args) != len(other_args) or kwargs.keys() != other_kwargs.keys():
                return None
            follow_args = tuple(
                _follow(x, y, span, k in sizes)
                for k, (x, y) in enumerate(zip(args, other_args, strict=True))
            )
            follow_kwargs = {
                k: _follow(v, other_kwargs[k], span, k in sizes) for k, v in kwargs.items()
            }
            out.append(((follow_args, follow_kwargs), _follow(a[4], b[4], span, True)))
    except _Unpaired:
        return None
    return RowsOf(span, out)


def _size_arguments(node: fx.Node) -> set:
    """The positions and names of `node`'s arguments that an op schema types as int or
    int[] (sizes, indices, bounds), and `arange`'s bounds (Scalars that are sizes: its
    length; Hugging Face's masks index the batch by `arange(rows)`): only those may follow
    the rows. Another number (`Scalar`) that differs, `x / (rows * rows)`, could follow them
    otherwise than on a line: the two traces do not pair."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return set()
    sized = ("int", "List[int]", *(("number",) if schema.name == "aten::arange" else ()))
    out = set()
    for k, arg in enumerate(schema.arguments):
        text = str(arg.type)
        if text.startswith("Optional["):
            text = text[len("Optional[") : -1]
        if text in sized:
            out |= {k, arg.name}
    return out


def _follow(x, y, span: tuple[int, int], sizes: bool):
    """`x` (at span[0] rows) and `y` (at span[1]) as one value of the rows: an int that
    differs becomes an `_Affine` where `sizes` (a size argument or a value's sizes and
    strides); anything else must be equal."""
    if type(x) is not type(y) or isinstance(x, _Opaque):
        raise _Unpaired
    if isinstance(x, int) and not isinstance(x, bool) and x != y:
        if not sizes:
            raise _Unpaired
        slope = Fraction(x - y, span[0] - span[1])
        return _Affine(slope, x - slope * span[0])
    if isinstance(x, (list, tuple)):
        if len(x) != len(y):
            raise _Unpaired
        return type(x)(_follow(a, b, span, sizes) for a, b in zip(x, y, strict=True))
    if isinstance(x, dict):
        if x.keys() != y.keys():
            raise _Unpaired
        return {k: _follow(x[k], y[k], span, sizes) for k in x}
    if isinstance(x, _Tensor):
        if (x.dtype, x.device) != (y.dtype, y.device):
            raise _Unpaired
        shape, stride = (
            _follow(x.shape, y.shape, span, True),
            _follow(x.stride, y.stride, span, True),
        )
        return _Tensor(shape, stride, x.dtype, x.device)
    if x != y and not (isinstance(x, float) and x != x and y != y):  # NaN equals NaN here
        raise _Unpaired
    return x


@dataclass(frozen=True)
class _Affine:
    slope: Fraction
    intercept: Fraction

    def at(self, rows: int) -> int:
        value = self.slope * rows + self.intercept
        if value.denominator != 1 or value < 0:
            raise _Unpaired
        return int(value)


def made_at(traced: Traced, rows_of: RowsOf, rows: int) -> Traced | None:
    """A copy of `traced` at `rows` (every argument and value of `rows_of` evaluated); None
    where an integer is no whole number there."""
    out = traced.copy()
    nodes = list(out.gm.graph.nodes)
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def value(f):
        if isinstance(f, _Affine):
            return f.at(rows)
        if isinstance(f, _NodeRef):
            return nodes[f.index]
        if isinstance(f, _Tensor):
            with mode:
                return torch.empty_strided(value(f.shape), value(f.stride), dtype=f.dtype,
                                           device=f.device)  # fmt: skip
        if isinstance(f, (list, tuple)):
            return type(f)(value(x) for x in f)
        if isinstance(f, dict):
            return {k: value(v) for k, v in f.items()}
        return f

    try:
        for node, (args, val) in zip(nodes, rows_of.nodes, strict=True):
            node.args, node.kwargs = value(args)
            if "val" in node.meta:
                node.meta["val"] = value(val)
            node.meta.pop("tensor_meta", None)  # sizes at the traced rows; nothing reads it
    except _Unpaired:
        return None
    out.gm.recompile()
    return out

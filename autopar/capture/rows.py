"""One trace for every microbatch size: two traces paired, or one with the batch dim symbolic.

    tracer = AnyRows()
    traced = tracer(root, args)          # args of 16 rows: traced here, and at 8 rows on
                                         # another core meanwhile
    traced = tracer(root, sliced_args)   # 4 rows: the same graph, its sizes made at 4

The layout search prices every microbatch count on a template captured at that count's
rows, and each `torch.export` + decomposition takes ~1 s (Llama-3-8B's two-block
template): five row counts cost as much as its ILPs. The first call traces the batch's
rows here and half of them in a forked process at the same time (two cores: ~1 s where
one export with a symbolic batch takes ~2.3 s); where the two traces pair, every size of
the graph is the same in both or on a line through them (`capture.affine_rows`), and
`affine_rows.made_at` makes the graph at any rows (~0.04 s). Where they do not pair (a
number that follows the rows off a line, another op at half the rows), the batch's rows
are exported once more with dim 0 of every batch tensor as `torch.export.Dim` (rows 2 to
the first call's): the graph holds the rows as a symbol, and `at_rows` evaluates every
size, stride and symbolic scalar of it at a row count and drops the nodes that computed
them. Either way the graph made at some rows is the one a trace at those rows gives (the
same ops, arguments and shapes, so the same `export.graph_fingerprint` once finished:
checked on every sample at 1 to 8 rows in tests/test_capture_rows.py).

Where it cannot hold, the call traces as given (`export.trace`): a model that traces
neither way with its batch's rows free (a hard-coded `view(16, ...)`, a branch on the
batch size), rows where an op's shapes differ from those made (`shapes_hold` runs every
op again on the made values, ~0.1 s against a trace's ~1 s: a `squeeze` of the batch dim
at one row, which the symbol, exported as at least 2, and the line through two traces of
more rows both keep; a size a line does not follow), rows above the first call's, or other
shapes than the first call's beyond dim 0. Another root (the whole model, where a template
cannot be cut: a stack forward does not iterate over, or whose blocks alternate with
another's) is served the same way by an instance of its own (each microbatch size's
whole-model trace was made again: Hugging Face BART's, ~4 s, before its template cut both
its stacks). A template only prices: the
final plan's graph is built from the winner's template and checked against a concrete
trace of three blocks (`Template._repeats`), or traced.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence

import torch
import torch.fx as fx

from autopar._compat import FakeTensorMode, detect_fake_mode
from autopar.capture.affine_rows import RowsOf, describe, made_at, paired
from autopar.capture.export import Traced, _WithLoss, decompositions, trace
from autopar.forked import Forked

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class AnyRows:
    """`trace(root, args)` at any rows from the first call's traces (see the module
    docstring for where it traces as given instead). One instance serves the model (and
    loss) of one search: its first root, and any other root (the whole model where a
    template's cut stack is not what forward iterates over) by an instance of its own."""

    def __init__(self) -> None:
        self.traced: Traced | None = None  # the first call's graph (concrete or symbolic)
        self.failed = False
        # how `traced` follows the rows (two concrete traces paired); None: it is symbolic
        self.rows_of: RowsOf | None = None
        self._key: tuple | None = None  # (root, shapes beyond dim 0 and dtypes of the args)
        self._rows = 0  # the first call's rows: the most any graph is made at
        self._others: dict[tuple, AnyRows] = {}  # another root's own, by its key

    def __call__(self, root: torch.nn.Module, args: Sequence) -> Traced:
        rows = _rows_of(args)
        if rows is None or rows < 1 or self.failed:
            return trace(root, args)
        key = (_identity(root), _beyond_rows(args))
        if self.traced is None:
            if rows < 3:  # the symbol's range [2, rows] would be one size
                return trace(root, args)
            self._key, self._rows = key, rows
            first = self._paired_trace(root, args, rows)
            if first is not None:
                return first
            self.traced = _trace_symbolic(root, args, rows)
            self.failed = self.traced is None
            if self.failed:
                return trace(root, args)
        if key != self._key:  # another root (the whole model, where a template's cut
            # was not what forward iterates over): traced any rows by its own instance
            return self._others.setdefault(key, AnyRows())(root, args)
        if rows > self._rows:
            return trace(root, args)
        if self.rows_of is not None and rows == self._rows:
            return self.traced.copy()
        made = self.evaluated(rows)
        if made is None or (self._unchecked(rows) and not shapes_hold(made)):
            return trace(root, args)  # an op that drops a dim of size 1, a size off a line
        return made

    def evaluated(self, rows: int) -> Traced | None:
        """The first call's graph at `rows`, unchecked (None: an integer of it is no whole
        number there)."""
        if self.rows_of is not None:
            return made_at(self.traced, self.rows_of, rows)
        return at_rows(self.traced, rows)

    def _unchecked(self, rows: int) -> bool:
        """Whether the graph made at `rows` is not what a trace gave: rows other than the two
        traced ones; rows of 1 below the symbol's range [2, first call's rows]."""
        if self.rows_of is not None:
            return rows not in self.rows_of.rows
        return rows == 1

    def _paired_trace(self, root: torch.nn.Module, args: Sequence, rows: int) -> Traced | None:
        """The trace at `rows`, paired with a trace at half of them made meanwhile in a
        forked process (`capture.affine_rows`); None where they do not pair."""
        half = rows // 2
        if half < 2:
            return None
        helper = Forked.start(lambda: describe(trace(root, _first_rows(args, half))))
        try:
            traced = trace(root, args)
        except BaseException:
            helper.cancel()
            raise
        try:
            other = helper.result()
        except Exception:  # noqa: BLE001 - it does not trace at half the rows
            return None
        rows_of = paired(traced, rows, other, half)
        if rows_of is None:
            return None
        self.traced, self.rows_of = traced.copy(), rows_of
        return traced


def _first_rows(args: Sequence, rows: int) -> tuple:
    return tuple(a[:rows] if _batched(a) else a for a in args)


def at_rows(traced: Traced, rows: int) -> Traced:
    """A copy of `traced` (exported with the batch dim symbolic) at `rows`: every size,
    stride and symbolic scalar evaluated, the nodes that computed the scalars dropped."""
    out = traced.copy()
    graph = out.gm.graph
    at = {s: rows for s in _symbols(graph)}
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def number(x):
        if isinstance(x, torch.SymInt):
            return int(x.node.expr.xreplace(at))
        if isinstance(x, torch.SymFloat):
            return float(x.node.expr.xreplace(at))
        if isinstance(x, torch.SymBool):
            return bool(x.node.expr.xreplace(at))
        return x

    def value(v):
        if isinstance(v, torch.Tensor):
            size, stride = [number(s) for s in v.shape], [number(s) for s in v.stride()]
            with mode:
                return torch.empty_strided(size, stride, dtype=v.dtype, device=v.device)
        if isinstance(v, (list, tuple)):
            return type(v)(value(x) for x in v)
        return number(v)

    scalars: dict[fx.Node, object] = {}
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, SYMBOLIC):
            scalars[node] = number(val)
            continue
        if scalars:
            node.args, node.kwargs = fx.node.map_arg(
                (node.args, node.kwargs), lambda a: scalars.get(a, a)
            )
        if "val" in node.meta:
            node.meta["val"] = value(val)
        node.meta.pop("tensor_meta", None)  # sizes of the symbolic graph; nothing reads it
    for node in reversed(list(scalars)):
        graph.erase_node(node)
    out.gm.recompile()
    return out


def shapes_hold(traced: Traced) -> bool:
    """Whether every op of `traced` (made by `at_rows`), run again on its inputs' values,
    gives the shapes its metadata holds. The symbol was exported for rows of 2 and more,
    so an op whose result depends on a dim being 1 (a `squeeze`) was traced as for 2: at
    one row its metadata would keep a dim the op drops."""
    for node in traced.gm.graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        try:
            with detect_fake_mode(node.meta.get("val")) or contextlib.nullcontext():
                got = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - an op that does not run at these rows
            return False
        if _shapes(got) != _shapes(node.meta.get("val")):
            return False
    return True


def _shapes(val) -> object:
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    if isinstance(val, (list, tuple)):
        return tuple(_shapes(v) for v in val)
    return None


def _trace_symbolic(root: torch.nn.Module, args: Sequence, rows: int) -> Traced | None:
    """`root` exported with dim 0 of every batch tensor symbolic (2 to `rows`) and
    decomposed as `export.trace` does; None where torch.export does not take it so."""
    dim = torch.export.Dim("rows", min=2, max=rows)
    dynamic = torch.export.ShapesCollection()  # by tensor: forward(*batch) takes it too
    for a in args:
        if _batched(a):
            dynamic[a] = {0: dim}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shapes = dynamic.dynamic_shapes(root, tuple(args))
            ep = torch.export.export(root, tuple(args), dynamic_shapes=shapes, strict=False)
            ep = ep.run_decompositions(decompositions())
    except Exception:  # noqa: BLE001 - any refusal means: trace each size as given
        return None
    sig = ep.graph_signature
    return Traced(ep.graph_module, sig.input_specs, sig.output_specs, ep.constants)


def _symbols(graph: fx.Graph) -> set:
    """The symbols in the placeholders' shapes (the rows)."""
    out: set = set()
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    out |= size.node.expr.free_symbols
    return out


def _batched(a) -> bool:
    return isinstance(a, torch.Tensor) and a.ndim > 0


def _rows_of(args: Sequence) -> int | None:
    """The rows every batch tensor shares (dim 0), None if they differ or none has one."""
    rows = {a.shape[0] for a in args if _batched(a)}
    return rows.pop() if len(rows) == 1 else None


def _beyond_rows(args: Sequence) -> tuple:
    return tuple((tuple(a.shape[1:]), a.dtype) if _batched(a) else repr(a) for a in args)


def _identity(root: torch.nn.Module) -> tuple:
    """The model (and loss) a root traces: a loss wrapper is made anew for each call."""
    if isinstance(root, _WithLoss):
        return (id(root.model), id(root.loss_fn), _blocks(root.model))
    return (id(root), None, _blocks(root))


def _blocks(model: torch.nn.Module) -> tuple:
    """The module lists' lengths: a template traces the model with its stack cut."""
    return tuple(len(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList))

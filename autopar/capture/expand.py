"""The whole model's graph from its two-block template, without tracing the whole model.

`expand_blocks(traced, path, total) -> Traced | None`

Tracing Llama-3-8B's 32 blocks takes ~6 s on two cores, GPT-3's 96 blocks ~14 s, while
planning needs only the template (`autopar.capture.template`: the model traced with its
block stack cut to blocks 0 and 1). A model that iterates over its blocks traces block k
as it traces block 1, reading block k - 1's values where block 1 reads block 0's. So the
full graph is the template's with block 1 repeated `total - 2` more times:

- placeholders: block k's parameters and buffers after block k - 1's (each run of block-1
  inputs, as `named_parameters` / `named_buffers` list them), named as export names them
  (`p_layers_1_w` -> `p_layers_k_w`, FQN `layers.1.w` -> `layers.k.w`);
- nodes: block k's copy of each block-1 node, in order after block k - 1's; what block 1
  reads of block 0 (the residual stream) block k reads of block k - 1; the nodes after the
  stack read the last block;
- names: each node's base name (`mul_7` -> `mul`); `finish` numbers every graph's nodes
  in graph order, traced or expanded;
- metadata: block 1's, the module paths renumbered (`layers.1.attn` -> `layers.k.attn`).

It applies only where the template shows the iteration: blocks 0 and 1 are the same ops
on the same shapes wired alike (block 1 reading block 0 only where block 0 reads what
precedes the stack), one contiguous run each, nothing after the stack reads block 0, no
buffer of a block updated in place. Otherwise None, and the caller traces the model. The
graph is then `finish`ed as a traced one is; tests/test_expand.py checks it equals the
trace of the whole model (names, ops, wiring, metadata, fingerprint) on the samples.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import replace

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from autopar._compat import LazyGraphModule
from autopar.capture.export import Traced, base_name, layer_of

_LIFTED = re.compile(r"lifted_tensor_(\d+)$")


def expand_blocks(traced: Traced, path: str, total: int, first: int = 0) -> Traced | None:
    """`traced` (blocks `path`.0 and `path`.1 of a stack of `total`) with blocks 2 ..
    total - 1 added (module docstring); None where the template does not show how.
    `first`: the stack's blocks before the repeated ones (T5's first, the only one with
    the relative position bias), traced as they are; blocks `first` and `first + 1` then
    play blocks 0 and 1. An encoder-decoder's graph is expanded one stack at a time."""
    graph = traced.gm.graph
    spec_of = {s.arg.name: s for s in traced.input_specs}
    block = {n: _block_index(n, spec_of, path, first) for n in graph.nodes}
    shape = _Blocks.read(graph, block)
    if (
        shape is None
        or total <= first + 2
        or any(_updates_block(s, path) for s in traced.output_specs)
    ):
        return None
    return _Expansion(traced, spec_of, shape, path, total, first).run()


def _block_index(node: fx.Node, spec_of: dict, path: str, first: int) -> int | None:
    """0 for a node of block `first`, 1 for one of the next, else None."""
    if node.op == "placeholder":
        target = getattr(spec_of.get(node.name), "target", None) or ""
        return next((i for i in (0, 1) if target.startswith(f"{path}.{first + i}.")), None)
    if node.op == "output":
        return None
    layer = layer_of(node)
    return next((i for i in (0, 1) if layer == f"{path}.{first + i}"), None)


def _updates_block(spec, path: str) -> bool:
    return spec.kind == OutputKind.BUFFER_MUTATION and str(spec.target).startswith(f"{path}.")


class _Blocks:
    """Block 0's and block 1's inputs and nodes, and block 0 -> block 1 twins."""

    def __init__(self, block: dict[fx.Node, int | None], twin: dict[fx.Node, fx.Node]):
        self.block, self.twin = block, twin
        self.first = set(twin)
        self.second = set(twin.values())

    @classmethod
    def read(cls, graph: fx.Graph, block: dict[fx.Node, int | None]) -> _Blocks | None:
        if any(n.op == "get_attr" for n in graph.nodes):
            return None
        computed = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
        if not _units(computed, block):
            return None
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        pairs = [
            [n for n in nodes if block[n] == i] for nodes in (inputs, computed) for i in (0, 1)
        ]
        if len(pairs[0]) != len(pairs[1]) or len(pairs[2]) != len(pairs[3]):
            return None
        blocks = cls(block, dict(zip(pairs[0] + pairs[2], pairs[1] + pairs[3], strict=True)))
        if not all(blocks._alike(a, b) for a, b in blocks.twin.items()):
            return None
        last = max(i for i, n in enumerate(computed) if block[n] == 1)
        after = [*computed[last + 1 :], *(n for n in graph.nodes if n.op == "output")]
        if any(a in blocks.first for n in after for a in n.all_input_nodes):
            return None  # the head reads block 0: the graph depends on the depth otherwise
        return blocks

    def _alike(self, a: fx.Node, b: fx.Node) -> bool:
        """Block-0 node `a` and its twin `b` compute the same thing one block later."""
        if (a.op, a.target if a.op != "placeholder" else None) != (
            b.op,
            b.target if b.op != "placeholder" else None,
        ) or not _same_value(a.meta.get("val"), b.meta.get("val")):
            return False
        return self._same_args((a.args, a.kwargs), (b.args, b.kwargs))

    def _same_args(self, x, y) -> bool:
        if isinstance(x, fx.Node) or isinstance(y, fx.Node):
            if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)):
                return False
            if x in self.first:
                return self.twin[x] is y
            # what precedes the stack: the same value, or block 0's where block 0 reads it
            return self.block[x] is None and (x is y or y in self.first)
        if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
            return len(x) == len(y) and all(map(self._same_args, x, y))
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(self._same_args(x[k], y[k]) for k in x)
        return type(x) is type(y) and x == y


def _units(computed: list[fx.Node], block: dict[fx.Node, int | None]) -> bool:
    """Mark the iteration's units in `block` (changed in place): block 0 with the nodes
    between it and block 1 (the parent's own ops in the loop: `x = x + layer(x)`), and
    block 1 with as many nodes after it. False unless each block is one contiguous run,
    block 0 first."""
    runs = [k for k, _ in itertools.groupby(block[n] for n in computed)]
    if [k for k in runs if k is not None] != [0, 1] or runs[1:-1].count(None) > 1:
        return False
    at = [i for i, n in enumerate(computed) if block[n] is not None]
    start, end = at[0], at[-1] + 1
    first_of_1 = next(i for i in at if block[computed[i]] == 1)
    tail = sum(1 for n in computed[start:first_of_1] if block[n] is None)
    if end + tail > len(computed):
        return False
    for n in computed[start:first_of_1]:
        block[n] = 0
    for n in computed[end : end + tail]:
        block[n] = 1
    return True


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.shape, a.dtype) == (b.shape, b.dtype)
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same_value, a, b))
    return True


class _Expansion:
    def __init__(
        self, traced: Traced, spec_of: dict, blocks: _Blocks, path: str, total: int, first: int
    ):
        self.traced, self.spec_of, self.blocks = traced, spec_of, blocks
        self.path, self.total, self.first = path, total, first
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}  # template node -> its node in the full graph
        # blocks added: first + 2 .. total - 1 (`first` 0: 2 ..); copies[k - first - 2]:
        # block-1 node -> block k's copy ("block 1": block first + 1 of the stack)
        self.added = total - first - 2
        self.copies: list[dict[fx.Node, fx.Node]] = [{} for _ in range(self.added)]
        self.specs: dict[str, object] = {}  # full placeholder name -> its input spec
        self.constants = dict(traced.constants)
        self.after_stack = False  # past the last block: block 1's values are the last block's
        self.lifted = _lifted_numbering(blocks, spec_of)

    def run(self) -> Traced | None:
        if self.lifted is None:
            return None
        nodes = list(self.traced.gm.graph.nodes)
        for n, nxt in zip(nodes, [*nodes[1:], None], strict=True):
            if not self._emit(n):
                return None
            ends_run = n in self.blocks.second and (nxt is None or nxt not in self.blocks.second)
            if ends_run and not self._repeat(n.op == "placeholder", n):
                return None
            self.after_stack |= ends_run and n.op != "placeholder"
        gm = LazyGraphModule(self.traced.gm, self.graph)
        inputs = [self.specs[n.name] for n in self.graph.nodes if n.op == "placeholder"]
        return Traced(gm, inputs, self._output_specs(), self.constants)

    def _emit(self, n: fx.Node) -> bool:
        """A template node in the full graph (`finish` numbers the names in graph order)."""
        last = self.copies[-1] if self.after_stack else {}
        if n.op == "placeholder":
            spec = self.spec_of[n.name]
            number = _lifted_number(spec)
            if self.lifted and number is not None and number > self.lifted[1]:
                # a constant lifted after the stack: numbered after every block's
                shift = self.added * self.lifted[0]
                new = self._input(n, spec.target, _lifted_renumbered(spec.target, shift))
                if new is None:
                    return False
            else:
                new = self.graph.placeholder(n.name)
                self.specs[new.name] = spec
        else:
            new = self._copy(n, lambda a: last[a] if a in last else self.env[a])
        new.meta = copy.copy(n.meta)
        self.env[n] = new
        return True

    def _repeat(self, inputs: bool, end: fx.Node) -> bool:
        """Blocks 2 .. total - 1's copies of the run of block-1 nodes ending at `end`."""
        run = [n for n in self.blocks.twin.values() if (n.op == "placeholder") == inputs]
        run = run[: run.index(end) + 1]
        second = self.first + 1  # the stack's index of the template's block 1
        for k in range(second + 1, self.total):
            previous = self.copies[k - second - 2] if k > second + 1 else self.env
            mine = self.copies[k - second - 1]

            for n in run:
                if n in mine:
                    continue
                if inputs:
                    new = self._input(n, self.spec_of[n.name].target, self._block_target(n, k))
                    if new is None:
                        return False
                else:
                    new = self._copy(n, lambda a, m=mine, p=previous: self._read(a, m, p))
                new.meta = _renumbered_meta(n.meta, f"{self.path}.{second}", f"{self.path}.{k}")
                mine[n] = new
        return True

    def _copy(self, n: fx.Node, read) -> fx.Node:
        """`n` in the full graph, reading `read(a)` where it reads `a`, named by its base
        (`finish` numbers the names in graph order)."""
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), read)
        return self.graph.create_node(n.op, n.target, args, kwargs, name=base_name(n.name))

    def _read(self, a: fx.Node, mine: dict, previous: dict) -> fx.Node:
        """What block k's copy reads where block 1 reads `a` (`mine`: block k's copies,
        `previous`: block k - 1's nodes by their block-1 twins)."""
        if a in mine:
            return mine[a]
        if a in self.blocks.first:  # block 1 reads block 0: block k reads block k - 1
            return previous[self.blocks.twin[a]]
        return self.env[a]

    def _block_target(self, n: fx.Node, k: int) -> str:
        """Block k's FQN for block 1's input `n` (a lifted constant numbered on)."""
        spec = self.spec_of[n.name]
        old, new = f"{self.path}.{self.first + 1}.", f"{self.path}.{k}."
        target = new + spec.target[len(old) :]
        steps = k - self.first - 1
        return _lifted_renumbered(target, steps * self.lifted[0] if self.lifted else 0)

    def _input(self, n: fx.Node, old: str, target: str) -> fx.Node | None:
        """The placeholder of FQN `target` standing where template input `n` (of FQN `old`)
        stands, named as export names it (`p_` + the FQN's characters); None where export
        named `n` otherwise (it had to disambiguate: trace instead)."""
        prefix = n.name.partition("_")[0]
        if n.name != f"{prefix}_{_sanitized(old)}":
            return None
        name = f"{prefix}_{_sanitized(target)}"
        node = self.graph.placeholder(name)
        if node.name != name:
            return None
        spec = self.spec_of[n.name]
        self.specs[name] = replace(spec, arg=TensorArgument(name=name), target=target)
        if spec.kind == InputKind.CONSTANT_TENSOR:
            self.constants[target] = self.traced.constants[old]
        return node

    def _output_specs(self) -> list:
        out = next(n for n in self.graph.nodes if n.op == "output")
        values = out.args[0]
        specs = []
        for value, spec in zip(values, self.traced.output_specs, strict=True):
            if isinstance(spec.arg, TensorArgument) and isinstance(value, fx.Node):
                spec = replace(spec, arg=TensorArgument(name=value.name))
            specs.append(spec)
        return specs


def _lifted_number(spec) -> int | None:
    """N of a constant export lifted as `...lifted_tensor_N` (numbered across the model)."""
    if spec.kind != InputKind.CONSTANT_TENSOR:
        return None
    match = _LIFTED.search(spec.target)
    return int(match.group(1)) if match else None


def _lifted_renumbered(target: str, shift: int) -> str:
    match = _LIFTED.search(target)
    if not shift or match is None:
        return target
    return f"{target[: match.start(1)]}{int(match.group(1)) + shift}"


def _lifted_numbering(blocks: _Blocks, spec_of: dict) -> tuple[int, int] | tuple[()] | None:
    """(constants lifted per block, the last number in block 1), () when the blocks lift
    none, None when their numbers do not step evenly from block to block."""
    pairs = [
        (_lifted_number(spec_of[a.name]), _lifted_number(spec_of[b.name]))
        for a, b in blocks.twin.items()
        if a.op == "placeholder" and spec_of[a.name].kind == InputKind.CONSTANT_TENSOR
    ]
    if not pairs:
        return ()
    steps = {b - a for a, b in pairs if a is not None and b is not None}
    if len(steps) != 1 or any(None in p for p in pairs):
        return None
    return steps.pop(), max(b for _, b in pairs)


def _sanitized(target: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]", "_", target.lower())


def _renumbered_meta(meta: dict, old: str, new: str) -> dict:
    """A copy of block 1's node metadata for block k: module paths `old...` -> `new...`."""
    out = copy.copy(meta)
    out.pop("_autopar_layer_of", None)
    stack = meta.get("nn_module_stack")
    if stack:
        renamed = {}
        for key, (where, cls) in stack.items():
            if where == old or where.startswith(old + "."):
                moved = new + where[len(old) :]
                key = key[: len(key) - len(where)] + moved if key.endswith(where) else key
                where = moved
            renamed[key] = (where, cls)
        out["nn_module_stack"] = renamed
    return out

"""Zero-bubble backward: a stage program's backward cut into its input- and weight-gradient parts.

`WeightGradients(shards)`: `.compiler(inner, n_params, n_state)` is a backward compiler for
AOTAutograd that splits the stage program's backward graph in two (`split_backward`) and
compiles each half with `inner`; `.builder` is the `dw_builder` torch's `PipelineStage`
takes.

The zero-bubble schedules (ZB, ZBV, DualPipeV) run a stage's backward as two actions: I
makes the gradients of the stage's inputs (what the previous stage waits for), W those of
its parameters (which nobody waits for, so the schedule fills bubbles with it). The stage
program is one AOTAutograd function, so autograd sees its backward as one node and cannot
cut it (torch's own `stage_backward_input` would run the whole backward at I and again at
W). Its backward graph can be cut instead:

    I = every node an input gradient depends on (the stage inputs' gradients)
    W = every other node a parameter gradient depends on
    stash = the values W reads that it does not compute: the backward's arguments (saved
            activations, incoming gradients) and the I nodes W reads

For a matmul y = x w^T: I computes dx = dy w, W computes dw = dy^T x and the stash holds
dy and x. Elementwise backward feeding dx runs at I, and so does a fused backward op that
makes a weight gradient beside an input gradient (a norm's); a bias's gradient sum and
the collectives only weight gradients need (FSDP's reduce-scatter) run at W. A collective
and its wait always land in the same half. The first stage's inputs (the batch) take no
gradient, so its I half is empty and its W half is its whole backward. The stage-mesh
peers of a pipeline rank run the same actions in the same order, so the collectives of
either half meet.

At run time the backward AOTAutograd calls (the I action: torch's `stage_backward` on the
stage outputs) runs the I half, returns the input gradients and None for every parameter,
and leaves the W half with its stash in a queue; `builder()` (called by `PipelineStage`
right after that backward) takes it off the queue, and the runner it returns (the W action)
runs it and accumulates the parameter gradients into `.grad`, as autograd would have. The
stash lives from I to W: `search.schedules.replay` holds that memory between them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

Compiler = Callable[[fx.GraphModule, Sequence], Callable]


@dataclass(frozen=True, slots=True)
class SplitBackward:
    """The two halves of a backward graph. `input_gm` takes the backward's arguments and
    returns the input gradients then the stashed I values; `weight_gm` takes
    `[args[k] for k in stash_args]` + those stashed values and returns one gradient (or
    None) per parameter."""

    input_gm: fx.GraphModule
    weight_gm: fx.GraphModule
    stash_args: tuple[int, ...]  # backward arguments W reads
    n_input_grads: int


def split_backward(gm: fx.GraphModule, n_params: int, n_state: int) -> SplitBackward:
    """Cut `gm` (an AOTAutograd backward graph whose outputs are one gradient per program
    argument: parameters, buffers, then stage inputs) into its I and W halves."""
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    assert output.op == "output", output
    grads = list(output.args[0])
    placeholders = [n for n in nodes if n.op == "placeholder"]
    input_outs, weight_outs = grads[n_state:], grads[:n_params]
    assert all(g is None for g in grads[n_params:n_state]), "buffers get no gradient"
    in_i = _ancestors([g for g in input_outs if isinstance(g, fx.Node)])
    for n in nodes:  # a multi-output node's pieces and a collective's wait stay with it
        if _follows(n) and n not in in_i and all(a in in_i for a in n.all_input_nodes):
            in_i.add(n)
    in_w = _ancestors([g for g in weight_outs if isinstance(g, fx.Node)]) - in_i
    in_w -= set(placeholders)
    # what W reads from outside itself, in graph order
    read = {a for n in in_w for a in n.all_input_nodes if a not in in_w}
    read |= {g for g in weight_outs if isinstance(g, fx.Node) and g not in in_w}
    stash_args = [p for p in placeholders if p in read]
    stash_i = [n for n in nodes if n in read and n.op != "placeholder"]
    assert all(n in in_i for n in stash_i)

    first = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes[:-1]:
        if n.op == "placeholder" or n in in_i:
            env[n] = first.node_copy(n, env.__getitem__)
    first.output(
        tuple(env[g] if isinstance(g, fx.Node) else g for g in input_outs)
        + tuple(env[n] for n in stash_i)
    )
    second = fx.Graph()
    wenv: dict[fx.Node, fx.Node] = {}
    for n in [*stash_args, *stash_i]:
        wenv[n] = second.placeholder(f"stash_{n.name}")
        wenv[n].meta = dict(n.meta)
    for n in nodes[:-1]:
        if n in in_w:
            wenv[n] = second.node_copy(n, wenv.__getitem__)
    second.output(tuple(wenv[g] if isinstance(g, fx.Node) else g for g in weight_outs))
    return SplitBackward(
        fx.GraphModule(gm, first),
        fx.GraphModule(gm, second),
        tuple(placeholders.index(p) for p in stash_args),
        len(input_outs),
    )


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _follows(n: fx.Node) -> bool:
    return n.op == "call_function" and (
        n.target is operator.getitem or "wait_tensor" in str(n.target)
    )


def _call(fn: Callable, args: list) -> list:
    """Call a compiled graph whichever convention its compiler chose (boxed or not)."""
    out = fn(args) if getattr(fn, "_boxed_call", False) else fn(*args)
    return list(out)


class WeightGradients:
    """The W half of a stage's backward, deferred from its I action to its W action."""

    def __init__(self, shards: Callable[[], Sequence[torch.nn.Parameter]]):
        self._shards = shards  # the stage's parameters (read at W: ZeRO may replace them)
        self._queue: list[Callable[[], None]] = []

    def compiler(self, inner: Compiler, n_params: int, n_state: int) -> Compiler:
        """A backward compiler: the graph split (`split_backward`), each half compiled by
        `inner`, the I half run by AOTAutograd and the W half queued."""

        def compile_backward(gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
            split = split_backward(gm, n_params, n_state)
            first = inner(split.input_gm, list(example_inputs))
            stashed = [n for n in split.weight_gm.graph.nodes if n.op == "placeholder"]
            second = inner(split.weight_gm, [n.meta.get("val") for n in stashed])
            n_in, keep = split.n_input_grads, split.stash_args

            def run(args: list) -> list:
                stash = [args[k] for k in keep]
                out = _call(first, args)
                args.clear()  # boxed: the saved activations W does not read go now
                stash += out[n_in:]
                self._queue.append(lambda: self._accumulate(_call(second, stash)))
                return [None] * n_state + out[:n_in]

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_backward

    def builder(self) -> Callable[[], None]:
        """`PipelineStage`'s `dw_builder`: the W runner of the backward that just ran."""
        assert len(self._queue) == 1, f"{len(self._queue)} weight-gradient halves pending"
        return self._queue.pop()

    def _accumulate(self, grads: list) -> None:
        with torch.no_grad():
            for p, g in zip(self._shards(), grads, strict=True):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.detach()
                else:
                    p.grad += g

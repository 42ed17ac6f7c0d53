"""Layer templates: capture a few of a model's identical blocks to stand for all of them.

`capture_template(model, args, loss_fn=None, keep=2) -> Template`

Tracing a 112-block model takes tens of seconds, and the search prices many candidate
meshes and microbatch shapes. Identical blocks cost the same on a given mesh, so the search
captures the model with each block stack cut to its first `keep` blocks (`block_stacks`:
every `nn.ModuleList` whose children are of one class with the same parameter shapes, an
encoder-decoder's two; or all but the first, which T5 gives the relative position bias,
then kept too), and weighs each stack's last captured block by the number of blocks it
stands for (`Template.weights`, used as `CostWeights.layer`). The model is restored before
returning; the stacks are replaced only for the trace (`truncated_blocks`), never copied.

A model whose forward depends on the number of blocks other than by iterating over them
would trace differently: the final plan is made on the whole model's graph, which
`Template.whole_model` builds from the template's traced graph where it shows the
iteration (`autopar.capture.expand`) and three blocks built are blocks 0, 1 and the last
traced (one more trace of three blocks: a forward reading `len(self.layers)`, a last block
unlike the others are traced instead; `autopar.plan` runs that trace in a forked process
beside the final plan's own work, and plans on the trace where it disagrees), else the
caller traces the whole model. An encoder-decoder's graph is built one stack at a time,
its check traces three blocks of each. A plan made on a built graph says so
(`plan.solver["graph"] == BUILT`); `compile` traces, and names the cause where the
fingerprints then differ (`DEPTH_HINT`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from autopar.capture.analysis import layer_order
from autopar.capture.expand import expand_blocks
from autopar.capture.export import (
    Captured,
    CaptureError,
    Traced,
    _WithLoss,
    capture,
    finish,
    layer_of,
    trace,
)
from autopar.forked import Forked, can_fork

TEMPLATE_BLOCKS = 2
TEMPLATE_MIN_BLOCKS = 8  # below, a second capture costs more than the full graph's ILP saves
# a plan's `solver["graph"]` when its graph was built (`Template.whole_model`), not traced
BUILT = "built from the two-block template (autopar.capture.expand)"
DEPTH_HINT = (
    " The plan's graph was built from the model's first two blocks, not traced (autopar.plan"
    " does so for 8+ repeated blocks): if this is the same model, its forward depends on its"
    " depth otherwise than by iterating its blocks; plan it with autopar.compile, which"
    " traces the whole model."
)


@dataclass
class Template:
    captured: Captured
    total_layers: int | None = None  # the full model's blocks, all stacks (None: none cut)
    weights: dict[str, float] = field(default_factory=dict)  # layer name -> blocks it stands for
    # what the search solved on this template, by problem (`autopar.search.template_plan`):
    # the layout search's winner is not solved again for the final plan
    solved: dict[str, object] = field(default_factory=dict, repr=False, compare=False)
    # the template's traced graph before `finish` and each cut stack's (path in the model,
    # blocks, blocks before the repeated ones): what `whole_model` repeats; whether three
    # blocks built are three blocks traced (None: not checked yet)
    traced: Traced | None = field(default=None, repr=False, compare=False)
    stacks: tuple[tuple[str, int, int], ...] = ()
    repeats: bool | None = field(default=None, repr=False, compare=False)
    _check: _Check | None = field(default=None, repr=False, compare=False)

    def whole_model(
        self,
        model: nn.Module,
        args: Sequence[torch.Tensor],
        loss_fn: Callable | None = None,
        confirm_later: bool = False,
    ) -> Captured | None:
        """The graph `capture(model, args, loss_fn)` would trace, built from the template
        (`autopar.capture.expand`); None where the template cannot show it, where three
        blocks built are not three blocks traced (`_repeats`), or where the model, batch or
        loss are not those it was captured with. `confirm_later`: the three-block trace
        runs in a forked process (`autopar.forked`) while the caller plans on the graph,
        which it then confirms (`confirmed`) before it gives the plan out."""
        if self.traced is None or self.total_layers is None:
            return None
        later = confirm_later and self.repeats is None
        if self._check is not None and not self._check.serves(model, loss_fn, args):
            self._check.traced.cancel()  # started for another model or shapes (`adopt`)
            self._check = None
        if later and self._check is None:
            fn = _three_traced(model, self.stacks, args, loss_fn)
            self._check = _Check(model, loss_fn, Forked.start(fn), _shapes(args))
        built = self._built(model, loss_fn)
        if built is None or not _traces(built, model, args):
            if self._check is not None:
                self._check.traced.cancel()
                self._check = None
            return None
        if not later and not (
            self.confirmed() if self._check else self._repeats(model, args, loss_fn)
        ):
            return None
        built.from_template = True
        return built

    def adopt(self, check: _Check | None) -> None:
        """`check` (`start_check`'s, started before this template was captured) as this
        template's three-block check, where it checks this template's stacks."""
        if check is None:
            return
        if check.stacks != self.stacks or self._check:
            check.traced.cancel()
            return
        self._check = check

    def confirmed(self) -> bool:
        """Whether the graph `whole_model(..., confirm_later=True)` built is the model's
        (the three-block check's answer, waited on)."""
        if self._check is not None:
            check, self._check = self._check, None
            self.repeats = self._same(check.model, check.loss_fn, check.traced.result())
        return self.repeats is True

    def _built(
        self, model: nn.Module, loss_fn: Callable | None, three: bool = False
    ) -> Captured | None:
        """The template expanded to the whole model, stack by stack (`three`: to each
        stack's blocks before the repeated ones and three repeated ones)."""
        expanded = self.traced
        for path, blocks, first in self.stacks:
            traced_path = f"model.{path}" if loss_fn is not None else path
            total = first + 3 if three else blocks
            expanded = expanded and expand_blocks(expanded, traced_path, total, first)
        if expanded is None:
            return None
        root = _WithLoss(model, loss_fn) if loss_fn is not None else model
        return finish(expanded, root, loss_fn is not None)

    def _repeats(self, model: nn.Module, args: Sequence, loss_fn: Callable | None) -> bool:
        """Whether the template, expanded to three blocks, is the model traced with blocks
        0, 1 and its last (of each stack, after its blocks before the repeated ones): the
        check that the blocks repeat as block 1 does where the template cannot tell (a
        forward that reads its depth, `aux / len(self.layers)`; a last block unlike the
        others). One trace of three blocks, once per template."""
        if self.repeats is None:
            fn = _three_traced(model, self.stacks, args, loss_fn)
            self.repeats = self._same(model, loss_fn, fn())
        return self.repeats

    def _same(self, model: nn.Module, loss_fn: Callable | None, traced) -> bool:
        """Three blocks built are the three traced (`_three_traced`'s answer)."""
        built = self._built(model, loss_fn, three=True)
        return (
            built is not None
            and traced is not None
            and (built.fingerprint, [n.name for n in built.gm.graph.nodes]) == tuple(traced)
        )


@dataclass
class _Check:
    """The three-block check running beside the plan (`Template.whole_model`)."""

    model: nn.Module
    loss_fn: Callable | None
    traced: Forked
    shapes: tuple  # of the args it traces (`_shapes`)
    stacks: tuple[tuple[str, int, int], ...] = ()  # what it cuts (`start_check`'s)

    def serves(self, model: nn.Module, loss_fn: Callable | None, args: Sequence) -> bool:
        return self.model is model and self.loss_fn is loss_fn and self.shapes == _shapes(args)


IDLE_PRIORITY = 19  # `os.nice` of the check started ahead: it runs on idle cycles


def start_check(model: nn.Module, args: Sequence, loss_fn: Callable | None) -> _Check | None:
    """The three-block check of the template `capture_template(model, args, loss_fn)`
    will capture, started now in a forked process at the lowest priority (None where
    nothing would be cut or no process can be forked). The layout search's first second
    traces its template (twice, on two cores: `capture.rows`) and then prices its degrees
    in as many processes as cores; the check runs on what they leave idle, and alone once
    the final plan waits for it (`Template.adopt`). Started at its turn instead (once the
    pricing was done) it ran ~1 s at the end of Llama-3-8B's 4.4-4.9 s plan; started at
    once at the same priority as the search it slowed the traces as much as it saved."""
    stacks = _cut(model, TEMPLATE_BLOCKS)
    if not stacks or not can_fork():
        return None
    cut = tuple((s.path, len(s.blocks), s.first) for s in stacks)
    fn = _three_traced(model, cut, args, loss_fn)
    return _Check(model, loss_fn, Forked.start(fn, nice=IDLE_PRIORITY), _shapes(args), cut)


def _three_traced(model: nn.Module, stacks, args, loss_fn: Callable | None):
    """What `Template._same` compares of the model traced with blocks 0, 1 and its last of
    each stack (`stacks`: (path, blocks, blocks before the repeated ones, also traced)): a
    function giving its (fingerprint, node names), None where it does not trace so."""

    def traced() -> tuple[str, list[str]] | None:
        try:
            with ExitStack() as cut:
                for path, blocks, first in stacks:
                    kept = (*range(first + 2), blocks - 1)
                    cut.enter_context(truncated_blocks(model, path, kept))
                found = capture(model, args, loss_fn)
        except CaptureError:  # not traceable so: the whole model is traced (and says why)
            return None
        return found.fingerprint, [n.name for n in found.gm.graph.nodes]

    return traced


def _shapes(args: Sequence) -> tuple:
    return tuple(
        (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in args
    )


@dataclass(frozen=True)
class BlockStack:
    """A ModuleList of repeated blocks: its children from `first` on are identical (T5's
    first block alone holds the relative position bias: `first` 1)."""

    path: str
    blocks: nn.ModuleList
    first: int = 0

    def kept(self, keep: int) -> int:
        """The blocks a template of `keep` repeated blocks traces of this stack."""
        return self.first + keep


def block_stacks(model: nn.Module) -> list[BlockStack]:
    """The model's stacks of repeated blocks (an encoder-decoder's two), outside one
    another, largest first."""
    found: list[BlockStack] = []
    for name, module in model.named_modules():  # a stack's own lists come after it
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if any(name.startswith(f"{s.path}.") for s in found):
            continue
        if _identical(module):
            found.append(BlockStack(name, module))
        elif len(module) > 2 and _identical(module[1:]):
            found.append(BlockStack(name, module, first=1))
    return sorted(found, key=lambda s: -len(s.blocks))


def _identical(blocks: Sequence[nn.Module]) -> bool:
    def shape(m: nn.Module):
        return type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())

    first = shape(blocks[0])
    return all(shape(b) == first for b in blocks)


@contextmanager
def truncated_blocks(model: nn.Module, path: str, keep: int | Sequence[int]) -> Iterator[None]:
    """The model with its stack at `path` cut to its first `keep` blocks (or to the blocks
    of those indices, in that order) for the duration."""
    parent_name, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    full = getattr(parent, attr)
    indices = range(keep) if isinstance(keep, int) else keep
    setattr(parent, attr, nn.ModuleList([full[i] for i in indices]))
    try:
        yield
    finally:
        setattr(parent, attr, full)


def template_of(model: nn.Module, batch: Sequence, loss_fn: Callable | None) -> Template | None:
    """The two-block template when the model repeats blocks `TEMPLATE_MIN_BLOCKS` times or
    more (its stacks together), else None."""
    stacks = _cut(model, TEMPLATE_BLOCKS)
    if sum(len(s.blocks) for s in stacks) < TEMPLATE_MIN_BLOCKS:
        return None
    tpl = capture_template(model, batch, loss_fn, keep=TEMPLATE_BLOCKS)
    return tpl if tpl.total_layers is not None else None


def capture_template(
    model: nn.Module,
    args: Sequence,
    loss_fn: Callable | None = None,
    keep: int = 2,
    tracer: Callable | None = None,
) -> Template:
    """The model with each stack cut to its first `keep` repeated blocks, traced on `args`
    (by `tracer(root, args)` when given: the layout search's
    `autopar.capture.rows.AnyRows`, one trace for every microbatch size); each stack's
    last block traced weighted by the blocks it stands for."""
    stacks = _cut(model, keep)
    if not stacks:
        return Template(capture(model, args, loss_fn, tracer))
    root = _WithLoss(model, loss_fn) if loss_fn is not None else model
    with ExitStack() as cut:
        for stack in stacks:
            cut.enter_context(truncated_blocks(model, stack.path, stack.kept(keep)))
        traced = (tracer or trace)(root, args)
        kept = traced.copy()
        captured = finish(traced, root, loss_fn is not None)
    prefix = "model." if loss_fn is not None else ""
    layers = layer_order(captured)
    weights = _stack_weights(captured, layers, stacks, keep, prefix)
    if weights is None:  # a stack is not what forward iterates over: no shortcut, the
        # whole model at any rows
        return Template(capture(model, args, loss_fn, tracer))
    total = len(layers) + round(sum(w - 1 for w in weights.values()))
    if keep != 2 or len(layers) != sum(s.kept(keep) for s in stacks):
        # `expand_blocks` repeats block 1 of two, of stacks that are all the blocks
        return Template(captured, total, weights)
    cut = tuple((s.path, len(s.blocks), s.first) for s in stacks)
    return Template(captured, total, weights, traced=kept, stacks=cut)


def _cut(model: nn.Module, keep: int) -> list[BlockStack]:
    """The stacks a template of `keep` repeated blocks cuts: those longer than that."""
    return [s for s in block_stacks(model) if len(s.blocks) > s.kept(keep)]


def _stack_weights(
    captured: Captured, layers: list[str], stacks: list[BlockStack], keep: int, prefix: str
) -> dict[str, float] | None:
    """Each cut stack's last traced block -> the blocks it stands for; None where the
    traced blocks (in graph order) are not each stack's kept ones in order, computed in
    one run each (stacks run one after the other, an encoder's then a decoder's).
    `layers`: the captured graph's (`layer_order`)."""
    computed = [n for n in captured.gm.graph.nodes if n.op == "call_function"]
    computed = list(dict.fromkeys(filter(None, map(layer_of, computed))))
    weights = {}
    for stack in stacks:
        path = prefix + stack.path
        traced = [name for name in layers if name.rpartition(".")[0] == path]
        if traced != [f"{path}.{i}" for i in range(stack.kept(keep))]:
            return None
        at = computed.index(traced[0]) if traced[0] in computed else -1
        if computed[at : at + len(traced)] != traced:  # interleaved with another stack's:
            return None  # its repeats would not follow its last block traced
        weights[traced[-1]] = float(len(stack.blocks) - stack.kept(keep) + 1)
    return weights


def _traces(captured: Captured, model: nn.Module, args: Sequence[torch.Tensor]) -> bool:
    """`captured` takes `model`'s parameters (names, shapes, dtypes) and `args`' shapes."""
    params = dict(model.named_parameters())
    nodes = {n.name: n for n in captured.placeholders()}
    if set(captured.params.values()) != set(params):
        return False
    for name, fqn in captured.params.items():
        val = nodes[name].meta.get("val")
        if (tuple(val.shape), val.dtype) != (tuple(params[fqn].shape), params[fqn].dtype):
            return False
    inputs = [nodes[name].meta.get("val") for name in captured.user_inputs]
    return len(inputs) == len(args) and all(
        (tuple(v.shape), v.dtype) == (tuple(a.shape), a.dtype)
        for v, a in zip(inputs, args, strict=True)
    )

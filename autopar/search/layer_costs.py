"""What a pipeline's layers cost on one stage mesh, and what a stage of them costs.

`layer_costs(captured, result) -> LayerCosts`: per layer (and the parts before the first
and after the last) its forward + backward time per microbatch, its once-per-step
gradient reductions, state and activation bytes, and what its program runs, under one
intra-op ILP's answer (`IntraOpResult`) on one stage mesh; the stage mesh it was priced on
(`LayerCosts.stage`), and what an activation crossing a stage boundary costs there.
`stage_time(stage, cluster, comm)`: one microbatch's forward and backward programs of a
stage (a range of layers, `layer_range`) as they run with the communication pass.
`StageSpans`: `stage_cuts.balanced_cuts`' price of every range of layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import groupby

from autopar.capture import Captured
from autopar.capture.analysis import batch_dependent, layer_order, layer_parts
from autopar.cluster import Cluster
from autopar.cost_models.buckets import Grad, collective_times
from autopar.cost_models.comm import Collective
from autopar.plan import CommPlan
from autopar.search.crossing import Crossing, crossings
from autopar.search.intra_op import IntraOpResult
from autopar.search.schedules import weight_gradient_work
from autopar.search.shared_params import SharedParam, shared_params
from autopar.search.stage_cuts import range_prices
from autopar.search.step import (
    Part,
    overlapped_time,
    param_itemsize,
    program_parts,
    zero_gather_ratio,
)


@dataclass(frozen=True, slots=True)
class PartCost:
    """One layer (or the part of the graph before/after the layers) on one stage mesh."""

    time: float = 0.0  # forward + backward per microbatch, seconds
    sync: float = 0.0  # parameter-gradient reduction, once per step, seconds (as the ILP)
    state: float = 0.0  # parameters, gradients, optimizer state, bytes
    act: float = 0.0  # saved activations per microbatch, bytes
    grads: tuple[Grad, ...] = ()  # the gradient reductions behind `sync`
    # zero-bubble schedules (`schedules.weight_gradient_work`): the part of `time` their W
    # action runs, seconds, and the bytes held from I to W, per microbatch
    wgrad: float = 0.0
    stash: float = 0.0
    update: float = 0.0  # the optimizer's update of its parameters, once per step, seconds
    # what the stage program runs, for its time with the communication pass (`search.step`)
    program: tuple[Part, ...] = ()

    def __add__(self, other: PartCost) -> PartCost:
        return PartCost.total((self, other))

    @staticmethod
    def total(parts) -> PartCost:
        """The parts summed field by field, in order (`sum(parts, PartCost())`, bit for bit)
        in one pass: each tuple joined once, not once per part (a 96-layer stage joined its
        gradients and program 96 times over)."""
        time = sync = state = act = wgrad = stash = update = 0.0
        grads, program = [], []
        for p in parts:
            time, sync, state, act = time + p.time, sync + p.sync, state + p.state, act + p.act
            wgrad, stash, update = wgrad + p.wgrad, stash + p.stash, update + p.update
            grads.extend(p.grads)
            program.extend(p.program)
        return PartCost(time, sync, state, act, tuple(grads), wgrad, stash, update, tuple(program))


@dataclass(frozen=True)
class LayerCosts:
    layers: tuple[str, ...]
    parts: tuple[PartCost, ...]  # per layer
    pre: PartCost  # outside the layers, before the first (embedding)
    post: PartCost  # after the last layer (final norm, head, loss)
    # per layer, what a stage cut before it carries (placed, scattered; index 0: no cut)
    crossings: tuple[Crossing, ...]
    comm: CommPlan | None = None  # the stage programs' communication pass (None: none)
    # ZeRO: bytes the all-gathers after the optimizer step move (the working parameters,
    # `runtime.optimizer.ParamState`) per gradient byte reduced; 0: no ZeRO
    zero: float = 0.0
    # the once-per-step reduction runs in another dtype than the gradients: its sums are
    # cast back into them (`runtime.stage_grads`; else they are the buffer's slices)
    cast_back: bool = False
    stage: Cluster | None = None  # the stage mesh priced on (None: the pipeline's stage mesh)
    # the parameters more than one part reads (`search.shared_params`): every stage reading
    # one holds a copy; their gradients are summed over pp after the schedule
    shared: tuple[SharedParam, ...] = ()

    @property
    def time(self) -> list[float]:
        return [p.time for p in self.parts]

    def repeated(self, weights: Mapping[str, float]) -> LayerCosts:
        """A template's costs stretched to the full model: each weighted layer (a stack's
        last captured block, `Template.weights`) repeated in place for the blocks it stands
        for, named as they are (`layers.1` standing for 3: `layers.1`, `layers.2`,
        `layers.3`); they are identical."""
        if all(weights.get(name, 1.0) <= 1.0 for name in self.layers):
            return self
        layers, parts, cuts, expanded = [], [], [], {}
        for name, part, cut in zip(self.layers, self.parts, self.crossings, strict=True):
            prefix, _, index = name.rpartition(".")
            copies = round(weights.get(name, 1.0))
            expanded[name] = (name, *(f"{prefix}.{int(index) + k}" for k in range(1, copies)))
            layers += expanded[name]
            parts += [part] * copies
            cuts += [cut] * copies  # a cut before block k > 1 carries what one before 1 does
        shared = tuple(p.expanded(expanded) for p in self.shared)
        return replace(
            self, layers=tuple(layers), parts=tuple(parts), crossings=tuple(cuts), shared=shared
        )


def layer_costs(captured: Captured, result: IntraOpResult) -> LayerCosts:
    layers = layer_order(captured)
    # with the pass, each part's program (unweighted: `repeated` copies the layers)
    program = [
        (replace(p, weight=1.0),) if result.comm is not None else ()
        for p in program_parts(captured, result)
    ]
    parts = [PartCost(program=p) for p in program[1:-1]]
    pre, post = PartCost(program=program[0]), PartCost(program=program[-1])
    part_of = layer_parts(captured)  # as a pipeline runs them
    batch = batch_dependent(captured)
    for n in captured.gm.graph.nodes:
        if n not in result.chosen or n.op == "output":
            continue
        time, sync = result.node_times(n)
        mem = result.node_memory(n)
        state = n.op == "placeholder" or n not in batch
        held = result.held_weights(n)  # gathered weights kept until backward: once per stage
        grads = tuple(g for pos, op in result.ctx.operands(n) for g in _grads(result, n, pos, op))
        w = weight_gradient_work(result.ctx, n, result.chosen[n])
        cost = PartCost(time, sync, (mem if state else 0.0) + held, 0.0 if state else mem,
                        grads, *w, update=result.ctx.update_time(n, result.chosen[n]))  # fmt: skip
        i = part_of[n]
        if i == 0:
            pre += cost
        elif i > len(parts):
            post += cost
        else:
            parts[i - 1] += cost
    zero, cast = zero_gather_ratio(captured, result), result.ctx.reduce_itemsize
    cast_back = bool(cast) and cast != param_itemsize(captured)
    cross = crossings(captured, result)
    return LayerCosts(
        tuple(layers),
        tuple(parts),
        pre,
        post,
        cross,
        result.comm,
        zero,
        cast_back,
        result.ctx.cluster,
        shared_params(captured, result, cast if cast and not zero else None),
    )


def _grads(result: IntraOpResult, n, pos: int, op) -> list[Grad]:
    src = result.ctx.output_spec(op, result.chosen[op.producer])
    return result.ctx.grad_reductions(op, src, n, result.chosen[n], pos)


def stage_parts(lc: LayerCosts, cuts: tuple[int, ...]) -> list[PartCost]:
    bounds = [*cuts, len(lc.layers)]
    return [layer_range(lc, bounds[s], bounds[s + 1]) for s in range(len(cuts))]


def layer_range(lc: LayerCosts, first: int, end: int) -> PartCost:
    """A stage of layers first..end-1 (with what precedes the first layer / follows the
    last when it holds them)."""
    total = PartCost.total(lc.parts[first:end])
    if first == 0:
        total = lc.pre + total
    if end == len(lc.layers):
        total += lc.post
    return total


class StageSpans:
    """`balanced_cuts`' price of a stage of layers i..j-1 (`span(i, j)`): `stage_time`, what
    the schedule is priced with (overlap does not add up layer by layer: a stage's first
    gather and last gradient bucket are exposed). A template's repeated layers are one
    object, so ranges of them that hold as many are priced once; `prices()`, the table of
    every range, is made once for the schedules priced on the same costs."""

    def __init__(self, lc: LayerCosts, cluster: Cluster):
        self.lc, self.cluster, self.n = lc, cluster, len(lc.layers)
        self.seen: dict[tuple, float] = {}
        self.table = None
        # same[i]: the end of the run of lc.parts[i]'s object
        self.same = list(range(1, self.n + 1))
        for i in reversed(range(self.n - 1)):
            if lc.parts[i] is lc.parts[i + 1]:
                self.same[i] = self.same[i + 1]

    def __call__(self, i: int, j: int) -> float:
        lc, n = self.lc, self.n
        key = (i == 0, j == n, id(lc.parts[i]), j - i) if j <= self.same[i] else (i, j)
        if key not in self.seen:
            self.seen[key] = stage_time(layer_range(lc, i, j), self.cluster, lc.comm)
        return self.seen[key]

    def prices(self):
        if self.table is None:
            self.table = range_prices(self.lc.time, self)
        return self.table


def reduced_per_step(grad: Grad) -> bool:
    """Whether a stage reduces `grad` once per step, from its last backward: a replicated
    parameter's all-reduce, left partial (`runtime.pipeline._DeferGradSync`) for
    `GradientSync`. Every other gradient collective (a sharded parameter's reduce-scatter)
    runs in each microbatch's backward program (its parameter is not deferred)."""
    return Collective(grad[1]) is Collective.ALL_REDUCE


def stage_time(stage: PartCost, cluster: Cluster, comm: CommPlan | None) -> float:
    """Seconds of one microbatch's forward and backward programs of `stage` on the stage
    mesh `cluster`, with the gradient collectives those programs run (a sharded
    parameter's reduce-scatter, every microbatch; not the all-reduces `reduced_per_step`
    leaves to a stage's last backward): with the communication pass, its gathers fused per
    layer and prefetched, its gradients bucketed behind the backward, its waits at first
    use (`search.step.overlapped_time`); without it, every collective waited at once, one
    per tensor (the ILP's)."""
    if comm is None or not stage.program:
        return stage.time + collective_times(_in_program(stage.grads), cluster, fused=False)
    # a template's repeated layer (one object) as one part of that weight: the same price
    runs = [list(run) for _, run in groupby(stage.program, key=id)]
    program = [
        replace(r[0], weight=r[0].weight * len(r), grads=_in_program(r[0].grads)) for r in runs
    ]
    return overlapped_time(program, cluster, comm)


def _in_program(grads) -> list[Grad]:
    return [g for g in grads if not reduced_per_step(g)]

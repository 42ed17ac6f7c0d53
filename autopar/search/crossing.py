"""What an activation crossing a pipeline stage boundary costs, placed or scattered.

`crossings(captured, result) -> (Crossing per layer)` prices what a stage cut before each
layer carries (`passes.stages` sends it: the residual stream, the targets forwarded to the
loss, an encoder's output inside the decoder), each value as the pipeline runtime moves it
(`runtime.pipeline.boundary_spec`), both ways `PipelinePlan.boundary` names:

- "placed": the producer's output placement, a Partial reduced; each rank sends its local
  shard to its peer in the next stage.
- "scattered": the same placement split over the stage mesh's replicated axes too
  (`plan.scattered_spec`): each rank sends 1/n of what it sends placed. The sending stage
  redistributes into that spec (a local chunk from Replicate, a reduce-scatter instead of
  an all-reduce from a Partial) and its backward gathers the gradient back; the receiving
  stage's consumers redistribute from it (an all-gather where they read it replicated)
  and their gradients into it (a reduce-scatter where an all-reduce was).

- "canonical": split on one dim over all the stage's devices (`plan.canonical_spec`), what
  stage meshes of different shapes exchange (`search.stage_meshes`): priced as scattered.

`Crossing` holds the bytes each way sends and the seconds the scattered (and the canonical)
way adds (or saves) per microbatch to a receiving and a sending stage's forward and
backward, against the placed way's, summed over the values crossing one cut: the
redistributions priced by the ILP's own `CostContext` on the stage mesh. Where scattering sends less and stages sit on different
ranks, `inter_op.price_schedule` simulates the schedule both ways and keeps the faster (the
messages it shortens may lie off the critical path, the redistributions on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.capture import Captured
from autopar.capture.analysis import batch_dependent, layer_order, layer_parts
from autopar.cost_models.memory import local_numel
from autopar.cost_models.reshard import reshard_seconds
from autopar.passes.strategies import summed_spec
from autopar.plan import canonical_spec, scattered_spec


@dataclass(frozen=True, slots=True)
class Crossing:
    placed_bytes: float = 0.0  # what one rank sends placed, per microbatch
    scattered_bytes: float = 0.0  # what one rank sends scattered
    # seconds scattering adds per microbatch (negative: saves), on the stage that receives
    # and on the one that sends, forward and backward
    receive: tuple[float, float] = (0.0, 0.0)
    send: tuple[float, float] = (0.0, 0.0)
    canonical_bytes: float = 0.0  # what one rank sends canonical
    canonical: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))

    def __add__(self, other: Crossing) -> Crossing:
        """Two values crossing one cut: what each sends and adds, summed."""

        def plus(a: tuple, b: tuple) -> tuple:
            pairs = zip(a, b, strict=True)
            return tuple(plus(x, y) if isinstance(x, tuple) else x + y for x, y in pairs)

        return Crossing(
            self.placed_bytes + other.placed_bytes,
            self.scattered_bytes + other.scattered_bytes,
            plus(self.receive, other.receive),
            plus(self.send, other.send),
            self.canonical_bytes + other.canonical_bytes,
            plus(self.canonical, other.canonical),
        )

    def sent(self, boundary: str) -> float:
        """What one rank sends per microbatch the `boundary` way."""
        return {
            "placed": self.placed_bytes,
            "scattered": self.scattered_bytes,
            "canonical": self.canonical_bytes,
        }[boundary]

    def adds(self, boundary: str) -> tuple[tuple[float, float], tuple[float, float]]:
        """(receive, send): seconds the `boundary` way adds to a receiving and a sending
        stage's (forward, backward) per microbatch, against the placed way."""
        if boundary == "scattered":
            return self.receive, self.send
        if boundary == "canonical":
            return self.canonical
        return (0.0, 0.0), (0.0, 0.0)

    @property
    def can_scatter(self) -> bool:
        """Scattering sends less, and the runtime can redistribute both ways."""
        finite = all(math.isfinite(t) for t in (*self.receive, *self.send))
        return finite and self.scattered_bytes < self.placed_bytes


def crossings(captured: Captured, result) -> tuple[Crossing, ...]:
    """Per layer, what a stage cut before it carries under `result` (an `IntraOpResult` on
    the stage mesh; index 0: no cut): as the stage split sends (`passes.stages`), every
    value computed from the batch (and the batch itself) that a node at or after the cut
    reads and a node before it made (a node outside the layers on the stage of its part,
    `capture.analysis.layer_parts`). A decoder's cut carries the residual stream (and the targets, forwarded to
    the loss); an encoder-decoder's, inside the decoder, the encoder's output too."""
    layers = layer_order(captured)
    part_of, last = layer_parts(captured), len(layers) - 1
    batch = batch_dependent(captured)
    where: dict[fx.Node, int] = {}  # the layer (stage position) each batch value is made at
    spans = []
    for n in captured.gm.graph.nodes:
        if n not in batch or n not in result.chosen:
            continue
        # the batch enters the first stage; before the first layer and after the last run
        # with them
        where[n] = 0 if n.op == "placeholder" else min(max(part_of[n] - 1, 0), last)
        if n.op == "placeholder" or isinstance(n.meta.get("val"), torch.Tensor):
            spans.append(n)
    out = [Crossing() for _ in layers]
    for n in spans:
        last = max((where[u] for u in n.users if u in where), default=where[n])
        passing = None  # crossing a cut no reader follows (the targets: priced once)
        for cut in range(where[n] + 1, last + 1):
            readers = {u for u in n.users if where.get(u) == cut}
            if readers:
                out[cut] = out[cut] + _priced(n, readers, result)
                continue
            passing = passing or _priced(n, readers, result)
            out[cut] = out[cut] + passing
    return tuple(out)


def _priced(value: fx.Node, readers: set[fx.Node], result) -> Crossing:
    """`value` crossing a cut, its `readers` on the receiving stage."""
    v = value.meta["val"]
    shape, size = tuple(v.shape), v.element_size()
    if value not in result.chosen:
        whole = float(v.numel() * size)
        return Crossing(whole, whole, canonical_bytes=whole)
    ctx = result.ctx
    out = tuple(result.chosen[value].outputs[0])
    placed = summed_spec(out)
    scattered = scattered_spec(placed, shape, ctx.mesh_shape)
    canonical = canonical_spec(shape, math.prod(ctx.mesh_shape), len(ctx.mesh_shape))

    def sent(spec) -> float:
        return float(local_numel(shape, spec, ctx.mesh_shape) * size)

    receive, send = _adds(value, readers, result, out, placed, scattered)
    return Crossing(
        sent(placed),
        sent(scattered),
        receive,
        send,
        sent(canonical),
        _adds(value, readers, result, out, placed, canonical),
    )


def _adds(value: fx.Node, readers: set[fx.Node], result, out, placed, crossing) -> tuple:
    """((receive fwd, bwd), (send fwd, bwd)): seconds `value` crossing as `crossing`
    rather than `placed` adds to the stages on either side, per microbatch."""
    if crossing == placed:
        return (0.0, 0.0), (0.0, 0.0)
    v = value.meta["val"]
    shape, size = tuple(v.shape), v.element_size()
    ctx = result.ctx
    cluster = ctx.cluster
    send_fwd = reshard_seconds(cluster, out, crossing, shape, size) - reshard_seconds(
        cluster, out, placed, shape, size
    )
    send_bwd = reshard_seconds(cluster, crossing, placed, shape, size)  # the gradient back
    recv_fwd = recv_bwd = 0.0
    for user in value.users:
        if user not in readers or user not in result.chosen:
            continue
        s = result.chosen[user]
        for pos, op in ctx.operands(user):
            if op.producer is value:
                f1, b1 = ctx.edge_parts(op, crossing, user, s, pos)
                f0, b0 = ctx.edge_parts(op, placed, user, s, pos)
                recv_fwd, recv_bwd = recv_fwd + f1 - f0, recv_bwd + b1 - b0
    return (recv_fwd, recv_bwd), (send_fwd, send_bwd)

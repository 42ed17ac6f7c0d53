"""What an activation crossing a pipeline stage boundary costs, placed or scattered.

`crossing(captured, result) -> Crossing` prices the residual stream entering the second
layer (what every stage cut carries) as the pipeline runtime moves it
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
backward, against the placed way's: the redistributions priced by the ILP's own
`CostContext` on the stage mesh. Where scattering sends less and stages sit on different
ranks, `inter_op.price_schedule` simulates the schedule both ways and keeps the faster (the
messages it shortens may lie off the critical path, the redistributions on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.capture import Captured
from autopar.capture.analysis import layer_order
from autopar.capture.export import layer_of
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


def crossing(captured: Captured, result) -> Crossing:
    """The residual stream's crossing (layer 0's output read by layer 1) under `result`
    (an `IntraOpResult` on the stage mesh); nothing where fewer than two layers."""
    layers = layer_order(captured)
    if len(layers) < 2:
        return Crossing()
    for n in captured.gm.graph.nodes:
        if layer_of(n) == layers[1]:
            for a in n.all_input_nodes:
                if layer_of(a) == layers[0] and isinstance(a.meta.get("val"), torch.Tensor):
                    return _priced(a, layers[1], result)
    return Crossing()


def _priced(value: fx.Node, reader: str, result) -> Crossing:
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

    receive, send = _adds(value, reader, result, out, placed, scattered)
    return Crossing(
        sent(placed),
        sent(scattered),
        receive,
        send,
        sent(canonical),
        _adds(value, reader, result, out, placed, canonical),
    )


def _adds(value: fx.Node, reader: str, result, out, placed, crossing) -> tuple:
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
        if layer_of(user) != reader or user not in result.chosen:
            continue
        s = result.chosen[user]
        for pos, op in ctx.operands(user):
            if op.producer is value:
                f1, b1 = ctx.edge_parts(op, crossing, user, s, pos)
                f0, b0 = ctx.edge_parts(op, placed, user, s, pos)
                recv_fwd, recv_bwd = recv_fwd + f1 - f0, recv_bwd + b1 - b0
    return (recv_fwd, recv_bwd), (send_fwd, send_bwd)

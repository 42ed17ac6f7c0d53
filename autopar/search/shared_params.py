"""Parameters several parts of a pipelined model read, priced as the pipeline holds them.

A parameter read by more than one part of the model (an embedding tied to the head: the
part before the first layer and the one after the last; an encoder-decoder's shared
embedding, read again where the decoder starts, in the middle) is held by every stage that
reads it: `passes.stages` copies its weight-only readers into each, every copy with its
gradient and optimizer states, and after the schedule the copies' gradients are summed over
the pipeline axis, one all-reduce per parameter, non-holders adding zeros
(`runtime.pipeline_model._sync_tied_grads`; of the local shards, or of whole gradients where
the pipeline ranks' stage meshes differ in shape, each holder first gathering its own).

`shared_params(captured, result, itemsize) -> tuple[SharedParam, ...]` records each such
parameter once per stage mesh (`LayerCosts.shared`); `stage_copies(costs, cuts)` gives what
each stage holds beyond what its parts count (`PartCost.state` counts a parameter in one
part, its first reader's), and `shared_sum_seconds` the all-reduces after the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch.distributed.tensor import Replicate

from autopar.capture import Captured
from autopar.capture.analysis import batch_dependent, layer_order, layer_parts
from autopar.cluster import Cluster
from autopar.cost_models.comm import Collective, collective_time
from autopar.cost_models.memory import local_numel
from autopar.cost_models.reshard import reshard_seconds

PRE, POST = "<pre>", "<post>"  # the parts before the first layer and after the last


@dataclass(frozen=True, slots=True)
class SharedParam:
    """One parameter that more than one part reads, on one stage mesh."""

    name: str
    readers: frozenset[str]  # the parts reading it: layer names, `PRE`, `POST`
    home: str  # the part whose `PartCost.state` counts it (its first reader's)
    state: float  # bytes a holding rank keeps: parameter, gradient, optimizer states
    update: float  # seconds of its optimizer update
    local: float  # gradient bytes of the all-reduce over pp (the local shard)
    whole: float  # the whole gradient's bytes
    gather: float  # seconds of gathering the whole gradient on the stage mesh

    def expanded(self, copies: dict[str, tuple[str, ...]]) -> SharedParam:
        """Read by every copy of a repeated layer it reads (`LayerCosts.repeated`)."""
        readers = frozenset(c for r in self.readers for c in copies.get(r, (r,)))
        return replace(self, readers=readers)


def shared_params(captured: Captured, result, itemsize: int | None) -> tuple[SharedParam, ...]:
    """The parameters read (through weight-only nodes) by the batch-dependent nodes of more
    than one part (`capture.analysis.layer_parts`), under `result`'s placements.
    `itemsize`: the reduced gradients' (None: the parameters')."""
    batch, part_of = batch_dependent(captured), layer_parts(captured)
    layers = layer_order(captured)
    names = [PRE, *layers, POST]
    where = {
        n: part_of[n] for n in captured.gm.graph.nodes if n.op == "call_function" and n in batch
    }
    ctx, found = result.ctx, []
    for p in captured.placeholders():
        if p.name not in captured.params or p not in result.chosen:
            continue
        parts, frontier = set(), [p]
        while frontier:
            for user in frontier.pop().users:
                if user in where:
                    parts.add(where[user])
                elif user.op == "call_function":
                    frontier.append(user)
        if len(parts) < 2:
            continue
        val, spec = p.meta["val"], result.chosen[p].outputs[0]
        size = itemsize or val.element_size()
        whole = val.numel() * size
        everywhere = (Replicate(),) * len(spec)
        found.append(
            SharedParam(
                captured.params[p.name],
                frozenset(names[i] for i in parts),
                names[part_of[p]],
                result.node_memory(p),
                ctx.update_time(p, result.chosen[p]),
                local_numel(tuple(val.shape), spec, ctx.mesh_shape) * size,
                whole,
                reshard_seconds(ctx.cluster, tuple(spec), everywhere, val.shape, size),
            )
        )
    return tuple(found)


def stage_part_names(layers: Sequence[str], cuts: Sequence[int]) -> list[frozenset[str]]:
    """The parts each stage of `cuts` runs (the first also `PRE`, the last `POST`)."""
    bounds = [*cuts, len(layers)]
    out = []
    for s in range(len(cuts)):
        names = set(layers[bounds[s] : bounds[s + 1]])
        names |= {PRE} if bounds[s] == 0 else set()
        names |= {POST} if bounds[s + 1] == len(layers) else set()
        out.append(frozenset(names))
    return out


def stage_copies(costs: Sequence, cuts: Sequence[int]) -> list[tuple[float, float]]:
    """Per stage (`costs[s]`: stage s's `LayerCosts`): (bytes, update seconds) of the shared
    parameters it reads whose state its parts do not count (their first reader is another
    stage's): each holding stage keeps its own copy."""
    if not costs[0].shared:  # most models: no stage's names made (a schedule's hot path)
        return [(0.0, 0.0)] * len(cuts)
    parts = stage_part_names(costs[0].layers, cuts)
    out = []
    for s, names in enumerate(parts):
        held = [p for p in costs[s].shared if p.readers & names and p.home not in names]
        out.append((sum(p.state for p in held), sum(p.update for p in held)))
    return out


def shared_sum_seconds(
    costs: Sequence, cuts: Sequence[int], ranks: Sequence[int], cluster: Cluster
) -> float:
    """Seconds of the all-reduces over pp that sum the shared parameters' gradients after
    the schedule (stage s on pipeline rank `ranks[s]`): one per parameter that more than
    one stage holds, of its local shard; where the ranks' stage meshes differ, of the whole
    gradient, after each holding rank has gathered its copies' (the slowest waited)."""
    if not costs[0].shared or len(cuts) < 2:
        return 0.0
    parts = stage_part_names(costs[0].layers, cuts)
    axis = cluster.axis_names.index("pp")
    uniform = len({id(c) for c in costs}) == 1
    total = 0.0
    for i, p in enumerate(costs[0].shared):
        holders = [s for s, names in enumerate(parts) if p.readers & names]
        if len(holders) < 2:
            continue
        if uniform:
            total += collective_time(Collective.ALL_REDUCE, p.local, axis, cluster)
            continue
        gathered = dict.fromkeys((ranks[s] for s in holders), 0.0)
        for s in holders:
            gathered[ranks[s]] += costs[s].shared[i].gather
        total += max(gathered.values()) + collective_time(
            Collective.ALL_REDUCE, p.whole, axis, cluster
        )
    return total

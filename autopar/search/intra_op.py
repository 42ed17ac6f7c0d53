"""Intra-op search: from the captured graph and its strategies to one strategy per node.

`search_plan(captured, cluster, mesh, options) -> Plan`

Building the ILP (`autopar.search.ilp` holds the formulation itself):

1. `build_decisions` (`autopar.search.decisions`) — one *decision* per node, except *followers*: a node with one tensor
   operand (`autopar.capture.operands`) which has, for every choice of that operand's
   producer, a strategy taking the operand as it is (views, permutes, unary elementwise,
   and every getitem of a multi-output node: its strategies are the producer's, one to
   one). A follower adds its cost and memory to the producer's decision and costs no
   resharding. Every other node is a decision *head*: each of its tensor operands is an
   edge (`IntraOpResult.priced` names the heads). Pins (strategy="dp"/"fsdp"/"tp",
   per-parameter overrides) restrict the choices of placeholders before this step.
2. `share_layers` — decisions of repeated layers (same `nn_module_stack` block structure,
   same strategies) map onto the first such layer's decisions, so a 96-layer model solves
   like a one-layer one; their costs and memories add up on the shared decision.
3. `price` — node cost = roofline time of forward + backward on the strategy's share of the
   work (a parameter's: the optimizer's update of its local shard, once per step,
   `cost_models.optimizer`); edge cost = forward redistribution producer-output ->
   consumer-input plus its backward transpose (a Replicate input of a split computation receives a Partial
   gradient: that is where DP's all-reduce and FSDP's reduce-scatter are priced);
   memory = parameters + gradients + optimizer state of local shards, plus saved
   activations.
4. `add_levers` (`autopar.search.levers`) — per shared layer, a recompute decision
   (none/selective/full) and a reshard-after-forward decision, priced jointly with the
   sharding; pinned by `activation_checkpointing=` / `reshard_after_forward=`.

Ranking (`solve_intra` with `comm`, the program's communication pass `plan.CommPlan`): the
ILP stays linear, every collective waited at once (an upper bound on the step), and the
candidates are compared by the step as the runtime runs it (`search.step`, the overlap of
`passes.comm`), which is `IntraOpResult.step_time`. Candidates:

- the ILP's optimum for each pair of scales in `COMM_SCALES` of the weight edges' costs
  (gathers: the FSDP all-gathers and their re-gathers; gradient reductions: what the pass
  overlaps; (1, 1) is the plain bound, smaller ones ask for the plan that leans on the
  overlap: prefetched gathers hide but the first, a bucketed reduction hides but its tail;
  and `DP_SCALES`, DP's, where gathers are dearer per byte than all-reduces);
- each of those with its levers swapped, the same choice on every layer, for every lever
  choice the pins allow whose memory fits (`ilp_problem.evaluate`).

Every candidate fits the memory limit. The fastest wins (ties: the earliest, i.e. the
plain ILP's); `objective` is always its unscaled ILP objective, the bound. Without `comm`
(pipeline stages, which run no pass) the ILP's optimum is the only candidate and its step
time is the objective.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.capture.analysis import batch_dependent
from autopar.capture.export import layer_of
from autopar.cluster import Cluster
from autopar.passes.strategies import NodeStrategy, enumerate_strategies
from autopar.plan import DEFAULT_COMM, CommPlan, MemoryPlan, Plan
from autopar.search import ahead
from autopar.search.costs import CostContext, CostWeights
from autopar.search.decisions import Decisions, build_decisions, share_layers  # noqa: F401
from autopar.search.ilp import (
    Edge,
    IntraOpProblem,
    IntraOpSolution,
    MemoryInfeasible,
    SolverTimeout,
    evaluate,
    solve_all,
)
from autopar.search.levers import (
    CHOICES,
    WEIGHT_NOT_SAVED,
    Levers,
    add_levers_at_scales,
    gathered_bytes,
    layer_summary,
)
from autopar.search.pins import SearchOptions, apply_pins
from autopar.search.progress import phase
from autopar.search.step import predicted_step_time
from autopar.search.to_plan import assemble_plan

# (gather, gradient reduction) cost scales of the weight edges in the ILPs whose optima are
# ranked by the overlapped step: the bound; gathers prefetched (hidden but the first) with
# the gradients' tail exposed; both mostly hidden
COMM_SCALES: tuple[tuple[float, float], ...] = ((1.0, 1.0), (0.1, 1.0), (0.1, 0.1))
# and where a link moves a gather's bytes slower than an all-reduce's (gloo): the
# reductions mostly hidden and the gathers not, DP's plan, which the bound can rank below
# plans whose activation collectives never overlap
DP_SCALES = (1.0, 0.1)
SLOW_LATENCY = 1e-4  # seconds per ring step: NCCL's are ~5-20 us, gloo's on a CPU ~1 ms


def price(
    dec: Decisions, rep: list[int], strats, ctx: CostContext, memory_limit: float,
    time_limit_s: float, comm_scale: tuple[float, float] = (1.0, 1.0),
) -> tuple[IntraOpProblem, list[int]]:  # fmt: skip
    """The ILP of the decisions; `comm_scale` multiplies the weight edges' forward (gather)
    and backward (gradient reduction) costs."""
    return price_scales(dec, rep, strats, ctx, memory_limit, time_limit_s, (comm_scale,))[0]


def price_scales(
    dec: Decisions, rep: list[int], strats, ctx: CostContext, memory_limit: float,
    time_limit_s: float, scales: tuple[tuple[float, float], ...],
) -> list[tuple[IntraOpProblem, list[int]]]:  # fmt: skip
    """`price` at each of `scales`: the node prices and the edges' terms are read once."""
    reps = sorted(set(rep))
    index = {r: i for i, r in enumerate(reps)}
    cost = [[0.0] * dec.items[r].num_choices for r in reps]
    mem = [[0.0] * dec.items[r].num_choices for r in reps]
    for d, item in enumerate(dec.items):
        i = index[rep[d]]
        for n, mapping in item.members:
            for c, j in enumerate(mapping):
                once = ctx.weights.sync * ctx.update_time(n, s := strats[n][j])  # optimizer
                cost[i][c] += ctx.weights.of(n) * (ctx.node_cost(n, s) + once)
                mem[i][c] += ctx.weighted_memory(n, s)
    node_cost = tuple(tuple(r) for r in cost)
    node_memory = tuple(tuple(r) for r in mem)
    terms = _edge_terms(dec, rep, index, strats, ctx)
    var_of = [index[r] for r in rep]
    return [
        (
            IntraOpProblem(node_cost, node_memory, _edges(terms, s), memory_limit, time_limit_s),
            var_of,
        )
        for s in scales
    ]


def _edge_terms(dec: Decisions, rep, index, strats, ctx: CostContext) -> list[tuple]:
    """Per operand edge, in order: (ILP pair, weight or not, its weight, gradient syncs and
    (forward, backward) parts per choice pair)."""
    terms = []
    for d, item in enumerate(dec.items):
        v_node, v_map = item.members[0]
        for pos, op in ctx.operands(v_node):
            du, map_u = dec.owner[op.producer]
            key = (index[rep[du]], index[rep[d]])
            srcs = [ctx.output_spec(op, strats[op.producer][ju]) for ju in map_u]
            ss = [strats[v_node][jv] for jv in v_map]
            weight = ctx.is_weight(op.producer)  # as `CostContext.weighted_edge_cost` counts
            syncs = ctx.edge_sync_matrix(op, srcs, v_node, ss, pos)
            parts_of = ctx.edge_part_matrices(op, srcs, v_node, ss, pos)
            terms.append((key, weight, ctx.weights.of(v_node), syncs, parts_of))
    return terms


def _edges(terms: list[tuple], scale: tuple[float, float]) -> tuple[Edge, ...]:
    """The edges at `scale`, which scales a weight edge's forward and backward parts."""
    acc: dict[tuple[int, int], list[list[float]]] = {}
    for key, weight, w, syncs, parts_of in terms:
        scaled = scale != (1.0, 1.0) and weight
        mat = acc.setdefault(key, [[0.0] * len(parts_of[0]) for _ in parts_of])
        for row, parts, sync_row in zip(mat, parts_of, syncs, strict=True):
            for cv, ((fwd, bwd), sync) in enumerate(zip(parts, sync_row, strict=True)):
                if scaled:
                    row[cv] += w * (scale[0] * fwd + scale[1] * sync * bwd)
                else:
                    row[cv] += w * (fwd + sync * bwd)
    return tuple(Edge(u, v, tuple(tuple(r) for r in m)) for (u, v), m in acc.items())


@dataclass
class IntraOpResult:
    """The ILP's answer with what is needed to price parts of the graph afterwards."""

    chosen: dict[fx.Node, NodeStrategy]
    ctx: CostContext
    objective: float
    memory: float
    info: dict
    priced: frozenset[fx.Node]  # decision heads: every tensor operand is an ILP edge
    levers: Levers | None = None
    recompute: dict[str, str] = field(default_factory=dict)  # layer -> recompute policy
    reshard: dict[str, bool] = field(default_factory=dict)  # layer -> reshard after forward
    memory_plan: tuple[tuple, tuple] = ((), ())  # (MemoryPlan.recompute, reshard_after_forward)
    step_time: float = math.nan  # the step as the runtime runs it (module docstring)
    comm: CommPlan | None = None  # the communication pass the program runs (`passes.comm`)

    def recomputed(self, n: fx.Node) -> bool:
        """Whether `n`'s output is recomputed in backward under its layer's policy."""
        return self.levers is not None and self.levers.is_recomputed(n, self.recompute)

    def regathers(self, n: fx.Node) -> bool:
        """Whether the weights `n` gathers are freed after forward and gathered again."""
        layer = layer_of(n)
        return layer is not None and (
            self.reshard.get(layer, False) or self.recompute.get(layer) == "full"
        )

    def update_time(self) -> float:
        """The optimizer step's seconds: every parameter's update, weighted as its layer."""
        weight, update = self.ctx.weights.of, self.ctx.update_time
        return sum(weight(n) * update(n, s) for n, s in self.chosen.items())

    def node_time(self, n: fx.Node) -> float:
        """Compute plus the resharding of its inputs (forward and backward), seconds."""
        return sum(self.node_times(n))

    def node_times(self, n: fx.Node) -> tuple[float, float]:
        """(per microbatch: compute and activation resharding, forward and backward, and
        what the levers run again; per step: the reduction of parameter gradients), seconds,
        unweighted (`autopar.search.levers` prices the same terms in the ILP)."""
        s = self.chosen[n]
        total, sync = self.ctx.node_cost(n, s), 0.0
        again = self.recomputed(n)
        if again:
            total += self.ctx.forward_time(n, s)
        full = again and self.recompute.get(layer_of(n)) == "full"
        for pos, op in self.ctx.operands(n):
            src = self.ctx.output_spec(op, self.chosen[op.producer])
            fwd, bwd = self.ctx.edge_parts(op, src, n, s, pos)
            if self.ctx.is_weight(op.producer):
                total, sync = total + fwd, sync + bwd
                if self._gathered(n, op, fwd) and self.regathers(n):
                    total += fwd
            else:
                total += fwd + bwd + (fwd if full else 0.0)
        return total, sync

    def _gathered(self, n: fx.Node, op, fwd: float) -> bool:
        return 0 < fwd < math.inf and n.target not in WEIGHT_NOT_SAVED and op.tensor is not None

    def node_memory(self, n: fx.Node) -> float:
        """Bytes `n` holds (0 for an output recomputed in backward), unweighted."""
        return 0.0 if self.recomputed(n) else self.ctx.node_memory(n, self.chosen[n])

    def held_weights(self, n: fx.Node) -> float:
        """Bytes of the weight copies gathered for `n` and kept until backward."""
        if self.regathers(n):
            return 0.0
        s, total = self.chosen[n], 0.0
        for pos, op in self.ctx.operands(n):
            if self.ctx.is_weight(op.producer):
                src = self.ctx.output_spec(op, self.chosen[op.producer])
                if self._gathered(n, op, self.ctx.edge_parts(op, src, n, s, pos)[0]):
                    total += gathered_bytes(op, s, pos, self.ctx)
        return total


def solve_intra(
    captured: Captured,
    cluster: Cluster,
    mesh: DeviceMesh,
    options: SearchOptions | None = None,
    weights: CostWeights | None = None,
    memory_limit: float | None = None,
    comm: CommPlan | None = None,
) -> IntraOpResult:
    """The fastest candidate (module docstring). `weights` and `memory_limit` (default: the
    device's, or `options.memory_limit`) are how a pipeline search asks for its stages'
    budget; `comm`: the communication pass the program runs (None: none, a pipeline stage's
    program), by whose step the candidates are ranked."""
    options = options or SearchOptions()
    t0 = time.perf_counter()
    args = (captured, cluster, mesh, options, weights, memory_limit, comm)
    key = _prepared_key(*args)
    if key in captured.solved:  # this very problem, solved before
        return captured.solved[key]
    found = ahead.take(key)
    strats, scales, built, solving = found[1:] if found is not None else (*_prepare(*args), None)
    best, solve_s, seen = None, 0.0, set()
    with phase("ILP"):
        if solving is None:
            outcomes = solve_all(built.problems, meanwhile=ahead.take_meanwhile())
        else:  # its ILPs started when they were prepared (`search.ahead.start`)
            if (work := ahead.take_meanwhile()) is not None:
                ahead.run_safely(work)
            outcomes = solving.result()
    for k, (problem, solution) in enumerate(zip(built.problems, outcomes, strict=True)):
        if isinstance(solution, MemoryInfeasible):  # the same memory at every scale
            raise solution.explained(cluster, problem.memory_limit) from None
        if isinstance(solution, SolverTimeout):
            if k == 0:
                raise solution
            continue
        if isinstance(solution, Exception):
            raise solution
        solve_s += solution.solve_time_s
        for choices, why in _variants(built, solution.choices, comm is not None):
            if choices in seen:
                continue
            seen.add(choices)
            result = _result(captured, built, strats, choices, solution, options, comm)
            result.info["chosen_by"] = "ilp x{:g}/{:g}".format(*scales[k]) + why
            if best is None or result.step_time < best.step_time:
                best = result
    assert best is not None
    best.info.update(
        solve_time_s=solve_s, search_time_s=time.perf_counter() - t0, step_candidates=len(seen)
    )
    captured.solved[key] = best
    return best


def prepare_intra(
    captured: Captured,
    cluster: Cluster,
    mesh: DeviceMesh,
    options: SearchOptions,
    weights: CostWeights | None = None,
    memory_limit: float | None = None,
    comm: CommPlan | None = None,
) -> None:
    """What `solve_intra` with the same arguments computes before its ILPs (strategies,
    the priced problems), computed now and kept for that call (`search.ahead`)."""
    args = (captured, cluster, mesh, options, weights, memory_limit, comm)
    key = _prepared_key(*args)
    if not ahead.kept(key) and key not in captured.solved:
        strats, scales, built = _prepare(*args)
        solving = ahead.start(solve_all, built.problems) if ahead.spare_core() else None
        # `captured` kept alive: its id is in the key
        ahead.keep(key, (captured, strats, scales, built, solving))


def _prepared_key(captured, cluster, mesh, options, weights, memory_limit, comm) -> tuple:
    names = tuple(mesh.mesh_dim_names or ())
    return (id(captured), cluster, tuple(mesh.shape), names, repr(options), repr(weights),
            memory_limit, repr(comm))  # fmt: skip


def comm_scales(cluster: Cluster) -> tuple[tuple[float, float], ...]:
    """`COMM_SCALES`, and `DP_SCALES` where some axis gathers slower than it all-reduces or
    pays `SLOW_LATENCY` or more per step (gloo: the bound prices each small gradient's
    all-reduce with its own ring latency, ~5 ms on 4 CPU processes, where DDP's buckets pay
    it once per 25 MiB)."""
    dear = any(
        link.kind_bandwidth("all_gather") < link.kind_bandwidth("all_reduce")
        or link.latency >= SLOW_LATENCY
        for link in cluster.links
    )
    return (*COMM_SCALES, DP_SCALES) if dear else COMM_SCALES


def _prepare(captured, cluster, mesh, options, weights, memory_limit, comm):
    with phase("strategies"):
        strats = enumerate_strategies(captured.gm, mesh)
        strats = apply_pins(captured, strats, options, mesh)
    scales = (
        comm_scales(cluster) if comm is not None and cluster.world_size > 1 else COMM_SCALES[:1]
    )
    with phase("costs"):
        built = _build_problem(captured, cluster, strats, options, weights, memory_limit, scales)
    return strats, scales, built


@dataclass
class _Built:
    """The decisions, one ILP per weight-edge cost scale (the first unscaled), the ILP
    variable of each decision, the levers and the prices."""

    dec: Decisions
    problems: list[IntraOpProblem]
    var_of: list[int]
    levers: Levers
    ctx: CostContext


def _build_problem(captured, cluster, strats, options, weights, memory_limit, scales) -> _Built:
    ctx = CostContext(
        cluster,
        optimizer_states=options.optimizer_states,
        weights=weights,
        shard_optimizer=options.shard_optimizer,
        batch_dependent=batch_dependent(captured),
        shard_gradients=options.shard_gradients,
        mixed_precision=options.mixed_precision,
        reduce_itemsize=options.reduce_itemsize,
    )
    dec = build_decisions(captured.gm, strats, ctx)
    rep = share_layers(dec, strats) if options.share_layers else list(range(len(dec.items)))
    limit = memory_limit or options.memory_limit or cluster.device.memory_bytes * 0.9
    priced = price_scales(dec, rep, strats, ctx, limit, options.time_limit_s, scales)
    var_of = priced[0][1]  # the same at every scale
    index = {r: var_of[r] for r in set(rep)}
    with_levers = add_levers_at_scales(
        dec,
        rep,
        index,
        strats,
        ctx,
        [(problem, scale) for scale, (problem, _) in zip(scales, priced, strict=True)],
        recompute=options.activation_checkpointing,
        reshard=options.reshard_after_forward,
    )
    problems = [problem for problem, _ in with_levers]
    levers = with_levers[0][1]
    return _Built(dec, problems, var_of, levers, ctx)


def _variants(built: _Built, choices: tuple[int, ...], swap: bool):
    """(choices, what changed): the ILP's, then with `swap` its levers set to each lever
    choice on every layer, where the pins allow it and the memory fits."""
    yield choices, ""
    levers = sorted(set(built.levers.decision.values()))
    if not swap or not levers:
        return
    bound = built.problems[0]
    for a, (policy, raf) in enumerate(CHOICES):
        alt = list(choices)
        for d in levers:
            alt[d] = a
        if alt == list(choices):
            continue
        cost, memory = evaluate(bound, alt)
        if math.isfinite(cost) and memory <= bound.memory_limit:
            yield tuple(alt), f", levers ({policy}, reshard={raf})"


def _result(captured, built: _Built, strats, choices, solution: IntraOpSolution, options, comm):
    """The candidate `choices` as an `IntraOpResult`, priced by the unscaled ILP and by
    the step the runtime runs (`search.step`)."""
    dec, levers, ctx = built.dec, built.levers, built.ctx
    chosen = {
        n: strats[n][mapping[choices[built.var_of[d]]]] for n, (d, mapping) in dec.owner.items()
    }
    objective, memory = evaluate(built.problems[0], choices)
    info = {
        "status": solution.status,
        "gap": solution.gap,
        "decisions": len(dec.items),
        "ilp_decisions": len(built.problems[0].node_cost),
        "edges": len(built.problems[0].edges),
        **({"shard_optimizer": True} if options.shard_optimizer else {}),
    }
    priced = frozenset(item.members[0][0] for item in dec.items)
    recompute, raf, policies = layer_summary(levers, choices, chosen, priced, ctx)
    info["recompute"] = dict(recompute)
    info["reshard_after_forward"] = list(raf)
    result = IntraOpResult(
        chosen,
        ctx,
        objective,
        memory,
        info,
        priced,
        levers,
        policies,
        levers.reshards(choices),
        (recompute, raf),
    )
    result.comm = comm
    result.info["comm_pass"] = result.comm is not None
    if result.comm is None:
        result.step_time = objective
    else:
        result.step_time = predicted_step_time(captured, result, result.comm)
    return result


def search_plan(
    captured: Captured, cluster: Cluster, mesh: DeviceMesh, options: SearchOptions | None = None
) -> Plan:
    options = options or SearchOptions()
    result = solve_intra(captured, cluster, mesh, options, comm=DEFAULT_COMM)
    return assemble_plan(
        captured,
        cluster,
        result.chosen,
        options.strategy_name(),
        result.step_time,
        result.memory,
        {**result.info, "ilp_step_time_bound": result.objective},
        priced=result.priced,
        memory=MemoryPlan(
            recompute=result.memory_plan[0], reshard_after_forward=result.memory_plan[1]
        ),
        comm=result.comm,
    )

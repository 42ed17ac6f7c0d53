"""Plan search: which sharding every node gets, and how the model is split into stages.

- `intra_op` (`search_plan`): one strategy per node on a mesh, chosen by the ILP of `ilp`
  (`solve_intra_op`) over the costs of `costs`, under the pins of `pins` (`SearchOptions`).
- `inter_op` (`solve_pipeline`; `pipeline_plan.search_pipeline`): Alpa's stage search: cut points over the layers and a
  schedule (`schedules` simulates each), on the ILP's per-layer costs.
- `layouts` (`search_layout`): the outer loop over pipeline degree x stage mesh (dp, tp) x
  microbatches x schedule, priced on two-block templates.
- `to_plan` assembles the answer as an `autopar.plan.Plan`.

The search reads the captured graph and the cost models; it imports neither lowering,
fusion nor the runtime. The orchestration of a plan/compile call is `autopar.planning`.
"""

from autopar.search.ilp import (
    Edge,
    GatedEdge,
    IntraOpProblem,
    IntraOpSolution,
    MemoryInfeasible,
    evaluate,
    solve_intra_op,
)

__all__ = [
    "Edge",
    "GatedEdge",
    "IntraOpProblem",
    "IntraOpSolution",
    "MemoryInfeasible",
    "evaluate",
    "solve_intra_op",
]

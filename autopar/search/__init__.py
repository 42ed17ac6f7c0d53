"""Plan search: the intra-op ILP (and, later, the inter-op stage search)."""

from autopar.search.ilp import (
    Edge,
    IntraOpProblem,
    IntraOpSolution,
    MemoryInfeasible,
    evaluate,
    solve_intra_op,
)

__all__ = [
    "Edge",
    "IntraOpProblem",
    "IntraOpSolution",
    "MemoryInfeasible",
    "evaluate",
    "solve_intra_op",
]

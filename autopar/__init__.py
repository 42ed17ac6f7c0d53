"""autopar: compiler-driven auto-parallelization of PyTorch training.

    pm = autopar.compile(model, batch, cluster=autopar.Cluster.local(mesh=(2, 2)),
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    loss = pm.step(*batch)

See docs/ARCHITECTURE.md for the stages.
"""

from autopar.api import compile, plan
from autopar.capture import CaptureError
from autopar.capture.regions import Region
from autopar.cluster import Cluster, DeviceSpec, Link
from autopar.options import PlanOptions
from autopar.plan import Plan
from autopar.runtime.parallel_model import ParallelModel
from autopar.search.ilp import MemoryInfeasible

__all__ = [
    "CaptureError",
    "Cluster",
    "DeviceSpec",
    "Link",
    "MemoryInfeasible",
    "ParallelModel",
    "Plan",
    "PlanOptions",
    "Region",
    "compile",
    "plan",
]

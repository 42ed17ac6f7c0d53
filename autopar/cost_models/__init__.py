"""Cost models: pure functions returning seconds or bytes.

``buckets`` (bucketed gradient reductions and overlap, as `passes.comm` runs them),
``compute`` (roofline FLOPs/bytes of ATen nodes), ``comm`` (alpha-beta collectives and
DTensor redistributions per mesh axis), ``memory`` (local shard sizes, training state).
"""

from autopar.cost_models import buckets, comm, compute, memory
from autopar.cost_models.comm import (
    Collective,
    collective_time,
    redistribute_steps,
    redistribute_time,
    send_recv_time,
)
from autopar.cost_models.compute import (
    backward_factor,
    compute_time,
    node_bytes,
    node_flops,
)
from autopar.cost_models.memory import local_numel, local_shape, param_state_bytes

__all__ = [
    "Collective",
    "backward_factor",
    "buckets",
    "collective_time",
    "comm",
    "compute",
    "compute_time",
    "local_numel",
    "local_shape",
    "memory",
    "node_bytes",
    "node_flops",
    "param_state_bytes",
    "redistribute_steps",
    "redistribute_time",
    "send_recv_time",
]

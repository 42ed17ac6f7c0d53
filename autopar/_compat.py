"""The one place where autopar touches private PyTorch APIs.

A torch upgrade that moves one of these breaks this file only. Group imports by the stage
that uses them and say why the public API does not suffice.
"""

from __future__ import annotations

# capture / lowering: tracing a DTensor program into a plain per-rank graph. make_fx is the
# documented tracer for this (torch.export cannot trace through tensor subclasses' dispatch).
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401

# strategies: DTensor's sharding-strategy registry and its schema types.
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.distributed.tensor._op_schema import (  # noqa: F401
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
)

# tests / planning at scale: the fake process group's store.
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

# strategies (autopar/passes/strategies): placeholder dims in DTensor's single-mesh-dim rules,
# tuple (list-of-tensor) strategies, the vocab-parallel embedding partial, the full-mesh
# expansion helper used to register autopar rules into DTensor, and the decomposition-based
# propagation fallback; LocalTensorMode (N ranks in one process) for the strategy tests;
# DTensor's op-strategy modules, whose redistribute-cost hook the enumeration stubs out (it
# is quadratic in the candidates and the search prices resharding itself).
# None of these has a public equivalent.
from torch.distributed._local_tensor import LocalTensorMode  # noqa: F401
from torch.distributed.tensor._decompositions import DecompShardingStrategy  # noqa: F401
from torch.distributed.tensor._op_schema import TupleStrategy  # noqa: F401
from torch.distributed.tensor._ops import (  # noqa: F401
    _math_ops as dtensor_math_ops,
    _matrix_ops as dtensor_matrix_ops,
    _tensor_ops as dtensor_tensor_ops,
    _view_ops as dtensor_view_ops,
)
from torch.distributed.tensor._ops import utils as dtensor_ops_utils  # noqa: F401
from torch.distributed.tensor._ops.single_dim_strategy import (  # noqa: F401
    _ShardingPlaceholder as ShardingPlaceholder,
)
from torch.distributed.tensor._ops.utils import (  # noqa: F401
    expand_to_full_mesh_op_strategy,
)
from torch.distributed.tensor.placement_types import _MaskPartial as MaskPartial  # noqa: F401


def sharding_propagator():
    """DTensor's global sharding propagator (holds the op-strategy registry)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator

"""The one place where autopar touches private PyTorch APIs.

A torch upgrade that moves one of these breaks this file only. Imports are grouped by the
stage that uses them, each group saying why the public API does not suffice. Everything
here is re-exported through `__all__` (so linters keep it).
"""

from __future__ import annotations

# pipeline stages: AOTAutograd splits a stage's traced program into forward and backward
# graphs behind one autograd.Function (the schedules drive forward and backward separately);
# a compiler it calls returns a function of one boxed argument list (make_boxed_func).
from torch._functorch.aot_autograd import aot_function, make_boxed_func

# fusion="inductor" (runtime/inductor.py): importing torch._dynamo already fills
# TORCHINDUCTOR_CACHE_DIR with torch's default (a folder in the system's temp directory);
# its default is what tells that value apart from one the user chose.
from torch._inductor.runtime.cache_dir_utils import (
    default_cache_dir as default_inductor_cache_dir,
)

# strategies (autopar/passes/strategies): DTensor's sharding-strategy registry and its schema
# types, placeholder dims in DTensor's single-mesh-dim rules, tuple (list-of-tensor)
# strategies, the vocab-parallel embedding partial, the full-mesh expansion helper used to
# register autopar rules into DTensor, and the decomposition-based propagation fallback;
# LocalTensorMode (N ranks in one process) for the strategy tests; DTensor's op-strategy
# modules, whose redistribute-cost hook the enumeration stubs out (it is quadratic in the
# candidates and the search prices resharding itself). None has a public equivalent.
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor._decompositions import DecompShardingStrategy
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
from torch.distributed.tensor._ops import _math_ops as dtensor_math_ops
from torch.distributed.tensor._ops import _matrix_ops as dtensor_matrix_ops
from torch.distributed.tensor._ops import _tensor_ops as dtensor_tensor_ops
from torch.distributed.tensor._ops import _view_ops as dtensor_view_ops
from torch.distributed.tensor._ops import utils as dtensor_ops_utils
from torch.distributed.tensor._ops.single_dim_strategy import (
    _ShardingPlaceholder as ShardingPlaceholder,
)
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.placement_types import _MaskPartial as MaskPartial

# capture / lowering: tracing a DTensor program into a plain per-rank graph. make_fx is the
# tracer for this (torch.export cannot trace through a tensor subclass's dispatch).
from torch.fx.experimental.proxy_tensor import make_fx

# planning at scale and tests: the fake process group's store.
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    "DTensorSpec",
    "DecompShardingStrategy",
    "FakeStore",
    "LocalTensorMode",
    "MaskPartial",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "RuntimeSchemaInfo",
    "ShardingPlaceholder",
    "TensorMeta",
    "TupleStrategy",
    "aot_function",
    "default_inductor_cache_dir",
    "dtensor_math_ops",
    "dtensor_matrix_ops",
    "dtensor_ops_utils",
    "dtensor_tensor_ops",
    "dtensor_view_ops",
    "expand_to_full_mesh_op_strategy",
    "make_boxed_func",
    "make_fx",
    "sharding_propagator",
]


def sharding_propagator():
    """DTensor's global sharding propagator (holds the op-strategy registry)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator

"""Local shards of global tensors, and back, for a rank's coordinate on the mesh.

A rank's shard of a tensor placed `(p_0, ..., p_{n-1})` is obtained by `torch.chunk`-ing,
axis by axis in mesh order, the dim each `Shard(d)` names into `mesh.size(axis)` pieces and
keeping the one at the rank's coordinate: exactly DTensor's layout for nested sharding,
uneven ones included (a dim of 97 over 4 ranks: 25, 25, 25, 22 rows; 6 over 4: 2, 2, 2, 0,
the missing trailing chunks being empty); a `_StridedShard(d, k)` takes the rank's chunk of
each of the `k` equal pieces of dim `d`. `gather_full` is DTensor's `full_tensor`, which
pads the uneven pieces for the all-gather and strips the padding.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar._compat import StridedShard
from autopar.plan import Spec


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors live on: the mesh's device type (for cuda, the
    current device, which the launcher sets to the local rank's GPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def local_chunk(full: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's shard of `full` under `spec`, on the mesh's device (a view is cloned
    into its own storage; a meta tensor, used for shapes, stays on meta)."""
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not part of the mesh"
    local = full
    for axis, placement in enumerate(spec):
        if isinstance(placement, Shard):
            local = chunk_of(local, placement.dim, mesh.size(axis), coord[axis])
        elif isinstance(placement, StridedShard):  # its piece of each of split_factor pieces
            d, k = placement.dim, placement.split_factor
            pieces = local.unflatten(d, (k, local.shape[d] // k))
            local = chunk_of(pieces, d + 1, mesh.size(axis), coord[axis]).flatten(d, d + 1)
        elif placement.is_partial():
            raise ValueError("a stored tensor cannot be Partial")
    if local.is_meta:
        return local.detach().contiguous()
    device = mesh_device(mesh)
    if local.device != device:  # the copy to the device is the rank's own storage
        return local.detach().to(device).contiguous()
    return local.detach().clone().contiguous()


def chunk_of(t: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    """Piece `index` of `n` of `t` along `dim`, as `torch.chunk` (and DTensor) cut it:
    pieces of `ceil(size / n)`, the last smaller; an index past the last piece is empty."""
    pieces = t.chunk(n, dim)
    if index < len(pieces):
        return pieces[index]
    return t.narrow(dim, t.shape[dim], 0)


def gather_full(
    local: torch.Tensor, spec: Spec, mesh: DeviceMesh, shape: tuple[int, ...]
) -> torch.Tensor:
    """The global tensor from every rank's shard (a collective: every rank must call it)."""
    if all(not isinstance(p, (Shard, StridedShard)) for p in spec):
        return local.detach().clone()
    dt = DTensor.from_local(
        local.detach(),
        mesh,
        spec,
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )
    return dt.full_tensor()

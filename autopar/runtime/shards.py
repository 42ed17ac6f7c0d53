"""Local shards of global tensors, and back, for a rank's coordinate on the mesh.

Only even shardings occur in plans (the strategy pass drops uneven ones), so a rank's shard
of a tensor placed `(p_0, ..., p_{n-1})` is obtained by chunking, axis by axis in mesh
order, the dim each `Shard(d)` names into `mesh.size(axis)` equal pieces and keeping the one
at the rank's coordinate: exactly DTensor's layout for nested sharding.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

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
            n = mesh.size(axis)
            dim = placement.dim
            if local.shape[dim] % n:
                raise ValueError(
                    f"dim {dim} of size {local.shape[dim]} does not split evenly over mesh "
                    f"axis {axis} of size {n}"
                )
            local = local.chunk(n, dim)[coord[axis]]
        elif placement.is_partial():
            raise ValueError("a stored tensor cannot be Partial")
    if local.is_meta:
        return local.detach().contiguous()
    device = mesh_device(mesh)
    if local.device != device:  # the copy to the device is the rank's own storage
        return local.detach().to(device).contiguous()
    return local.detach().clone().contiguous()


def gather_full(
    local: torch.Tensor, spec: Spec, mesh: DeviceMesh, shape: tuple[int, ...]
) -> torch.Tensor:
    """The global tensor from every rank's shard (a collective: every rank must call it)."""
    if all(not isinstance(p, Shard) for p in spec):
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

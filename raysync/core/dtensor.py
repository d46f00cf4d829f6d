"""A rank's own pieces of a model whose weights are ``DTensor``\\ s: what a sharded push sends.

Each ``DTensor`` (FSDP2's ``fully_shard``, ``distribute_tensor`` over a device mesh) is
described by its global shape and placements; the rank contributes its local shard
(``to_local()``, no gather and no copy) as a box of the global tensor. A tensor replicated
along a mesh dimension is contributed only by the ranks at coordinate 0 there, so each
element is pushed once. Plain tensors in such a model are taken from group rank 0.

Example:
    >>> part = local_part(extract_tensors(model))          # doctest: +SKIP
    >>> part.rank, part.world, sorted(part.tensors)         # doctest: +SKIP
    (1, 2, ['0.weight'])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from raysync.core.layout import _dtype_name
from raysync.core.shards import ShardPiece, TensorSpec, chunk
from raysync.errors import InvalidWeightsError

__all__ = ["LocalPart", "is_sharded", "local_part", "mesh_of", "mesh_rank"]


def _dtensor_class() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def is_sharded(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether any of the weights is a ``DTensor`` (the push is then one rank's of a group).

    Example:
        >>> is_sharded({"w": torch.zeros(2)})
        False
    """
    return mesh_of(tensors) is not None


def mesh_of(tensors: Mapping[str, torch.Tensor]) -> Any:
    """The device mesh of the first ``DTensor`` in ``tensors`` (``None`` without one)."""
    cls = _dtensor_class()
    for t in tensors.values():
        if cls is not None and isinstance(t, cls):
            return t.device_mesh
    return None


def mesh_rank(mesh: Any) -> tuple[int, int]:
    """``(rank, world)`` of this process in ``mesh``: its place in the flattened mesh, and its size."""
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    return ranks.index(mesh.get_rank()), len(ranks)


@dataclass
class LocalPart:
    """This rank's share of a sharded model.

    Attributes:
        rank: its place in the group (in the device mesh, flattened).
        world: the group's size (the mesh's).
        specs: every tensor of the model, as every rank must see it.
        tensors: the local pieces this rank contributes, by tensor key (views, no copy).
        boxes: ``key -> (offsets, lengths)`` of each contributed piece in its global tensor.
    """

    rank: int
    world: int
    specs: tuple[TensorSpec, ...]
    tensors: dict[str, torch.Tensor]
    boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]

    def pieces(self, manifest: Any) -> tuple[ShardPiece, ...]:
        """The pieces, placed in this rank's own layout ``manifest``."""
        return tuple(
            ShardPiece(e.key, self.rank, e.bucket, e.index, e.nbytes, *self.boxes[e.key])
            for e in manifest.entries
        )


@torch.no_grad()  # the local shards are only read: no autograd around them
def local_part(tensors: Mapping[str, torch.Tensor]) -> LocalPart:
    """This rank's pieces of ``tensors`` (some of them ``DTensor``\\ s over one device mesh).

    Raises:
        InvalidWeightsError: ``DTensor``\\ s over different meshes, a ``Partial`` (unreduced)
            or strided placement, or a local shard whose shape is not the one its placement
            implies (the message names the tensor).
    """
    from torch.distributed.tensor import Replicate, Shard

    dtensor = _dtensor_class()
    mesh = None
    for key, t in tensors.items():
        if isinstance(t, dtensor):
            if mesh is None:
                mesh = t.device_mesh
            elif t.device_mesh != mesh:
                raise InvalidWeightsError(
                    f"tensor {key!r} is distributed over another device mesh ({t.device_mesh}) than the "
                    f"others ({mesh}): a sharded push takes one mesh per model"
                )
    if mesh is None:
        raise InvalidWeightsError("a sharded push needs DTensor weights; these have none")
    coord = mesh.get_coordinate()
    if coord is None:
        raise InvalidWeightsError(f"this process is not in the device mesh {mesh} its weights are on")
    me, world = mesh_rank(mesh)
    sizes = [mesh.size(dim) for dim in range(mesh.ndim)]
    described: dict[Any, str] = {}  # each placements' description, made once per push
    specs: list[TensorSpec] = []
    local: dict[str, torch.Tensor] = {}
    boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for key, t in tensors.items():
        shape = tuple(int(n) for n in t.shape)
        if not isinstance(t, dtensor):
            specs.append(TensorSpec(key, shape, _dtype_name(t.dtype), t.element_size(), "plain"))
            if me == 0:
                local[key], boxes[key] = t, ((0,) * len(shape), shape)
            continue
        offsets = [0] * len(shape)
        lengths = list(shape)
        owner = True
        for dim, p in enumerate(t.placements):
            if isinstance(p, Shard):
                d = p.dim % max(len(shape), 1)
                start, lengths[d] = chunk(lengths[d], sizes[dim], coord[dim])
                offsets[d] += start
            elif isinstance(p, Replicate):
                owner = owner and coord[dim] == 0
            else:
                raise InvalidWeightsError(
                    f"tensor {key!r} has placement {p} on mesh dimension {dim}: a sharded push takes "
                    "Shard(d) and Replicate() placements (reduce a Partial one first: "
                    "t.redistribute(placements=[Replicate()]))"
                )
        shard = t.to_local()  # under no_grad: the local tensor itself, not through autograd
        if tuple(shard.shape) != tuple(lengths):
            raise InvalidWeightsError(
                f"tensor {key!r}: this rank's local shard has shape {tuple(shard.shape)}, but its placements "
                f"{tuple(t.placements)} over mesh {tuple(mesh.shape)} imply {tuple(lengths)}"
            )
        placement = described.get(t.placements)
        if placement is None:
            placement = described[t.placements] = f"{tuple(t.placements)} over mesh {tuple(mesh.shape)}"
        specs.append(TensorSpec(key, shape, _dtype_name(t.dtype), shard.element_size(), placement))
        if owner and all(lengths):
            local[key], boxes[key] = shard, (tuple(offsets), tuple(lengths))
    return LocalPart(me, world, tuple(sorted(specs, key=lambda s: s.key)), local, boxes)

"""A receiver's placement: which part of each tensor it takes, and a version's view for it.

A tensor-parallel receiver (:class:`TensorParallel`) takes only its own slice of each tensor it
names; :func:`reshard` turns a version's manifest into that receiver's view (the parts it needs,
in the buckets that hold them), so it fetches only those buckets. A version of one writer is
first seen as a sharded one with a single rank (:func:`one_writer`).

Example:
    >>> tp = TensorParallel(0, 2, {"*.weight": 0})
    >>> tp.box("fc.weight", (4, 3))
    ((0, 0), (2, 3))
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

from raysync.core.layout import Manifest, plan_specs
from raysync.core.shards import SHARDED, Box, ShardMap, ShardPiece, chunk
from raysync.errors import InvalidWeightsError

__all__ = ["TensorParallel", "one_writer", "reshard"]


@dataclass(frozen=True)
class TensorParallel:
    """A receiver's own placement: tensor-parallel rank ``rank`` of ``size``.

    A tensor whose name matches a pattern of ``dims`` is split along that dimension into
    ``size`` chunks as ``torch.chunk`` (and ``DTensor``'s ``Shard(d)``) splits it, and this
    receiver holds chunk ``rank``; every other tensor is held whole (replicated). Give it to
    a receiver (``WeightsLoader(..., placement=...)``, ``@synced_model(..., placement=...)``,
    ``raysync.follow(module, placement=...)``): it fetches only the buckets holding its
    parts (a sharded trainer's ranks' or one writer's) and copies only its parts, whatever
    the trainer's layout was.

    Args:
        rank: this receiver's place, ``0 .. size - 1``.
        size: how many receivers split each sharded tensor.
        dims: ``{fnmatch pattern of names: dimension}``, first match wins.

    Example:
        >>> tp = TensorParallel(1, 2, {"*.q_proj.weight": 0, "*.o_proj.weight": 1})
        >>> tp.box("l.o_proj.weight", (4, 6))
        ((0, 3), (4, 3))
        >>> tp.box("l.norm.weight", (4,)) is None
        True
    """

    rank: int
    size: int
    dims: tuple[tuple[str, int], ...] | dict[str, int]

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int)):
            raise ValueError(
                f"TensorParallel needs integers size >= 1 and rank, got {self.rank} of {self.size}"
            )
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallel rank must be in 0 .. {self.size - 1}, got {self.rank}")
        if isinstance(self.dims, dict):
            object.__setattr__(self, "dims", tuple(self.dims.items()))

    def box(self, key: str, shape: tuple[int, ...]) -> Box | None:
        """The part of tensor ``key`` (of global ``shape``) this receiver holds; None: all of it."""
        import fnmatch

        rules: Any = self.dims.items() if isinstance(self.dims, dict) else self.dims
        for pattern, dim in rules:
            dim = int(dim)
            if fnmatch.fnmatchcase(key, pattern):
                if not -len(shape) <= dim < len(shape):
                    raise InvalidWeightsError(
                        f"TensorParallel splits {key!r} along dimension {dim}, but it has shape {shape}"
                    )
                d = dim % len(shape)
                start, length = chunk(shape[d], self.size, self.rank)
                offsets = tuple(start if i == d else 0 for i in range(len(shape)))
                return offsets, tuple(length if i == d else n for i, n in enumerate(shape))
        return None


def reshard(manifest: Manifest, placement: TensorParallel) -> Manifest:
    """The view of a version that a receiver with its own ``placement`` takes.

    Same buckets (each bucket of the view holds this receiver's parts of the tensors of
    that bucket of the version, so bucket ids still say which changed), entries shaped as
    the parts; the version's shard map with the parts' boxes. A version of one writer is
    cut as a sharded one of one rank (:func:`one_writer`; its bucket refs then go in
    :class:`ShardRefs` of one bucket each). A placement that takes every tensor whole
    leaves the version as it is.

    Example:
        >>> view = reshard(manifest, TensorParallel(0, 2, {"*.weight": 0}))   # doctest: +SKIP
        >>> view.schema()["fc.weight"]                                         # doctest: +SKIP
        ((2, 8), 'float32')
    """
    boxes = []
    for e in manifest.entries:
        box = placement.box(e.key, e.shape)
        if box is not None and box[1] != tuple(e.shape):
            boxes.append((e.key, box[0], box[1]))
    if not boxes:
        return manifest
    if manifest.shards is None:
        manifest = one_writer(manifest)
    shards = manifest.shards
    assert shards is not None
    by_key = {k: (o, n) for k, o, n in boxes}
    entries = []
    spans = []
    for b in range(manifest.num_buckets):
        specs = []
        for e in manifest.bucket_entries(b):
            box = by_key.get(e.key)
            shape = box[1] if box is not None else e.shape
            itemsize = e.nbytes // math.prod(e.shape) if math.prod(e.shape) else 0
            specs.append((e.key, tuple(shape), e.dtype, math.prod(shape) * itemsize))
        one = plan_specs(specs, bucket_bytes=2**62)  # one bucket: this bucket's parts
        entries += [dataclasses.replace(x, bucket=b) for x in one.entries]
        spans.append(sum(one.bucket_nbytes))
    digest = hashlib.sha1(repr((manifest.layout_hash, shards.world, tuple(boxes))).encode())
    return dataclasses.replace(
        manifest,
        entries=tuple(sorted(entries, key=lambda x: x.key)),
        bucket_nbytes=tuple(spans),
        layout_hash=digest.hexdigest()[:16],
        shards=dataclasses.replace(shards, boxes=tuple(boxes)),
    )


def one_writer(manifest: Manifest) -> Manifest:
    """A version of one writer as a sharded version of one rank: each tensor one whole piece.

    What :func:`reshard` cuts a receiver's parts from. The rank buckets are the version's
    own buckets (their refs: ``ShardRefs((b,), (ref,))``), and so are their checksums.

    Example:
        >>> cut = one_writer(plan_layout({"w": torch.zeros(4, 2)}))   # doctest: +SKIP
        >>> cut.transport, cut.shards.pieces_of("w")[0].lengths          # doctest: +SKIP
        ('sharded', (4, 2))
    """
    pieces = tuple(
        ShardPiece(e.key, 0, e.bucket, e.index, e.nbytes, (0,) * len(e.shape), tuple(e.shape))
        for e in manifest.entries
    )
    shard_map = ShardMap(
        world=1,
        transport=manifest.transport,
        bucket_ranks=(0,) * manifest.num_buckets,
        bucket_nbytes=manifest.bucket_nbytes,
        pieces=pieces,
        placements=tuple((e.key, "plain") for e in manifest.entries),
        checksums=manifest.checksums,
    )
    return dataclasses.replace(manifest, shards=shard_map, transport=SHARDED, checksums=None)

"""The data path of a sharded trainer's versions: every rank puts its own pieces; receivers get whole tensors.

Trainer side: each rank snapshots only its own pieces through the data path underneath
(``object_store``: one ``ray.put`` per bucket of that rank's layout). The hub makes one
version of every rank's buckets (:func:`raysync.core.shards.merge`): its manifest lays out
the whole tensors, and each of its buckets' refs is a :class:`~raysync.core.shards.ShardRefs`
naming the rank buckets that bucket is made of.

Receiver side (:meth:`ShardedTransport.fetch`): for the buckets asked for, fetch exactly
the rank buckets holding their tensors' pieces (a replicated tensor's bytes come from one
rank), and assemble each whole bucket: one copy of each piece into its box of its tensor.
Every receiver (``@synced_model`` actors, :class:`~raysync.Follower`,
:class:`~raysync.WeightsLoader`, ``hub.pull()``) then takes the version as any other.

Example:
    >>> buckets = ShardedTransport.fetch(manifest, refs, [0], timeout=30)   # doctest: +SKIP
    >>> [a.nbytes for a in buckets[0]]                                      # whole tensors
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from raysync.core.codec import failed_checksums
from raysync.core.layout import Manifest
from raysync.core.shards import SHARDED, Box, ShardPiece, intersect
from raysync.errors import ChecksumError
from raysync.transports import registry
from raysync.transports.base import Reuse, Snapshot, transport_for

__all__ = ["Assembly", "ShardedTransport", "assemble", "verify_rank_buckets"]


class ShardedTransport:
    """Both sides of a sharded version's data path (see the module's docstring)."""

    name = SHARDED
    info = registry.info(SHARDED)

    def snapshot(
        self,
        model_id: str,
        tensors: Mapping[str, torch.Tensor],
        manifest: Manifest,
        *,
        checksum: bool = False,
        reuse: Reuse | None = None,
    ) -> Snapshot:
        """Trainer side, one rank: its own pieces (laid out in ``manifest``) into the object store."""
        return transport_for("object_store").snapshot(
            model_id, tensors, manifest, checksum=checksum, reuse=reuse
        )

    @staticmethod
    def fetch(
        manifest: Manifest, refs: Sequence[Any], needed: Sequence[int], *, timeout: float | None
    ) -> list[Any]:
        """Receiver side: the whole-tensor buckets ``needed``, made of the rank buckets that hold them."""
        shards = manifest.shards
        if shards is None:
            raise ValueError("a version over the 'sharded' data path carries a shard map; this one has none")
        rank_refs: dict[int, Any] = {}
        for b in needed:
            # a receiver taking part of each tensor (shards.boxes) fetches only the rank buckets it needs
            wanted = set(shards.buckets_of([e.key for e in manifest.bucket_entries(b)]))
            rank_refs.update(
                (i, r) for i, r in zip(refs[b].buckets, refs[b].refs, strict=True) if i in wanted
            )
        order = sorted(rank_refs)
        inner = registry.transport_class(shards.transport)
        got = inner.fetch(manifest, [rank_refs[i] for i in order], list(range(len(order))), timeout=timeout)
        arrays = dict(zip(order, got, strict=True))
        return [Assembly(manifest, b, arrays) for b in needed]

    @staticmethod
    def receive_into(
        bound: Any,
        refs: Sequence[Any],
        ids: Sequence[str | None],
        *,
        timeout: float,
        extra_state: Sequence[tuple[str, bytes]] = (),
    ) -> int:
        raise NotImplementedError("sharded versions are fetched and assembled, then copied in")


class Assembly(Sequence[np.ndarray]):
    """One whole-tensor bucket of a sharded version, assembled when first read.

    A receiver that copies a bucket into buffers of its own (a module's, ``apply="copy"``:
    :func:`raysync.core.codec.copy_into`) calls :meth:`write_into`, which copies each piece
    straight into them: one copy, as for a version of one writer. Anything else that reads
    it (``apply="view"``, a ``WeightsLoader``'s tensors) gets one uint8 array per tensor:
    a read-only view of the rank bucket's bytes where one piece holds the tensor (or the
    receiver's part of it) as one run of bytes, no copy; else views of one buffer assembled
    on first read (:func:`assemble`).

    Example:
        >>> bucket = ShardedTransport.fetch(manifest, refs, [0], timeout=30)[0]   # doctest: +SKIP
        >>> bucket.write_into(flat)                                              # doctest: +SKIP
    """

    def __init__(
        self, manifest: Manifest, bucket: int, rank_buckets: Mapping[int, Sequence[np.ndarray]]
    ) -> None:
        self.manifest = manifest
        self.bucket = bucket
        self.rank_buckets = rank_buckets
        self._entries = manifest.bucket_entries(bucket)
        self._arrays: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: Any) -> Any:
        if self._arrays is None:
            self._arrays = _read(self.manifest, self.bucket, self._entries, self.rank_buckets)
        return self._arrays[i]

    def write_into(self, flat: torch.Tensor) -> None:
        """Copy the bucket into ``flat`` (a uint8 tensor of the bucket's span): each piece once."""
        _check_sizes(self.manifest, self._entries, self.rank_buckets)  # nothing written if one is off
        with torch.no_grad():
            _fill(self.manifest, self._entries, self.rank_buckets, flat)


def verify_rank_buckets(manifest: Manifest, fetched: Mapping[int, Any]) -> None:
    """Raise :class:`~raysync.ChecksumError` unless each rank bucket behind ``fetched`` matches its CRC32.

    ``fetched``: the :class:`Assembly` buckets :meth:`ShardedTransport.fetch` returned. Each rank
    bucket they were made of is checked once, against the checksum its rank computed
    (``hub.push(..., checksum=True)`` on every rank); a version without them is refused.

    Example:
        >>> verify_rank_buckets(manifest, dict(zip(needed, ShardedTransport.fetch(manifest, refs, needed,
        ...     timeout=30))))   # doctest: +SKIP
    """
    shards = manifest.shards
    assert shards is not None
    if shards.checksums is None:
        raise ChecksumError(
            f"this sharded version (layout {manifest.layout_hash}) carries no checksums, so a verify=True "
            "subscriber cannot check its bytes and refuses it: push with hub.push(..., checksum=True) "
            "on every rank, or subscribe without verify=True"
        )
    rank_buckets: dict[int, Sequence[np.ndarray]] = {}
    for bucket in fetched.values():
        rank_buckets.update(bucket.rank_buckets)
    bad = failed_checksums(shards.checksums, rank_buckets)
    if bad:
        raise ChecksumError(
            f"rank bucket(s) {bad} (of rank(s) {sorted({shards.bucket_ranks[i] for i in bad})}) of layout "
            f"{manifest.layout_hash} failed their checksum: the bytes were corrupted in transit or in the "
            "object store; the version is refused"
        )


def assemble(
    manifest: Manifest, bucket: int, rank_buckets: Mapping[int, Sequence[np.ndarray]]
) -> list[np.ndarray]:
    """One whole-tensor bucket of a sharded version, from its rank buckets (``{index: arrays}``).

    Returns one uint8 array per tensor, in buffer order, all views of one fresh buffer laid
    out as the manifest says (padding zeroed).

    Example:
        >>> arrays = assemble(manifest, 0, {0: ray.get(r0), 1: ray.get(r1)})   # doctest: +SKIP
    """
    entries = manifest.bucket_entries(bucket)
    _check_sizes(manifest, entries, rank_buckets)
    flat = np.empty(manifest.bucket_nbytes[bucket], dtype=np.uint8)
    _fill(manifest, entries, rank_buckets, torch.from_numpy(flat))
    return [flat[e.offset : e.offset + e.nbytes] for e in entries]


def _read(
    manifest: Manifest, bucket: int, entries: Sequence[Any], rank_buckets: Mapping[int, Sequence[np.ndarray]]
) -> list[np.ndarray]:
    """One uint8 array per tensor of a bucket: a view of the rank bucket where one piece holds
    it as one run of bytes, else (any other tensor there) the bucket assembled (:func:`assemble`)."""
    _check_sizes(manifest, entries, rank_buckets)
    direct = [_run(manifest, e, rank_buckets) for e in entries]
    if any(a is None for a in direct):
        whole = assemble(manifest, bucket, rank_buckets)
        return [whole[i] if a is None else a for i, a in enumerate(direct)]
    return [a for a in direct if a is not None]


def _run(
    manifest: Manifest, entry: Any, rank_buckets: Mapping[int, Sequence[np.ndarray]]
) -> np.ndarray | None:
    """The bytes of ``entry`` (its box) as a view of the one piece holding them all, if contiguous there."""
    box, pieces = _pieces(manifest, entry)
    if not entry.nbytes or len(pieces) != 1:
        return None
    piece = pieces[0]
    if intersect((piece.offsets, piece.lengths), box) != box:
        return None
    # row-major: the box is one run of the piece's bytes if, before its last dimension narrower
    # than the piece, every dimension is 1 long
    start, stride, narrowed = 0, entry.nbytes // max(1, math.prod(box[1])), False
    for d in reversed(range(len(piece.lengths))):
        if narrowed and box[1][d] != 1:
            return None
        start += (box[0][d] - piece.offsets[d]) * stride
        stride *= piece.lengths[d]
        narrowed = narrowed or box[1][d] != piece.lengths[d]
    flat = np.asarray(rank_buckets[piece.bucket][piece.index]).reshape(-1).view(np.uint8)
    return flat[start : start + entry.nbytes]


def _pieces(manifest: Manifest, entry: Any) -> tuple[Box, list[ShardPiece]]:
    """The box of ``entry``'s tensor this bucket holds, and the pieces with elements in it."""
    shards = manifest.shards
    assert shards is not None
    box = shards.box_of(entry.key) or ((0,) * len(entry.shape), tuple(entry.shape))
    return box, [
        p
        for p in shards.pieces_of(entry.key)
        if p.numel and intersect((p.offsets, p.lengths), box) is not None
    ]


def _check_sizes(
    manifest: Manifest, entries: Sequence[Any], rank_buckets: Mapping[int, Sequence[np.ndarray]]
) -> None:
    for entry in entries:
        if not entry.nbytes:
            continue
        for piece in _pieces(manifest, entry)[1]:
            data = rank_buckets[piece.bucket][piece.index]
            if data.nbytes != piece.nbytes:
                raise ValueError(
                    f"rank {piece.rank}'s piece of {piece.key!r} arrived with {data.nbytes} bytes, the "
                    f"manifest says {piece.nbytes}"
                )


def _fill(
    manifest: Manifest,
    entries: Sequence[Any],
    rank_buckets: Mapping[int, Sequence[np.ndarray]],
    flat: torch.Tensor,
) -> None:
    """Write a bucket's tensors into ``flat`` (uint8, the bucket's span) from their pieces; padding zeroed."""
    end = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # object-store arrays are read-only; only read here
        for entry in entries:
            flat[end : entry.offset] = 0
            end = entry.offset + entry.nbytes
            if not entry.nbytes:
                continue
            numel = 1
            for n in entry.shape:
                numel *= n
            whole = flat[entry.offset : end].view(*entry.shape, entry.nbytes // numel)
            box, pieces = _pieces(manifest, entry)
            for piece in pieces:
                _place(whole, box, piece, rank_buckets[piece.bucket][piece.index])
        flat[end:] = 0


def _place(whole: torch.Tensor, box: Box, piece: ShardPiece, data: np.ndarray) -> None:
    """Copy the part of one piece inside ``box`` into ``whole`` (the box as ``(*n, itemsize)`` uint8)."""
    common = intersect((piece.offsets, piece.lengths), box)
    assert common is not None
    src = torch.from_numpy(np.asarray(data).reshape(-1).view(np.uint8)).view(*piece.lengths, whole.shape[-1])
    dst = whole
    for d, (o, n) in enumerate(zip(*common, strict=True)):
        if n != piece.lengths[d]:
            src = src.narrow(d, o - piece.offsets[d], n)
        if n != whole.shape[d]:
            dst = dst.narrow(d, o - box[0][d], n)
    dst.copy_(src)

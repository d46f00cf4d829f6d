"""Whole tensors from a sharded version's pieces: into numpy or torch buffers alike, torch-free.

A sharded trainer's version (:func:`raysync.core.shards.merge`) lays out whole tensors in its
manifest and says, in its shard map, which rank bucket holds each piece of each. Here each
piece is copied once into its box of its tensor, into a numpy array (:func:`assemble`,
:func:`whole_version`) or into a receiver's own torch buffers (:func:`fill`, called by
:class:`raysync.transports.sharded.Assembly`). Nothing here imports torch: the hub and the
relays assemble small versions for a node's doorbell without loading it.

Example:
    >>> whole, buckets = whole_version(manifest, {0: ray.get(r0), 1: ray.get(r1)})   # doctest: +SKIP
    >>> whole.shards is None and len(buckets) == whole.num_buckets                   # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from raysync.core.checksums import bucket_checksums, failed_checksums
from raysync.core.layout import Manifest
from raysync.core.shards import Box, ShardPiece, intersect
from raysync.errors import ChecksumError

__all__ = ["assemble", "check_sizes", "fill", "pieces_in", "verify_rank_buckets", "whole_version"]

RankBuckets = Mapping[int, Sequence[np.ndarray]]
"""``{rank bucket index: its arrays}``: the rank buckets a version's pieces are read from."""


def whole_version(manifest: Manifest, rank_buckets: RankBuckets) -> tuple[Manifest, list[list[np.ndarray]]]:
    """A sharded version as one writer's: its manifest without the shard map, every bucket assembled.

    For a node's doorbell (:mod:`raysync.hub.relay`), which hands a version to the node's
    subscribers as one writer's buckets in a sealed segment. ``rank_buckets``: every rank
    bucket of the version. The ranks' checksums (if they pushed with ``checksum=True``) are
    checked against these bytes, and the whole buckets get checksums of their own, so a
    ``verify=True`` subscriber checks what it reads.

    Raises:
        ChecksumError: a rank bucket does not match its rank's checksum.
        ValueError: ``manifest`` is not a sharded version's, or a piece has the wrong size.
    """
    shards = manifest.shards
    if shards is None:
        raise ValueError("whole_version takes a sharded version's manifest; this one has no shard map")
    if shards.checksums is not None:
        verify_rank_buckets(manifest, rank_buckets)
    buckets = [assemble(manifest, b, rank_buckets) for b in range(manifest.num_buckets)]
    checksums = bucket_checksums(buckets) if shards.checksums is not None else None
    whole = dataclasses.replace(manifest, shards=None, transport=shards.transport, checksums=checksums)
    return whole, buckets


def verify_rank_buckets(manifest: Manifest, rank_buckets: RankBuckets) -> None:
    """Raise :class:`~raysync.ChecksumError` unless each of ``rank_buckets`` matches its CRC32.

    Each is checked against the checksum its rank computed (``hub.push(..., checksum=True)``
    on every rank); a version without them is refused.

    Example:
        >>> verify_rank_buckets(manifest, {0: ray.get(r0)})   # doctest: +SKIP
    """
    shards = manifest.shards
    assert shards is not None
    if shards.checksums is None:
        raise ChecksumError(
            f"this sharded version (layout {manifest.layout_hash}) carries no checksums, so a verify=True "
            "subscriber cannot check its bytes and refuses it: push with hub.push(..., checksum=True) "
            "on every rank, or subscribe without verify=True"
        )
    bad = failed_checksums(shards.checksums, rank_buckets)
    if bad:
        raise ChecksumError(
            f"rank bucket(s) {bad} (of rank(s) {sorted({shards.bucket_ranks[i] for i in bad})}) of layout "
            f"{manifest.layout_hash} failed their checksum: the bytes were corrupted in transit or in the "
            "object store; the version is refused"
        )


def assemble(manifest: Manifest, bucket: int, rank_buckets: RankBuckets) -> list[np.ndarray]:
    """One whole-tensor bucket of a sharded version, from its rank buckets.

    Returns one uint8 array per tensor, in buffer order, all views of one fresh buffer laid
    out as the manifest says (padding zeroed).

    Example:
        >>> arrays = assemble(manifest, 0, {0: ray.get(r0), 1: ray.get(r1)})   # doctest: +SKIP
    """
    entries = manifest.bucket_entries(bucket)
    check_sizes(manifest, entries, rank_buckets)
    flat = np.empty(manifest.bucket_nbytes[bucket], dtype=np.uint8)
    fill(manifest, entries, rank_buckets, flat)
    return [flat[e.offset : e.offset + e.nbytes] for e in entries]


def pieces_in(manifest: Manifest, entry: Any) -> tuple[Box, list[ShardPiece]]:
    """The box of ``entry``'s tensor this bucket holds, and the pieces with elements in it."""
    shards = manifest.shards
    assert shards is not None
    box = shards.box_of(entry.key) or ((0,) * len(entry.shape), tuple(entry.shape))
    return box, [
        p
        for p in shards.pieces_of(entry.key)
        if p.numel and intersect((p.offsets, p.lengths), box) is not None
    ]


def check_sizes(manifest: Manifest, entries: Sequence[Any], rank_buckets: RankBuckets) -> None:
    """Raise ``ValueError`` unless every piece of ``entries`` arrived with the bytes the manifest says."""
    for entry in entries:
        if not entry.nbytes:
            continue
        for piece in pieces_in(manifest, entry)[1]:
            data = rank_buckets[piece.bucket][piece.index]
            if data.nbytes != piece.nbytes:
                raise ValueError(
                    f"rank {piece.rank}'s piece of {piece.key!r} arrived with {data.nbytes} bytes, the "
                    f"manifest says {piece.nbytes}"
                )


def fill(
    manifest: Manifest,
    entries: Sequence[Any],
    rank_buckets: RankBuckets,
    flat: Any,
    as_array: Callable[[np.ndarray], Any] = lambda a: a,
) -> None:
    """Write a bucket's tensors into ``flat`` (uint8, the bucket's span) from their pieces; padding zeroed.

    ``flat``: a numpy array, or a torch tensor (on any device) with ``as_array=torch.from_numpy``.
    """
    end = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # object-store arrays are read-only; only read here
        for entry in entries:
            flat[end : entry.offset] = 0
            end = entry.offset + entry.nbytes
            if not entry.nbytes:
                continue
            whole = flat[entry.offset : end].reshape(*entry.shape, entry.nbytes // math.prod(entry.shape))
            box, pieces = pieces_in(manifest, entry)
            for piece in pieces:
                data = np.asarray(rank_buckets[piece.bucket][piece.index]).reshape(-1).view(np.uint8)
                _place(whole, box, piece, as_array(data).reshape(*piece.lengths, whole.shape[-1]))
        flat[end:] = 0


def _place(whole: Any, box: Box, piece: ShardPiece, src: Any) -> None:
    """Copy the part of one piece (``src``, ``(*lengths, itemsize)`` uint8) inside ``box`` into
    ``whole`` (the box as ``(*n, itemsize)`` uint8)."""
    common = intersect((piece.offsets, piece.lengths), box)
    assert common is not None
    spans = list(enumerate(zip(*common, strict=True)))
    into = tuple(slice(o - box[0][d], o - box[0][d] + n) for d, (o, n) in spans)
    out = tuple(slice(o - piece.offsets[d], o - piece.offsets[d] + n) for d, (o, n) in spans)
    whole[into] = src[out]

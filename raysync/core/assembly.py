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
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from raysync.core.checksums import bucket_checksums, failed_checksums
from raysync.core.kept import Kept
from raysync.core.layout import Manifest
from raysync.core.shards import Box, ShardMap, ShardPiece, intersect
from raysync.errors import ChecksumError

__all__ = [
    "SPARES", "BucketPlan", "Spares", "assemble", "bucket_plan", "check_sizes", "fill", "run_in",
    "verify_rank_buckets", "whole_version",
]  # fmt: skip

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


def assemble(
    manifest: Manifest, bucket: int, rank_buckets: RankBuckets, *, spare: bool = False
) -> list[np.ndarray]:
    """One whole-tensor bucket of a sharded version, from its rank buckets.

    Returns one uint8 array per tensor, in buffer order, all views of one buffer laid out as
    the manifest says (padding zeroed): a fresh one, or with ``spare`` the process's buffer of
    that size (:data:`SPARES`) when nothing holds it any more.

    Example:
        >>> arrays = assemble(manifest, 0, {0: ray.get(r0), 1: ray.get(r1)})   # doctest: +SKIP
    """
    plan = bucket_plan(manifest, bucket)
    check_sizes(plan, rank_buckets)
    nbytes = manifest.bucket_nbytes[bucket]
    flat = SPARES.take(nbytes) if spare else np.empty(nbytes, dtype=np.uint8)
    fill(plan, rank_buckets, flat)
    return [flat[e.offset : e.offset + e.nbytes] for e in manifest.bucket_entries(bucket)]


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """How one whole-tensor bucket of a sharded version is written from its pieces.

    Worked out once per layout (:func:`bucket_plan` keeps it): each version of the layout
    then costs one copy per piece and no search.

    Attributes:
        runs: ``(rank bucket, index, source byte, bucket byte, nbytes)`` of each piece whose
            part is one run of bytes both in the piece and in the bucket (``Shard(0)`` pieces,
            replicated tensors): one flat copy each.
        boxed: ``(entry, box, piece)`` of the others (a ``Shard(1)`` piece of a whole tensor):
            copied box by box.
        gaps: ``(start, end)`` of the bucket's bytes no tensor covers (zeroed).
        sizes: ``(rank bucket, index, nbytes, key, rank)`` of every piece read (checked first).
        direct: per entry, ``(rank bucket, index, source byte)`` when one piece holds all its
            bytes as one run (a view of the piece serves it), else None.
    """

    runs: tuple[tuple[int, int, int, int, int], ...]
    boxed: tuple[tuple[Any, Box, ShardPiece], ...]
    gaps: tuple[tuple[int, int], ...]
    sizes: tuple[tuple[int, int, int, str, int], ...]
    direct: tuple[tuple[int, int, int] | None, ...]


class Spares:
    """Assembly buffers handed out again once nothing holds them: one per byte size, at most
    ``sizes`` sizes and ``max_bytes`` in all (the oldest size goes first).

    A receiver that reads a sharded version's tensors as arrays (a ``WeightsLoader``'s
    callback, which copies them into buffers of its own) lets go of them after each apply; a
    fresh buffer for every version would page-fault its way through every byte again (a
    32 MiB part: ~8,000 faults, about as long as the copy). A buffer is handed out again only
    while nothing but this map refers to it, so a view still held (an ``apply="view"``
    module's weights) is never written over: the next version gets a fresh buffer then.

    Example:
        >>> spares = Spares(2)
        >>> a = spares.take(8); a_ptr = a.ctypes.data; del a
        >>> spares.take(8).ctypes.data == a_ptr
        True
    """

    def __init__(self, sizes: int, max_bytes: int = 2**30) -> None:
        self._sizes = sizes
        self._max_bytes = max_bytes
        self._buffers: dict[int, list[Any]] = {}  # nbytes -> [buffer, its references when free]
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes`` (its bytes are whatever was last written there)."""
        with self._lock:
            kept = self._buffers.pop(nbytes, None)
            if kept is not None and sys.getrefcount(kept[0]) == kept[1]:  # nothing else holds it
                self._buffers[nbytes] = kept  # the newest last
                return kept[0]
            if nbytes > self._max_bytes:
                return np.empty(nbytes, dtype=np.uint8)  # not kept: larger than all kept may be
            while self._buffers and (
                len(self._buffers) >= self._sizes
                or nbytes + sum(b[0].nbytes for b in self._buffers.values()) > self._max_bytes
            ):
                del self._buffers[next(iter(self._buffers))]
            kept = self._buffers[nbytes] = [np.empty(nbytes, dtype=np.uint8), 0]
            kept[1] = sys.getrefcount(kept[0])  # counted as above: the list's, and the call's own
            return kept[0]  # type: ignore[no-any-return]


SPARES = Spares(4)
"""The process's spare assembly buffers (receivers' reads of sharded versions)."""

_PLANS: Kept[BucketPlan] = Kept(64)  # per bucket of a layout


def bucket_plan(manifest: Manifest, bucket: int) -> BucketPlan:
    """The :class:`BucketPlan` of ``bucket`` (kept for the layout: its pieces, boxes and entries).

    Example:
        >>> plan = bucket_plan(manifest, 0)       # doctest: +SKIP
        >>> len(plan.runs) + len(plan.boxed)       # doctest: +SKIP
        4
    """
    shards = manifest.shards
    if shards is None:
        raise ValueError("a bucket plan is of a sharded version's bucket; this manifest has no shard map")
    entries = manifest.bucket_entries(bucket)
    key = (
        manifest.bucket_nbytes[bucket],
        tuple((e.key, e.offset, e.nbytes, tuple(e.shape)) for e in entries),
        shards.pieces,
        shards.boxes,
    )
    return _PLANS.get(key, lambda: _plan(shards, entries, manifest.bucket_nbytes[bucket]))


def _plan(shards: ShardMap, entries: Sequence[Any], nbytes: int) -> BucketPlan:
    by_key: dict[str, list[ShardPiece]] = {}
    for p in shards.pieces:
        if p.numel:
            by_key.setdefault(p.key, []).append(p)
    boxes = {k: (o, n) for k, o, n in shards.boxes}
    runs, boxed, gaps, sizes, direct = [], [], [], [], []
    end = 0
    for entry in entries:
        if end < entry.offset:
            gaps.append((end, entry.offset))
        end = max(end, entry.offset + entry.nbytes)
        one: list[tuple[int, int, int] | None] = []
        if entry.nbytes:
            box = boxes.get(entry.key) or ((0,) * len(entry.shape), tuple(entry.shape))
            itemsize = entry.nbytes // math.prod(entry.shape)
            for p in by_key.get(entry.key, ()):
                common = intersect((p.offsets, p.lengths), box)
                if common is None:
                    continue
                sizes.append((p.bucket, p.index, p.nbytes, p.key, p.rank))
                src, dst = run_in(p.offsets, p.lengths, common), run_in(*box, common)
                if src is None or dst is None:
                    boxed.append((entry, box, p))
                    one.append(None)
                    continue
                runs.append((p.bucket, p.index, src * itemsize, entry.offset + dst * itemsize,
                             math.prod(common[1]) * itemsize))  # fmt: skip
                one.append((p.bucket, p.index, src * itemsize) if common == box else None)
        direct.append(one[0] if len(one) == 1 else None)
    if end < nbytes:
        gaps.append((end, nbytes))
    return BucketPlan(tuple(runs), tuple(boxed), tuple(gaps), tuple(sizes), tuple(direct))


def run_in(offsets: Sequence[int], lengths: Sequence[int], inner: Box) -> int | None:
    """Where ``inner`` starts among the row-major elements of the box ``(offsets, lengths)``,
    if it is one run of them (else None).

    Example:
        >>> run_in((0, 0), (4, 3), ((1, 0), (2, 3)))   # rows 1-2 of a 4x3 box: elements 3-8
        3
        >>> run_in((0, 0), (4, 3), ((1, 0), (2, 2))) is None
        True
    """
    start, stride, narrowed = 0, 1, False
    for d in reversed(range(len(lengths))):
        if narrowed and inner[1][d] != 1:
            return None
        start += (inner[0][d] - offsets[d]) * stride
        stride *= lengths[d]
        narrowed = narrowed or inner[1][d] != lengths[d]
    return start


def check_sizes(plan: BucketPlan, rank_buckets: RankBuckets) -> None:
    """Raise ``ValueError`` unless every piece a bucket's ``plan`` reads arrived with the bytes the
    manifest says."""
    for b, i, nbytes, key, rank in plan.sizes:
        data = rank_buckets[b][i]
        if data.nbytes != nbytes:
            raise ValueError(
                f"rank {rank}'s piece of {key!r} arrived with {data.nbytes} bytes, the manifest says {nbytes}"
            )


def fill(
    plan: BucketPlan,
    rank_buckets: RankBuckets,
    flat: Any,
    as_array: Callable[[np.ndarray], Any] = lambda a: a,
) -> None:
    """Write a bucket's tensors into ``flat`` (uint8, the bucket's span) from their pieces, as its
    ``plan`` (:func:`bucket_plan`) says; gaps zeroed.

    ``flat``: a numpy array, or a torch tensor (on any device) with ``as_array=torch.from_numpy``.
    """
    arrays: dict[tuple[int, int], Any] = {}

    def source(b: int, i: int) -> Any:
        found = arrays.get((b, i))
        if found is None:
            found = arrays[b, i] = as_array(np.asarray(rank_buckets[b][i]).reshape(-1).view(np.uint8))
        return found

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # object-store arrays are read-only; only read here
        for start, end in plan.gaps:
            flat[start:end] = 0
        for b, i, src, dst, n in plan.runs:
            flat[dst : dst + n] = source(b, i)[src : src + n]
        for entry, box, piece in plan.boxed:
            itemsize = entry.nbytes // math.prod(entry.shape)
            whole = flat[entry.offset : entry.offset + entry.nbytes].reshape(*entry.shape, itemsize)
            _place(whole, box, piece, source(piece.bucket, piece.index).reshape(*piece.lengths, itemsize))


def _place(whole: Any, box: Box, piece: ShardPiece, src: Any) -> None:
    """Copy the part of one piece (``src``, ``(*lengths, itemsize)`` uint8) inside ``box`` into
    ``whole`` (the box as ``(*n, itemsize)`` uint8)."""
    common = intersect((piece.offsets, piece.lengths), box)
    assert common is not None
    spans = list(enumerate(zip(*common, strict=True)))
    into = tuple(slice(o - box[0][d], o - box[0][d] + n) for d, (o, n) in spans)
    out = tuple(slice(o - piece.offsets[d], o - piece.offsets[d] + n) for d, (o, n) in spans)
    whole[into] = src[out]

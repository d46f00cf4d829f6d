"""Sharded versions: what each trainer rank sends, and how the hub makes one version of them.

A trainer whose weights are ``DTensor``\\ s pushes from every rank: each rank lays out and
puts only the pieces it holds (:func:`raysync.core.dtensor.local_part`) and sends the hub a
:class:`ShardPart`. Once every rank's part is in, :func:`merge` checks that the ranks agree
(same tensors, shapes, dtypes, placements) and that their pieces tile every tensor exactly
once, then lays the *whole* tensors out as one plain :class:`~raysync.core.layout.Manifest`
(what receivers bind to and check against their models) whose :attr:`Manifest.shards`
(a :class:`ShardMap`) says where each piece's bytes live. Receivers fetch through the
``"sharded"`` data path (:mod:`raysync.transports.sharded`), which assembles whole tensors
from exactly the rank buckets that hold them.

Torch-free: the hub runs :func:`merge`.

Example:
    >>> manifest, refs = merge([(part0, refs0), (part1, refs1)])   # doctest: +SKIP
    >>> manifest.shards.pieces_of("w")                             # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raysync.core.kept import Kept
from raysync.core.layout import DEFAULT_BUCKET_BYTES, Manifest, plan_specs
from raysync.errors import InvalidWeightsError

__all__ = [
    "SHARDED",
    "Box",
    "ShardMap",
    "ShardPart",
    "ShardPiece",
    "ShardRefs",
    "TensorSpec",
    "chunk",
    "merge",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, lengths)``: a box of a tensor, per dimension."""

SHARDED = "sharded"
"""The data path name a merged sharded version carries (``Manifest.transport``)."""


@dataclass(frozen=True)
class TensorSpec:
    """What a rank says of one tensor of the model; every rank must say the same.

    Attributes:
        key: the tensor's name, as in ``state_dict()``.
        shape: its global shape (the whole tensor).
        dtype: its dtype's name without ``torch.``.
        itemsize: bytes per element.
        placement: how it is laid out over the ranks, e.g.
            ``"(Shard(dim=0),) over mesh (2,)"``; ``"plain"`` for a tensor that is
            not a ``DTensor`` (taken from group rank 0).
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    placement: str

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class ShardPiece:
    """One rank's piece of one tensor: a box of the global tensor, and where its bytes are.

    Attributes:
        key: the tensor.
        rank: the group rank that put it.
        bucket: the bucket that holds it (in a :class:`ShardPart`: of that rank's own
            layout; in a :class:`ShardMap`: of the version, every rank's buckets in rank order).
        index: its buffer's position in the bucket.
        nbytes: its bytes.
        offsets: where the box starts, per dimension of the global tensor.
        lengths: the box's size per dimension.
    """

    key: str
    rank: int
    bucket: int
    index: int
    nbytes: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the piece."""
        return math.prod(self.lengths)


@dataclass(frozen=True)
class ShardPart:
    """What one rank of a sharded trainer sends the hub for one push.

    Attributes:
        round: the how-many-th push of this model by this rank over its process group
            (every push counts, one that raised too); the hub matches the ranks' parts of
            one version by it, within one ``group``.
        rank: this rank's place in the group (0 .. world - 1).
        world: how many ranks hold the model's shards (the ``DTensor``\\ s' mesh).
        specs: every tensor of the model, as this rank sees it (sorted by key).
        manifest: the layout of this rank's own buckets (its pieces, keyed by tensor).
        pieces: its pieces, ``bucket`` in its own layout.
        bucket_bytes: the bucket size the whole-tensor layout uses.
        separate: the keys laid out in buckets of their own, apart from the others (in the
            rank's layout and the whole one), once ``keys=`` pushed them: a receiver then
            fetches only their buckets of a ``keys=`` push.
        group: the token of the rank's group (:mod:`raysync.core.group`), the same on every rank.
    """

    round: int
    rank: int
    world: int
    specs: tuple[TensorSpec, ...]
    manifest: Manifest
    pieces: tuple[ShardPiece, ...]
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    separate: tuple[str, ...] = ()
    group: str = ""


@dataclass(frozen=True)
class ShardMap:
    """Where a sharded version's bytes live: the ranks' buckets and every tensor's pieces.

    Attributes:
        world: ranks that pushed it.
        transport: the data path of the ranks' buckets (``"object_store"``).
        bucket_ranks: the rank of each rank bucket (rank 0's buckets first).
        bucket_nbytes: the span of each rank bucket.
        pieces: every piece, sorted by key, then offsets; a replicated tensor has one
            piece (one rank's copy), a ``Shard(d)`` tensor one per rank holding elements.
        placements: ``(key, placement)`` of each tensor on the trainer.
        boxes: ``(key, offsets, lengths)`` of the tensors a receiver takes only part of
            (:func:`reshard`); the manifest's entries are then those parts. Empty: whole tensors.
        checksums: one CRC32 per rank bucket when every rank pushed with ``checksum=True``
            (receivers that verify check the rank buckets they fetch, before assembling).

    Example:
        >>> [p.rank for p in manifest.shards.pieces_of("w")]    # doctest: +SKIP
        [0, 1]
    """

    world: int
    transport: str
    bucket_ranks: tuple[int, ...]
    bucket_nbytes: tuple[int, ...]
    pieces: tuple[ShardPiece, ...]
    placements: tuple[tuple[str, str], ...]
    boxes: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    checksums: tuple[int, ...] | None = None

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # Pickled once per object (the hub keeps one per layout, and sends it to every receiver of
        # every version); a receiver unpickles each layout's once (see _shard_map_from)
        blob = self.__dict__.get("_pickled")
        if blob is None:
            fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
            blob = pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)
            object.__setattr__(self, "_pickled", blob)
        return _shard_map_from, (blob,)

    def pieces_of(self, key: str) -> list[ShardPiece]:
        """The pieces of one tensor."""
        return [p for p in self.pieces if p.key == key]

    def buckets_of(self, keys: Sequence[str]) -> list[int]:
        """The rank buckets that hold any byte of ``keys`` (of their boxes, in a view), sorted."""
        wanted = set(keys)
        boxes = {k: (o, n) for k, o, n in self.boxes}
        out = set()
        for p in self.pieces:
            if p.key in wanted and p.numel:
                box = boxes.get(p.key)
                if box is None or intersect((p.offsets, p.lengths), box) is not None:
                    out.add(p.bucket)
        return sorted(out)


_MAPS: Kept[ShardMap] = Kept(16)  # the shard maps unpickled in this process, by their bytes


def _shard_map_from(blob: bytes) -> ShardMap:
    """A pickled :class:`ShardMap`: the one unpickled before from the same bytes, if kept (every
    version of a layout carries the same map; its pieces, and the bucket plans keyed on them, stay)."""

    def load() -> ShardMap:
        shard_map = ShardMap(*pickle.loads(blob))
        object.__setattr__(shard_map, "_pickled", blob)
        return shard_map

    return _MAPS.get(blob, load)


class ShardRefs:
    """The ref of one whole-tensor bucket of a sharded version: the rank buckets it is made of.

    The hub, relays and receivers treat it as any bucket's ref (it travels inside their
    messages; Ray tracks the ``ObjectRef``\\ s in it); :meth:`hex` is its identity.

    Example:
        >>> ShardRefs((0, 2), (ref0, ref2)).hex()   # doctest: +SKIP
    """

    __slots__ = ("buckets", "refs")

    def __init__(self, buckets: tuple[int, ...], refs: tuple[Any, ...]) -> None:
        self.buckets = buckets
        self.refs = refs

    def hex(self) -> str:
        """Same rank buckets, same id: a digest of their objects' ids."""
        return hashlib.sha1(",".join(r.hex() for r in self.refs).encode()).hexdigest()

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardRefs, (self.buckets, self.refs))

    def __repr__(self) -> str:
        return f"ShardRefs(buckets={self.buckets})"


def merge(parts: Sequence[tuple[ShardPart, Sequence[Any]]]) -> tuple[Manifest, list[ShardRefs]]:
    """One version of every rank's part: the whole-tensor manifest and one ref per its bucket.

    What depends only on the ranks' layouts (the checks that they agree and that their pieces
    tile every tensor, the whole-tensor layout, the shard map) is worked out once per layout
    and kept: each later version of it costs a lookup, its refs and checksums.

    Args:
        parts: ``(part, refs)`` of every rank (``refs``: one per bucket of its own layout).

    Raises:
        InvalidWeightsError: a rank missing or twice, ranks that disagree on the tensors
            or their layout, or pieces that leave part of a tensor uncovered or cover it
            twice (each message names the tensor).
    """
    by_rank: dict[int, tuple[ShardPart, Sequence[Any]]] = {}
    for part, refs in parts:
        if part.rank in by_rank:
            raise InvalidWeightsError(f"rank {part.rank} pushed its shards twice for one version")
        by_rank[part.rank] = (part, refs)
    world = parts[0][0].world if parts else 0
    missing = sorted(set(range(world)) - set(by_rank))
    if missing or any(p.world != world for p, _ in parts):
        raise InvalidWeightsError(
            f"a sharded version needs one part from each of {world} ranks: missing {missing}, worlds "
            f"{sorted({p.world for p, _ in parts})}"
        )
    ordered = [by_rank[r][0] for r in range(world)]
    sums = [p.manifest.checksums for p in ordered]
    without = [r for r in range(world) if sums[r] is None]
    if 0 < len(without) < world:
        raise InvalidWeightsError(
            f"the ranks of a sharded push disagree on checksum=: ranks {without} pushed none, the "
            f"others did (every rank passes the same checksum=)"
        )
    for rank, part in enumerate(ordered):
        sent = len(by_rank[rank][1])
        if sent != part.manifest.num_buckets:
            raise InvalidWeightsError(
                f"rank {rank} sent {sent} bucket refs for {part.manifest.num_buckets} buckets"
            )
    key = tuple(
        (p.specs, p.pieces, p.manifest.layout_hash, p.manifest.bucket_nbytes, p.manifest.transport,
         p.bucket_bytes, p.separate)
        for p in ordered
    )  # fmt: skip
    whole, rank_buckets = _MERGED.get(key, lambda: _merge_layout(ordered))
    assert whole.shards is not None
    shard_map = whole.shards
    if sums[0] is not None:
        shard_map = dataclasses.replace(shard_map, checksums=tuple(c for s in sums for c in s or ()))
    manifest = dataclasses.replace(whole, extra_state=ordered[0].manifest.extra_state, shards=shard_map)
    all_refs = [ref for rank in range(world) for ref in by_rank[rank][1]]
    refs_out = [ShardRefs(rb, tuple(all_refs[i] for i in rb)) for rb in rank_buckets]
    return manifest, refs_out


_MERGED: Kept[tuple[Manifest, tuple[tuple[int, ...], ...]]] = Kept(16)  # per layout of the ranks' parts


def _merge_layout(ordered: Sequence[ShardPart]) -> tuple[Manifest, tuple[tuple[int, ...], ...]]:
    """:func:`merge`'s part that depends on the ranks' layouts alone: the whole-tensor manifest
    (its shard map without checksums, no extra state) and the rank buckets of each whole bucket."""
    world = len(ordered)
    first = ordered[0]
    specs = {s.key: s for s in first.specs}
    for rank in range(1, world):
        _agree(specs, ordered[rank], first.rank)
    apart = {r: ordered[r].separate for r in range(world)}
    if len(set(apart.values())) != 1:
        raise InvalidWeightsError(
            f"the ranks of a sharded push disagree on the keys pushed apart (keys=): {apart}; every rank "
            "passes the same keys="
        )
    transports = {p.manifest.transport for p in ordered}
    if len(transports) != 1:
        raise InvalidWeightsError(
            f"the ranks of a sharded push used different data paths: {sorted(transports)}"
        )
    # every rank's buckets, in rank order
    pieces: list[ShardPiece] = []
    bucket_ranks: list[int] = []
    bucket_nbytes: list[int] = []
    for rank, part in enumerate(ordered):
        base = len(bucket_ranks)
        for p in part.pieces:
            if p.rank != rank:
                raise InvalidWeightsError(f"rank {rank} sent a piece of {p.key!r} marked as rank {p.rank}'s")
            if p.key not in specs:
                raise InvalidWeightsError(f"rank {rank} sent a piece of {p.key!r}, a tensor no rank declared")
            pieces.append(ShardPiece(p.key, rank, base + p.bucket, p.index, p.nbytes, p.offsets, p.lengths))
        bucket_ranks += [rank] * part.manifest.num_buckets
        bucket_nbytes += list(part.manifest.bucket_nbytes)
    pieces.sort(key=lambda p: (p.key, p.offsets, p.rank))
    _check_cover(specs, pieces)
    whole = plan_specs(
        [(s.key, s.shape, s.dtype, s.nbytes) for s in specs.values()],
        bucket_bytes=first.bucket_bytes,
        separate=first.separate,
    )
    shard_map = ShardMap(
        world,
        transports.pop(),
        tuple(bucket_ranks),
        tuple(bucket_nbytes),
        tuple(pieces),
        tuple((k, s.placement) for k, s in sorted(specs.items())),
    )
    # The placements are part of the layout: a receiver keeps its binding only while they hold.
    digest = hashlib.sha1(repr((whole.layout_hash, shard_map.placements, bucket_nbytes)).encode())
    manifest = Manifest(
        whole.entries, whole.bucket_nbytes, digest.hexdigest()[:16], transport=SHARDED, shards=shard_map
    )
    rank_buckets = tuple(
        tuple(shard_map.buckets_of([e.key for e in manifest.bucket_entries(b)]))
        for b in range(manifest.num_buckets)
    )
    return manifest, rank_buckets


def _agree(specs: dict[str, TensorSpec], part: ShardPart, first: int) -> None:
    """Raise unless ``part``'s rank declares the same tensors, each the same, as rank ``first``."""
    theirs = {s.key: s for s in part.specs}
    only_first = sorted(set(specs) - set(theirs))
    only_theirs = sorted(set(theirs) - set(specs))
    if only_first or only_theirs:
        raise InvalidWeightsError(
            f"the ranks of a sharded push disagree on the tensors: rank {first} has {only_first[:10]} that "
            f"rank {part.rank} lacks, rank {part.rank} has {only_theirs[:10]} that rank {first} lacks; "
            "every rank must push the same model"
        )
    for key, spec in specs.items():
        other = theirs[key]
        if other != spec:
            raise InvalidWeightsError(
                f"the ranks of a sharded push disagree on tensor {key!r}: rank {first} has shape "
                f"{spec.shape} {spec.dtype} placed {spec.placement}, rank {part.rank} has shape "
                f"{other.shape} {other.dtype} placed {other.placement}"
            )


def _check_cover(specs: dict[str, TensorSpec], pieces: list[ShardPiece]) -> None:
    """Raise unless each tensor's pieces lie inside it and cover every element exactly once."""
    by_key: dict[str, list[ShardPiece]] = {k: [] for k in specs}
    for p in pieces:
        by_key[p.key].append(p)
    for key, spec in specs.items():
        mine = by_key[key]
        for p in mine:
            inside = len(p.offsets) == len(spec.shape) == len(p.lengths) and all(
                o >= 0 and n >= 0 and o + n <= size
                for o, n, size in zip(p.offsets, p.lengths, spec.shape, strict=True)
            )
            if not inside or p.nbytes != p.numel * spec.itemsize:
                raise InvalidWeightsError(
                    f"rank {p.rank}'s piece of tensor {key!r} (offsets {p.offsets}, lengths {p.lengths}, "
                    f"{p.nbytes} bytes) does not fit its shape {spec.shape}"
                )
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                if a.numel and b.numel and intersect((a.offsets, a.lengths), (b.offsets, b.lengths)):
                    raise InvalidWeightsError(
                        f"tensor {key!r} is pushed twice: ranks {a.rank} and {b.rank} both hold elements "
                        f"from offsets {max(a.offsets, b.offsets)} (a replicated tensor is taken from one "
                        "rank only: check the placements)"
                    )
        covered = sum(p.numel for p in mine)
        if covered != math.prod(spec.shape):
            raise InvalidWeightsError(
                f"tensor {key!r} is missing a shard: the ranks' pieces hold {covered} of its "
                f"{math.prod(spec.shape)} elements"
            )


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """``(start, length)`` of part ``i`` of ``n`` elements cut in ``parts`` as torch's ``Shard`` cuts
    them: ``ceil(n / parts)`` each, the last parts shorter or empty (``chunk(5, 2, 1) == (3, 2)``)."""
    size = -(-n // parts) if n else 0
    start = min(i * size, n)
    return start, max(0, min(n, start + size) - start)


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover (None if they share no element).

    Example:
        >>> intersect(((0,), (4,)), ((2,), (4,)))
        ((2,), (2,))
    """
    offsets, lengths = [], []
    for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(oa, ob), min(oa + na, ob + nb)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return tuple(offsets), tuple(lengths)

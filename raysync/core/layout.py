"""A version's layout: which tensor sits in which bucket at which offset, and its manifest.

A version of a model travels as a few *buckets*: flat byte buffers. :func:`plan_layout`
assigns every tensor a bucket and an offset (the alignment Ray's serializer uses, so a
bucket put as a list of uint8 arrays is one flat buffer on arrival; and a multiple of the
tensor's element size, so every dtype views its bytes in place). A :class:`Manifest`
says what is in the buckets (key, shape, dtype, bucket, offset, bytes) and carries a
``layout_hash`` that changes only when the model's structure does; :func:`validate`
checks a manifest against a model and lists every mismatch.

Example:
    >>> m = plan_layout({"w": torch.zeros(2, 3)})
    >>> m.entries[0].shape, m.total_nbytes
    ((2, 3), 24)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raysync.errors import InvalidWeightsError, WeightMismatchError

if TYPE_CHECKING:  # torch is imported where it is used: the hub process never loads it
    import torch

    from raysync.core.shards import ShardMap

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "EXTRA_STATE_MAX_BYTES",
    "Manifest",
    "SparsePatch",
    "TensorEntry",
    "WeightsLike",
    "cast_floating",
    "plan_layout",
    "plan_specs",
    "schema_of",
    "validate",
]


DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Default bucket size: big enough that a version is a handful of copies."""


EXTRA_STATE_MAX_BYTES = 2**20
"""The most pickled extra state (``get_extra_state()``) one version may carry."""


_EXTRA = "_extra_state"  # where state_dict() puts a module's get_extra_state() (torch's suffix)


# Ray's serializer aligns out-of-band buffers like this (see ray/includes/serialization.pxi):
# to _MAJOR_ALIGN bytes from _MAJOR_SIZE bytes on, to _MINOR_ALIGN below.
_MAJOR_ALIGN = 64
_MINOR_ALIGN = 8
_MAJOR_SIZE = 2048


# Elements wider than Ray's minor alignment, by dtype name: torch views a byte buffer as a
# dtype only at an offset that is a multiple of its element size. Only needed for tensors
# with no elements (the others' element size is nbytes / numel).
_WIDE_ELEMENTS = {"complex128": 16}


WeightsLike = Any  # nn.Module | TensorDictBase | Mapping[str, Tensor | Mapping]


_Spec = tuple[str, tuple[int, ...], str, int]  # (key, shape, dtype name, nbytes): what plan_specs lays out


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a version.

    Attributes:
        key: dotted name, as in ``state_dict()``.
        shape: the tensor's shape.
        dtype: the dtype's name without ``torch.`` (``"bfloat16"``).
        bucket: index of the bucket that holds it.
        index: position of its buffer in the bucket's list.
        offset: byte offset from the start of the bucket.
        nbytes: its size in bytes.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    index: int
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """The entry's dtype as a ``torch.dtype``."""
        return _dtype_from_name(self.dtype)


@dataclass(frozen=True)
class SparsePatch:
    """A changed bucket's patch (``delta="sparse"``): its changed elements against a base bucket.

    Attributes:
        bucket: the bucket it rebuilds.
        base_version: the version whose bucket it applies to.
        base_id: that bucket's identity (its object's id, as receivers hold it).
        ref: the patch's object (:mod:`raysync.core.sparse` encodes it).
        nbytes: the patch's bytes.
        crc: CRC32 of the whole new bucket (as ``checksum=True`` gives it): a rebuild is checked by it.
        changed: elements changed.
    """

    bucket: int
    base_version: int
    base_id: str
    ref: Any
    nbytes: int
    crc: int
    changed: int


@dataclass(frozen=True)
class Manifest:
    """The description of one version's buckets; small, picklable, torch-free.

    Attributes:
        entries: one :class:`TensorEntry` per tensor, sorted by key.
        bucket_nbytes: the span of each bucket in bytes (padding included).
        layout_hash: changes exactly when keys, shapes, dtypes or the bucket
            plan change.
        checksums: one CRC32 per bucket when the pusher asked for them.
        transport: how the bucket bytes travel: ``"object_store"`` (each
            bucket a list of uint8 arrays in Ray's object store) or ``"nixl"``
            (each bucket one flat uint8 tensor sent by Ray's NIXL transport).
        extra_state: ``(key, pickled object)`` per submodule with extra state
            (``get_extra_state()``; the key is its ``state_dict()`` key, such
            as ``"norm._extra_state"``), sorted by key. Not part of
            ``layout_hash``: it may change from version to version.
        shards: for a version pushed by a sharded trainer (every rank its own
            shard; ``transport="sharded"``), where each piece of each tensor
            lives in the ranks' buckets (:class:`~raysync.core.shards.ShardMap`);
            ``entries`` and ``bucket_nbytes`` then describe the whole tensors
            receivers get. None for a version of one writer.
        order: the pushed weights' own key order (their ``state_dict()`` order), as
            indices into ``entries``; None when it is the sorted order (or unknown).
            Not part of ``layout_hash``. :meth:`pushed_keys` reads it.
        patches: for buckets of a ``delta="sparse"`` push, their patches (:class:`SparsePatch`):
            a receiver holding a patch's base bucket may fetch the patch instead of the bucket.

    Example:
        >>> m = plan_layout({"w": torch.zeros(2, 3)})
        >>> m.entries[0].shape, m.total_nbytes
        ((2, 3), 24)
    """

    entries: tuple[TensorEntry, ...]
    bucket_nbytes: tuple[int, ...]
    layout_hash: str
    checksums: tuple[int, ...] | None = None
    transport: str = "object_store"
    extra_state: tuple[tuple[str, bytes], ...] = ()
    shards: ShardMap | None = None
    order: tuple[int, ...] | None = None
    patches: tuple[SparsePatch, ...] = ()

    @property
    def num_buckets(self) -> int:
        """How many buckets (Ray objects) a version has."""
        return len(self.bucket_nbytes)

    @property
    def total_nbytes(self) -> int:
        """Bytes of tensor data in a version (padding excluded)."""
        return sum(e.nbytes for e in self.entries)

    def pushed_keys(self) -> list[str]:
        """The tensor keys in the pushed weights' own order (see ``order``; sorted if unknown)."""
        return self.keys() if self.order is None else [self.entries[i].key for i in self.order]

    def with_order(self, keys: Sequence[str]) -> Manifest:
        """A copy carrying ``keys`` (every entry's key once) as the push's key order.

        Example:
            >>> plan_layout({"b": torch.ones(1), "a": torch.ones(1)}).with_order(["b", "a"]).pushed_keys()
            ['b', 'a']
        """
        index = {e.key: i for i, e in enumerate(self.entries)}
        order: tuple[int, ...] | None = tuple(index[k] for k in keys if k in index)
        if order is not None and (len(set(order)) != len(index) or order == tuple(range(len(index)))):
            order = None  # not every key once, or the sorted order itself
        return self if order == self.order else dataclasses.replace(self, order=order)

    def keys(self) -> list[str]:
        """The tensor keys, sorted."""
        return [e.key for e in self.entries]

    def schema(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{key: (shape, dtype_name)}``, the part :func:`validate` compares."""
        return {e.key: (e.shape, e.dtype) for e in self.entries}

    def bucket_entries(self, bucket: int) -> list[TensorEntry]:
        """The entries of one bucket in buffer order."""
        return sorted((e for e in self.entries if e.bucket == bucket), key=lambda e: e.index)

    def with_checksums(self, checksums: Sequence[int] | None) -> Manifest:
        """A copy of this manifest carrying per-bucket checksums (or none)."""
        return dataclasses.replace(self, checksums=tuple(checksums) if checksums is not None else None)

    def with_transport(self, transport: str) -> Manifest:
        """A copy of this manifest for another transport (same layout)."""
        return dataclasses.replace(self, transport=transport)

    def with_extra_state(self, states: Mapping[str, Any]) -> Manifest:
        """A copy of this manifest carrying modules' extra state (see :func:`extract_extra_state`).

        Each object is pickled here, so a version carries the state as it was
        at push time.

        Raises:
            InvalidWeightsError: an object cannot be pickled, or all of them
                take more than :data:`EXTRA_STATE_MAX_BYTES`.

        Example:
            >>> m = plan_layout({"w": torch.zeros(2)}).with_extra_state({"_extra_state": {"steps": 3}})
            >>> m.extra_states()
            {'_extra_state': {'steps': 3}}
        """
        if not states and not self.extra_state:
            return self
        pickled = []
        for key in sorted(states):
            try:
                pickled.append((key, pickle.dumps(states[key], protocol=pickle.HIGHEST_PROTOCOL)))
            except Exception as err:
                raise InvalidWeightsError(
                    f"the extra state of {key!r} (get_extra_state()) cannot be pickled: {err}; return "
                    "plain Python objects and tensors from get_extra_state()"
                ) from err
        total = sum(len(b) for _, b in pickled)
        if total > EXTRA_STATE_MAX_BYTES:
            raise InvalidWeightsError(
                f"the extra state of this version (get_extra_state() of {[k for k, _ in pickled][:5]}) "
                f"takes {total} bytes pickled, more than {EXTRA_STATE_MAX_BYTES}: it travels with every "
                "notification; register large state as buffers instead"
            )
        return dataclasses.replace(self, extra_state=tuple(pickled))

    def extra_states(self) -> dict[str, Any]:
        """The extra state objects this version carries, ``{state_dict key: object}`` (unpickled)."""
        return {key: pickle.loads(data) for key, data in self.extra_state}


def _is_extra_key(key: str) -> bool:
    return key.rpartition(".")[2] == _EXTRA


def schema_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype_name)}`` of a flat tensor dict, comparable with ``Manifest.schema()``.

    Example:
        >>> schema_of({"w": torch.zeros(2, dtype=torch.bfloat16)})
        {'w': ((2,), 'bfloat16')}
    """
    return {k: (tuple(t.shape), _dtype_name(t.dtype)) for k, t in tensors.items()}


def plan_layout(
    tensors: Mapping[str, torch.Tensor],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    separate: Collection[str] = (),
) -> Manifest:
    """Assign every tensor a bucket and an offset.

    Tensors fill buckets in key order; a bucket closes when the next tensor
    would take it past ``bucket_bytes`` (a larger tensor gets a bucket of its
    own). Inside a bucket, small tensors of 16-byte elements (complex128) come
    first, then tensors of 2 KiB or more, then the others: offsets follow Ray's
    alignment of the buffers (64 bytes from 2 KiB, 8 below), so a received bucket
    is laid out as planned, and every tensor starts at a multiple of its element
    size, so it is a view of its bucket whatever its dtype.

    Args:
        tensors: flat ``{key: tensor}`` (see :func:`extract_tensors`).
        bucket_bytes: the target bucket size.
        separate: keys that get buckets of their own, after the others (so a
            partial push of just those keys re-sends only their buckets).

    Returns:
        The manifest (without checksums).

    Example:
        >>> m = plan_layout({"a": torch.zeros(1000), "b": torch.zeros(1000)}, bucket_bytes=4000)
        >>> m.num_buckets
        2
    """
    specs = [
        (k, tuple(t.shape), _dtype_name(t.dtype), t.numel() * t.element_size()) for k, t in tensors.items()
    ]
    return plan_specs(specs, bucket_bytes=bucket_bytes, separate=separate)


def plan_specs(
    specs: Sequence[tuple[str, tuple[int, ...], str, int]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    separate: Collection[str] = (),
) -> Manifest:
    """:func:`plan_layout` from ``(key, shape, dtype name, nbytes)`` alone (no tensors, no torch).

    The hub lays out a sharded version's whole tensors this way (:mod:`raysync.core.shards`).

    Example:
        >>> plan_specs([("w", (2, 3), "float32", 24)]).total_nbytes
        24
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    by_key = {spec[0]: spec for spec in specs}
    apart = set(separate)
    groups: list[list[tuple[str, tuple[int, ...], str, int]]] = []
    for selection in ([k for k in sorted(by_key) if k not in apart], sorted(apart & set(by_key))):
        filled = 0
        start = len(groups)
        for key in selection:
            nbytes = by_key[key][3]
            if len(groups) == start or (groups[-1] and filled + nbytes > bucket_bytes):
                groups.append([])
                filled = 0
            groups[-1].append(by_key[key])
            filled += nbytes
    entries: list[TensorEntry] = []
    spans: list[int] = []
    for b, group in enumerate(groups):
        # Small tensors of elements wider than Ray's minor alignment (complex128) go first, from
        # offset 0: each then starts at a multiple of its element size both here and where Ray
        # puts it, so buckets stay views of the store and every tensor a view of its bucket.
        wide: list[tuple[_Spec, int]] = []  # (spec, its alignment)
        major: list[tuple[_Spec, int]] = []
        minor: list[tuple[_Spec, int]] = []
        for spec in group:
            size = _element_size(spec)
            if spec[3] >= _MAJOR_SIZE:
                major.append((spec, max(_MAJOR_ALIGN, size)))
            else:
                (wide if size > _MINOR_ALIGN else minor).append((spec, max(_MINOR_ALIGN, size)))
        offset = 0
        for i, ((key, shape, dtype, nbytes), align) in enumerate(wide + major + minor):
            offset = -(-offset // align) * align
            entries.append(TensorEntry(key, tuple(shape), dtype, b, i, offset, nbytes))
            offset += nbytes
        spans.append(offset)
    entries.sort(key=lambda e: e.key)
    digest = hashlib.sha1(repr(([tuple(e.__dict__.values()) for e in entries], spans)).encode())
    return Manifest(tuple(entries), tuple(spans), digest.hexdigest()[:16])


def _element_size(spec: _Spec) -> int:
    """The bytes of one element of a ``(key, shape, dtype name, nbytes)`` spec (torch-free)."""
    _, shape, dtype, nbytes = spec
    numel = math.prod(shape)
    return nbytes // numel if numel else _WIDE_ELEMENTS.get(dtype, 1)


def cast_floating(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast every floating-point tensor to ``dtype`` (integers and bools stay as they are).

    Example:
        >>> cast = cast_floating({"w": torch.ones(2), "n": torch.ones(2, dtype=torch.int64)}, torch.bfloat16)
        >>> cast["w"].dtype, cast["n"].dtype
        (torch.bfloat16, torch.int64)
    """
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}


def validate(
    manifest: Manifest,
    model_schema: Mapping[str, tuple[tuple[int, ...], str | None]] | None,
    *,
    who: str = "the model",
    partial: bool = False,
    accepts: Callable[[str, tuple[int, ...], torch.dtype], bool] | None = None,
    floating: bool = False,
    extra_state: bool = True,
) -> None:
    """Check a version against what a receiver holds; report every problem at once.

    The one mismatch check: a module (its ``{key: (shape, dtype)}``), a
    :class:`~raysync.WeightsLoader` and a vLLM engine (``partial``, with their own rules).

    Args:
        manifest: the version.
        model_schema: ``{key: (shape, dtype name, or None for any)}``; ``None``: any key.
        who: the receiver, as the message names it.
        partial: it takes versions of some of its keys (a loader, an engine): keys it has
            that a version lacks are not missing; keys it does not have are "unknown".
        accepts: ``(name, shape, dtype) -> bool``; the keys it refuses are listed.
        floating: every tensor must be floating point (an engine's loader casts it).
        extra_state: whether it takes ``get_extra_state()`` objects (modules do).

    Raises:
        WeightMismatchError: listing missing, unexpected, mis-shaped and mis-typed keys.

    Example:
        >>> m = plan_layout({"w": torch.zeros(3)})
        >>> validate(m, {"w": ((2,), "float32")})
        Traceback (most recent call last):
        ...
        raysync.errors.WeightMismatchError: weights do not match the model: shape mismatch w: ...
    """
    pushed = manifest.schema()
    held = pushed if model_schema is None else model_schema
    missing = [] if partial else sorted(set(held) - set(pushed))
    unexpected = sorted(set(pushed) - set(held))
    both = sorted(set(pushed) & set(held))
    shapes = {k: (pushed[k][0], tuple(held[k][0])) for k in both if tuple(pushed[k][0]) != tuple(held[k][0])}
    dtypes: dict[str, tuple[Any, Any]] = {
        k: (pushed[k][1], held[k][1]) for k in both if held[k][1] not in (None, pushed[k][1])
    }
    if floating:
        dtypes.update(
            {
                k: (d, "a floating dtype")
                for k, (_, d) in pushed.items()
                if not _dtype_from_name(d).is_floating_point
            }
        )
    refused = [
        k for k, (shape, d) in pushed.items() if accepts and not accepts(k, shape, _dtype_from_name(d))
    ]
    extra = [] if extra_state else [k for k, _ in manifest.extra_state]
    if not (missing or unexpected or shapes or dtypes or refused or extra):
        return
    want = "expected" if partial else "model"
    parts = [f"missing keys {_short(missing)}"] if missing else []
    if unexpected:
        parts.append(f"{'unknown' if partial else 'unexpected'} keys {_short(unexpected)}")
    if refused:
        parts.append(f"refused by expected() {_short(refused)}")
    if extra:
        parts.append(
            f"extra state for {_short(extra)} (get_extra_state() objects), which only a module takes"
        )
    parts += [f"shape mismatch {k}: pushed {a}, {want} {b}" for k, (a, b) in list(shapes.items())[:10]]
    parts += [f"dtype mismatch {k}: pushed {a}, {want} {b}" for k, (a, b) in list(dtypes.items())[:10]]
    raise WeightMismatchError(
        f"weights do not match {who}: " + "; ".join(parts),
        missing=missing,
        unexpected=unexpected + refused + extra,
        shape_mismatch=shapes,
        dtype_mismatch=dtypes,
    )


def _short(keys: list[str], limit: int = 20) -> str:
    return repr(keys) if len(keys) <= limit else f"{keys[:limit]!r} and {len(keys) - limit} more"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidWeightsError(f"unknown dtype {name!r} in a manifest")
    return dtype

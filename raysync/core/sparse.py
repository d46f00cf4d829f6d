"""Sparse deltas (``hub.push(..., delta="sparse")``): a changed bucket as a patch against its base.

After an optimizer step at a small learning rate most elements of a bf16 copy of the weights keep
their bits. The pusher compares each changed bucket with its previous version's bytes, element
by element at each tensor's element size (bf16: 2 bytes), and when few changed
(:data:`MAX_DENSITY`) puts, besides the whole bucket, a patch: the changed elements' indices and
new values (:func:`encode`). A receiver holding the base bucket rebuilds the new one from its own
bytes and the patch (:func:`rebuild`), checked against the CRC32 of the whole new bucket:
lossless, bit for bit the bucket a full push sends.

A patch is a list of numpy arrays (what ``ray.put`` stores and ``ray.get`` returns, never
unpickled by raysync): a header (int64: format, rows, then per tensor changed: its buffer index
in the bucket, how many elements changed, the element size, the index width), then per row its
indices and its new values (the elements as unsigned integers of the element size). Indices are
gaps (width 2: uint16, each the distance from the previous changed element, the first counted
from -1, so every gap is at least 1) where every gap fits, else absolute (width 4: int32; 8:
int64 past 2**31 elements; sorted, unique). Either way they are checked in range, sorted and
unique before any byte is written. Numpy and zlib only: no torch.

Example:
    >>> patch = encode(manifest, 0, new_bucket, old_bucket)               # doctest: +SKIP
    >>> rebuilt = rebuild(manifest, 0, held_flat, patch, crc)             # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from raysync.core.checksums import bucket_checksums
from raysync.core.layout import Manifest, TensorEntry
from raysync.errors import ChecksumError

__all__ = ["MAX_DENSITY", "PatchError", "Rebuilt", "encode", "patch_nbytes", "rebuild"]

MAX_DENSITY = 0.25
"""The largest fraction of a bucket's elements that may have changed for it to get a patch.

A changed element costs its bytes plus a 2-byte gap (bf16: 4 bytes instead of 2; a 4-byte
index where gaps past 65,535 elements occur), so at 25% a patch is half of a bf16 bucket: past
that, fetching the whole bucket costs little more and saves the receiver the rebuild. A patch is
never put when it would be as large as the bucket.
"""

_FORMAT = 1
_ROW = 4  # header fields per row: buffer index, count, element size, index width
_WORDS: dict[int, Any] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INDEX: dict[int, Any] = {2: np.uint16, 4: np.int32, 8: np.int64}  # 2: gaps, else absolute
_STRIDE = 251  # the quick look's sample: every 251st element (a prime: no stride lines up with rows)


class PatchError(ChecksumError):
    """A patch that does not rebuild its bucket: malformed, or the result fails its checksum."""


class Rebuilt(list[Any]):
    """A bucket rebuilt from a patch (its arrays, as a fetched bucket's); ``fetched_nbytes``: the patch's."""

    fetched_nbytes: int = 0


def _word(entry: TensorEntry) -> int:
    """The comparison granularity of an entry: its element size (16-byte elements as two 8-byte words)."""
    numel = math.prod(entry.shape)
    size = entry.nbytes // numel if numel else 1
    return size if size in _WORDS else 8


def _elements(entries: Sequence[TensorEntry]) -> int:
    return sum(e.nbytes // _word(e) for e in entries)


def encode(
    manifest: Manifest, bucket: int, new: Sequence[np.ndarray], old: Sequence[np.ndarray]
) -> tuple[list[np.ndarray], int] | None:
    """The patch turning bucket ``bucket``'s ``old`` arrays into ``new``, and the elements changed;
    ``([], 0)`` when they are equal bit for bit; None when more than :data:`MAX_DENSITY` of them
    changed or the patch would not be smaller than the bucket.

    Example:
        >>> encode(manifest, 0, pack(new, manifest)[0], pack(old, manifest)[0])   # doctest: +SKIP
    """
    entries = manifest.bucket_entries(bucket)
    limit = MAX_DENSITY * _elements(entries)
    if _sampled_density(entries, new, old) > 2 * MAX_DENSITY:
        return None  # far too many changed: not worth comparing every element
    header: list[int] = [_FORMAT, 0]
    parts: list[np.ndarray] = []
    changed = 0
    for i, entry in enumerate(entries):
        if not entry.nbytes:
            continue
        word = _WORDS[_word(entry)]
        a, b = np.asarray(new[i]).view(word), np.asarray(old[i]).view(word)
        index = np.flatnonzero(a != b)
        if not index.size:
            continue
        changed += int(index.size)
        if changed > limit:
            return None
        width, indices = _indices(index, a.size)
        header += [i, int(index.size), _word(entry), width]
        parts += [indices, a[index]]
    if not changed:
        return [], 0
    header[1] = (len(header) - 2) // _ROW
    patch = [np.array(header, dtype=np.int64), *parts]
    if patch_nbytes(patch) >= manifest.bucket_nbytes[bucket]:
        return None
    return patch, changed


def _indices(index: np.ndarray, numel: int) -> tuple[int, np.ndarray]:
    """``(width, indices)`` of a row: uint16 gaps where every gap fits, else absolute indices."""
    gaps = np.diff(index, prepend=-1)
    if int(gaps.max()) <= np.iinfo(np.uint16).max:
        return 2, gaps.astype(np.uint16)
    return (4, index.astype(np.int32)) if numel < 2**31 else (8, index.astype(np.int64))


def _sampled_density(
    entries: Sequence[TensorEntry], new: Sequence[np.ndarray], old: Sequence[np.ndarray]
) -> float:
    """The fraction of changed elements among every :data:`_STRIDE`-th of each large tensor (a quick
    look; small tensors are left to the full comparison)."""
    seen = changed = 0
    for i, entry in enumerate(entries):
        if entry.nbytes // _word(entry) >= 64 * _STRIDE:
            word = _WORDS[_word(entry)]
            a, b = np.asarray(new[i]).view(word)[::_STRIDE], np.asarray(old[i]).view(word)[::_STRIDE]
            seen, changed = seen + a.size, changed + int(np.count_nonzero(a != b))
    return changed / seen if seen else 0.0


def patch_nbytes(patch: Sequence[np.ndarray]) -> int:
    """The bytes a patch takes."""
    return sum(int(p.nbytes) for p in patch)


def rebuild(manifest: Manifest, bucket: int, held: np.ndarray, patch: Any, crc: int) -> Rebuilt:
    """Bucket ``bucket`` rebuilt from ``held`` (the base bucket's bytes, flat uint8, padding
    included) and ``patch``, into new memory; ``held`` is only read.

    Raises:
        PatchError: the patch is malformed (any index out of range, unsorted or repeated; a row
            that does not fit its tensor) or the bucket rebuilt fails ``crc``.
    """
    entries = manifest.bucket_entries(bucket)
    size = manifest.bucket_nbytes[bucket]
    if held.dtype != np.uint8 or held.ndim != 1 or held.size != size:
        raise PatchError(f"the base of bucket {bucket} held here is not {size} bytes")
    rows = _rows(patch, entries, bucket)
    out = np.empty(size, dtype=np.uint8)
    np.copyto(out, held)
    for i, index, values in rows:
        entry = entries[i]
        out[entry.offset : entry.offset + entry.nbytes].view(values.dtype)[index] = values
    arrays = Rebuilt(out[e.offset : e.offset + e.nbytes] for e in entries)
    arrays.fetched_nbytes = patch_nbytes(patch)
    if bucket_checksums([arrays])[0] != crc:
        raise PatchError(f"bucket {bucket} rebuilt from its patch fails its checksum")
    return arrays


def _rows(
    patch: Any, entries: Sequence[TensorEntry], bucket: int
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The patch's rows ``(buffer index, indices, values)``, every field checked before any is used."""

    def bad(why: str) -> PatchError:
        return PatchError(f"the patch of bucket {bucket} is malformed: {why}")

    if not isinstance(patch, list) or not patch or not all(isinstance(p, np.ndarray) for p in patch):
        raise bad("not a list of arrays")
    header = patch[0]
    if header.dtype != np.int64 or header.ndim != 1 or header.size < 2 or int(header[0]) != _FORMAT:
        raise bad("no header of this format")
    count = int(header[1])
    if count < 0 or header.size != 2 + _ROW * count or len(patch) != 1 + 2 * count:
        raise bad("its header does not match its parts")
    rows, last = [], -1
    for r in range(count):
        i, n, word, width = (int(x) for x in header[2 + _ROW * r : 2 + _ROW * (r + 1)])
        if not last < i < len(entries) or not entries[i].nbytes:
            raise bad(f"row {r} names no tensor after the previous row's")
        last = i
        if word != _word(entries[i]) or width not in _INDEX:
            raise bad(f"row {r}'s element size or index width does not fit {entries[i].key!r}")
        index, values = patch[1 + 2 * r], patch[2 + 2 * r]
        numel = entries[i].nbytes // word
        if index.dtype != _INDEX[width] or index.ndim != 1 or index.size != n or n < 1:
            raise bad(f"row {r}'s indices are not {n} of {np.dtype(_INDEX[width]).name}")
        if values.dtype != _WORDS[word] or values.ndim != 1 or values.size != n:
            raise bad(f"row {r}'s values are not {n} of uint{8 * word}")
        if width == 2:  # gaps, each at least 1: sorted and unique by construction
            index = np.cumsum(index, dtype=np.int64) - 1 if bool(np.all(index)) else index[:0]
        if (
            index.size != n
            or int(index[0]) < 0
            or int(index[-1]) >= numel
            or (width != 2 and n > 1 and not bool(np.all(index[1:] > index[:-1])))
        ):
            raise bad(f"row {r}'s indices are not sorted, unique and below {numel}")
        rows.append((i, index, values))
    return rows

"""The doorbell's wire format: rings, acks and segment headers as fixed, versioned binary records.

Everything here crosses a process boundary outside Ray's authenticated calls (a Unix
socket, a shared-memory segment), so it is decoded as untrusted input:
no pickle and no other format that can run code while decoding; every field is
bounded and checked; a record that does not parse raises :class:`WireError` and
is dropped by the caller. Rings and acks end with a keyed BLAKE2b MAC (32 bytes)
over everything before it, made with the receiving process's doorbell key, which
reached the ringer only through Ray's authenticated calls (the subscriber's
registration with the hub, the hub's delivery to the relay).

Layouts (little-endian; ``str`` is a ``u16`` byte length then UTF-8):

- ring: ``b"RSRG" u16 wire u16 flags u64 token i64 version u64 size u64 inode
  u64 device u16 n`` then ``str model_id, n x str sub_id``, MAC.
  ``size``/``inode``/``device`` name the sealed segment sent with it (SCM_RIGHTS).
- ack: ``b"RSAK" u16 wire u16 flags u64 token i64 version``, then the rows of
  subscriptions that applied the version and the other acks, MAC.
- segment header: ``u64 length`` then ``b"RSSG" u16 wire u16 flags i64 version
  str model_id``, the layout (``u32`` length, then entries, bucket sizes, layout
  hash, transport), the checksums, bucket ids and array sizes.

Example:
    >>> key = bytes(32)
    >>> data = encode_ring(key, Ring(1, "policy", 3, ("a:policy",), 64, 7, 9))
    >>> decode_ring(key, data).version
    3
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

from raysync._protocol import ApplyReport, RelayAck, RelayReply, Ring
from raysync.core.kept import Kept
from raysync.transports.doorbell.fields import (
    ACK,
    I64,
    MAX_BUCKETS,
    MAX_DIMS,
    MAX_ENTRIES,
    MAX_ERROR,
    MAX_SUBS,
    RING,
    SEG,
    U8,
    U16,
    U32,
    U64,
    WIRE_VERSION,
    Reader,
    WireError,
    Writer,
)

__all__ = [
    "KEY_BYTES",
    "MAC_BYTES",
    "MAX_MESSAGE",
    "WIRE_VERSION",
    "WireError",
    "ack_token",
    "decode_ack",
    "decode_ring",
    "decode_segment_header",
    "encode_ack",
    "encode_ring",
    "encode_segment_header",
    "mac",
]


KEY_BYTES = 32
MAC_BYTES = 32
MAX_MESSAGE = 64 * 1024
"""The largest ring or ack accepted (a ring is split to stay below it)."""


_OUTCOMES = ("ok", "died", "unreachable", "failed", "unknown")

# ApplyReport fields, in wire order: optional ints, optional floats, flags.
_INT_FIELDS = (
    "applied",
    "skipped",
    "deferred",
    "failed",
    "lost",
    "buckets_fetched",
    "bytes_fetched",
    "modified_since",
)
_FLOAT_FIELDS = ("apply_s", "pause_s")
_BOOL_FIELDS = ("reset", "timed_out", "prefetched")


def mac(key: bytes, data: bytes | memoryview) -> bytes:
    """The MAC of ``data`` under ``key`` (keyed BLAKE2b, 32 bytes).

    Example:
        >>> len(mac(bytes(32), b"ring"))
        32
    """
    return hashlib.blake2b(data, key=key, digest_size=MAC_BYTES).digest()


def _sealed(key: bytes, body: bytes) -> bytes:
    data = body + mac(key, body)
    if len(data) > MAX_MESSAGE:
        raise WireError(f"a record of {len(data)} bytes is over the wire's limit of {MAX_MESSAGE}")
    return data


def encode_ring(key: bytes, ring: Ring) -> bytes:
    """A ring as a message, MAC'd with the receiving process's doorbell ``key``.

    Raises:
        WireError: a field is over its limit (the caller splits or calls the Ray way).
    """
    if len(ring.sub_ids) > MAX_SUBS:
        raise WireError(f"{len(ring.sub_ids)} subscriptions in one ring, over {MAX_SUBS}")
    out = Writer()
    out.put(
        RING,
        b"RSRG",
        WIRE_VERSION,
        0,
        ring.token,
        ring.version,
        ring.segment_size,
        ring.segment_inode,
        ring.segment_device,
        len(ring.sub_ids),
    )
    out.text(ring.model_id)
    for sub_id in ring.sub_ids:
        out.text(sub_id)
    return _sealed(key, out.bytes())


def encode_ack(key: bytes, token: int, version: int, reply: RelayReply) -> bytes:
    """A subscriber process's acks of one ring (``reply`` as :func:`~raysync._protocol.compact`
    makes it), MAC'd with its doorbell ``key``."""
    out = Writer()
    out.put(ACK, b"RSAK", WIRE_VERSION, 0, token, version)
    out.put(U16, len(reply.applied))
    for sub_id, apply_s, pause_s, buckets, nbytes in reply.applied:
        out.text(sub_id)
        out.opt_float(apply_s)
        out.opt_float(pause_s)
        out.opt_int(buckets)
        out.opt_int(nbytes)
    out.put(U16, len(reply.acks))
    for ack in reply.acks:
        out.text(ack.sub_id)
        out.put(U8, _OUTCOMES.index(ack.outcome))
        out.text(_error_text(ack.error), MAX_ERROR * 2)
        report = ack.report
        out.put(U8, report is not None)
        if report is not None:
            for name in _INT_FIELDS:
                out.opt_int(getattr(report, name))
            for name in _FLOAT_FIELDS:
                out.opt_float(getattr(report, name))
            out.put(U8, sum(1 << i for i, name in enumerate(_BOOL_FIELDS) if getattr(report, name)))
            out.text(_error_text(report.error), MAX_ERROR * 2)
    return _sealed(key, out.bytes())


def _error_text(err: BaseException | None) -> str:
    if err is None:
        return ""
    text = f"{type(err).__name__}: {err}"
    return text.encode("utf-8")[:MAX_ERROR].decode("utf-8", "ignore")


def _opened(key: bytes, data: bytes | memoryview, magic: bytes) -> Reader:
    """Check length, magic, wire version and MAC; a reader over the body."""
    if not MAC_BYTES + 8 <= len(data) <= MAX_MESSAGE:
        raise WireError(f"a record of {len(data)} bytes")
    view = memoryview(data)
    if bytes(view[:4]) != magic:
        raise WireError("not a raysync record of this kind")
    if U16.unpack_from(view, 4)[0] != WIRE_VERSION:
        raise WireError(f"wire version {U16.unpack_from(view, 4)[0]}, this process speaks {WIRE_VERSION}")
    body = view[:-MAC_BYTES]
    if not hmac.compare_digest(mac(key, body), bytes(view[-MAC_BYTES:])):
        raise WireError("bad MAC: not sent by a holder of this doorbell's key")
    return Reader(body)


def decode_ring(key: bytes, data: bytes | memoryview) -> Ring:
    """A ring from a message, checked field by field against ``key``'s MAC.

    Raises:
        WireError: anything that is not a well-formed ring MAC'd with ``key``.
    """
    r = _opened(key, data, b"RSRG")
    _, _, flags, token, version, size, inode, device, n = r.take(RING)
    if flags != 0 or version < 0 or n == 0 or n > MAX_SUBS:
        raise WireError("ring fields out of range")
    model_id = r.text(nonempty=True)
    sub_ids = tuple(r.text(nonempty=True) for _ in range(n))
    r.done()
    return Ring(token, model_id, version, sub_ids, size, inode, device)


def ack_token(data: bytes | memoryview) -> int:
    """The ring token an ack answers, read before its MAC can be checked (the token names the key).

    Raises:
        WireError: not an ack.
    """
    if len(data) < ACK.size + MAC_BYTES or bytes(data[:4]) != b"RSAK":
        raise WireError("not a raysync ack")
    return int(ACK.unpack_from(data, 0)[3])


def decode_ack(key: bytes, data: bytes | memoryview) -> tuple[int, int, RelayReply]:
    """``(token, version, reply)`` of an ack, checked field by field against ``key``'s MAC.

    Errors come back as ``RuntimeError("<Type>: <message>")``: their text, never their objects.

    Raises:
        WireError: anything that is not a well-formed ack MAC'd with ``key``.
    """
    r = _opened(key, data, b"RSAK")
    _, _, flags, token, version = r.take(ACK)
    if flags != 0 or version < 0:
        raise WireError("ack fields out of range")
    rows = []
    for _ in range(r.count(U16, MAX_SUBS, "rows")):
        sub_id = r.text(nonempty=True)
        rows.append((sub_id, r.opt_float(), r.opt_float(), r.opt_int(), r.opt_int()))
    acks = []
    for _ in range(r.count(U16, MAX_SUBS, "acks")):
        sub_id = r.text(nonempty=True)
        outcome = r.one(U8)
        if outcome >= len(_OUTCOMES):
            raise WireError(f"unknown outcome {outcome}")
        error = _error(r.text(MAX_ERROR * 2))
        report = None
        if r.one(U8):
            fields: dict[str, Any] = {name: r.opt_int() for name in _INT_FIELDS}
            fields.update({name: r.opt_float() for name in _FLOAT_FIELDS})
            bits = r.one(U8)
            if bits >> len(_BOOL_FIELDS):
                raise WireError("unknown report flags")
            fields.update({name: bool(bits >> i & 1) for i, name in enumerate(_BOOL_FIELDS)})
            fields["error"] = _error(r.text(MAX_ERROR * 2))
            report = ApplyReport(**fields)
        acks.append(RelayAck(sub_id, report, _OUTCOMES[outcome], error))
    r.done()
    return token, version, RelayReply(tuple(acks), tuple(rows))


def _error(text: str) -> BaseException | None:
    return RuntimeError(text) if text else None


# ---------------------------------------------------------------------------- segment headers
# Encoded / decoded layouts remembered (a layout repeats version after version).
_encoded_layouts: Kept[bytes] = Kept(8)
_decoded_layouts: Kept[tuple[Any, ...]] = Kept(8)


def _layout_blob(manifest: Any) -> bytes:
    """The part of a manifest that only changes with its layout: entries, buckets, hash, transport."""

    def encode() -> bytes:
        out = Writer()
        out.put(U32, len(manifest.entries))
        for e in manifest.entries:
            out.text(e.key)
            out.put(U8, len(e.shape))
            for d in e.shape:
                out.put(I64, d)
            out.text(e.dtype, 64)
            out.put(U32, e.bucket)
            out.put(U32, e.index)
            out.put(U64, e.offset)
            out.put(U64, e.nbytes)
        out.put(U32, len(manifest.bucket_nbytes))
        for n in manifest.bucket_nbytes:
            out.put(U64, n)
        out.text(manifest.layout_hash, 256)
        out.text(manifest.transport, 64)
        return out.bytes()

    return _encoded_layouts.get((manifest.layout_hash, manifest.transport), encode)


def _read_layout(blob: bytes) -> tuple[Any, ...]:
    """``(entries, bucket_nbytes, layout_hash, transport)`` of a layout blob, checked."""
    from raysync.core.layout import TensorEntry  # torch-free

    r = Reader(blob)
    entries = []
    for _ in range(r.count(U32, MAX_ENTRIES, "entries")):
        key = r.text(nonempty=True)
        ndim = r.count(U8, MAX_DIMS, "dimensions")
        shape = tuple(r.non_negative(I64) for _ in range(ndim))
        dtype = r.text(64, nonempty=True)
        bucket, index = r.one(U32), r.one(U32)
        offset, nbytes = r.one(U64), r.one(U64)
        entries.append(TensorEntry(key, shape, dtype, bucket, index, offset, nbytes))
    bucket_nbytes = tuple(r.one(U64) for _ in range(r.count(U32, MAX_BUCKETS, "buckets")))
    layout_hash = r.text(256, nonempty=True)
    transport = r.text(64, nonempty=True)
    r.done()
    keys = [e.key for e in entries]
    if keys != sorted(set(keys)):
        raise WireError("entries not sorted or not unique")
    for e in entries:
        if e.bucket >= len(bucket_nbytes) or e.offset + e.nbytes > bucket_nbytes[e.bucket]:
            raise WireError(f"entry {e.key!r} does not fit its bucket")
    return tuple(entries), bucket_nbytes, layout_hash, transport


def encode_segment_header(
    model_id: str, version: int, manifest: Any, ids: Sequence[str | None], sizes: Sequence[Sequence[int]]
) -> bytes:
    """A segment's header: ``u64`` length, then the version, its manifest, bucket ids and array sizes.

    Raises:
        WireError: the manifest carries extra state (pickled objects: those versions go the Ray way).
    """
    if manifest.extra_state:
        raise WireError("a version with extra state (pickled objects) does not go by doorbell")
    out = Writer()
    out.put(SEG, b"RSSG", WIRE_VERSION, 0, version)
    out.text(model_id)
    blob = _layout_blob(manifest)
    out.put(U32, len(blob))
    out.parts.append(blob)
    out.put(U8, manifest.checksums is not None)
    if manifest.checksums is not None:
        out.put(U32, len(manifest.checksums))
        for c in manifest.checksums:
            out.put(U32, c)
    out.put(U32, len(ids))
    for i in ids:
        out.put(U8, i is not None)
        if i is not None:
            out.text(i, 256)
    out.put(U32, len(sizes))
    for arrays in sizes:
        out.put(U32, len(arrays))
        for n in arrays:
            out.put(U64, n)
    body = out.bytes()
    return U64.pack(len(body)) + body


def decode_segment_header(
    data: bytes | memoryview, file_size: int
) -> tuple[str, int, Any, list[str | None], list[list[int]], int]:
    """``(model_id, version, manifest, ids, sizes, header_end)`` of a segment, every field checked.

    The arrays the sizes describe must fit in ``file_size``; the manifest's entries must
    fit in its buckets. A layout seen before is not parsed again (its bytes are compared).

    Raises:
        WireError: anything that is not a well-formed segment header.
    """
    from raysync.core.layout import Manifest  # torch-free

    view = memoryview(data)
    if len(view) < 8:
        raise WireError("segment shorter than its header's length")
    length = U64.unpack_from(view, 0)[0]
    if length > file_size - 8 or length > len(view) - 8:
        raise WireError("segment header longer than the segment")
    r = Reader(view[8 : 8 + length])
    magic, wire, flags, version = r.take(SEG)
    if magic != b"RSSG" or wire != WIRE_VERSION or flags != 0 or version < 0:
        raise WireError("not a raysync segment of this wire version")
    model_id = r.text(nonempty=True)
    blob = r.raw(r.one(U32), "layout")
    entries, bucket_nbytes, layout_hash, transport = _decoded_layouts.get(blob, lambda: _read_layout(blob))
    checksums = None
    if r.one(U8):
        checksums = tuple(r.one(U32) for _ in range(r.count(U32, MAX_BUCKETS, "checksums")))
    ids: list[str | None] = []
    for _ in range(r.count(U32, MAX_BUCKETS, "bucket ids")):
        ids.append(r.text(256) if r.one(U8) else None)
    sizes: list[list[int]] = []
    for _ in range(r.count(U32, MAX_BUCKETS, "buckets")):
        sizes.append(r.u64s(r.count(U32, MAX_ENTRIES, "arrays")))
    r.done()
    nb = len(bucket_nbytes)
    if len(ids) != nb or len(sizes) != nb or (checksums is not None and len(checksums) != nb):
        raise WireError("bucket counts disagree")
    if any(e.index >= len(sizes[e.bucket]) for e in entries):
        raise WireError("an entry's array is missing")
    manifest = Manifest(entries, bucket_nbytes, layout_hash, checksums, transport)
    return model_id, version, manifest, ids, sizes, 8 + length

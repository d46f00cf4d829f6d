"""THE bucket codec: tensors into flat buckets, buckets back into tensor views, checksums.

Every path that moves a version (the hub's object store, NIXL, every channel and
adapter, :class:`~raysync.core.bound.BoundModel`) packs and unpacks with this module.
Bytes move as uint8 and are re-interpreted on arrival, so every dtype is bit-exact.

Example:
    >>> t = {"w": torch.arange(3.0)}
    >>> m = plan_layout(t)
    >>> unpack(m, pack(t, m))["w"]
    tensor([0., 1., 2.])
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from raysync.core.checksums import bucket_checksums, failed_checksums
from raysync.core.layout import Manifest, TensorEntry
from raysync.core.readonly import ReadOnlyTensor
from raysync.errors import ChecksumError

__all__ = [
    "on_gpu",
    "stage_bucket",
    "allocate",
    "bucket_checksums",
    "copy_into",
    "failed_checksums",
    "flats_of",
    "pack",
    "require_checksums",
    "same_bytes",
    "tensor_of",
    "unpack",
    "verify_checksums",
    "views",
    "write",
]


def same_bytes(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Whether two buckets (lists of uint8 arrays) hold exactly the same bytes.

    Example:
        >>> same_bytes([np.zeros(3, np.uint8)], [np.zeros(3, np.uint8)])
        True
    """
    return len(a) == len(b) and all(
        x.nbytes == y.nbytes and (x.nbytes == 0 or torch.equal(_from_numpy(x), _from_numpy(y)))
        for x, y in zip(a, b, strict=True)
    )


def pack(tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> list[list[np.ndarray]]:
    """Uint8 numpy views of the tensors, grouped by bucket in buffer order. No copy.

    Hand each list to ``ray.put``: that is the one copy a version costs.
    Non-contiguous tensors are made contiguous first; GPU tensors are copied to
    the host.

    Example:
        >>> t = {"w": torch.ones(2)}
        >>> pack(t, plan_layout(t))[0][0].dtype
        dtype('uint8')
    """
    return [
        [_as_bytes(tensors[e.key]) for e in manifest.bucket_entries(b)] for b in range(manifest.num_buckets)
    ]


def on_gpu(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is on a GPU (its bytes must come to the host to be put)."""
    return any(t.is_cuda for t in tensors.values())


def stage_bucket(
    tensors: Mapping[str, torch.Tensor], manifest: Manifest, bucket: int, staging: torch.Tensor
) -> list[np.ndarray]:
    """Bucket ``bucket`` of GPU weights copied into ``staging`` (page-locked host memory of at
    least the bucket's size), as uint8 views of it: :func:`pack` for one bucket, with one DMA
    copy per tensor instead of ``.cpu()`` into fresh pageable memory. Put the views before the
    next bucket is staged into the same buffer.

    Example:
        >>> t = {"w": torch.ones(2)}
        >>> m = plan_layout(t)
        >>> stage_bucket(t, m, 0, torch.empty(m.bucket_nbytes[0], dtype=torch.uint8))[0].nbytes
        8
    """
    views, devices = [], set()
    for entry in manifest.bucket_entries(bucket):
        dst = staging[entry.offset : entry.offset + entry.nbytes]
        if entry.nbytes:
            src = tensors[entry.key]
            dst.copy_(_as_uint8(src), non_blocking=True)
            if src.is_cuda:
                devices.add(src.device)
        views.append(dst.numpy() if entry.nbytes else np.empty(0, dtype=np.uint8))
    for device in devices:
        torch.cuda.synchronize(device)  # the DMA copies are done before anyone reads the views
    return views


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    flat = _as_uint8(t.detach().cpu())
    return flat.numpy() if flat.numel() else np.empty(0, dtype=np.uint8)


def require_checksums(manifest: Manifest) -> None:
    """Raise :class:`ChecksumError` unless the version carries checksums to verify.

    A subscriber that asked to verify (``verify=True``) must not take a
    version it cannot check: the pusher left the checksums out
    (``checksum=False``), or the version came over NIXL, which has none.

    Example:
        >>> require_checksums(plan_layout({"w": torch.ones(2)}))
        Traceback (most recent call last):
        ...
        raysync.errors.ChecksumError: this version (layout ...) carries no checksums, ...
    """
    if manifest.checksums is not None:
        return
    raise ChecksumError(
        f"this version (layout {manifest.layout_hash}, came over {manifest.transport!r}) carries no "
        "checksums, so a verify=True subscriber cannot check its bytes and refuses it: push with "
        "hub.push(..., checksum=True) over transport='object_store' (NIXL carries none), or subscribe "
        "without verify=True"
    )


def verify_checksums(
    manifest: Manifest,
    buckets: Mapping[int, Sequence[np.ndarray]] | Sequence[Sequence[np.ndarray]],
) -> None:
    """Raise :class:`ChecksumError` if a bucket's bytes differ from the manifest's CRC.

    ``buckets`` is every bucket in order, or ``{index: arrays}`` for some of them.
    A version pushed without checksums is refused too (see
    :func:`require_checksums`): verifying it would check nothing.

    Example:
        >>> t = {"w": torch.ones(2)}
        >>> m = plan_layout(t)
        >>> buckets = pack(t, m)
        >>> verify_checksums(m.with_checksums(bucket_checksums(buckets)), buckets)
        >>> verify_checksums(m, buckets)
        Traceback (most recent call last):
        ...
        raysync.errors.ChecksumError: this version (layout ...) carries no checksums, ...
    """
    require_checksums(manifest)
    assert manifest.checksums is not None
    by_index = dict(buckets.items()) if isinstance(buckets, Mapping) else dict(enumerate(buckets))
    bad = failed_checksums(manifest.checksums, by_index)
    if bad:
        raise ChecksumError(
            f"bucket(s) {bad} of layout {manifest.layout_hash} failed their checksum: "
            "the bytes were corrupted in transit or in the object store; the version is refused"
        )


def unpack(
    manifest: Manifest, buckets: Sequence[Sequence[np.ndarray]], *, read_only: bool = False
) -> dict[str, torch.Tensor]:
    """Tensors that view the bucket buffers, with their shapes and dtypes. No copy.

    Args:
        manifest: the version's manifest.
        buckets: what ``ray.get`` returned for the version's bucket refs.
        read_only: wrap each tensor as :class:`ReadOnlyTensor`, so in-place
            writes raise instead of changing shared memory.

    Example:
        >>> t = {"w": torch.arange(3.0)}
        >>> m = plan_layout(t)
        >>> unpack(m, pack(t, m))["w"]
        tensor([0., 1., 2.])
    """
    return {e.key: tensor_of(e, buckets[e.bucket], read_only=read_only) for e in manifest.entries}


def tensor_of(entry: TensorEntry, bucket: Sequence[np.ndarray], *, read_only: bool = False) -> torch.Tensor:
    """One tensor of a received bucket (its arrays), viewing the bucket's bytes. No copy.

    Example:
        >>> t = {"w": torch.arange(3.0)}
        >>> m = plan_layout(t)
        >>> tensor_of(m.entries[0], pack(t, m)[0])
        tensor([0., 1., 2.])
    """
    arr = bucket[entry.index]
    if arr.nbytes != entry.nbytes:
        raise ChecksumError(
            f"tensor {entry.key!r} arrived with {arr.nbytes} bytes, the manifest says {entry.nbytes}"
        )
    return _typed(_from_numpy(arr) if arr.nbytes else torch.empty(0, dtype=torch.uint8), entry, read_only)


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # Object-store buffers are read-only numpy arrays; torch warns but shares them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def _typed(flat: torch.Tensor, entry: TensorEntry, read_only: bool) -> torch.Tensor:
    """``entry``'s tensor over ``flat``, its bytes (read-only: as :class:`ReadOnlyTensor`)."""
    t = flat.view(entry.torch_dtype).reshape(entry.shape)
    return t.as_subclass(ReadOnlyTensor) if read_only else t


def _span(arrays: Sequence[np.ndarray], entries: Sequence[TensorEntry], nbytes: int) -> torch.Tensor | None:
    """One uint8 tensor over a whole bucket if Ray laid it out as planned, else None.

    The returned tensor aliases the object-store buffer; the caller must keep
    ``arrays`` alive while using it and must not write to it.
    """
    if not arrays or nbytes == 0:
        return None
    base = arrays[0].ctypes.data
    for arr, entry in zip(arrays, entries, strict=True):
        if arr.nbytes and arr.ctypes.data - base != entry.offset:
            return None
    raw = (ctypes.c_uint8 * nbytes).from_address(base)
    return torch.from_numpy(np.ctypeslib.as_array(raw))


# --------------------------------------------------------------------------- flat buckets
# The other form of a version: one flat uint8 tensor per bucket (shared memory for pipes,
# NIXL-registered buffers, what torch.distributed sends, a bound module's storage).


def allocate(
    manifest: Manifest, *, device: torch.device | str | None = None, shared: bool = False
) -> list[torch.Tensor]:
    """One empty flat uint8 buffer per bucket (in shared memory with ``shared=True``).

    Example:
        >>> m = plan_layout({"w": torch.zeros(3)})
        >>> [b.numel() for b in allocate(m)]
        [12]
    """
    flats = [torch.empty(n, dtype=torch.uint8, device=device) for n in manifest.bucket_nbytes]
    return [f.share_memory_() for f in flats] if shared else flats


def write(tensors: Mapping[str, torch.Tensor], manifest: Manifest, flats: Sequence[torch.Tensor]) -> None:
    """Copy each tensor into its place in flat bucket buffers (the one copy a snapshot costs).

    Alignment padding is zeroed, so a buffer never carries stale bytes.

    Example:
        >>> t = {"w": torch.arange(3.0)}
        >>> m = plan_layout(t)
        >>> flats = allocate(m)
        >>> write(t, m, flats)
        >>> views(m, flats)["w"]
        tensor([0., 1., 2.])
    """
    with torch.no_grad():
        for b in range(manifest.num_buckets):
            flat, end = flats[b], 0
            for entry in manifest.bucket_entries(b):
                flat[end : entry.offset].zero_()
                if entry.nbytes:
                    flat[entry.offset : entry.offset + entry.nbytes].copy_(_as_uint8(tensors[entry.key]))
                end = max(end, entry.offset + entry.nbytes)
            flat[end:].zero_()


def views(
    manifest: Manifest, flats: Sequence[torch.Tensor], *, read_only: bool = False
) -> dict[str, torch.Tensor]:
    """``{key: tensor}`` (sorted keys) viewing flat uint8 buckets laid out by ``manifest``. No copy.

    Example:
        >>> m = plan_layout({"w": torch.zeros(3)})
        >>> views(m, allocate(m))["w"].shape
        torch.Size([3])
    """
    return {
        e.key: _typed(flats[e.bucket][e.offset : e.offset + e.nbytes], e, read_only) for e in manifest.entries
    }


def copy_into(
    flats: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
    manifest: Manifest,
    buckets: Mapping[int, Sequence[np.ndarray]],
) -> None:
    """Copy received buckets (lists of uint8 arrays, by index) into flat buffers.

    One ``copy_`` per bucket when Ray laid the arrays out as planned (it does),
    else one per tensor.
    """
    with torch.no_grad():
        for b, arrays in buckets.items():
            write_into = getattr(arrays, "write_into", None)
            if write_into is not None:  # a bucket that copies itself in (a sharded version's pieces)
                write_into(flats[b])
                continue
            entries = manifest.bucket_entries(b)
            src = _span(arrays, entries, manifest.bucket_nbytes[b])
            if src is not None:
                flats[b].copy_(src)
                continue
            for entry, arr in zip(entries, arrays, strict=True):
                if entry.nbytes:
                    flats[b][entry.offset : entry.offset + entry.nbytes].copy_(_from_numpy(arr))


def flats_of(manifest: Manifest, buckets: Sequence[Sequence[np.ndarray]]) -> list[torch.Tensor]:
    """Flat uint8 tensors over received buckets: views of the store when laid out as planned, else copies.

    The views alias read-only object-store memory: send them, never write them.
    """
    out = []
    for b, arrays in enumerate(buckets):
        src = _span(arrays, manifest.bucket_entries(b), manifest.bucket_nbytes[b])
        if src is None:
            src = torch.zeros(manifest.bucket_nbytes[b], dtype=torch.uint8)
            copy_into({b: src}, manifest, {b: arrays})
        out.append(src)
    return out


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (contiguous; conjugate/negative views resolved)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # the bytes of a lazy view are not its values
    return t.contiguous().reshape(-1).view(torch.uint8)

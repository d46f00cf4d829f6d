"""The default data path: each bucket ``ray.put`` once; receivers map it zero-copy.

A bucket is put as a list of uint8 numpy views of the tensors (the codec's
:func:`~raysync.core.codec.pack`): Ray lays the buffers out back to back, so that is
the one copy a version costs. Same-node readers map it; other nodes pull it once.

Example:
    >>> snap = ObjectStoreTransport().snapshot("policy", tensors, manifest)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raysync import _compat
from raysync._checks import require_ray
from raysync.core.codec import bucket_checksums, on_gpu, pack, stage_bucket
from raysync.core.layout import Manifest
from raysync.transports import registry
from raysync.transports.base import Reuse, Snapshot
from raysync.transports.store_pages import populate_store_mapping

__all__ = ["ObjectStoreTransport"]


class ObjectStoreTransport:
    """The object-store data path (the hub's default): both sides."""

    name = "object_store"
    info = registry.info("object_store")

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None  # page-locked, for GPU weights (one bucket)
        self._staging_lock = threading.Lock()  # pushes from several threads share the buffer

    def _staging_for(self, manifest: Manifest) -> torch.Tensor:
        need = max(manifest.bucket_nbytes, default=0)
        if self._staging is None or self._staging.numel() < need:
            self._staging = None  # the old one goes first
            self._staging = torch.empty(need, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._staging

    def close(self) -> None:
        """Drop the staging buffer (page-locked memory, for GPU weights); the next GPU push makes one."""
        with self._staging_lock:
            self._staging = None

    def snapshot(
        self,
        model_id: str,
        tensors: Mapping[str, torch.Tensor],
        manifest: Manifest,
        *,
        checksum: bool = False,
        reuse: Reuse | None = None,
    ) -> Snapshot:
        gpu = on_gpu(tensors)
        # GPU weights go a bucket at a time through one page-locked staging buffer (one push at a time).
        with self._staging_lock if gpu else contextlib.nullcontext():
            buckets = [] if gpu else pack(tensors, manifest)
            checksums: list[int] = []
            refs = []
            put_bytes = puts = 0
            for b in range(manifest.num_buckets):
                bucket = (
                    stage_bucket(tensors, manifest, b, self._staging_for(manifest)) if gpu else buckets[b]
                )
                if checksum:
                    checksums.extend(bucket_checksums([bucket]))
                ref = reuse(b, bucket) if reuse is not None else None
                if ref is None:
                    require_ray("push")  # a push racing ray.shutdown(): fail, never start a new Ray
                    ref = _compat.put_no_start(bucket)
                    put_bytes += manifest.bucket_nbytes[b]
                    puts += 1
                refs.append(ref)
                del bucket
            del buckets
            if checksum:
                manifest = manifest.with_checksums(tuple(checksums))
            populate_store_mapping(True, put_bytes)  # once per process: later puts take no page faults
            return Snapshot(manifest, refs, put_bytes, puts)

    @staticmethod
    def fetch(
        manifest: Manifest, refs: Sequence[Any], needed: Sequence[int], *, timeout: float | None
    ) -> list[Any]:
        """Receiver side: the buckets, zero-copy views of this node's object store."""
        require_ray("fetch a version")
        buckets: list[Any] = _compat.get_no_start([refs[b] for b in needed], timeout=timeout)
        return buckets

    @staticmethod
    async def fetch_async(manifest: Manifest, refs: Sequence[Any], needed: Sequence[int]) -> list[Any]:
        """:meth:`fetch` on an event loop (an async actor's): awaits the refs, no thread."""
        return list(await asyncio.gather(*[refs[b] for b in needed]))

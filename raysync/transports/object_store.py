"""The default data path: each bucket ``ray.put`` once; receivers map it zero-copy.

A bucket is put as a list of uint8 numpy views of the tensors (the codec's
:func:`~raysync.core.codec.pack`): Ray lays the buffers out back to back, so that is
the one copy a version costs. Same-node readers map it; other nodes pull it once.

Example:
    >>> snap = ObjectStoreTransport().snapshot("policy", tensors, manifest)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping

import ray
import torch

from raysync._checks import require_ray
from raysync.core.codec import bucket_checksums, pack
from raysync.core.layout import Manifest
from raysync.transports.base import Reuse, Snapshot
from raysync.transports.store_pages import populate_store_mapping

__all__ = ["ObjectStoreTransport"]


class ObjectStoreTransport:
    """The object-store data path (the hub's default)."""

    name = "object_store"
    supports_partial = True

    def snapshot(
        self,
        model_id: str,
        tensors: Mapping[str, torch.Tensor],
        manifest: Manifest,
        *,
        checksum: bool = False,
        reuse: Reuse | None = None,
    ) -> Snapshot:
        buckets = pack(tensors, manifest)
        if checksum:
            manifest = manifest.with_checksums(bucket_checksums(buckets))
        refs = []
        put_bytes = puts = 0
        for b, bucket in enumerate(buckets):
            ref = reuse(b, bucket) if reuse is not None else None
            if ref is None:
                require_ray("push")  # a push racing ray.shutdown(): fail, never start a new Ray
                ref = ray.put(bucket)
                put_bytes += manifest.bucket_nbytes[b]
                puts += 1
            refs.append(ref)
        del buckets
        populate_store_mapping(True, put_bytes)  # once per process: later puts take no page faults
        return Snapshot(manifest, refs, put_bytes, puts)

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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from raysync.core.assembly import assemble, bucket_plan, check_sizes, fill, verify_rank_buckets
from raysync.core.layout import Manifest
from raysync.core.shards import SHARDED
from raysync.transports import registry

__all__ = ["Assembly", "ShardedTransport", "verify_fetched"]


class ShardedTransport:
    """The receivers' side of a sharded version's data path (see the module's docstring): its ranks
    push over the object store's own (``pushable=False``: no pusher names this one)."""

    name = SHARDED
    info = registry.info(SHARDED)

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
        plan = bucket_plan(self.manifest, self.bucket)
        check_sizes(plan, self.rank_buckets)  # nothing written if one is off
        if flat.device.type == "cpu":
            # numpy's copies are the C library's memcpy: for pieces of a few hundred KiB, a third
            # less CPU than torch's copy loop (the same for MiB pieces)
            fill(plan, self.rank_buckets, flat.detach().numpy())
            return
        with torch.no_grad():
            fill(plan, self.rank_buckets, flat, torch.from_numpy)


def verify_fetched(manifest: Manifest, fetched: Mapping[int, Any]) -> None:
    """Raise :class:`~raysync.ChecksumError` unless each rank bucket behind ``fetched`` matches its CRC32.

    ``fetched``: the :class:`Assembly` buckets :meth:`ShardedTransport.fetch` returned. Each rank
    bucket they were made of is checked once (:func:`raysync.core.assembly.verify_rank_buckets`).

    Example:
        >>> verify_fetched(manifest, dict(zip(needed, ShardedTransport.fetch(manifest, refs, needed,
        ...     timeout=30))))   # doctest: +SKIP
    """
    rank_buckets: dict[int, Sequence[np.ndarray]] = {}
    for bucket in fetched.values():
        rank_buckets.update(bucket.rank_buckets)
    verify_rank_buckets(manifest, rank_buckets)


def _read(
    manifest: Manifest, bucket: int, entries: Sequence[Any], rank_buckets: Mapping[int, Sequence[np.ndarray]]
) -> list[np.ndarray]:
    """One uint8 array per tensor of a bucket: a view of the rank bucket where one piece holds
    it as one run of bytes, else (any other tensor there) the bucket assembled (:func:`assemble`)."""
    plan = bucket_plan(manifest, bucket)
    whole: list[np.ndarray] | None = None
    if any(run is None for run in plan.direct):
        whole = assemble(manifest, bucket, rank_buckets, spare=True)  # checks every piece's size first
    else:
        check_sizes(plan, rank_buckets)
    out: list[np.ndarray] = []
    for i, (entry, run) in enumerate(zip(entries, plan.direct, strict=True)):
        if run is None:
            assert whole is not None
            out.append(whole[i])
            continue
        b, j, start = run
        flat = np.asarray(rank_buckets[b][j]).reshape(-1).view(np.uint8)
        out.append(flat[start : start + entry.nbytes])
    return out

"""One rank's push of a sharded model: lay out and put only its own pieces, hand the hub its part.

:class:`~raysync.client.push.PushPipeline` sends here a push whose weights hold ``DTensor``\\ s
(``hub.push(model)`` on every rank of an FSDP2 or tensor-parallel trainer, unchanged).
Nothing is gathered: the rank's local shards (views) are laid out in buckets of their own
and put once into the object store, the only copy. The push returns the version number the
hub granted the push's round once it recorded this rank's part; the hub publishes the version
when every rank's part is in (:mod:`raysync.hub.sharded`).

Example:
    >>> v = hub.push(fsdp_model)     # on every rank; the same version number on each   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from raysync.core.codec import unpack
from raysync.core.dtensor import local_part
from raysync.core.extract import extract_extra_state
from raysync.core.layout import Manifest, plan_layout, schema_of
from raysync.core.shards import ShardPart
from raysync.errors import InvalidWeightsError
from raysync.transports.base import Reuse, Snapshot, Transport, reuse_unchanged, transport_for
from raysync.transports.registry import DEFAULT, fetcher, info

__all__ = ["Contribute", "push_shard"]

Contribute = Callable[[str, ShardPart, list[Any], dict[str, Any]], int]  # the round's version
"""``(model_id, part, refs, pusher) -> version``: this rank's part to the hub; its round's number."""


def push_shard(
    request: Any,
    tensors: dict[str, torch.Tensor],
    contribute: Contribute,
    *,
    round: int,
    group: str,
    writer: dict[str, Any],
    transport: Transport | None = None,
    selected: set[str] | None = None,
    separate: frozenset[str] = frozenset(),
    previous: Snapshot | None = None,
) -> tuple[int, dict[str, Any], Snapshot]:
    """This rank's part of push ``round`` of a sharded model; ``(version, stats, its snapshot)``.

    ``group`` is the token of the rank's group (:mod:`raysync.core.group`): the hub matches
    the parts of one push by it and ``round``.

    ``transport`` is the client's object-store transport (it keeps a GPU rank's page-locked
    staging buffer from push to push); a fresh one without it. ``selected``: the keys of a
    ``keys=`` push (every other tensor keeps its bytes of ``previous``, this rank's last
    push, whose buckets holding none of them are not put again; with ``delta=``, neither are
    the buckets whose bytes are those of ``previous``); ``separate``: the keys laid out in
    buckets of their own (those of every ``keys=`` push of the model so far).

    Raises:
        ValueError: a transport other than the object store (not carried for sharded pushes
            yet).
        InvalidWeightsError: see :func:`~raysync.core.dtensor.local_part`, NaN/Inf in this
            rank's pieces with ``check_finite``; a ``keys=`` push without a previous push of
            the same tensors by this rank.
    """
    t0 = time.perf_counter()
    model_id = request.model_id
    if not info(request.transport).rank_pieces:
        raise ValueError(
            f"a sharded push (DTensor weights) cannot go over transport={request.transport!r} (its "
            "ranks cannot each put their own pieces there): drop transport= (the object store)"
        )
    part = local_part(tensors)
    local = part.tensors
    if request.dtype is not None:
        local = {k: t.to(request.dtype) if t.is_floating_point() else t for k, t in local.items()}
    if request.check_finite:
        bad = [k for k, t in local.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            raise InvalidWeightsError(
                f"rank {part.rank}'s shards of {model_id!r} hold NaN or Inf in {bad[:20]}; nothing was pushed"
            )
    specs = part.specs
    if request.dtype is not None:
        name = str(request.dtype).removeprefix("torch.")
        size = torch.empty(0, dtype=request.dtype).element_size()
        specs = tuple(
            dataclasses.replace(s, dtype=name, itemsize=size) if _floating(s.dtype) else s for s in specs
        )
    local = {k: t.contiguous() for k, t in local.items()}  # local shards are contiguous: no copy
    manifest = plan_layout(local, bucket_bytes=request.bucket_bytes, separate=separate & local.keys())
    if part.rank == 0:
        manifest = manifest.with_extra_state(extract_extra_state(request.weights))
    store = transport if transport is not None else transport_for(DEFAULT)
    reuse = None
    if selected is not None or request.delta:
        local, reuse = _from_previous(model_id, local, manifest, selected, request.delta, previous)
    # checksum=True: one CRC32 per bucket of this rank's own (every rank must say the same)
    snap = store.snapshot(model_id, local, manifest, checksum=request.checksum, reuse=reuse)
    snapshot_s = time.perf_counter() - t0
    del local
    shard = ShardPart(
        round,
        part.rank,
        part.world,
        specs,
        snap.manifest,
        part.pieces(snap.manifest),
        request.bucket_bytes,
        tuple(sorted(separate)),
        group,
    )
    stats = {
        "model_id": model_id,
        "snapshot_s": snapshot_s,
        "bytes_put": snap.bytes_put,
        "buckets_put": snap.buckets_put,
        "buckets": len(snap.refs),
        "rank": part.rank,
        "world": part.world,
    }
    t1 = time.perf_counter()
    version = contribute(model_id, shard, snap.refs, {**writer, **stats})
    stats["seconds"] = time.perf_counter() - t0
    stats["contribute_s"] = stats["seconds"] - (t1 - t0)  # the hub's round trip (recording the part)
    stats["bytes"] = snap.bytes_put
    return version, stats, snap


def _from_previous(
    model_id: str,
    local: dict[str, torch.Tensor],
    manifest: Manifest,
    selected: set[str] | None,
    delta: bool,
    previous: Snapshot | None,
) -> tuple[dict[str, torch.Tensor], Reuse | None]:
    """A ``keys=`` or ``delta=`` push: this rank's pieces (the keys not ``selected`` as
    ``previous`` holds them), and which of its buckets to take as they are from ``previous``,
    this rank's last push (same layout: those holding none of ``selected``, or, with
    ``delta``, whose bytes are the same). A delta push without a previous one sends everything.
    """
    if previous is None:
        if selected is None:
            return local, None
        raise InvalidWeightsError(
            f"push(keys=...) of a sharded model fills the other keys from this rank's previous push of "
            f"{model_id!r}, and this process has pushed none: push the whole model once first"
        )
    if previous.manifest.schema() != schema_of(local):
        if selected is None:
            return local, None
        raise InvalidWeightsError(
            f"push(keys=...) needs this rank's shards of the other keys of {model_id!r} shaped as in its "
            "previous push; they changed, so push the whole model"
        )
    every = range(previous.manifest.num_buckets)
    buckets = fetcher(previous.manifest.transport)(previous.manifest, previous.refs, every, timeout=None)
    if selected is not None:
        old = unpack(previous.manifest, buckets)
        local = {k: (t if k in selected else old[k]) for k, t in local.items()}
    if previous.manifest.layout_hash != manifest.layout_hash:  # the first keys= push lays them apart
        return local, None
    return local, reuse_unchanged(previous.refs, manifest, selected, buckets if delta else None)


def _floating(dtype: str) -> bool:
    return bool(getattr(torch, dtype).is_floating_point)

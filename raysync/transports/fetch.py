"""The receiver side's fetch step: a version's buckets through its data path, checked.

Every receiver takes a version's bytes through here (the :class:`~raysync.receivers.pipeline.
Applier`'s receivers, adapters, torchrl's receivers in Ray actors, and ``HubClient.pull``):
:func:`fetch` / :func:`fetch_async` ask the version's data path (:mod:`raysync.transports`)
for the buckets wanted, as the receiver takes them (:func:`view`: its own parts of each
tensor, for a target with a ``placement``), and :func:`verified` checks their checksums as
asked (:data:`Verify`). :func:`at_hand` does the same for buckets a receiver has already
(a doorbell segment's). Of a ``delta="sparse"`` version, a bucket whose base the target holds
(:func:`patchable`) comes as its patch, rebuilt from the target's own bytes and checked
(:mod:`raysync.core.sparse`); a patch that does not rebuild it is logged and the whole bucket fetched.

Example:
    >>> fetch(ann.manifest, list(ann.refs), [0, 1], timeout=30, verify=True)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import Any, Literal

from raysync import _compat
from raysync.core.codec import verify_checksums
from raysync.core.layout import Manifest, SparsePatch
from raysync.core.placement import TensorParallel, reshard
from raysync.core.shards import ShardRefs
from raysync.core.sparse import PatchError, rebuild
from raysync.transports.registry import fetcher, transport_class
from raysync.transports.registry import info as transport_info
from raysync.transports.sharded import Assembly, verify_fetched
from raysync.transports.store_pages import populate_store_mapping

__all__ = ["Verify", "at_hand", "checked", "fetch", "fetch_async", "nbytes", "patchable", "verified", "view"]

logger = logging.getLogger(__name__)


Verify = bool | Literal["if_present"]
"""``True``: verify checksums, refusing a version without them; ``"if_present"``: verify those
a version carries; ``False``: do not verify."""


def view(target: Any, manifest: Manifest) -> Manifest:
    """The version as ``target`` takes it: its own parts of a sharded version, or all of it.

    A target with a ``placement`` attribute (a :class:`~raysync.core.placement.TensorParallel`,
    e.g. ``WeightsLoader(..., placement=...)``) takes, of a sharded trainer's version or of
    one writer's (over a data path that hands out buckets, such as the object store), only
    its parts of each tensor (:func:`~raysync.core.placement.reshard`): checked, fetched and
    committed as such. Every other version and target: ``manifest`` itself.

    Example:
        >>> tp = raysync.TensorParallel(0, 2, {"*.weight": 0})
        >>> view(WeightsLoader(load, placement=tp), manifest)  # doctest: +SKIP
    """
    placement = getattr(target, "placement", None)
    if placement is None or (manifest.shards is None and transport_info(manifest.transport).in_place):
        return manifest  # NIXL receives whole buffers in place: whole tensors (a module of parts refuses)
    return _resharded(manifest, placement)


def _as_taken(manifest: Manifest, refs: Sequence[Any], target: Any) -> tuple[Manifest, list[Any]]:
    """The version as ``target`` takes it (:func:`view`), and the refs to fetch that by: of one
    writer's buckets cut into parts, each bucket is a rank's (one ``ShardRefs`` each)."""
    taken = view(target, manifest)
    if manifest.shards is None and taken.shards is not None:
        return taken, [ShardRefs((b,), (ref,)) for b, ref in enumerate(refs)]
    return taken, list(refs)


@functools.lru_cache(maxsize=8)
def _resharded(manifest: Manifest, placement: TensorParallel) -> Manifest:
    return reshard(manifest, placement)


def fetch(
    manifest: Manifest,
    refs: Sequence[Any],
    needed: Sequence[int],
    *,
    timeout: float | None,
    verify: Verify = False,
    target: Any = None,
) -> dict[int, Any]:
    """The buckets ``needed`` through the version's data path, by index, verified if asked.

    ``target``: whose :func:`view` of the version to fetch (its own parts of a sharded one).
    """
    manifest, refs = _as_taken(manifest, refs, target)
    patched = patchable(manifest, needed, target)
    whole = [b for b in needed if b not in patched]
    got = dict(zip(whole, fetcher(manifest.transport)(manifest, refs, whole, timeout=timeout), strict=True))
    if patched:
        patches = _compat.get_no_start([p.ref for p, _ in patched.values()], timeout=timeout)
        again = _rebuild(manifest, patched, patches, got)
        if again:
            got.update(
                zip(again, fetcher(manifest.transport)(manifest, refs, again, timeout=timeout), strict=True)
            )
    return verified(manifest, needed, [got[b] for b in needed], verify=verify)


async def fetch_async(
    manifest: Manifest,
    refs: Sequence[Any],
    needed: Sequence[int],
    *,
    timeout: float | None,
    verify: Verify = False,
    target: Any = None,
) -> dict[int, Any]:
    """:func:`fetch` on an event loop: without a thread where the data path can (``fetch_async``)."""
    manifest, refs = _as_taken(manifest, refs, target)
    native = getattr(transport_class(manifest.transport), "fetch_async", None)

    async def buckets(wanted: list[int]) -> dict[int, Any]:
        if native is not None:
            arrays = await asyncio.wait_for(native(manifest, refs, wanted), timeout)
        else:
            arrays = await asyncio.to_thread(
                fetcher(manifest.transport), manifest, refs, wanted, timeout=timeout
            )
        return dict(zip(wanted, arrays, strict=True))

    patched = patchable(manifest, needed, target)
    got = await buckets([b for b in needed if b not in patched])
    if patched:
        patches = await asyncio.wait_for(asyncio.gather(*[p.ref for p, _ in patched.values()]), timeout)
        again = await asyncio.to_thread(_rebuild, manifest, patched, list(patches), got)  # off the loop
        if again:
            got.update(await buckets(again))
    return verified(manifest, needed, [got[b] for b in needed], verify=verify)


def patchable(manifest: Manifest, needed: Sequence[int], target: Any) -> dict[int, tuple[SparsePatch, Any]]:
    """The buckets of ``needed`` to take as patches: ``{bucket: (its patch, the base's bytes held)}``.

    Those whose patch's base bucket ``target`` holds as it was applied: a target that can read
    its weights back says so (``reads_back``) and hands out a bucket's bytes by the bucket's id
    (``held_bucket(manifest, bucket, id)``); any other target gets whole buckets.
    """
    if not manifest.patches or not getattr(target, "reads_back", False) or manifest.shards is not None:
        return {}
    wanted = set(needed)
    out = {}
    for patch in manifest.patches:
        if patch.bucket in wanted:
            held = target.held_bucket(manifest, patch.bucket, patch.base_id)
            if held is not None:
                out[patch.bucket] = (patch, held)
    return out


def _rebuild(
    manifest: Manifest, patched: dict[int, tuple[SparsePatch, Any]], patches: list[Any], got: dict[int, Any]
) -> list[int]:
    """Rebuild each patched bucket into ``got``; the buckets whose patch did not rebuild them (logged)."""
    again = []
    for (b, (patch, held)), arrays in zip(patched.items(), patches, strict=True):
        try:
            got[b] = rebuild(manifest, b, held, arrays, patch.crc)
        except PatchError as err:
            logger.warning("%s: fetching the whole bucket instead", err)
            again.append(b)
    return again


def verified(
    manifest: Manifest, needed: Sequence[int], arrays: Sequence[Any], *, verify: Verify
) -> dict[int, Any]:
    """The fetched buckets by index, their checksums checked as asked; what every fetch ends with."""
    # once per process: later reads take no page faults
    populate_store_mapping(False, nbytes(manifest, needed))
    return checked(manifest, dict(zip(needed, arrays, strict=True)), verify=verify)


def at_hand(
    target: Any, manifest: Manifest, buckets: Sequence[Any], needed: Sequence[int], *, verify: Verify
) -> dict[int, Any]:
    """The buckets ``needed`` of a version whose whole buckets are at hand (a rung segment's), as
    ``target`` takes them (its parts cut from them, for a target holding parts), checked as asked.

    Example:
        >>> fetched = at_hand(target, segment.manifest, segment.buckets, [0], verify=False)  # doctest: +SKIP
    """
    cut = view(target, manifest)
    if cut is manifest:
        return checked(manifest, {b: buckets[b] for b in needed}, verify=verify)
    rank_buckets = dict(enumerate(buckets))  # the parts' pieces lie in the whole buckets
    return checked(cut, {b: Assembly(cut, b, rank_buckets) for b in needed}, verify=verify)


def checked(manifest: Manifest, fetched: dict[int, Any], *, verify: Verify) -> dict[int, Any]:
    """``fetched``, once its checksums are checked as asked (``ChecksumError`` if one differs)."""
    shards = manifest.shards  # a sharded version's rank buckets carry its checksums (checked before assembly)
    if verify is True or (verify == "if_present" and (manifest if shards is None else shards).checksums):
        (verify_checksums if shards is None else verify_fetched)(manifest, fetched)
    return fetched


def nbytes(manifest: Manifest, buckets: Sequence[int], target: Any = None, fetched: Any = None) -> int:
    """The bytes of those buckets, as ``target`` takes them (its parts of a sharded version: :func:`view`);
    given what was ``fetched``, a bucket rebuilt from a patch counts the patch's bytes."""
    sizes = view(target, manifest).bucket_nbytes
    return sum(getattr((fetched or {}).get(b), "fetched_nbytes", sizes[b]) for b in buckets)

"""The interface every data path implements, both sides: a version's snapshot, its fetch.

Example:
    >>> transport = transport_for("object_store")
    >>> snap = transport.snapshot("policy", tensors, manifest)   # doctest: +SKIP
    >>> snap.refs                                                # one ObjectRef per bucket
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from raysync.core.codec import same_bytes
from raysync.core.layout import Manifest
from raysync.transports import registry
from raysync.transports.registry import TRANSPORTS, TransportInfo, check_transport

__all__ = [
    "TRANSPORTS",
    "FetchesBuckets",
    "ReceivesInPlace",
    "Reuse",
    "Snapshot",
    "Transport",
    "TransportInfo",
    "check_transport",
    "transport_for",
]

Reuse = Callable[[int, list[Any]], Any]
"""``(bucket index, packed bucket) -> ObjectRef | None``: a previous version's object to re-use."""


def reuse_unchanged(
    refs: Sequence[Any],
    manifest: Manifest,
    selected: Collection[str] | None,
    previous_buckets: Sequence[Any] | None = None,
) -> Reuse:
    """Re-use ``refs[b]``, a previous version's objects in the same layout, for each bucket that
    holds none of ``selected`` (a ``keys=`` push) or, given ``previous_buckets``, whose bytes equal
    the previous ones (a ``delta=`` push).

    Example:
        >>> reuse = reuse_unchanged(prev.refs, manifest, {"lora.A"})   # doctest: +SKIP
    """

    def reuse(b: int, bucket: list[Any]) -> Any:
        untouched = selected is not None and not any(e.key in selected for e in manifest.bucket_entries(b))
        if untouched or (previous_buckets is not None and same_bytes(bucket, previous_buckets[b])):
            return refs[b]
        return None

    return reuse


@dataclass
class Snapshot:
    """A version taken: its manifest (checksums added), one ref per bucket, and what it cost.

    Attributes:
        manifest: the layout, with checksums if asked for.
        refs: one ``ObjectRef`` per bucket.
        bytes_put: bytes written for it (object store or snapshot buffers).
        buckets_put: buckets written (the rest re-use a previous version's objects).
        keep_locally: whether the pusher may keep the refs to offer the version again.
        stats: transport-specific figures for ``HubClient.last_push``.
    """

    manifest: Manifest
    refs: list[Any]
    bytes_put: int
    buckets_put: int
    keep_locally: bool = True
    stats: dict[str, Any] = field(default_factory=dict)


class Transport(Protocol):
    """One data path: the trainer's side (snapshot), with :class:`FetchesBuckets` or
    :class:`ReceivesInPlace` for the receivers' side.

    A data path is one module with one such class. raysync's are ``object_store`` and
    ``nixl``; another is named ``"<module>:<Class>"`` (:mod:`raysync.transports.registry`).

    Example:
        >>> t = transport_for("object_store")
        >>> snap = t.snapshot("policy", tensors, manifest)                 # trainer
        >>> buckets = fetcher("object_store")(snap.manifest, snap.refs, [0], timeout=30)   # receiver
    """

    name: str
    info: TransportInfo  # what it allows: relays, node shared memory, in-place receives, ...

    def snapshot(
        self,
        model_id: str,
        tensors: Mapping[str, torch.Tensor],
        manifest: Manifest,
        *,
        checksum: bool = False,
        reuse: Reuse | None = None,
    ) -> Snapshot:
        """Trainer side: copy the tensors once into where receivers read them; the caller may
        change them after. The manifest it returns names this data path."""
        ...

    def close(self) -> None:
        """Trainer side: release what this instance holds for later pushes (buffer pools and their
        registrations, staging memory) that no version still being read uses; a later push makes
        them anew. Called by :meth:`raysync.HubClient.close`; calling it twice is harmless."""
        ...


class FetchesBuckets(Protocol):
    """The receiver's side of a data path that hands out buckets (the object store): receivers fetch
    those they lack and copy them in. A path that receives in place has :class:`ReceivesInPlace`
    instead; :func:`~raysync.transports.registry.fetcher` finds the one or says why there is none.

    Example:
        >>> buckets = fetcher("object_store")(manifest, refs, [0], timeout=30)   # doctest: +SKIP
    """

    @staticmethod
    def fetch(
        manifest: Manifest, refs: Sequence[Any], needed: Sequence[int], *, timeout: float | None
    ) -> list[Any]:
        """The buckets ``needed`` (indices into ``refs``) as a receiver reads them, to copy from (each a
        list of uint8 arrays)."""
        ...


class ReceivesInPlace(Protocol):
    """What a data path whose ``info.in_place`` is true adds: the receiver's side that receives
    straight into a receiver's spare buffers (NIXL). Paths that fetch buckets do not have it.

    Example:
        >>> nbytes = transport_class("nixl").receive_into(bound, refs, ids, timeout=30)  # doctest: +SKIP
    """

    @staticmethod
    def receive_into(
        bound: Any,
        refs: Sequence[Any],
        ids: Sequence[str | None],
        *,
        timeout: float,
        extra_state: Sequence[tuple[str, bytes]] = (),
    ) -> int:
        """Receiver side of a path that receives in place (``info.in_place``): into the spare
        buffers of ``bound`` (a :class:`~raysync.core.bound.BoundModel`), which the caller swaps in;
        the bytes received."""
        ...


def transport_for(name: str) -> Transport:
    """A fresh instance of the named data path (one per client: NIXL keeps buffer pools)."""
    cls = registry.transport_class(name)
    instance: Transport = cls()
    return instance

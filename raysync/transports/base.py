"""The interface every hub data path implements: take a version's snapshot, hand back refs.

Example:
    >>> transport = transport_for("object_store")
    >>> snap = transport.snapshot("policy", tensors, manifest)   # doctest: +SKIP
    >>> snap.refs                                                # one ObjectRef per bucket
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from raysync.core.layout import Manifest

__all__ = [
    "TRANSPORTS",
    "HubTransport",
    "Reuse",
    "Snapshot",
    "check_transport",
    "transport_for",
]

TRANSPORTS = ("object_store", "nixl")
"""The hub's data paths, by name (``hub.push(..., transport=...)``, ``raysync.connect(transport=...)``)."""


Reuse = Callable[[int, list[Any]], Any]
"""``(bucket index, packed bucket) -> ObjectRef | None``: a previous version's object to re-use."""


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


class HubTransport(Protocol):
    """A data path for the hub: the trainer's side of it (receivers are in :mod:`raysync.receivers`)."""

    name: str
    supports_partial: bool  # keys= / delta= / checksum=

    def snapshot(
        self,
        model_id: str,
        tensors: Mapping[str, torch.Tensor],
        manifest: Manifest,
        *,
        checksum: bool = False,
        reuse: Reuse | None = None,
    ) -> Snapshot:
        """Copy the tensors once into where receivers read them; the caller may change them after."""
        ...


def check_transport(transport: Any) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def transport_for(name: str) -> HubTransport:
    """A fresh instance of the named data path (one per client: NIXL keeps buffer pools)."""
    check_transport(name)
    if name == "nixl":
        from raysync.transports.nixl import NixlTransport

        return NixlTransport()
    from raysync.transports.object_store import ObjectStoreTransport

    return ObjectStoreTransport()

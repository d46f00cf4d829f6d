"""Which data paths exist and what each can do: found by name, without importing them.

Every version names its data path (``Manifest.transport``). The hub and relays (torch-free
processes) and every receiver ask this registry what that path allows, by name, and get
:class:`TransportInfo`; receivers and pushers get its class (:func:`transport_class`), whose
module is imported on first use. Nothing outside ``raysync.transports`` compares names.

A data path of one's own is one module with one class (both sides, see
:class:`~raysync.transports.base.Transport`); its name is ``"<module>:<Class>"``, so every
process that meets a version of it imports it by that name:

    >>> hub.push(model, transport="my_pkg.my_transport:MyTransport")   # doctest: +SKIP

Example:
    >>> info("nixl").relayable, info("object_store").node_shared
    (False, True)
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raysync.errors import RaySyncError

__all__ = [
    "BUILTIN", "DEFAULT", "TRANSPORTS", "TransportInfo", "check_transport", "fetcher", "info",
    "transport_class",
]  # fmt: skip


@dataclass(frozen=True)
class TransportInfo:
    """What a data path allows (the hub's, relays' and receivers' view of it).

    Attributes:
        name: its name, as versions carry it.
        partial: the pusher may send part of a version (``keys=``, ``delta=``) and checksums.
        relayable: a relay may forward its refs to the receivers of a node (the object store's
            refs travel anywhere; NIXL's carry the sender's tensor transport, which a hop loses).
        node_shared: a relay may copy a version's bytes into node shared memory (the doorbell).
        in_place: receivers receive straight into their spare buffers (then swap), instead of
            fetching buckets and copying them in.
        checksummed: versions carry checksums when asked (``push(checksum=True)``).
        pushable: a pusher may name it (``hub.push(transport=...)``); ``sharded`` is the name the
            hub gives a sharded trainer's versions, never a pusher's.
        object_store: the bytes live in Ray's object store: a push is checked against its
            capacity first, and refs may travel in any Ray call (the schemes layer's path).
        rank_pieces: a sharded trainer's ranks may each put their own pieces over it.
    """

    name: str
    partial: bool = True
    relayable: bool = True
    node_shared: bool = False
    in_place: bool = False
    checksummed: bool = True
    pushable: bool = True
    object_store: bool = False
    rank_pieces: bool = False


BUILTIN: dict[str, tuple[str, TransportInfo]] = {
    "object_store": (
        "raysync.transports.object_store:ObjectStoreTransport",
        TransportInfo("object_store", node_shared=True, object_store=True, rank_pieces=True),
    ),
    "nixl": (
        "raysync.transports.nixl:NixlTransport",
        TransportInfo("nixl", partial=False, relayable=False, in_place=True, checksummed=False),
    ),
    # A sharded trainer's versions (every rank its own pieces); the hub names it, not the
    # pusher. Relays forward its refs; the doorbell's copy of whole buckets is not wired to it.
    # Checksums are the ranks' own, one per rank bucket (ShardMap.checksums).
    "sharded": (
        "raysync.transports.sharded:ShardedTransport",
        TransportInfo("sharded", partial=False, pushable=False, object_store=True),
    ),
}
"""The data paths raysync ships: name -> (``module:Class``, what it allows)."""

TRANSPORTS = tuple(n for n in BUILTIN if n != "sharded")  # the hub names "sharded" versions
"""raysync's own data paths, by name (``hub.push(transport=...)``, ``raysync.connect(transport=...)``)."""

DEFAULT = "object_store"
"""The data path a push takes unless told otherwise (and every sharded push)."""

_CLASSES: dict[str, Any] = {}
_LOCK = threading.Lock()


def _target(name: str) -> str:
    builtin = BUILTIN.get(name)
    if builtin is not None:
        return builtin[0]
    if ":" not in name:
        raise ValueError(
            f"transport must be one of {sorted(BUILTIN)} or '<module>:<Class>' of a data path of your "
            f"own, got {name!r}"
        )
    return name


def check_transport(name: Any) -> None:
    """Raise ``ValueError`` for a name that is no data path (a built-in, or ``module:Class``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"transport must be a non-empty string, got {name!r}")
    _target(name)


def transport_class(name: str) -> Any:
    """The class of a data path (its module imported on first use).

    Raises:
        ValueError: not a data path's name, or its module or class cannot be found.
    """
    with _LOCK:
        cls = _CLASSES.get(name)
    if cls is not None:
        return cls
    module_name, _, class_name = _target(name).partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"no data path {name!r}: {err}") from err
    if getattr(cls, "name", name) != name and name not in BUILTIN:
        raise ValueError(f"{name!r} names a class whose name is {cls.name!r}; set name = {name!r} on it")
    declared = getattr(cls, "info", None)
    if (
        isinstance(declared, TransportInfo)
        and declared.in_place
        and not callable(getattr(cls, "receive_into", None))
    ):
        raise ValueError(
            f"data path {name!r} says info.in_place=True but has no receive_into(bound, refs, ids, "
            "*, timeout, extra_state): add it, or set in_place=False so receivers fetch its buckets"
        )
    with _LOCK:
        _CLASSES[name] = cls
    return cls


def fetcher(name: str) -> Callable[..., Any]:
    """The receiver side of a data path that hands out buckets: its ``fetch`` (a static method).

    A path that receives in place (``info.in_place``: NIXL) has none: its versions go straight
    into a receiver's spare buffers, so one that copies from fetched buckets cannot take them.

    Raises:
        RaySyncError: ``name`` receives in place (it says what the receiver needs instead).
    """
    fetch = getattr(transport_class(name), "fetch", None)
    if fetch is None:
        raise RaySyncError(
            f"this version came over {name!r}, which receives in place into a subscriber's own buffers; "
            "a receiver that copies from fetched buckets needs transport='object_store'"
        )
    return fetch  # type: ignore[no-any-return]


def info(name: str, *, load: bool = True) -> TransportInfo:
    """What a data path allows, by name.

    Built-ins are known without importing them. Another data path says it itself (its class's
    ``info``, a :class:`TransportInfo`); with ``load=False`` (the hub and relays, which never
    import users' code), or where its module cannot be imported, the answer is the most careful
    one: no relay, no shared memory (the hub then hands it to each receiver by a Ray call).
    """
    builtin = BUILTIN.get(name)
    if builtin is not None:
        return builtin[1]
    found = None
    if load:
        try:
            found = getattr(transport_class(name), "info", None)
        except ValueError:
            found = None
    return found if isinstance(found, TransportInfo) else TransportInfo(name, relayable=False)

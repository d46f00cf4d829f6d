"""The hub's records: a kept version, a model, a subscription, a wait, a group, the tables (plain data)."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raysync._protocol import (
    Announcement,
    Laggard,
    RelayMember,
    SubscriberInfo,
)
from raysync.core.layout import Manifest
from raysync.hub.state.cohort import Cohort, Kept, OfRow, Seen, Shared

__all__ = ["DeliveryGroup", "Model", "Subscriber", "Tables", "Version", "Waiter"]

_STAMPS_KEPT = 100_000  # published version numbers remembered per model (lag counts versions)
_SCHEMAS_KEPT = 10_000  # distinct subscriber schemas numbered (Subscriber.schema_key)
_SCHEMA_IDS: dict[tuple[Any, ...], int] = {}
_SCHEMA_NUMBERS = itertools.count(1)


@dataclass
class Version:
    """One kept version: the hub holds its refs (borrowed from the pusher), never its bytes."""

    version: int
    manifest: Manifest
    refs: list[Any]
    pushed_at: float
    pusher: dict[str, Any]

    def announce(self, model_id: str, sub_ids: tuple[str, ...] = ()) -> Announcement:
        return Announcement(model_id, self.version, self.manifest, tuple(self.refs), sub_ids)


@dataclass
class Model:
    versions: dict[int, Version] = field(default_factory=dict)
    latest: int = 0
    pushes: int = 0
    bytes_pushed: int = 0
    last_push_time: float | None = None
    writer: dict[str, Any] | None = None  # the process (or actor) holding the writer lease
    epoch: int = 0  # the lease's fencing epoch: it changes whenever the lease passes to another process
    session: str | None = None  # the process (of the writer) that holds the current epoch
    reserved: int = 0  # every number up to this one was granted or stamped (persisted before use)
    stamps: list[int] = field(default_factory=list)  # numbers of the versions published (newest kept)
    # The established layout, ``{key: (shape, dtype)}`` of its versions: what a push is checked
    # against (None until the first version, and again when the writer lease passes on).
    layout: dict[str, tuple[tuple[int, ...], str]] | None = None
    layout_hash: str | None = None  # a version's layout hash found to fit ``layout``

    def published(self, version: int) -> None:
        """Count a version as published (for lag in versions: numbers skip at a new writer)."""
        if not self.stamps or version > self.stamps[-1]:
            self.stamps.append(version)
        elif version not in self.stamps:
            bisect.insort(self.stamps, version)
        if len(self.stamps) > _STAMPS_KEPT:
            del self.stamps[: len(self.stamps) - _STAMPS_KEPT]

    def versions_after(self, applied: int | None) -> int:
        """How many published versions are newer than ``applied`` (``None``: it holds none, so all)."""
        return len(self.stamps) - bisect.bisect_right(self.stamps, applied or 0)

    @property
    def issued(self) -> int:
        """The highest number ever handed out (granted to a writer or stamped here)."""
        return max(self.latest, self.reserved)

    @property
    def newest(self) -> Version | None:
        return self.versions.get(self.latest)


@dataclass(eq=False)
class Subscriber:
    """One subscription as the hub sees it.

    The fields its delivery group's cohort holds while it is in step with the others
    (:mod:`~raysync.hub.state.cohort`) are descriptors: read and written as plain fields.
    """

    _cohort: Cohort | None = field(default=None, init=False, repr=False)  # first: set before the rest
    sub_id: str
    model_id: str
    reachable: bool  # its process polls for the hub's calls (not: restored after a restart, plain processes)
    info: SubscriberInfo
    schema: dict[str, tuple[tuple[int, ...], str]] | None = None
    applied: int | None = Shared(None)  # type: ignore[assignment]
    sent: int = Shared(0)  # type: ignore[assignment]  # newest version handed to it (in flight or done)
    failed: int = 0  # newest version that failed to apply
    last_apply_time: float | None = Shared(None)  # type: ignore[assignment]
    last_apply_s: float | None = OfRow(None, 1)  # type: ignore[assignment]
    last_pause_s: float | None = OfRow(None, 2)  # type: ignore[assignment]
    last_buckets_fetched: int | None = OfRow(None, 3)  # type: ignore[assignment]
    last_bytes_fetched: int | None = OfRow(None, 4)  # type: ignore[assignment]
    last_prefetched: bool = Kept(False)  # type: ignore[assignment]
    last_error: str | None = Kept(None)  # type: ignore[assignment]
    error_version: int | None = None  # the version last_error is about (None: not about one)
    # the version it holds, if its own code changed it in place since
    modified_since: int | None = Kept(None)  # type: ignore[assignment]
    state: str = Kept("live")  # type: ignore[assignment]  # live | unreachable | restoring | dead
    # why its model does not fit the model id's versions (not delivered them)
    misfit: str | None = Kept(None)  # type: ignore[assignment]
    receivers: list[dict[str, Any]] | None = None  # an adapter's receivers
    last_seen: float = Seen(0.0)  # type: ignore[assignment]  # registration, heartbeat or reply
    relay_pending: bool = Kept(False)  # type: ignore[assignment]  # its relay hands it a version still
    doorbell_key: bytes | None = field(default=None, repr=False)  # never persisted or shown
    # Whether the hub hands it versions: push subscribers and Followers (not pull ones); so
    # whether a wait counts it without ``include_pull``. Plain fields, read per subscriber per
    # version (set from ``info``, which never changes).
    pushed: bool = field(init=False)
    # Subscriptions delivered together share one delivery loop: through relays (the default),
    # every subscription of a model on one node, one message per node per version (``None``:
    # delivered alone, by its own call from the hub). Set with ``via_node`` (:meth:`route`).
    group: str | None = field(init=False, default=None)
    via_node: bool = field(init=False, default=False)  # delivered through its node's relay

    def __post_init__(self) -> None:
        self.pushed = self.info.mode != "pull"
        if self.last_seen == 0.0:
            self.last_seen = time.monotonic()

    def route(self, via_node: bool) -> None:
        """Deliver it through its node (its group's one message per version), or alone."""
        self.via_node = via_node
        self.group = f"{self.model_id}@node:{self.info.node_id}" if via_node else None

    def relay_member(self) -> RelayMember:
        """What its node's relay (or the hub, on its own node) needs to hand it a version."""
        return RelayMember(self.info.address, self.info.doorbell, self.doorbell_key)

    @functools.cached_property
    def schema_key(self) -> int | None:
        """Subscribers with equal schemas are validated together (and once per layout): the
        schema's number, the same for equal schemas (a small key, hashed per delivery)."""
        if self.schema is None:
            return None
        schema = tuple(sorted((k, tuple(shape), str(dt)) for k, (shape, dt) in self.schema.items()))
        if len(_SCHEMA_IDS) > _SCHEMAS_KEPT:
            _SCHEMA_IDS.clear()  # numbers are never given twice: a cleared schema gets a new one
        number = _SCHEMA_IDS.get(schema)
        if number is None:
            number = _SCHEMA_IDS[schema] = next(_SCHEMA_NUMBERS)
        return number

    def settled(self, version: int) -> bool:
        """Holds ``version`` (or newer), or failed to apply it: a wait for it no longer waits."""
        return (self.applied is not None and self.applied >= version) or self.failed >= version

    def laggard(self) -> Laggard:
        return Laggard(self.sub_id, self.info.class_name, self.applied, self.last_error, self.state)

    def persisted(self) -> dict[str, Any]:
        """What the hub keeps of it in the GCS, so that a restarted hub knows whom to wait for."""
        return {"model_id": self.model_id, "info": self.info.row()}

    @classmethod
    def restored(cls, sub_id: str, record: dict[str, Any]) -> Subscriber:
        """A subscription known from before a restart: waited for until it registers again.

        The fields a record holds that this raysync no longer knows (written by an older one:
        ``batch``) are left out."""
        known = {f.name for f in dataclasses.fields(SubscriberInfo)}
        info = SubscriberInfo(**{k: v for k, v in record["info"].items() if k in known})
        return cls(sub_id, record["model_id"], False, info, state="restoring")


@dataclass(eq=False)
class Waiter:
    """One wait: the subscribers it still waits for; woken when none is left (or one more registered).

    ``on_wake`` is the waiting side's (the hub actor sets an event of its loop): the state
    itself holds no event loop object.
    """

    version: int
    pending: set[str]
    include_pull: bool = False
    need: int = 0  # subscribers that must have registered too (``wait(subscribers=n)``)
    on_wake: Callable[[], None] | None = None
    woken: bool = False
    failures: bool = False  # one it waited for failed the version (so its answer must look again)
    cohorts: set[Cohort] = field(default_factory=set)  # nodes' cohorts it waits for (each counted once)

    def counts(self, sub: Subscriber) -> bool:
        """Whether it waits for ``sub``: of a mode it counts, and not a misfit (which never applies)."""
        return (self.include_pull or sub.pushed) and sub.misfit is None

    def let_go(self, *sub_ids: str) -> None:
        """It waits for ``sub_ids`` no more; woken once it waits for no one."""
        self.pending.difference_update(sub_ids)
        if not self.pending and not self.cohorts:
            self.wake()

    def wake(self) -> None:
        self.woken = True
        if self.on_wake is not None:
            self.on_wake()


@dataclass(eq=False)
class DeliveryGroup:
    """One node's subscriptions of one model, delivered by one message (to its relay, or the hub's own).

    Its members in step form its :class:`~raysync.hub.state.cohort.Cohort`; the others are
    ``outside`` it, each handed and recorded on its own.
    """

    members: dict[str, Subscriber] = field(default_factory=dict)
    node_id: str | None = None  # set: the members are delivered through this node's relay
    known: set[str] = field(default_factory=set)  # members the relay has been told of
    relay_pid: int | None = None  # the relay process that answered last
    here: bool = False  # delivered by the hub itself (its own node, a small group): ``known`` is the hub's
    outside: dict[str, Subscriber] = field(default_factory=dict)
    cohort: Cohort = field(init=False)

    def __post_init__(self) -> None:
        self.cohort = Cohort(self.outside)

    def add(self, sub: Subscriber) -> None:
        self.members[sub.sub_id] = sub
        self.outside[sub.sub_id] = sub
        self.known.discard(sub.sub_id)  # a new registration may carry a new doorbell

    def discard(self, sub: Subscriber) -> None:
        if sub._cohort is self.cohort:
            self.cohort.leave(sub)
        del self.members[sub.sub_id]
        self.outside.pop(sub.sub_id, None)
        self.known.discard(sub.sub_id)

    def relay_lost(self) -> None:
        """The relay died or restarted: what it was still doing is lost; hand it all again."""
        self.known.clear()
        for sub in list(self.outside.values()):  # a cohort's members have nothing pending
            if sub.relay_pending:
                sub.relay_pending = False
                sub.sent = 0


@dataclass(eq=False)
class Tables:
    """What the hub knows, shared by the parts of :class:`~raysync.hub.state.HubState` (plain data).

    Indexes keep every event O(1) in the number of subscribers of other models: by model,
    by delivery group, and the waits of each model.
    """

    name: str
    keep: int
    relay: bool = False  # deliver push subscriptions through one relay per node
    delivery_calls: int = 0  # Ray calls the hub made to hand out versions (relays and subscribers)
    models: dict[str, Model] = field(default_factory=dict)
    subs: dict[str, Subscriber] = field(default_factory=dict)
    by_model: dict[str, dict[str, Subscriber]] = field(default_factory=dict)
    groups: dict[str, DeliveryGroup] = field(default_factory=dict)
    model_groups: dict[str, dict[str, DeliveryGroup]] = field(default_factory=dict)  # by model
    solo: dict[str, dict[str, Subscriber]] = field(default_factory=dict)  # pushed, in no group, by model
    waiters: dict[str, set[Waiter]] = field(default_factory=dict)

    def subscribers(self, model_id: str) -> list[Subscriber]:
        """The model's subscribers that are not dead."""
        return [s for s in self.by_model.get(model_id, {}).values() if s.state != "dead"]

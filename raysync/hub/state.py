"""What the hub knows and its rules, as plain Python (no Ray, no event loop needed).

Versions (stamped in order, the newest ``keep`` kept), writer leases (one writer per
model), subscribers (who holds what, who is behind), and waits (who a wait still
waits for). :class:`~raysync.hub.actor.WeightHub` is the shell around it that talks
to Ray: delivery loops, pings, persistence.

Example:
    >>> state = HubState("raysync", keep=2)
    >>> v = state.stamp("policy", manifest, refs, pusher={"writer_id": "job:01"})
    >>> v.version, state.latest("policy")
    (1, 1)
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from raysync._protocol import (
    Announcement,
    ApplyReport,
    Grant,
    Laggard,
    Registration,
    RelayMember,
    SubscriberInfo,
)
from raysync.core.layout import Manifest, validate
from raysync.errors import StaleWriterError, UnknownModelError, WeightMismatchError

__all__ = ["HubState", "Model", "Subscriber", "Version", "Waiter"]

logger = logging.getLogger(__name__)

_FITS_KEPT = 4096  # (layout, schema) pairs remembered as fitting before the memo starts afresh
_STAMPS_KEPT = 100_000  # published version numbers remembered per model (lag counts versions)


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
    """One subscription as the hub sees it."""

    sub_id: str
    model_id: str
    handle: Any  # None: the hub cannot call it (known from before a restart, or a plain process)
    info: SubscriberInfo
    schema: dict[str, tuple[tuple[int, ...], str]] | None = None
    applied: int | None = None
    sent: int = 0  # newest version handed to it (a delivery in flight or done)
    failed: int = 0  # newest version that failed to apply
    last_apply_time: float | None = None
    last_apply_s: float | None = None
    last_pause_s: float | None = None
    last_buckets_fetched: int | None = None
    last_bytes_fetched: int | None = None
    last_prefetched: bool = False
    last_error: str | None = None
    error_version: int | None = None  # the version last_error is about (None: not about one)
    modified_since: int | None = None  # the version it holds, if its own code changed it in place since
    state: str = "live"  # live | unreachable | restoring | dead
    receivers: list[dict[str, Any]] | None = None  # an adapter's receivers
    last_seen: float = field(default_factory=time.monotonic)  # registration, heartbeat or reply
    task: Any = None  # the actor's delivery loop for it (the state never touches it)
    via_node: bool = False  # delivered through its node's relay (set when indexed)
    relay_pending: bool = False  # its relay is still handing it a version (its ack comes later)
    doorbell_key: bytes | None = field(default=None, repr=False)  # never persisted or shown

    @property
    def mode(self) -> str:
        return self.info.mode

    @property
    def ringable(self) -> bool:
        """Whether its node's relay (or the hub) can ring its doorbell: an address and the key."""
        return bool(self.info.doorbell and self.doorbell_key)

    @property
    def waited_for(self) -> bool:
        """Whether a wait counts it without ``include_pull``: push and follow subscribers."""
        return self.info.mode != "pull"

    def relay_member(self) -> RelayMember:
        """What its node's relay (or the hub, on its own node) needs to hand it a version."""
        return RelayMember(
            self.handle, self.info.actor_id, self.info.batch, self.info.doorbell, self.doorbell_key
        )

    @functools.cached_property
    def schema_key(self) -> Any:
        """Subscribers with equal schemas are validated together (and once per layout)."""
        if self.schema is None:
            return None
        return tuple(sorted((k, tuple(shape), str(dt)) for k, (shape, dt) in self.schema.items()))

    @property
    def group(self) -> str | None:
        """Subscriptions delivered together share one delivery loop.

        Through relays (the default), every push subscription of a model on one node:
        one message per node per version. Otherwise, subscriptions of one actor that
        asked for batched notifications.
        """
        if self.via_node:
            return f"{self.model_id}@node:{self.info.node_id}"
        if not self.info.batch or not self.info.actor_id:
            return None
        return f"{self.model_id}/{self.info.actor_id}"

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
        """A subscription known from before a restart: waited for until it registers again."""
        return cls(sub_id, record["model_id"], None, SubscriberInfo(**record["info"]), state="restoring")


@dataclass(eq=False)
class Waiter:
    """One wait: the subscribers it still waits for, and the event set when none is left."""

    version: int
    pending: set[str]
    include_pull: bool = False
    need: int = 0  # subscribers that must have registered too (``wait(subscribers=n)``)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def counts(self, sub: Subscriber) -> bool:
        return self.include_pull or sub.waited_for


@dataclass(eq=False)
class Group:
    """Subscriptions delivered by one message: one actor's batched ones, or one node's (via its relay)."""

    members: dict[str, Subscriber] = field(default_factory=dict)
    task: Any = None
    node_id: str | None = None  # set: the members are delivered through this node's relay
    known: set[str] = field(default_factory=set)  # members whose handle the relay has been sent
    relay_pid: int | None = None  # the relay process that answered last

    def relay_lost(self) -> None:
        """The relay died or restarted: what it was still doing is lost; hand it all again."""
        self.known.clear()
        for sub in self.members.values():
            if sub.relay_pending:
                sub.relay_pending = False
                sub.sent = 0


class HubState:
    """The hub's rules over its models, subscribers and waits.

    Indexes keep every event O(1) in the number of subscribers of other models:
    by model, by batch group, and the waits of each model.
    """

    def __init__(self, name: str, keep: int, *, relay: bool = False) -> None:
        self.name = name
        self.keep = max(1, int(keep))
        self.relay = relay  # deliver push subscriptions through one relay per node
        self.delivery_calls = 0  # Ray calls the hub made to hand out versions (relays and subscribers)
        self.models: dict[str, Model] = {}
        self.subs: dict[str, Subscriber] = {}
        self.by_model: dict[str, dict[str, Subscriber]] = {}
        self.groups: dict[str, Group] = {}
        self.waiters: dict[str, set[Waiter]] = {}
        self._fits: set[tuple[str, Any]] = set()  # (layout hash, schema key) found to fit
        self._misfits: dict[tuple[str, Any], str] = {}  # (layout hash, schema key) -> why it does not

    # ------------------------------------------------------------------ subscribers
    def subscribers(self, model_id: str) -> list[Subscriber]:
        """The model's subscribers that are not dead."""
        return [s for s in self.by_model.get(model_id, {}).values() if s.state != "dead"]

    def register(self, reg: Registration) -> tuple[Subscriber, Subscriber | None, Announcement | None]:
        """Add (or re-add) a subscription; the registration it replaces; the newest version to apply.

        The subscriber applies the newest version itself (from its ``__init__``), so
        it counts as sent.
        """
        sub = Subscriber(reg.sub_id, reg.model_id, reg.handle, reg.info, reg.schema)
        sub.doorbell_key = reg.doorbell_key
        if reg.applied is not None and self.believable(sub, reg.applied):
            sub.applied = reg.applied
        replaced = self.add(sub)
        newest = self.newest(reg.model_id)
        if newest is None or (sub.applied is not None and sub.applied >= newest.version):
            return sub, replaced, None
        why = self.misfit(sub, newest.manifest)
        if why is not None:  # say, another job's versions under the same model_id: not offered
            logger.info(
                "hub %r: %s does not take %r version %d (another layout: %s); it waits for a push that fits",
                self.name,
                sub.sub_id,
                reg.model_id,
                newest.version,
                why[:300],
            )
            return sub, replaced, None
        sub.sent = newest.version
        return sub, replaced, newest.announce(reg.model_id)

    def add(self, sub: Subscriber) -> Subscriber | None:
        """Index a subscription; returns the one of the same id it replaces (now removed)."""
        old = self.subs.get(sub.sub_id)
        if old is not None:
            self.remove(old)
        self.subs[sub.sub_id] = sub
        self.by_model.setdefault(sub.model_id, {})[sub.sub_id] = sub
        sub.via_node = self.relay and sub.mode == "push" and bool(sub.info.node_id)
        if sub.group is not None:
            node = sub.info.node_id if sub.via_node else None
            group = self.groups.setdefault(sub.group, Group(node_id=node))
            group.members[sub.sub_id] = sub
            group.known.discard(sub.sub_id)  # a new registration may carry a new handle
        for waiter in self.waiters.get(sub.model_id, ()):
            if waiter.counts(sub) and not sub.settled(waiter.version):
                waiter.pending.add(sub.sub_id)
            elif waiter.need and waiter.counts(sub) and not waiter.pending:
                waiter.event.set()  # one more of the subscribers it waits to see: look again
        return old

    def remove(self, sub: Subscriber) -> Group | None:
        """Forget a subscription (indexes and the waits that waited for it); its emptied group, if any."""
        if self.subs.get(sub.sub_id) is sub:
            del self.subs[sub.sub_id]
        members = self.by_model.get(sub.model_id)
        if members is not None and members.get(sub.sub_id) is sub:
            del members[sub.sub_id]
            if not members:
                del self.by_model[sub.model_id]
        emptied = None
        key = sub.group
        group = self.groups.get(key) if key is not None else None
        if group is not None and group.members.get(sub.sub_id) is sub:
            del group.members[sub.sub_id]
            if not group.members:
                emptied = self.groups.pop(key)  # type: ignore[arg-type]
        for waiter in self.waiters.get(sub.model_id, ()):
            waiter.pending.discard(sub.sub_id)
            if not waiter.pending:
                waiter.event.set()
        return emptied

    def drop(self, sub: Subscriber, why: str) -> Group | None:
        """A subscriber that is gone for good: forget it and say so."""
        emptied = self.remove(sub)
        sub.state = "dead"
        logger.warning(
            "hub %r dropped subscriber %s of %r (at version %s): %s",
            self.name,
            sub.sub_id,
            sub.model_id,
            sub.applied,
            why,
        )
        return emptied

    def settle(self, sub: Subscriber) -> None:
        """Tell the waits on ``sub``'s model that it holds (or failed) what they wait for."""
        for waiter in self.waiters.get(sub.model_id, ()):
            if sub.sub_id in waiter.pending and sub.settled(waiter.version):
                waiter.pending.discard(sub.sub_id)
                if not waiter.pending:
                    waiter.event.set()

    def record(self, sub: Subscriber, report: ApplyReport) -> None:
        """What a subscriber said after it was handed a version (or on its own)."""
        sub.last_seen = time.monotonic()
        if report.lost is not None:
            self.forget_version(sub.model_id, report.lost, f"subscriber {sub.sub_id} could not fetch it")
        if report.reset:
            sub.applied, sub.sent, sub.failed, sub.modified_since = None, 0, 0, None
            sub.last_error = report.error_text()
            return
        applied = report.applied
        if applied is not None and not self.believable(sub, applied):
            self.settle(sub)
            return
        newer = applied is not None and (sub.applied is None or applied > sub.applied)
        if newer:
            sub.applied = applied
        # Only an apply of a newer version clears it; a report of an older held version is stale.
        if report.modified_since is not None and report.modified_since == sub.applied:
            sub.modified_since = report.modified_since
        elif newer:
            sub.modified_since = None
        # A report of an apply describes it (a skipped or deferred one does not): the report
        # of a prefetched swap may arrive after the delivery's reply for the same version.
        if report.describes_apply() and (newer or applied == sub.applied):
            sub.last_apply_time = time.time()
            sub.last_apply_s = report.apply_s
            sub.last_pause_s = report.pause_s
            sub.last_buckets_fetched = report.buckets_fetched
            sub.last_bytes_fetched = report.bytes_fetched
            sub.last_prefetched = report.prefetched
        if report.error is not None:
            sub.last_error = report.error_text()
            sub.error_version = report.failed
            sub.failed = max(sub.failed, report.failed or 0)
        elif applied is not None:
            sub.last_error = sub.error_version = None
        if report.receivers is not None:
            sub.receivers = list(report.receivers)
        if sub.state == "unreachable":
            sub.state = "live"
        self.settle(sub)

    def record_applied(
        self,
        sub: Subscriber,
        version: int,
        apply_s: float | None,
        pause_s: float | None,
        buckets: int | None,
        nbytes: int | None,
        now: float,
    ) -> None:
        """What :meth:`record` does with a plain report of an apply of ``version`` (a relay's compact row)."""
        sub.last_seen = time.monotonic()
        if (sub.applied is not None and version < sub.applied) or not self.believable(sub, version):
            return
        if version != sub.applied:
            sub.modified_since = None
        sub.applied = version
        sub.last_apply_time = now
        sub.last_apply_s, sub.last_pause_s = apply_s, pause_s
        sub.last_buckets_fetched, sub.last_bytes_fetched, sub.last_prefetched = buckets, nbytes, False
        sub.last_error = sub.error_version = None
        if sub.state == "unreachable":
            sub.state = "live"
        self.settle(sub)

    def believable(self, sub: Subscriber, version: int) -> bool:
        """Whether ``sub`` may hold ``version``: this hub issued it. A report of a version it never
        issued (forged, or of another hub's numbering) is refused, logged, and shown as the
        subscriber's error; what it held before stands.
        """
        model = self.models.get(sub.model_id)
        issued = model.issued if model is not None else 0
        if version <= issued:
            return True
        sub.last_error = (
            f"RaySyncError: reported holding version {version} of {sub.model_id!r}, which this hub never "
            f"issued (newest issued: {issued or None}); report ignored"
        )
        logger.error("hub %r: subscriber %s %s", self.name, sub.sub_id, sub.last_error)
        return False

    def delivery_failed(self, sub: Subscriber, version: int, error: BaseException) -> None:
        """Handing ``version`` to ``sub`` raised (not a report of its own): record it as a failure."""
        sub.last_error = f"{type(error).__name__}: {str(error)[:500]}"
        sub.error_version = version
        sub.failed = max(sub.failed, version)
        self.settle(sub)

    def unreachable(self, sub: Subscriber, error: BaseException) -> None:
        """Restarting or not answering: it registers again when it is back."""
        sub.state = "unreachable"
        sub.sent = 0
        sub.last_error = f"{type(error).__name__}: {str(error)[:300]}"

    def stale(self, before: float) -> list[Subscriber]:
        """Subscribers not heard from since ``before`` (monotonic seconds)."""
        return [s for s in self.subs.values() if s.last_seen < before]

    # ------------------------------------------------------------------ versions
    def latest(self, model_id: str) -> int | None:
        model = self.models.get(model_id)
        return model.latest if model and model.latest else None

    def newest(self, model_id: str) -> Version | None:
        model = self.models.get(model_id)
        return model.newest if model else None

    def misfit(self, sub: Subscriber, manifest: Manifest) -> str | None:
        """Why a version's layout does not fit ``sub``'s model (``None``: it fits, or nothing to check).

        Remembered per (layout, schema): a hub that kept another job's versions under the same
        ``model_id`` checks each new subscriber once, not once per delivery.
        """
        if sub.schema is None:
            return None
        key = (manifest.layout_hash, sub.schema_key)
        if key in self._fits:
            return None
        why = self._misfits.get(key)
        if why is None:
            try:
                validate(manifest, sub.schema)
            except WeightMismatchError as err:
                why = str(err)
            if len(self._fits) + len(self._misfits) > _FITS_KEPT:
                self._fits.clear()
                self._misfits.clear()
            if why is None:
                self._fits.add(key)
                return None
            self._misfits[key] = why
        return why

    def mismatches(
        self, model_id: str, manifest: Manifest
    ) -> list[tuple[WeightMismatchError, list[Subscriber]]]:
        """Why a version does not fit the subscribers' models: one error per schema, with its subscribers."""
        by_schema: dict[Any, list[Subscriber]] = {}
        for sub in self.subscribers(model_id):
            if sub.schema is not None and (manifest.layout_hash, sub.schema_key) not in self._fits:
                by_schema.setdefault(sub.schema_key, []).append(sub)
        found = []
        for key, subs in by_schema.items():
            try:
                validate(manifest, subs[0].schema)  # type: ignore[arg-type]
            except WeightMismatchError as err:
                found.append((err, subs))
                continue
            if len(self._fits) > _FITS_KEPT:
                self._fits.clear()
            self._fits.add((manifest.layout_hash, key))  # a layout fits a schema or not, for good
        return found

    def writer_to_check(self, model_id: str, pusher: dict[str, Any], takeover: bool) -> dict[str, Any] | None:
        """One writer per model: None if ``pusher`` may publish; else the lease holder whose
        liveness decides (see :meth:`refuse_writer` and :meth:`hand_over`)."""
        model = self.models.setdefault(model_id, Model())
        me, current = pusher.get("writer_id"), model.writer
        if me is None or current is None or current.get("writer_id") == me:
            if me is not None and current is None:
                model.writer = _lease(pusher)
                model.epoch += 1
            return None
        if takeover:
            logger.warning(
                "hub %r: %s took over model %r (at version %d) from %s",
                self.name,
                who(pusher),
                model_id,
                model.latest,
                who(current),
            )
            model.writer = _lease(pusher)
            model.epoch += 1
            return None
        return current

    def refuse_writer(
        self, model_id: str, current: dict[str, Any], pusher: dict[str, Any]
    ) -> StaleWriterError:
        return StaleWriterError(
            f"model {model_id!r} is written by {who(current)}; this process ({who(pusher)}) may not "
            "push to it. Stop the other trainer, push under another model_id, or take over with "
            "raysync.connect(..., takeover=True)"
        )

    def hand_over(self, model_id: str, current: dict[str, Any], pusher: dict[str, Any]) -> None:
        """The lease holder is gone: ``pusher`` takes the lease."""
        model = self.models[model_id]
        logger.info(
            "hub %r: writer %s of %r is gone; %s takes over at version %d",
            self.name,
            who(current),
            model_id,
            who(pusher),
            model.latest,
        )
        model.writer = _lease(pusher)
        model.epoch += 1

    def grant(self, model_id: str, count: int, pusher: dict[str, Any]) -> Grant:
        """A block of ``count`` version numbers for the lease holder (persist before replying).

        A process of the writer other than the one holding the epoch (a restarted
        trainer, another task of a job) gets a new epoch: the other process's later
        publishes are refused, never interleaved with this one's.
        """
        model = self.models.setdefault(model_id, Model())
        session = pusher.get("session")
        if session != model.session:
            model.epoch += 1
            model.session = session
            if pusher.get("writer_id") is not None:
                model.writer = _lease(pusher)
        first = model.issued + 1
        model.reserved = first + max(1, int(count)) - 1
        return Grant(model_id, model.epoch, first, model.reserved)

    def accept(
        self,
        model_id: str,
        manifest: Manifest,
        refs: list[Any],
        pusher: dict[str, Any],
        version: int,
        epoch: int,
    ) -> Version:
        """Keep a version its writer stamped from a :class:`Grant` (no reply awaited).

        An older one arriving after a newer one (an async actor may run one caller's
        calls out of order) is kept as an older version, never made the newest; the
        same version offered again (after a hub restart lost it) is kept once.

        Raises:
            StaleWriterError: the lease passed to another writer (older ``epoch``), or
                ``version`` was never granted.
        """
        model = self.models.get(model_id)
        if model is not None and epoch != model.epoch and model.writer is not None:
            same = model.writer.get("writer_id") == pusher.get("writer_id")
            if same:
                raise StaleWriterError(
                    f"another process of this writer ({who(model.writer)}) took the writer lease of "
                    f"model {model_id!r} after this process ({who(pusher)}) stamped version {version}, "
                    "so that version was refused; push from one process at a time (this process's "
                    "next push takes the lease back)"
                )
        if model is None or epoch != model.epoch:
            holder = who(model.writer) if model is not None and model.writer else "no writer"
            raise StaleWriterError(
                f"model {model_id!r} is now written by {holder} (lease epoch "
                f"{model.epoch if model else 0}); this process ({who(pusher)}) lost its writer lease "
                f"(epoch {epoch}), so its version {version} was refused. Stop the other trainer, push "
                "under another model_id, or take over with raysync.connect(..., takeover=True)"
            )
        if version > model.reserved:
            raise StaleWriterError(
                f"version {version} of {model_id!r} was never granted (granted up to {model.reserved}); "
                "push again"
            )
        kept = model.versions.get(version)
        if kept is not None:
            return kept
        v = Version(version, manifest, list(refs), time.time(), pusher)
        model.versions[version] = v
        model.latest = max(model.latest, version)
        model.published(version)
        model.pushes += 1
        model.bytes_pushed += manifest.total_nbytes
        model.last_push_time = v.pushed_at
        self.trim(model)
        return v

    def stamp(self, model_id: str, manifest: Manifest, refs: list[Any], pusher: dict[str, Any]) -> Version:
        """Give a version its number and keep it (the oldest beyond ``keep`` are let go).

        The number follows every number ever granted to a writer (persist before replying),
        and it ends the blocks granted before it (a new epoch): a writer stamping from one
        would publish versions older than this one.
        """
        model = self.models.setdefault(model_id, Model())
        if model.session is not None:
            model.epoch += 1
            model.session = None
        model.latest = model.reserved = model.issued + 1
        v = Version(model.latest, manifest, list(refs), time.time(), pusher)
        model.versions[v.version] = v
        model.published(v.version)
        model.pushes += 1
        model.bytes_pushed += manifest.total_nbytes
        model.last_push_time = time.time()
        self.trim(model)
        return v

    def offer_again(
        self, model_id: str, version: int, manifest: Manifest, refs: list[Any], pusher: dict[str, Any]
    ) -> bool:
        """The writer offers its newest version again after a restart lost it; whether it is kept now.

        Accepted for a number not older than the newest the hub knows (a restarted hub
        knows the newest of a moment before it died) and not newer than it ever issued,
        when nothing of it is kept, and only from the lease holder.
        """
        model = self.models.get(model_id)
        if model is None or not model.latest <= version <= model.issued or version in model.versions:
            return False
        writer = model.writer
        if writer is not None and writer.get("writer_id") != pusher.get("writer_id"):
            return False
        model.versions[version] = Version(version, manifest, list(refs), time.time(), pusher)
        model.latest = version
        model.published(version)
        self.trim(model)
        logger.info("hub %r: %r version %d offered again by its writer", self.name, model_id, version)
        return True

    def forget_version(self, model_id: str, version: int, why: str) -> None:
        """Stop offering a version whose bytes are gone (its pusher died)."""
        model = self.models.get(model_id)
        if model is not None and model.versions.pop(version, None) is not None:
            logger.warning(
                "hub %r: version %d of %r is lost (%s; the process that pushed it died); the next push "
                "brings subscribers forward",
                self.name,
                version,
                model_id,
                why,
            )

    def trim(self, model: Model) -> None:
        for v in sorted(model.versions)[: -self.keep]:
            del model.versions[v]  # drops the hub's borrow of that version's objects

    def raise_keep(self, keep: int | None) -> bool:
        """Keep at least ``keep`` versions per model; never fewer than another client asked. Changed?"""
        if keep is None or keep == self.keep:
            return False
        if keep < self.keep:
            logger.warning(
                "hub %r: a client asked for keep=%d; it keeps %d versions per model, as another client "
                "asked (a hub never lowers keep under a client that relies on it)",
                self.name,
                keep,
                self.keep,
            )
            return False
        logger.info("hub %r now keeps %d versions per model (was %d)", self.name, keep, self.keep)
        self.keep = int(keep)
        for model in self.models.values():
            self.trim(model)
        return True

    def get(
        self, model_id: str, version: int | None = None, newer_than: int | None = None
    ) -> Announcement | None:
        """A kept version (the newest by default); None if it is not newer than ``newer_than``.

        Raises:
            UnknownModelError: nothing kept of ``model_id``, or not ``version``.
        """
        model = self.models.get(model_id)
        if model is None or not model.versions:
            raise UnknownModelError(
                f"no version of model {model_id!r} on hub {self.name!r}; models here: "
                f"{sorted(self.models)}. Push one first with hub.push(model, model_id={model_id!r})"
            )
        v = model.versions.get(version if version is not None else model.latest)
        if v is None:
            raise UnknownModelError(
                f"version {version} of model {model_id!r} is not kept (kept: {sorted(model.versions)}); "
                "raise keep= on connect() to keep more"
            )
        if newer_than is not None and v.version <= newer_than:
            return None
        return v.announce(model_id)

    def due(self, sub: Subscriber) -> Version | None:
        """The version a push subscriber should be handed now (the newest it lacks), if any."""
        newest = self.newest(sub.model_id)
        if sub.state == "dead" or newest is None or newest.version <= max(sub.applied or 0, sub.sent):
            return None
        if self.misfit(sub, newest.manifest) is not None:
            return None  # another layout (kept from another job): it waits for one that fits
        return newest

    def due_in_group(self, model_id: str, group: Group) -> tuple[Version | None, list[Subscriber]]:
        newest = self.newest(model_id)
        if newest is None:
            return None, []
        due = [
            s
            for s in group.members.values()
            if s.state != "dead"
            and s.mode == "push"
            and s.handle is not None
            and not s.relay_pending
            and newest.version > max(s.applied or 0, s.sent)
            and self.misfit(s, newest.manifest) is None
        ]
        return newest, due

    # ------------------------------------------------------------------ waits
    def check_waitable(self, model_id: str, version: int, *, granted: bool = True) -> bool:
        """Raise if ``version`` of ``model_id`` was never pushed (a wait for it could only run out).

        Returns whether it was published. A number granted to the writer but not published
        yet (its publish is on its way, or was refused) is waitable with ``granted``; the
        caller gives the publish a moment, then asks again with ``granted=False``.
        """
        model = self.models.get(model_id)
        limit = (model.issued if granted else model.latest) if model is not None else 0
        if model is None or version > limit:
            raise UnknownModelError(
                f"version {version} of model {model_id!r} was never pushed on hub {self.name!r} "
                f"(newest pushed: {model.latest if model and model.latest else None}; models here: "
                f"{sorted(self.models)}); wait for a version push() returned (a refused push's "
                "number is never pushed)"
            )
        return version <= model.latest

    def kept_from(self, model_id: str, version: int) -> bool:
        """Whether a version this new or newer is kept."""
        model = self.models.get(model_id)
        return model is not None and any(v >= version for v in model.versions)

    def pending(
        self, model_id: str, version: int, include_pull: bool = True
    ) -> tuple[list[Laggard], list[Laggard]]:
        """Who a wait for ``version`` still waits for, and who failed it."""
        laggards: list[Laggard] = []
        failures: list[Laggard] = []
        model = self.models.get(model_id)
        kept = model.versions.get(version) if model is not None else None
        for sub in self.subscribers(model_id):
            if not (include_pull or sub.waited_for):
                continue
            if sub.applied is not None and sub.applied >= version:
                continue
            why = None if kept is None else self.misfit(sub, kept.manifest)
            if why is not None:  # it is not offered a version of another layout: it cannot get there
                row = sub.laggard()
                failures.append(dataclasses.replace(row, error=f"WeightMismatchError: {why}"))
                continue
            (failures if sub.failed >= version else laggards).append(sub.laggard())
        return laggards, failures

    def counted(self, model_id: str, include_pull: bool = False) -> int:
        """How many live subscribers of ``model_id`` a wait counts (push and follow; pull too with
        ``include_pull``)."""
        return sum(1 for s in self.subscribers(model_id) if include_pull or s.waited_for)

    def add_waiter(self, model_id: str, waiter: Waiter) -> None:
        self.waiters.setdefault(model_id, set()).add(waiter)

    def remove_waiter(self, model_id: str, waiter: Waiter) -> None:
        waiters = self.waiters.get(model_id)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self.waiters[model_id]

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """Models (versions kept, bytes, last push) and subscribers (applied, lag, errors), as plain data."""
        now = time.time()
        models = {}
        for model_id, model in sorted(self.models.items()):
            newest = model.newest
            models[model_id] = {
                "latest": model.latest or None,
                "versions_kept": sorted(model.versions),
                "bytes_per_version": newest.manifest.total_nbytes if newest else 0,
                "buckets": newest.manifest.num_buckets if newest else 0,
                "layout_hash": newest.manifest.layout_hash if newest else None,
                "pushes": model.pushes,
                "bytes_pushed": model.bytes_pushed,
                "last_push_time": model.last_push_time,
                "last_push_age_s": None if model.last_push_time is None else now - model.last_push_time,
                "writer": model.writer,
            }
        subs = []
        for sub in sorted(self.subs.values(), key=lambda s: (s.model_id, s.sub_id)):
            held = self.models.get(sub.model_id)
            latest = held.latest if held is not None else 0
            # An error about a version older than the newest belongs to a superseded version:
            # the subscriber moves on with the next one (or its next pull), so status drops it.
            error = sub.last_error
            if error is not None and sub.error_version is not None and sub.error_version < latest:
                error = None
            newest = held.newest if held is not None else None
            misfit = None if newest is None or sub.applied is not None else self.misfit(sub, newest.manifest)
            subs.append(
                {
                    "subscriber": sub.sub_id,
                    "model_id": sub.model_id,
                    "actor_id": sub.info.actor_id,
                    "class_name": sub.info.class_name,
                    "node_id": sub.info.node_id,
                    "pid": sub.info.pid,
                    "mode": sub.mode,
                    "apply": sub.info.apply,
                    "applied": sub.applied,
                    "modified_since": sub.modified_since,  # its own code changed `applied` in place
                    # versions published since the one it holds (numbers skip at a new writer)
                    "lag": held.versions_after(sub.applied) if held is not None else 0,
                    "last_apply_time": sub.last_apply_time,
                    # measured at the same moment as the models' last_push_age_s
                    "last_apply_age_s": None if sub.last_apply_time is None else now - sub.last_apply_time,
                    "last_apply_s": sub.last_apply_s,
                    "last_pause_s": sub.last_pause_s,
                    "last_buckets_fetched": sub.last_buckets_fetched,
                    "last_bytes_fetched": sub.last_bytes_fetched,
                    "last_prefetched": sub.last_prefetched,
                    "last_error": error,
                    "state": sub.state,
                    # why it holds nothing yet: the newest version has another layout
                    "waiting_for": None if misfit is None else f"a version that fits ({misfit[:200]})",
                    "receivers": sub.receivers,
                    "placement": sub.info.placement,
                }
            )
        delivery = {
            "relay": self.relay,
            "calls": self.delivery_calls,
            "nodes": sorted({g.node_id for g in self.groups.values() if g.node_id is not None}),
        }
        return {
            "hub": self.name,
            "keep": self.keep,
            "models": models,
            "subscribers": subs,
            "delivery": delivery,
        }


def _lease(pusher: dict[str, Any]) -> dict[str, Any]:
    keys = ("writer_id", "kind", "actor_id", "job_id", "pid", "host")
    return {k: pusher.get(k) for k in keys} | {"since": time.time()}


def who(writer: dict[str, Any]) -> str:
    """A writer as a person reads it: an actor, the tasks of a job, or a job's driver."""
    kind = writer.get("kind") or ("actor" if writer.get("actor_id") else "driver")
    where = f"pid {writer.get('pid')} on {writer.get('host')}"
    if kind == "actor":
        return f"actor {writer['actor_id']} ({where})"
    if kind == "tasks":
        return f"tasks of job {writer.get('job_id')} (last push from {where})"
    return f"driver of job {writer.get('job_id')} ({where})"

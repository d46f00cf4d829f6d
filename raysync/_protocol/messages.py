"""The messages and method names of raysync's actors (hub, clients, subscribers): :mod:`raysync._protocol`.

Example:
    >>> report = ApplyReport(applied=3, apply_s=0.002)
    >>> report.holds(3), report.holds(4)
    (True, False)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACQUIRE",
    "ANSWER",
    "BLOCK",
    "CONTRIBUTE",
    "DEFAULT_HUB",
    "DEFAULT_KEEP",
    "DEFAULT_NAMESPACE",
    "GIVE_UP",
    "GET",
    "HEARTBEAT",
    "HEARTBEAT_S",
    "NOTIFY",
    "PING",
    "POLL",
    "PUBLISH",
    "PUBLISH_STAMPED",
    "REGISTER",
    "RELAY_ACKS",
    "RELAY_DELIVER",
    "REPORT",
    "UNREGISTER",
    "WAIT_NEWER",
    "Announcement",
    "Answer",
    "ApplyReport",
    "Caller",
    "Grant",
    "Laggard",
    "PollReply",
    "Publication",
    "Registration",
    "Request",
    "SubscriberInfo",
    "WaitResult",
    "address_job",
    "bucket_ids",
    "process_address",
]

DEFAULT_HUB = "raysync"
"""The hub's actor name unless told otherwise."""

DEFAULT_NAMESPACE = "raysync"
"""raysync's own Ray namespace: every driver, job and the CLI find the same hub there."""

DEFAULT_KEEP = 2
"""Versions per model a new hub keeps unless a client asks for more."""

HEARTBEAT_S = 2.0
"""How often a subscriber (an actor, an adapter, a process) checks in with the hub."""

# Methods a subscriber's actor answers. The hub and relays hold no subscriber's handle (they
# would have to load its class, so import its code): they queue each call as a Request, which
# the subscriber's process collects with a long poll (POLL), runs, and answers (Answer).
NOTIFY = "_raysync_notify"
"""``(announcement) -> ApplyReport``: apply this version (push mode); ``announcement.sub_ids``
names the subscription, so each receiver in a process answers its own."""
PING = "_raysync_ping"
"""``() -> True``."""

# Methods of the hub and of each relay (called by every subscriber process).
POLL = "raysync_poll"
"""``(caller, answers, running, timeout) -> PollReply``: answers to earlier requests, the ids
still running; returns the calls queued for the caller's process (within ``timeout`` s)."""
ANSWER = "raysync_answer"
"""``(caller, answers)``: answers of requests that ended after the poll that carried them."""

# Methods of a node's relay (called by the hub).
RELAY_DELIVER = "deliver"
"""``(delivery: RelayDelivery) -> RelayReply``: hand a version to the relay's subscribers on its node."""

# Methods of the hub (called by subscribers, adapters and relays).
RELAY_ACKS = "relay_acks"
"""``(node_id, model_id, version, reply)``: a relay's late acks (subscribers slower than its window)."""

REGISTER = "register"
"""``(registration) -> Announcement | None``: join; the newest version to start from, if any."""
HEARTBEAT = "heartbeat"
"""``(sub_ids) -> list[str]``: check in; the ids the hub does not know (register them again)."""
REPORT = "report"
"""``(sub_id, report)``: what a subscriber applied on its own (start-up, pull, a deferred apply)."""
UNREGISTER = "unregister"
"""``(sub_id)``: leave."""
GET = "get"
"""``(model_id, version=None, newer_than=None) -> Announcement | None``: pull."""
WAIT_NEWER = "wait_newer"
"""``(model_id, version, timeout) -> Announcement | None``: long poll."""

# Methods of the hub (called by writers).
ACQUIRE = "acquire"
"""``(model_id, pusher, takeover, count) -> Grant``: the writer lease and a block of version numbers."""
PUBLISH = "publish"
"""``(model_id, manifest, refs, pusher, takeover, version=None, epoch=None) -> int``: a new version.

With ``version`` and ``epoch`` (from a :class:`Grant`) the writer stamped it itself and
need not wait for the reply; without them the hub stamps it (one round trip)."""

PUBLISH_STAMPED = "publish_stamped"
"""``(publication) -> int``: a version its writer stamped (one message: one argument to serialize)."""

CONTRIBUTE = "contribute"
"""``(model_id, part, refs, pusher, takeover, timeout, settle, previous, stamp) -> PartTaken``: a rank's
part; with ``stamp`` (the number the rank gave it from its group's block) it is posted without waiting."""

GIVE_UP = "give_up"
"""``(model_id, group token, push, rank, why) -> None``: a sharded rank's push raised before its part went."""

BLOCK = 100
"""Version numbers a writer takes with each grant (the hub persists once per block)."""


@dataclass(frozen=True)
class SubscriberInfo:
    """Who a subscriber is, for ``status()`` and for the hub's rules.

    Attributes:
        mode: ``"push"`` (the hub delivers), ``"pull"`` (it asks when its user asks) or
            ``"follow"`` (a :class:`~raysync.Follower`, in an actor or a plain process: the
            hub delivers to it as to a push subscriber, through its process's poll).
        apply: ``"copy"``, ``"view"``, or the adapter's kind.
        actor_id: its Ray actor (``None``: a plain process).
        class_name: the user's class, or the adapter's.
        node_id: the Ray node it runs on.
        pid: its process.
        attr: the attribute that holds the module.
        placement: where an adapter runs (placement group, bundle).
        job_id: the Ray job of a plain process (the hub drops it when that job ends).
        doorbell: the address of its process's doorbell (:mod:`raysync.transports.doorbell`):
            its node's relay rings it instead of calling the actor, for small versions.
    """

    mode: str = "push"
    apply: str = "copy"
    actor_id: str | None = None
    class_name: str | None = None
    node_id: str | None = None
    pid: int | None = None
    attr: str | None = None
    placement: dict[str, Any] | None = None
    job_id: str | None = None
    doorbell: str | None = None

    @property
    def address(self) -> str | None:
        """Where the hub's calls for it go: its actor, or ``job:<job>/<node>/<pid>`` for a process
        that is no actor (a driver, a Ray task's worker: one job may have many)."""
        if self.actor_id:
            return self.actor_id
        return process_address(self.job_id, self.node_id, self.pid) if self.job_id else None

    def row(self) -> dict[str, Any]:
        """The fields as a plain dict (persisted, shown in status)."""
        return dataclasses.asdict(self)


def process_address(job_id: str, node_id: str | None, pid: int | None) -> str:
    """The call address of a process that is no actor: its job, node and pid (``job:...``)."""
    return f"job:{job_id}/{node_id}/{pid}"


def address_job(address: str) -> str | None:
    """The job a :func:`process_address` names (``None``: an actor's address)."""
    return address[4:].split("/", 1)[0] if address.startswith("job:") else None


@dataclass(frozen=True)
class Registration:
    """A subscriber joins (or joins again, after a hub restart).

    Attributes:
        sub_id: unique per (subscriber, model): ``"<actor id>:<model id>"`` for actors.
        model_id: the model it follows.
        reachable: its process answers the hub's calls (it polls for them); ``False``
            for a subscriber the hub cannot call (it follows by long-poll or pull and
            reports what it applied).
        info: who it is.
        schema: ``{key: (shape, dtype)}`` of its model, to refuse pushes that
            would not fit before anything is published (``None``: not checked).
        applied: the version it holds (after a hub restart, or a restart of its own).
        doorbell_key: the secret its process's doorbell checks every ring against
            (``info.doorbell`` set): only who learnt it through Ray's authenticated
            calls (the hub, its node's relay) can ring it. Never persisted or shown.
    """

    sub_id: str
    model_id: str
    reachable: bool
    info: SubscriberInfo
    schema: dict[str, tuple[tuple[int, ...], str]] | None = None
    applied: int | None = None
    doorbell_key: bytes | None = dataclasses.field(default=None, repr=False)


@dataclass(frozen=True)
class Caller:
    """A subscriber process polling the hub or a relay for the calls it is to answer.

    Attributes:
        actor_id: the calls' address: its actor, or :func:`process_address` for a plain process.
        pid: its process: a new one (the actor restarted) fails calls handed to the old.
        node_id: its node (the hub answers with that node's relay, to poll too).
        relay: the relay it polls already (its name), if any.
    """

    actor_id: str
    pid: int
    node_id: str | None = None
    relay: str | None = None


@dataclass(frozen=True)
class Request:
    """A call for a subscriber's actor: ``method`` (:data:`NOTIFY`, ...) with ``announcement``."""

    req_id: int
    method: str
    announcement: Announcement | None = None


@dataclass(frozen=True)
class Answer:
    """What a :class:`Request` returned (``value``), or the error it raised."""

    req_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class PollReply:
    """The calls queued for a process; from the hub, also its node's relay (name, handle) to poll."""

    requests: tuple[Request, ...] = ()
    relay: tuple[str, Any] | None = None


@dataclass(frozen=True)
class Announcement:
    """A version to apply: its number, layout and where its bytes are.

    Attributes:
        model_id: the model.
        version: the hub's stamp.
        manifest: the buckets' layout (a :class:`raysync.core.layout.Manifest`).
        refs: one ``ObjectRef`` per bucket.
        sub_ids: the subscription a call is for (``()``: handed out on registration or pull).
    """

    model_id: str
    version: int
    manifest: Any
    refs: tuple[Any, ...]
    sub_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ApplyReport:
    """What a subscriber holds after it was handed a version.

    Exactly one outcome: applied (``applied`` is that version), ``skipped`` (it
    held that or newer), ``deferred`` (it applies once its running methods end and
    reports then), or ``failed`` (``error`` says why; it keeps ``applied``).

    Attributes:
        applied: the version it holds now (``None``: none).
        skipped: a version it did not apply because it held it or newer.
        deferred: a version whose apply waits for the actor's running methods.
        failed: a version it could not apply.
        error: why, as an exception (``failed``, ``reset``).
        lost: a version whose bytes are gone (its pusher died): the hub stops offering it.
        reset: it holds no version any more (user code re-pointed its parameters).
        timed_out: the failure was a timeout.
        apply_s: seconds from the call to the version held.
        pause_s: seconds its methods were held back.
        buckets_fetched: buckets it fetched.
        bytes_fetched: bytes it fetched.
        prefetched: applied by swapping in a prefetched copy.
        receivers: an adapter's receivers, one row each.
        modified_since: the version it holds, if its own code changed those weights in
            place since it applied them (a module in training mode updating running
            statistics, an optimizer step); ``None``: held as applied (or not said).
            Sent alone (``applied`` None) by the heartbeat that first sees a change;
            only an apply of a newer version clears it on the hub.
    """

    applied: int | None = None
    skipped: int | None = None
    deferred: int | None = None
    failed: int | None = None
    error: BaseException | None = None
    lost: int | None = None
    reset: bool = False
    timed_out: bool = False
    apply_s: float | None = None
    pause_s: float | None = None
    buckets_fetched: int | None = None
    bytes_fetched: int | None = None
    prefetched: bool = False
    receivers: tuple[dict[str, Any], ...] | None = None
    modified_since: int | None = None

    def holds(self, version: int) -> bool:
        """Whether the subscriber holds ``version`` or a newer one."""
        return self.applied is not None and self.applied >= version

    def describes_apply(self) -> bool:
        """Whether it reports an apply just done (its timings mean something)."""
        ok = self.failed is None and (self.error is None or self.receivers is not None)
        return self.applied is not None and self.skipped is None and self.deferred is None and ok

    def error_text(self) -> str | None:
        """``"<Type>: <message>"`` of the error, as status shows it."""
        if self.error is None:
            return None
        return f"{type(self.error).__name__}: {str(self.error)[:1000]}"


@dataclass(frozen=True)
class Grant:
    """The writer lease of a model and a block of version numbers for its holder to stamp.

    Numbers ``first..last`` are the writer's alone: the hub wrote ``last`` to the GCS
    before granting them, and never grants or stamps a number at or below it again,
    across hub restarts too. ``epoch`` fences: it changes whenever the lease passes to
    another writer, and the hub refuses publishes that carry an older one.

    Attributes:
        model_id: the model.
        epoch: the lease's fencing epoch.
        first: the first number of the block.
        last: the last number of the block.
    """

    model_id: str
    epoch: int
    first: int
    last: int


@dataclass(frozen=True)
class Publication:
    """A version its writer stamped from a :class:`Grant`, sent without waiting for the reply.

    Attributes:
        model_id: the model.
        manifest: the buckets' layout (a :class:`raysync.core.layout.Manifest`).
        refs: one ``ObjectRef`` per bucket (the writer owns them).
        pusher: who pushed it (writer identity and the push's figures).
        version: the number the writer stamped.
        epoch: the lease epoch of the grant the number came from.
    """

    model_id: str
    manifest: Any
    refs: tuple[Any, ...]
    pusher: dict[str, Any]
    version: int
    epoch: int


@dataclass(frozen=True)
class Laggard:
    """A subscriber a wait is still waiting for (or that failed the version).

    Attributes:
        subscriber: its id.
        actor: its class name.
        applied: the version it holds.
        error: its last error.
        state: ``live``, ``unreachable`` or ``restoring`` (known from before a hub restart).
    """

    subscriber: str
    actor: str | None
    applied: int | None
    error: str | None
    state: str

    def row(self) -> dict[str, Any]:
        """As a plain dict (what ``SyncTimeoutError.laggards`` holds)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class WaitResult:
    """The end of a wait: who did not get there in time, who failed.

    Attributes:
        laggards: subscribers still short of the version.
        failures: subscribers that failed to apply it (and keep their previous one).
        missing: the hub keeps no version that new (a restart lost it): its writer may offer it again.
        registered: how many subscribers the wait counted when it ran out (``None``: it did not).
        misfits: subscribers whose model does not fit, that ``subscribers=n`` needs: it ends at once.
    """

    laggards: tuple[Laggard, ...] = ()
    failures: tuple[Laggard, ...] = ()
    missing: bool = False
    registered: int | None = None
    misfits: tuple[Laggard, ...] = ()


def bucket_ids(refs: list[Any] | tuple[Any, ...]) -> list[str | None]:
    """Each bucket's identity in an :class:`Announcement`: the object it came from (same object, same bytes).

    Receivers compare them with what they hold to skip unchanged buckets.

    Example:
        >>> bucket_ids([ray.put(b"x")])   # doctest: +SKIP
        ['00ffffffffffffffffffffffffffffffffffffff0100000001e1f505']
    """
    return [r.hex() for r in refs]

"""A node's relay: the hub sends it one message per version; it hands the version to that node's subscribers.

Without relays the hub makes one Ray call per subscriber per version (about a
millisecond of hub CPU each). With them the hub's work per version grows with
the number of nodes that have subscribers: one :class:`~raysync._protocol.RelayDelivery`
per node carries every subscription there, the relay makes the node-local calls
(one per subscriber, each queued for the subscriber's process, which polls the relay for
them: :mod:`raysync.hub.mailbox`) and answers the hub with every subscriber's report in one
:class:`~raysync._protocol.RelayReply`.
Versions up to a few MiB go without a Ray call per subscriber at all: the relay
writes them once into the node's shared memory and rings each subscriber
process's doorbell (:mod:`raysync.transports.doorbell`).

The hub starts a relay on demand, when the first subscriber on a node registers:
placed on that node (``NodeAffinitySchedulingStrategy(soft=False)``), named per hub
and node (:func:`relay_name`), restarted by Ray (``max_restarts=-1``), owned by the
hub (it goes when the hub goes; a restarted hub starts new ones). A relay holds no
state that matters: it learns its subscribers from the hub (once per relay
process), and a relay that dies mid-delivery or mid-ack loses nothing, since the
hub hands the newest version again to every subscriber whose ack it did not get,
and subscribers ignore versions not newer than the one they hold.

Example:
    >>> relay = start_relay("raysync", node_id, settings)   # in the hub
    >>> reply = ray.get(relay.deliver.remote(RelayDelivery(announcement, members)))
    >>> [ack.outcome for ack in reply.acks]
    ['ok', 'ok']
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysync import _protocol as proto
from raysync._protocol import (
    DEFAULT_NAMESPACE,
    Announcement,
    Answer,
    ApplyReport,
    Caller,
    PollReply,
    RelayAck,
    RelayDelivery,
    RelayMember,
    RelayReply,
    bucket_ids,
    compact,
)
from raysync.core.assembly import whole_version
from raysync.hub.mailbox import Mailboxes, SubscriberGone, SubscriberRestarted, SubscriberUnreachable
from raysync.hub.persistence import address_alive
from raysync.hub.priority import control_plane_priority, freeze_startup_objects
from raysync.hub.settings import DEFAULT_RING_ACK_S, HubSettings
from raysync.transports import doorbell
from raysync.transports.registry import info as transport_info

__all__ = [
    "ACK_WINDOW_S",
    "NodeDelivery",
    "NodeRelay",
    "compact",
    "late_acks",
    "notify_members",
    "quiet_threaded_gets",
    "relay_name",
    "rings",
    "start_relay",
]

logger = logging.getLogger(__name__)


def relay_name(hub: str, hub_actor_id: str, node_id: str) -> str:
    """The relay's actor name (in raysync's namespace): one per hub and node.

    Example:
        >>> relay_name("raysync", "9f" * 16, "ab" * 28)
        'raysync-relay:raysync:9f9f9f9f9f9f:abababababababababababab'
    """
    return f"raysync-relay:{hub}:{hub_actor_id[:12]}:{node_id[:24]}"


class NodeDelivery:
    """What a relay does with each version for its node's subscribers, as plain Python.

    The relay actor wraps one (:class:`NodeRelay`); the hub keeps one for its own node,
    where it rings doorbells itself (no hop through a relay). ``send_late(model_id,
    version, reply)`` takes the acks of subscribers slower than the window; ``settings``
    are the hub's (``doorbell_bytes``, ``ring_ack_s``).
    """

    def __init__(
        self,
        node_id: str,
        send_late: Callable[[str, int, RelayReply], None],
        mail: Mailboxes,
        settings: HubSettings,
    ) -> None:
        self._node_id = node_id
        self.mail = mail  # calls to this node's subscribers' actors (they poll for them)
        self._doorbell_bytes = settings.doorbell_bytes or 0  # the largest version handed over by doorbell
        # A rung subscriber silent this long is called too.
        self._ring_ack_s = settings.ring_ack_s or DEFAULT_RING_ACK_S
        self._send_late = send_late
        self._members: dict[str, RelayMember] = {}
        self.delivered = 0  # calls made to subscribers
        self.deliveries = 0  # messages from the hub
        self.rung = 0  # doorbells rung (one per subscriber process and version)
        self.called_after_ring = 0  # rung subscriptions not acked in time, called the Ray way too
        # Why subscriptions were called instead of rung, per reason (says why a node is not rung)
        self.not_rung: collections.Counter[str] = collections.Counter()
        self.last_ring_error: str | None = None  # the message of the last ring that failed
        # The node-local hop for small versions (transports/doorbell.py): made on first use.
        self._bell: tuple[doorbell.Ringer, doorbell.SegmentWriter] | None = None
        self._late_rows: dict[tuple[str, int], list[RelayAck]] = {}
        self._timing: collections.deque[tuple[float, float]] = collections.deque(maxlen=100)

    async def deliver(self, delivery: RelayDelivery) -> RelayReply:
        """Hand ``delivery.announcement`` to each of its ``sub_ids``; the acks in one reply.

        Called subscribers that take longer than :data:`ACK_WINDOW_S`, and rung ones that
        have not acked within ``ring_ack_s`` (called then too), are listed in the reply's
        ``pending``; their acks follow in batches (``send_late``).
        """
        self.deliveries += 1
        self._members.update(delivery.members)
        a = delivery.announcement
        members = {s: m for s in a.sub_ids if (m := self._members.get(s)) is not None}
        unknown = [RelayAck(s, None, "unknown") for s in a.sub_ids if s not in members]
        t0 = time.perf_counter()
        tokens, called = await self._ring(a, members)
        t1 = time.perf_counter()
        (acks, late, calls), (rung, rung_pending) = await asyncio.gather(
            notify_members(a, called, self.mail.call), self._rung_acks(tokens)
        )
        self._timing.append((t1 - t0, time.perf_counter() - t1))
        if rung_pending:
            # Rung, no ack within the window: busy, or its process died after the ring went out
            # (a doorbell says nothing of that). The Ray call tells which; its ack is a late one.
            slow = {s: m for s in rung_pending if (m := self._members.get(s)) is not None}
            more_acks, more_late, more_calls = await notify_members(a, slow, self.mail.call, window=0.0)
            self.called_after_ring += more_calls
            acks, late, calls = acks + more_acks, late + more_late, calls + more_calls
        self.delivered += calls
        acks += rung.acks
        self._forget_dead(acks)
        if late:
            asyncio.get_running_loop().create_task(self._forward(a.model_id, a.version, late))
        pending = tuple(s for ids, _ in late for s in ids)
        reply = compact(a.version, unknown + acks, os.getpid(), pending)
        return replace(reply, applied=reply.applied + rung.applied)  # rung: compact already

    async def _ring(
        self, a: Announcement, members: dict[str, RelayMember]
    ) -> tuple[list[int], dict[str, RelayMember]]:
        """Ring the doorbells of the members that have one, if the version fits; the rest to call.

        Returns the rings' tokens and the members to call the Ray way.
        """
        bells = {s: m for s, m in members.items() if m.doorbell is not None and m.doorbell_key is not None}
        self.not_rung["no doorbell"] += len(members) - len(bells)
        if not bells:
            return [], members
        if not rings(a.manifest, self._doorbell_bytes):
            self.not_rung["version not for a doorbell"] += len(bells)  # too large, pickled state, ...
            return [], members
        ringer, writer = self._doorbell()
        try:  # in one worker thread: fetch, write, ring (the loop keeps reading acks meanwhile)
            tokens, gone, busy = await asyncio.to_thread(_write_and_ring, ringer, writer, a, bells)
        except Exception as err:  # no memory for a segment, bytes gone, ...: the Ray way this time
            logger.info(
                "node %s: no doorbell for %r version %d: %s", self._node_id[:8], a.model_id, a.version, err
            )
            self.not_rung[f"ring failed: {type(err).__name__}"] += len(bells)  # a key per type: bounded
            self.last_ring_error = f"{type(err).__name__}: {str(err)[:200]}"
            return [], members
        self.rung += len({bells[s].doorbell for s in bells if s not in gone and s not in busy})
        called = {s: m for s, m in members.items() if s not in bells}
        for sub_id in gone:  # gone, or not reachable from here: call it; stop ringing it
            member = replace(bells[sub_id], doorbell=None, doorbell_key=None)
            self._members[sub_id] = called[sub_id] = member
        for sub_id in busy:  # its doorbell's queue is full (say, flooded): call it this time
            called[sub_id] = bells[sub_id]
        self.not_rung["process gone or unreachable"] += len(gone)
        for why, n in collections.Counter(busy.values()).items():  # a key per queue: bounded
            self.not_rung[f"doorbell busy: {why}"] += n
        return tokens, called

    async def _rung_acks(self, tokens: list[int]) -> tuple[RelayReply, list[str]]:
        if not tokens:
            return RelayReply(()), []
        return await self._doorbell()[0].wait_compact(tokens, self._ring_ack_s)

    def _doorbell(self) -> tuple[doorbell.Ringer, doorbell.SegmentWriter]:
        if self._bell is None:
            ringer = doorbell.Ringer()
            ringer.late = self._late_ring
            self._bell = (ringer, doorbell.SegmentWriter())
        return self._bell

    def _late_ring(self, model_id: str, version: int, acks: list[RelayAck]) -> None:
        """Acks of rung subscribers slower than the window: in batches, like :meth:`_forward`'s."""
        key = (model_id, version)
        if key not in self._late_rows:
            self._late_rows[key] = []
            asyncio.get_running_loop().call_later(
                0.02, lambda: self._send(*key, self._late_rows.pop(key, []))
            )
        self._late_rows[key].extend(acks)

    async def _forward(self, model_id: str, version: int, late: Late) -> None:
        """Send the acks of slow subscribers, a batch per message, as their calls end."""
        async for batch in late_acks(late):
            self._send(model_id, version, batch)

    def _send(self, model_id: str, version: int, acks: list[RelayAck]) -> None:
        """Late acks to the hub, in one message."""
        self._forget_dead(acks)
        if acks:
            self._send_late(model_id, version, compact(version, acks, os.getpid()))

    def _forget_dead(self, acks: list[RelayAck]) -> None:
        self.forget([ack.sub_id for ack in acks if ack.outcome == "died"])

    def forget(self, sub_ids: list[str]) -> None:
        """Drop subscriptions that left; an actor none is left of gets no more calls."""
        gone = {m.actor_id for s in sub_ids if (m := self._members.pop(s, None)) is not None}
        gone -= {m.actor_id for m in self._members.values()}
        for actor_id in gone:
            if actor_id is not None:
                self.mail.fail(actor_id, SubscriberGone("it left"))

    def stats(self) -> dict[str, Any]:
        """Its process, node, and the calls it made so far (for tests and benchmarks)."""
        return {
            "pid": os.getpid(),
            "node_id": self._node_id,
            "members": len(self._members),
            "calls_pending": self.mail.pending(),
            "mailboxes": len(self.mail),  # subscriber processes it keeps a mailbox for
            "deliveries": self.deliveries,
            "delivered": self.delivered,
            "rung": self.rung,
            # of the calls delivered: to rung subscribers that had not acked within ring_ack_s
            "called_after_ring": self.called_after_ring,
            # subscriptions called instead of rung, by why (none rung: "no doorbell", say)
            "not_rung": {why: n for why, n in self.not_rung.items() if n},
            "last_ring_error": self.last_ring_error,
            # datagrams refused at the ack socket (not acks of an open ring MAC'd by the process rung)
            "dropped": sum(self._bell[0].drops.total.values()) if self._bell is not None else 0,
            # medians of the last 100 deliveries: writing the version and ringing, then the acks
            "ring_s": statistics.median(t[0] for t in self._timing) if self._timing else None,
            "acks_s": statistics.median(t[1] for t in self._timing) if self._timing else None,
        }


@ray.remote(num_cpus=0, max_restarts=-1)
class NodeRelay:
    """The relay actor of one hub on one node; the hub starts it (:func:`start_relay`)."""

    def __init__(self, hub: Any, node_id: str, settings: HubSettings) -> None:
        control_plane_priority(settings.nice)  # as the hub's (hub/priority.py)
        quiet_threaded_gets()

        def send_late(model_id: str, version: int, reply: RelayReply) -> None:
            getattr(hub, proto.RELAY_ACKS).remote(node_id, model_id, version, reply)

        mail = Mailboxes(alive=lambda address: asyncio.to_thread(address_alive, address))
        self._node = NodeDelivery(node_id, send_late, mail, settings)
        self._gc_frozen = freeze_startup_objects()  # out of the garbage collector's full scans, as the hub's

    async def deliver(self, delivery: RelayDelivery) -> RelayReply:
        """See :meth:`NodeDelivery.deliver`."""
        return await self._node.deliver(delivery)

    async def forget(self, sub_ids: list[str]) -> None:
        """Drop subscriptions that left."""
        self._node.forget(sub_ids)

    async def raysync_poll(
        self, caller: Caller, answers: list[Answer], running: list[int], timeout: float
    ) -> PollReply:
        """A subscriber process collects the calls for its actor (see :mod:`raysync.hub.mailbox`)."""
        return PollReply(await self._node.mail.poll(caller, answers, running, timeout))

    async def raysync_answer(self, caller: Caller, answers: list[Answer]) -> None:
        """Answers of calls that ended after the poll that carried them."""
        self._node.mail.answer(caller, answers)

    async def stats(self) -> dict[str, Any]:
        """Its process, node, and the calls it made so far (for tests and benchmarks)."""
        return {**self._node.stats(), "gc_frozen": self._gc_frozen}


_FETCH_S = 30.0  # a version's bytes not at hand by then (pusher gone?): the Ray way instead


def quiet_threaded_gets() -> None:
    """The hub's and relays' ``ray.get`` calls run in worker threads, never on their event loop:
    Ray's warning about blocking gets in async actors would only mislead (as Ray Train also does)."""
    os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")


def rings(manifest: Any, limit: int) -> bool:
    """Whether a version goes by doorbell: object-store bytes (one writer's, or a sharded
    trainer's ranks'), no larger than ``limit`` (the hub's ``doorbell_bytes``), no pickled extra
    state (the doorbell's wire format carries none), here."""
    shards = getattr(manifest, "shards", None)
    transport = manifest.transport if shards is None else shards.transport
    return (
        limit > 0
        and transport_info(transport, load=False).node_shared
        and not manifest.extra_state
        and sum(manifest.bucket_nbytes) <= limit
        and doorbell.available()
    )


def _write_and_ring(
    ringer: doorbell.Ringer, writer: doorbell.SegmentWriter, a: Announcement, bells: dict[str, RelayMember]
) -> tuple[list[int], list[str], dict[str, str]]:
    """Fetch a version's buckets (zero-copy on this node), write them into a new segment, and
    ring every process in ``bells``; the rings' tokens, the subscriptions whose process is gone
    (or cannot be rung from here) and those whose doorbell is busy, with which of its queues was
    full (call them this time).

    A sharded trainer's version goes in whole: its tensors assembled from the ranks' pieces
    once here, as one writer's buckets (subscribers read them as any other version's).
    """
    manifest = a.manifest
    if manifest.shards is None:
        buckets = ray.get(list(a.refs), timeout=_FETCH_S)
    else:  # the rank buckets the whole buckets are made of, each once
        rank_refs = {i: r for ref in a.refs for i, r in zip(ref.buckets, ref.refs, strict=True)}
        got = ray.get(list(rank_refs.values()), timeout=_FETCH_S)
        manifest, buckets = whole_version(manifest, dict(zip(rank_refs, got, strict=True)))
    segment = writer.write(a.model_id, a.version, manifest, bucket_ids(list(a.refs)), buckets)
    del buckets
    by_process: dict[tuple[str, bytes], list[str]] = {}
    for sub_id, member in bells.items():
        by_process.setdefault((member.doorbell, member.doorbell_key), []).append(sub_id)  # type: ignore[arg-type]
    tokens: list[int] = []
    gone: list[str] = []
    busy: dict[str, str] = {}
    try:
        for (address, key), sub_ids in by_process.items():
            try:
                tokens += ringer.ring(address, key, a.model_id, a.version, segment, sub_ids)
            except (BlockingIOError, InterruptedError) as err:
                logger.debug("doorbell of %s busy: %s", sub_ids[0], err)
                busy.update(dict.fromkeys(sub_ids, _busy_reason(err)))
            except (OSError, ValueError) as err:
                logger.debug("doorbell of %s: %s", sub_ids[0], err)
                gone += sub_ids
    finally:
        segment.close()  # each process rung holds its own descriptor: freed when the last lets go
    return tokens, gone, busy


def _busy_reason(err: OSError) -> str:
    """Which queue of a busy doorbell was full (``not_rung``'s "doorbell busy: ..." keys, a few)."""
    if err.strerror == doorbell.CONNECTIONS_QUEUED_FULL:
        return doorbell.CONNECTIONS_QUEUED_FULL
    return "rings queued full" if isinstance(err, BlockingIOError) else "interrupted"


ACK_WINDOW_S = 0.2
"""How long a delivery waits for every subscriber before it answers with the acks it has.

The acks of slower subscribers follow in batches (:func:`late_acks`), so one
slow or hung subscriber never holds up the others' next version."""

Late = list[tuple[tuple[str, ...], "asyncio.Future[Any]"]]
"""Calls still running when a delivery answered: (their subscriptions, the call's future)."""

Call = Callable[[str, str, Announcement], "asyncio.Future[Any]"]
"""``call(actor_id, method, announcement)``: a call for a subscriber's actor (:class:`Mailboxes.call`)."""


def _acks_of(sub_ids: tuple[str, ...], fut: asyncio.Future[Any]) -> list[RelayAck]:
    """The acks of one finished notification call (its reply, or why it failed)."""
    try:
        reply = fut.result()
    except SubscriberGone as err:
        return [RelayAck(s, None, "died", _plain(err)) for s in sub_ids]
    except SubscriberRestarted as err:  # for its old process: the new one registers (and catches up)
        return [RelayAck(s, None, "restarted", _plain(err)) for s in sub_ids]
    except SubscriberUnreachable as err:
        return [RelayAck(s, None, "unreachable", _plain(err)) for s in sub_ids]
    except Exception as err:
        return [RelayAck(s, None, "failed", _plain(err)) for s in sub_ids]
    if not isinstance(reply, ApplyReport):
        wrong = RuntimeError(f"a notify answered {type(reply).__name__}, not an ApplyReport")
        return [RelayAck(s, None, "failed", wrong) for s in sub_ids]
    return [RelayAck(s, reply) for s in sub_ids]


async def notify_members(
    announcement: Announcement,
    members: dict[str, RelayMember],
    call: Call,
    *,
    window: float | None = ACK_WINDOW_S,
) -> tuple[list[RelayAck], Late, int]:
    """Hand a version to ``members`` (one call each).

    What a relay does on its node, and what the hub does itself while a node's
    relay is not up (starting, restarting). Returns the acks of the calls that
    ended within ``window`` seconds, the calls still running, and the calls made.

    Example:
        >>> members = {"a1:policy": RelayMember("a1")}
        >>> acks, late, calls = await notify_members(announcement, members, mail.call)
    """
    a = announcement
    calls: Late = []
    for sub_id, member in members.items():
        if member.actor_id is None:  # nothing to call: it registers again, and starts from the newest
            calls.append(((sub_id,), _failed(SubscriberUnreachable(f"{sub_id} names no process"))))
        else:
            single = Announcement(a.model_id, a.version, a.manifest, a.refs, (sub_id,))  # routed by it
            calls.append(((sub_id,), call(member.actor_id, proto.NOTIFY, single)))
    if calls and window != 0.0:
        await asyncio.wait([fut for _, fut in calls], timeout=window)
    acks = [ack for ids, fut in calls if fut.done() for ack in _acks_of(ids, fut)]
    return acks, [(ids, fut) for ids, fut in calls if not fut.done()], len(calls)


def _failed(error: Exception) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.set_exception(error)
    return fut


async def late_acks(late: Late, *, gather_s: float = 0.02) -> AsyncIterator[list[RelayAck]]:
    """The acks of calls that outlived their delivery's window, in batches as they end.

    Example:
        >>> async for batch in late_acks(late):
        ...     hub.relay_acks.remote(node_id, model_id, version, compact(version, batch))
    """
    running = {fut: ids for ids, fut in late}
    while running:
        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(gather_s)  # others ending about now go in the same message
        batch: list[RelayAck] = []
        for fut in [f for f in running if f.done()]:
            batch.extend(_acks_of(running.pop(fut), fut))
        yield batch


def _plain(err: BaseException) -> BaseException:
    """An error that pickles back to the hub (Ray's own may carry what does not)."""
    return RuntimeError(f"{type(err).__name__}: {str(err)[:500]}")


def start_relay(hub: str, node_id: str, settings: HubSettings) -> Any:
    """Get or create the calling hub's relay on ``node_id`` (blocking: call it off the event loop).

    Example:
        >>> relay = start_relay("raysync", ray.get_runtime_context().get_node_id(), HubSettings().resolved())
    """
    cls: Any = NodeRelay
    ctx = ray.get_runtime_context()
    hub_actor_id = ctx.get_actor_id() or "driver"
    return cls.options(
        name=relay_name(hub, hub_actor_id, node_id),
        namespace=DEFAULT_NAMESPACE,
        get_if_exists=True,
        max_concurrency=10_000,  # a poll stays open per subscriber process of the node
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(ctx.current_actor, node_id, settings)

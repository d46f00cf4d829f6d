"""The ``WeightHub`` actor: one named, detached, async actor per cluster (per name).

It never sees tensor bytes: a pusher puts a version's buckets into the object store
itself and hands the hub their ``ObjectRef``\\ s, which the hub borrows and forwards.
The rules (stamping, ``keep``, leases, who is behind) are :class:`HubState`'s; this
shell talks to Ray: one delivery loop per node (through that node's relay, see
:mod:`raysync.hub.relay`; per subscriber with ``RAYSYNC_RELAY=0``), at most one call
in flight, always the newest version; pings, the GCS records that outlive a restart,
and metrics.

Example:
    >>> hub = raysync.connect("my-hub", keep=3)   # creates or finds the actor
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import ray

from raysync._protocol import (
    BLOCK,
    DEFAULT_HUB,
    DEFAULT_KEEP,
    Announcement,
    Answer,
    ApplyReport,
    Caller,
    Grant,
    PollReply,
    Publication,
    Registration,
    RelayReply,
    WaitResult,
)
from raysync.core.layout import Manifest
from raysync.core.shards import ShardPart
from raysync.errors import WeightMismatchError
from raysync.hub import metrics
from raysync.hub.delivery import Delivery
from raysync.hub.liveness import Liveness
from raysync.hub.mailbox import Mailboxes
from raysync.hub.persistence import HubStore, address_alive, writer_alive
from raysync.hub.priority import control_plane_priority, freeze_startup_objects
from raysync.hub.relay import quiet_threaded_gets
from raysync.hub.relay_handles import Relays
from raysync.hub.settings import HubSettings
from raysync.hub.sharded import ShardedPublish
from raysync.hub.state import HubState, Subscriber
from raysync.hub.state.rounds import PartTaken
from raysync.hub.version_waits import VersionWaits

__all__ = ["WeightHub"]

logger = logging.getLogger(__name__)


def _actor_id() -> str:
    return ray.get_runtime_context().get_actor_id() or "driver"


@ray.remote(num_cpus=0)
class WeightHub:
    """The hub actor. Reach it through :func:`raysync.connect`; its methods are the protocol's."""

    def __init__(
        self, name: str = DEFAULT_HUB, keep: int = DEFAULT_KEEP, settings: HubSettings | None = None
    ) -> None:
        # Fixed for the hub's life (a restart runs this again with the same arguments).
        self._settings = (settings or HubSettings()).resolved()
        control_plane_priority(self._settings.nice)  # see hub/priority.py
        quiet_threaded_gets()
        self._state = HubState(name, keep, relay=bool(self._settings.relays))
        # Calls to subscribers' actors, collected by their processes' polls (hub/mailbox.py).
        self._mail = Mailboxes(alive=lambda address: asyncio.to_thread(address_alive, address))
        # One relay per node; when one comes up, open polls end so that its node's processes poll it.
        self._relays = Relays(name, _actor_id(), self._settings, on_ready=self._mail.wake)
        self._store = HubStore(name)
        self._started = time.time()
        self._gauges = metrics.HubGauges(name)
        # The delivery loops (hub/delivery.py) and sharded writers' rounds (hub/sharded.py).
        self._delivery = Delivery(
            self._state,
            self._settings,
            self._mail,
            self._relays,
            self._gauges,
            drop=self._drop,
            record=self._record,
        )
        self._sharded = ShardedPublish(
            self._state,
            self._store,
            publish=self.publish,
            restore=self.restore,
            check_writer=self._check_writer,
        )
        self._liveness = Liveness(
            self._state, self._settings, delivering=self._delivery.delivering, drop=self._drop
        )
        self._waits = VersionWaits(
            self._state, self._gauges, reap=self._liveness.reap, round_published=self._sharded.round_published
        )
        self._restored = self._restore()
        # Out of the garbage collector's full scans (hub/priority.py); counted once (a count walks them).
        self._gc_frozen = freeze_startup_objects()

    # ------------------------------------------------------------------ restart
    def _restore(self) -> list[str]:
        """After a restart: continue version numbers and leases where the last hub left them.

        The kept versions are lost with the old process (it held the only references the
        hub had) until their writer offers them again or pushes; the subscriptions it knew
        are waited for until they register again or Ray reports their actor dead.
        """
        try:
            models, keep, members = self._store.load()
        except Exception as err:  # a fresh cluster, or no GCS access: start empty
            logger.warning("hub %r could not restore its state: %s", self._name, err)
            return []
        self._state.models.update(models)
        if keep is not None:
            self._state.keep = max(self._state.keep, keep)
        for sub_id, record in members.items():
            self._state.roster.add(Subscriber.restored(sub_id, record))
        if models:
            logger.warning(
                "hub %r restarted: continuing %s from their last version numbers, waiting for %d "
                "subscriber(s) to check in again; versions kept before the restart are gone until their "
                "writer offers them again or pushes",
                self._name,
                {m: model.latest for m, model in models.items()},
                len(members),
            )
        return sorted(models)

    # ------------------------------------------------------------------ helpers
    @property
    def _name(self) -> str:
        return self._state.name

    def _drop(self, sub: Subscriber, why: str | None) -> None:
        """Forget a subscriber: it left (``why`` None) or its actor died (``why``)."""
        # Its node's relay (or this hub, on its node) forgets it too; if it died, its actor's mailbox.
        self._delivery.release(sub, died=why is not None)
        self._delivery.stop(sub)
        emptied = self._state.roster.remove(sub) if why is None else self._state.roster.drop(sub, why)
        if emptied is not None:
            self._delivery.stop(emptied)
        self._store.remove(sub.sub_id)

    # ------------------------------------------------------------------ admin
    async def configure(self, keep: int | None = None) -> dict[str, Any]:
        """Raise how many versions per model the hub keeps (never lowered under another client)."""
        if self._state.versions.raise_keep(keep):
            await asyncio.to_thread(self._store.save_keep, self._state.keep)
        return {
            "name": self._name,
            "keep": self._state.keep,
            "pid": os.getpid(),
            "cpu_s": time.process_time(),  # cheap counters for benchmarks (status() is O(subscribers))
            "delivery_calls": self._state.tables.delivery_calls,
            "gc_frozen": self._gc_frozen,  # start-up objects out of full collections' scans
        }

    async def settings(self) -> HubSettings:
        """The settings this hub delivers with (fixed when it was created)."""
        return self._settings

    # ------------------------------------------------------------------ publish
    async def acquire(
        self, model_id: str, pusher: dict[str, Any], takeover: bool = False, count: int = BLOCK
    ) -> Grant:
        """The writer lease of ``model_id`` and a block of ``count`` version numbers to stamp.

        The block is written to the GCS before the reply: no number in it is ever
        granted or stamped again, across hub restarts too.

        Raises:
            StaleWriterError: another live writer holds the model's lease.
        """
        await self._check_writer(model_id, pusher, takeover)
        grant = self._state.versions.grant(model_id, count, pusher)
        await asyncio.wrap_future(self._store.save_model(model_id, self._state.models[model_id]))
        logger.debug("hub %r: granted %r versions %d-%d", self._name, model_id, grant.first, grant.last)
        return grant

    async def _check_writer(self, model_id: str, pusher: dict[str, Any], takeover: bool) -> None:
        current = self._state.leases.writer_to_check(model_id, pusher, takeover)
        if current is not None:
            if await asyncio.to_thread(writer_alive, current):
                raise self._state.leases.refuse_writer(model_id, current, pusher)
            self._state.leases.hand_over(model_id, current, pusher)

    async def publish(
        self,
        model_id: str,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        pusher: dict[str, Any],
        takeover: bool = False,
        version: int | None = None,
        epoch: int | None = None,
        *,
        reserved: int | None = None,
    ) -> int:
        """Keep a version and start delivering it; return its number.

        With ``version`` and ``epoch`` (from :meth:`acquire`) the writer stamped it and
        does not wait for this reply; the version is kept before this method first
        awaits anything, so the writer's later calls see it. Without them the hub
        stamps it and writes the number to the GCS before replying; with ``reserved``
        (a sharded round's, :mod:`raysync.hub.sharded`) under that number, written before.

        Raises:
            WeightMismatchError: it does not fit the layout the model's versions established
                (the first version: it fits no live subscriber's model).
            StaleWriterError: another writer holds the model's lease (for a stamped
                version: the lease passed on since its grant).
        """
        refused = self._state.layouts.refusal(model_id, manifest) or await self._mismatch(model_id, manifest)
        if refused is not None:
            raise refused
        if version is None or epoch is None:
            await self._check_writer(model_id, pusher, takeover)
            v = self._state.versions.stamp(model_id, manifest, refs, pusher, reserved)
            if reserved is None:
                await asyncio.wrap_future(self._store.save_model(model_id, self._state.models[model_id]))
            else:  # the number was written when it was reserved
                self._store.save_model_soon(model_id, self._state.models[model_id])
        else:
            v = self._state.versions.accept(model_id, manifest, refs, pusher, version, epoch)
            # The newest number, for a restarted hub (in the background; one queued write serves
            # many publishes): a number's uniqueness rests on the grant's write, not on this one.
            self._store.save_model_soon(model_id, self._state.models[model_id])
        self._gauges.published(model_id)
        if v.version == self._state.versions.latest(model_id):
            # Deliver just after this reply has left: a pusher waiting on it (a hub-stamped
            # version) would otherwise compete with receivers starting their copies for CPU.
            # A sharded round's ranks do not wait on it: deliver at once (a 1 ms sleep of the
            # hub's loop became 6-13 ms on a busy node before the first receiver was called).
            delay = 0.001 if version is None and reserved is None else 0.0
            asyncio.get_running_loop().call_later(delay, self._delivery.kick_model, model_id)
        await self._waits.changed()
        logger.debug("hub %r: %r version %d published", self._name, model_id, v.version)
        return v.version

    async def publish_stamped(self, pub: Publication) -> int:
        """:meth:`publish` of a version its writer stamped, as one message (what a push sends)."""
        return await self.publish(
            pub.model_id, pub.manifest, list(pub.refs), pub.pusher, False, pub.version, pub.epoch
        )

    async def contribute(
        self,
        model_id: str,
        part: ShardPart,
        refs: list[Any],
        pusher: dict[str, Any],
        takeover: bool = False,
        timeout: float = 60.0,
        settle: bool = True,
        previous: int | None = None,
        stamp: int | None = None,
    ) -> PartTaken:
        """One rank's part of a sharded push (:meth:`.ShardedPublish.contribute`)."""
        return await self._sharded.contribute(
            model_id, part, refs, pusher, takeover, timeout, settle, previous, stamp
        )

    async def give_up(self, model_id: str, token: str, round: int, rank: int, why: str) -> None:
        """A rank's push raised before its part was sent (:meth:`.ShardedPublish.give_up`)."""
        self._sharded.give_up(model_id, token, round, rank, why)

    async def restore_part(
        self, model_id: str, version: int, part: ShardPart, refs: list[Any], pusher: dict[str, Any]
    ) -> bool:
        """A rank offers its part of a lost version again (:meth:`.ShardedPublish.restore_part`)."""
        return await self._sharded.restore_part(model_id, version, part, refs, pusher)

    async def relay_acks(self, node_id: str, model_id: str, version: int, reply: RelayReply) -> None:
        """A relay's late acks (:meth:`.Delivery.relay_acks`)."""
        await self._delivery.relay_acks(node_id, model_id, version, reply)

    async def _mismatch(self, model_id: str, manifest: Manifest) -> WeightMismatchError | None:
        """The error for a first version that fits none of the live subscribers' models (dead
        ones are dropped instead: a dead subscriber never blocks a push)."""
        for error, subs in self._state.layouts.first_mismatches(model_id, manifest):
            alive = await asyncio.gather(*(self._liveness.alive(sub) for sub in subs))
            for sub, ok in zip(subs, alive, strict=True):
                if not ok:
                    self._drop(sub, "actor died")
            live = [sub for sub, ok in zip(subs, alive, strict=True) if ok]
            if live:
                who = f"{live[0].sub_id} ({live[0].info.class_name})"
                error.args = (
                    f"{error.args[0]} (the first version of model {model_id!r} fits none of its live "
                    f"subscribers, e.g. {who}; no version was published and every subscriber keeps "
                    "its weights)",
                )
                return error
        return None

    async def restore(
        self,
        model_id: str,
        version: int,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        pusher: dict[str, Any],
    ) -> bool:
        """The writer offers its newest version again after a hub restart lost it; kept?"""
        if not self._state.versions.offer_again(model_id, version, manifest, refs, pusher):
            return False
        self._delivery.kick_model(model_id)
        await self._waits.changed()
        return True

    async def lost(self, model_id: str, version: int) -> None:
        """A client found a kept version's bytes gone: stop offering it."""
        self._state.versions.forget_version(model_id, version, "a client could not fetch it")

    def _record(self, sub: Subscriber, report: ApplyReport) -> None:
        self._state.roster.record(sub, report)
        if report.describes_apply():
            metrics.record_apply(self._name, sub.model_id, report.apply_s)
        self._gauges.changed(self._state.models, self._state.subs)  # rate-limited

    # ------------------------------------------------------------------ subscribers
    async def register(self, reg: Registration) -> Announcement | None:
        """Add (or re-add, after a restart) a subscriber; return the newest version to start from."""
        self._liveness.start_sweeper()
        sub, replaced, newest = self._state.roster.register(reg)
        if replaced is not None:
            self._delivery.stop(replaced)
        group = self._state.groups.get(sub.group) if sub.group is not None else None
        if group is not None and sub.info.node_id and not self._delivery.rings_here(group):
            self._relays.start(sub.info.node_id)
        self._store.add(sub)
        logger.info(
            "hub %r: subscriber %s registered for %r at version %s (newest %s)",
            self._name,
            reg.sub_id,
            reg.model_id,
            sub.applied,
            self._state.versions.latest(reg.model_id),
        )
        self._gauges.changed(self._state.models, self._state.subs)
        return newest

    async def raysync_poll(
        self, caller: Caller, answers: list[Answer], running: list[int], timeout: float
    ) -> PollReply:
        """A subscriber process collects the calls for its actor (see :mod:`raysync.hub.mailbox`);
        the reply also names its node's relay, once that is up, for the process to poll it too."""
        relay = self._relay_for(caller)
        if relay is None:
            requests = await self._mail.poll(caller, answers, running, timeout)
            relay = self._relay_for(caller)  # woken because the relay came up?
        else:
            requests = await self._mail.poll(caller, answers, running, 0.0)
        return PollReply(requests, relay)

    async def raysync_answer(self, caller: Caller, answers: list[Answer]) -> None:
        """Answers of calls that ended after the poll that carried them."""
        self._mail.answer(caller, answers)

    def _relay_for(self, caller: Caller) -> tuple[str, Any] | None:
        """The name and handle of the caller's node's relay, if up and not the one it polls."""
        relay = None if caller.node_id is None else self._relays.handle(caller.node_id)
        if relay is None:
            return None
        name = self._relays.name(caller.node_id)  # type: ignore[arg-type]
        return None if caller.relay == name else (name, relay)

    async def heartbeat(self, sub_ids: list[str]) -> list[str]:
        """Subscribers check in; returns the ids to register again (the hub restarted or dropped them)."""
        self._liveness.start_sweeper()
        unknown = []
        now = time.monotonic()
        for sub_id in sub_ids:
            sub = self._state.subs.get(sub_id)
            if sub is None or sub.state == "restoring":  # unknown, or known from before a restart only
                unknown.append(sub_id)
                continue
            sub.last_seen = now
            if sub.state == "unreachable":
                sub.state = "live"
        return unknown

    async def unregister(self, sub_id: str) -> None:
        sub = self._state.subs.get(sub_id)
        if sub is not None:
            self._drop(sub, None)
        self._store.remove(sub_id)

    async def report(self, sub_id: str, report: ApplyReport) -> None:
        """A subscriber applied (or failed, or lost) a version on its own (start-up, pull, deferred)."""
        sub = self._state.subs.get(sub_id)
        if sub is None:
            return
        self._record(sub, report)
        if sub.pushed:  # a version may have been pushed while it was busy, or it needs one again
            self._delivery.kick(sub)

    # ------------------------------------------------------------------ queries
    async def latest(self, model_id: str) -> int | None:
        return self._state.versions.latest(model_id)

    async def get(
        self, model_id: str, version: int | None = None, newer_than: int | None = None
    ) -> Announcement | None:
        """A kept version (newest by default); None if nothing newer than ``newer_than``.

        Raises:
            UnknownModelError: nothing kept of ``model_id``, or not ``version``.
        """
        return self._state.versions.get(model_id, version, newer_than)

    async def wait_newer(self, model_id: str, version: int, timeout: float) -> Announcement | None:
        """Long poll: the newest version once it is newer than ``version``, or None after ``timeout``."""
        return await self._waits.wait_newer(model_id, version, timeout)

    async def wait(
        self,
        model_id: str,
        version: int,
        timeout: float | None,
        include_pull: bool = False,
        report_missing: bool = False,
        subscribers: int = 0,
    ) -> WaitResult:
        """Until every live push subscriber applied ``version`` (:meth:`.VersionWaits.wait`)."""
        return await self._waits.wait(model_id, version, timeout, include_pull, report_missing, subscribers)

    async def status(self) -> dict[str, Any]:
        return self._state.waits.status() | {
            "cpu_s": time.process_time(),
            **self._relays.status(),  # relays up, and stalled ones (delivered around)
            # the hub's own node, whose doorbells it rings itself (None: a relay serves it too)
            "here": None if self._delivery.here is None else self._delivery.here.stats(),
            "uptime_s": time.time() - self._started,
            "restored_models": self._restored,
            "abandoned": self._sharded.abandoned(),  # sharded rounds' numbers never published, lately
        }

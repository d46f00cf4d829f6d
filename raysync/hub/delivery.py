"""How the hub hands versions out: through a node's relay, on its own node itself, or per
subscriber without relays (doorbells and calls); at most one delivery in flight per subscriber
or group, always the newest version.

:class:`~raysync.hub.actor.WeightHub` holds one :class:`Delivery`: the actor keeps the Ray face
(its methods callers use), this module the delivery loops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import ray

from raysync import _protocol as proto
from raysync._protocol import Announcement, ApplyReport, RelayDelivery, RelayReply
from raysync.hub import metrics
from raysync.hub.mailbox import Mailboxes, SubscriberGone, SubscriberUnreachable
from raysync.hub.relay import (
    Late,
    NodeDelivery,
    compact,
    late_acks,
    notify_members,
)
from raysync.hub.relay_handles import RelayLost, Relays
from raysync.hub.settings import HubSettings
from raysync.hub.state import DeliveryGroup, HubState, Subscriber, Version
from raysync.transports.registry import info as transport_info

__all__ = ["HERE_MAX_MEMBERS", "Delivery", "Prior"]

logger = logging.getLogger(__name__)


HERE_MAX_MEMBERS = 256
"""The most subscriptions of one model on the hub's own node that the hub rings itself: ringing
and reading acks cost the hub's one event loop per subscription, so a larger group is handed to
its node's relay (one message per version, as on every other node)."""

Prior = dict[Subscriber, int]
"""What each subscriber of a delivery had been sent before it (restored if the delivery is lost)."""


class Delivery:
    """The hub's delivery loops (one per subscriber or group at most), what it sends and records.

    Args:
        state: the hub's state (who holds what, what is due).
        settings: the hub's settings.
        mail: calls to subscribers' actors, collected by their processes' polls.
        relays: the relay of each node (Ray's side of it).
        gauges: the hub's metrics.
        drop: ``drop(sub, why)`` forgets a subscriber whose actor died (the actor's part).
        record: ``record(sub, report)`` records what a subscriber applied (the actor's part).
    """

    def __init__(
        self,
        state: HubState,
        settings: HubSettings,
        mail: Mailboxes,
        relays: Relays,
        gauges: metrics.HubGauges,
        *,
        drop: Callable[[Subscriber, str], None],
        record: Callable[[Subscriber, ApplyReport], None],
    ) -> None:
        self._state, self._settings, self._mail, self._relays = state, settings, mail, relays
        self._gauges, self._drop, self._record = gauges, drop, record
        # The delivery loop of each subscriber or group, if one runs.
        self._loops: dict[Subscriber | DeliveryGroup, asyncio.Task[None]] = {}
        # The hub's own node needs no relay: the hub rings its doorbells and calls the rest itself.
        self.here_node: str = ray.get_runtime_context().get_node_id()
        self.here = (
            NodeDelivery(self.here_node, self._late_here, mail, settings)
            if settings.relays and settings.rings_own_node
            else None
        )

    @property
    def _name(self) -> str:
        return self._state.name

    def release(self, sub: Subscriber, *, died: bool) -> None:
        """Free what delivery keeps for a subscription that goes (before the state forgets it):
        its node's relay's record of it (or the hub's own, on its node), and, if its actor
        ``died``, the actor's mailbox (its calls fail as gone: nobody polls for them any more)."""
        if self._state.subs.get(sub.sub_id) is not sub:
            return  # replaced by a newer registration (which keeps what it uses), or gone already
        node, address = sub.info.node_id, sub.info.address
        if sub.via_node and node:
            self._relays.forget(node, [sub.sub_id])
            if self.here is not None and node == self.here_node:
                self.here.forget([sub.sub_id])
        if died and address is not None:
            self._mail.fail(address, SubscriberGone(f"process {address[:16]} died"))

    def kick_model(self, model_id: str) -> None:
        """Start the delivery of ``model_id``'s newest version: a loop per node group (not per
        subscriber), and one per subscriber delivered alone."""
        for group in list(self._state.tables.model_groups.get(model_id, {}).values()):
            if not self.delivering(group) and group.node_id is not None:
                self._start(group, self._deliver_relay(model_id, group))
        for sub in list(self._state.tables.solo.get(model_id, {}).values()):
            if sub.state != "dead":
                self.kick(sub)

    def kick(self, sub: Subscriber) -> None:
        if not sub.reachable:  # it gets the newest when it registers (again)
            return
        key = sub.group
        if key is not None:
            group = self._state.groups.get(key)
            if group is not None and not self.delivering(group):
                self._start(group, self._deliver_relay(sub.model_id, group))
        elif not self.delivering(sub):
            self._start(sub, self._deliver(sub))

    # One delivery loop at most per subscriber or group, kept here (the state holds no task).
    def delivering(self, key: Subscriber | DeliveryGroup) -> bool:
        task = self._loops.get(key)
        return task is not None and not task.done()

    def _start(self, key: Subscriber | DeliveryGroup, loop: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(loop)
        self._loops[key] = task
        task.add_done_callback(lambda t: self._loops.pop(key, None) if self._loops.get(key) is t else None)

    def stop(self, key: Subscriber | DeliveryGroup) -> None:
        """Stop its delivery loop, unless that is the one running this code (it returns by itself)."""
        task = self._loops.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _deliver(self, sub: Subscriber) -> None:
        """Hand the newest version to one subscriber until it holds it (one call in flight)."""
        while (due := self._state.versions.due(sub)) is not None:
            sub.sent = due.version
            self._state.tables.delivery_calls += 1
            try:
                announcement = due.announce(sub.model_id, (sub.sub_id,))
                report = await self._mail.call(_address(sub), proto.NOTIFY, announcement)
            except SubscriberGone as err:
                self._drop(sub, f"actor died ({err})")
                return
            except SubscriberUnreachable as err:  # restarting or not polling: it registers again when back
                self._state.roster.unreachable(sub, err)
                return
            except Exception as err:  # the notify itself failed: record, do not loop
                self._state.roster.delivery_failed(sub, due.version, err)
                return
            self._record(sub, report)

    async def _deliver_relay(self, model_id: str, group: DeliveryGroup) -> None:
        """Deliver through the node's relay: one message per version for every member that lacks it.

        The relay answers with every member's ack in one reply. While the relay is not
        up (starting, restarting after it died), the hub delivers to the members itself,
        and starts (or waits for) the relay in the background. A relay that dies
        mid-delivery or mid-ack loses nothing: members whose ack did not come back are
        due again and get the newest version; a member that applied it already skips it.
        """
        assert group.node_id is not None
        cohort = group.cohort
        while True:
            newest, whole, due = self._state.versions.due_in_group(model_id, group)
            if newest is None or not (whole or due):
                return
            prior: Prior = {}
            v = newest.version
            for sub in due:  # one pass: what each had been sent, and that it is sent this one
                prior[sub] = sub.sent
                sub.sent = v
            cohort_prior = cohort.sent
            ids = tuple([s.sub_id for s in due])
            if whole:  # the cohort's members: one field, however many
                cohort.sent = v
                ids = cohort.ids + ids
            announcement = newest.announce(model_id, ids)
            here = self.rings_here(group)
            if here != group.here:  # from the hub to its node's relay, or back: it knows none of them
                group.known.clear()
                group.here = here
            if here:
                assert self.here is not None
                # The hub's own node: the hub does the relay's part itself (rings doorbells, calls the rest).
                members = _untold(group, whole, due)
                group.known.update(members)  # told once: later versions name them only
                reply = await self.here.deliver(RelayDelivery(announcement, members))
                self._acks(model_id, group, newest.version, reply, prior)
            elif not await self._via_relay(group, group.node_id, newest, announcement, whole, due, prior):
                if whole:
                    cohort.sent = cohort_prior

    def rings_here(self, group: DeliveryGroup) -> bool:
        """Whether the hub delivers to ``group`` itself: on its own node, while the group is small
        (:data:`HERE_MAX_MEMBERS`) or its node's relay is not up yet (started here); a larger one
        goes through that relay, as on every node."""
        if self.here is None or group.node_id != self.here_node:
            return False
        if len(group.members) <= HERE_MAX_MEMBERS:
            return True
        if self._relays.up(group.node_id):
            return False
        self._relays.start(group.node_id)  # rung from here meanwhile, not called one by one
        return True

    async def _via_relay(
        self,
        group: DeliveryGroup,
        node_id: str,
        newest: Version,
        announcement: Announcement,
        whole: bool,
        due: list[Subscriber],
        prior: Prior,
    ) -> bool:
        """One version to ``due`` (and the cohort if ``whole``) through their node's relay (or
        directly while it is not up); False: the relay was lost, nothing handed (``sent`` undone)."""
        model_id = announcement.model_id
        # NIXL versions go straight from the hub: their refs carry Ray's tensor transport
        # (the receiver pulls from the pusher's registered buffers), which a relay's hop loses.
        direct = not transport_info(newest.manifest.transport, load=False).relayable
        if direct or not self._relays.up(node_id):  # not up yet (or NIXL): deliver directly, start it
            if not direct:
                self._relays.start(node_id)
            everyone = list(group.cohort.members.values()) + due if whole else due
            members = {s.sub_id: s.relay_member() for s in everyone}  # called: no doorbell from here
            acks, late, calls = await notify_members(announcement, members, self._mail.call)
            self._state.tables.delivery_calls += calls
            pending = tuple(s for ids, _ in late for s in ids)
            self._acks(model_id, group, newest.version, compact(newest.version, acks, None, pending), prior)
            if late:
                asyncio.get_running_loop().create_task(self._late(model_id, node_id, newest.version, late))
            return True
        members = _untold(group, whole, due)
        self._state.tables.delivery_calls += 1
        try:
            reply = await self._relays.deliver(node_id, RelayDelivery(announcement, members))
        except RelayLost as err:  # it died or restarts: deliver directly until it answers again
            logger.info("hub %r: relay on node %s: %s; delivering directly", self._name, node_id, err)
            group.relay_lost()
            for sub in due:
                sub.sent = prior[sub]
            return False
        if group.relay_pid is not None and reply.relay_pid != group.relay_pid:
            group.relay_lost()  # it restarted since it last answered: its late acks will not come
        group.relay_pid = reply.relay_pid
        group.known.update(members)
        self._acks(model_id, group, newest.version, reply, prior)
        return True

    def _acks(
        self, model_id: str, group: DeliveryGroup, version: int, reply: RelayReply, prior: Prior
    ) -> None:
        """Record a relay's acks (members that left meanwhile are skipped)."""
        for sub_id in reply.pending:
            sub = group.members.get(sub_id)
            if sub is not None:
                sub.relay_pending = True
        if reply.applied:
            times = self._state.roster.record_group_rows(model_id, version, group, reply.applied, time.time())
            metrics.record_applies(self._name, model_id, times)
            self._gauges.changed(self._state.models, self._state.subs)
        for ack in reply.acks:
            sub = group.members.get(ack.sub_id)
            if sub is None or self._state.subs.get(ack.sub_id) is not sub:
                continue
            sub.relay_pending = False
            if ack.outcome == "ok" and ack.report is not None:
                self._record(sub, ack.report)
                group.cohort.join(sub)  # back in step, if it is
            elif ack.outcome == "unknown":  # a restarted relay: send it the handle again
                group.known.discard(ack.sub_id)
                sub.sent = prior.get(sub, 0)
            elif ack.outcome == "died":
                self._drop(sub, f"actor died ({ack.error})")
            elif ack.outcome == "restarted":  # its new process registers (or did): that brings it up to date
                continue
            elif ack.outcome == "unreachable":
                self._state.roster.unreachable(sub, ack.error or RuntimeError("unreachable"))
            else:
                self._state.roster.delivery_failed(sub, version, ack.error or RuntimeError(ack.outcome))

    async def _late(self, model_id: str, node_id: str, version: int, late: Late) -> None:
        """The hub's own direct delivery: record the acks of slow subscribers as their calls end."""
        async for batch in late_acks(late):
            await self.relay_acks(node_id, model_id, version, compact(version, batch))

    def _late_here(self, model_id: str, version: int, reply: RelayReply) -> None:
        """Late acks of the subscribers the hub rang itself (no relay process to check)."""
        reply = RelayReply(reply.acks, reply.applied, None, reply.pending)
        asyncio.get_running_loop().create_task(self.relay_acks(self.here_node, model_id, version, reply))

    async def relay_acks(self, node_id: str, model_id: str, version: int, reply: RelayReply) -> None:
        """Acks of subscribers still applying when their relay answered; then deliver what is due."""
        group = self._state.groups.get(f"{model_id}@node:{node_id}")
        if group is None:
            return
        if reply.relay_pid is not None and group.relay_pid is not None and reply.relay_pid != group.relay_pid:
            return  # from a relay process the hub no longer counts on
        self._acks(model_id, group, version, reply, {})
        if not self.delivering(group):
            self._start(group, self._deliver_relay(model_id, group))


def _untold(group: DeliveryGroup, whole: bool, due: list[Subscriber]) -> dict[str, proto.RelayMember]:
    """What the relay needs of the members it will hand a version and has not been told of."""
    known = group.known
    members = {s.sub_id: s.relay_member() for s in due if s.sub_id not in known}
    if whole and not known.issuperset(group.cohort.ids):  # a new relay (or a restarted one)
        members.update({i: s.relay_member() for i, s in group.cohort.members.items() if i not in known})
    return members


def _address(sub: Subscriber) -> str:
    """Where calls for ``sub`` go: its process (an actor's, or a plain process's job)."""
    address = sub.info.address
    if address is None:
        raise SubscriberUnreachable(f"{sub.sub_id} names no process: the hub cannot call it")
    return address

"""The hub's relays, one per node: started on demand, known to be up, delivered through.

The Ray side of relaying (:class:`~raysync.hub.relay.NodeRelay` actors, their handles and
Ray's errors), so that :mod:`raysync.hub.delivery` is plain asyncio: it asks whether a
node's relay is up, starts one in the background, and hands a
:class:`~raysync._protocol.RelayDelivery` over, with :class:`RelayLost` when that fails.

A relay that does not answer within ``ring_ack_s + relay_stall_s``
(:class:`~raysync.hub.settings.HubSettings`) is *stalled* (stopped, wedged, starved):
:class:`RelayStalled`, and it is not up, so its node is delivered to directly, as while a
relay restarts. It is up again once the call it left unanswered returns (it resumed), or
it is replaced: killed (Ray starts it again) once it has been silent for
:data:`REPLACE_AFTER_STALLS` times that bound.

Example:
    >>> relays = Relays("raysync", hub_actor_id, settings, on_ready=mail.wake)
    >>> relays.start(node_id)                       # in the background; delivered directly meanwhile
    >>> reply = await relays.deliver(node_id, RelayDelivery(announcement, members))
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from raysync import _protocol as proto
from raysync._protocol import RelayDelivery, RelayReply
from raysync.hub.mailbox import quiet
from raysync.hub.relay import relay_name, start_relay
from raysync.hub.settings import DEFAULT_RELAY_STALL_S, DEFAULT_RING_ACK_S, HubSettings

__all__ = ["REPLACE_AFTER_STALLS", "RelayLost", "RelayStalled", "Relays"]

logger = logging.getLogger(__name__)

_START_S = 120.0  # how long a relay may take to (re)start before the hub gives up for a while
_RETRY_S = 5.0  # after a relay failed to start, deliver directly this long before trying again


REPLACE_AFTER_STALLS = 6
"""A stalled relay silent for this many stall bounds (from the call it left unanswered) is replaced."""


class RelayLost(Exception):
    """A relay did not take a delivery (it died or restarts): deliver directly until it is up."""


class RelayStalled(RelayLost):
    """A relay did not answer a delivery within the stall bound: deliver directly until it answers."""


class Relays:
    """The hub's relays by node.

    Args:
        hub: the hub's name; ``hub_actor_id`` its actor (relays are named after both).
        on_ready: called when a node's relay first answers (subscribers then learn of it).
    """

    def __init__(
        self, hub: str, hub_actor_id: str, settings: HubSettings, on_ready: Callable[[], None]
    ) -> None:
        self._hub = hub
        self._hub_actor_id = hub_actor_id
        self._settings = settings
        self._on_ready = on_ready
        # The hub keeps every relay's handle while it lives: a relay is the hub's child,
        # and Ray ends an actor whose owner let go of its last handle.
        self._handles: dict[str, Any] = {}
        self._ready: set[str] = set()  # nodes whose relay answered (and has not failed since)
        self._starts: dict[str, asyncio.Task[Any]] = {}
        self._failed: dict[str, float] = {}  # node id -> when its relay last failed to start
        # A relay silent this long on a call is stalled (its deliveries wait for acks up to ring_ack_s).
        stall = settings.relay_stall_s or DEFAULT_RELAY_STALL_S
        self.stall_s = (settings.ring_ack_s or DEFAULT_RING_ACK_S) + stall
        self._stalled: dict[str, float] = {}  # node id -> when the call its relay left unanswered went
        self._watches: dict[str, asyncio.Task[None]] = {}  # node id -> waiting for it (a task kept)

    def up(self, node_id: str) -> bool:
        return node_id in self._ready

    def name(self, node_id: str) -> str:
        return relay_name(self._hub, self._hub_actor_id, node_id)

    def status(self) -> dict[str, Any]:
        """For ``hub.status()``: the relays that are up, and the stalled ones (how long silent)."""
        now = time.monotonic()
        stalled = {
            node: {"relay": self.name(node), "silent_s": round(now - since, 3)}
            for node, since in sorted(self._stalled.items())
        }
        up = {node: self.name(node) for node in sorted(self._ready)}
        return {"relays": up, "stalled_relays": stalled}

    def handle(self, node_id: str) -> Any | None:
        """The handle of the node's relay, if it is up (subscribers poll it)."""
        return self._handles.get(node_id) if node_id in self._ready else None

    def start(self, node_id: str) -> None:
        """Start (or wait for) the node's relay in the background; nobody waits for it."""
        starting = self._starts.get(node_id)
        if (
            node_id in self._ready
            or node_id in self._stalled
            or (starting is not None and not starting.done())
        ):
            return  # (a stalled relay's watch starts it again once it answered or was replaced)
        if time.monotonic() - self._failed.get(node_id, -_RETRY_S) < _RETRY_S:
            return

        async def start() -> None:
            try:
                await self._start_and_ping(node_id)
            except Exception as err:  # delivered directly meanwhile; tried again later
                self._failed[node_id] = time.monotonic()
                logger.warning("hub %r could not start the relay on node %s: %s", self._hub, node_id, err)

        self._starts[node_id] = asyncio.get_running_loop().create_task(start())

    async def deliver(self, node_id: str, delivery: RelayDelivery) -> RelayReply:
        """Hand ``delivery`` to the node's relay (up); :class:`RelayLost` if it does not take it,
        :class:`RelayStalled` if it does not answer within :attr:`stall_s`."""
        relay = self._handles.get(node_id)
        if relay is None or node_id not in self._ready:
            raise RelayLost(f"no relay up on node {node_id[:8]}")
        sent = time.monotonic()
        call = quiet(asyncio.wrap_future(getattr(relay, proto.RELAY_DELIVER).remote(delivery).future()))
        await asyncio.wait([call], timeout=self.stall_s)
        if not call.done():
            self._stall(node_id, relay, call, sent, sent + REPLACE_AFTER_STALLS * self.stall_s)
            raise RelayStalled(f"no answer in {self.stall_s:.1f} s")
        try:
            reply: RelayReply = call.result()
        except Exception as err:  # it died or restarts: not up until it answers again
            self._ready.discard(node_id)
            raise RelayLost(f"{type(err).__name__}: {err}") from err
        return reply

    def forget(self, node_id: str, sub_ids: list[str]) -> None:
        """Tell the node's relay that these subscriptions left."""
        relay = self._handles.get(node_id)
        if relay is not None:
            relay.forget.remote(sub_ids)

    def _stall(
        self, node_id: str, relay: Any, call: asyncio.Future[Any], sent: float, replace_at: float
    ) -> None:
        """The node's relay left ``call`` (sent at ``sent``) unanswered past the bound: not up;
        watched until it answers, or replaced at ``replace_at`` (``time.monotonic()``)."""
        self._ready.discard(node_id)
        if node_id in self._stalled:
            return  # watched already (another model's delivery, or a ping, stalled first)
        self._stalled[node_id] = sent
        replace_in = replace_at - time.monotonic()
        logger.warning(
            "hub %r: the relay on node %s has not answered in %.1f s: stalled; its node's subscribers are "
            "delivered to directly until it answers (replaced if still silent in %.0f s)",
            self._hub,
            node_id[:8],
            time.monotonic() - sent,
            max(0.0, replace_in),
        )
        self._watches[node_id] = asyncio.get_running_loop().create_task(
            self._watch(node_id, relay, call, replace_in)
        )

    async def _watch(self, node_id: str, relay: Any, call: asyncio.Future[Any], replace_in: float) -> None:
        """Until a stalled relay answers ``call`` (resumed, or died: Ray restarts it) or is replaced."""
        try:
            await asyncio.wait([call], timeout=max(0.0, replace_in))
            if call.done():
                logger.warning(
                    "hub %r: the stalled relay on node %s answered (or died)", self._hub, node_id[:8]
                )
            else:
                logger.warning(
                    "hub %r: the relay on node %s stayed silent for %.0f s: replacing it",
                    self._hub,
                    node_id[:8],
                    time.monotonic() - self._stalled[node_id],
                )
                await asyncio.to_thread(ray.kill, relay, no_restart=False)  # Ray starts a new process
        except Exception as err:  # it went meanwhile (a dead node): the next start makes another
            logger.warning("hub %r: could not replace the relay on node %s: %s", self._hub, node_id[:8], err)
            self._handles.pop(node_id, None)
        finally:
            self._stalled.pop(node_id, None)
            self._watches.pop(node_id, None)
        self.start(node_id)  # up once it answers a ping

    async def _start_and_ping(self, node_id: str) -> None:
        relay: Any = self._handles.get(node_id)
        if relay is None:
            relay = await asyncio.to_thread(start_relay, self._hub, node_id, self._settings)
            self._handles[node_id] = relay
        deadline = time.monotonic() + _START_S
        while True:
            try:
                sent = time.monotonic()
                ping = quiet(asyncio.wrap_future(relay.stats.remote().future()))
                await asyncio.wait([ping], timeout=max(0.0, deadline - sent))
                if not ping.done():  # not up within _START_S: stopped or wedged as it started
                    self._stall(node_id, relay, ping, sent, time.monotonic())  # replaced now
                    return
                ping.result()  # up
                break
            except ActorDiedError:  # gone for good (its node died?): the next try starts another
                self._handles.pop(node_id, None)
                raise
            except (ActorUnavailableError, RayActorError):  # restarting: Ray refuses calls until it is back
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        self._ready.add(node_id)
        self._on_ready()

"""The hub's relays, one per node: started on demand, known to be up, delivered through.

The Ray side of relaying (:class:`~raysync.hub.relay.NodeRelay` actors, their handles and
Ray's errors), so that :mod:`raysync.hub.delivery` is plain asyncio: it asks whether a
node's relay is up, starts one in the background, and hands a
:class:`~raysync._protocol.RelayDelivery` over, with :class:`RelayLost` when that fails.

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

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from raysync import _protocol as proto
from raysync._protocol import RelayDelivery, RelayReply
from raysync.hub.relay import relay_name, start_relay
from raysync.hub.settings import HubSettings

__all__ = ["RelayLost", "Relays"]

logger = logging.getLogger(__name__)

_START_S = 120.0  # how long a relay may take to (re)start before the hub gives up for a while
_RETRY_S = 5.0  # after a relay failed to start, deliver directly this long before trying again


class RelayLost(Exception):
    """A relay did not take a delivery (it died or restarts): deliver directly until it is up."""


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

    def up(self, node_id: str) -> bool:
        return node_id in self._ready

    def name(self, node_id: str) -> str:
        return relay_name(self._hub, self._hub_actor_id, node_id)

    def names(self) -> dict[str, str]:
        """Node id -> relay name, for the relays that are up."""
        return {node: self.name(node) for node in sorted(self._ready)}

    def handle(self, node_id: str) -> Any | None:
        """The handle of the node's relay, if it is up (subscribers poll it)."""
        return self._handles.get(node_id) if node_id in self._ready else None

    def start(self, node_id: str) -> None:
        """Start (or wait for) the node's relay in the background; nobody waits for it."""
        starting = self._starts.get(node_id)
        if node_id in self._ready or (starting is not None and not starting.done()):
            return
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
        """Hand ``delivery`` to the node's relay (up); :class:`RelayLost` if it does not take it."""
        relay = self._handles.get(node_id)
        if relay is None or node_id not in self._ready:
            raise RelayLost(f"no relay up on node {node_id[:8]}")
        try:
            reply: RelayReply = await getattr(relay, proto.RELAY_DELIVER).remote(delivery)
        except Exception as err:  # it died or restarts: not up until it answers again
            self._ready.discard(node_id)
            raise RelayLost(f"{type(err).__name__}: {err}") from err
        return reply

    def forget(self, node_id: str, sub_ids: list[str]) -> None:
        """Tell the node's relay that these subscriptions left."""
        relay = self._handles.get(node_id)
        if relay is not None:
            relay.forget.remote(sub_ids)

    async def _start_and_ping(self, node_id: str) -> None:
        relay: Any = self._handles.get(node_id)
        if relay is None:
            relay = await asyncio.to_thread(start_relay, self._hub, node_id, self._settings)
            self._handles[node_id] = relay
        deadline = time.monotonic() + _START_S
        while True:
            try:
                await relay.stats.remote()  # up
                break
            except ActorDiedError:
                self._handles.pop(
                    node_id, None
                )  # gone for good (its node died?): the next try starts another
                raise
            except (ActorUnavailableError, RayActorError):  # restarting: Ray refuses calls until it is back
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        self._ready.add(node_id)
        self._on_ready()

"""Whether subscribers' actors still run: pinged when a wait or a push needs to know, swept when silent.

:class:`~raysync.hub.actor.WeightHub` holds one :class:`Liveness`. A subscriber whose actor died is
dropped (``drop``); one whose version is being delivered needs no ping (a dead actor fails that call).

Example:
    >>> await liveness.reap(["sub-1", "sub-2"])   # drops those whose actor is dead   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from raysync.hub.persistence import actor_alive, job_alive
from raysync.hub.settings import DEFAULT_DROP_SILENT_S, HubSettings
from raysync.hub.state import DeliveryGroup, HubState, Subscriber

__all__ = ["Liveness"]


class Liveness:
    """Pings subscribers' actors (through Ray's GCS) and drops the dead ones.

    Args:
        state: the hub's state.
        settings: the hub's settings (``drop_silent_s``: how long a subscriber may stay silent).
        delivering: whether a delivery to a subscriber or group is in flight.
        drop: ``drop(sub, why)`` forgets a subscriber whose actor died.
    """

    def __init__(
        self,
        state: HubState,
        settings: HubSettings,
        *,
        delivering: Callable[[Subscriber | DeliveryGroup], bool],
        drop: Callable[[Subscriber, str], None],
    ) -> None:
        self._state, self._settings, self._delivering, self._drop = state, settings, delivering, drop
        self._sweeper: asyncio.Task[None] | None = None

    async def alive(self, sub: Subscriber) -> bool:
        """Whether a subscriber's actor (or a plain process's job) may still run: Ray's GCS says."""
        if sub.info.actor_id is None and sub.info.job_id is not None:  # a plain process: its job
            return await asyncio.to_thread(job_alive, sub.info.job_id)
        return await asyncio.to_thread(actor_alive, sub.info.actor_id)

    async def reap(self, sub_ids: list[str]) -> None:
        """Drop the subscribers among ``sub_ids`` whose actor is dead (one ping per actor)."""
        actors: dict[str, list[Subscriber]] = {}
        for sub_id in sub_ids:
            sub = self._state.subs.get(sub_id)
            # A subscriber whose notification is in flight needs no ping: a dead actor fails that call.
            if sub is None or sub.relay_pending or self._delivering(sub):
                continue
            group = self._state.groups.get(sub.group) if sub.group is not None else None
            if group is not None and self._delivering(group):
                continue
            actors.setdefault(sub.info.actor_id or sub.sub_id, []).append(sub)

        async def check(subs: list[Subscriber]) -> None:
            if not await self.alive(subs[0]):
                for sub in subs:
                    self._drop(sub, "actor died")

        await asyncio.gather(*(check(subs) for subs in actors.values()))

    def start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Drop subscribers whose actor died while nobody waited for them (failed ones too)."""
        silent = float(self._settings.drop_silent_s or DEFAULT_DROP_SILENT_S)  # pinged, dropped if dead
        while True:
            await asyncio.sleep(silent / 2)  # how often the hub looks for subscribers that went silent
            stale = self._state.roster.stale(time.monotonic() - silent)
            if stale:
                await self.reap([s.sub_id for s in stale])

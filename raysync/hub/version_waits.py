"""Waits for versions at the hub: long polls for a newer one, and writers' waits until one is applied.

:class:`~raysync.hub.actor.WeightHub` holds one :class:`VersionWaits` and tells it of every change
(:meth:`VersionWaits.changed`: a publish, a restore); the hub's state keeps each wait's laggards
(:mod:`raysync.hub.state.laggards`), updated in O(1) per report.

Example:
    >>> result = await waits.wait("policy", 3, timeout=30.0)   # doctest: +SKIP
    >>> [lag.subscriber for lag in result.laggards]            # doctest: +SKIP
    []
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from raysync._protocol import Announcement, Laggard, WaitResult
from raysync.hub import metrics
from raysync.hub.state import HubState, Subscriber, Waiter
from raysync.hub.state.cohort import Cohort

__all__ = ["VersionWaits"]

_PUBLISH_GRACE_S = 2.0  # a wait for a granted, unpublished number gives its publish this long
_REAP_INTERVAL_S = 1.0  # how often a waiting hub checks that laggards are still alive


class VersionWaits:
    """The hub's waits for versions.

    Args:
        state: the hub's state.
        gauges: the hub's metrics (updated at each change).
        reap: drops the subscribers among those named whose actor died (:meth:`.Liveness.reap`).
        round_published: until a sharded round's number is published; what is left of the timeout
            (:meth:`.ShardedPublish.round_published`).
    """

    def __init__(
        self,
        state: HubState,
        gauges: metrics.HubGauges,
        *,
        reap: Callable[[list[str]], Awaitable[None]],
        round_published: Callable[[str, int, float | None], Awaitable[float | None]],
    ) -> None:
        self._state, self._gauges, self._reap, self._round_published = state, gauges, reap, round_published
        self._cond: asyncio.Condition | None = None  # wakes long polls (wait_newer) on publish

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def changed(self) -> None:
        self._gauges.changed(self._state.models, self._state.subs)
        cond = self._condition()
        async with cond:
            cond.notify_all()

    async def published(self, model_id: str, version: int, timeout: float) -> bool:
        """Until ``version`` of ``model_id`` (or newer) is published; whether it was within ``timeout`` s."""
        cond = self._condition()
        try:
            async with cond:
                await asyncio.wait_for(
                    cond.wait_for(lambda: (self._state.versions.latest(model_id) or 0) >= version), timeout
                )
        except asyncio.TimeoutError:
            return False
        return True

    async def wait_newer(self, model_id: str, version: int, timeout: float) -> Announcement | None:
        """Long poll: the newest version once it is newer than ``version``, or None after ``timeout``."""
        if not await self.published(model_id, version + 1, timeout):
            return None
        return self._state.versions.get(model_id)

    async def wait(
        self,
        model_id: str,
        version: int,
        timeout: float | None,
        include_pull: bool = False,
        report_missing: bool = False,
        subscribers: int = 0,
    ) -> WaitResult:
        """Wait until every live push subscriber of ``model_id`` applied ``version`` (or failed it).

        Pull subscribers too with ``include_pull``. With ``report_missing``, answer at once
        (``missing=True``) if some subscriber lacks the version and the hub keeps nothing
        that new (a restart lost it): the caller, its writer, can offer it again. With
        ``subscribers``, also until at least that many (counted as above) registered.

        Raises:
            UnknownModelError: ``version`` was never pushed.
            SyncTimeoutError, InvalidWeightsError, ...: ``version`` is a sharded round's that is
                still missing ranks' parts at ``timeout``, or was abandoned (why).
        """
        state = self._state
        # A sharded round's number: until the round is published (raises why it never will be).
        timeout = await self._round_published(model_id, version, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not state.waits.check_waitable(model_id, version):
            # Granted to its writer, not published yet: its publish may be on its way (another
            # process's wait can overtake it), or a restart lost it: its writer (report_missing)
            # offers it again. A moment, then it counts as never pushed.
            if report_missing:
                laggards, failures = state.waits.pending(model_id, version, include_pull)
                return WaitResult(tuple(laggards), tuple(failures), missing=True)
            grace = _PUBLISH_GRACE_S if timeout is None else min(timeout, _PUBLISH_GRACE_S)
            await self.published(model_id, version, grace)
            state.waits.check_waitable(model_id, version, granted=False)
        waits = state.waits
        while True:
            cohorts: list[Cohort] = []  # nodes' cohorts that lack it: counted once each, not per member
            behind, failed = waits.unsettled(model_id, version, include_pull, cohorts)  # no records made
            # (a scan of every subscriber: only for a wait that asked for a number of them)
            short = max(0, subscribers - waits.counted(model_id, include_pull)) if subscribers else 0
            if short and len(misfits := waits.misfits(model_id, include_pull)) >= short:
                behind += _members(cohorts)
                return WaitResult(_laggards(behind), _laggards(failed), misfits=tuple(misfits))  # never there
            if (behind or cohorts) and report_missing and not waits.kept_from(model_id, version):
                behind += _members(cohorts)
                return WaitResult(_laggards(behind), _laggards(failed), missing=True)
            if not behind and not cohorts and not short:
                if failed:  # a dead subscriber's failure is no failure of this version
                    await self._reap([s.sub_id for s in failed])
                    behind, failed = waits.unsettled(model_id, version, include_pull)
                if not behind:
                    return WaitResult((), _laggards(failed))
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                await self._reap([s.sub_id for s in behind + failed + _members(cohorts)])
                laggards, failures = waits.pending(model_id, version, include_pull)
                counted = waits.counted(model_id, include_pull)
                return WaitResult(tuple(laggards), tuple(failures), registered=counted)
            # Each record, drop or registration updates this waiter in O(1); it wakes once,
            # when no laggard is left (or one more subscriber registered, while too few have),
            # instead of re-scanning every subscriber per event.
            woken = asyncio.Event()
            waiter = Waiter(version, {s.sub_id for s in behind}, include_pull, subscribers, woken.set)
            waits.add_waiter(model_id, waiter, cohorts)
            try:
                while not waiter.woken:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    step = _REAP_INTERVAL_S if remaining is None else min(remaining, _REAP_INTERVAL_S)
                    try:
                        await asyncio.wait_for(woken.wait(), step)
                    except asyncio.TimeoutError:
                        await self._reap(list(waiter.pending))
            finally:
                waits.remove_waiter(model_id, waiter)
            if waiter.woken and not waiter.pending and not (failed or waiter.failures or subscribers):
                return WaitResult((), ())  # each one it waited for applied it: no second scan of them all


def _members(cohorts: list[Cohort]) -> list[Subscriber]:
    """The members of ``cohorts`` (where a wait's answer names each subscriber)."""
    return [s for c in cohorts for s in c.members.values()]


def _laggards(subs: list[Subscriber]) -> tuple[Laggard, ...]:
    """What a wait's result says of each subscriber (made only when the result names them)."""
    return tuple(s.laggard() for s in subs)

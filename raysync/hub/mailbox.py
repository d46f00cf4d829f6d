"""Calls from the hub (or a relay) to subscribers' actors, carried by their processes' long polls.

The hub and the relays hold no handle of a subscriber's actor: Ray builds a handle from
the actor's class, so holding one makes the holder load that class (the user's module,
torch, whatever they import). Instead each subscriber process keeps one poll open at the
hub and one at its node's relay (:mod:`raysync.receivers.poller`); a call for its actor is
queued here as a :class:`~raysync._protocol.Request` and handed out with the next poll,
and its :class:`~raysync._protocol.Answer` resolves the caller's future. This is how Ray
Serve's long-poll host feeds its replicas, and it keeps delivery free of Ray: the loops in
:mod:`raysync.hub.delivery` await futures, which the unit tests make by hand.

What Ray's errors said before, the mailbox says itself:

- :class:`SubscriberGone`: its actor is dead (asked of ``alive`` once its process stopped
  polling while a call waited for it);
- :class:`SubscriberRestarted` (a :class:`SubscriberUnreachable`): its actor restarted (a new
  process polls: its registration, not this call, brings it up to date);
- :class:`SubscriberUnreachable`: a call waited
  :data:`PICKUP_S` for a poll, or a running call went unconfirmed for :data:`LOST_S`.

A process's mailbox goes when its actor is known dead (:meth:`Mailboxes.fail`), or once it
holds no call and its process has not polled for :data:`IDLE_S` (it is gone; were it not, its
next poll would make it a new one): a hub or relay keeps none for processes that came and went.

Example:
    >>> mail = Mailboxes(alive=lambda actor_id: asyncio.sleep(0, True))
    >>> report = await mail.call("a1", NOTIFY, announcement)   # the process polls, runs, answers
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from raysync._protocol import Announcement, Answer, Caller, Request

__all__ = [
    "IDLE_S",
    "LOST_S",
    "PICKUP_S",
    "Mailboxes",
    "SubscriberGone",
    "SubscriberRestarted",
    "SubscriberUnreachable",
    "quiet",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

PICKUP_S = 30.0
"""A call no poll collected within this long fails (the process is alive, yet does not poll)."""
LOST_S = 60.0
"""A call handed out, neither answered nor reported running by a poll for this long, fails."""
IDLE_S = 60.0
"""A mailbox without calls whose process has not polled for this long is freed (a live one polls
every :data:`~raysync.receivers.poller.POLL_S`)."""
_SUSPECT_S = 1.0  # a call waiting this long with no poll open: is the actor still alive?
_CHECK_S = 0.5  # how often the watchdog looks


class SubscriberGone(Exception):
    """The subscriber's actor is dead: drop it."""


class SubscriberUnreachable(Exception):
    """The subscriber's actor restarted or does not poll: it gets the newest when it is back."""


class SubscriberRestarted(SubscriberUnreachable):
    """The call was for the actor's previous process: a new one polls now (and registers again)."""


@dataclass
class _Box:
    """One process's calls: queued (not handed out yet) and running (handed out, no answer yet)."""

    pid: int | None = None
    replaced: set[int] = field(default_factory=set)  # its actor's earlier processes (they get nothing)
    queued: list[tuple[Request, asyncio.Future[Any], float]] = field(default_factory=list)
    running: dict[int, tuple[asyncio.Future[Any], float]] = field(default_factory=dict)  # confirmed at
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    polls: int = 0  # polls open now
    started: int = 0  # polls started: the newest one takes the calls
    last_poll: float = field(default_factory=time.monotonic)  # when one was last open
    checked: float = 0.0  # when `alive` was last asked

    def busy(self) -> bool:
        return bool(self.queued or self.running)

    def fail(self, error: Exception) -> None:
        for _, fut, _ in self.queued:
            _set_error(fut, error)
        for fut, _ in self.running.values():
            _set_error(fut, error)
        self.queued.clear()
        self.running.clear()


class Mailboxes:
    """The calls this process (the hub, or one relay) makes to subscribers' actors.

    Args:
        alive: ``await alive(actor_id)``: whether the actor may still run (Ray's GCS).
    """

    def __init__(self, alive: Callable[[str], Awaitable[bool]]) -> None:
        self._alive = alive
        self._boxes: dict[str, _Box] = {}
        self._ids = itertools.count(1)
        self._watchdog: asyncio.Task[None] | None = None

    def call(
        self, actor_id: str, method: str, announcement: Announcement | None = None
    ) -> asyncio.Future[Any]:
        """Queue ``method(announcement)`` for ``actor_id``'s process; the future ends with its answer."""
        fut: asyncio.Future[Any] = quiet(asyncio.get_running_loop().create_future())  # a caller may give up
        box = self._boxes.setdefault(actor_id, _Box())
        box.queued.append((Request(next(self._ids), method, announcement), fut, time.monotonic()))
        box.wake.set()
        self._watch()
        return fut

    async def poll(
        self, caller: Caller, answers: list[Answer], running: list[int], timeout: float
    ) -> tuple[Request, ...]:
        """A process collects its calls (waiting up to ``timeout`` s for one) and answers earlier ones."""
        box = self._boxes.setdefault(caller.actor_id, _Box())
        self._watch()  # frees its mailbox once it stops polling
        if caller.pid in box.replaced:  # a poll its dead process left behind, arriving late
            return ()
        if box.pid is not None and box.pid != caller.pid:  # the actor restarted: its old calls are gone
            box.fail(
                SubscriberRestarted(f"actor {caller.actor_id[:12]} restarted (pid {box.pid} -> {caller.pid})")
            )
            box.replaced.add(box.pid)
        box.pid = caller.pid
        self._answer(box, answers)
        now = time.monotonic()
        for req_id in running:
            if req_id in box.running:
                box.running[req_id] = (box.running[req_id][0], now)
        if box.polls:  # an older poll of this process is still open: this one supersedes it (the
            box.wake.set()  # process gave up on that one's reply, or its poller stopped and began anew)
        box.started += 1
        mine = box.started
        box.polls += 1
        box.last_poll = now
        try:
            if not box.queued:
                box.wake.clear()
                try:
                    await asyncio.wait_for(box.wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            if box.pid != caller.pid or self._boxes.get(caller.actor_id) is not box:
                return ()  # its process was replaced meanwhile: the new one's polls take the calls
            if box.started != mine:
                return ()  # a newer poll of the process takes the calls (no reply nobody reads)
            return self._hand_out(box)
        finally:
            box.polls -= 1
            box.last_poll = time.monotonic()

    def answer(self, caller: Caller, answers: list[Answer]) -> None:
        """Answers of calls that ended after the poll that carried them."""
        box = self._boxes.get(caller.actor_id)
        if box is not None and box.pid == caller.pid:
            self._answer(box, answers)

    def wake(self, actor_ids: list[str] | None = None) -> None:
        """End the open polls of ``actor_ids`` (all: ``None``) now, with whatever is queued."""
        for actor_id, box in self._boxes.items():
            if actor_ids is None or actor_id in actor_ids:
                box.wake.set()

    def fail(self, actor_id: str, error: Exception) -> None:
        """Fail every call of ``actor_id`` with ``error`` and forget its process."""
        box = self._boxes.pop(actor_id, None)
        if box is not None:
            box.fail(error)
            box.wake.set()

    def pending(self) -> int:
        """Calls queued or running (for stats and tests)."""
        return sum(len(b.queued) + len(b.running) for b in self._boxes.values())

    def __len__(self) -> int:
        """The processes that have a mailbox here (for stats and tests)."""
        return len(self._boxes)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _hand_out(box: _Box) -> tuple[Request, ...]:
        now = time.monotonic()
        out = []
        for req, fut, _ in box.queued:
            if not fut.done():  # its caller may have given up (cancelled)
                box.running[req.req_id] = (fut, now)
                out.append(req)
        box.queued.clear()
        return tuple(out)

    @staticmethod
    def _answer(box: _Box, answers: list[Answer]) -> None:
        for ans in answers:
            entry = box.running.pop(ans.req_id, None)
            if entry is None or entry[0].done():
                continue
            if ans.error is not None:
                entry[0].set_exception(ans.error)
            else:
                entry[0].set_result(ans.value)

    def _watch(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        """Fail the calls of actors that died or stopped polling, free the mailboxes of processes
        that stopped polling; ends when there is no mailbox left."""
        swept = time.monotonic()
        while self._boxes:
            await asyncio.sleep(_CHECK_S)
            now = time.monotonic()
            if now - swept >= IDLE_S / 4:  # a few times per IDLE_S (an idle process costs nothing between)
                swept = now
                for actor_id, box in list(self._boxes.items()):
                    if not box.busy() and box.polls == 0 and now - box.last_poll > IDLE_S:
                        del self._boxes[actor_id]  # its process is gone (a poll would make a new one)
            if any(box.busy() for box in self._boxes.values()):
                for actor_id, box in list(self._boxes.items()):
                    if box.busy():
                        await self._check(actor_id, box, now)

    async def _check(self, actor_id: str, box: _Box, now: float) -> None:
        for req_id, (fut, confirmed) in list(box.running.items()):
            if fut.done():
                box.running.pop(req_id, None)
            elif now - confirmed > LOST_S:
                box.running.pop(req_id, None)
                _set_error(
                    fut, SubscriberUnreachable(f"no answer from actor {actor_id[:12]} in {LOST_S:.0f} s")
                )
        if box.polls == 0 and now - box.last_poll > _SUSPECT_S and now - box.checked > _SUSPECT_S:
            box.checked = now
            try:
                alive = await self._alive(actor_id)
            except Exception as err:  # the GCS did not answer: as far as we know, alive
                logger.debug("could not ask whether actor %s lives: %s", actor_id[:12], err)
                alive = True
            if not alive and self._boxes.get(actor_id) is box:
                self.fail(actor_id, SubscriberGone(f"actor {actor_id[:12]} died"))
                return
        stale = [(r, f, t) for r, f, t in box.queued if now - t > PICKUP_S]
        if stale:
            box.queued[:] = [q for q in box.queued if q not in stale]
            for _, fut, _ in stale:
                _set_error(
                    fut, SubscriberUnreachable(f"actor {actor_id[:12]} did not poll in {PICKUP_S:.0f} s")
                )


def _set_error(fut: asyncio.Future[Any], error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)


def quiet(fut: asyncio.Future[_T]) -> asyncio.Future[_T]:
    """``fut``, whose error nobody may read (its caller gave up, a stalled call): no "never retrieved" log."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut

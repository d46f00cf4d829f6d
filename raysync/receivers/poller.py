"""A subscriber process answers the hub's and its relay's calls by polling for them.

The hub and relays never hold a handle of a subscriber's actor (that would load its
class, and so import the user's code, in their processes: see :mod:`raysync.hub.mailbox`).
Each subscriber process keeps one poll open at its hub and, once the hub names it, one at
its node's relay. A poll returns the calls queued for this actor (``_raysync_notify`` and
friends); each runs on a small thread pool, or, for an async actor, on the actor's event
loop, exactly as Ray would run the method; answers ride on the next poll, or go at once
(:data:`~raysync._protocol.ANSWER`) for calls that outlast it. A hub that restarts, or a
relay, is polled again as soon as it answers.

Example:
    >>> serve(hub, owner=self)   # in a subscriber actor's constructor
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from raysync import _protocol as proto
from raysync._protocol import Answer, Caller, PollReply, Request

__all__ = ["POLL_S", "serve"]

logger = logging.getLogger(__name__)

POLL_S = 10.0
"""How long one poll stays open when no call comes (then the process polls again)."""
_PIGGYBACK_S = 0.05  # answers of calls that end within this ride on the next poll
_RETRY_S = (0.05, 2.0)  # backoff while the hub or relay restarts

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="raysync-call")
_SERVED: dict[tuple[str, str | None], _Endpoint] = {}
_LOCK = threading.Lock()


def serve(hub: Any, owner: Any) -> None:
    """Answer ``hub``'s calls for this actor with ``owner``'s methods, from now on (once per hub).

    Called from an async actor's constructor (or any of its methods), the actor's coroutine
    methods run on its event loop, as Ray runs them.

    Args:
        hub: the hub as this process sees it (``.name``, ``.namespace``, ``.handle(fresh)``).
        owner: the actor instance whose ``_raysync_*`` methods answer the calls.
    """
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # not on an event loop: a plain or threaded actor
        loop = None
    ctx = ray.get_runtime_context()
    actor_id = ctx.get_actor_id()
    if actor_id is None:
        raise RuntimeError("only a Ray actor answers the hub's calls")
    key = (hub.name, hub.namespace)
    with _LOCK:
        if key in _SERVED:
            return
        caller = Caller(actor_id, os.getpid(), ctx.get_node_id())
        runner = _Runner(owner, loop)
        _SERVED[key] = endpoint = _Endpoint(f"hub {hub.name}", hub.handle, caller, runner)
    endpoint.start()


class _Runner:
    """Runs a request's method on the owner: in the pool, or on the actor's event loop."""

    def __init__(self, owner: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        self.owner = owner
        self.loop = loop

    def submit(self, req: Request) -> concurrent.futures.Future[Answer]:
        return _POOL.submit(self._run, req)

    def _run(self, req: Request) -> Answer:
        try:
            method = getattr(self.owner, req.method)
            args = () if req.announcement is None else (req.announcement,)
            if inspect.iscoroutinefunction(method):
                if self.loop is None:
                    raise RuntimeError(f"{req.method} is a coroutine and this actor's loop is unknown")
                value = asyncio.run_coroutine_threadsafe(method(*args), self.loop).result()
            else:
                value = method(*args)
            return Answer(req.req_id, value)
        except Exception as err:
            return Answer(req.req_id, error=_portable(err))


class _Endpoint:
    """One poll kept open at one hub or relay; the hub's also starts the relay's."""

    def __init__(
        self,
        what: str,
        handle: Callable[[bool], Any],
        caller: Caller,
        runner: _Runner,
        parent: _Endpoint | None = None,
    ) -> None:
        self.what = what
        self.parent = parent  # the hub's endpoint, for a relay's
        self.handle = handle
        self.caller = caller
        self.runner = runner
        self.relay: _Endpoint | None = None
        self.running: dict[int, concurrent.futures.Future[Answer]] = {}
        self.outbox: list[Answer] = []
        self.collecting = True  # answers wait for the next poll (else: sent at once)
        self.lock = threading.Lock()
        self.stopped = False

    def start(self) -> None:
        threading.Thread(target=self._loop, name=f"raysync-poll-{self.what}", daemon=True).start()

    def _loop(self) -> None:
        fresh, delay = False, _RETRY_S[0]
        while not self.stopped:
            with self.lock:
                answers, self.outbox = self.outbox, []
                running = [r for r, f in self.running.items() if not f.done()]
                self.collecting = False
            try:
                ref = getattr(self.handle(fresh), proto.POLL).remote(self.caller, answers, running, POLL_S)
                reply: PollReply = ray.get(ref, timeout=POLL_S + 30)
            except ActorDiedError as err:
                if self.parent is not None:  # a relay gone for good: the hub names the next one
                    logger.info("%s died (%s)", self.what, err)
                    self.stopped = True
                    self.parent.caller = Caller(self.caller.actor_id, self.caller.pid, self.caller.node_id)
                    return
                fresh = True
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_S[1])
                continue
            except Exception as err:  # restarting, busy, or Ray shutting down
                if not ray.is_initialized():
                    return
                logger.debug("%s: poll failed (%s); polling again", self.what, err)
                with self.lock:
                    self.outbox[:0] = answers  # not known to have arrived: carried again
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_S[1])
                continue
            fresh, delay = False, _RETRY_S[0]
            if reply.relay is not None:
                self._follow_relay(*reply.relay)
            self._run(reply.requests)

    def _run(self, requests: tuple[Request, ...]) -> None:
        """Start the calls; wait a moment so that quick ones' answers ride on the next poll."""
        if not requests:
            return
        with self.lock:
            self.collecting = True
            futures = [self.runner.submit(req) for req in requests]
            for req, fut in zip(requests, futures, strict=True):
                self.running[req.req_id] = fut
        for req, fut in zip(requests, futures, strict=True):  # outside the lock: may run at once
            fut.add_done_callback(functools.partial(self._done, req.req_id))
        concurrent.futures.wait(futures, timeout=_PIGGYBACK_S)

    def _done(self, req_id: int, fut: concurrent.futures.Future[Answer]) -> None:
        """A call ended: its answer goes with the next poll, or now if a poll is already open."""
        answer = fut.result()
        with self.lock:
            self.running.pop(req_id, None)
            if self.collecting:
                self.outbox.append(answer)
                return
        try:
            getattr(self.handle(False), proto.ANSWER).remote(self.caller, [answer])
        except Exception as err:  # the hub restarting: it re-delivers what it has no answer for
            logger.debug("%s: answer lost (%s)", self.what, err)

    def _follow_relay(self, name: str, relay: Any) -> None:
        """Poll the node's relay the hub named (a new one replaces one that died)."""
        if self.relay is not None and self.relay.caller.relay == name and not self.relay.stopped:
            return
        if self.relay is not None:
            self.relay.stopped = True
        self.caller = Caller(self.caller.actor_id, self.caller.pid, self.caller.node_id, name)
        self.relay = _Endpoint(f"relay {name}", lambda fresh: relay, self.caller, self.runner, parent=self)
        self.relay.start()


def _portable(error: BaseException) -> BaseException:
    """An error that pickles back to the hub (a user's may carry what does not)."""
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {str(error)[:500]}")

"""A subscriber process answers the hub's and its relay's calls by polling for them.

The hub and relays never hold a handle of a subscriber's actor (that would load its
class, and so import the user's code, in their processes: see :mod:`raysync.hub.mailbox`).
Each subscriber process keeps one poll open at its hub and, once the hub names it, one at
its node's relay. A poll returns the calls queued for this process (``_raysync_notify`` and
friends); each runs on a small thread pool, or, for an async actor, on the actor's event
loop, exactly as Ray would run the method; answers ride on the next poll, or go at once
(:data:`~raysync._protocol.ANSWER`) for calls that outlast it. A hub that restarts, or a
relay, is polled again as soon as it answers.

Every receiver process hears of versions this one way: an actor's ``@synced_model``
subscriptions and adapters (the actor answers), and Followers (:class:`~raysync.Follower`), in an
actor or in a plain process (a driver, a torchrl worker), which each answer the calls for
their own subscription (``sub_ids`` of the call's announcement). A plain process's calls are
addressed to its job, node and pid (``job:<job>/<node>/<pid>``: a driver and the workers of
its Ray tasks share a job), an actor's to the actor.

Example:
    >>> serve(hub, owner=self)   # in a subscriber actor's constructor
    >>> serve(hub, owner=follower, sub_id=follower.sub_id)   # a Follower, in any process
    >>> unserve(hub, follower.sub_id)                        # it stopped
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
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
from raysync.client import background

__all__ = ["POLL_S", "address", "ray_session", "serve", "unserve"]

logger = logging.getLogger(__name__)

POLL_S = 10.0
"""How long one poll stays open when no call comes (then the process polls again)."""
_PIGGYBACK_S = 0.05  # answers of calls that end within this ride on the next poll
_RETRY_S = (0.05, 2.0)  # backoff while the hub or relay restarts

_POOL: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (its process, the pool)
_SERVED: dict[tuple[str, str | None], _Endpoint] = {}
_LOCK = threading.Lock()


def address() -> str:
    """Where the hub's calls for this process go: its actor's id, or, for a process that is no
    actor (a driver, a Ray task's worker), its job, node and pid (one job may have many)."""
    ctx = ray.get_runtime_context()
    return ctx.get_actor_id() or proto.process_address(ctx.get_job_id(), ctx.get_node_id(), os.getpid())


def serve(hub: Any, owner: Any, *, sub_id: str | None = None) -> None:
    """Answer ``hub``'s calls for this process with ``owner``'s methods, from now on.

    One poll per hub and process, whatever answers: the actor (``sub_id`` ``None``: the calls
    for its subscriptions), or the owner of one subscription (``sub_id``: a Follower), which
    answers the calls naming it. Called from an async actor's constructor (or any of its
    methods), the actor's coroutine methods run on its event loop, as Ray runs them.

    Args:
        hub: the hub as this process sees it (``.name``, ``.namespace``, ``.handle(fresh)``).
        owner: the object whose ``_raysync_*`` methods answer the calls.
        sub_id: the one subscription ``owner`` answers for (``None``: the actor's own).

    Raises:
        RuntimeError: ``sub_id`` ``None`` outside an actor (only an actor answers for itself).
    """
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # not on an event loop: a plain or threaded actor
        loop = None
    ctx = ray.get_runtime_context()
    if sub_id is None and ctx.get_actor_id() is None:
        raise RuntimeError("only a Ray actor answers the hub's calls for itself")
    key = (hub.name, hub.namespace)
    session = ray_session()
    with _LOCK:
        endpoint = _SERVED.get(key)
        if endpoint is not None and (endpoint.stopped or endpoint.session != session):
            endpoint.stop()  # Ray was shut down (and maybe started again) since: a new poll
            endpoint = None
        if endpoint is None:
            caller = Caller(address(), os.getpid(), ctx.get_node_id())
            endpoint = _SERVED[key] = _Endpoint(f"hub {hub.name}", hub.handle, caller, _Runner())
            endpoint.session, endpoint.key = session, key
            endpoint.start()
        endpoint.runner.add(owner, loop, sub_id)  # under _LOCK: the poll cannot end idle meanwhile


def ray_session() -> tuple[str, str]:
    """Which Ray this process is connected to: its node and job (a new ``ray.init()`` changes one)."""
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), ctx.get_job_id()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads the calls run on: this process's own (a forked child gets its own, never the
    parent's pool, whose threads did not come along)."""
    global _POOL
    with _LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="raysync-call"))
        return _POOL[1]


def unserve(hub: Any, sub_id: str) -> None:
    """The subscription ``sub_id`` left: its calls are no longer answered here. The process's poll
    ends by itself once its open poll returns with nothing in it left to answer (a plain process
    whose Followers all stopped); a Follower started before that takes it over, so a process
    never has two polls of one hub, one of them abandoned with a call in its reply."""
    with _LOCK:
        endpoint = _SERVED.get((hub.name, hub.namespace))
        if endpoint is not None:
            endpoint.runner.remove(sub_id)


class _Runner:
    """Runs a request's method on its owner: in the pool, or on the owner's event loop.

    A request whose announcement names a subscription with an owner of its own goes to that
    owner (a Follower); every other request goes to the actor's.
    """

    def __init__(self) -> None:
        self.actor: tuple[Any, asyncio.AbstractEventLoop | None] | None = None
        self.owners: dict[str, tuple[Any, asyncio.AbstractEventLoop | None]] = {}
        self.lock = threading.Lock()

    def add(self, owner: Any, loop: asyncio.AbstractEventLoop | None, sub_id: str | None) -> None:
        with self.lock:
            if sub_id is None:
                if self.actor is None:  # the first to serve the actor's calls keeps them
                    self.actor = (owner, loop)
            else:
                self.owners[sub_id] = (owner, loop)

    def remove(self, sub_id: str) -> None:
        """Forget ``sub_id``'s owner."""
        with self.lock:
            self.owners.pop(sub_id, None)

    def idle(self) -> bool:
        """Whether nothing is left to answer."""
        with self.lock:
            return self.actor is None and not self.owners

    def _owner(self, req: Request) -> tuple[Any, asyncio.AbstractEventLoop | None]:
        with self.lock:
            ann = req.announcement
            for sub_id in () if ann is None else ann.sub_ids:
                owned = self.owners.get(sub_id)
                if owned is not None:
                    return owned
            if self.actor is None:
                named = () if ann is None else ann.sub_ids
                raise RuntimeError(f"nothing in process {os.getpid()} answers {req.method} for {named}")
            return self.actor

    def submit(self, req: Request) -> concurrent.futures.Future[Answer]:
        return _pool().submit(self._run, req)

    def _run(self, req: Request) -> Answer:
        try:
            owner, loop = self._owner(req)
            method = getattr(owner, req.method)
            args = () if req.announcement is None else (req.announcement,)
            if inspect.iscoroutinefunction(method):
                if loop is None:
                    raise RuntimeError(f"{req.method} is a coroutine and this actor's loop is unknown")
                value = asyncio.run_coroutine_threadsafe(method(*args), loop).result()
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
        self.session: tuple[str, str] | None = None  # the Ray it polls in (node, job)
        self.key: tuple[str, str | None] | None = None  # its hub's (name, namespace): the hub's endpoint
        self.plain = proto.address_job(caller.actor_id) is not None  # no actor: its script may shut Ray down

    def stop(self) -> None:
        """Poll no more (the poll open ends within :data:`POLL_S`), nor at the relay."""
        self.stopped = True
        if self.relay is not None:
            self.relay.stopped = True

    def start(self) -> None:
        threading.Thread(target=self._loop, name=f"raysync-poll-{self.what}", daemon=True).start()

    def _loop(self) -> None:
        fresh, delay = False, _RETRY_S[0]
        while not self.stopped:
            if self._ends_idle():
                return
            with self.lock:
                answers, self.outbox = self.outbox, []
                running = [r for r, f in self.running.items() if not f.done()]
                self.collecting = False
            try:
                reply = self._poll(fresh, answers, running)
                if reply is None:  # stopped meanwhile
                    return
            except ActorDiedError as err:
                if self.parent is not None:  # a relay gone for good: the hub names the next one
                    logger.info("%s died (%s)", self.what, err)
                    self.stopped = True
                    self.parent.caller = Caller(self.caller.actor_id, self.caller.pid, self.caller.node_id)
                    return
                fresh = True
            except Exception as err:  # restarting, busy, or Ray shutting down
                if not ray.is_initialized():
                    self.stop()
                    return
                logger.debug("%s: poll failed (%s); polling again", self.what, err)
                with self.lock:
                    self.outbox[:0] = answers  # not known to have arrived: carried again
            else:
                fresh, delay = False, _RETRY_S[0]
                if reply.relay is not None:
                    self._follow_relay(*reply.relay)
                self._run(reply.requests)
                continue
            time.sleep(delay)  # the poll failed: again after a back-off
            delay = min(delay * 2, _RETRY_S[1])

    def _ends_idle(self) -> bool:
        """A hub's endpoint with nothing left to answer stops, under the lock :func:`serve` adds
        owners under (a Follower started meanwhile finds it gone, and starts a new poll)."""
        if self.key is None:
            return False
        with _LOCK:
            if not self.runner.idle():
                return False
            if _SERVED.get(self.key) is self:
                del _SERVED[self.key]
            self.stop()
            return True

    def _poll(self, fresh: bool, answers: list[Answer], running: list[int]) -> PollReply | None:
        """One poll. A plain process's Ray may be shut down by its script at any time (an actor's is
        not): its poll runs under :mod:`raysync.client.background`'s rules, in slices that let
        a ``ray.shutdown()`` in (``None``: it stopped)."""
        if not self.plain:
            ref = getattr(self.handle(fresh), proto.POLL).remote(self.caller, answers, running, POLL_S)
            reply: PollReply = ray.get(ref, timeout=POLL_S + 30)
            return reply
        with background.held(f"poll {self.what}"):
            ref = getattr(self.handle(fresh), proto.POLL).remote(self.caller, answers, running, POLL_S)
        got: PollReply | None = background.get(
            ref, timeout=POLL_S + 30, stopped=lambda: self.stopped, what=f"poll {self.what}"
        )
        return got

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
            with background.held(f"answer {self.what}") if self.plain else contextlib.nullcontext():
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

"""Calls into Ray from raysync's own threads, never into a Ray that is shutting down.

A raysync thread (a :class:`~raysync.Follower`'s long poll and applies, the heartbeat) that is
inside a call into Ray while another thread runs ``ray.shutdown()`` ends the whole process:
Ray's core worker, torn down under the call, exits with "The core worker has already been
shutdown ... The process will exit", whatever the script does next. So each of their calls
runs under Ray's own init/shutdown lock (:func:`held`), and only while Ray runs, and each wait
for an answer in slices of :data:`STEP_S` (:func:`get`): a ``ray.shutdown()`` waits for one
slice at most (or an apply under way), then the thread meets
:class:`~raysync.errors.RayNotRunningError` at its next call and ends quietly.

Example:
    >>> with held("check in with the hub"):                  # doctest: +SKIP
    ...     ref = hub.heartbeat.remote(ids)
    >>> unknown = get(ref, timeout=10.0)                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from raysync import _compat
from raysync._checks import not_running

__all__ = ["STEP_S", "get", "held", "never", "taking"]

STEP_S = 0.1
"""The longest a raysync thread stays in one call into Ray (a ``ray.shutdown()`` waits as long)."""


def never() -> bool:
    """A ``stopped`` for a wait nothing stops."""
    return False


@contextlib.contextmanager
def held(what: str) -> Iterator[None]:
    """Run the block with Ray running here; a ``ray.shutdown()`` in another thread waits for its end.

    Raises:
        RayNotRunningError: Ray is not running in this process (it was shut down).
    """
    with _compat.shutdown_lock():
        if not ray.is_initialized():
            raise not_running(what)
        yield


@contextlib.contextmanager
def taking(what: str, *locks: Any) -> Iterator[None]:
    """Inside :func:`held`: take ``locks``, which the thread calling ``ray.shutdown()`` may hold
    (``Follower.paused()``), letting a shutdown in while waiting for them, never deadlocked.

    The caller must hold Ray's lock once (one :func:`held` block, not nested).

    Raises:
        RayNotRunningError: Ray was shut down meanwhile (nothing is held then).
    """
    shutdown = _compat.shutdown_lock()
    shutdown.release()
    again = False
    try:
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            shutdown.acquire()
            again = True
            if not ray.is_initialized():
                raise not_running(what)
            yield
    finally:
        if not again:
            shutdown.acquire()  # the enclosing held() releases it


def get(
    ref: Any, *, timeout: float | None, stopped: Callable[[], bool] = never, what: str = "wait for the hub"
) -> Any:
    """``ray.get(ref, timeout=timeout)`` from a raysync thread: in slices of :data:`STEP_S`, each
    with Ray :func:`held` running; ``None`` once ``stopped()`` says True (checked between slices).

    Raises:
        GetTimeoutError: no answer within ``timeout`` seconds.
        RayNotRunningError: Ray was shut down meanwhile.
    """
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if end is None else end - time.monotonic()
        with held(what):
            try:
                return _compat.get_no_start(
                    ref, timeout=STEP_S if left is None else max(0.0, min(STEP_S, left))
                )
            except GetTimeoutError:
                if left is not None and left <= STEP_S:
                    raise
        if stopped():
            return None

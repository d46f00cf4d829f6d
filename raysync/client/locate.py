"""How anyone finds the hub and calls it: by name, retrying while it restarts.

The one retry loop every caller of the hub uses (clients, subscribers, adapters).
An error the hub raises arrives as itself (not wrapped in Ray's ``RayTaskError``).

Example:
    >>> handle = get_hub_actor("raysync")                                        # doctest: +SKIP
    >>> call_hub(lambda fresh: get_hub_actor("raysync"), "latest", "policy")     # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayTaskError

from raysync import _compat
from raysync._checks import not_running, ray_shut_down, require_ray
from raysync._protocol import DEFAULT_HUB, DEFAULT_KEEP, DEFAULT_NAMESPACE
from raysync.client import background
from raysync.errors import RaySyncError
from raysync.hub.actor import WeightHub
from raysync.hub.settings import HubSettings

__all__ = ["RETRY_S", "call_hub", "call_hub_async", "get_hub_actor", "needs_ray"]

logger = logging.getLogger(__name__)

RETRY_S = 60.0
"""How long callers keep retrying while the hub restarts."""

_RESTARTING = (ActorDiedError, ActorUnavailableError)


def get_hub_actor(
    name: str = DEFAULT_HUB,
    namespace: str | None = None,
    *,
    keep: int | None = None,
    settings: HubSettings | None = None,
    start_ray: bool = False,
) -> Any:
    """Get or create the named, detached hub actor (safe when many processes race).

    Args:
        keep, settings: what a hub created by this call starts with (an existing one
            keeps its own).
        start_ray: start a local Ray if this process has none (what :func:`raysync.connect`
            does, logging it once); otherwise a process without Ray gets
            :class:`~raysync.errors.RayNotRunningError`.

    Example:
        >>> handle = get_hub_actor("raysync")  # doctest: +SKIP
    """
    if not ray.is_initialized():
        if not start_ray:
            raise not_running("find the hub")
        logger.warning(
            "raysync.connect(): Ray was not running in this process, so it started a local Ray "
            "(ray.init()). To use another cluster or ray.init() options, call ray.init(...) before "
            "raysync.connect(); a later ray.init() in this process fails (Ray is already running)."
        )
        ray.init()
    return WeightHub.options(  # type: ignore[attr-defined]
        name=name,
        namespace=namespace or DEFAULT_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_concurrency=10_000,
    ).remote(name=name, keep=DEFAULT_KEEP if keep is None else keep, settings=settings)


_F = TypeVar("_F", bound=Callable[..., Any])


def needs_ray(method: _F) -> _F:
    """A client call that needs Ray in this process: :class:`RayNotRunningError` without it,
    and for whatever Ray raises when it was shut down meanwhile (from another thread)."""
    what = method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not ray.is_initialized():
            raise not_running(what)
        try:
            return method(self, *args, **kwargs)
        except (RaySyncError, ValueError, TypeError, RayTaskError):
            raise  # raysync's own, bad input, or the hub's answer: nothing raced a shutdown
        except Exception as err:
            if ray_shut_down():
                raise not_running(what) from err
            raise

    return call  # type: ignore[return-value]


def _unwrapped(err: RayTaskError) -> BaseException:
    """The hub's own error for a raysync error it raised; Ray's wrapper for anything else."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, RaySyncError) else err


class _Retries:
    """The retry rule of every hub call: back off while the hub restarts, within the caller's time."""

    def __init__(self, method: str, timeout: float | None, retry_s: float, timeout_error: type[Exception]):
        now = time.monotonic()
        self.method, self.timeout, self.timeout_error = method, timeout, timeout_error
        self.deadline = None if timeout is None else now + timeout
        self.give_up = now + (retry_s if timeout is None else min(retry_s, timeout))
        self.delay = 0.05

    def left(self) -> float | None:
        """Seconds left of the caller's timeout (``None``: no timeout)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def after(self, err: Exception) -> float:
        """Seconds to wait before trying again after ``err`` (the hub restarting); raise when out of time."""
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            why = f"the hub did not answer {self.method} within {self.timeout} s (restarting)"
            raise self.timeout_error(why) from err
        if now >= self.give_up:
            raise err
        logger.warning("hub unavailable (%s); retrying %s", type(err).__name__, self.method)
        wait = self.delay if self.deadline is None else min(self.delay, self.deadline - now)
        self.delay = min(self.delay * 2, 1.0)
        return wait


def call_hub(
    handle: Callable[[bool], Any],
    method: str,
    *args: Any,
    timeout: float | None = None,
    retry_s: float = RETRY_S,
    stopped: Callable[[], bool] | None = None,
) -> Any:
    """Call a hub method; while the hub restarts (or was re-created), find it again and retry.

    Args:
        handle: returns the hub's actor handle; ``handle(True)`` looks it up afresh.
        method: the hub method (a name from :mod:`raysync._protocol`, or a query).
        args: its arguments.
        timeout: seconds for the whole call, retries included (``GetTimeoutError`` after).
        retry_s: how long to keep retrying while the hub is unavailable.
        stopped: for a call from a raysync thread (:mod:`raysync.client.background`): its calls
            into Ray hold a ``ray.shutdown()`` off, for :data:`~raysync.client.background.STEP_S`
            at most each, and ``stopped`` is checked between them; once it says True, the call
            returns None without the answer (a long poll that its caller's ``stop()`` should
            not have to sit out).

    Raises:
        RaySyncError: what the hub raised (``StaleWriterError``, ``UnknownModelError``, ...).
        RayNotRunningError: Ray is not running here (with ``stopped``: it was shut down meanwhile).
    """
    retries, fresh = _Retries(method, timeout, retry_s, GetTimeoutError), False
    what = f"call the hub ({method})"
    while True:
        try:
            if stopped is not None:  # from a raysync thread
                with background.held(what):
                    ref = _compat.call_no_start(getattr(handle(fresh), method), *args)
                return background.get(ref, timeout=retries.left(), stopped=stopped, what=what)
            require_ray(what)
            # Never Ray's auto-init: a call racing ray.shutdown() fails instead of starting a new Ray.
            ref = _compat.call_no_start(getattr(handle(fresh), method), *args)
            return _compat.get_no_start(ref, timeout=retries.left())
        except RayTaskError as err:
            raise _unwrapped(err) from None
        except _RESTARTING as err:
            time.sleep(retries.after(err))
            fresh = True


async def call_hub_async(
    handle: Callable[[bool], Any], method: str, *args: Any, timeout: float | None = None
) -> Any:
    """:func:`call_hub` for event loops (``asyncio.TimeoutError`` after ``timeout``)."""
    retries, fresh = _Retries(method, timeout, RETRY_S, asyncio.TimeoutError), False
    while True:
        try:
            return await asyncio.wait_for(getattr(handle(fresh), method).remote(*args), retries.left())
        except RayTaskError as err:
            raise _unwrapped(err) from None
        except _RESTARTING as err:
            await asyncio.sleep(retries.after(err))
            fresh = True

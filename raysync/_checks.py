"""Checks shared by every public entry point: one rule for every timeout, one for "is Ray running here"."""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "WAIT_TIMEOUT_S",
    "check_model_id",
    "check_timeout",
    "not_running",
    "ray_shut_down",
    "require_ray",
    "wait_timeout",
]

WAIT_TIMEOUT_S = 300.0
"""The bound of a wait given ``timeout=None`` (the default of ``hub.wait``, ``push``'s ``wait=True``
and ``max_lag``, ``Follower.wait_for``, ``raysync_sync`` and the torchrl senders' waits): every wait
ends, with :class:`~raysync.SyncTimeoutError` naming who is behind. ``float("inf")`` waits without
a bound, where a caller really means it."""


def check_timeout(
    value: Any, name: str = "timeout", *, allow_none: bool = True, positive: bool = False
) -> float | None:
    """Return ``value`` as seconds, or raise ``ValueError`` naming it.

    A timeout is a real number of seconds: not a bool (``True`` is not "one
    second"), not NaN (a wait for NaN seconds never ends), not negative.
    ``float("inf")`` means no limit, like ``None``.

    Args:
        value: what the caller passed.
        name: the argument's name, for the message.
        allow_none: whether ``None`` (no limit) is accepted.
        positive: refuse 0 as well (for timeouts that must let something happen).

    Example:
        >>> check_timeout(2)
        2.0
        >>> check_timeout(float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: timeout must be None or a number of seconds >= 0, got nan
    """
    if value is None and allow_none:
        return None
    bound = "> 0" if positive else ">= 0"
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not math.isnan(value)
        and (value > 0 if positive else value >= 0)
    )
    if not ok:
        what = f"None or a number of seconds {bound}" if allow_none else f"a number of seconds {bound}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def wait_timeout(value: Any, name: str = "timeout") -> float | None:
    """A wait's bound in seconds: ``value`` checked as :func:`check_timeout` does, ``None`` (the
    default) as :data:`WAIT_TIMEOUT_S` (read at call time), ``float("inf")`` as ``None`` (no bound).

    Example:
        >>> wait_timeout(None)
        300.0
        >>> wait_timeout(float("inf")) is None
        True
    """
    seconds = check_timeout(value, name)
    if seconds is None:
        return WAIT_TIMEOUT_S
    return None if math.isinf(seconds) else seconds


def not_running(what: str) -> Exception:
    """The error for a call into Ray in a process where Ray is not running (see :func:`require_ray`)."""
    from raysync.errors import RayNotRunningError

    return RayNotRunningError(
        f"cannot {what}: Ray is not running in this process (ray.shutdown() was called, or Ray never "
        "started here). Call ray.init(...) and raysync.connect(...) again; raysync starts no cluster "
        "of its own outside connect()."
    )


def require_ray(what: str) -> None:
    """Raise :class:`~raysync.errors.RayNotRunningError` unless Ray runs in this process.

    Called right before raysync's calls into Ray that would otherwise start a local Ray
    of their own (``ray.put``, ``ray.get``: Ray's auto-init), so that a push racing
    ``ray.shutdown()`` from another thread fails instead of starting a new cluster.

    Example:
        >>> require_ray("push")  # doctest: +SKIP
    """
    import ray

    if not ray.is_initialized():
        raise not_running(what)


def ray_shut_down(grace_s: float = 2.0) -> bool:
    """Whether Ray is (or within ``grace_s`` becomes) not running here: an error from a call into
    Ray that raced ``ray.shutdown()`` from another thread arrives while the shutdown is still
    under way, before ``ray.is_initialized()`` turns False."""
    import time

    import ray

    deadline = time.monotonic() + grace_s
    while ray.is_initialized():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def check_model_id(model_id: Any) -> None:
    """Raise ``ValueError`` unless ``model_id`` is a non-empty string.

    Example:
        >>> check_model_id("")
        Traceback (most recent call last):
        ValueError: model_id must be a non-empty string, got ''
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")

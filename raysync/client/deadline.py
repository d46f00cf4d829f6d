"""One deadline per client call: every answer the call waits for from the hub comes within it.

A call of :class:`~raysync.HubClient` (``push``, ``wait``, ``latest``, ...) sets its deadline
once (:func:`within`); each hub call and each read of the hub's answers inside it waits
:func:`left` seconds at most, and the call raises :class:`~raysync.SyncTimeoutError` once the
deadline has passed, whatever the hub does (stopped, overloaded, restarting). The hub's own
timeouts (a wait's) let it answer in time, with the laggards' names; this one is the client's
guarantee. Blocks nest: a call made inside another keeps the earlier deadline of the two.

Example:
    >>> with within(3.0):          # doctest: +SKIP
    ...     client._calls.latest("policy")   # SyncTimeoutError after 3 s without an answer
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, TypeVar

from raysync.errors import SyncTimeoutError

__all__ = ["ANSWER_GRACE_S", "bounded", "left", "timed_out", "within"]

ANSWER_GRACE_S = 2.0
"""How long past a wait's ``timeout`` its client still waits for the hub's answer (which names
the laggards); also granted to a push, whose first publish may wait for a sharded group."""


@dataclass(frozen=True)
class _Deadline:
    at: float  # time.monotonic() seconds; inf: no bound
    seconds: float | None  # the bound the call was given, for messages


_current: ContextVar[_Deadline | None] = ContextVar("raysync_hub_deadline", default=None)


class within:  # lower case: used like a function, ``with within(3.0):``
    """Hub calls made in the block (by this thread or task) end within ``seconds`` from now, all told.

    ``None``: no bound of its own (an enclosing block's still holds). A class, not a generator:
    a push enters two (under 2 us each, against 4 for a generator).
    """

    __slots__ = ("_deadline", "_token")

    def __init__(self, seconds: float | None) -> None:
        at = math.inf if seconds is None else time.monotonic() + seconds
        self._deadline = _Deadline(at, seconds)
        self._token: Token[_Deadline | None] | None = None

    def __enter__(self) -> None:
        outer = _current.get()
        mine = self._deadline
        self._token = _current.set(mine if outer is None or mine.at < outer.at else outer)

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _current.reset(self._token)


_F = TypeVar("_F", bound=Callable[..., Any])


def bounded(method: _F) -> _F:
    """A client method without a timeout of its own: its hub calls end within the client's
    ``retry_s``, all told."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with within(self.retry_s):
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def left(default: float | None = None) -> float | None:
    """Seconds left of the call under way (``None``: no bound); ``default`` outside any call."""
    current = _current.get()
    if current is None:
        return default
    if math.isinf(current.at):
        return None
    return max(0.0, current.at - time.monotonic())


def timed_out(hub: str, method: str, default: float | None = None) -> SyncTimeoutError:
    """The error of a call whose deadline passed before ``hub`` answered ``method``."""
    current = _current.get()
    seconds = default if current is None else current.seconds
    return SyncTimeoutError(
        f"hub {hub!r} did not answer {method} within the call's {seconds} s: it is stopped, "
        "overloaded or restarting (it may still carry the call out once it runs again)"
    )

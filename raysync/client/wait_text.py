"""What a wait for a version says: who is behind and why, who was not counted, and a log line
every :data:`LOG_EVERY_S` while it is long.

Waits (``hub.wait``, ``push(wait=True)``, ``push(max_lag=...)``) count push-mode subscribers
(push and follow); pull-mode ones apply only when they call ``raysync_sync()``, so they are
counted only with ``include_pull=True``, and every message that could be read otherwise says so.

Example:
    >>> behind([{"subscriber": "s1", "actor": "Collector", "applied": 3, "error": None, "state": "live"}])
    'Collector s1 (holds version 3; live, no error: applying, or busy in a method call)'
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LOG_EVERY_S", "Progress", "WaitLabel", "behind", "not_counted", "registered"]

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
"""While a wait runs longer, it logs one line this often (at most): what it waits for, who is behind."""

_NAMED = 10  # subscribers a message names (then "and N more")


def behind(rows: Sequence[dict[str, Any]]) -> str:
    """The subscribers ``rows`` (``Laggard.row()``) in words: actor, id, version held, state, why."""
    words = []
    for r in rows[:_NAMED]:
        held = "nothing yet" if r["applied"] is None else f"version {r['applied']}"
        if r["error"]:
            why = f"last error: {r['error']}"
        elif r["state"] == "live":
            why = "no error: applying, or busy in a method call"
        elif r["state"] == "restoring":
            why = "known from before a hub restart, not checked in since"
        else:
            why = "the hub cannot reach it"
        words.append(f"{r['actor'] or 'subscriber'} {r['subscriber']} (holds {held}; {r['state']}, {why})")
    more = len(rows) - _NAMED
    return "; ".join(words) + (f"; and {more} more" if more > 0 else "")


def not_counted(pull: int | None) -> str:
    """The sentence on pull-mode subscribers a wait did not count (``pull``: how many; ``None``: unknown)."""
    if pull == 0:
        return ""
    many = "pull-mode subscribers" if pull is None else f"{pull} pull-mode subscriber(s) registered and"
    return (
        f" ({many} not counted: they apply only when they call raysync_sync(); include_pull=True counts them)"
    )


def registered(counted: int, need: int, pull: int | None, include_pull: bool) -> str:
    """How many of the ``need`` subscribers a wait asked for registered (``counted``), in words,
    with the ``pull`` pull-mode ones it did not count (and whether counting them would do)."""
    if include_pull:
        return f"only {counted} of the {need} subscribers waited for (subscribers={need}) registered"
    words = f"only {counted} of the {need} push-mode subscribers waited for (subscribers={need}) registered"
    if pull and counted + pull >= need:
        return (
            f"{words}; {pull} pull-mode subscriber(s) registered too, which would make {counted + pull}, "
            "but a wait counts them only with include_pull=True (they apply only when they call "
            "raysync_sync())"
        )
    return words + not_counted(pull)


@dataclass(frozen=True)
class WaitLabel:
    """What a wait is, for its messages: ``hub.wait(...)``, a push's ``wait=True`` or its ``max_lag``."""

    model_id: str
    version: int
    need: int = 0  # subscribers=n
    max_lag: int | None = None  # set: the wait of a push(max_lag=...)

    def __str__(self) -> str:
        if self.max_lag is not None:
            return (
                f"push of {self.model_id!r} waiting for subscribers to come within max_lag={self.max_lag} "
                f"(to hold version {self.version})"
            )
        also = f" and {self.need} registered subscribers" if self.need else ""
        return f"wait for version {self.version} of {self.model_id!r}{also}"


@dataclass
class Progress:
    """One log line per :data:`LOG_EVERY_S` (at most) while a wait is long; ``clock`` injectable."""

    label: WaitLabel
    include_pull: bool
    every: float = LOG_EVERY_S
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)
    _next: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()
        self._next = self.started + self.every

    def due(self) -> bool:
        """Whether a line is due now."""
        return self.clock() >= self._next

    def note(self, why: object) -> bool:
        """Log ``why`` the wait goes on (a sharded round not published yet) if a line is due."""
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + self.every
        logger.warning("%s: still waiting after %.0f s: %s", self.label, now - self.started, why)
        return True

    def report(self, rows: Sequence[dict[str, Any]], count: int | None, pull: int | None) -> bool:
        """Log who is behind if a line is due (``count``: subscribers registered and counted; ``pull``:
        pull-mode ones not counted); whether it logged."""
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + self.every
        what = [f"{self.label}: still waiting after {now - self.started:.0f} s"]
        if rows:
            what.append(f"{len(rows)} behind: {behind(rows)}")
        if count is not None and count < self.label.need:
            what.append(registered(count, self.label.need, pull, self.include_pull))
        logger.warning("%s", "; ".join(what))
        return True

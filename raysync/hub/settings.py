"""How a hub and its relays deliver: typed settings, fixed when the hub is created.

A hub reads them once, in its constructor; its relays get them from the hub. Pass
them to :func:`raysync.connect` (``settings=``) when it creates the hub. Where a
field is not given, the environment variable beside it is the default, read in the
hub's own process (so a cluster-wide ``runtime_env`` keeps working):

=====================  ==========================  ==========================================
field                  environment variable        meaning
=====================  ==========================  ==========================================
``relays``             ``RAYSYNC_RELAY``           one relay per node carries each version to
                                                   that node's subscribers (default on)
``rings_own_node``     ``RAYSYNC_HUB_RINGS``       the hub serves its own node itself: rings
                                                   its doorbells, calls the rest (default on;
                                                   off: a relay does)
``doorbell_bytes``     ``RAYSYNC_DOORBELL_BYTES``  the largest version handed over by
                                                   doorbell (8 MiB; ``0``: never)
``nice``               ``RAYSYNC_HUB_NICE``        the hub's and relays' niceness (default:
                                                   keep Ray's, see :mod:`raysync.hub.priority`)
``drop_silent_s``      ``RAYSYNC_DROP_SILENT_S``   a subscriber silent this long is checked and
                                                   dropped if its process died (10 s)
``ring_ack_s``         ``RAYSYNC_RING_ACK_S``      how long a rung subscriber has to ack before
                                                   it is called the Ray way too (0.2 s)
``relay_stall_s``      ``RAYSYNC_RELAY_STALL_S``   a relay silent this long (beyond
                                                   ``ring_ack_s``) on a delivery is stalled:
                                                   its node is delivered to directly (10 s)
=====================  ==========================  ==========================================

Example:
    >>> hub = raysync.connect("eval-hub", settings=raysync.HubSettings(relays=False))  # doctest: +SKIP
    >>> hub.settings().relays                                                         # doctest: +SKIP
    False
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_DOORBELL_BYTES",
    "DEFAULT_DROP_SILENT_S",
    "DEFAULT_RELAY_STALL_S",
    "DEFAULT_RING_ACK_S",
    "HubSettings",
]

logger = logging.getLogger(__name__)

DEFAULT_DOORBELL_BYTES = 8 << 20
"""Above it, one Ray call per subscriber costs less than the extra copy into shared memory."""

DEFAULT_DROP_SILENT_S = 10.0
"""Five of a subscriber's heartbeats (every 2 s): a live one is never this silent."""

DEFAULT_RING_ACK_S = 0.2
"""A rung subscriber applies a small version in milliseconds: one silent this long may have died."""

DEFAULT_RELAY_STALL_S = 10.0
"""A relay answers a delivery within milliseconds past ``ring_ack_s``: one silent this long is stuck."""

# The fields in seconds: (default, the values that fit, those values in words, why). NaN fits none.
_SECONDS: dict[str, tuple[float, Callable[[float], bool], str, str]] = {
    "drop_silent_s": (DEFAULT_DROP_SILENT_S, lambda v: v >= 4.0, "at least 4", " (two heartbeats)"),
    "ring_ack_s": (DEFAULT_RING_ACK_S, lambda v: 0 < v <= 60.0, "within (0, 60]", ""),
    "relay_stall_s": (DEFAULT_RELAY_STALL_S, lambda v: 1.0 <= v <= 600.0, "within [1, 600]", ""),
}

_ENV = {
    "relays": "RAYSYNC_RELAY",
    "rings_own_node": "RAYSYNC_HUB_RINGS",
    "doorbell_bytes": "RAYSYNC_DOORBELL_BYTES",
    "nice": "RAYSYNC_HUB_NICE",
    "drop_silent_s": "RAYSYNC_DROP_SILENT_S",
    "ring_ack_s": "RAYSYNC_RING_ACK_S",
    "relay_stall_s": "RAYSYNC_RELAY_STALL_S",
}
_NO = ("0", "false", "no", "off")
_YES = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class HubSettings:
    """How a hub and its relays deliver versions; ``None`` fields take the environment's default.

    Args:
        relays: deliver through one relay actor per node (one hub message per node per
            version). ``False``: the hub calls every subscriber itself.
        rings_own_node: the hub serves its own node's subscribers itself: it rings their
            doorbells and calls the others (no relay hop, and no relay, there). ``False``: a
            relay serves the hub's node too.
        doorbell_bytes: versions up to this many bytes reach a node's subscribers through
            shared memory and a doorbell; larger ones by Ray call. ``0``: never by doorbell.
        nice: the hub's and relays' niceness (-20..19); ``None`` keeps the one Ray gave them
            (lowering it needs root or ``CAP_SYS_NICE``; without it they keep Ray's).
        drop_silent_s: a subscriber that has not checked in for this many seconds (they
            send a heartbeat every 2 s) is checked, and dropped if its process died: a
            follower or torchrl worker that died leaves ``raysync status``, ``hub.wait``
            and ``push(wait=True)`` this long after (at most 1.5 times this). At least 4.
        ring_ack_s: a subscriber rung by doorbell that has not acked within this many
            seconds is called the Ray way as well (the call tells whether its process died
            after the ring; a live one applies the version once and acks whichever way
            comes first). Raise it on nodes so loaded that live subscribers miss it (the
            relay's ``called_after_ring`` count grows). Above 0, at most 60.
        relay_stall_s: a relay that has not answered one of the hub's deliveries within
            ``ring_ack_s`` (its longest wait for rung subscribers) plus this many seconds is
            *stalled* (stopped, wedged, starved of CPU): the hub delivers to its node's
            subscribers itself, ``hub.status()["stalled_relays"]`` names it, and the relay is
            used again once it answers, or replaced (killed; Ray starts it again) if it stays
            silent for :data:`~raysync.hub.relay_handles.REPLACE_AFTER_STALLS` times this bound.
            At least 1, at most 600.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: ``doorbell_bytes`` below 0, ``nice`` outside -20..19, or
            ``drop_silent_s`` below 4, ``ring_ack_s`` not within (0, 60], or
            ``relay_stall_s`` not within [1, 600].

    Example:
        >>> HubSettings(relays=False, doorbell_bytes=0).relays
        False
    """

    relays: bool | None = None
    rings_own_node: bool | None = None
    doorbell_bytes: int | None = None
    nice: int | None = None
    drop_silent_s: float | None = None
    ring_ack_s: float | None = None
    relay_stall_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("relays", "rings_own_node"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"HubSettings.{name} must be True, False or None, got {value!r}")
        for name in ("doorbell_bytes", "nice"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"HubSettings.{name} must be an integer or None, got {value!r}")
        if self.doorbell_bytes is not None and self.doorbell_bytes < 0:
            raise ValueError(
                f"HubSettings.doorbell_bytes must be >= 0 (0: no doorbell), got {self.doorbell_bytes}"
            )
        if self.nice is not None and not -20 <= self.nice <= 19:
            raise ValueError(f"HubSettings.nice must be within -20..19, got {self.nice}")
        for name, (_, fits, bound, why) in _SECONDS.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise TypeError(f"HubSettings.{name} must be a number of seconds or None, got {value!r}")
            if value is not None and not fits(value):  # NaN too
                raise ValueError(f"HubSettings.{name} must be {bound} s{why}, got {value!r}")

    def resolved(self, environ: Mapping[str, str] | None = None) -> HubSettings:
        """Every field set: the given ones as they are, the others from ``environ`` (this process's
        environment by default), a malformed variable logged and replaced by the default.

        Example:
            >>> given = HubSettings(relays=False).resolved({"RAYSYNC_DOORBELL_BYTES": "1024"})
            >>> given.relays, given.doorbell_bytes, given.ring_ack_s, given.relay_stall_s
            (False, 1024, 0.2, 10.0)
        """
        env = os.environ if environ is None else environ
        read: dict[str, Callable[[Mapping[str, str], str], Any]] = {
            "relays": _flag,
            "rings_own_node": _flag,
            "doorbell_bytes": _bytes,
            "nice": _nice,
            **dict.fromkeys(_SECONDS, _seconds),
        }
        given: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return HubSettings(**{k: read[k](env, k) if v is None else v for k, v in given.items()})

    def differs(self, other: HubSettings) -> dict[str, tuple[Any, Any]]:
        """The fields set here (not ``None``) whose value ``other`` does not have: name -> (here, there)."""
        out: dict[str, tuple[Any, Any]] = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is not None and mine != theirs:
                out[f.name] = (mine, theirs)
        return out


def _warn(env: Mapping[str, str], name: str, what: str, default: Any) -> None:
    logger.warning("%s=%r is not %s; using %r", _ENV[name], env[_ENV[name]], what, default)


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(_ENV[name], "").strip().lower()
    if raw in _NO:
        return False
    if raw and raw not in _YES:
        _warn(env, name, "one of " + "/".join(_YES + _NO), True)
    return True


def _bytes(env: Mapping[str, str], name: str) -> int:
    raw = env.get(_ENV[name], "").strip()
    if not raw:
        return DEFAULT_DOORBELL_BYTES
    try:
        return max(0, int(raw))
    except ValueError:
        _warn(env, name, "a number of bytes", DEFAULT_DOORBELL_BYTES)
        return DEFAULT_DOORBELL_BYTES


def _seconds(env: Mapping[str, str], name: str) -> float:
    """A number of seconds from the environment: the field's default if unset; logged and the
    default if it is not a number, or not one that fits the field (:data:`_SECONDS`)."""
    default, fits, bound, _ = _SECONDS[name]
    raw = env.get(_ENV[name], "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not fits(value):  # NaN fits nothing
        _warn(env, name, f"a number of seconds, {bound}", default)
        return default
    return value


def _nice(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(_ENV[name], "").strip().lower()
    if raw in ("", "ray"):
        return None
    try:
        value = int(raw)
    except ValueError:
        _warn(env, name, "an integer or 'ray'", None)
        return None
    return min(19, max(-20, value))

"""A model id the hub has no version of: the models it does have, and one log line per hub and id.

``hub.latest(model_id)`` answers ``None`` before the first push and a follower may start
before its trainer, so neither can refuse a model id with no version yet. A typo'd one
(``"polcy"``) would then pass silently: these calls log one line, once per hub and model
id in a process, naming the models the hub does hold (a warning when it holds others:
most likely a typo).

Example:
    >>> models_there({"models": {"policy": {"latest": 3}, "critic": {"latest": None}}})
    ['policy']
    >>> note_absent("raysync", "polcy", lambda: {"models": {"policy": {"latest": 3}}}, "latest() is None")
    ['policy']
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LATEST_NONE", "describe_models", "models_there", "note_absent"]

logger = logging.getLogger(__name__)

LATEST_NONE = "latest() is None until one is pushed"
"""What ``hub.latest()`` does meanwhile, as its line says."""

RECHECK_S = 2.0
"""Seconds before a model id found absent from a hub holding nothing else is checked again
(a ``latest()`` polled before the first push asks the hub for its models this often at most)."""

_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()  # (hub, model id): its line was logged
_checked: dict[tuple[str, str], float] = {}  # (hub, model id) -> when its models were last asked


def models_there(status: dict[str, Any]) -> list[str]:
    """The model ids with a version on the hub, from its ``status()``."""
    models = status.get("models") or {}
    return sorted(m for m, info in models.items() if isinstance(info, dict) and info.get("latest"))


def describe_models(models: list[str]) -> str:
    """``"'policy', 'critic'"``, or ``"none"``: the models there, as a message names them."""
    return ", ".join(repr(m) for m in models) if models else "none"


def note_absent(
    hub: str, model_id: str, status: Callable[[], dict[str, Any]], then: str, *, always: bool = False
) -> list[str] | None:
    """Log once per ``(hub, model_id)`` that the hub has no version of ``model_id``; the models there.

    Args:
        hub: the hub's name.
        model_id: the model id that has no version on the hub.
        status: the hub's ``status()`` (called at most once per :data:`RECHECK_S` per
            hub and model id until the line is logged).
        then: what happens meanwhile, for the line (``"latest() is None until one is pushed"``).
        always: log even when the hub holds no model at all (a follower that starts before
            its trainer says so at ``INFO``); otherwise only when it holds others (``WARNING``).

    Returns:
        The models with a version on the hub; ``None`` if it was not asked (logged before,
        or asked within :data:`RECHECK_S`) or did not answer.
    """
    key = (hub, model_id)
    now = time.monotonic()
    with _lock:
        if key in _warned or now - _checked.get(key, -RECHECK_S) < RECHECK_S:
            return None
        _checked[key] = now
    try:
        models = models_there(status())
    except Exception as err:  # a line that helps a user must never fail the call it rides on
        logger.debug("hub %r: could not list its models (%s)", hub, err)
        return None
    if model_id in models or not (models or always):
        return models
    with _lock:
        if key in _warned:
            return models
        _warned.add(key)
    logger.log(
        logging.WARNING if models else logging.INFO,
        "no model %r on hub %r (models there: %s); %s",
        model_id,
        hub,
        describe_models(models),
        then,
    )
    return models

"""Argument checks shared by every public entry point (one rule for every timeout)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_timeout"]


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

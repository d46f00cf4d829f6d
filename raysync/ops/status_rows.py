"""What ``raysync status`` says of one subscriber row of ``hub.status()``: its state and its error.

A subscriber whose model does not fit its model id's versions (a *misfit*: the hub keeps it
registered but hands it no version) is shown as state ``misfit``, with the reason (which
tensors) where its last error goes.

Example:
    >>> row_state({"state": "live", "misfit": "weights do not match the model: ..."})
    'misfit'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["row_error", "row_state"]


def row_state(row: Mapping[str, Any]) -> str:
    """``misfit`` for a live misfit subscriber; else its state (``live``, ``unreachable``, ...).

    Example:
        >>> row_state({"state": "unreachable"})
        'unreachable'
    """
    state = str(row.get("state"))
    return "misfit" if row.get("misfit") and state == "live" else state


def row_error(row: Mapping[str, Any]) -> str | None:
    """Its last error; for a misfit, why its model does not fit (and that it is not handed versions).

    Example:
        >>> row_error({"last_error": None, "misfit": "shape mismatch w: pushed (4,), model (3,)"})
        'not handed versions, its model does not fit them: shape mismatch w: pushed (4,), model (3,)'
    """
    misfit = row.get("misfit")
    if misfit:
        return f"not handed versions, its model does not fit them: {misfit}"
    error = row.get("last_error")
    return None if not error else str(error)

"""The hub's and relays' CPU priority: Ray's worker default, or another by choice.

Ray starts every worker process, actors included, at nice 15 (``RAY_worker_niceness``),
below the driver and Ray's own daemons (nice 0). The hub and the relays are
actors, so they keep that by default: measured with ``examples/quickstart.py``
(2 cores, 4 alternations), a hub at nice 0 made the trainer's median push
slower (5.8-7.2 ms against 3.8-4.5 ms at nice 15): at equal priority the hub's
deliveries compete with the trainer for the cores. Where deliveries matter more
than the trainer's blocking time, ``HubSettings(nice=<n>)`` (or ``RAYSYNC_HUB_NICE=<n>``
in the hub's environment) sets the hub's and relays' niceness (lowering it needs root or
``CAP_SYS_NICE``; without it they keep Ray's, never an error).

Example:
    >>> control_plane_priority(None)   # in the hub's or a relay's constructor
    15
"""

from __future__ import annotations

import logging
import os

__all__ = ["control_plane_priority"]

logger = logging.getLogger(__name__)


def control_plane_priority(target: int | None) -> int | None:
    """Set this process's niceness to ``target`` (``None``: keep Ray's); return the niceness it has.

    ``target`` is the hub's :attr:`~raysync.hub.settings.HubSettings.nice`. Never raises:
    without the right to raise a priority the process keeps the one Ray gave it (logged
    at debug level). ``None`` where the OS has no niceness.
    """
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return None
    if target is None:
        return current
    if target != current:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, target)
        except OSError as err:  # lowering the niceness needs privileges
            logger.debug("keeping niceness %d (could not set %d: %s)", current, target, err)
    return os.getpriority(os.PRIO_PROCESS, 0)

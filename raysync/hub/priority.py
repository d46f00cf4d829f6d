"""The hub's and relays' CPU priority: that of Ray's own control plane, not of its workers.

Ray starts every worker process, actors included, at nice 15 (``RAY_worker_niceness``),
below the driver and Ray's own daemons (nice 0). The hub and the relays are
actors, so on a node where the trainer keeps a core busy they got a small
share of the CPU and every delivery waited for the trainer (on a 2-core machine a
new actor's imports took 8 s instead of 2.5 s while a driver worked). They do
little work but are on every version's path, so they set their own priority
back to nice 0 where the OS allows it (root, or ``CAP_SYS_NICE``), and keep
Ray's where it does not. ``RAYSYNC_HUB_NICE`` picks another value; ``ray``
keeps Ray's.

Example:
    >>> control_plane_priority()   # in the hub's or a relay's constructor
    0
"""

from __future__ import annotations

import logging
import os

__all__ = ["control_plane_priority"]

logger = logging.getLogger(__name__)

DEFAULT_NICE = 0


def control_plane_priority() -> int | None:
    """Set this process's niceness to ``RAYSYNC_HUB_NICE`` (default 0); return the niceness it has.

    Never raises: without the right to raise a priority the process keeps the one
    Ray gave it (logged at debug level). ``None`` where the OS has no niceness.
    """
    wanted = os.environ.get("RAYSYNC_HUB_NICE", str(DEFAULT_NICE)).strip().lower()
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return None
    if wanted in ("", "ray"):
        return current
    try:
        target = int(wanted)
    except ValueError:
        logger.warning("RAYSYNC_HUB_NICE=%r is not an integer or 'ray': keeping niceness %d", wanted, current)
        return current
    if target != current:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, target)
        except OSError as err:  # lowering the niceness needs privileges
            logger.debug("keeping niceness %d (could not set %d: %s)", current, target, err)
    return os.getpriority(os.PRIO_PROCESS, 0)

"""The hub's and relays' CPU priority (Ray's worker default, or another by choice), and their
start-up objects kept out of the garbage collector's full scans.

Ray starts every worker process, actors included, at nice 15 (``RAY_worker_niceness``),
below the driver and Ray's own daemons (nice 0). The hub and the relays are
actors, so they keep that by default: measured with ``examples/quickstart.py``
(2 cores, 4 alternations), a hub at nice 0 made the trainer's median push
slower (5.8-7.2 ms against 3.8-4.5 ms at nice 15): at equal priority the hub's
deliveries compete with the trainer for the cores. Where deliveries matter more
than the trainer's blocking time, ``HubSettings(nice=<n>)`` (or ``RAYSYNC_HUB_NICE=<n>``
in the hub's environment) sets the hub's and relays' niceness (lowering it needs root or
``CAP_SYS_NICE``; without it they keep Ray's, never an error).

Each full collection of Python's cyclic garbage collector scans every object the process
tracks; in a hub, about 80,000, nearly all from importing Ray and raysync, took ~50 ms of CPU
(measured on 2 cores, 4 sharded writers of 256 tensors: one every ~7 versions, a stall of the
loop that serves every model). :func:`freeze_startup_objects` at the end of the hub's and a
relay's constructor moves what they hold then out of those scans (``gc.freeze()``): a full
collection then took 3 ms. Those objects are still freed when nothing refers to them.

Example:
    >>> control_plane_priority(None)   # in the hub's or a relay's constructor
    15
"""

from __future__ import annotations

import gc
import logging
import os

__all__ = ["control_plane_priority", "freeze_startup_objects"]

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


def freeze_startup_objects() -> int:
    """Keep every object this process tracks now out of the garbage collector's later scans
    (``gc.freeze()``: its imports and set-up, alive for the process's life); how many it keeps out.

    Called once, at the end of the hub's and a relay's constructor (see the module's docstring).
    """
    gc.freeze()
    return gc.get_freeze_count()

"""A following scheme's wait for its writer's first version, bounded, with one clear error."""

from __future__ import annotations

import logging
import time
from typing import Any

from raysync.errors import SyncTimeoutError, UnknownModelError

__all__ = ["POLL_S", "wait_for_first_version"]

logger = logging.getLogger(__name__)

POLL_S = 0.05
"""How often the hub is asked for the model's newest version while none is there."""


def wait_for_first_version(client: Any, model_id: str, *, hub: str, timeout: float) -> int:
    """The model's newest version, waiting up to ``timeout`` seconds for a first one.

    Args:
        client: the :class:`raysync.HubClient`.
        model_id: the model followed.
        hub: the hub's name, for the message.
        timeout: seconds to wait for a first version.

    Raises:
        SyncTimeoutError: nothing was pushed for ``model_id`` within ``timeout``.

    Example:
        >>> wait_for_first_version(raysync.connect(), "policy", hub="raysync", timeout=30)  # doctest: +SKIP
        1
    """
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            latest: int | None = client.latest(model_id)
        except UnknownModelError:  # a hub that names the models it has: none of this one yet
            latest = None
        if latest is not None:
            return latest
        if time.monotonic() >= deadline:
            raise SyncTimeoutError(
                f"no version of {model_id!r} on hub {hub!r} within {timeout:g} s: this HubWeightSyncScheme "
                "follows it (follow_only=True) and its writer has not pushed yet; push a first version "
                "before creating the collector, or give the scheme a longer timeout="
            )
        if not said:
            logger.info("waiting up to %g s for the first version of %r on hub %r", timeout, model_id, hub)
            said = True
        time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))

"""A follower that starts before any version of its model: one log line, and a bounded wait for a first.

Following a model id with no version yet is allowed (a follower may start before its
trainer): :meth:`~raysync.Follower.start` then returns at once holding nothing and says so
in one log line per hub and model id, naming the models the hub holds (a warning when it
holds others: a typo'd id is then seen at once). A receiver whose docs promise the newest
version on return (``follow_engine``) waits for a first one with :func:`wait_for_first`.

Example:
    >>> follower = raysync.Follower(target=loader, model_id="policy").start()  # doctest: +SKIP
    >>> wait_for_first(follower, timeout=60)                                    # doctest: +SKIP
    3
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raysync.client.hub_calls import calls_to
from raysync.client.model_ids import describe_models, models_there, note_absent
from raysync.errors import SyncTimeoutError
from raysync.receivers.membership import membership

if TYPE_CHECKING:
    from raysync.receivers.follower import Follower

__all__ = ["note_no_version", "wait_for_first"]

FOLLOWING = "following it until one is pushed"
"""What a follower of a model id with no version does meanwhile, as its line says."""


def _status(follower: Follower) -> dict[str, Any]:
    return calls_to(membership().hub(follower).handle, timeout=5.0).status()


def note_no_version(follower: Follower) -> None:
    """The follower holds no version after registering: one log line naming the models there."""
    note_absent(follower.hub_name, follower.model_id, lambda: _status(follower), FOLLOWING, always=True)


def wait_for_first(follower: Follower, timeout: float) -> int:
    """Block until ``follower`` holds a version (the hub's newest); return it.

    Raises:
        SyncTimeoutError: none within ``timeout`` seconds; the message names the model id and
            the models the hub holds (and why a version that came failed to apply, if one did).
    """
    try:
        return follower.wait_for(1, timeout=timeout)
    except SyncTimeoutError:
        pass
    try:
        there = describe_models(models_there(_status(follower)))
    except Exception as err:  # the hub did not answer: say so instead of the models
        there = f"not listed: {err}"
    failed = f"; a version came but failed to apply: {follower.last_error}" if follower.last_error else ""
    raise SyncTimeoutError(
        f"{follower.label}: hub {follower.hub_name!r} had no version of model {follower.model_id!r} "
        f"within {timeout:g} s (models there: {there}){failed}. Push one first "
        f"(hub.push(model, model_id={follower.model_id!r})), check the model id, or raise timeout="
    )

"""How a client waits for a version: within its timeout, whatever the hub does; the errors it raises."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayTaskError

from raysync import _compat
from raysync._checks import check_timeout, require_ray
from raysync._protocol import WaitResult
from raysync.errors import ApplyError, RaySyncError, SyncTimeoutError, UnknownModelError, WeightMismatchError
from raysync.hub import deadline
from raysync.hub.identity import writer_identity

if TYPE_CHECKING:
    from raysync.hub.client import HubClient

__all__ = ["early_result", "raise_for", "wait_for"]


def wait_for(
    client: HubClient,
    version: int,
    model_id: str,
    timeout: float | None,
    *,
    include_pull: bool,
    raise_failures: bool,
    need: int = 0,
) -> None:
    """``client``'s wait for ``version`` (:meth:`HubClient.wait <raysync.HubClient.wait>`, a push's
    ``max_lag``): the hub's answer is waited for :data:`~raysync.hub.deadline.ANSWER_GRACE_S`
    past ``timeout``, then :class:`SyncTimeoutError`, whatever the hub does.
    """
    check_timeout(timeout)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"version must be an integer >= 1 (what push() returned), got {version!r}")
    end = None if timeout is None else time.monotonic() + timeout
    with deadline.within(None if timeout is None else timeout + deadline.ANSWER_GRACE_S):
        mine = client._pipeline.offer(model_id)
        offer = mine is not None and mine.version >= version
        args = (model_id, version, timeout, include_pull, offer, need)
        # With publishes unanswered (a push just returned), send the wait at once instead of
        # after their answers: the hub keeps a stamped version before its publish awaits
        # anything and starts one caller's calls in order, so the wait finds it (one round
        # trip less). A refusal among the answers still raises first.
        early = None
        if client._publishes.unanswered(model_id):
            require_ray("wait")
            early = _compat.call_no_start(client.actor.wait, *args)
        try:
            client._settle(model_id, wait=True, raise_refused=False)
            client._publishes.raise_refused(model_id, waited=version)  # push(wait=True): its own
        except BaseException:
            if early is not None:
                with contextlib.suppress(Exception):
                    ray.cancel(early)
            raise
        result: WaitResult | None = None if early is None else early_result(early)
        if result is None:
            result = client._call("wait", *args)
        if result.missing and mine is not None:
            # The hub restarted and lost the version: offer ours again (a sharded rank: its part;
            # the hub keeps the version once every rank offered), then wait as usual.
            client._call(mine.method, *mine.args, writer_identity())
            left = None if end is None else max(0.0, end - time.monotonic())
            result = client._call("wait", model_id, version, left, include_pull, False, need)
    raise_for(result, model_id, version, timeout, need=need, failures=raise_failures)


def early_result(ref: Any) -> WaitResult | None:
    """The answer to a wait sent with publishes in flight; ``None``: ask again the usual way.

    The usual way retries through a hub restart and offers a version a restart lost;
    an early wait that met either (or arrived first after all) gives way to it, and so
    does one the call's deadline (:mod:`raysync.hub.deadline`) ran out for.
    """
    try:
        result: WaitResult = _compat.get_no_start(ref, timeout=deadline.left())
    except RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, UnknownModelError):
            return None
        raise cause if isinstance(cause, RaySyncError) else err from None
    except (ActorDiedError, ActorUnavailableError, GetTimeoutError):
        return None
    return result


def raise_for(
    result: WaitResult, model_id: str, version: int, timeout: float | None, *, need: int, failures: bool
) -> None:
    """Raise what a wait's end means: ``WeightMismatchError`` naming the misfits ``need`` counts
    on, ``SyncTimeoutError`` naming the laggards (or how many of ``need`` subscribers
    registered), ``ApplyError`` naming the failures (with ``failures``).

    Example:
        >>> raise_for(WaitResult(), "policy", 3, 30.0, need=0, failures=True)   # all there: no error
    """
    if result.misfits:
        rows = [r.row() for r in result.misfits]
        names = "; ".join(f"{r['subscriber']} ({r['actor']}): {r['error']}" for r in rows[:10])
        raise WeightMismatchError(
            f"{len(rows)} of the {need} subscribers of {model_id!r} this wait counts on do not fit the "
            f"model's versions, so they never apply version {version}: {names}"
        )
    if result.laggards or (result.registered is not None and result.registered < need):
        rows = [r.row() for r in result.laggards]
        names = ", ".join(
            f"{r['subscriber']} ({r['actor']}, applied {r['applied']}"
            + (f", {r['state']}" if r["state"] != "live" else "")
            + (f", error: {r['error']}" if r["error"] else "")
            + ")"
            for r in rows[:10]
        )
        short = (
            f"; only {result.registered} of the {need} subscribers waited for had registered"
            if result.registered is not None and result.registered < need
            else ""
        )
        raise SyncTimeoutError(
            f"{len(rows)} subscriber(s) of {model_id!r} did not apply version {version} "
            f"within {timeout} s: {names or '-'}{short}",
            laggards=rows,
        )
    if result.failures and failures:
        rows = [r.row() for r in result.failures]
        names = "; ".join(f"{r['subscriber']} ({r['actor']}): {r['error']}" for r in rows[:10])
        raise ApplyError(
            f"{len(rows)} subscriber(s) of {model_id!r} failed to apply version {version} "
            f"and kept their previous weights: {names}",
            failures=rows,
        )

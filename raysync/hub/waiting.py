"""How a client reads the end of a wait: the early answer, and the errors it raises."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayTaskError

from raysync._protocol import WaitResult
from raysync.errors import ApplyError, RaySyncError, SyncTimeoutError, UnknownModelError

__all__ = ["early_result", "raise_for"]


def early_result(ref: Any, timeout: float | None) -> WaitResult | None:
    """The answer to a wait sent with publishes in flight; ``None``: ask again the usual way.

    The usual way retries through a hub restart and offers a version a restart lost;
    an early wait that met either (or arrived first after all) gives way to it.
    """
    try:
        result: WaitResult = ray.get(ref, timeout=None if timeout is None else timeout + 30.0)
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
    """Raise what a wait's end means: ``SyncTimeoutError`` naming the laggards (or how many of
    ``need`` subscribers registered), ``ApplyError`` naming the failures (with ``failures``).

    Example:
        >>> raise_for(WaitResult(), "policy", 3, 30.0, need=0, failures=True)   # all there: no error
    """
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

"""How a client waits for a version: within its timeout, whatever the hub does; the errors it raises."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayTaskError

from raysync import _compat
from raysync._checks import wait_timeout
from raysync._protocol import WaitResult
from raysync.client import deadline, wait_text
from raysync.client.identity import writer_identity
from raysync.client.wait_text import Progress, WaitLabel, behind, not_counted, registered
from raysync.errors import ApplyError, RaySyncError, SyncTimeoutError, UnknownModelError, WeightMismatchError

if TYPE_CHECKING:
    from raysync.client.hub_client import HubClient

__all__ = ["early_result", "raise_for", "wait_for", "wait_within_lag"]


def wait_for(
    client: HubClient,
    version: int,
    model_id: str,
    timeout: float | None,
    *,
    include_pull: bool,
    raise_failures: bool,
    need: int = 0,
    label: WaitLabel | None = None,
) -> None:
    """``client``'s wait for ``version`` (:meth:`HubClient.wait <raysync.HubClient.wait>`, a push's
    ``wait=True`` and ``max_lag``): the hub's answer is waited for
    :data:`~raysync.client.deadline.ANSWER_GRACE_S` past ``timeout`` (``None``:
    :data:`~raysync._checks.WAIT_TIMEOUT_S`; ``inf``: no bound), then :class:`SyncTimeoutError`,
    whatever the hub does. The hub is asked in slices of :data:`~raysync.client.wait_text.LOG_EVERY_S`,
    and each slice that ends short logs who is behind.
    """
    timeout = wait_timeout(timeout)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"version must be an integer >= 1 (what push() returned), got {version!r}")
    label = label or WaitLabel(model_id, version, need)
    progress = Progress(label, include_pull, every=wait_text.LOG_EVERY_S)
    end = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if end is None else max(0.0, end - time.monotonic())

    def slice_s() -> float:
        rest = left()
        return progress.every if rest is None else min(rest, progress.every)

    pull: int | None = 0
    with deadline.within(None if timeout is None else timeout + deadline.ANSWER_GRACE_S):
        writer, calls = client._writer, client._calls
        mine = writer.pipeline.offer(model_id)
        offer = mine is not None and mine.version >= version
        # With publishes unanswered (a push just returned), send the wait at once instead of
        # after their answers: the hub keeps a stamped version before its publish awaits
        # anything and starts one caller's calls in order, so the wait finds it (one round
        # trip less). A refusal among the answers still raises first.
        early, asked, sent = None, slice_s(), time.monotonic()
        if writer.publishes.unanswered(model_id):
            early = calls.post_wait(model_id, version, asked, include_pull, offer, need)
        try:
            writer.settle(model_id, wait=True, raise_refused=False)
            writer.publishes.raise_refused(model_id, waited=version)  # push(wait=True): its own
        except BaseException:
            if early is not None:
                with contextlib.suppress(Exception):
                    ray.cancel(early)
            raise
        result: WaitResult | None = None
        while True:
            if result is None:
                try:
                    if early is not None:
                        early, result = None, early_result(early)
                    if result is None:
                        asked, sent = slice_s(), time.monotonic()
                        result = calls.wait(model_id, version, asked, include_pull, offer, need)
                except SyncTimeoutError as err:
                    if time.monotonic() - sent < asked:
                        raise  # before its slice ended: why a sharded round will never be published
                    if left() == 0:
                        raise SyncTimeoutError(f"{err} ({label}: {timeout} s in all)") from None
                    # A sharded round still missing ranks' parts at the end of a slice: wait on.
                    progress.note(err)
                    continue
            if result.missing and mine is not None:
                # The hub restarted and lost the version: offer ours again (a sharded rank: its part;
                # the hub keeps the version once every rank offered), then wait as usual.
                calls.offer(mine, writer_identity())
                offer, result = False, None
                continue
            registered = result.registered
            short = registered is not None and registered < need
            if result.misfits or not (result.laggards or short) or left() == 0:
                break  # misfits: a wait that needs them never ends (raise_for says so at once)
            if progress.due():
                if short and not include_pull:
                    pull = _pull_mode(client, model_id)
                progress.report([r.row() for r in result.laggards], registered, pull)
            result = None
        if (result.laggards or short) and not include_pull:
            pull = _pull_mode(client, model_id)
    raise_for(
        result,
        model_id,
        version,
        timeout,
        need=need,
        failures=raise_failures,
        label=label,
        include_pull=include_pull,
        pull=pull,
    )


def wait_within_lag(
    client: HubClient, model_id: str, max_lag: int, timeout: float | None, *, include_pull: bool
) -> None:
    """A push's ``max_lag``: wait until no push-mode subscriber (pull-mode too with ``include_pull``)
    would be more than ``max_lag`` versions behind the version about to be pushed."""
    target = (client.latest(model_id) or 0) + 1 - max_lag
    if target >= 1:
        # A subscriber that failed an old version is not behind in a way waiting can fix
        # (this push brings it forward): only laggards hold the trainer back.
        label = WaitLabel(model_id, target, max_lag=max_lag)
        wait_for(
            client, target, model_id, timeout, include_pull=include_pull, raise_failures=False, label=label
        )


def _pull_mode(client: HubClient, model_id: str) -> int | None:
    """How many pull-mode subscribers of ``model_id`` are registered (``None``: the hub did not say)."""
    try:
        status = client._calls.status()
    except Exception:  # only for a message: the wait's own answer is what counts
        return None
    return sum(1 for s in status["subscribers"] if s["model_id"] == model_id and s["mode"] == "pull")


def early_result(ref: Any) -> WaitResult | None:
    """The answer to a wait sent with publishes in flight; ``None``: ask again the usual way.

    The usual way retries through a hub restart and offers a version a restart lost;
    an early wait that met either (or arrived first after all) gives way to it, and so
    does one the call's deadline (:mod:`raysync.client.deadline`) ran out for.
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
    result: WaitResult,
    model_id: str,
    version: int,
    timeout: float | None,
    *,
    need: int,
    failures: bool,
    label: WaitLabel | None = None,
    include_pull: bool = True,
    pull: int | None = 0,
) -> None:
    """Raise what a wait's end means: ``WeightMismatchError`` naming the misfits ``need`` counts
    on, ``SyncTimeoutError`` naming who is behind and why (and how many of ``need`` subscribers
    registered; without ``include_pull``, that the ``pull`` pull-mode ones were not counted:
    ``None``, an unknown number), ``ApplyError`` naming the failures (with ``failures``).

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
    short = result.registered is not None and result.registered < need
    if result.laggards or short:
        label = label or WaitLabel(model_id, version, need)
        rows = [r.row() for r in result.laggards]
        kind = "subscriber(s)" if include_pull else "push-mode subscriber(s)"
        said = [f"{label} timed out after {timeout} s"]
        if rows:
            said.append(f"{len(rows)} {kind} did not apply version {version}: {behind(rows)}")
        if short:
            assert result.registered is not None
            said.append(registered(result.registered, need, pull, include_pull))
        # Said with the registrations, where they fell short.
        tail = "" if short or include_pull else not_counted(pull)
        raise SyncTimeoutError("; ".join(said) + tail, laggards=rows)
    if result.failures and failures:
        rows = [r.row() for r in result.failures]
        names = "; ".join(f"{r['subscriber']} ({r['actor']}): {r['error']}" for r in rows[:10])
        raise ApplyError(
            f"{len(rows)} subscriber(s) of {model_id!r} failed to apply version {version} "
            f"and kept their previous weights: {names}",
            failures=rows,
        )

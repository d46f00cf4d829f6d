"""The steps of the apply path: plan, fetch, verify, commit whole or not at all, report.

:class:`~raysync.receivers.pipeline.Applier` runs them, in one order, for every receiver
(``@synced_model`` subscriptions in each form, ``RayModuleTransform`` hosts,
:class:`~raysync.Follower` and what it feeds, adapters, whose fan-out is the commit, torchrl's
receivers and strategy). The
steps are functions here, but for the fetch, which is :mod:`raysync.transports.fetch`'s
(a trainer's ``pull`` takes bytes through it too):

1. :func:`plan`: not newer than the version held, skip; else the target checks the
   manifest against what it holds (before any byte is fetched: the error names the
   tensor) and says which buckets it lacks.
2. :func:`~raysync.transports.fetch.fetch` / :func:`~raysync.transports.fetch.fetch_async`:
   those buckets, through the receiver side of the version's data path; then
   :func:`~raysync.transports.fetch.verified` checks their checksums (``verify``).
3. :func:`commit`: the target takes the version whole (:meth:`Target.commit`), under
   whatever lock the receiver holds for it.
4. :func:`failed`, :func:`skipped`: the :class:`ApplyReport` for the hub (an applied
   version's is the :class:`~raysync.receivers.pipeline.Applier`'s).

Example:
    >>> needed = plan(target, ann.version, ann.manifest, ids, held=3)  # doctest: +SKIP
    >>> fetched = fetch(ann.manifest, list(ann.refs), needed, timeout=30, target=target)  # doctest: +SKIP
    >>> commit(target, ann.version, ann.manifest, ids, fetched)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ray.exceptions import ObjectLostError

from raysync._protocol import ApplyReport
from raysync.core.layout import Manifest
from raysync.errors import ApplyError, RaySyncError
from raysync.receivers.target import Incoming, Target
from raysync.transports.fetch import view

__all__ = ["commit", "failed", "plan", "portable", "skipped"]

logger = logging.getLogger(__name__)


def plan(
    target: Target, version: int, manifest: Manifest, ids: Sequence[str | None], held: int | None
) -> list[int] | None:
    """The buckets to fetch for ``version``, or None if it is not newer than ``held``.

    Raises:
        WeightMismatchError: the version does not fit the target (nothing fetched).
    """
    if held is not None and version <= held:
        return None
    manifest = view(target, manifest)
    target.check(manifest)
    return target.needed(manifest, ids)


def commit(
    target: Target, version: int, manifest: Manifest, ids: Sequence[str | None], fetched: Any
) -> float:
    """Hand the version to the target, whole; the seconds it took (readers' pause under a lock)."""
    t0 = time.perf_counter()
    target.commit(Incoming(version, view(target, manifest), list(ids), fetched))
    return time.perf_counter() - t0


def failed(version: int, held: int | None, error: BaseException) -> ApplyReport:
    """The report of a version not applied: the receiver keeps ``held``."""
    return ApplyReport(
        applied=held,
        failed=version,
        error=portable(error),
        timed_out=isinstance(error, TimeoutError),
        # its bytes are gone (the pusher died): the hub stops offering it
        lost=version if isinstance(error, ObjectLostError) else None,
    )


def skipped(held: int | None, version: int) -> ApplyReport:
    """The report of a version not newer than the one held."""
    return ApplyReport(applied=held, skipped=version)


def portable(error: BaseException) -> BaseException:
    """The error itself if it pickles across Ray (raysync's do), else an ApplyError that says what it was."""
    if isinstance(error, RaySyncError):
        return error
    return ApplyError(f"{type(error).__name__}: {str(error)[:1000]}")

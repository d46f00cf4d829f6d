"""Who a wait still waits for, and the hub's status as plain data."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable
from typing import Any

from raysync._protocol import (
    Laggard,
)
from raysync.errors import UnknownModelError
from raysync.hub.state.cohort import Cohort
from raysync.hub.state.layouts import Layouts
from raysync.hub.state.records import Subscriber, Tables, Version, Waiter

__all__ = ["Waits"]


class Waits:
    """Waits for versions (and registrations), and ``status()``."""

    def __init__(self, tables: Tables, layouts: Layouts) -> None:
        self.tables = tables
        self.layouts = layouts  # whether a subscriber fits the version a wait is for

    # ------------------------------------------------------------------ waits
    def check_waitable(self, model_id: str, version: int, *, granted: bool = True) -> bool:
        """Raise if ``version`` of ``model_id`` was never pushed (a wait for it could only run out).

        Returns whether it was published. A number granted to the writer but not published
        yet (its publish is on its way, or was refused) is waitable with ``granted``; the
        caller gives the publish a moment, then asks again with ``granted=False``.
        """
        model = self.tables.models.get(model_id)
        limit = (model.issued if granted else model.latest) if model is not None else 0
        if model is None or version > limit:
            raise UnknownModelError(
                f"version {version} of model {model_id!r} was never pushed on hub {self.tables.name!r} "
                f"(newest pushed: {model.latest if model and model.latest else None}; models here: "
                f"{sorted(self.tables.models)}); wait for a version push() returned (a refused push's "
                "number is never pushed)"
            )
        return version <= model.latest

    def kept_from(self, model_id: str, version: int) -> bool:
        """Whether a version this new or newer is kept."""
        model = self.tables.models.get(model_id)
        return model is not None and any(v >= version for v in model.versions)

    def pending(
        self, model_id: str, version: int, include_pull: bool = True
    ) -> tuple[list[Laggard], list[Laggard]]:
        """Who a wait for ``version`` still waits for, and who failed it.

        Not a subscriber whose model does not fit the version (a misfit, see
        :mod:`raysync.hub.state.layouts`): it is never handed it, so it is no laggard of it.
        """
        laggards, failures = self.unsettled(model_id, version, include_pull)
        return [s.laggard() for s in laggards], [s.laggard() for s in failures]

    def unsettled(
        self, model_id: str, version: int, include_pull: bool = True, cohorts: list[Cohort] | None = None
    ) -> tuple[list[Subscriber], list[Subscriber]]:
        """:meth:`pending`'s subscribers themselves (one pass of plain fields; no record made).

        With ``cohorts`` (a list to fill): a node's cohort that lacks ``version`` is put there,
        once, instead of its members (one test for all of them, see :meth:`watch`).
        """
        laggards: list[Subscriber] = []
        failures: list[Subscriber] = []
        model = self.tables.models.get(model_id)
        kept = model.versions.get(version) if model is not None else None
        misfit = self.layouts.misfit
        for sub in self._candidates(model_id, version, kept, cohorts):
            if (sub.applied is not None and sub.applied >= version) or sub.state == "dead":
                continue
            if not (include_pull or sub.pushed):
                continue
            if (sub.misfit if kept is None else misfit(sub, kept.manifest)) is not None:
                continue
            (failures if sub.failed >= version else laggards).append(sub)
        return laggards, failures

    def _candidates(
        self, model_id: str, version: int, kept: Version | None, cohorts: list[Cohort] | None
    ) -> Iterable[Subscriber]:
        """The model's subscribers, less the members of cohorts that hold ``version`` (each settled:
        one test per node) and of those ``cohorts`` takes, where every subscriber is pushed."""
        subs = self.tables.by_model.get(model_id, {})
        groups = self.tables.model_groups.get(model_id, {}).values()
        solo = self.tables.solo.get(model_id, {})
        if sum(len(g.members) for g in groups) + len(solo) != len(subs):
            return subs.values()  # pull subscriptions too: each one
        parts: list[Iterable[Subscriber]] = [solo.values()]
        skipped = False
        for g in groups:
            cohort = g.cohort
            whole = bool(cohort.members)
            if whole and not cohort.holds(version):
                fits = kept is None or cohort.fits(kept.manifest, self.layouts.misfit)
                whole = cohorts is not None and fits
                if whole:
                    cohorts.append(cohort)  # type: ignore[union-attr]
            parts.append(g.outside.values() if whole else g.members.values())
            skipped = skipped or whole
        return itertools.chain.from_iterable(parts) if skipped else subs.values()

    def misfits(self, model_id: str, include_pull: bool = False) -> list[Laggard]:
        """The misfit subscribers of ``model_id`` a wait would count (its error: why it misfits)."""
        return [
            dataclasses.replace(s.laggard(), error=f"WeightMismatchError: {s.misfit}")
            for s in self.tables.subscribers(model_id)
            if s.misfit is not None and (include_pull or s.pushed)
        ]

    def counted(self, model_id: str, include_pull: bool = False) -> int:
        """How many live subscribers of ``model_id`` a wait counts (push and follow; pull too with
        ``include_pull``; never a misfit)."""
        return sum(
            1 for s in self.tables.subscribers(model_id) if (include_pull or s.pushed) and s.misfit is None
        )

    def add_waiter(self, model_id: str, waiter: Waiter, cohorts: Iterable[Cohort] = ()) -> None:
        """Register a wait; it counts each of ``cohorts`` (cohorts that lack its version) once."""
        self.tables.waiters.setdefault(model_id, set()).add(waiter)
        for cohort in cohorts:
            cohort.watch(waiter)

    def remove_waiter(self, model_id: str, waiter: Waiter) -> None:
        for cohort in list(waiter.cohorts):
            cohort.waiters.discard(waiter)
        waiter.cohorts.clear()
        waiters = self.tables.waiters.get(model_id)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self.tables.waiters[model_id]

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """Models (versions kept, bytes, last push) and subscribers (applied, lag, errors), as plain data."""
        now = time.time()
        models = {}
        for model_id, model in sorted(self.tables.models.items()):
            newest = model.newest
            models[model_id] = {
                "latest": model.latest or None,
                "versions_kept": sorted(model.versions),
                "bytes_per_version": newest.manifest.total_nbytes if newest else 0,
                "buckets": newest.manifest.num_buckets if newest else 0,
                "layout_hash": newest.manifest.layout_hash if newest else None,
                "pushes": model.pushes,
                "bytes_pushed": model.bytes_pushed,
                "last_push_time": model.last_push_time,
                "last_push_age_s": None if model.last_push_time is None else now - model.last_push_time,
                "writer": model.writer,
            }
        subs = []
        for sub in sorted(self.tables.subs.values(), key=lambda s: (s.model_id, s.sub_id)):
            held = self.tables.models.get(sub.model_id)
            latest = held.latest if held is not None else 0
            # An error about a version older than the newest belongs to a superseded version:
            # the subscriber moves on with the next one (or its next pull), so status drops it.
            error = sub.last_error
            if error is not None and sub.error_version is not None and sub.error_version < latest:
                error = None
            misfit = sub.misfit
            subs.append(
                {
                    "subscriber": sub.sub_id,
                    "model_id": sub.model_id,
                    "actor_id": sub.info.actor_id,
                    "class_name": sub.info.class_name,
                    "node_id": sub.info.node_id,
                    "pid": sub.info.pid,
                    "mode": sub.info.mode,
                    "apply": sub.info.apply,
                    "applied": sub.applied,
                    "modified_since": sub.modified_since,  # its own code changed `applied` in place
                    # versions published since the one it holds (numbers skip at a new writer)
                    "lag": held.versions_after(sub.applied) if held is not None else 0,
                    "last_apply_time": sub.last_apply_time,
                    # measured at the same moment as the models' last_push_age_s
                    "last_apply_age_s": None if sub.last_apply_time is None else now - sub.last_apply_time,
                    "last_apply_s": sub.last_apply_s,
                    "last_pause_s": sub.last_pause_s,
                    "last_buckets_fetched": sub.last_buckets_fetched,
                    "last_bytes_fetched": sub.last_bytes_fetched,
                    "last_prefetched": sub.last_prefetched,
                    "last_error": error,
                    "state": sub.state,
                    # its model does not fit the versions (it is not handed them): why
                    "misfit": misfit,
                    "waiting_for": None if misfit is None else f"a version that fits ({misfit[:200]})",
                    "receivers": sub.receivers,
                    "placement": sub.info.placement,
                }
            )
        delivery = {
            "relay": self.tables.relay,
            "calls": self.tables.delivery_calls,
            "nodes": sorted({g.node_id for g in self.tables.groups.values() if g.node_id is not None}),
        }
        return {
            "hub": self.tables.name,
            "keep": self.tables.keep,
            "models": models,
            "subscribers": subs,
            "delivery": delivery,
        }

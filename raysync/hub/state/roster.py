"""The hub's subscribers: who holds what, who is behind, who is gone."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from raysync._protocol import (
    Announcement,
    AppliedRow,
    ApplyReport,
    Registration,
)
from raysync.hub.state.layouts import Layouts
from raysync.hub.state.records import DeliveryGroup, Subscriber, Tables
from raysync.hub.state.versions import Versions

__all__ = ["Roster"]

logger = logging.getLogger(__name__)


class Roster:
    """Registrations, reports and drops, indexed by model and by delivery group."""

    def __init__(self, tables: Tables, versions: Versions, layouts: Layouts) -> None:
        self.tables = tables
        self.versions = versions  # the newest version a registration applies; versions found lost
        self.layouts = layouts  # whether a new subscriber fits its model's versions

    # ------------------------------------------------------------------ subscribers
    def register(self, reg: Registration) -> tuple[Subscriber, Subscriber | None, Announcement | None]:
        """Add (or re-add) a subscription; the registration it replaces; the newest version to apply.

        The subscriber applies the newest version itself (from its ``__init__``), so
        it counts as sent.
        """
        sub = Subscriber(reg.sub_id, reg.model_id, reg.reachable, reg.info, reg.schema)
        sub.doorbell_key = reg.doorbell_key
        if reg.applied is not None and self.believable(sub, reg.applied):
            sub.applied = reg.applied
        newest = self.versions.newest(reg.model_id)
        # A misfit: before waits count it.
        self.layouts.judge(sub, None if newest is None else newest.manifest)
        replaced = self.add(sub)
        if newest is None or (sub.applied is not None and sub.applied >= newest.version):
            return sub, replaced, None
        if sub.misfit is not None:  # its model does not fit the versions: not offered (judge logged it)
            return sub, replaced, None
        sub.sent = newest.version
        return sub, replaced, newest.announce(reg.model_id)

    def add(self, sub: Subscriber) -> Subscriber | None:
        """Index a subscription; returns the one of the same id it replaces (now removed)."""
        old = self.tables.subs.get(sub.sub_id)
        if old is not None:
            self.remove(old)
        self.tables.subs[sub.sub_id] = sub
        self.tables.by_model.setdefault(sub.model_id, {})[sub.sub_id] = sub
        sub.route(self.tables.relay and sub.pushed and bool(sub.info.node_id))
        if sub.group is not None:
            group = self.tables.groups.get(sub.group)
            if group is None:
                group = self.tables.groups[sub.group] = DeliveryGroup(node_id=sub.info.node_id)
                self.tables.model_groups.setdefault(sub.model_id, {})[sub.group] = group
            group.add(sub)
        elif sub.pushed:
            self.tables.solo.setdefault(sub.model_id, {})[sub.sub_id] = sub
        for waiter in self.tables.waiters.get(sub.model_id, ()):
            if waiter.counts(sub) and not sub.settled(waiter.version):
                waiter.pending.add(sub.sub_id)
            elif waiter.need and (waiter.include_pull or sub.pushed) and not waiter.pending:
                waiter.wake()  # one more of the subscribers it waits to see (or a misfit): look again
        return old

    def remove(self, sub: Subscriber) -> DeliveryGroup | None:
        """Forget a subscription (indexes and the waits that waited for it); its emptied group, if any."""
        if self.tables.subs.get(sub.sub_id) is sub:
            del self.tables.subs[sub.sub_id]
        members = self.tables.by_model.get(sub.model_id)
        if members is not None and members.get(sub.sub_id) is sub:
            del members[sub.sub_id]
            if not members:
                del self.tables.by_model[sub.model_id]
        emptied = None
        key = sub.group
        group = self.tables.groups.get(key) if key is not None else None
        if group is not None and group.members.get(sub.sub_id) is sub:
            group.discard(sub)
            if not group.members:
                emptied = self.tables.groups.pop(key)  # type: ignore[arg-type]
                _discard(self.tables.model_groups, sub.model_id, key)  # type: ignore[arg-type]
        solo = self.tables.solo.get(sub.model_id)
        if solo is not None and solo.get(sub.sub_id) is sub:
            _discard(self.tables.solo, sub.model_id, sub.sub_id)
        for waiter in self.tables.waiters.get(sub.model_id, ()):
            waiter.let_go(sub.sub_id)
        return emptied

    def drop(self, sub: Subscriber, why: str) -> DeliveryGroup | None:
        """A subscriber that is gone for good: forget it and say so."""
        emptied = self.remove(sub)
        sub.state = "dead"
        logger.warning(
            "hub %r dropped subscriber %s of %r (at version %s): %s",
            self.tables.name,
            sub.sub_id,
            sub.model_id,
            sub.applied,
            why,
        )
        return emptied

    def settle(self, sub: Subscriber) -> None:
        """Tell the waits on ``sub``'s model that it holds (or failed) what they wait for."""
        for waiter in self.tables.waiters.get(sub.model_id, ()):
            if sub.sub_id in waiter.pending and sub.settled(waiter.version):
                if sub.applied is None or sub.applied < waiter.version:
                    waiter.failures = True  # it failed the version: the wait's answer names it
                waiter.let_go(sub.sub_id)

    def record(self, sub: Subscriber, report: ApplyReport) -> None:
        """What a subscriber said after it was handed a version (or on its own)."""
        sub.last_seen = time.monotonic()
        if report.lost is not None:
            self.versions.forget_version(
                sub.model_id, report.lost, f"subscriber {sub.sub_id} could not fetch it"
            )
        if report.reset:
            sub.applied, sub.sent, sub.failed, sub.modified_since = None, 0, 0, None
            sub.last_error = report.error_text()
            return
        applied = report.applied
        if applied is not None and not self.believable(sub, applied):
            self.settle(sub)
            return
        newer = applied is not None and (sub.applied is None or applied > sub.applied)
        if newer:
            sub.applied = applied
        # Only an apply of a newer version clears it; a report of an older held version is stale.
        if report.modified_since is not None and report.modified_since == sub.applied:
            sub.modified_since = report.modified_since
        elif newer:
            sub.modified_since = None
        # A report of an apply describes it (a skipped or deferred one does not): the report
        # of a prefetched swap may arrive after the delivery's reply for the same version.
        if report.describes_apply() and (newer or applied == sub.applied):
            sub.last_apply_time = time.time()
            sub.last_apply_s = report.apply_s
            sub.last_pause_s = report.pause_s
            sub.last_buckets_fetched = report.buckets_fetched
            sub.last_bytes_fetched = report.bytes_fetched
            sub.last_prefetched = report.prefetched
        if report.error is not None:
            sub.last_error = report.error_text()
            sub.error_version = report.failed
            sub.failed = max(sub.failed, report.failed or 0)
        elif applied is not None:
            sub.last_error = sub.error_version = None
        if report.receivers is not None:
            sub.receivers = list(report.receivers)
        if sub.state == "unreachable":
            sub.state = "live"
        self.settle(sub)

    def record_applied(
        self,
        sub: Subscriber,
        version: int,
        apply_s: float | None,
        pause_s: float | None,
        buckets: int | None,
        nbytes: int | None,
        now: float,
    ) -> None:
        """What :meth:`record` does with a plain report of an apply of ``version`` (a relay's compact row)."""
        self.record_applied_rows(
            sub.model_id, version, {sub.sub_id: sub}, [(sub.sub_id, apply_s, pause_s, buckets, nbytes)], now
        )

    def record_applied_rows(
        self,
        model_id: str,
        version: int,
        members: dict[str, Subscriber],
        rows: Iterable[AppliedRow],
        now: float,
        settled_too: tuple[str, ...] = (),
    ) -> list[float | None]:
        """:meth:`record_applied` for a node's rows of one model (a relay's reply): one pass of plain
        fields per subscriber, and each wait told once, of all of them together. Rows of
        subscriptions not among ``members`` (they left meanwhile) are skipped. The apply times recorded.
        ``settled_too``: a cohort's members recorded already (for the waits that name them).
        """
        mono = time.monotonic()
        model = self.tables.models.get(model_id)
        issued = version <= (model.issued if model is not None else 0)  # the same for every row
        subs = self.tables.subs
        settled: list[str] = list(settled_too)
        times: list[float | None] = []
        for sub_id, apply_s, pause_s, buckets, nbytes in rows:
            sub = members.get(sub_id)
            if sub is None or subs.get(sub_id) is not sub:
                continue
            sub.relay_pending = False
            sub.last_seen = mono
            if sub.applied is not None and version < sub.applied:
                continue
            if not (issued or self.believable(sub, version)):
                continue
            if version != sub.applied:
                sub.modified_since = None
            sub.applied = version
            sub.last_apply_time = now
            sub.last_apply_s, sub.last_pause_s = apply_s, pause_s
            sub.last_buckets_fetched, sub.last_bytes_fetched, sub.last_prefetched = buckets, nbytes, False
            sub.last_error = sub.error_version = None
            if sub.state == "unreachable":
                sub.state = "live"
            settled.append(sub_id)
            times.append(apply_s)
        for waiter in list(self.tables.waiters.get(model_id, ())):
            if waiter.version <= version and waiter.pending and not waiter.pending.isdisjoint(settled):
                waiter.let_go(*settled)
        return times

    def record_group_rows(
        self, model_id: str, version: int, group: DeliveryGroup, rows: tuple[AppliedRow, ...], now: float
    ) -> list[float | None]:
        """:meth:`record_applied_rows` for a relay's rows of one group: its cohort's members that all
        applied ``version`` are one write (:meth:`Cohort.applied_by_all`); a member without a row
        leaves the cohort first; the members outside it are recorded one by one, then join it
        if they are in step. The apply times recorded.
        """
        cohort = group.cohort
        model = self.tables.models.get(model_id)
        issued = version <= (model.issued if model is not None else 0)
        times: list[float | None] = [r[1] for r in rows]
        settled: tuple[str, ...] = ()
        members = cohort.members
        in_cohort = {r[0]: r for r in rows if r[0] in members} if members else {}
        if in_cohort:
            if issued and len(in_cohort) == len(members) and (cohort.applied or 0) <= version:
                cohort.applied_by_all(version, in_cohort, now, time.monotonic())
                settled = cohort.ids
            else:  # not all of it applied this version (or one of them reports on its own): one by one
                newer = issued and (cohort.applied or 0) < version
                if newer:  # those that did not apply it leave
                    going = [s for i, s in members.items() if i not in in_cohort]
                else:  # an older or repeated report: those that report leave, and are recorded alone
                    going = [members[i] for i in in_cohort]
                for sub in going:
                    cohort.leave(sub)
                if newer and members:
                    cohort.applied_by_all(version, in_cohort, now, time.monotonic())
                    settled = cohort.ids
                else:
                    in_cohort = {}
            if in_cohort:
                rows = () if len(in_cohort) == len(rows) else tuple(r for r in rows if r[0] not in in_cohort)
        outside = group.outside
        self.record_applied_rows(model_id, version, outside, rows, now, settled)
        for row in rows:
            joining = outside.get(row[0])
            if joining is not None and joining.applied == version:
                cohort.join(joining)
        return times

    def believable(self, sub: Subscriber, version: int) -> bool:
        """Whether ``sub`` may hold ``version``: this hub issued it. A report of a version it never
        issued (forged, or of another hub's numbering) is refused, logged, and shown as the
        subscriber's error; what it held before stands.
        """
        model = self.tables.models.get(sub.model_id)
        issued = model.issued if model is not None else 0
        if version <= issued:
            return True
        sub.last_error = (
            f"RaySyncError: reported holding version {version} of {sub.model_id!r}, which this hub never "
            f"issued (newest issued: {issued or None}); report ignored"
        )
        logger.error("hub %r: subscriber %s %s", self.tables.name, sub.sub_id, sub.last_error)
        return False

    def delivery_failed(self, sub: Subscriber, version: int, error: BaseException) -> None:
        """Handing ``version`` to ``sub`` raised (not a report of its own): record it as a failure."""
        sub.last_error = f"{type(error).__name__}: {str(error)[:500]}"
        sub.error_version = version
        sub.failed = max(sub.failed, version)
        self.settle(sub)

    def unreachable(self, sub: Subscriber, error: BaseException) -> None:
        """Restarting or not answering: it registers again when it is back."""
        sub.state = "unreachable"
        sub.sent = 0
        sub.last_error = f"{type(error).__name__}: {str(error)[:300]}"

    def stale(self, before: float) -> list[Subscriber]:
        """Subscribers not heard from since ``before`` (monotonic seconds)."""
        return [s for s in self.tables.subs.values() if s.last_seen < before]


def _discard(index: dict[str, dict[str, Any]], model_id: str, key: str) -> None:
    """Remove ``key`` from ``index[model_id]``, and the model's entry once empty."""
    entries = index.get(model_id)
    if entries is not None:
        entries.pop(key, None)
        if not entries:
            del index[model_id]

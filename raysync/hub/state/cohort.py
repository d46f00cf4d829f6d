"""A delivery group's cohort: its members in step, handed and recorded each version together.

A fleet's subscribers on one node apply the same versions at the same time: the hub would
otherwise write the same fields of each of them per version (a Python loop per subscriber,
the cost issue 46 measured). The members of a :class:`~raysync.hub.state.records.DeliveryGroup`
that hold the same version, were sent the same, and have nothing of their own to report (no
error, no delivery pending, live, one schema) form its cohort: those fields live once, on the
cohort, and every member reads them from there. A version handed to the whole cohort and
applied by all of it is one write of the cohort's fields (and one C-level update of their
apply rows), whatever its size.

A member leaves the cohort (its fields copied back to it first) as soon as anything of its own
is written: an error, a pending ack, a reset, another version. It joins again once it is back
in step (:meth:`Cohort.join`). So every reader sees exactly what it saw before cohorts existed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raysync._protocol import AppliedRow
from raysync.core.layout import Manifest

if TYPE_CHECKING:
    from raysync.hub.state.records import Subscriber, Waiter

__all__ = ["Cohort", "Kept", "OfRow", "Seen", "Shared"]


class Shared:
    """A subscriber field its cohort holds while it is a member (set: it leaves the cohort first)."""

    def __init__(self, default: Any) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.own = "_own_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default  # a dataclass field's default
        cohort = obj._cohort
        return getattr(cohort, self.name) if cohort is not None else obj.__dict__[self.own]

    def __set__(self, obj: Any, value: Any) -> None:
        if obj.__dict__.get("_cohort") is not None:
            obj.__dict__["_cohort"].leave(obj)
        obj.__dict__[self.own] = value


class OfRow(Shared):
    """A field of a member's last apply: read from the cohort's row of it (the relay's row)."""

    def __init__(self, default: Any, index: int) -> None:
        super().__init__(default)
        self.index = index

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default
        cohort = obj._cohort
        return cohort.rows[obj.sub_id][self.index] if cohort is not None else obj.__dict__[self.own]


class Kept(Shared):
    """A field every member of a cohort has at its in-step value: another value takes it out first."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self.default if obj is None else obj.__dict__[self.own]

    def __set__(self, obj: Any, value: Any) -> None:
        cohort = obj.__dict__.get("_cohort")
        if cohort is not None and value != self.default:
            cohort.leave(obj)
        obj.__dict__[self.own] = value


class Seen(Shared):
    """When a subscriber was last heard from: its own time, or its cohort's (all heard), the later."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default
        cohort = obj._cohort
        own = obj.__dict__[self.own]
        return own if cohort is None or cohort.seen < own else cohort.seen

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.own] = value


SHARED = ("applied", "sent", "last_apply_time")  # the cohort's own fields, one per member
ROW_FIELDS = ("last_apply_s", "last_pause_s", "last_buckets_fetched", "last_bytes_fetched")  # AppliedRow[1:]


@dataclass(eq=False)
class Cohort:
    """The members of one delivery group in step: what they hold, were sent, and applied when."""

    outside: dict[str, Subscriber]  # the group's members not in it (shared with the group)
    applied: int | None = None
    sent: int = 0
    last_apply_time: float | None = None
    seen: float = 0.0  # when every member was last heard from (a member's own may be later)
    schema_key: int | None = None
    members: dict[str, Subscriber] = field(default_factory=dict)
    rows: dict[str, AppliedRow] = field(default_factory=dict)  # each member's last apply
    # The waits for a version it does not hold yet: each counts the cohort once, not its members.
    waiters: set[Waiter] = field(default_factory=set)
    _ids: tuple[str, ...] | None = None

    @property
    def ids(self) -> tuple[str, ...]:
        """The members' ids (an announcement's list), kept until a member joins or leaves."""
        if self._ids is None:
            self._ids = tuple(self.members)
        return self._ids

    def holds(self, version: int) -> bool:
        """Whether its members hold ``version`` (or newer)."""
        return self.applied is not None and self.applied >= version

    def fits(self, manifest: Manifest, misfit: Callable[[Subscriber, Manifest], str | None]) -> bool:
        """Whether a version's layout fits its members (one schema: one member's check says)."""
        return misfit(next(iter(self.members.values())), manifest) is None

    def join(self, sub: Subscriber) -> bool:
        """Take ``sub`` in if it is in step (the first member sets the step); whether it joined."""
        if sub._cohort is not None:
            return sub._cohort is self
        if not (
            sub.state == "live"
            and sub.pushed
            and sub.reachable
            and not sub.relay_pending
            and sub.modified_since is None
            and sub.last_error is None
            and sub.misfit is None
            and not sub.last_prefetched
            and sub.applied is not None
        ):
            return False
        step = (sub.applied, sub.sent, sub.schema_key, sub.last_apply_time)
        if not self.members:
            self.applied, self.sent, self.schema_key, self.last_apply_time = step
            self.seen = sub.last_seen
        elif step != (self.applied, self.sent, self.schema_key, self.last_apply_time):
            return False
        own = sub.__dict__
        self.rows[sub.sub_id] = (
            sub.sub_id,
            own["_own_last_apply_s"],
            own["_own_last_pause_s"],
            own["_own_last_buckets_fetched"],
            own["_own_last_bytes_fetched"],
        )
        self.seen = min(self.seen, sub.last_seen)  # a member reads the later of its own and this
        self.members[sub.sub_id] = sub
        self.outside.pop(sub.sub_id, None)
        self._ids = None
        own["_cohort"] = self
        for waiter in self.waiters:  # it holds what the cohort holds: they count it with the cohort
            waiter.pending.discard(sub.sub_id)
        return True

    def leave(self, sub: Subscriber) -> None:
        """``sub`` goes its own way: its fields are copied back to it, then it is outside."""
        own = sub.__dict__
        own["_cohort"] = None
        for name in SHARED:
            own["_own_" + name] = getattr(self, name)
        row = self.rows.pop(sub.sub_id)
        for name, value in zip(ROW_FIELDS, row[1:], strict=True):
            own["_own_" + name] = value
        own["_own_last_seen"] = max(own["_own_last_seen"], self.seen)
        del self.members[sub.sub_id]
        self._ids = None
        self.outside[sub.sub_id] = sub
        for waiter in self.waiters:  # the waits that counted it with the cohort count it alone now
            if waiter.counts(sub) and not sub.settled(waiter.version):
                waiter.pending.add(sub.sub_id)
        if not self.members:
            for waiter in list(self.waiters):
                self.release(waiter)

    def watch(self, waiter: Waiter) -> None:
        """``waiter`` waits for a version the cohort lacks: it counts the cohort until it holds it."""
        self.waiters.add(waiter)
        waiter.cohorts.add(self)

    def release(self, waiter: Waiter) -> None:
        """``waiter`` no longer counts the cohort (it holds the version, or the wait ended)."""
        self.waiters.discard(waiter)
        waiter.cohorts.discard(self)
        if not waiter.cohorts and not waiter.pending:
            waiter.wake()

    def applied_by_all(self, version: int, rows: dict[str, AppliedRow], now: float, mono: float) -> None:
        """Every member applied ``version`` (``rows`` holds a row of each)."""
        self.applied = version
        self.last_apply_time = now
        self.seen = mono
        self.rows.update(rows)
        for waiter in [w for w in self.waiters if w.version <= version]:
            self.release(waiter)

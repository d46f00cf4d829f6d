"""A node's subscribers in step are handed and recorded together (issue 46); what each reports stays its."""

from __future__ import annotations

import pytest
import torch

from raysync._protocol import ApplyReport, Registration, SubscriberInfo
from raysync.core.layout import plan_layout
from raysync.hub import metrics
from raysync.hub.state import HubState, Subscriber, Waiter
from raysync.hub.state.records import DeliveryGroup

MANIFEST = plan_layout({"w": torch.zeros(4), "b": torch.zeros(2)})
TRAINER = {"writer_id": "job:01", "kind": "driver", "job_id": "01", "pid": 1, "host": "h"}
N = 50


def _fleet(n: int = N) -> tuple[HubState, DeliveryGroup, list[Subscriber]]:
    state = HubState("hub", 3, relay=True)
    subs = []
    for i in range(n):
        info = SubscriberInfo(class_name="Rollout", actor_id=f"a{i}", node_id="n1")
        sub, _, _ = state.roster.register(Registration(f"s{i}", "policy", True, info))
        subs.append(sub)
    return state, state.groups["policy@node:n1"], subs


def _hand(state: HubState, group: DeliveryGroup) -> tuple[int, bool, list[Subscriber]]:
    """What the hub's delivery does before its one message: mark each due member (or the cohort) sent."""
    newest, whole, due = state.versions.due_in_group("policy", group)
    assert newest is not None
    for sub in due:
        sub.sent = newest.version
    if whole:
        group.cohort.sent = newest.version
    return newest.version, whole, due


def _rows(subs: list[Subscriber], apply_s: float = 0.01) -> tuple[tuple, ...]:
    return tuple((s.sub_id, apply_s + i * 1e-4, 0.0, 2, 24) for i, s in enumerate(subs))


def _in_step(state: HubState, group: DeliveryGroup, subs: list[Subscriber]) -> int:
    """Push a version that every member applies (so they are its cohort); its number."""
    version = _push(state)
    _hand(state, group)
    state.roster.record_group_rows("policy", version, group, _rows(subs), now=1.0)
    assert len(group.cohort.members) == len(subs)
    return version


def _push(state: HubState) -> int:
    return state.versions.stamp("policy", MANIFEST, ["r"], TRAINER).version


def test_members_that_applied_the_same_version_form_the_cohort_and_are_then_handed_it_together() -> None:
    state, group, subs = _fleet()
    v1 = _push(state)
    version, whole, due = _hand(state, group)
    assert (version, whole, due) == (v1, False, subs)  # nobody holds a version yet: one by one
    state.roster.record_group_rows("policy", v1, group, _rows(subs), now=100.0)
    assert len(group.cohort.members) == N and not group.outside  # all in step now

    v2 = _push(state)
    version, whole, due = _hand(state, group)
    assert (version, whole, due) == (v2, True, [])  # the whole cohort, no member one by one
    assert all(s.sent == v2 and s.applied == v1 for s in subs)  # each reads the cohort's fields
    waiter = Waiter(v2, {s.sub_id for s in subs})
    state.waits.add_waiter("policy", waiter)
    state.roster.record_group_rows("policy", v2, group, _rows(subs, 0.5), now=200.0)
    assert waiter.woken and not waiter.pending
    # each member's own row is kept: its apply time, not the cohort's
    assert [s.last_apply_s for s in subs[:3]] == [0.5, 0.5001, 0.5002]
    assert all((s.applied, s.last_apply_time, s.last_bytes_fetched) == (v2, 200.0, 24) for s in subs)
    assert not state.versions.due_in_group("policy", group)[1]  # nothing more to hand


def test_a_member_that_fails_leaves_the_cohort_and_is_named_while_the_others_go_on() -> None:
    state, group, subs = _fleet()
    v1 = _in_step(state, group, subs)
    v2 = _push(state)
    _hand(state, group)
    bad = subs[7]
    state.roster.delivery_failed(bad, v2, RuntimeError("out of memory"))  # its ack said so
    state.roster.record_group_rows("policy", v2, group, _rows([s for s in subs if s is not bad]), now=2.0)
    assert bad not in group.cohort.members.values() and group.outside == {bad.sub_id: bad}
    assert (bad.applied, bad.sent, bad.failed) == (v1, v2, v2) and "out of memory" in (bad.last_error or "")
    assert all(s.applied == v2 for s in subs if s is not bad)
    rows = {r["subscriber"]: r for r in state.waits.status()["subscribers"]}
    assert len(rows) == N and rows[bad.sub_id]["applied"] == v1 and rows[subs[0].sub_id]["applied"] == v2
    laggards, failures = state.waits.pending("policy", v2, False)
    assert [f.subscriber for f in failures] == [bad.sub_id] and not laggards

    v3 = _push(state)  # the cohort and the one outside it are handed v3; both apply it
    _, whole, due = _hand(state, group)
    assert whole and due == [bad]
    state.roster.record(bad, ApplyReport(applied=v3))  # its own report clears its error ...
    state.roster.record_group_rows("policy", v3, group, _rows(subs), now=3.0)
    assert all(s.applied == v3 for s in subs) and bad.last_error is None
    assert len(group.cohort.members) == N  # ... and it is back in step with the others


def test_members_without_a_row_leave_the_cohort_and_are_due_again() -> None:
    state, group, subs = _fleet()
    v1 = _in_step(state, group, subs)
    v2 = _push(state)
    _hand(state, group)
    slow = subs[:5]
    for s in slow:
        s.relay_pending = True  # the relay answers before they applied: their acks come later
    state.roster.record_group_rows("policy", v2, group, _rows(subs[5:]), now=2.0)
    assert all(s.applied == v1 and s.relay_pending for s in slow)
    assert all(s.applied == v2 for s in subs[5:]) and len(group.cohort.members) == N - 5
    for s in slow:
        s.relay_pending = False
    state.roster.record_group_rows("policy", v2, group, _rows(slow), now=2.5)  # their late acks
    assert all(s.applied == v2 and s.last_apply_time == 2.5 for s in slow)
    _push(state)
    _, whole, due = _hand(state, group)
    assert whole and due == slow  # one message still names them all


def test_a_member_removed_or_registered_again_leaves_no_trace_in_the_cohort() -> None:
    state, group, subs = _fleet()
    v1 = _in_step(state, group, subs)
    state.roster.drop(subs[0], "actor died")
    assert subs[0].sub_id not in group.members and subs[0].sub_id not in group.cohort.ids
    assert subs[0].applied == v1 and subs[0].state == "dead"  # what it held when it went
    info = SubscriberInfo(class_name="Rollout", actor_id="a1", node_id="n1")
    again, replaced, _ = state.roster.register(Registration("s1", "policy", True, info))
    assert replaced is subs[1] and "s1" not in group.cohort.members and group.outside["s1"] is again
    assert len(group.cohort.members) == N - 2


def test_a_wait_counts_a_cohort_once_and_each_member_that_leaves_it_on_its_own() -> None:
    state, group, subs = _fleet()
    _in_step(state, group, subs)
    v2 = _push(state)
    _hand(state, group)
    cohorts: list = []
    behind, failed = state.waits.unsettled("policy", v2, False, cohorts)
    assert cohorts == [group.cohort] and not behind and not failed  # one entry for 50 subscribers
    laggards, _ = state.waits.pending("policy", v2, False)
    assert len(laggards) == N  # a wait's answer still names every one of them
    waiter = Waiter(v2, set())
    state.waits.add_waiter("policy", waiter, cohorts)
    bad, slow = subs[3], subs[4]
    state.roster.delivery_failed(bad, v2, RuntimeError("no"))  # leaves the cohort, settles: failed
    slow.relay_pending = True  # leaves the cohort: the wait now waits for it by name
    assert waiter.pending == {slow.sub_id} and waiter.failures and not waiter.woken
    state.roster.record_group_rows("policy", v2, group, _rows(subs[5:] + subs[:3]), now=2.0)
    assert not waiter.woken and waiter.pending == {slow.sub_id} and not waiter.cohorts
    slow.relay_pending = False
    state.roster.record_group_rows("policy", v2, group, _rows([slow]), now=2.5)
    assert waiter.woken and not waiter.pending
    state.waits.remove_waiter("policy", waiter)
    assert not group.cohort.waiters


def test_the_gauges_count_a_cohort_and_give_its_members_lag_series_only_when_it_lags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.unit.test_metrics import _Recorder

    fake = metrics._Metrics(*(_Recorder() for _ in range(8)))
    monkeypatch.setattr(metrics, "_get", lambda: fake)
    state, group, subs = _fleet()
    v1 = _in_step(state, group, subs)
    state.roster.delivery_failed(subs[0], v1 + 1, RuntimeError("no"))  # one outside it, failing
    gauges = metrics.HubGauges("h")
    gauges.changed(state.models, state.subs)
    assert (fake.subscribers.get(state="live"), fake.subscribers.get(state="failing")) == (N - 1, 1)
    assert fake.subscriber_lag.get(subscriber=subs[5].sub_id) == 0  # a small fleet: a series each
    for _ in range(3):
        _push(state)  # the cohort now lags by 3 versions
    gauges.changed(state.models, state.subs)
    assert fake.subscriber_lag.get(subscriber=subs[5].sub_id) == 3
    assert fake.subscribers.get(state="live") == N - 1


def test_a_fleets_cohort_in_step_costs_the_gauges_no_series(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.test_metrics import _Recorder

    fake = metrics._Metrics(*(_Recorder() for _ in range(8)))
    monkeypatch.setattr(metrics, "_get", lambda: fake)
    n = metrics.LAG_SERIES_MAX + 100
    state, group, subs = _fleet(n)
    _in_step(state, group, subs)
    metrics.HubGauges("h").changed(state.models, state.subs)
    assert fake.subscribers.get(state="live") == n and fake.subscriber_lag.get(model_id="policy") is None
    for _ in range(2):
        _push(state)  # two behind: a laggard fleet, each member named
    metrics.HubGauges("h").changed(state.models, state.subs)
    assert fake.subscriber_lag.get(subscriber=subs[-1].sub_id) == 2

"""The hub's rules as plain Python: versions, keep, leases, subscribers, waits (no Ray)."""

from __future__ import annotations

import pytest
import torch

from raysync._protocol import ApplyReport, Registration, SubscriberInfo
from raysync.core.layout import plan_layout
from raysync.errors import ApplyError, StaleWriterError, UnknownModelError, WeightMismatchError
from raysync.hub.state import HubState, Model, Subscriber, Waiter

MANIFEST = plan_layout({"w": torch.zeros(4), "b": torch.zeros(2)})
TRAINER = {"writer_id": "job:01", "kind": "driver", "job_id": "01", "pid": 1, "host": "h"}


def _state(keep: int = 2) -> HubState:
    return HubState("hub", keep)


def _join(
    state: HubState, name: str, *, mode: str = "push", applied: int | None = None, schema: object = None
) -> Subscriber:
    reg = Registration(
        f"{name}:policy", "policy", True, SubscriberInfo(mode=mode, class_name=name), schema, applied
    )
    sub, _, _ = state.roster.register(reg)
    return sub


def test_versions_are_stamped_in_order_and_only_keep_are_kept() -> None:
    state = _state(keep=2)
    versions = [state.versions.stamp("policy", MANIFEST, [f"ref{i}"], TRAINER).version for i in range(1, 5)]
    assert versions == [1, 2, 3, 4] and state.versions.latest("policy") == 4
    assert sorted(state.models["policy"].versions) == [3, 4]
    assert state.versions.get("policy").version == 4
    assert state.versions.get("policy", newer_than=4) is None
    with pytest.raises(UnknownModelError, match="not kept"):
        state.versions.get("policy", 1)
    with pytest.raises(UnknownModelError, match="no version of model 'other'"):
        state.versions.get("other")


def test_keep_is_raised_never_lowered() -> None:
    state = _state(keep=3)
    for i in range(4):
        state.versions.stamp("policy", MANIFEST, [i], TRAINER)
    assert state.versions.raise_keep(2) is False and state.keep == 3
    assert state.versions.raise_keep(None) is False
    assert state.versions.raise_keep(5) is True and state.keep == 5
    assert sorted(state.models["policy"].versions) == [2, 3, 4]


def test_one_writer_per_model_until_takeover_or_hand_over() -> None:
    state = _state()
    other = {**TRAINER, "writer_id": "actor:x", "kind": "actor", "actor_id": "x"}
    assert state.leases.writer_to_check("policy", TRAINER, False) is None  # first writer takes the lease
    assert state.leases.writer_to_check("policy", TRAINER, False) is None  # and keeps it
    current = state.leases.writer_to_check("policy", other, False)
    assert current is not None and current["writer_id"] == "job:01"  # liveness decides
    assert "driver of job 01" in str(state.leases.refuse_writer("policy", current, other))
    state.leases.hand_over("policy", current, other)  # the driver was gone
    assert state.models["policy"].writer["writer_id"] == "actor:x"
    assert state.leases.writer_to_check("policy", TRAINER, True) is None  # takeover
    assert state.models["policy"].writer["writer_id"] == "job:01"


def test_a_new_subscriber_starts_from_the_newest_version() -> None:
    state = _state()
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    reg = Registration("a:policy", "policy", True, SubscriberInfo(class_name="A"))
    sub, replaced, newest = state.roster.register(reg)
    assert replaced is None and newest is not None and newest.version == 1 and sub.sent == 1
    _, replaced, newest = state.roster.register(
        Registration("a:policy", "policy", True, SubscriberInfo(), applied=1)
    )
    assert replaced is sub and newest is None  # re-registration holding the newest: nothing to do


def test_reports_move_applied_forward_only_and_record_failures() -> None:
    state = _state()
    state.versions.grant("policy", 3, TRAINER)  # numbers 1..3 issued to the writer
    sub = _join(state, "a")
    state.roster.record(sub, ApplyReport(applied=2, apply_s=0.5))
    assert sub.applied == 2 and sub.last_apply_s == 0.5
    state.roster.record(sub, ApplyReport(applied=1))  # an old report never takes it back
    assert sub.applied == 2
    state.roster.record(sub, ApplyReport(applied=2, skipped=1, apply_s=9.0))  # skipped: no timings
    state.roster.record(sub, ApplyReport(applied=2, deferred=3, apply_s=9.0))  # deferred: not applied yet
    assert sub.last_apply_s == 0.5 and sub.applied == 2
    state.roster.record(sub, ApplyReport(applied=2, failed=3, error=ApplyError("boom")))
    assert sub.failed == 3 and sub.last_error == "ApplyError: boom" and sub.applied == 2
    state.roster.record(sub, ApplyReport(reset=True, error=ApplyError("re-pointed")))
    assert sub.applied is None and sub.failed == 0 and "re-pointed" in sub.last_error


def test_a_report_of_lost_bytes_stops_offering_that_version() -> None:
    state = _state()
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    sub = _join(state, "a")
    state.roster.record(sub, ApplyReport(failed=1, lost=1, error=ApplyError("OwnerDiedError")))
    assert state.models["policy"].versions == {}
    with pytest.raises(UnknownModelError):
        state.versions.get("policy")


def test_waits_count_push_subscribers_unless_pull_is_asked_for() -> None:
    state = _state()
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    pusher, puller, failing = _join(state, "push"), _join(state, "pull", mode="pull"), _join(state, "bad")
    state.roster.record(failing, ApplyReport(failed=1, error=ApplyError("no")))
    laggards, failures = state.waits.pending("policy", 1, include_pull=False)
    assert [r.subscriber for r in laggards] == ["push:policy"]
    assert [r.subscriber for r in failures] == ["bad:policy"]
    laggards, _ = state.waits.pending("policy", 1, include_pull=True)
    assert sorted(r.subscriber for r in laggards) == ["pull:policy", "push:policy"]
    state.roster.record(pusher, ApplyReport(applied=1))
    assert state.waits.pending("policy", 1, include_pull=False)[0] == []
    assert puller.applied is None


def test_a_waiter_wakes_when_its_last_subscriber_settles_or_goes() -> None:
    state = _state()
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    a, b = _join(state, "a"), _join(state, "b")
    waiter = Waiter(1, {a.sub_id, b.sub_id})
    state.waits.add_waiter("policy", waiter)
    state.roster.record(a, ApplyReport(applied=1))
    assert waiter.pending == {b.sub_id} and not waiter.woken
    late = _join(state, "late")  # a subscriber that joins while the wait runs is waited for
    assert late.sub_id in waiter.pending
    state.roster.drop(b, "actor died")
    state.roster.record(late, ApplyReport(failed=1, error=ApplyError("bad")))
    assert waiter.woken and waiter.pending == set()
    state.waits.remove_waiter("policy", waiter)
    assert state.waiters == {}


def test_after_a_restart_known_subscribers_are_waited_for_until_they_register() -> None:
    state = _state()
    state.models["policy"] = Model(latest=7)
    # a record an older raysync wrote carries a field since dropped ("batch"): it is restored all the same
    row = {**SubscriberInfo(class_name="A").row(), "batch": False}
    sub = Subscriber.restored("a:policy", {"model_id": "policy", "info": row})
    assert sub.info.class_name == "A"
    state.roster.add(sub)
    laggards, _ = state.waits.pending("policy", 7, include_pull=False)
    assert [(r.subscriber, r.state) for r in laggards] == [("a:policy", "restoring")]
    assert not state.waits.kept_from("policy", 7)  # the restart lost version 7: its writer may offer it
    assert state.versions.offer_again("policy", 7, MANIFEST, ["r7"], TRAINER)
    assert state.waits.kept_from("policy", 7)
    assert not state.versions.offer_again("policy", 7, MANIFEST, ["r7"], TRAINER)  # kept already
    assert not state.versions.offer_again("policy", 6, MANIFEST, ["r6"], TRAINER)  # not the newest


def test_mismatches_are_found_once_per_schema() -> None:
    state = _state()
    good = {"w": ((4,), "float32"), "b": ((2,), "float32")}
    bad = {"w": ((5,), "float32"), "b": ((2,), "float32")}
    for name, schema in (("a", good), ("b", bad), ("c", bad)):
        _join(state, name, schema=schema)
    found = state.layouts.mismatches("policy", MANIFEST)
    assert len(found) == 1
    error, subs = found[0]
    assert isinstance(error, WeightMismatchError) and sorted(s.sub_id for s in subs) == [
        "b:policy",
        "c:policy",
    ]


def test_delivery_goes_to_push_subscribers_that_lack_the_newest() -> None:
    state = _state()
    pusher, puller = _join(state, "push"), _join(state, "pull", mode="pull")
    assert state.versions.due(pusher) is None  # nothing pushed yet
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    assert state.versions.due(pusher).version == 1
    pusher.sent = 1
    assert state.versions.due(pusher) is None  # in flight
    state.versions.stamp("policy", MANIFEST, ["r2"], TRAINER)
    assert state.versions.due(pusher).version == 2
    rows = {r["subscriber"]: r for r in state.waits.status()["subscribers"]}
    assert rows["pull:policy"]["lag"] == 2 and rows["pull:policy"]["mode"] == "pull"
    assert puller.applied is None


def test_the_hub_process_starts_without_torch() -> None:
    """A hub restart only loads Ray and the hub's rules (about a second on 2 cores, torch is ~3 s)."""
    import subprocess
    import sys

    probe = "import sys, raysync.hub.actor, raysync; print(sorted(m for m in ('torch',) if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch" not in done.stdout, done.stdout


# ---------------------------------------------------------------------- writer-stamped versions


def test_grants_are_disjoint_blocks_and_the_hub_stamps_after_every_grant() -> None:
    state = _state()
    assert state.leases.writer_to_check("policy", TRAINER, False) is None
    a = state.versions.grant("policy", 10, TRAINER)
    b = state.versions.grant("policy", 10, TRAINER)  # the same process's next block
    assert (a.first, a.last, b.first, b.last) == (1, 10, 11, 20) and a.epoch == b.epoch
    # A hub-stamped version never takes a number that was granted, used or not.
    assert state.versions.stamp("policy", MANIFEST, ["r"], TRAINER).version == 21
    assert state.versions.grant("policy", 5, TRAINER).first == 22


def test_accept_keeps_the_writers_stamp_and_older_ones_never_become_newest() -> None:
    state = _state(keep=3)
    state.leases.writer_to_check("policy", TRAINER, False)
    grant = state.versions.grant("policy", 10, TRAINER)
    state.versions.accept("policy", MANIFEST, ["r3"], TRAINER, 3, grant.epoch)
    state.versions.accept("policy", MANIFEST, ["r2"], TRAINER, 2, grant.epoch)  # arrived out of order
    assert state.versions.latest("policy") == 3 and sorted(state.models["policy"].versions) == [2, 3]
    again = state.versions.accept("policy", MANIFEST, ["other"], TRAINER, 3, grant.epoch)  # offered again
    assert again.refs == ["r3"] and state.models["policy"].pushes == 2  # kept once
    with pytest.raises(StaleWriterError, match="never granted"):
        state.versions.accept("policy", MANIFEST, ["r"], TRAINER, 11, grant.epoch)


def test_a_lease_that_passed_on_fences_the_old_writers_stamps() -> None:
    state = _state()
    other = {**TRAINER, "writer_id": "actor:x", "kind": "actor", "actor_id": "x", "pid": 2}
    state.leases.writer_to_check("policy", TRAINER, False)
    old = state.versions.grant("policy", 10, TRAINER)
    state.versions.accept("policy", MANIFEST, ["r1"], TRAINER, 1, old.epoch)
    assert state.leases.writer_to_check("policy", other, True) is None  # takeover
    new = state.versions.grant("policy", 10, other)
    assert new.epoch > old.epoch and new.first == 11  # past the old block, used or not
    with pytest.raises(StaleWriterError, match=r"lost its writer lease \(epoch 1\), so its version 2"):
        state.versions.accept("policy", MANIFEST, ["r2"], TRAINER, 2, old.epoch)
    state.versions.accept("policy", MANIFEST, ["r11"], other, 11, new.epoch)
    assert state.versions.latest("policy") == 11
    # A writer found dead hands the lease over: a new epoch again.
    current = state.leases.writer_to_check("policy", TRAINER, False)
    assert current is not None
    state.leases.hand_over("policy", current, TRAINER)
    assert state.versions.grant("policy", 10, TRAINER).epoch == new.epoch + 1


def test_a_restarted_hub_continues_from_the_persisted_block() -> None:
    """What the GCS holds after a restart: the newest seen (maybe stale), the block, the epoch."""
    state = _state()
    state.models["policy"] = Model(latest=4, reserved=10, epoch=3, writer=dict(TRAINER))
    # The writer still stamps from its block: 7 is newer than what the hub knew.
    state.versions.accept("policy", MANIFEST, ["r7"], TRAINER, 7, 3)
    assert state.versions.latest("policy") == 7
    state.waits.check_waitable("policy", 9)  # granted: a wait may wait for it
    with pytest.raises(UnknownModelError, match="never pushed"):
        state.waits.check_waitable("policy", 11)
    assert state.versions.grant("policy", 10, TRAINER).first == 11
    # The writer offers its newest again when it finds it missing; older ones are not taken.
    restarted = _state()
    restarted.models["policy"] = Model(latest=4, reserved=10, epoch=3, writer=dict(TRAINER))
    assert restarted.versions.offer_again("policy", 3, MANIFEST, ["r3"], TRAINER) is False
    assert restarted.versions.offer_again("policy", 6, MANIFEST, ["r6"], TRAINER) is True
    assert restarted.versions.latest("policy") == 6
    assert restarted.versions.offer_again("policy", 11, MANIFEST, ["r11"], TRAINER) is False  # never issued


def test_another_process_of_the_same_writer_fences_the_first() -> None:
    """A restarted trainer actor, or another task of a job: the same writer, a new process."""
    state = _state()
    first = {**TRAINER, "session": "a"}
    second = {**TRAINER, "session": "b", "pid": 2}
    state.leases.writer_to_check("policy", first, False)
    a = state.versions.grant("policy", 10, first)
    assert state.versions.grant("policy", 10, first).epoch == a.epoch  # its own next block: same epoch
    state.versions.accept("policy", MANIFEST, ["r1"], first, 1, a.epoch)
    assert state.leases.writer_to_check("policy", second, False) is None  # no liveness check: same writer
    b = state.versions.grant("policy", 10, second)
    assert b.epoch == a.epoch + 1 and b.first == 21
    assert state.models["policy"].writer["pid"] == 2  # status names the process that writes now
    with pytest.raises(StaleWriterError, match=r"another process of this writer .*stamped version 2"):
        state.versions.accept("policy", MANIFEST, ["r2"], first, 2, a.epoch)
    state.versions.accept("policy", MANIFEST, ["r21"], second, 21, b.epoch)
    assert state.versions.latest("policy") == 21


def _on_node(
    state: HubState, name: str, node: str | None, *, mode: str = "push", reachable: bool = True
) -> Subscriber:
    info = SubscriberInfo(mode=mode, class_name=name, actor_id=name, node_id=node)
    sub, _, _ = state.roster.register(Registration(f"{name}:policy", "policy", reachable, info))
    return sub


def test_with_relays_push_subscribers_are_grouped_by_node() -> None:
    state = HubState("hub", 2, relay=True)
    a, b = _on_node(state, "a", "n1"), _on_node(state, "b", "n1")
    c = _on_node(state, "c", "n2")
    puller = _on_node(state, "p", "n1", mode="pull")
    nowhere = _on_node(state, "x", None)  # a plain process: no node to relay through
    assert a.group == b.group == "policy@node:n1" and c.group == "policy@node:n2"
    assert puller.group is None and nowhere.group is None
    assert {k: sorted(g.members) for k, g in state.groups.items()} == {
        "policy@node:n1": ["a:policy", "b:policy"],
        "policy@node:n2": ["c:policy"],
    }
    assert state.groups["policy@node:n1"].node_id == "n1"
    assert state.waits.status()["delivery"] == {"relay": True, "calls": 0, "nodes": ["n1", "n2"]}
    state.roster.remove(c)
    assert "policy@node:n2" not in state.groups


def test_without_relays_each_subscriber_is_its_own_delivery() -> None:
    state = HubState("hub", 2, relay=False)
    assert _on_node(state, "a", "n1").group is None and not state.groups


def test_a_node_group_delivers_the_newest_to_members_that_lack_it_and_can_be_called() -> None:
    state = HubState("hub", 2, relay=True)
    a, b = _on_node(state, "a", "n1"), _on_node(state, "b", "n1")
    restoring = _on_node(state, "r", "n1", reachable=False)  # one the hub cannot call (restored, a process)
    group = state.groups["policy@node:n1"]
    group.known.update({"a:policy", "b:policy"})
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    newest, whole, due = state.versions.due_in_group("policy", group)
    assert newest is not None and newest.version == 1 and due == [a, b]  # not the one it cannot call
    assert not whole  # no member holds a version yet: none is in the group's cohort
    a.sent = 1
    assert state.versions.due_in_group("policy", group)[2] == [b]
    _on_node(state, "b", "n1")  # registers again (a restarted actor): the relay must be told of it again
    assert group.known == {"a:policy"} and not restoring.reachable


def test_a_relay_reply_carries_plain_applies_as_rows_and_the_hub_records_them_forward_only() -> None:
    from raysync._protocol import RelayAck
    from raysync.hub.relay import compact

    failed = RelayAck("b:policy", ApplyReport(applied=1, failed=2, error=ApplyError("no")))
    reply = compact(
        2,
        [
            RelayAck("a:policy", ApplyReport(applied=2, apply_s=0.5, pause_s=0.1, buckets_fetched=1)),
            failed,
            RelayAck("c:policy", ApplyReport(applied=2, skipped=2)),  # held it already: not an apply
            RelayAck("d:policy", None, "died"),
        ],
    )
    assert reply.applied == (("a:policy", 0.5, 0.1, 1, None),)
    assert [a.sub_id for a in reply.acks] == ["b:policy", "c:policy", "d:policy"]
    state = HubState("hub", 2, relay=True)
    state.versions.grant("policy", 2, TRAINER)
    a = _on_node(state, "a", "n1")
    state.roster.record_applied(a, 2, 0.5, 0.1, 1, None, now=1.0)
    assert (a.applied, a.last_apply_s, a.last_apply_time) == (2, 0.5, 1.0)
    state.roster.record_applied(a, 1, 0.2, 0.0, 1, None, now=2.0)  # an older version never moves it back
    assert (a.applied, a.last_apply_s) == (2, 0.5)


def test_the_hub_believes_no_version_it_never_issued() -> None:
    """A report (or a registration) of a version above every number the hub issued is refused:
    shown as the subscriber's error, its applied version unchanged, lag never below zero."""
    state = _state()
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    state.versions.stamp("policy", MANIFEST, ["r2"], TRAINER)
    sub = _join(state, "a")
    state.roster.record(sub, ApplyReport(applied=2))
    waiter = Waiter(3, {sub.sub_id})
    state.waits.add_waiter("policy", waiter)
    state.roster.record(sub, ApplyReport(applied=1_000_000_000))  # forged (say, through a doorbell)
    state.roster.record_applied(sub, 1_000_000_000, 0.01, 0.0, 1, 8, 0.0)  # the relay's compact row
    assert sub.applied == 2 and "never issued" in (sub.last_error or "")
    assert not waiter.woken and sub.sub_id in waiter.pending  # a wait for 3 is not fooled
    row = state.waits.status()["subscribers"][0]
    assert row["applied"] == 2 and row["lag"] == 0 and "1000000000" in row["last_error"]
    state.versions.stamp("policy", MANIFEST, ["r3"], TRAINER)
    state.roster.record(sub, ApplyReport(applied=3))  # real versions still count, and clear the error
    assert sub.applied == 3 and sub.last_error is None and waiter.woken
    ghost = _join(state, "b", applied=10**9)  # registers claiming a version never issued
    assert ghost.applied is None and "never issued" in (ghost.last_error or "")
    assert all(r["lag"] >= 0 for r in state.waits.status()["subscribers"])


def test_a_subscriber_modified_locally_shows_until_it_applies_a_newer_version() -> None:
    """``modified_since``: set by a subscriber's report (a heartbeat's, or an apply's), cleared only
    by an apply of a newer version or a reset; a late report about an older version changes nothing."""
    state = _state()
    state.versions.grant("policy", 3, TRAINER)
    sub = _join(state, "a")
    state.roster.record(sub, ApplyReport(applied=1, apply_s=0.1))
    state.roster.record(sub, ApplyReport(modified_since=1))  # the heartbeat that saw it
    assert state.waits.status()["subscribers"][0]["modified_since"] == 1
    assert (sub.applied, sub.last_apply_s) == (1, 0.1)  # the heartbeat's report is no apply
    state.roster.record(sub, ApplyReport(applied=1, skipped=1))  # a redelivery of 1 does not undo it
    state.roster.record(sub, ApplyReport(applied=1, apply_s=0.2))  # a late reply of the apply of 1 neither
    assert sub.modified_since == 1
    state.roster.record(sub, ApplyReport(applied=2, apply_s=0.1))
    assert sub.modified_since is None
    state.roster.record(sub, ApplyReport(modified_since=1))  # a late heartbeat's, about 1
    assert sub.modified_since is None
    state.roster.record(sub, ApplyReport(applied=3, modified_since=3))  # changed again right after the apply
    assert state.waits.status()["subscribers"][0]["modified_since"] == 3
    state.roster.record(sub, ApplyReport(reset=True, error=ApplyError("re-pointed")))
    assert sub.modified_since is None
    state.roster.record(sub, ApplyReport(applied=2, modified_since=2))
    state.roster.record_applied(sub, 3, 0.1, 0.0, 1, None, now=1.0)  # a relay's compact row of an apply of 3
    assert sub.modified_since is None

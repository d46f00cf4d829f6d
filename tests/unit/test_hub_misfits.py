"""A subscriber whose model does not fit is its own error: pushes are checked against the
model id's established layout, not against whoever registered (hub state, no Ray)."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from raysync._protocol import ApplyReport, Registration, SubscriberInfo
from raysync.client.writer_lease import Refusal
from raysync.core.layout import plan_layout
from raysync.errors import WeightMismatchError
from raysync.hub import metrics
from raysync.hub.state import HubState, Model, Subscriber, Waiter
from raysync.ops import cli
from tests.unit.test_metrics import _Recorder

MANIFEST = plan_layout({"w": torch.zeros(4), "b": torch.zeros(2)})
GOOD = {"w": ((4,), "float32"), "b": ((2,), "float32")}
BAD = {"w": ((3,), "float32"), "b": ((2,), "float32")}  # the fleet's w is (4,)
TRAINER = {"writer_id": "job:01", "kind": "driver", "job_id": "01", "pid": 1, "host": "h"}


def _join(state: HubState, name: str, schema: object, *, mode: str = "push") -> Subscriber:
    reg = Registration(f"{name}:policy", "policy", True, SubscriberInfo(mode=mode, class_name=name), schema)
    sub, _, _ = state.roster.register(reg)
    return sub


def test_a_misfit_registrant_neither_refuses_nor_changes_the_established_layout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = HubState("hub", 2)
    good = _join(state, "good", GOOD)
    bad = _join(state, "bad", BAD)
    # The first version fits one live subscriber: not refused; it establishes the layout.
    assert (
        state.layouts.refusal("policy", MANIFEST) is None
        and state.layouts.first_mismatches("policy", MANIFEST) == []
    )
    with caplog.at_level(logging.WARNING, logger="raysync.hub.state.layouts"):
        state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
        state.versions.stamp("policy", MANIFEST, ["r2"], TRAINER)
    assert good.misfit is None
    assert bad.misfit is not None and "shape mismatch w: pushed (4,), model (3,)" in bad.misfit
    assert len([r for r in caplog.records if "bad:policy" in r.getMessage()]) == 1  # once, not per push
    assert (
        state.versions.due(good) is not None and state.versions.due(bad) is None
    )  # not handed versions it cannot apply
    # A later registrant of another model changes nothing either: pushes of the layout go on.
    late = _join(state, "late", BAD)
    assert late.misfit is not None and state.layouts.refusal("policy", MANIFEST) is None
    row = {r["subscriber"]: r for r in state.waits.status()["subscribers"]}["bad:policy"]
    assert row["state"] == "live" and "shape mismatch w" in row["misfit"]


def test_a_push_that_does_not_fit_the_established_layout_is_refused_naming_each_tensor() -> None:
    state = HubState("hub", 2)
    assert state.layouts.refusal("policy", plan_layout({"x": torch.zeros(1)})) is None  # nothing established
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)  # no subscriber at all
    other = plan_layout({"w": torch.zeros(5), "b": torch.zeros(2, dtype=torch.float64), "x": torch.zeros(1)})
    error = state.layouts.refusal("policy", other)
    assert error is not None and error.unexpected == ["x"]
    assert set(error.shape_mismatch) == {"w"} and set(error.dtype_mismatch) == {"b"}
    assert "no version was published" in str(error) and "'policy'" in str(error)
    missing = state.layouts.refusal("policy", plan_layout({"w": torch.zeros(4)}))
    assert missing is not None and missing.missing == ["b"]
    same = plan_layout({"w": torch.zeros(4), "b": torch.zeros(2)}, bucket_bytes=8)  # another bucket plan
    assert same.layout_hash != MANIFEST.layout_hash and state.layouts.refusal("policy", same) is None


def test_a_first_version_is_refused_only_when_it_fits_none_of_the_subscribers() -> None:
    state = HubState("hub", 2)
    _join(state, "bad", BAD)
    _join(state, "worse", {"z": ((1,), "float32")})
    found = state.layouts.first_mismatches("policy", MANIFEST)
    assert sorted(s.sub_id for _, subs in found for s in subs) == ["bad:policy", "worse:policy"]
    _join(state, "any", None)  # a subscriber that takes any layout (no schema): it fits
    assert state.layouts.first_mismatches("policy", MANIFEST) == []


def test_waits_do_not_wait_for_a_misfit_nor_count_it() -> None:
    state = HubState("hub", 2)
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    good = _join(state, "good", GOOD)
    waiter = Waiter(1, {good.sub_id}, need=2)
    state.waits.add_waiter("policy", waiter)
    bad = _join(state, "bad", BAD)
    assert bad.sub_id not in waiter.pending
    assert state.waits.pending("policy", 1) == ([good.laggard()], [])  # no laggard, no failure
    assert state.waits.counted("policy") == 1
    assert [(r.subscriber, r.error[:20]) for r in state.waits.misfits("policy")] == [
        ("bad:policy", "WeightMismatchError:")
    ]
    state.roster.record(good, ApplyReport(applied=1))
    assert waiter.woken and state.waits.pending("policy", 1) == ([], [])


def test_a_misfit_that_registers_again_with_a_fitting_model_is_delivered_again() -> None:
    state = HubState("hub", 2)
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    assert _join(state, "a", BAD).misfit is not None
    sub, _, newest = state.roster.register(Registration("a:policy", "policy", True, SubscriberInfo(), GOOD))
    assert sub.misfit is None and newest is not None and newest.version == 1
    assert state.waits.status()["subscribers"][0]["misfit"] is None and state.waits.counted("policy") == 1


def test_a_new_writer_establishes_its_own_layout() -> None:
    state = HubState("hub", 2)
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    new = {**TRAINER, "writer_id": "job:02", "job_id": "02"}
    other = plan_layout({"v": torch.zeros(3)})
    assert state.layouts.refusal("policy", other) is not None
    state.leases.hand_over("policy", TRAINER, new)  # the old job's driver is gone
    assert state.layouts.refusal("policy", other) is None


def test_misfits_are_counted_by_the_subscribers_gauge(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = metrics._Metrics(*(_Recorder() for _ in range(8)))
    monkeypatch.setattr(metrics, "_get", lambda: fake)
    subs = {
        "a": Subscriber("a", "policy", True, SubscriberInfo(), applied=1),
        "b": Subscriber("b", "policy", True, SubscriberInfo(), misfit="shape mismatch w"),
    }
    metrics.HubGauges("h").changed({"policy": Model(latest=1, stamps=[1])}, subs)
    assert fake.subscribers.get(state="misfit") == 1 and fake.subscribers.get(state="live") == 1


def test_status_text_shows_a_misfit_and_its_reason() -> None:
    state = HubState("hub", 2)
    state.versions.stamp("policy", MANIFEST, ["r1"], TRAINER)
    _join(state, "bad", BAD)
    out = io.StringIO()
    cli.render_status(state.waits.status(), file=out)
    words = " ".join(out.getvalue().split())
    assert "misfit" in words
    reason = "weights do not match the model: shape mismatch w: pushed (4,), model (3,)"
    assert f"its model does not fit them: {reason}" in words


def test_a_refusal_of_the_version_a_call_waits_for_is_not_called_an_earlier_push() -> None:
    refused = Refusal(2, WeightMismatchError("weights do not match the model: shape mismatch w"))
    with pytest.raises(WeightMismatchError, match=r"version 2 of 'policy' \(the version this call waits for"):
        refused.raise_it("policy", waited=2)  # push(wait=True) of version 2
    earlier = Refusal(2, WeightMismatchError("weights do not match the model: shape mismatch w"))
    with pytest.raises(
        WeightMismatchError, match=r"\(an earlier push that returned before the hub answered\)"
    ):
        earlier.raise_it("policy", waited=3)

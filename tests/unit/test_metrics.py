"""The hub's gauges, computed from its state (the export itself is checked in test_job.py)."""

from __future__ import annotations

import pytest

from raysync._protocol import SubscriberInfo
from raysync.hub import metrics
from raysync.hub.state import Model, Subscriber


class _Recorder:
    def __init__(self) -> None:
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.values[tuple(sorted(tags.items()))] = value

    observe = inc = set

    def get(self, **tags: str) -> float | None:
        hits = [v for k, v in self.values.items() if all((n, t) in k for n, t in tags.items())]
        return sum(hits) if hits else None


def _sub(
    sub_id: str,
    applied: int | None,
    state: str = "live",
    error: str | None = None,
    modified_since: int | None = None,
) -> Subscriber:
    info = SubscriberInfo(class_name="C")
    return Subscriber(
        sub_id,
        "policy",
        None,
        info,
        applied=applied,
        state=state,
        last_error=error,
        modified_since=modified_since,
    )


def test_gauges_count_states_set_lag_and_zero_the_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = metrics._Metrics(*(_Recorder() for _ in range(8)))
    monkeypatch.setattr(metrics, "_get", lambda: fake)
    models = {"policy": Model(latest=5, stamps=[1, 2, 3, 4, 5])}
    subs = {
        "a": _sub("a", 5),
        "b": _sub("b", 2),
        "c": _sub("c", 4, error="ApplyError: boom"),
        "d": _sub("d", None, state="unreachable"),
    }
    gauges = metrics.HubGauges("h")
    gauges.changed(models, subs)  # no event loop here: refreshes at once
    assert fake.latest_version.get(model_id="policy") == 5
    assert [fake.subscriber_lag.get(subscriber=s) for s in "abcd"] == [0, 3, 1, 5]
    by_state = {s: fake.subscribers.get(state=s) for s in ("live", "unreachable", "failing")}
    assert by_state == {"live": 2, "unreachable": 1, "failing": 1}

    del subs["b"]  # dropped by the hub
    gauges.changed(models, subs)
    assert fake.subscriber_lag.get(subscriber="b") == 0
    assert fake.subscribers.get(state="live") == 1

    models["policy"] = Model(latest=105, stamps=[1, 2, 3, 4, 5, 105])  # a new writer: numbers jump
    gauges.changed(models, subs)
    assert fake.subscriber_lag.get(subscriber="a") == 1  # one version behind, not 100


def test_the_modified_gauge_counts_subscribers_changed_in_place_since_their_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = metrics._Metrics(*(_Recorder() for _ in range(8)))
    monkeypatch.setattr(metrics, "_get", lambda: fake)
    models = {"policy": Model(latest=5, stamps=[1, 2, 3, 4, 5])}
    subs = {"a": _sub("a", 5, modified_since=5), "b": _sub("b", 4, modified_since=4), "c": _sub("c", 5)}
    gauges = metrics.HubGauges("h")
    gauges.changed(models, subs)
    assert fake.modified.get(model_id="policy") == 2
    assert "raysync_modified_subscribers" in metrics.METRIC_NAMES
    subs["a"] = _sub("a", 6)  # applied a newer version: no longer modified
    gauges.changed(models, subs)
    assert fake.modified.get(model_id="policy") == 1

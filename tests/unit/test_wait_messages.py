"""What a wait for a version says (issue 48, items 2 and 4), without a cluster: a stand-in hub.

Its ``wait`` sits out the seconds it is given (nobody moves), as the hub's does, and answers who is
behind; its ``status`` lists the subscribers, pull-mode ones among them.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest

from raysync import _checks
from raysync._protocol import Laggard, WaitResult
from raysync.client import wait_text
from raysync.client.hub_calls import HubCalls
from raysync.client.wait_text import Progress, WaitLabel
from raysync.client.waiting import raise_for, wait_for
from raysync.errors import SyncTimeoutError

BUSY = Laggard("sub-1", "Collector", 3, None, "live")
FAILING = Laggard("sub-2", "Collector", 2, "RuntimeError: out of memory", "live")


class StandInHub:
    """A client whose hub keeps ``laggards`` behind and ``push`` + ``pull`` subscribers registered."""

    def __init__(self, laggards: tuple[Laggard, ...] = (), *, push: int = 1, pull: int = 0) -> None:
        self.laggards, self.push, self.pull = laggards, push, pull
        self.slices: list[float] = []
        publishes = SimpleNamespace(
            unanswered=lambda model_id: False, raise_refused=lambda model_id, waited=None: None
        )
        self._writer = SimpleNamespace(
            pipeline=SimpleNamespace(offer=lambda model_id: None),
            publishes=publishes,
            settle=lambda model_id, *, wait, raise_refused=True: None,
        )

    @property
    def _calls(self) -> HubCalls:
        return HubCalls(self._call)

    def _call(self, method: str, *args: Any) -> Any:
        if method == "status":
            rows = [{"model_id": "policy", "mode": "push"}] * self.push
            return {"subscribers": rows + [{"model_id": "policy", "mode": "pull"}] * self.pull}
        assert method == "wait"
        _model_id, _version, seconds, include_pull, _offer, _need = args
        assert seconds is not None, "a wait was sent to the hub without a bound"
        self.slices.append(seconds)
        time.sleep(seconds)  # the hub sits the wait out: nobody moves
        counted = self.push + (self.pull if include_pull else 0)
        return WaitResult(self.laggards, registered=counted)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default bound 1 s instead of 300 s; a log line every 0.2 s instead of every 10 s."""
    monkeypatch.setattr(_checks, "WAIT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(wait_text, "LOG_EVERY_S", 0.2)


def test_a_wait_left_at_its_default_timeout_ends_with_sync_timeout_error(quick: None) -> None:
    hub = StandInHub((BUSY,))
    started = time.monotonic()
    with pytest.raises(SyncTimeoutError) as info:
        wait_for(hub, 4, "policy", None, include_pull=False, raise_failures=True)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0 + 5.0  # the default bound, not forever
    text = str(info.value)
    assert "timed out after 1.0 s" in text
    assert "1 push-mode subscriber(s) did not apply version 4" in text
    assert "Collector sub-1 (holds version 3; live, no error: applying, or busy in a method call)" in text
    assert "-;" not in text
    assert info.value.laggards == [BUSY.row()]


def test_the_default_timeout_is_a_documented_bound() -> None:
    assert _checks.wait_timeout(None) == _checks.WAIT_TIMEOUT_S == 300.0
    assert _checks.wait_timeout(float("inf")) is None  # no bound only when asked for
    assert _checks.wait_timeout(5) == 5.0


def test_subscribers_n_short_names_the_pull_mode_ones_it_did_not_count(quick: None) -> None:
    # One push-mode and one pull-mode actor, subscribers=2: push-mode ones alone never make 2.
    hub = StandInHub(push=1, pull=1)
    with pytest.raises(SyncTimeoutError) as info:
        wait_for(hub, 1, "policy", 0.5, include_pull=False, raise_failures=True, need=2)  # type: ignore[arg-type]
    text = str(info.value)
    assert "only 1 of the 2 push-mode subscribers waited for (subscribers=2) registered" in text
    assert "1 pull-mode subscriber(s) registered too, which would make 2" in text
    assert "include_pull=True" in text
    assert "0 subscriber(s)" not in text and "-;" not in text


def test_only_a_pull_mode_actor_registered_says_so_and_names_include_pull(quick: None) -> None:
    hub = StandInHub(push=0, pull=1)
    with pytest.raises(SyncTimeoutError) as info:
        wait_for(hub, 1, "policy", 0.3, include_pull=False, raise_failures=True, need=1)  # type: ignore[arg-type]
    text = str(info.value)
    assert "only 0 of the 1 push-mode subscribers" in text
    assert "1 pull-mode subscriber(s) registered too" in text and "include_pull=True" in text


def test_max_lag_timeout_names_push_mode_laggards_and_their_errors(quick: None) -> None:
    hub = StandInHub((BUSY, FAILING), push=2, pull=1)
    label = WaitLabel("policy", 3, max_lag=1)
    with pytest.raises(SyncTimeoutError) as info:
        wait_for(hub, 3, "policy", 0.3, include_pull=False, raise_failures=False, label=label)  # type: ignore[arg-type]
    text = str(info.value)
    assert text.startswith("push of 'policy' waiting for subscribers to come within max_lag=1")
    assert "2 push-mode subscriber(s) did not apply version 3" in text
    assert "Collector sub-2 (holds version 2; live, last error: RuntimeError: out of memory)" in text
    assert "1 pull-mode subscriber(s) registered and not counted" in text and "include_pull=True" in text


def test_with_include_pull_nothing_is_said_about_uncounted_subscribers() -> None:
    with pytest.raises(SyncTimeoutError) as info:
        raise_for(WaitResult((BUSY,), registered=2), "policy", 4, 5.0, need=0, failures=True)
    assert "pull-mode" not in str(info.value) and "1 subscriber(s) did not apply version 4" in str(info.value)


def test_a_long_wait_logs_who_is_behind_at_most_once_per_interval(
    quick: None, caplog: pytest.LogCaptureFixture
) -> None:
    hub = StandInHub((BUSY,))
    label = WaitLabel("policy", 5, max_lag=1)
    with caplog.at_level(logging.WARNING, logger="raysync"), pytest.raises(SyncTimeoutError):
        wait_for(hub, 5, "policy", 1.0, include_pull=False, raise_failures=False, label=label)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if r.name == "raysync.client.wait_text"]
    assert 1 <= len(lines) <= 1.0 / 0.2 + 1  # one per 0.2 s at most
    assert all("within max_lag=1" in line and "Collector sub-1 (holds version 3" in line for line in lines)
    assert max(hub.slices) <= 0.2 + 1e-6  # the hub is asked in slices of the interval


def test_progress_logs_once_per_interval_by_its_clock(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    progress = Progress(WaitLabel("policy", 2, need=3), False, every=10.0, clock=lambda: now[0])
    logged = []
    with caplog.at_level(logging.WARNING, logger="raysync"):
        for second in range(36):
            now[0] = float(second)
            if progress.report([BUSY.row()], 1, 2):
                logged.append(second)
    assert logged == [10, 20, 30]
    assert (
        "wait for version 2 of 'policy' and 3 registered subscribers: still waiting after 10 s" in caplog.text
    )
    assert "only 1 of the 3 push-mode subscribers" in caplog.text and "would make 3" in caplog.text


class RoundHub(StandInHub):
    """A hub whose version is a sharded round: unpublished for ``slices`` slices (the hub's
    ``SyncTimeoutError`` at each slice's end), or abandoned (``SyncTimeoutError`` at once)."""

    def __init__(self, slices: int, *, abandoned: bool = False) -> None:
        super().__init__()
        self.unpublished, self.abandoned = slices, abandoned

    def _call(self, method: str, *args: Any) -> Any:
        if method == "wait" and self.abandoned:
            raise SyncTimeoutError("ranks [1] of 2 did not push their shards: readers keep version 1")
        if method == "wait" and self.unpublished:
            self.unpublished -= 1
            time.sleep(args[2])
            raise SyncTimeoutError(f"version 2 of 'policy' is not published yet (within {args[2]} s)")
        return WaitResult() if method == "wait" else super()._call(method, *args)


def test_a_sharded_round_slower_than_a_slice_is_waited_for_and_an_abandoned_one_raises_at_once(
    quick: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="raysync"):
        wait_for(RoundHub(2), 2, "policy", 5.0, include_pull=False, raise_failures=True)  # type: ignore[arg-type]
    assert "wait for version 2 of 'policy': still waiting after" in caplog.text
    assert "is not published yet" in caplog.text
    started = time.monotonic()
    with pytest.raises(SyncTimeoutError, match="did not push their shards"):
        wait_for(RoundHub(0, abandoned=True), 2, "policy", 30.0, include_pull=False, raise_failures=True)  # type: ignore[arg-type]
    assert time.monotonic() - started < 15.0  # not asked again until the wait's 30 s end

"""A model id the hub has no version of: ``latest`` and followers say so, naming the models there."""

from __future__ import annotations

import logging
import time

import pytest

import raysync
from tests._support import small_policy


def _lines_about(caplog: pytest.LogCaptureFixture, model_id: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if f"no model {model_id!r}" in r.getMessage()]


def test_latest_of_a_typod_model_id_is_none_and_warns_once_naming_the_models_there(
    hub: raysync.HubClient, hub_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    hub.push(small_policy(1))
    with caplog.at_level(logging.INFO):
        assert hub.latest("polcy") is None  # None stays the answer for "no version yet"
        assert hub.latest("polcy") is None
        assert hub.latest() == 1
    (line,) = _lines_about(caplog, "polcy")  # one line per hub and model id, however often asked
    assert line.levelno == logging.WARNING
    assert line.getMessage() == (
        f"no model 'polcy' on hub {hub_name!r} (models there: 'policy'); latest() is None until one is pushed"
    )


def test_a_follower_of_a_typod_model_id_says_so_and_a_bounded_wait_names_the_models(
    hub: raysync.HubClient, hub_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    from raysync.receivers.follower import wait_for_first

    hub.push(small_policy(1))
    with caplog.at_level(logging.INFO):
        # Following a model with no version yet is allowed (a follower may start before its trainer).
        follower = raysync.follow(small_policy(0), "polcy", hub=hub_name, label="evaluator")
    try:
        assert follower.version is None
        (line,) = _lines_about(caplog, "polcy")
        assert line.levelno == logging.WARNING
        assert "(models there: 'policy'); following it until one is pushed" in line.getMessage()
        t0 = time.monotonic()
        with pytest.raises(
            raysync.SyncTimeoutError,
            match=r"evaluator: hub .* had no version of model 'polcy' within 1 s \(models there: 'policy'\)",
        ):
            wait_for_first(follower, timeout=1)
        assert time.monotonic() - t0 < 1 + 30  # bounded by its timeout (generous: a loaded machine)
        # The first version pushed under that id is applied: the wait returns it.
        v = hub.push(small_policy(2), "polcy")
        assert wait_for_first(follower, timeout=60) == v
    finally:
        follower.stop()


def test_a_follower_that_starts_before_any_push_logs_one_info_line(
    hub: raysync.HubClient, hub_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    from raysync.receivers.follower import wait_for_first

    with caplog.at_level(logging.INFO):
        follower = raysync.follow(small_policy(0), "policy", hub=hub_name)
    try:
        (line,) = _lines_about(caplog, "policy")
        assert line.levelno == logging.INFO  # the hub holds nothing: not a typo, just early
        assert "(models there: none); following it until one is pushed" in line.getMessage()
        v = hub.push(small_policy(1))
        assert wait_for_first(follower, timeout=60) == v
    finally:
        follower.stop()

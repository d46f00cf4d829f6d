"""The hub's typed settings (raysync.HubSettings): given values win, the environment fills the rest."""

from __future__ import annotations

import logging

import pytest

import raysync
from raysync.hub.settings import (
    DEFAULT_DOORBELL_BYTES,
    DEFAULT_DROP_SILENT_S,
    DEFAULT_RELAY_STALL_S,
    DEFAULT_RING_ACK_S,
    HubSettings,
)


def test_defaults_without_environment() -> None:
    assert HubSettings().resolved({}) == HubSettings(
        relays=True,
        rings_own_node=True,
        doorbell_bytes=DEFAULT_DOORBELL_BYTES,
        nice=None,
        drop_silent_s=DEFAULT_DROP_SILENT_S,
        ring_ack_s=DEFAULT_RING_ACK_S,
        relay_stall_s=DEFAULT_RELAY_STALL_S,
    )


def test_the_environment_fills_what_is_not_given() -> None:
    env = {
        "RAYSYNC_RELAY": "off",
        "RAYSYNC_HUB_RINGS": "0",
        "RAYSYNC_DOORBELL_BYTES": "1024",
        "RAYSYNC_HUB_NICE": "18",
        "RAYSYNC_DROP_SILENT_S": "4.5",
        "RAYSYNC_RING_ACK_S": "1.5",
        "RAYSYNC_RELAY_STALL_S": "2.5",
    }
    assert HubSettings().resolved(env) == HubSettings(
        relays=False,
        rings_own_node=False,
        doorbell_bytes=1024,
        nice=18,
        drop_silent_s=4.5,
        ring_ack_s=1.5,
        relay_stall_s=2.5,
    )
    given = HubSettings(relays=True, doorbell_bytes=0).resolved(env)
    assert (given.relays, given.doorbell_bytes) == (True, 0)  # given values win
    assert (given.rings_own_node, given.nice) == (False, 18)


def test_a_malformed_variable_is_logged_and_replaced_by_the_default(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "RAYSYNC_DOORBELL_BYTES": "lots",
        "RAYSYNC_HUB_NICE": "high",
        "RAYSYNC_RELAY": "maybe",
        "RAYSYNC_DROP_SILENT_S": "1",
        "RAYSYNC_RING_ACK_S": "0",
        "RAYSYNC_RELAY_STALL_S": "0.5",
    }
    with caplog.at_level(logging.WARNING, logger="raysync.hub.settings"):
        settings = HubSettings().resolved(env)
    assert settings == HubSettings().resolved({})
    text = caplog.text
    assert "RAYSYNC_DOORBELL_BYTES='lots'" in text and "RAYSYNC_HUB_NICE='high'" in text
    assert "RAYSYNC_RELAY='maybe'" in text and "RAYSYNC_DROP_SILENT_S='1'" in text
    assert "RAYSYNC_RING_ACK_S='0'" in text and "RAYSYNC_RELAY_STALL_S='0.5'" in text


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"relays": "no"}, TypeError, "relays must be True, False or None"),
        ({"doorbell_bytes": 1.5}, TypeError, "doorbell_bytes must be an integer"),
        ({"nice": True}, TypeError, "nice must be an integer"),
        ({"doorbell_bytes": -1}, ValueError, "doorbell_bytes must be >= 0"),
        ({"nice": 40}, ValueError, "nice must be within -20..19"),
        ({"drop_silent_s": "10"}, TypeError, "drop_silent_s must be a number of seconds"),
        ({"drop_silent_s": 2.0}, ValueError, "drop_silent_s must be at least 4 s"),
        ({"drop_silent_s": float("nan")}, ValueError, "drop_silent_s must be at least 4 s"),
        ({"ring_ack_s": "1"}, TypeError, "ring_ack_s must be a number of seconds"),
        ({"ring_ack_s": 0}, ValueError, r"ring_ack_s must be within \(0, 60\]"),
        ({"ring_ack_s": 61.0}, ValueError, r"ring_ack_s must be within \(0, 60\]"),
        ({"ring_ack_s": float("nan")}, ValueError, r"ring_ack_s must be within \(0, 60\]"),
        ({"relay_stall_s": "5"}, TypeError, "relay_stall_s must be a number of seconds"),
        ({"relay_stall_s": 0.5}, ValueError, r"relay_stall_s must be within \[1, 600\]"),
        ({"relay_stall_s": 601}, ValueError, r"relay_stall_s must be within \[1, 600\]"),
        ({"relay_stall_s": float("nan")}, ValueError, r"relay_stall_s must be within \[1, 600\]"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        HubSettings(**kwargs)


def test_differs_names_only_the_fields_asked_for() -> None:
    hub_has = HubSettings().resolved({})
    assert HubSettings(relays=True).differs(hub_has) == {}
    assert HubSettings(relays=False, nice=None).differs(hub_has) == {"relays": (False, True)}


def test_exported_and_connect_refuses_another_type() -> None:
    assert raysync.HubSettings is HubSettings and "HubSettings" in raysync.__all__
    with pytest.raises(TypeError, match=r"settings must be a raysync\.HubSettings"):
        raysync.connect("hub", settings={"relays": False})  # type: ignore[arg-type]

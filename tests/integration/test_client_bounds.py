"""A client call's timeout holds on the client's side, whatever the hub does (stopped, here).

The hub's process is stopped (SIGSTOP): it neither answers nor dies, so nothing in Ray tells
the client. Every call still raises ``SyncTimeoutError`` within its bound: ``wait(v, timeout=)``
within the timeout and the time allowed for the hub's answer (``ANSWER_GRACE_S``); calls
without a timeout (``latest``, ``status``, a push's publish) within the client's ``retry_s``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import ray
import torch

import raysync
from raysync.client.deadline import ANSWER_GRACE_S
from tests._support import small_policy

MARGIN_S = 5.0  # the client's own scheduling on a loaded machine, beyond the bound it promises


def _hub_pid(hub: raysync.HubClient) -> int:
    return int(ray.get(hub.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60))


def _raises_within(call: Callable[[], Any], bound: float) -> str:
    t0 = time.monotonic()
    with pytest.raises(raysync.SyncTimeoutError) as err:
        call()
    took = time.monotonic() - t0
    assert took < bound + MARGIN_S, f"raised after {took:.1f} s, bound {bound} s"
    return str(err.value)


def test_every_client_call_raises_in_time_while_the_hub_is_stopped(hub: raysync.HubClient) -> None:
    model = small_policy(1)
    hub.push(model)  # the layout is accepted: the next pushes do not wait for the hub
    pid = _hub_pid(hub)
    hub.retry_s = 3.0  # the bound of calls without a timeout (60 s by default)
    os.kill(pid, signal.SIGSTOP)
    try:
        v = hub.push(model)  # returns at once: its publish waits for the stopped hub
        message = _raises_within(lambda: hub.wait(v, timeout=3), 3 + ANSWER_GRACE_S)
        assert "did not answer" in message and repr(hub.name) in message, message
        _raises_within(hub.latest, hub.retry_s)
        _raises_within(hub.status, hub.retry_s)
        # a first push of a model waits for the hub's lease and its answer to the publish
        _raises_within(lambda: hub.push({"w": torch.ones(3)}, "other"), hub.retry_s + ANSWER_GRACE_S)
        _raises_within(lambda: hub.push({"w": torch.ones(3)}, "third", timeout=2), 2 + ANSWER_GRACE_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    # The hub works again: the version pushed while it was stopped was published, and so is a new one.
    hub.wait(v, timeout=60)
    assert hub.latest() == v
    assert hub.push({"w": torch.ones(3)}, "other") >= 1
    assert set(hub.status()["models"]) >= {"policy", "other"}

"""A new kind of receiver is one ``Target`` class: the pipeline gives it the rest.

``tests/_http_target.py`` (an engine updated through an HTTP endpoint, under 60 lines)
says what it holds, which buckets it needs and how a version goes in; held in a
``@synced_model`` actor it is pushed to, pulled by ``raysync_sync()``, holds a trainer
back through ``max_lag`` and shows in ``hub.status()``, with no code of its own for any.
"""

from __future__ import annotations

from typing import Any

import pytest
import ray
import torch

import raysync
from tests._http_target import HttpEndpoint
from tests._support import assert_same_weights, small_policy
from tests._targets import policy_state

TIMEOUT = 90.0


def _host(hub_name: str, **opts: Any) -> Any:
    @raysync.synced_model("engine", hub=hub_name, **opts)
    class Host:
        def __init__(self) -> None:
            self.engine = HttpEndpoint(policy_state())

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.engine.weights.items()}

        def requests(self) -> int:
            return self.engine.requests

        def sync_now(self) -> bool:
            return bool(self.raysync_sync(timeout=30))

    return Host


def test_one_target_class_gets_push_pull_staleness_bounds_and_status(
    hub: raysync.HubClient, hub_name: str
) -> None:
    remote = ray.remote(num_cpus=0)
    pushed_to = remote(_host(hub_name)).remote()
    puller = remote(_host(hub_name, mode="pull")).remote()
    assert ray.get([pushed_to.raysync_version.remote(), puller.raysync_version.remote()], timeout=120) == [
        None,
        None,
    ]
    first = small_policy(1)
    v1 = hub.push(first, wait=True, timeout=TIMEOUT)
    # push: the version went in through the endpoint, one request
    assert ray.get(pushed_to.raysync_version.remote()) == v1
    assert_same_weights(ray.get(pushed_to.weights.remote()), first.state_dict())
    assert ray.get(pushed_to.requests.remote()) == 1
    # pull: nothing until the actor asks
    assert ray.get(puller.requests.remote()) == 0
    assert ray.get(puller.sync_now.remote()) and ray.get(puller.raysync_version.remote()) == v1
    assert_same_weights(ray.get(puller.weights.remote()), first.state_dict())
    # staleness bounds: the puller one behind is allowed, two is not (nothing published)
    v2 = hub.push(small_policy(2), max_lag=1, timeout=30, include_pull=True)
    with pytest.raises(raysync.SyncTimeoutError):
        hub.push(small_policy(3), max_lag=1, timeout=1.0, include_pull=True)
    assert hub.latest() == v2
    assert ray.get(puller.sync_now.remote()) and ray.get(puller.raysync_version.remote()) == v2
    third = small_policy(3)
    v3 = hub.push(third, max_lag=1, timeout=30, include_pull=True)
    hub.wait(v3, timeout=TIMEOUT)  # the push-mode receiver (the puller holds v2 until it asks)
    assert_same_weights(ray.get(pushed_to.weights.remote()), third.state_dict())
    # status: each receiver's row says what it holds
    rows = {row["mode"]: row for row in hub.status()["subscribers"]}
    assert rows["push"]["applied"] == v3 and rows["pull"]["applied"] == v2, rows
    assert rows["push"]["last_error"] is None and rows["push"]["lag"] == 0 and rows["pull"]["lag"] == 1, rows

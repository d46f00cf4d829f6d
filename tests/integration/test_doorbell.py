"""Small versions reach a node's subscribers by doorbell: no Ray call per subscriber, whole and in order."""

from __future__ import annotations

import time
from typing import Any

import pytest
import ray
import torch

import raysync
from raysync.transports import doorbell
from tests.conftest import assert_same_weights, small_policy, wait_for_condition
from tests.integration.test_relay import _check_all, _relay
from tests.integration.test_synced import make_collector

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="needs Linux and a writable /dev/shm")


def _stats(relay: Any) -> dict[str, int]:
    return dict(ray.get(relay.stats.remote(), timeout=30))


def test_copy_subscribers_are_rung_not_called(hub: raysync.HubClient, hub_name: str) -> None:
    plain = [make_collector(hub_name).remote() for _ in range(2)]
    threaded = make_collector(hub_name).options(max_concurrency=4).remote()
    view = make_collector(hub_name, apply="view").remote()  # views stay on the object store: called
    actors = [*plain, threaded, view]
    ray.get([a.raysync_version.remote() for a in actors])
    relay = _relay(hub)
    _check_all(hub, actors, hub.push(small_policy(1)), 1)  # the relay is up and knows everyone
    before = _stats(relay)
    for seed in (2, 3, 4):
        v = hub.push(small_policy(seed))
        _check_all(hub, actors, v, seed)  # every actor holds v, bit for bit, and reports it
    after = _stats(relay)
    assert after["rung"] - before["rung"] == 3 * 3  # three processes rung per version
    assert after["delivered"] - before["delivered"] == 3  # the view subscriber's calls only
    rows = {r["subscriber"]: r for r in hub.status()["subscribers"]}
    assert all(r["applied"] == v and r["last_error"] is None for r in rows.values())


def test_a_version_over_the_limit_goes_by_ray_call(hub: raysync.HubClient, hub_name: str) -> None:
    def big() -> torch.nn.Module:
        return torch.nn.Linear(1536, 1536)  # 9 MiB: over the 8 MiB default

    actor = make_collector(hub_name, factory=big).remote()
    ray.get(actor.raysync_version.remote())
    relay = _relay(hub)
    hub.wait(hub.push(big()), timeout=60)
    before = _stats(relay)
    model = big()
    v = hub.push(model)
    hub.wait(v, timeout=60)
    after = _stats(relay)
    assert after["rung"] == before["rung"] and after["delivered"] - before["delivered"] == 1
    assert ray.get(actor.raysync_version.remote()) == v
    assert_same_weights(ray.get(actor.weights.remote()), model.state_dict())


def make_reader(hub_name: str) -> Any:
    @ray.remote(num_cpus=0, max_concurrency=4)
    @raysync.synced_model("policy", hub=hub_name)
    class Reader:
        """A threaded actor whose method reads its weights twice, with a pause between."""

        def __init__(self) -> None:
            self.policy = small_policy(0)

        def read_twice(self, pause: float) -> tuple[int | None, int | None, bool]:
            before = {k: v.clone() for k, v in self.policy.state_dict().items()}
            v0 = self.raysync_version()  # type: ignore[attr-defined]
            time.sleep(pause)
            after = self.policy.state_dict()
            same = all(torch.equal(before[k], after[k]) for k in before)
            return v0, self.raysync_version(), same  # type: ignore[attr-defined]

    return Reader


def test_a_rung_apply_waits_for_running_methods_and_never_tears_a_read(
    hub: raysync.HubClient, hub_name: str
) -> None:
    reader = make_reader(hub_name).remote()
    ray.get(reader.raysync_version.remote())
    relay = _relay(hub)
    rung = _stats(relay)["rung"]
    reads = [reader.read_twice.remote(0.3) for _ in range(4)]
    time.sleep(0.05)  # the reads are running
    v = hub.push(small_policy(7))
    results = ray.get(reads, timeout=60)
    assert all(v0 == v1 and same for v0, v1, same in results), results  # no version changed under a read
    hub.wait(v, timeout=30)
    assert _stats(relay)["rung"] > rung  # it did come by doorbell
    assert ray.get(reader.raysync_version.remote()) == v
    wait_for_condition(lambda: ray.get(reader.read_twice.remote(0.0))[0] == v, what="reads see the version")


def test_a_killed_subscriber_is_called_then_dropped(hub: raysync.HubClient, hub_name: str) -> None:
    live = make_collector(hub_name).remote()
    doomed = make_collector(hub_name).remote()
    ray.get([live.raysync_version.remote(), doomed.raysync_version.remote()])
    relay = _relay(hub)
    _check_all(hub, [live, doomed], hub.push(small_policy(1)), 1)
    ray.kill(doomed)
    v = hub.push(small_policy(2))
    hub.wait(v, timeout=30)  # the ring fails, the call says the actor died: dropped, not waited for
    assert [s["subscriber"] for s in hub.status()["subscribers"]] == [f"{live._actor_id.hex()}:policy"]
    _check_all(hub, [live], hub.push(small_policy(3)), 3)
    assert _stats(relay)["rung"] >= 3

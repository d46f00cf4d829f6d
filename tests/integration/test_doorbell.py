"""Small versions reach a node's subscribers by doorbell: no Ray call per subscriber, whole and in order.

Each test runs twice: the hub ringing its own node's doorbells (the default), and the
node's relay ringing them (``HubSettings(rings_own_node=False)``, as on every other node).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

import raysync
from raysync.transports import doorbell
from tests._support import (
    RING_ACK_S,
    assert_same_weights,
    kill_until_gone,
    small_policy,
    wait_for_condition,
)
from tests.integration.test_relay import _check_all, _relay
from tests.integration.test_synced import make_collector

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="needs Linux and a writable /dev/shm")


@pytest.fixture(params=["hub", "relay"])
def ringer(request: pytest.FixtureRequest, hub_name: str) -> Iterator[str]:
    """Who rings this node's doorbells: the hub itself, or the node's relay.

    Rung subscribers get ``RING_ACK_S`` to ack before they are called the Ray way too:
    these tests count the ways.
    """
    settings = raysync.HubSettings(rings_own_node=request.param == "hub", ring_ack_s=RING_ACK_S)
    client = raysync.connect(hub_name, settings=settings)
    yield request.param
    ray.kill(client.actor)


def _stats(hub: raysync.HubClient, ringer: str) -> dict[str, int]:
    """Doorbells rung and Ray calls made by whoever rings this node."""
    if ringer == "hub":
        return dict(hub.status()["here"])
    return dict(ray.get(_relay(hub).stats.remote(), timeout=30))


def test_copy_and_view_subscribers_are_rung_not_called(
    ringer: str, hub: raysync.HubClient, hub_name: str
) -> None:
    plain = [make_collector(hub_name).remote() for _ in range(2)]
    threaded = make_collector(hub_name).options(max_concurrency=4).remote()
    view = make_collector(hub_name, apply="view").remote()  # looks into the rung segment itself
    prefetching = make_collector(hub_name, prefetch=True).remote()  # stages ahead: called
    actors = [*plain, threaded, view, prefetching]
    ray.get([a.raysync_version.remote() for a in actors])
    if ringer == "relay":
        _relay(hub)
    _check_all(hub, actors, hub.push(small_policy(1)), 1)
    before, calls = _stats(hub, ringer), hub.status()["delivery"]["calls"]
    for seed in (2, 3, 4):
        v = hub.push(small_policy(seed))
        _check_all(hub, actors, v, seed)  # every actor holds v, bit for bit, and reports it
        assert ray.get(view.where.remote()).startswith("/memfd:")  # its weights: the sealed segment
    assert ray.get(view.write.remote()).startswith("refused")  # read-only, as over the object store
    after = _stats(hub, ringer)
    assert after["rung"] - before["rung"] == 3 * 4  # four processes rung per version
    assert after["delivered"] - before["delivered"] == 3  # the prefetching subscriber's calls only
    if ringer == "relay":
        assert hub.status()["delivery"]["calls"] - calls == 3  # one hub message per version
    else:  # the hub serves its own node: no relay there, no message to one
        assert hub.status()["relays"] == {}
    rows = {r["subscriber"]: r for r in hub.status()["subscribers"]}
    assert all(r["applied"] == v and r["last_error"] is None for r in rows.values())


def test_a_version_over_the_limit_goes_by_ray_call(
    ringer: str, hub: raysync.HubClient, hub_name: str
) -> None:
    def big() -> torch.nn.Module:
        return torch.nn.Linear(1536, 1536)  # 9 MiB: over the 8 MiB default

    actor = make_collector(hub_name, factory=big).remote()
    view = make_collector(hub_name, factory=big, apply="view").remote()
    ray.get([actor.raysync_version.remote(), view.raysync_version.remote()])
    hub.wait(hub.push(big()), timeout=60)
    hub.wait(hub.push(big()), timeout=60)
    before = _stats(hub, ringer)
    model = big()
    v = hub.push(model)
    hub.wait(v, timeout=60)
    assert _stats(hub, ringer)["rung"] == before["rung"]
    assert _stats(hub, ringer)["delivered"] - before["delivered"] == 2  # one call each
    for a in (actor, view):
        assert ray.get(a.raysync_version.remote()) == v
        assert_same_weights(ray.get(a.weights.remote()), model.state_dict())
    assert "plasma" in ray.get(view.where.remote())  # the view looks into the object store's copy


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

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

    return Reader


def test_a_rung_apply_waits_for_running_methods_and_never_tears_a_read(
    ringer: str, hub: raysync.HubClient, hub_name: str
) -> None:
    reader = make_reader(hub_name).remote()
    ray.get(reader.raysync_version.remote())
    hub.wait(hub.push(small_policy(6)), timeout=30)
    if ringer == "relay":
        _relay(hub)
    before = _stats(hub, ringer)
    reads = [reader.read_twice.remote(0.3) for _ in range(4)]
    time.sleep(0.05)  # the reads are running
    v = hub.push(small_policy(7))
    results = ray.get(reads, timeout=60)
    assert all(v0 == v1 and same for v0, v1, same in results), results  # no version changed under a read
    hub.wait(v, timeout=30)
    after = _stats(hub, ringer)
    assert after["rung"] > before["rung"]  # it did come by doorbell
    # acked within ring_ack_s (RING_ACK_S, past the 0.3 s wait): no Ray call on top of the ring
    calls = ("called_after_ring", "delivered")
    assert [after[k] for k in calls] == [before[k] for k in calls]
    assert ray.get(reader.raysync_version.remote()) == v
    wait_for_condition(lambda: ray.get(reader.read_twice.remote(0.0))[0] == v, what="reads see the version")


def test_a_rung_subscriber_slower_than_ring_ack_s_is_called_too_and_applies_once(hub_name: str) -> None:
    hub = raysync.connect(hub_name, settings=raysync.HubSettings(ring_ack_s=0.05))
    try:
        reader = make_reader(hub_name).remote()
        ray.get(reader.raysync_version.remote())
        hub.wait(hub.push(small_policy(6)), timeout=30)
        before = hub.status()["here"]
        reads = [reader.read_twice.remote(0.5) for _ in range(2)]
        time.sleep(0.05)  # the reads are running: the rung apply waits for them, past 0.05 s
        v = hub.push(small_policy(7))
        results = ray.get(reads, timeout=60)
        assert all(v0 == v1 and same for v0, v1, same in results), results
        hub.wait(v, timeout=30)
        after = hub.status()["here"]
        assert after["rung"] - before["rung"] == 1
        assert after["called_after_ring"] - before["called_after_ring"] == 1  # then called too
        assert after["delivered"] - before["delivered"] == 1  # that call, and no other
        assert ray.get(reader.raysync_version.remote()) == v
        assert_same_weights(ray.get(reader.weights.remote()), small_policy(7).state_dict())
        row = hub.status()["subscribers"][0]
        assert row["applied"] == v and row["last_error"] is None
    finally:
        ray.kill(hub.actor)


def test_a_killed_subscriber_is_called_then_dropped(
    ringer: str, hub: raysync.HubClient, hub_name: str
) -> None:
    live = make_collector(hub_name).remote()
    doomed = make_collector(hub_name).remote()
    ray.get([live.raysync_version.remote(), doomed.raysync_version.remote()])
    if ringer == "relay":
        _relay(hub)
    _check_all(hub, [live, doomed], hub.push(small_policy(1)), 1)
    # Pushed once its process is gone: a process still dying may apply and ack a ring, and is then
    # dropped only when it stops checking in, seconds later.
    kill_until_gone(doomed)
    v = hub.push(small_policy(2))
    # Never waited for: the ring to the dead process fails and the Ray call says it died.
    hub.wait(v, timeout=30)
    live_id = f"{live._actor_id.hex()}:policy"
    wait_for_condition(
        lambda: [s["subscriber"] for s in hub.status()["subscribers"]] == [live_id],
        timeout=60,
        what="the killed subscriber dropped",
    )
    _check_all(hub, [live], hub.push(small_policy(3)), 3)
    assert _stats(hub, ringer)["rung"] >= 3

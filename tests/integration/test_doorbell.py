"""Small versions reach a node's subscribers by doorbell: no Ray call per subscriber, whole and in order.

Each test runs twice: the hub ringing its own node's doorbells (the default), and the
node's relay ringing them (``HubSettings(rings_own_node=False)``, as on every other node).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

import raysync
from raysync.transports import doorbell
from tests._support import (
    PATH_RING_ACK_S,
    assert_same_weights,
    kill_until_gone,
    small_policy,
    wait_for_condition,
)
from tests.integration.test_relay import _check_all, _relay, _until_rung
from tests.integration.test_synced import make_collector

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="needs Linux and a writable /dev/shm")
# The ``ringer`` fixture creates each test's hub, with the settings of its parameter: no hub is
# started ahead with the file's (tests/conftest.py).
HUBS_STARTED_AHEAD = False


@pytest.fixture(params=["hub", "relay"])
def ringer(request: pytest.FixtureRequest, hub_name: str) -> Iterator[str]:
    """Who rings this node's doorbells: the hub itself, or the node's relay.

    Rung subscribers get ``PATH_RING_ACK_S`` to ack before they are called the Ray way too:
    these tests count the ways.
    """
    settings = raysync.HubSettings(rings_own_node=request.param == "hub", ring_ack_s=PATH_RING_ACK_S)
    client = raysync.connect(hub_name, settings=settings)
    yield request.param
    ray.kill(client.actor)


def _stats(hub: raysync.HubClient, ringer: str) -> dict[str, Any]:
    """Doorbells rung and Ray calls made by whoever rings this node (its process: ``pid``)."""
    if ringer == "hub":
        return dict(hub.status()["here"])
    return dict(ray.get(_relay(hub).stats.remote(), timeout=30))


def _serving(hub: raysync.HubClient, ringer: str, push: Any) -> None:
    """Push versions (``push()``) until one was rung: from then on every small version the test
    pushes is rung by whoever rings this node (see :func:`_until_rung`)."""
    if ringer == "relay":
        _relay(hub)  # up: the next delivery goes through it
    _until_rung(hub, push, lambda: _stats(hub, ringer))


def _same_ringer(before: dict[str, int], after: dict[str, int]) -> None:
    """The counts compared come from one ringing process (a relay that restarted starts from 0)."""
    assert after["pid"] == before["pid"], f"the ringer restarted mid-test: {before} -> {after}"


def test_copy_and_view_subscribers_are_rung_not_called(
    ringer: str, hub: raysync.HubClient, hub_name: str
) -> None:
    plain = make_collector(hub_name).remote()
    threaded = make_collector(hub_name).options(max_concurrency=4).remote()
    view = make_collector(hub_name, apply="view").remote()  # looks into the rung segment itself
    prefetching = make_collector(hub_name, prefetch=True).remote()  # stages ahead: called
    actors = [plain, threaded, view, prefetching]
    ray.get([a.raysync_version.remote() for a in actors])
    _serving(hub, ringer, lambda: hub.push(small_policy(1)))
    _check_all(hub, actors, hub.latest(), 1)
    before, calls = _stats(hub, ringer), hub.status()["delivery"]["calls"]
    for seed in (2, 3, 4):
        v = hub.push(small_policy(seed))
        _check_all(hub, actors, v, seed)  # every actor holds v, bit for bit, and reports it
        assert ray.get(view.where.remote()).startswith("/memfd:")  # its weights: the sealed segment
    assert ray.get(view.write.remote()).startswith("refused")  # read-only, as over the object store
    after = _stats(hub, ringer)
    _same_ringer(before, after)
    assert after["rung"] - before["rung"] == 3 * 3, (before, after)  # three processes rung per version
    assert after["delivered"] - before["delivered"] == 3, (before, after)  # the prefetching one's calls only
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
    before = _stats(hub, ringer)  # (a relay: up, so it takes the next version)
    model = big()
    v = hub.push(model)
    hub.wait(v, timeout=60)
    after = _stats(hub, ringer)
    _same_ringer(before, after)
    assert after["rung"] == before["rung"], (before, after)
    assert after["delivered"] - before["delivered"] == 2, (before, after)  # one call each
    too_big = "version not for a doorbell"  # and the stats say why (as `raysync status` would)
    assert after["not_rung"][too_big] - before["not_rung"].get(too_big, 0) == 2, (before, after)
    for a in (actor, view):
        assert ray.get(a.raysync_version.remote()) == v
        assert_same_weights(ray.get(a.weights.remote()), model.state_dict())
    assert "plasma" in ray.get(view.where.remote())  # the view looks into the object store's copy


def make_reader(hub_name: str) -> Any:
    @ray.remote(num_cpus=0, max_concurrency=8)
    @raysync.synced_model("policy", hub=hub_name)
    class Reader:
        """A threaded actor whose reads hold its weights until the test lets them go."""

        def __init__(self) -> None:
            self.policy = small_policy(0)
            self.gate = threading.Event()
            self.lock = threading.Lock()
            self.reading = 0

        def read_held(self) -> tuple[int | None, int | None, bool]:
            """Read the weights and version, wait for :meth:`open`, read them again."""
            before = {k: v.clone() for k, v in self.policy.state_dict().items()}
            v0 = self.raysync_version()  # type: ignore[attr-defined]
            with self.lock:
                self.reading += 1
            self.gate.wait(timeout=120)
            after = self.policy.state_dict()
            same = all(torch.equal(before[k], after[k]) for k in before)
            return v0, self.raysync_version(), same  # type: ignore[attr-defined]

        def reads(self) -> int:
            """How many reads hold the weights (or did)."""
            with self.lock:
                return self.reading

        def applies_waiting(self) -> int:
            """Applies waiting for the running methods to end (a rung one included)."""
            return int(self._raysync_actor_sync.lock.writers_waiting())  # type: ignore[attr-defined]

        def open(self) -> None:
            self.gate.set()

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

    return Reader


def _hold_reads(reader: Any) -> list[Any]:
    """Four reads that hold the reader's weights (running) until ``reader.open``."""
    reads = [reader.read_held.remote() for _ in range(4)]
    wait_for_condition(lambda: ray.get(reader.reads.remote()) == 4, what="the reads hold the weights")
    return reads


def _applies_waiting(reader: Any) -> None:
    wait_for_condition(lambda: ray.get(reader.applies_waiting.remote()), what="an apply waits for the reads")


def test_a_rung_apply_waits_for_running_methods_and_never_tears_a_read(
    ringer: str, hub: raysync.HubClient, hub_name: str
) -> None:
    reader = make_reader(hub_name).remote()
    ray.get(reader.raysync_version.remote())
    _serving(hub, ringer, lambda: hub.push(small_policy(6)))
    held = hub.latest()
    before = _stats(hub, ringer)
    reads = _hold_reads(reader)
    v = hub.push(small_policy(7))
    _applies_waiting(reader)  # rung while the reads run
    assert ray.get(reader.raysync_version.remote()) == held  # not applied under them
    ray.get(reader.open.remote())
    results = ray.get(reads, timeout=60)
    assert all(v0 == v1 == held and same for v0, v1, same in results), results  # no read torn
    hub.wait(v, timeout=30)
    after = _stats(hub, ringer)
    _same_ringer(before, after)
    assert after["rung"] - before["rung"] == 1, (before, after)  # it did come by doorbell
    # acked once the reads ended, well within ring_ack_s: no Ray call on top of the ring
    calls = ("called_after_ring", "delivered")
    assert [after[k] for k in calls] == [before[k] for k in calls], (before, after)
    assert ray.get(reader.raysync_version.remote()) == v
    assert_same_weights(ray.get(reader.weights.remote()), small_policy(7).state_dict())
    assert ray.get(reader.read_held.remote()) == (v, v, True)  # reads see the version


def test_a_rung_subscriber_slower_than_ring_ack_s_is_called_too_and_applies_once(hub_name: str) -> None:
    hub = raysync.connect(hub_name, settings=raysync.HubSettings(ring_ack_s=0.05))
    try:
        reader = make_reader(hub_name).remote()
        ray.get(reader.raysync_version.remote())
        _serving(hub, "hub", lambda: hub.push(small_policy(6)))
        held = hub.latest()
        before = hub.status()["here"]
        reads = _hold_reads(reader)
        v = hub.push(small_policy(7))
        _applies_waiting(reader)  # rung while the reads run: no ack until they end
        wait_for_condition(
            lambda: hub.status()["here"]["called_after_ring"] > before["called_after_ring"],
            what="the hub calls the rung subscriber too, past ring_ack_s",
        )
        ray.get(reader.open.remote())
        results = ray.get(reads, timeout=60)
        assert all(v0 == v1 == held and same for v0, v1, same in results), results
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
    _serving(hub, ringer, lambda: hub.push(small_policy(1)))
    _check_all(hub, [live, doomed], hub.latest(), 1)
    before = _stats(hub, ringer)
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
    after = _stats(hub, ringer)
    _same_ringer(before, after)
    # the live one rung for both versions (the dead one's ring failed: not counted), and never called
    assert after["rung"] - before["rung"] == 2, (before, after)
    assert after["called_after_ring"] == before["called_after_ring"], (before, after)

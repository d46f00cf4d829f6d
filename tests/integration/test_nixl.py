"""The NIXL transport (Ray's tensor transport) on CPU tensors: the same behaviour as the object store."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch

import raysync
from tests._busy_threads import lowered_busy_nixl_threads
from tests._support import assert_same_weights, small_policy, wait_for_condition
from tests.integration import test_synced
from tests.integration.test_synced import make_collector


@pytest.fixture(scope="module", autouse=True)
def _busy_nixl_threads_last() -> Iterator[list[int]]:
    """NIXL's progress threads poll a core each: they get what CPU the tests leave (see the module)."""
    with lowered_busy_nixl_threads() as lowered:
        yield lowered


@pytest.fixture
def nixl_hub(hub_name: str) -> Iterator[raysync.HubClient]:
    client = raysync.connect(hub_name, transport="nixl")
    yield client
    ray.kill(client.actor)


SAME_AS_OBJECT_STORE: list[Callable[..., Any]] = [
    test_synced.test_subscribers_end_bit_equal_for_float32_bfloat16_int64,
    test_synced.test_late_subscriber_starts_from_newest_version,
    test_synced.test_mismatched_push_is_refused_and_everyone_keeps_weights,
    test_synced.test_killed_subscriber_does_not_fail_pushes,
    test_synced.test_wait_names_the_laggard_and_applies_stay_in_order,
]


@pytest.mark.parametrize("case", SAME_AS_OBJECT_STORE, ids=lambda f: f.__name__.removeprefix("test_"))
def test_same_behaviour_as_the_object_store(
    case: Callable[..., Any], nixl_hub: raysync.HubClient, hub_name: str
) -> None:
    case(nixl_hub, hub_name)


@pytest.mark.parametrize("is_async", [False, True], ids=["threaded", "async"])
def test_no_torn_reads_over_nixl(nixl_hub: raysync.HubClient, hub_name: str, is_async: bool) -> None:
    test_synced.check_no_torn_reads(nixl_hub, hub_name, is_async, batches=8)


def test_nixl_versions_skip_the_object_store(nixl_hub: raysync.HubClient, hub_name: str) -> None:
    collector = make_collector(hub_name).remote()
    ray.get(collector.raysync_version.remote())
    model = small_policy(3)
    for _ in range(6):  # more versions than snapshot buffer sets: buffers are recycled safely
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        v = nixl_hub.push(model, wait=True, timeout=60)
        assert_same_weights(ray.get(collector.weights.remote()), model.state_dict())
    assert v == 6
    assert nixl_hub.last_push["transport"] == "nixl" and nixl_hub.last_push["bytes_put"] == 0
    row = nixl_hub.status()["subscribers"][0]
    assert row["last_bytes_fetched"] > 0 and row["last_error"] is None
    with pytest.raises(ValueError, match="whole versions"):
        nixl_hub.push(model, delta=True)


def test_view_subscribers_refuse_nixl_versions_clearly(nixl_hub: raysync.HubClient, hub_name: str) -> None:
    viewer = make_collector(hub_name, apply="view").remote()
    ray.get(viewer.raysync_version.remote())
    v = nixl_hub.push(small_policy(1))
    with pytest.raises(raysync.ApplyError, match="needs the object store"):
        nixl_hub.wait(v, timeout=30)
    assert ray.get(viewer.raysync_version.remote()) is None


def test_case6_verifying_subscribers_refuse_nixl_versions(nixl_hub: raysync.HubClient, hub_name: str) -> None:
    """Case 6: NIXL versions carry no checksums, so a verify=True subscriber refuses them clearly."""
    careful = make_collector(hub_name, verify=True).remote()
    trusting = make_collector(hub_name).remote()
    ray.get([careful.raysync_version.remote(), trusting.raysync_version.remote()])
    src = small_policy(4)
    v = nixl_hub.push(src)
    with pytest.raises(raysync.ApplyError, match=r"1 subscriber\(s\).*came over 'nixl'.*checksum=True"):
        nixl_hub.wait(v, timeout=30)
    assert ray.get(careful.raysync_version.remote()) is None
    assert_same_weights(ray.get(trusting.weights.remote()), src.state_dict())


def test_case13_extra_state_travels_over_nixl(nixl_hub: raysync.HubClient, hub_name: str) -> None:
    """Case 13a: a NIXL version carries the module's extra state too; the swap sets it."""
    test_synced.check_extra_state_travels(nixl_hub, [test_synced._counted_subscriber(hub_name)])


def _nixl_registrations() -> set[int]:
    """The addresses this process has registered with NIXL (Ray's registration cache; test only)."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    return set(get_tensor_transport_manager("NIXL")._tensor_desc_cache)


def test_nixl_memory_is_deregistered_before_it_is_freed(hub_name: str) -> None:
    """Ray keys a NIXL registration by address and keeps one raysync made until raysync drops it.
    Memory freed while registered, then allocated again at the same address, was read through the
    stale registration: on a GPU machine, the receivers of a second hub in the same trainer
    process got zeros, reported as applied (tests/integration/test_gpu.py shows it there). So a
    snapshot set's registration ends with the set (a client that goes takes its sets along)."""
    collector = make_collector(hub_name).remote()
    ray.get(collector.raysync_version.remote())
    before = _nixl_registrations()
    client = raysync.connect(hub_name, transport="nixl")
    client.push(small_policy(1), wait=True, timeout=60)
    first_layout = _nixl_registrations() - before
    assert first_layout, "the snapshot set was registered with NIXL"
    client.push(small_policy(2), wait=True, timeout=60)  # the next versions reuse the sets
    assert _nixl_registrations() - before >= first_layout
    ray.kill(client.actor)
    ray.kill(collector)
    del client
    gc.collect()
    wait_for_condition(
        lambda: not (_nixl_registrations() & first_layout),
        timeout=60,
        what="the dropped client's sets deregistered",
    )


def test_a_client_gives_back_the_snapshot_sets_no_version_reads(
    nixl_hub: raysync.HubClient, hub_name: str
) -> None:
    """``HubClient.release_buffers()`` (the transports' cleanup): the sets of versions nobody reads
    any more go, with their NIXL registrations; those of the versions the hub keeps stay readable;
    the client pushes on afterwards."""
    collector = make_collector(hub_name).remote()
    ray.get(collector.raysync_version.remote())
    before = _nixl_registrations()
    client = nixl_hub  # the hub keeps 2 versions
    for seed in range(4):  # 3 sets: the hub's 2 kept versions and one it dropped, free once Ray says so
        client.push(small_policy(seed), wait=True, timeout=60)
    held = _nixl_registrations() - before
    newest = small_policy(3).state_dict()

    def released() -> set[int]:
        client.release_buffers()
        return held - (_nixl_registrations() - before)

    gone = wait_for_condition(released, timeout=60, what="a free snapshot set released")
    left = _nixl_registrations() - before
    assert gone and left and left < held  # the kept versions' sets stay
    late = make_collector(hub_name).remote()  # starts from the newest kept version, read from its set
    assert ray.get(late.raysync_version.remote()) == 4
    assert_same_weights(ray.get(late.weights.remote()), newest)
    client.release_buffers()  # twice is harmless
    again = small_policy(9)
    assert client.push(again, wait=True, timeout=60) == 5  # sets are made anew as needed
    for actor in (collector, late):
        assert_same_weights(ray.get(actor.weights.remote()), again.state_dict())

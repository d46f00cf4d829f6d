"""A data path of one's own (it lives only in the tests) goes through push, hub and every receiver kind.

``tests/_loopback_transport.py`` stores each bucket with every byte flipped: a receiver
that read it any way but through its class's ``fetch`` would hold garbage. Each test checks
the weights bit for bit, and that the receiver's process fetched through the class.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

import raysync
from tests import _loopback_transport as loopback
from tests._support import assert_same_weights, small_policy, wait_for_condition

NAME = loopback.NAME


def _fetches() -> list[int]:
    from tests import _loopback_transport

    return list(_loopback_transport.FETCHES)


def _collector(hub_name: str, **opts: Any) -> Any:
    @raysync.synced_model("policy", hub=hub_name, **opts)
    class Collector:
        def __init__(self) -> None:
            self.policy = small_policy(0)

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

        def fetched(self) -> list[int]:
            return _fetches()

        def sync_now(self) -> bool:
            return bool(self.raysync_sync(timeout=30))

    return Collector


def _async_collector(hub_name: str) -> Any:
    @raysync.synced_model("policy", hub=hub_name)
    class AsyncCollector:
        def __init__(self) -> None:
            self.policy = small_policy(0)

        async def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

        async def fetched(self) -> list[int]:
            return _fetches()

    return AsyncCollector


def test_every_receiver_kind_takes_a_data_path_of_ones_own(hub: raysync.HubClient, hub_name: str) -> None:
    remote = ray.remote(num_cpus=0)
    actors = {
        "copy": remote(_collector(hub_name)).remote(),
        "view": remote(_collector(hub_name, apply="view")).remote(),
        "threaded": remote(_collector(hub_name)).options(max_concurrency=4).remote(),
        "async": remote(_async_collector(hub_name)).remote(),
    }
    puller = remote(_collector(hub_name, mode="pull")).remote()
    transform = raysync.RayModuleTransform(lambda: small_policy(0), model_id="policy", hub=hub_name)
    follower_module = small_policy(0)
    follower = raysync.follow(follower_module, "policy", hub=hub_name)
    try:
        ray.get([a.raysync_version.remote() for a in [*actors.values(), puller]], timeout=120)
        for seed in (1, 2):
            model = small_policy(seed)
            v = hub.push(model, transport=NAME)
            hub.wait(v, timeout=60, subscribers=len(actors) + 2)  # the actors, the transform, the follower
            expected = model.state_dict()
            for kind, actor in actors.items():
                assert ray.get(actor.raysync_version.remote()) == v, kind
                assert_same_weights(ray.get(actor.weights.remote()), expected)
                assert ray.get(actor.fetched.remote()), f"{kind}: not fetched through the data path's class"
            assert ray.get(puller.sync_now.remote()) and ray.get(puller.raysync_version.remote()) == v
            assert_same_weights(ray.get(puller.weights.remote()), expected)
            x = torch.randn(3, 8)
            assert torch.equal(transform(x), model(x))  # the hosted module holds it
            wait_for_condition(lambda v=v: follower.version == v, what="the follower applied it")
            assert_same_weights(follower_module.state_dict(), expected)
            assert loopback.FETCHES  # the follower (this process) fetched through the class
            assert_same_weights(hub.pull(state_dict=True), expected)  # and pull
    finally:
        follower.stop()
        transform.shutdown()


def test_a_misspelt_data_path_is_refused_by_name(hub: raysync.HubClient) -> None:
    import pytest

    with pytest.raises(ValueError, match="transport must be one of"):
        hub.push(small_policy(1), transport="objectstore")
    with pytest.raises(ValueError, match=r"no data path 'tests\._loopback_transport:Nope'"):
        hub.push(small_policy(1), transport="tests._loopback_transport:Nope")

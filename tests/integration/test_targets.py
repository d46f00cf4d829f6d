"""An engine fed ``(name, tensor)`` pairs (``raysync.WeightsLoader``) behind every receiver kind.

What a user of an inference engine would notice: the engine's weights are bit-equal to the
version the receiver reports, a version that does not fit is refused before anything is
fetched, a version whose bytes fail to arrive never reaches ``load_weights``, and a
``keys=`` push hands over only the keys pushed. Over the object store and over the
test-only loopback data path (``tests/_loopback_transport.py``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import ray
import torch

import raysync
import raysync.adapters
from raysync import _checks
from tests import _loopback_transport as loopback
from tests import _targets
from tests._support import CLIENT_MARGIN_S, assert_same_weights, small_policy, wait_for_condition
from tests._targets import Engine, engine_loader, policy_state, record_engine

TIMEOUT = 90.0


def _host(hub_name: str, **opts: Any) -> Any:
    @raysync.synced_model("engine", hub=hub_name, **opts)
    class Host:
        def __init__(self) -> None:
            self.inference = Engine()
            self.engine = self.inference.loader()

        def state(self) -> dict[str, torch.Tensor]:
            return self.inference.state()

        def fetched(self) -> list[int]:
            return list(loopback.FETCHES)

        def sync_now(self) -> bool:
            return bool(self.raysync_sync(timeout=30))

    return Host


def _async_host(hub_name: str) -> Any:
    @raysync.synced_model("engine", hub=hub_name)
    class AsyncHost:
        def __init__(self) -> None:
            self.inference = Engine()
            self.engine = self.inference.loader()

        async def state(self) -> dict[str, torch.Tensor]:
            return self.inference.state()

        async def fetched(self) -> list[int]:
            return list(loopback.FETCHES)

    return AsyncHost


@pytest.mark.parametrize("transport", ["object_store", loopback.NAME])
def test_an_engine_follows_through_every_receiver_kind(
    hub: raysync.HubClient, hub_name: str, transport: str
) -> None:
    remote = ray.remote(num_cpus=0)
    hosts = {
        "plain": remote(_host(hub_name)).remote(),
        "threaded": remote(_host(hub_name)).options(max_concurrency=4).remote(),
        "async": remote(_async_host(hub_name)).remote(),
    }
    puller = remote(_host(hub_name, mode="pull")).remote()
    engine = Engine()
    follower = raysync.Follower(target=engine.loader(), model_id="policy", hub=hub_name).start()
    try:
        ray.get([h.raysync_version.remote() for h in [*hosts.values(), puller]], timeout=120)
        for seed in (1, 2):
            model = small_policy(seed)
            v = hub.push(model, transport=transport)
            hub.wait(v, timeout=TIMEOUT, subscribers=len(hosts) + 1)  # the hosts and the follower
            expected = model.state_dict()
            for kind, host in hosts.items():
                assert ray.get(host.raysync_version.remote()) == v, kind
                assert_same_weights(ray.get(host.state.remote()), expected)
                if transport == loopback.NAME:
                    assert ray.get(host.fetched.remote()), f"{kind}: not fetched through the data path"
            assert ray.get(puller.sync_now.remote()) and ray.get(puller.raysync_version.remote()) == v
            assert_same_weights(ray.get(puller.state.remote()), expected)
            assert follower.version == v and follower.target.version == v  # type: ignore[attr-defined]
            assert_same_weights(engine.params, expected)
    finally:
        follower.stop()


def test_torchrl_receivers_and_adapters_feed_an_engine(
    hub: raysync.HubClient, hub_name: str, tmp_path: Any
) -> None:
    from raysync.torchrl.ray_transport import RayTransport

    @ray.remote(num_cpus=0)
    class Server:  # a plain actor: torchrl's Ray scheme calls into it, no decorator
        def __init__(self) -> None:
            self.inference = Engine()
            self.loader = self.inference.loader()

        def state(self) -> dict[str, torch.Tensor]:
            return self.inference.state()

    server = Server.remote()  # type: ignore[attr-defined]
    t = RayTransport(remote_collector=server, timeout=TIMEOUT, model_path="loader")
    model = small_policy(3)
    t.send_weights("policy", model)
    assert_same_weights(ray.get(server.state.remote()), model.state_dict())
    with pytest.raises(raysync.ApplyError, match=r"shape mismatch 2\.weight"):
        t.send_weights("policy", small_policy(4, out=3))
    assert_same_weights(ray.get(server.state.remote()), model.state_dict())  # kept

    adapter = raysync.adapters.start(
        "pipe",
        record_engine,
        (str(tmp_path), "e"),
        model_factory=engine_loader,
        num_receivers=1,
        hub=hub_name,
        timeout=TIMEOUT,
    )
    try:
        (row,) = ray.get(adapter.receivers.remote(), timeout=TIMEOUT)
        v = hub.push(small_policy(5))
        hub.wait(v, timeout=TIMEOUT, subscribers=1)
        path = os.path.join(str(tmp_path), f"e-{row['pid']}-1.pt")
        wait_for_condition(lambda: os.path.exists(path), timeout=TIMEOUT, what=path)
        assert_same_weights(torch.load(path), small_policy(5).state_dict())
    finally:
        ray.get(adapter.shutdown.remote(), timeout=TIMEOUT)
        ray.kill(adapter)


def test_a_misfit_is_refused_before_any_byte_is_fetched(hub: raysync.HubClient, hub_name: str) -> None:
    engine = Engine()
    before = {k: v.clone() for k, v in engine.params.items()}
    follower = raysync.follow(target=engine.loader(), hub=hub_name)
    try:
        fetches, calls = len(loopback.FETCHES), len(engine.calls)
        # The model id's first version (a later one of another layout is refused by the hub: it
        # does not fit the layout the versions established); the hub does not know the
        # engine's tensors, so the engine's loader refuses it.
        v1 = hub.push(small_policy(2, out=3), transport=loopback.NAME)
        with pytest.raises(raysync.ApplyError, match=r"shape mismatch 2\.weight"):
            hub.wait(v1, timeout=TIMEOUT, subscribers=1)
        assert len(loopback.FETCHES) == fetches  # refused from the manifest alone
        assert len(engine.calls) == calls and follower.version is None
        assert_same_weights(engine.params, before)
    finally:
        follower.stop()


def test_a_followers_wait_for_left_at_its_default_timeout_ends(
    hub: raysync.HubClient, hub_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 48, item 4: Follower.wait_for without a timeout is bounded (WAIT_TIMEOUT_S: 300 s, 1 s here).
    monkeypatch.setattr(_checks, "WAIT_TIMEOUT_S", 1.0)
    follower = raysync.follow(target=Engine().loader(), hub=hub_name)
    try:
        v1 = hub.push(small_policy(1))
        assert follower.wait_for(v1) >= v1
        ended: list[BaseException] = []

        def wait() -> None:
            try:
                follower.wait_for(v1 + 1)  # never pushed
            except BaseException as err:
                ended.append(err)

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        thread.join(timeout=1.0 + CLIENT_MARGIN_S)
        assert not thread.is_alive(), "wait_for() without a timeout did not end at the default bound"
        assert isinstance(ended[0], raysync.SyncTimeoutError)
        assert f"not {v1 + 1}, after 1.0 s" in str(ended[0])
    finally:
        follower.stop()


@pytest.mark.parametrize(("switch", "why"), [("FAIL", "did not arrive"), ("CORRUPT", "checksum")])
def test_a_failed_fetch_leaves_the_engine_on_its_version(
    hub: raysync.HubClient, hub_name: str, switch: str, why: str
) -> None:
    engine = Engine()
    loader = engine.loader()
    follower = raysync.follow(target=loader, hub=hub_name)
    small = 256  # several buckets: the first arrives, the next does not
    try:
        v1 = hub.push(small_policy(1), transport=_targets.FLAKY, bucket_bytes=small, checksum=True)
        hub.wait(v1, timeout=TIMEOUT, subscribers=1)
        calls = len(engine.calls)
        _targets.SWITCH[switch] = True
        try:
            v2 = hub.push(small_policy(2), transport=_targets.FLAKY, bucket_bytes=small, checksum=True)
            with pytest.raises(raysync.ApplyError, match=why):
                hub.wait(v2, timeout=TIMEOUT)
            # The failed version is tried again after a doubling back-off (0.05 s, 0.1 s, ... 5 s),
            before = len(_targets.FETCHES)
            wait_for_condition(lambda: len(_targets.FETCHES) > before, what="the failed version tried again")
            # not hundreds of times a second until the next push (a loaded machine only tries fewer).
            before = len(_targets.FETCHES)
            time.sleep(1.5)
            assert len(_targets.FETCHES) - before <= 8, len(_targets.FETCHES) - before
            assert loader.version == v1 and follower.version == v1
            assert len(engine.calls) == calls  # load_weights never saw it
            assert_same_weights(engine.params, small_policy(1).state_dict())
        finally:
            _targets.SWITCH[switch] = False
        v3 = hub.push(small_policy(3), transport=_targets.FLAKY, bucket_bytes=small, checksum=True)
        hub.wait(v3, timeout=TIMEOUT)
        assert loader.version == v3
        assert_same_weights(engine.params, small_policy(3).state_dict())
    finally:
        follower.stop()


def test_a_keys_push_hands_the_engine_only_the_keys_pushed(hub: raysync.HubClient, hub_name: str) -> None:
    engine = Engine()
    follower = raysync.follow(target=engine.loader(), hub=hub_name)
    remote = ray.remote(num_cpus=0)
    host = remote(_host(hub_name)).remote()
    try:
        ray.get(host.raysync_version.remote(), timeout=120)
        v1 = hub.push(small_policy(1))
        hub.wait(v1, timeout=TIMEOUT, subscribers=2)
        hub.push(small_policy(2), keys=["2.*"], wait=True, timeout=TIMEOUT)  # lays the keys out apart
        v3 = hub.push(small_policy(3), keys=["2.*"])
        hub.wait(v3, timeout=TIMEOUT)
        assert sorted(engine.calls[-1]) == ["2.bias", "2.weight"]  # only the keys pushed
        expected = {**policy_state(1), **{k: v for k, v in policy_state(3).items() if k.startswith("2.")}}
        assert_same_weights(engine.params, expected)
        assert follower.version == v3 and ray.get(host.raysync_version.remote()) == v3
        assert_same_weights(ray.get(host.state.remote()), expected)
    finally:
        follower.stop()

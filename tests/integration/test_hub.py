"""The control plane on a real local Ray cluster: connect, push, versions, keep, pull, wait, status."""

from __future__ import annotations

import pickle
import re
from typing import Any

import pytest
import ray
import torch
from ray._private.internal_api import memory_summary

import raysync
from raysync.client.hub_client import DEFAULT_NAMESPACE
from tests._support import assert_same_weights, small_policy, wait_for_condition


def test_push_stamps_monotonic_versions_and_pull_returns_them(hub: raysync.HubClient) -> None:
    assert hub.latest() is None
    a, b = small_policy(1), small_policy(2)
    assert hub.push(a) == 1
    assert hub.push(b) == 2
    assert hub.latest() == 2
    assert_same_weights(hub.pull().flatten_keys(".").to_dict(), b.state_dict())
    assert_same_weights(hub.pull(version=1).flatten_keys(".").to_dict(), a.state_dict())
    # The pulled copy is private: writing to it changes nothing on the hub.
    hub.pull()["0.weight"].zero_()
    assert_same_weights(hub.pull().flatten_keys(".").to_dict(), b.state_dict())


def test_push_returns_once_the_snapshot_is_taken(hub: raysync.HubClient) -> None:
    model = small_policy(3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    hub.push(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)  # the trainer's next step, right after push returns
    assert_same_weights(hub.pull().flatten_keys(".").to_dict(), expected)


def test_models_are_independent_and_unknown_ones_are_named(hub: raysync.HubClient) -> None:
    hub.push(small_policy(), "actor")
    hub.push({"v": torch.ones(3)}, "critic")
    hub.push({"v": torch.ones(3) * 2}, "critic")
    assert (hub.latest("actor"), hub.latest("critic")) == (1, 2)
    with pytest.raises(raysync.UnknownModelError, match=r"'nope'.*'actor', 'critic'"):
        hub.pull("nope")
    with pytest.raises(KeyError):  # also the built-in a caller would catch
        hub.pull("nope")


def test_keep_releases_old_versions(hub_name: str) -> None:
    hub = raysync.connect(hub_name, keep=2)
    for i in range(4):
        hub.push({"w": torch.full((4,), float(i))})
    assert hub.status()["models"]["policy"]["versions_kept"] == [3, 4]
    with pytest.raises(raysync.UnknownModelError, match=r"version 1 .* not kept .*keep="):
        hub.pull(version=1)
    ray.kill(hub.actor)


def _store_used_mib() -> float:
    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    match = re.search(r"Plasma memory usage (\d+) MiB", summary)
    return float(match.group(1)) if match else 0.0


def test_object_store_stays_bounded_over_many_pushes(hub_name: str) -> None:
    hub = raysync.connect(hub_name, keep=2)
    start = _store_used_mib()
    weights = {f"w{i}": torch.randn(4 * 2**20) for i in range(4)}  # 64 MiB
    # 10 pushes, 5 times keep: a version held past its turn at every push breaks the bound by the
    # 4th, one held once breaks the settled check below
    for i in range(10):
        hub.push(weights)
        # Ray frees released objects in batches (about once a second), so the bound
        # is checked once the push settled: the kept versions and the one just retired.
        wait_for_condition(
            lambda: _store_used_mib() - start <= 3 * 64,
            timeout=30,
            what=f"object store back within keep=2 (+1 retiring) versions after push {i + 1}",
        )
    settled = wait_for_condition(
        lambda: (used := _store_used_mib() - start) <= 2 * 64 and used,
        timeout=30,
        what="exactly the 2 kept versions of 64 MiB left",
    )
    assert settled >= 2 * 64 - 1  # it does hold the two kept versions
    ray.kill(hub.actor)
    # The trainer's client keeps its newest version (to offer it to a restarted hub): one left.
    wait_for_condition(
        lambda: _store_used_mib() - start <= 64 + 1, what="the older kept version released with the hub"
    )
    del hub
    wait_for_condition(lambda: _store_used_mib() - start <= 1, what="the newest released with the client")


def test_client_is_picklable_and_works_from_tasks_and_actors(hub: raysync.HubClient) -> None:
    clone = pickle.loads(pickle.dumps(hub))
    assert (clone.name, clone.namespace) == (hub.name, DEFAULT_NAMESPACE)

    # Different model ids: a task and an actor are different writers (one writer per model).
    @ray.remote
    def push_from_task(client: raysync.HubClient) -> int:
        return client.push({"w": torch.ones(2)}, "from_task")

    @ray.remote
    class Trainer:
        def __init__(self, client: raysync.HubClient) -> None:
            self.client = client

        def step(self) -> int:
            return self.client.push({"w": torch.ones(2) * 2}, "from_actor")

    assert ray.get(push_from_task.remote(hub)) == 1
    trainer = Trainer.remote(hub)
    assert ray.get(trainer.step.remote()) == 1
    assert ray.get(trainer.step.remote()) == 2
    assert hub.pull("from_task")["w"].tolist() == [1.0, 1.0]
    assert hub.pull("from_actor")["w"].tolist() == [2.0, 2.0]


def test_concurrent_connects_find_one_hub(hub_name: str) -> None:
    @ray.remote(num_cpus=0)
    def connect_and_ask(name: str) -> Any:
        client = raysync.connect(name)
        return ray.get(client.actor.configure.remote(2))["pid"]

    pids = ray.get([connect_and_ask.remote(hub_name) for _ in range(4)])
    assert len(set(pids)) == 1
    ray.kill(raysync.connect(hub_name).actor)


def test_bad_arguments_are_refused_with_the_fix(
    hub: raysync.HubClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused at once: bad input is not mistaken for a call that raced ``ray.shutdown()`` (whose
    check waits up to 2 s for the shutdown to finish)."""
    from raysync.client import locate

    def not_consulted(grace_s: float = 2.0) -> bool:
        raise AssertionError("a refused argument waited for a Ray shutdown")

    monkeypatch.setattr(locate, "ray_shut_down", not_consulted)
    with pytest.raises(ValueError, match="model_id"):
        hub.push({"w": torch.ones(1)}, "")
    with pytest.raises(ValueError, match="timeout"):
        hub.wait(1, timeout=-1)
    with pytest.raises(ValueError, match="keep"):
        raysync.connect("x", keep=0)
    with pytest.raises(raysync.InvalidWeightsError, match="empty"):
        hub.push({})


def test_wait_with_no_subscribers_returns_at_once(hub: raysync.HubClient) -> None:
    v = hub.push({"w": torch.ones(1)}, wait=True, timeout=5)
    hub.wait(v, timeout=1)


@pytest.mark.parametrize("kind", ["sparse", "meta", "quantized"])
def test_case13_unsupported_tensors_are_refused_before_the_object_store(
    hub: raysync.HubClient, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Case 13b: a sparse, meta or quantized tensor fails the push up front; nothing is put."""
    bad = {
        "sparse": lambda: torch.randn(4, 4).to_sparse(),
        "meta": lambda: torch.empty(4, device="meta"),
        "quantized": lambda: torch.quantize_per_tensor(torch.randn(4), 0.5, 1, torch.qint8),
    }[kind]()
    puts: list[Any] = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda *a, **k: puts.append(a) or real_put(*a, **k))
    with pytest.raises(raysync.InvalidWeightsError, match=r"'layer\.w'"):
        hub.push({"layer": {"w": bad, "b": torch.ones(2)}})
    assert puts == [] and hub.latest() is None


def test_case13_conjugate_and_negative_views_are_pushed_as_values(hub: raysync.HubClient) -> None:
    """Case 13b: lazy conjugate / negative views come back from the hub bit-exact as their values."""
    z = torch.randn(6, dtype=torch.complex128)
    weights = {"conj": z.conj(), "neg": z.conj().imag, "neg_view": torch._neg_view(torch.randn(3))}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in weights.items()}
    hub.push(weights)
    assert_same_weights(hub.pull().flatten_keys(".").to_dict(), expected)

"""Async RL controls on a real local cluster: max_lag, partial, cast, delta pushes, prefetch, pull mode."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import ray
import torch

import raysync
from raysync import _checks
from raysync.client import wait_text
from raysync.client.deadline import ANSWER_GRACE_S
from tests._support import CLIENT_MARGIN_S, assert_same_weights, wait_for_condition

BUCKET = 40 * 1024  # small buckets: base0 | base1 + adapters


class LoRAPolicy(torch.nn.Module):
    """A 'base' of two 32 KiB layers plus two small adapter matrices."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base0 = torch.nn.Linear(64, 128, bias=False)
        self.base1 = torch.nn.Linear(128, 64, bias=False)
        self.lora_a = torch.nn.Parameter(torch.randn(4, 64))
        self.lora_b = torch.nn.Parameter(torch.randn(64, 4))
        self.to(dtype)


def make_follower(hub_name: str, dtype: torch.dtype = torch.float32, **opts: Any) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name, **opts)
    class Follower:
        def __init__(self) -> None:
            self.policy = LoRAPolicy(seed=99, dtype=dtype)

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

        def version(self) -> int | None:
            return self.raysync_version()

        def sync_now(self) -> bool:
            return self.raysync_sync(timeout=10)

        def busy(self, seconds: float) -> int | None:
            time.sleep(seconds)
            return self.raysync_version()

    return Follower


def _row(hub: raysync.HubClient) -> dict[str, Any]:
    (row,) = hub.status()["subscribers"]
    return row


def test_max_lag_blocks_the_trainer_until_the_slow_subscriber_catches_up(
    hub: raysync.HubClient, hub_name: str
) -> None:
    slow = make_follower(hub_name, mode="pull").remote()
    ray.get(slow.version.remote())
    model = LoRAPolicy(1)
    assert hub.push(model, max_lag=2, timeout=30) == 1  # (without include_pull, pull mode never holds back)
    assert hub.push(model, max_lag=2, timeout=30, include_pull=True) == 2  # slow is 2 behind: allowed
    with pytest.raises(raysync.SyncTimeoutError, match=r"version 1.*Follower") as info:
        hub.push(model, max_lag=2, timeout=1.0, include_pull=True)  # a 3rd would put it 3 behind
    assert info.value.laggards[0]["applied"] is None
    assert hub.latest() == 2  # the refused push published nothing

    released: dict[str, float] = {}

    def trainer() -> None:
        hub.push(model, max_lag=2, timeout=60, include_pull=True)
        released["at"] = time.monotonic()

    thread = threading.Thread(target=trainer)
    thread.start()
    time.sleep(1.0)
    assert "at" not in released  # still held back
    synced_at = time.monotonic()
    assert ray.get(slow.sync_now.remote()) is True
    thread.join(timeout=30)
    assert released["at"] >= synced_at
    assert hub.latest() == 3


def test_max_lag_at_its_default_timeout_names_the_busy_actor_and_logs_while_it_waits(
    hub: raysync.HubClient, hub_name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 48, item 4: push(max_lag=...) without a timeout is bounded (WAIT_TIMEOUT_S, 300 s: 4 s
    # here) and says every LOG_EVERY_S (10 s: 1 s here) whom it waits for.
    monkeypatch.setattr(_checks, "WAIT_TIMEOUT_S", 4.0)
    monkeypatch.setattr(wait_text, "LOG_EVERY_S", 1.0)
    follower = make_follower(hub_name).remote()
    ray.get(follower.version.remote())
    model = LoRAPolicy(1)
    assert hub.push(model, wait=True, timeout=60) == 1
    busy = follower.busy.remote(12)  # a push-mode actor applies between its method calls: not now
    wait_for_condition(lambda: _row(hub)["applied"] == 1, what="the follower holds 1")
    assert hub.push(model) == 2
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="raysync"), pytest.raises(raysync.SyncTimeoutError) as info:
        hub.push(model, max_lag=1)  # a 3rd would put it 2 behind
    assert time.monotonic() - started < 4.0 + ANSWER_GRACE_S + CLIENT_MARGIN_S
    text = str(info.value)
    assert "within max_lag=1" in text and "timed out after 4.0 s" in text
    assert (
        "Follower" in text and "holds version 1; live, no error: applying, or busy in a method call" in text
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "raysync.client.wait_text"]
    assert lines and all("within max_lag=1" in line and "Follower" in line for line in lines)
    assert len(lines) <= 4.0 / 1.0 + 1  # one a second at most
    assert ray.get(busy, timeout=60) == 1
    assert hub.push(model, max_lag=1, timeout=60) == 3  # it applied 2 once free


def test_partial_push_moves_only_the_selected_keys(hub: raysync.HubClient, hub_name: str) -> None:
    follower = make_follower(hub_name).remote()
    ray.get(follower.version.remote())
    trainer = LoRAPolicy(1)
    hub.push(trainer, bucket_bytes=BUCKET, wait=True, timeout=60)
    full_bytes = hub.last_push["bytes_put"]
    base_before = {k: v.clone() for k, v in trainer.state_dict().items() if k.startswith("base")}
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1.0)  # the trainer changed everything...
    hub.push(trainer, keys=["lora_*"], bucket_bytes=BUCKET, wait=True, timeout=60)
    hub.push(trainer, keys=["lora_*"], bucket_bytes=BUCKET, wait=True, timeout=60)
    # ...but only the adapters were sent: 2 x 1 KiB, not the 64 KiB base.
    assert hub.last_push["bytes_put"] < 4096 < full_bytes
    assert hub.last_push["buckets_put"] == 1
    got = ray.get(follower.weights.remote())
    assert_same_weights({k: got[k] for k in base_before}, base_before)
    assert_same_weights(
        {k: got[k] for k in ("lora_a", "lora_b")},
        {"lora_a": trainer.lora_a.detach(), "lora_b": trainer.lora_b.detach()},
    )
    assert _row(hub)["last_buckets_fetched"] == 1
    # A subscriber that starts now gets the whole composed state.
    late = make_follower(hub_name).remote()
    assert_same_weights(ray.get(late.weights.remote()), got)
    with pytest.raises(raysync.InvalidWeightsError, match="matches no tensor"):
        hub.push(trainer, keys=["nope*"])


def test_partial_push_needs_a_full_version_first(hub: raysync.HubClient) -> None:
    with pytest.raises(raysync.InvalidWeightsError, match="push the whole model once first"):
        hub.push(LoRAPolicy(), keys=["lora_a"])


def test_cast_on_send_halves_the_bytes(hub: raysync.HubClient, hub_name: str) -> None:
    follower = make_follower(hub_name, dtype=torch.bfloat16).remote()
    ray.get(follower.version.remote())
    trainer = LoRAPolicy(3)  # float32
    with pytest.raises(raysync.WeightMismatchError, match="dtype mismatch"):
        hub.push(trainer)  # without the cast the follower's bf16 model does not fit
    hub.push(trainer, dtype=torch.bfloat16, wait=True, timeout=60)
    expected = {k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()}
    assert_same_weights(ray.get(follower.weights.remote()), expected)
    fp32_bytes = sum(v.numel() * 4 for v in trainer.state_dict().values())
    assert hub.last_push["bytes_put"] <= fp32_bytes // 2 + 256


def test_delta_push_skips_unchanged_buckets(hub: raysync.HubClient, hub_name: str) -> None:
    eager = make_follower(hub_name).remote()
    lazy = make_follower(hub_name, mode="pull").remote()
    ray.get([eager.version.remote(), lazy.version.remote()])
    trainer = LoRAPolicy(4)

    def push_delta() -> int:
        v = hub.push(trainer, bucket_bytes=BUCKET, delta=True)
        wait_for_condition(lambda: ray.get(eager.version.remote()) == v, what=f"eager follower on {v}")
        return v

    push_delta()
    assert ray.get(lazy.sync_now.remote())  # lazy holds version 1
    buckets = hub.last_push["buckets"]
    assert buckets >= 2 and hub.last_push["buckets_put"] == buckets
    with torch.no_grad():
        trainer.base1.weight.mul_(-1)  # one bucket's worth changes
    push_delta()
    assert hub.last_push["buckets_put"] == 1
    with torch.no_grad():
        trainer.base0.weight.mul_(-1)  # another one changes
    push_delta()
    assert hub.last_push["buckets_put"] == 1
    v3 = push_delta() - 1  # nothing changed: nothing put
    assert hub.last_push["bytes_put"] == 0
    # The actor reports each apply to the hub after it holds the version: wait for that report.
    wait_for_condition(
        lambda: {r["mode"]: r for r in hub.status()["subscribers"]}["push"]["applied"] == v3 + 1,
        what="the hub has the push subscriber's report of the last version",
    )
    rows = {r["mode"]: r for r in hub.status()["subscribers"]}
    assert rows["push"]["last_buckets_fetched"] == 0  # held every bucket of the last version already
    # The lazy one skipped versions 2 and 3: it fetches what changed since *its* version 1.
    assert ray.get(lazy.sync_now.remote())
    wait_for_condition(
        lambda: {r["mode"]: r for r in hub.status()["subscribers"]}["pull"]["applied"] == v3 + 1
    )
    assert {r["mode"]: r for r in hub.status()["subscribers"]}["pull"]["last_buckets_fetched"] == 2
    for follower in (eager, lazy):
        assert_same_weights(ray.get(follower.weights.remote()), trainer.state_dict())


def test_prefetch_applies_by_swapping_at_the_next_call(hub: raysync.HubClient, hub_name: str) -> None:
    follower = make_follower(hub_name, prefetch=True).remote()
    ray.get(follower.version.remote())
    first = LoRAPolicy(5)
    hub.push(first, wait=True, timeout=60)  # the first version binds the layout the normal way
    second = LoRAPolicy(6)
    busy = follower.busy.remote(2.0)  # the actor is in the middle of a rollout...
    time.sleep(0.3)
    v2 = hub.push(second)  # ...while version 2 is fetched and staged in the background
    assert ray.get(busy) == 1  # the rollout finished on the version it started with
    # A call after the staging finished swaps it in (on a loaded machine the staging can
    # outlast the 2 s rollout; then a later call does).
    wait_for_condition(lambda: ray.get(follower.version.remote()) == v2, timeout=60, what="v2 swapped in")
    assert_same_weights(ray.get(follower.weights.remote()), second.state_dict())
    row = wait_for_condition(lambda: (r := _row(hub))["applied"] == v2 and r, what="swap reported")
    assert row["last_prefetched"] is True
    with pytest.raises(ValueError, match="apply='copy'"):
        raysync.synced_model("policy", apply="view", prefetch=True)

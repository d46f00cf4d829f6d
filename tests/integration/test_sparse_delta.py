"""Sparse deltas (issue 45): ``hub.push(model, delta="sparse")``.

A trainer with fp32 master weights takes Adam steps at a small learning rate and pushes a bf16
copy: most elements keep their bits, so each changed bucket also gets a patch. A receiver that
holds the patch's base fetches the patch, not the bucket, and ends bit-equal to a full push; one
that does not (joined late, skipped a version) gets whole buckets; one whose weights were changed
behind its back refuses the rebuilt bucket (its checksum) and fetches the whole one.
"""

from __future__ import annotations

from typing import Any

import pytest
import ray
import torch

import raysync
from tests._support import assert_same_weights, wait_for_condition

HUB_SETTINGS = raysync.HubSettings(doorbell_bytes=0)  # by call: a doorbell hands out whole buckets
BUCKET = 64 * 2**10  # bf16: a 128x256 weight per bucket, give or take
LR = 1e-5


def master(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(3)))


def make_actor(hub_name: str, *, is_async: bool = False, **opts: Any) -> Any:
    @raysync.synced_model("policy", hub=hub_name, **opts)
    class Rollout:
        def __init__(self) -> None:
            self.policy = master().to(torch.bfloat16)

        def tamper(self) -> None:
            # through .data: no version counter sees it, so the receiver still believes it holds
            # what it applied (only the patch's checksum finds it)
            self.policy[0].weight.data.add_(1.0)

    if is_async:

        class AsyncRollout(Rollout):
            async def weights(self) -> dict[str, torch.Tensor]:
                return {k: v.clone() for k, v in self.policy.state_dict().items()}

        return ray.remote(num_cpus=0)(AsyncRollout)

    class ThreadedRollout(Rollout):
        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

    return ray.remote(num_cpus=0, max_concurrency=4)(ThreadedRollout)


class Trainer:
    """fp32 master weights, Adam(foreach=True) at a small learning rate, pushed as bf16."""

    def __init__(self, hub: raysync.HubClient) -> None:
        self.hub, self.model = hub, master()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR, foreach=True)

    def step(self) -> None:
        self.opt.zero_grad()
        self.model(torch.randn(32, 256)).pow(2).mean().backward()
        self.opt.step()

    def push(self, **opts: Any) -> int:
        return self.hub.push(
            self.model,
            dtype=torch.bfloat16,
            delta="sparse",
            bucket_bytes=BUCKET,
            wait=True,
            timeout=60,
            **opts,
        )

    def expected(self) -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16) for k, v in self.model.state_dict().items()}


def _row(hub: raysync.HubClient, actor: Any) -> dict[str, Any]:
    (row,) = [r for r in hub.status()["subscribers"] if r["actor_id"] == actor._actor_id.hex()]
    return row


def _applied(hub: raysync.HubClient, actor: Any) -> int | None:
    rows = [r for r in hub.status()["subscribers"] if r["actor_id"] == actor._actor_id.hex()]
    return rows[0]["applied"] if rows else None


def test_sparse_pushes_reach_threaded_and_async_actors_as_patches_bit_equal(
    hub: raysync.HubClient, hub_name: str
) -> None:
    actors = [make_actor(hub_name).remote(), make_actor(hub_name, is_async=True).remote()]
    ray.get([a.raysync_version.remote() for a in actors], timeout=60)
    trainer = Trainer(hub)
    trainer.push()
    assert hub.last_push["buckets_sparse"] == 0  # no base yet: whole buckets
    whole = _row(hub, actors[0])["last_bytes_fetched"]
    for _ in range(3):
        trainer.step()
        v = trainer.push()
        stats = hub.last_push
        # every bucket changed, a few elements each: each got a patch besides its bytes
        assert stats["buckets_put"] == stats["buckets"] == stats["buckets_sparse"] > 1, stats
        assert 0 < stats["bytes_patches"] < stats["bytes_put"] / 2, stats
        for actor in actors:
            assert_same_weights(ray.get(actor.weights.remote()), trainer.expected())
            assert ray.get(actor.raysync_version.remote()) == v
            row = _row(hub, actor)
            assert row["applied"] == v
            assert row["last_bytes_fetched"] == stats["bytes_patches"] < whole / 2, (row, stats)

    v = trainer.push()  # no step since: every bucket re-used, as delta=True does, nothing fetched
    assert (hub.last_push["buckets_put"], hub.last_push["buckets_sparse"]) == (0, 0)
    for actor in actors:
        assert ray.get(actor.raysync_version.remote()) == v and _row(hub, actor)["last_bytes_fetched"] == 0

    with pytest.raises(ValueError, match=r"delta must be one of \(False, True, 'sparse'\), got 'sparce'"):
        hub.push(trainer.model, delta="sparce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sends whole versions: drop keys=, delta= and checksum="):
        hub.push(trainer.model, delta="sparse", transport="nixl")


def test_receivers_without_the_base_get_whole_buckets_and_a_changed_one_refuses_its_patch(
    hub: raysync.HubClient, hub_name: str
) -> None:
    tampered = make_actor(hub_name).remote()
    skipper = make_actor(hub_name, mode="pull").remote()
    ray.get([tampered.raysync_version.remote(), skipper.raysync_version.remote()], timeout=60)
    trainer = Trainer(hub)
    trainer.push()
    whole = _row(hub, tampered)["last_bytes_fetched"]  # every bucket
    assert ray.get(skipper.raysync_sync.remote(timeout=30)) is True
    for _ in range(2):  # the pull subscriber skips the first of these
        trainer.step()
        v = trainer.push()
    assert ray.get(skipper.raysync_sync.remote(timeout=30)) is True
    late = make_actor(hub_name).remote()  # joins now: the newest version
    assert ray.get(late.raysync_version.remote(), timeout=60) == v
    wait_for_condition(lambda: _applied(hub, late) == v, what="the hub has the late actor's report")
    for actor in (skipper, late):  # neither held the base: every bucket whole, bit-equal
        assert_same_weights(ray.get(actor.weights.remote()), trainer.expected())
        assert ray.get(actor.raysync_version.remote()) == v
        assert _row(hub, actor)["last_bytes_fetched"] == whole

    ray.get(tampered.tamper.remote())
    trainer.step()
    v = trainer.push()  # the tampered actor's rebuild of the first bucket fails its checksum
    for actor in (tampered, late):
        assert_same_weights(ray.get(actor.weights.remote()), trainer.expected())
        assert _row(hub, actor)["applied"] == v
    patches = hub.last_push["bytes_patches"]
    assert _row(hub, late)["last_bytes_fetched"] == patches  # it holds the base now
    assert patches < _row(hub, tampered)["last_bytes_fetched"] < whole  # the first bucket whole

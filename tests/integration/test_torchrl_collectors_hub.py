"""torchrl 0.14's own collectors synced through raysync's hub, wired as torchrl's docs wire a scheme.

Every action of the policy equals its bias, so each batch says which weights its
worker acted with. No ``hub.push`` beforehand, no ``RAY_ADDRESS``: the scheme pushes the
collector's policy first, and torchrl's worker processes join the cluster themselves.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

import raysync
from benchmarks._ports import free_port
from tests._support import kill_until_gone, wait_for_condition

pytest.importorskip("torchrl")

from tensordict import TensorDict
from torchrl.collectors import AsyncCollector, Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.collectors.distributed import RayCollector
from torchrl.envs import PendulumEnv

from raysync.torchrl.integration import HubWeightSyncScheme
from tests.integration._torchrl_policies import constant_policy, moody_policy, set_bias

# torchrl's workers start from a forkserver with torchrl imported (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("torchrl_workers_from_a_forkserver")

_KINDS = {
    "AsyncCollector": (lambda pol, **kw: AsyncCollector(PendulumEnv, pol, **kw), 1, False),
    "MultiSyncCollector": (lambda pol, **kw: MultiSyncCollector([PendulumEnv] * 2, pol, **kw), 2, True),
    "MultiAsyncCollector": (lambda pol, **kw: MultiAsyncCollector([PendulumEnv] * 2, pol, **kw), 2, False),
}


def _actions(batch: Any) -> set[float]:
    return {round(float(a), 4) for a in batch["action"].flatten()}


@contextlib.contextmanager
def _closing(collector: Any) -> Iterator[Any]:
    try:
        yield collector
    finally:
        with contextlib.suppress(Exception):
            collector.shutdown()


def _worker_rows(hub_name: str) -> list[dict[str, Any]]:
    rows = raysync.connect(hub_name).status()["subscribers"]
    return sorted((r for r in rows if r["subscriber"].startswith("torchrl-")), key=lambda r: r["class_name"])


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_workers_act_with_every_update(hub_name: str, kind: str) -> None:
    make, workers, sync = _KINDS[kind]
    policy = constant_policy(0.5)
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=60)
    with _closing(
        make(policy, frames_per_batch=8, total_frames=-1, weight_sync_schemes={"policy": scheme})
    ) as c:
        batches = iter(c)
        # The workers got a weightless (meta) copy of the policy: they start from the hub's first version.
        assert _actions(next(batches)) == {0.5}
        for b in (1.0, -1.5):
            set_bias(policy, b)
            c.update_policy_weights_()  # the collector's own policy, trained in place
            if sync:
                assert _actions(next(batches)) == {b}  # from the next batch on
            else:
                # Each worker may hand in the batch it was collecting during the update (documented).
                seen = [_actions(next(batches)) for _ in range(workers + 2)]
                assert all(s == {b} for s in seen[workers:]), seen
        latest = raysync.connect(hub_name).latest("policy")
        rows = _worker_rows(hub_name)
        assert [r["class_name"] for r in rows] == [f"torchrl worker {i}" for i in range(workers)]
        assert all(r["mode"] == "follow" and r["applied"] == latest and r["state"] == "live" for r in rows)


def test_policy_factory_workers_take_explicit_weights(hub_name: str) -> None:
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=60)
    collector = MultiSyncCollector(
        [PendulumEnv] * 2,
        policy_factory=constant_policy,
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    with _closing(collector) as c:
        batches = iter(c)
        assert _actions(next(batches)) == {0.5}  # the factory's own weights: no version yet
        trained = constant_policy(0.0)
        for b in (1.0, -1.5):
            c.update_policy_weights_(set_bias(trained, b))
            assert _actions(next(batches)) == {b}
        c.update_policy_weights_(TensorDict.from_module(set_bias(trained, 0.25)))
        assert _actions(next(batches)) == {0.25}


def _ray_collector(policy: Any, scheme: HubWeightSyncScheme, sync: bool) -> RayCollector:
    """A RayCollector of 2 actors on Pendulum, synced by ``scheme``."""
    return RayCollector(
        [PendulumEnv] * 2,
        policy,
        frames_per_batch=8,
        total_frames=10**6,
        sync=sync,
        weight_sync_schemes={"policy": scheme},
        remote_configs={"num_cpus": 0.1},
    )


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_ray_collector_actors_act_with_every_update(hub_name: str, sync: bool) -> None:
    policy = constant_policy(0.5)
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=60)
    with _closing(_ray_collector(policy, scheme, sync)) as c:
        batches = iter(c)
        assert _actions(next(batches)) == {0.5}
        for b in (1.0, -1.5):
            set_bias(policy, b)
            c.update_policy_weights_()
            seen = [_actions(next(batches)) for _ in range(1 if sync else 4)]
            assert seen[-1] == {b}, seen
            if sync:
                assert seen == [{b}]
        rows = _worker_rows(hub_name)
        assert len(rows) == 2 and all(
            r["applied"] == raysync.connect(hub_name).latest("policy") for r in rows
        )
        assert all(r["actor_id"] for r in rows)  # RayCollector's workers are actors: the hub asks the GCS


def test_a_worker_that_fails_or_falls_behind_makes_the_update_raise(hub_name: str) -> None:
    policy = moody_policy(0.5)
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=4)
    collector = MultiSyncCollector(
        [PendulumEnv], policy, frames_per_batch=8, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    with _closing(collector) as c:
        batches = iter(c)
        assert _actions(next(batches)) == {0.5}

        policy.module.mood = "fail"  # the worker's set_extra_state raises on it
        set_bias(policy, 1.0)
        with pytest.raises(raysync.ApplyError, match="torchrl worker 0") as failed:
            c.update_policy_weights_()
        assert "refuses the mood" in str(failed.value)
        assert _actions(next(batches)) == {0.5}  # it keeps the version it held, whole

        policy.module.mood = "slow"  # the worker takes 6 s to apply: longer than the 4 s timeout
        with pytest.raises(raysync.SyncTimeoutError, match="torchrl worker 0"):
            c.update_policy_weights_()

        policy.module.mood = "ok"
        set_bias(policy, -1.5)
        wait_for_condition(
            lambda: _worker_rows(hub_name)[0]["applied"] == 3, timeout=30, what="slow apply ends"
        )
        c.update_policy_weights_()
        assert _actions(next(batches)) == {-1.5}


def test_a_dead_worker_makes_the_update_raise_and_is_dropped(hub_name: str) -> None:
    policy = constant_policy(0.5)
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=30)
    collector = MultiSyncCollector(
        [PendulumEnv] * 2, policy, frames_per_batch=8, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    with _closing(collector) as c:
        next(iter(c))
        c.procs[1].kill()
        c.procs[1].join()
        set_bias(policy, 1.0)
        with pytest.raises(
            raysync.SyncTimeoutError, match=r"1 of the collector.s 2 workers .* 1 not subscribed"
        ):
            c.update_policy_weights_()
        assert [r["class_name"] for r in _worker_rows(hub_name)] == ["torchrl worker 0"]


_FOLLOWER = textwrap.dedent(
    """
    import hashlib, sys, time
    import ray, torch, raysync
    ray.init(address=sys.argv[1], log_to_driver=False)
    model = torch.nn.Linear(3, 2)
    follower = raysync.follow(model, "policy", hub=sys.argv[2], label="evaluator")
    seen = None
    while True:
        with follower.paused():
            held = (follower.version, hashlib.sha256(b"".join(
                t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest())
        if held != seen:
            print(*held, flush=True)
            seen = held
        time.sleep(0.02)
    """
)


def _digest(module: torch.nn.Module) -> str:
    return hashlib.sha256(
        b"".join(t.detach().numpy().tobytes() for t in module.state_dict().values())
    ).hexdigest()


def test_a_plain_process_follows_the_hub_and_is_dropped_when_it_dies(hub_name: str, tmp_path: Any) -> None:
    hub = raysync.connect(hub_name, settings=raysync.HubSettings(drop_silent_s=4))  # dropped within 6 s
    hub.push(torch.nn.Linear(3, 2), "policy")
    script = tmp_path / "follower.py"
    script.write_text(_FOLLOWER)
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, str(script), address, hub_name],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split()[0] == "1"  # it started from the newest version
        trained = torch.nn.Linear(3, 2)
        version = hub.push(trained, "policy", wait=True, timeout=60)  # waits for the follower too
        held, digest = proc.stdout.readline().split()
        assert (int(held), digest) == (version, _digest(trained))  # bit for bit, the version it reports
        (row,) = [r for r in hub.status()["subscribers"] if r["class_name"] == "evaluator"]
        assert (row["mode"], row["applied"], row["actor_id"], row["pid"]) == (
            "follow",
            version,
            None,
            proc.pid,
        )
    finally:
        proc.kill()
        proc.wait()
    wait_for_condition(
        lambda: not any(r["class_name"] == "evaluator" for r in hub.status()["subscribers"]),
        timeout=60,
        what="the hub drops a follower whose process died",
    )
    version = hub.push(torch.nn.Linear(3, 2), "policy", wait=True, timeout=10)  # nobody left to wait for
    assert hub.latest("policy") == version


def test_workers_follow_the_hub_through_its_restart(hub_name: str) -> None:
    policy = constant_policy(0.5)
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=60)
    collector = MultiSyncCollector(
        [PendulumEnv], policy, frames_per_batch=8, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    with _closing(collector) as c:
        batches = iter(c)
        assert _actions(next(batches)) == {0.5}
        hub = raysync.connect(hub_name)
        kill_until_gone(hub.actor, no_restart=False)  # the hub process dies; Ray restarts it
        set_bias(policy, 1.0)
        c.update_policy_weights_()  # waits for the restarted hub, and for the worker's acknowledgement
        assert _actions(next(batches)) == {1.0}
        # It acknowledged the version (what the update waited for); it registers again at its
        # next check-in, until then the restarted hub lists it as "restoring".
        wait_for_condition(
            lambda: (
                [(r["state"], r["applied"]) for r in _worker_rows(hub_name)]
                == [("live", hub.latest("policy"))]
            ),
            timeout=30,
            what="the worker registered again, holding the newest version",
        )


def test_collectors_follow_a_sharded_trainer(hub_name: str) -> None:
    """An FSDP2 trainer of 2 Ray actor ranks pushes (every rank its own shard; rank 1's are empty);
    torchrl's collectors in the driver only follow: their workers act with each version whole."""
    ranks = _sharded_group()
    try:
        ray.get([r.make_policy.remote(0.5) for r in ranks], timeout=60)
        pushed = ray.get([r.push.remote(hub_name) for r in ranks], timeout=60)
        first = pushed[0][0]
        assert [(p[0], p[1]["world"]) for p in pushed] == [(first, 2), (first, 2)]  # one version, 2 writers
        hub = raysync.connect(hub_name)
        wait_for_condition(lambda: hub.latest("policy") == first, what="the first version published")
        policy = constant_policy(-1.0)  # the driver's own copy: never pushed
        scheme = HubWeightSyncScheme(hub=hub_name, timeout=60, follow_only=True)
        collector = MultiSyncCollector(
            [PendulumEnv] * 2,
            policy,
            frames_per_batch=8,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme},
        )
        with _closing(collector) as c:
            batches = iter(c)
            assert _actions(next(batches)) == {0.5}  # the trainer's version, not the driver's policy
            assert hub.latest("policy") == first
            for b in (1.25, -0.75):
                ray.get([r.set_bias.remote(b) for r in ranks], timeout=60)
                version = ray.get([r.push.remote(hub_name) for r in ranks], timeout=60)[0][0]
                # a rank's push returns once the hub has its shard: published once both are in
                wait_for_condition(lambda v=version: hub.latest("policy") == v, what="published")
                c.update_policy_weights_()  # returns once both workers hold the trainer's newest
                assert scheme.version == version == hub.latest("policy")
                assert _actions(next(batches)) == {b}
                assert float(policy.module.lin.bias.detach()) == b  # and the driver's own policy
            rows = _worker_rows(hub_name)
            assert len(rows) == 2 and all(r["applied"] == version for r in rows), rows
            with pytest.raises(ValueError, match="follow_only=True"):
                c.update_policy_weights_(constant_policy(3.0))  # weights of its own: never pushed from here
            assert hub.latest("policy") == version  # the driver pushed nothing
    finally:
        for r in ranks:
            ray.kill(r)


@ray.remote(num_cpus=0)
class _Trainer:
    """A trainer actor: the only writer of model ``policy`` on each hub it pushes to."""

    def __init__(self) -> None:
        self.hubs: dict[str, raysync.HubClient] = {}

    def push(self, hub_name: str, bias: float) -> int:
        hub = self.hubs.get(hub_name) or self.hubs.setdefault(hub_name, raysync.connect(hub_name))
        return int(hub.push(constant_policy(bias), "policy"))


@pytest.fixture(scope="module")
def trainer(ray_start_regular: dict[str, Any]) -> Iterator[Any]:
    """One trainer process for the tests that follow one (each pushes to its own hub: a hub of its
    test's name, whose lease and versions no other test sees)."""
    actor = _Trainer.remote()
    yield actor
    ray.kill(actor)


def test_a_collector_in_the_driver_follows_a_trainer_actor(hub_name: str, trainer: Any) -> None:
    """``follow_only`` with torchrl's single-process ``Collector``: it acts with its own policy, which
    ``update_policy_weights_()`` brings to the trainer actor's newest version."""
    hub = raysync.connect(hub_name)
    policy = constant_policy(-1.0)
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=30, follow_only=True)
    collector = Collector(
        PendulumEnv(), policy, frames_per_batch=8, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    with _closing(collector) as c:
        batches = iter(c)
        assert _actions(next(batches)) == {-1.0}  # nothing pushed yet, and the driver pushes nothing
        for b in (0.75, 1.5):
            version = ray.get(trainer.push.remote(hub_name, b), timeout=60)
            wait_for_condition(lambda v=version: hub.latest("policy") == v, what="published")
            c.update_policy_weights_()
            assert scheme.version == version and _actions(next(batches)) == {b}


def test_ray_collector_actors_follow_a_trainer_actor(hub_name: str, trainer: Any) -> None:
    """``follow_only`` with ``RayCollector``: its actors act with the trainer actor's versions, and
    ``update_policy_weights_()`` returns once both hold the newest."""
    hub = raysync.connect(hub_name)
    first = ray.get(trainer.push.remote(hub_name, 0.25), timeout=60)
    wait_for_condition(lambda: hub.latest("policy") == first, what="published")
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=60, follow_only=True)
    with _closing(_ray_collector(constant_policy(-1.0), scheme, sync=True)) as c:
        c.update_policy_weights_()  # as torchrl asks of a RayCollector before it iterates
        batches = iter(c)
        assert _actions(next(batches)) == {0.25}  # the trainer's version, not the driver's policy
        version = ray.get(trainer.push.remote(hub_name, -0.5), timeout=60)
        wait_for_condition(lambda: hub.latest("policy") == version, what="published")
        c.update_policy_weights_()
        assert _actions(next(batches)) == {-0.5}
        rows = _worker_rows(hub_name)
        assert len(rows) == 2 and all(r["applied"] == version for r in rows), rows


def _sharded_group(world: int = 2) -> list[Any]:
    from tests import _sharded

    port = free_port()
    cls = ray.remote(num_cpus=0)(_sharded.Rank)
    return [cls.remote(r, world, port) for r in range(world)]


def test_a_follow_only_collector_before_any_push_raises_within_its_timeout(hub: raysync.HubClient) -> None:
    """Created before its writer's first push, a follow_only collector fails in its constructor with
    one SyncTimeoutError naming what to do, within its timeout: no worker starts (issue 48)."""
    scheme = HubWeightSyncScheme(hub=hub.name, timeout=5, follow_only=True)
    t0 = time.monotonic()
    with pytest.raises(raysync.SyncTimeoutError, match=r"no version of 'policy' on hub .* within 5 s"):
        MultiSyncCollector(
            [PendulumEnv] * 2,
            constant_policy(-1.0),
            frames_per_batch=8,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme},
        )
    elapsed = time.monotonic() - t0
    assert elapsed < 5 + 15, f"took {elapsed:.1f} s"  # the timeout, and a loaded machine's margin
    assert _worker_rows(hub.name) == []  # no worker was started

"""One writer per model, and a hub that restarts without anyone stepping in."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from typing import Any

import pytest
import ray
import torch

import raysync
from tests._support import (
    assert_same_weights,
    kill_until_gone,
    small_policy,
    wait_for_condition,
)
from tests.integration.test_synced import make_collector


@ray.remote(num_cpus=0)
class Trainer:
    """A second trainer process."""

    def __init__(self, hub_name: str, takeover: bool) -> None:
        self.hub_name = hub_name
        self.hub = raysync.connect(hub_name, takeover=takeover)

    def take_over(self) -> None:
        """Connect again, with ``takeover=True``, as a trainer restarted to take over would."""
        self.hub = raysync.connect(self.hub_name, takeover=True)

    def push(self, seed: int, wait: bool = False, timeout: float | None = None) -> Any:
        try:
            return self.hub.push(small_policy(seed), wait=wait, timeout=timeout)
        except raysync.StaleWriterError as err:
            return f"refused: {err}"

    def latest(self) -> int | None:
        return self.hub.latest()


def test_one_writer_per_model_until_takeover_or_death(hub: raysync.HubClient, hub_name: str) -> None:
    assert hub.push(small_policy(1)) == 1  # this driver now holds the lease
    assert raysync.connect(hub_name).push(small_policy(2)) == 2  # same process, same lease
    intruder = Trainer.remote(hub_name, False)
    refused = ray.get(intruder.push.remote(3))
    assert refused.startswith("refused: model 'policy' is written by driver of job")
    assert "takeover=True" in refused
    assert hub.latest() == 2  # nothing interleaved
    assert hub.push(small_policy(4), "other") == 1  # other models are free

    new_trainer = intruder  # the refused process connects again, with takeover=True (a process less)
    ray.get(new_trainer.take_over.remote())
    taken = ray.get(new_trainer.push.remote(5))  # explicit takeover: a new lease, a new block
    assert taken > 2
    # The old writer (a job's driver) asks the hub for the newest version before it stamps: a newer
    # one than it stamped means the lease moved on, so it asks for the lease again and is refused at
    # once, never handing out a number from its old block (raysync.client.writer_lease.LeaseMoved).
    with pytest.raises(raysync.StaleWriterError, match=r"written by actor .*takeover=True"):
        hub.push(small_policy(6))
    with pytest.raises(PermissionError):  # and again: refused at once
        hub.push(small_policy(6))
    assert hub.latest() == taken  # the refused version was never kept
    assert ray.get(new_trainer.push.remote(7)) == taken + 1
    # the new writer stamps it and sends it one way: the hub may read it a moment after the reply
    wait_for_condition(lambda: hub.latest() == taken + 1, timeout=30, what="the new writer's version kept")
    assert_same_weights(hub.pull().flatten_keys(".").to_dict(), small_policy(7).state_dict())

    ray.kill(new_trainer)  # a writer that dies gives up its lease
    wait_for_condition(lambda: _pushes(hub, 8), timeout=30, what="lease released by the dead writer")
    assert hub.status()["models"]["policy"]["writer"]["actor_id"] is None  # back to this driver


def _pushes(hub: raysync.HubClient, seed: int) -> bool:
    try:
        hub.push(small_policy(seed))
    except raysync.StaleWriterError:
        return False
    return True


def test_hub_restart_resumes_sync_without_a_manual_step(hub: raysync.HubClient, hub_name: str) -> None:
    collectors = [make_collector(hub_name).remote() for _ in range(2)]
    ray.get([c.raysync_version.remote() for c in collectors])
    for seed in range(3):
        v = hub.push(small_policy(seed), wait=True, timeout=60)
    assert v == 3
    old_pid = kill_until_gone(hub.actor, no_restart=False)  # the hub process dies; Ray restarts it

    # The client retries through the restart; version numbers continue, never repeat.
    v4 = hub.push(small_policy(10))
    assert v4 == 4

    def hub_pid() -> int | None:
        try:
            pid: int = ray.get(hub.actor.configure.remote(2))["pid"]
            return pid
        except ray.exceptions.ActorUnavailableError:
            return None  # Ray may report the restart to this handle once more: ask again

    assert wait_for_condition(hub_pid, timeout=30, what="the restarted hub answering") != old_pid
    status = hub.status()
    assert status["restored_models"] == ["policy"]
    # Subscribers notice (heartbeat), register again with the version they hold...
    wait_for_condition(lambda: len(hub.status()["subscribers"]) == 2, timeout=30, what="re-registered")
    # ...and the next pushes reach them as before.
    v5 = hub.push(small_policy(11), wait=True, timeout=60)
    for c in collectors:
        assert ray.get(c.raysync_version.remote()) == v5
        assert_same_weights(ray.get(c.weights.remote()), small_policy(11).state_dict())


def test_connect_while_the_hub_restarts_waits_for_it(hub: raysync.HubClient, hub_name: str) -> None:
    """A trainer restarting at the same time as the hub (connect() first) gets a working client."""
    assert hub.push(small_policy(0)) == 1
    for i in range(2):
        kill_until_gone(hub.actor, no_restart=False)  # the hub process dies; Ray restarts it
        client = raysync.connect(hub_name, keep=3)  # must not raise ActorUnavailableError
        assert client.push(small_policy(i + 1)) == i + 2  # numbers continue across the restart
    assert ray.get(client.actor.configure.remote())["keep"] == 3


def test_check_finite_refuses_nan_and_inf(hub: raysync.HubClient) -> None:
    weights = {
        "ok": torch.ones(3),
        "bad": torch.tensor([1.0, float("nan")]),
        "worse": torch.tensor([float("inf")]),
    }
    with pytest.raises(raysync.InvalidWeightsError, match=r"NaN or Inf in \['bad', 'worse'\]"):
        hub.push(weights, check_finite=True)
    assert hub.latest() is None
    assert hub.push(weights) == 1  # without the check it is the caller's business


def test_version_larger_than_the_object_store_is_refused_before_any_copy(hub: raysync.HubClient) -> None:
    capacity = next(
        n["Resources"]["object_store_memory"]
        for n in ray.nodes()
        if n["NodeID"] == ray.get_runtime_context().get_node_id()
    )
    # A tensor whose storage is never touched: the check happens before any byte is copied.
    huge = {"w": torch.empty(int(capacity) // 4 + 1024, dtype=torch.float32)}
    with pytest.raises(raysync.InvalidWeightsError, match=r"GiB, more than this node's object store"):
        hub.push(huge)
    assert hub.latest() is None


# ---------------------------------------------------------------------- pushes that return after the snapshot


def test_a_refusal_of_a_push_that_did_not_wait_surfaces_on_the_next_push(
    hub: raysync.HubClient, hub_name: str
) -> None:
    # The old writer is an actor: a job's driver or task re-reads its lease before stamping
    # (test_one_job_writers.py), an actor (one process) stamps from its block without asking.
    old = Trainer.remote(hub_name, False)
    assert ray.get(old.push.remote(1)) == 1  # a new layout: this push waited for the hub's answer
    other = Trainer.remote(hub_name, True)
    taken = ray.get(other.push.remote(2))  # takes the writer lease over
    # The same layout, stamped from the old writer's block: returns before the hub answers.
    assert ray.get(old.push.remote(3)) == 2
    assert ray.get(old.latest.remote()) == taken  # a query reads the answers first: 2 was refused
    refused = ray.get(old.push.remote(4))  # the refusal of version 2 raises here; nothing more is pushed
    assert re.match(r"refused: .*refused version 2 of 'policy' \(an earlier push.*takeover=True", refused), (
        refused
    )
    # After a refusal the next push waits for the answer: refused on the push itself.
    again = ray.get(old.push.remote(4))
    assert again.startswith("refused: ") and "refused version" not in again, again
    assert hub.latest() == taken  # neither was kept
    ray.kill(other)
    ray.kill(old)
    v = wait_for_condition(lambda: _push_or_none(hub, 5), timeout=30, what="the dead writer's lease released")
    assert v > taken  # numbers handed out before (and refused) are never handed out again
    assert_same_weights(hub.pull().flatten_keys(".").to_dict(), small_policy(5).state_dict())


def test_a_push_with_wait_that_the_hub_refused_says_it_was_that_push(
    hub: raysync.HubClient, hub_name: str
) -> None:
    old = Trainer.remote(hub_name, False)  # an actor stamps from its block without asking first
    assert ray.get(old.push.remote(1)) == 1
    other = Trainer.remote(hub_name, True)
    assert isinstance(ray.get(other.push.remote(2)), int)  # takes the writer lease over
    said = ray.get(old.push.remote(3, True, 30))  # stamped from the old block: refused
    assert re.search(
        r"refused version 2 of 'policy' \(the version this call waits for: it was not published\)", said
    ), said
    assert "an earlier push" not in said
    ray.kill(other)
    ray.kill(old)


def _push_or_none(hub: raysync.HubClient, seed: int) -> int | None:
    try:
        return hub.push(small_policy(seed))
    except raysync.StaleWriterError:
        return None


def test_hub_restart_with_pushes_in_flight_issues_no_number_twice(
    hub: raysync.HubClient, hub_name: str
) -> None:
    collectors = [make_collector(hub_name).remote() for _ in range(2)]
    ray.get([c.raysync_version.remote() for c in collectors])
    versions = [hub.push(small_policy(seed)) for seed in range(3)]
    ray.kill(hub.actor, no_restart=False)  # dies with publishes in flight or just sent
    versions += [hub.push(small_policy(seed)) for seed in range(3, 8)]  # sent while it restarts
    # One writer, one block granted before the restart and kept in the GCS: numbers continue.
    assert versions == list(range(1, 9))
    hub.wait(8, timeout=60)  # a publish the restart swallowed is offered again
    assert hub.latest() == 8
    for c in collectors:
        assert ray.get(c.raysync_version.remote()) == 8
        assert_same_weights(ray.get(c.weights.remote()), small_policy(7).state_dict())
    # A second writer after the restart gets numbers past every one granted before it.
    other = Trainer.remote(hub_name, True)
    assert ray.get(other.push.remote(9)) > 8


@ray.remote(num_cpus=0, max_restarts=1)
class RestartableTrainer:
    """A trainer actor Ray restarts: the same actor (the same writer) in a new process."""

    def __init__(self, hub_name: str) -> None:
        self.hub = raysync.connect(hub_name)

    def push(self, seed: int) -> int:
        return self.hub.push(small_policy(seed))

    def pid(self) -> int:
        return os.getpid()


def test_a_restarted_trainer_actor_never_reuses_a_number(hub: raysync.HubClient, hub_name: str) -> None:
    trainer = RestartableTrainer.remote(hub_name)
    first = [ray.get(trainer.push.remote(seed)) for seed in range(3)]
    assert first == [1, 2, 3]
    old_pid = ray.get(trainer.pid.remote())
    ray.kill(trainer, no_restart=False)
    wait_for_condition(lambda: _pid(trainer) not in (None, old_pid), timeout=60, what="trainer restarted")
    # Its first life may have stamped any number of its block: the new process takes a new one.
    later = ray.get(trainer.push.remote(4))
    assert later > max(first) and later not in range(1, 101)
    assert ray.get(trainer.push.remote(5)) == later + 1
    # A push returns before the hub has read it: this process asks the hub, not the trainer's client
    wait_for_condition(lambda: hub.latest() == later + 1, what="the hub holds the trainer's last push")
    assert_same_weights(hub.pull().flatten_keys(".").to_dict(), small_policy(5).state_dict())


def _pid(actor: Any) -> int | None:
    try:
        pid: int = ray.get(actor.pid.remote(), timeout=10)
        return pid
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


_DRIVER = """
import sys, ray, torch, raysync
ray.init(address=sys.argv[1], namespace="raysync", logging_level="error", log_to_driver=False)
hub = raysync.connect(sys.argv[2])
torch.manual_seed(int(sys.argv[3]))
print([hub.push({"w": torch.randn(4)}) for _ in range(3)])
"""


def test_a_restarted_driver_never_reuses_a_number(
    hub: raysync.HubClient, hub_name: str, ray_start_regular: dict[str, Any]
) -> None:
    address = ray_start_regular["gcs_address"]
    runs = []
    for seed in range(2):  # the second driver is the first one restarted (a new job)
        done = subprocess.run(
            [sys.executable, "-c", _DRIVER, address, hub_name, str(seed)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
    assert runs[0] == [1, 2, 3]
    # The dead job's lease passes on; its block (which it might have used) is never granted again.
    assert runs[1][0] > 100 and runs[1] == [runs[1][0] + i for i in range(3)]
    assert hub.latest() == runs[1][-1]  # (its bytes went with the driver that pushed them)

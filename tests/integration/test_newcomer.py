"""What a newcomer trips on (issue 27): waits, pulls, never-pushed versions, reused model ids."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

import raysync
from raysync.client.deadline import ANSWER_GRACE_S
from tests._support import (
    CLIENT_MARGIN_S,
    assert_same_weights,
    kill_until_gone,
    small_policy,
    wait_for_condition,
)
from tests.integration.test_fencing_restart import Trainer
from tests.integration.test_synced import make_collector


def _rows(hub: raysync.HubClient) -> list[dict]:
    return list(hub.status()["subscribers"])


def test_wait_counts_the_collectors_just_created(hub: raysync.HubClient, hub_name: str) -> None:
    """The README's first snippet (8 collectors there, 2 here: a process each): collectors
    created, a push, a wait that covers them all."""
    collectors = [make_collector(hub_name).remote() for _ in range(2)]
    v = hub.push(small_policy(1))  # before any of them registered (a process takes seconds to start)
    hub.wait(v, timeout=120, subscribers=2)
    rows = _rows(hub)
    assert len(rows) == 2 and all(r["applied"] == v for r in rows)  # not "0 subscribers: done"
    for c in collectors:
        assert ray.get(c.raysync_version.remote()) == v
    t0 = time.monotonic()
    with pytest.raises(raysync.SyncTimeoutError, match="only 2 of the 3 push-mode subscribers"):
        hub.wait(v, timeout=2, subscribers=3)
    assert time.monotonic() - t0 < 2 + ANSWER_GRACE_S + CLIENT_MARGIN_S  # wait(timeout=T)'s bound
    with pytest.raises(ValueError, match="subscribers"):
        hub.wait(v, subscribers=-1)


def test_wait_on_a_version_never_pushed_names_it(hub: raysync.HubClient, hub_name: str) -> None:
    v = hub.push(small_policy(1))
    timeout = 60.0
    t0 = time.monotonic()
    with pytest.raises(
        raysync.UnknownModelError, match=f"version {v + 1} of model 'policy' was never pushed"
    ):
        hub.wait(v + 1, timeout=timeout)  # no subscriber: it did not return "done" at once
    # nor wait the whole timeout: the hub answers at once for a number it never granted (one
    # granted and not published yet within its publish's grace, 2 s)
    assert time.monotonic() - t0 < timeout
    collector = make_collector(hub_name).remote()
    hub.wait(v, timeout=60, subscribers=1)
    with pytest.raises(raysync.UnknownModelError):
        hub.wait(v + 7, timeout=60)  # with a subscriber: not a SyncTimeoutError after 60 s
    ray.kill(collector)


def test_wait_on_a_refused_push_says_it_was_never_pushed(hub: raysync.HubClient, hub_name: str) -> None:
    v = hub.push(small_policy(1))
    collector = make_collector(hub_name).remote()
    hub.wait(v, timeout=60, subscribers=1)
    refused = hub.next_version()
    with pytest.raises(raysync.WeightMismatchError):
        hub.push(torch.nn.Linear(3, 3))  # fits no subscriber: refused, never published
    with pytest.raises(raysync.UnknownModelError, match="never pushed"):
        hub.wait(refused, timeout=30)
    ray.kill(collector)


def test_load_state_dict_of_what_pull_returns(hub: raysync.HubClient) -> None:
    """What a torch user writes first: ``model.load_state_dict(hub.pull())``."""
    trained = small_policy(3)
    hub.push(trained)
    model = small_policy(0)
    model.load_state_dict(hub.pull())
    assert_same_weights(model.state_dict(), trained.state_dict())
    model = small_policy(0)
    model.load_state_dict(hub.pull(state_dict=True))  # a plain dict, as before
    assert_same_weights(model.state_dict(), trained.state_dict())
    nested = hub.pull().unflatten_keys(".")  # still a TensorDict
    assert torch.equal(nested["0", "weight"], trained[0].weight)


def test_a_model_id_reused_with_another_layout_is_not_offered(hub: raysync.HubClient, hub_name: str) -> None:
    """A new job, another architecture, the same model_id: its actors do not try the old job's
    versions (nor report errors about them), and start with the new job's first push (a new
    writer: its first version establishes the model's layout afresh)."""

    def other() -> torch.nn.Module:
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(3, 5))

    old_trainer = Trainer.remote(hub_name, False)  # "the old job"'s trainer
    for seed in (1, 2, 3):
        old = ray.get(old_trainer.push.remote(seed))
    kill_until_gone(old_trainer)  # the old job ended
    new_actors = [make_collector(hub_name, factory=other).remote() for _ in range(2)]
    evaluator = make_collector(hub_name, factory=other, mode="pull").remote()
    ray.get([a.raysync_version.remote() for a in [*new_actors, evaluator]])
    wait_for_condition(lambda: len(_rows(hub)) == 3, what="the new job's subscribers registered")
    rows = _rows(hub)
    assert all(r["applied"] is None and r["last_error"] is None for r in rows), rows
    assert all("a version that fits" in (r["waiting_for"] or "") for r in rows)
    assert all(ray.get(a.raysync_version.remote()) is None for a in new_actors)
    with pytest.raises(Exception, match=r"WeightMismatchError|missing"):  # the evaluator asks: a real error
        ray.get(evaluator.sync_now.remote())
    new = hub.push(other())  # "the new job's" first push: it fits them all
    assert new > old
    hub.wait(new, timeout=60)
    for a in new_actors:
        assert ray.get(a.raysync_version.remote()) == new
        assert_same_weights(ray.get(a.weights.remote()), other().state_dict())
    rows = {r["subscriber"]: r for r in _rows(hub)}
    assert all(r["last_error"] is None for r in rows.values()), rows  # the evaluator's is superseded
    assert all(r["waiting_for"] is None for r in rows.values())


def test_lag_counts_versions_not_numbers(hub: raysync.HubClient, hub_name: str) -> None:
    """A new writer's numbers start past every number granted before (here +100): lag stays 1."""
    evaluator = make_collector(hub_name, mode="pull").remote()
    first = hub.push(small_policy(1))
    ray.get(evaluator.sync_now.remote())
    assert ray.get(evaluator.raysync_version.remote()) == first

    @ray.remote(num_cpus=0)
    def other_writer(name: str) -> int:
        return raysync.connect(name, takeover=True).push(small_policy(2))

    second = ray.get(other_writer.remote(hub_name))
    assert second - first >= 100  # another writer: another block of numbers
    row = _rows(hub)[0]
    assert row["applied"] == first and row["lag"] == 1


def _polls(hub_name: str) -> list[threading.Thread]:
    """This process's threads that poll hub ``hub_name`` (or its node's relay) for their calls."""
    return [t for t in threading.enumerate() if t.name.startswith("raysync-poll-") and hub_name in t.name]


def test_a_stopped_follower_takes_no_version_and_the_last_one_ends_its_process_poll(
    hub: raysync.HubClient, hub_name: str
) -> None:
    """Two Followers in this plain process hear of versions through one poll of its node's delivery.
    One stops: it takes no further version and leaves the hub, the other goes on; once the
    last one stops, the process polls no more (no thread left behind)."""
    trainer = small_policy(0)
    hub.push(trainer)
    follower = raysync.follow(small_policy(1), "policy", hub=hub_name)
    witness = raysync.follow(small_policy(2), "policy", hub=hub_name)  # goes on following
    try:
        follower.wait_for(1, timeout=30)
        assert _polls(hub_name), "the followers' process polls for the hub's calls"
        follower.stop()
        assert follower.sub_id not in {r["subscriber"] for r in hub.status()["subscribers"]}
        with torch.no_grad():
            next(iter(trainer.parameters())).add_(1.0)
        v = hub.push(trainer)
        witness.wait_for(v, timeout=30)  # a follower that still followed would have it by now too
        hub.wait(v, timeout=30)  # the stopped one is not waited for
        assert follower.version == 1
    finally:
        witness.stop()
    wait_for_condition(lambda: not _polls(hub_name), timeout=30, what="the process's poll ended")


@ray.remote(num_cpus=0)
def _follow_in_a_task(hub_name: str, after: int) -> tuple[int | None, dict[str, torch.Tensor]]:
    """A Follower in a Ray task's worker (no actor; the driver's job): it holds a version newer
    than ``after`` the driver pushes once it sees this one registered."""
    module = small_policy(7)
    follower = raysync.follow(module, "policy", hub=hub_name, label="task follower")
    try:
        version = follower.wait_for(after + 1, timeout=60)
        with follower.paused():
            return version, {k: v.clone() for k, v in module.state_dict().items()}
    finally:
        follower.stop()


def test_followers_in_the_driver_and_in_its_tasks_each_get_every_version(
    hub: raysync.HubClient, hub_name: str
) -> None:
    """A driver and the workers of its Ray tasks share one job: each process's Followers are
    called at an address of their own (job, node, pid), never each other's."""
    v1 = hub.push(small_policy(1))
    mine = small_policy(8)
    follower = raysync.follow(mine, "policy", hub=hub_name)
    try:
        task = _follow_in_a_task.remote(hub_name, v1)
        wait_for_condition(
            lambda: any(r["class_name"] == "task follower" for r in hub.status()["subscribers"]),
            timeout=60,
            what="the task's follower registered",
        )
        trained = small_policy(2)
        v2 = hub.push(trained)
        held, weights = ray.get(task, timeout=120)
        assert held == v2
        assert_same_weights(weights, trained.state_dict())
        assert follower.wait_for(v2, timeout=60) == v2
        with follower.paused():
            assert_same_weights(mine.state_dict(), trained.state_dict())
    finally:
        follower.stop()

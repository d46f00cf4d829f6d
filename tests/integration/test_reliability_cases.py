"""Issue 14's cases, one test (or more) each: raysync never reports a version that is not held,
and never stalls an actor.

Every version fills every tensor with its own number (``filled``), so "the actor
holds what it reports" is checked bit for bit: every element of every tensor
equals the version the actor reports (``holds``).
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import Any
from unittest.mock import ANY

import pytest
import ray
import torch

import raysync
from benchmarks import soak
from raysync.client.deadline import ANSWER_GRACE_S
from tests._support import CLIENT_MARGIN_S, kill_until_gone, mismatched_subscriber, wait_for_condition
from tests.integration.test_reliability import (
    BUCKET_BYTES,
    SIZE_MIB,
    TENSORS,
    Gate,
    _dead,
    filled,
    holds,
    make_sub,
    push,
)

# Every call to an actor here must answer within this, a new actor's start included (Python, Ray
# and torch imports: seen past 20 s on a loaded 2-core machine): a stuck actor fails the test.
CALL_S = 60


def _hub_pid(hub: raysync.HubClient) -> int:
    return int(ray.get(hub.actor.configure.remote(), timeout=CALL_S)["pid"])


def _restart_hub(hub: raysync.HubClient) -> None:
    """Kill the hub's process; Ray restarts it (detached, max_restarts=-1). Returns once it answers."""
    before = _hub_pid(hub)
    ray.kill(hub.actor, no_restart=False)

    def restarted() -> bool:
        try:
            return _hub_pid(hub) != before
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    wait_for_condition(restarted, timeout=60, what="the hub restarted")


def _held(version: int) -> dict[str, Any]:
    """What ``check`` answers for an actor that holds ``version`` whole."""
    return {"version": version, "values": [float(version)]}


def _status_row(hub: raysync.HubClient, actor: Any) -> dict[str, Any] | None:
    actor_id = actor._actor_id.hex()
    rows = [r for r in hub.status()["subscribers"] if r["actor_id"] == actor_id]
    return rows[0] if rows else None


# ---------------------------------------------------------------------- case 1: hub restart


def test_case01_wait_after_a_hub_restart_returns_only_once_the_version_is_held(
    hub: raysync.HubClient, hub_name: str
) -> None:
    sub = make_sub(hub_name)
    push(hub, 1)
    hub.wait(1, timeout=CALL_S)
    gate = Gate.remote()
    busy = sub.hang.remote(gate)  # the subscriber cannot apply anything until the gate opens
    wait_for_condition(
        lambda: ray.get(gate.waiters.remote()) == 1, timeout=2 * CALL_S, what="the subscriber is busy"
    )
    push(hub, 2)
    _restart_hub(hub)  # the restarted hub has lost version 2 and has heard from nobody yet
    opened_at: list[float] = []

    def open_later() -> None:
        time.sleep(4)
        opened_at.append(time.monotonic())
        ray.get(gate.open.remote())

    opener = threading.Thread(target=open_later)
    opener.start()
    hub.wait(2, timeout=60)
    returned_at = time.monotonic()
    opener.join()
    ray.get(busy, timeout=CALL_S)
    assert opened_at and returned_at >= opened_at[0], "wait returned while the subscriber held version 1"
    assert holds(sub, 2)


def test_case01_push_wait_right_after_a_hub_restart_waits_for_the_known_subscribers(
    hub: raysync.HubClient, hub_name: str
) -> None:
    sub = make_sub(hub_name)
    push(hub, 1)
    hub.wait(1, timeout=CALL_S)
    gate = Gate.remote()
    busy = sub.hang.remote(gate)
    wait_for_condition(
        lambda: ray.get(gate.waiters.remote()) == 1, timeout=2 * CALL_S, what="the subscriber is busy"
    )
    _restart_hub(hub)
    opened_at: list[float] = []

    def open_later() -> None:
        opened_at.append(time.monotonic())  # before the gate opens: the subscriber applies only after
        ray.get(gate.open.remote())

    opener = threading.Timer(4, open_later)
    opener.start()
    push(hub, 2, wait=True, timeout=60)
    returned_at = time.monotonic()
    opener.join()
    assert opened_at and returned_at >= opened_at[0], (
        "push(wait=True) returned before the subscriber could apply"
    )
    ray.get(busy, timeout=CALL_S)
    assert holds(sub, 2)
    assert _status_row(hub, sub)["applied"] == 2  # type: ignore[index]


# ---------------------------------------------------------------------- case 2: re-pointed params


def _repointing_sub(hub_name: str, **opts: Any) -> Any:
    @raysync.synced_model("policy", hub=hub_name, **opts)
    class Repointing:
        def __init__(self) -> None:
            self.policy = soak.Filled(SIZE_MIB, TENSORS)

        def restore_checkpoint(self, state: dict[str, torch.Tensor]) -> int | None:
            self.policy.load_state_dict(state, assign=True)
            return self.raysync_version()  # type: ignore[attr-defined]

        def to_double(self) -> None:
            self.policy.double()

        def check(self) -> dict[str, Any]:
            from tests.integration.test_reliability import _report

            return _report(self)

    return ray.remote(num_cpus=0)(Repointing).remote()


def test_case02_restored_checkpoint_with_assign_is_not_reported_as_a_version(
    hub: raysync.HubClient, hub_name: str
) -> None:
    sub = _repointing_sub(hub_name)
    push(hub, 1)
    hub.wait(1, timeout=CALL_S)
    # The user restores a checkpoint: the actor holds its values, not version 1.
    assert ray.get(sub.restore_checkpoint.remote(filled(7)), timeout=CALL_S) is None
    # Push mode: the newest version comes back by itself, bit for bit.
    wait_for_condition(
        lambda: ray.get(sub.check.remote(), timeout=CALL_S) == {**_held(1), "pid": ANY},
        what="version 1 applied again after the re-pointing",
    )
    for v in (2, 3):
        push(hub, v)
        hub.wait(v, timeout=CALL_S)
        assert holds(sub, v)
        row = _status_row(hub, sub)
        assert row is not None and row["applied"] == v and row["lag"] == 0


def test_case02_dtype_changed_by_user_code_fails_the_apply_loudly(
    hub: raysync.HubClient, hub_name: str
) -> None:
    sub = _repointing_sub(hub_name)
    push(hub, 1)
    hub.wait(1, timeout=CALL_S)
    ray.get(sub.to_double.remote(), timeout=CALL_S)
    push(hub, 2)
    with pytest.raises(raysync.ApplyError, match="dtype mismatch"):
        hub.wait(2, timeout=CALL_S)
    report = ray.get(sub.check.remote(), timeout=CALL_S)
    assert report["version"] is None and report["values"] == [1.0]  # holds v1's values, reports no version


# ---------------------------------------------------------------------- case 3: async pull


def _async_pull_sub(hub_name: str) -> Any:
    @raysync.synced_model("policy", hub=hub_name, mode="pull")
    class AsyncPuller:
        def __init__(self) -> None:
            self.policy = soak.Filled(SIZE_MIB, TENSORS)

        async def act(self) -> int | None:
            return self.raysync_version()  # type: ignore[attr-defined,no-any-return]

        def start_episode(self) -> bool:
            return bool(self.raysync_sync(timeout=CALL_S))  # type: ignore[attr-defined]

        async def start_episode_async(self) -> bool:
            return bool(await self.raysync_sync(timeout=CALL_S))  # type: ignore[attr-defined]

        def check(self) -> dict[str, Any]:
            from tests.integration.test_reliability import _report

            return _report(self)

    return ray.remote(num_cpus=0)(AsyncPuller).remote()


def test_case03_pull_from_a_plain_method_of_an_async_actor_applies(
    hub: raysync.HubClient, hub_name: str
) -> None:
    sub = _async_pull_sub(hub_name)
    ray.get(sub.act.remote(), timeout=CALL_S)
    push(hub, 1)
    assert hub.latest() == 1  # the hub has read the push (a push returns before it has)
    assert ray.get(sub.start_episode.remote(), timeout=CALL_S) is True
    assert holds(sub, 1)
    assert ray.get(sub.start_episode.remote(), timeout=CALL_S) is False  # already current
    push(hub, 2)
    assert hub.latest() == 2
    assert ray.get(sub.start_episode_async.remote(), timeout=CALL_S) is True
    assert holds(sub, 2)
    push(hub, 3)
    assert hub.latest() == 3
    assert ray.get(sub.raysync_sync.remote(), timeout=CALL_S) is True  # called remotely
    assert holds(sub, 3)
    hub.wait(3, timeout=CALL_S, include_pull=True)
    assert _status_row(hub, sub)["lag"] == 0  # type: ignore[index]


# ---------------------------------------------------------------------- case 5: keep


def test_case05_connect_without_keep_leaves_another_clients_keep_alone(hub_name: str) -> None:
    trainer = raysync.connect(hub_name, keep=5)
    for v in range(1, 6):
        push(trainer, v)
    raysync.connect(hub_name)  # an evaluation job: default keep
    raysync.connect(hub_name, keep=2)  # one that asks for fewer
    assert trainer.status()["keep"] == 5
    assert trainer.status()["models"]["policy"]["versions_kept"] == [1, 2, 3, 4, 5]
    assert float(trainer.pull(version=1)["p0"][0]) == 1.0
    ray.kill(trainer.actor)


# ---------------------------------------------------------------------- case 7: thread pools


def _pool_sub(hub_name: str, *, concurrency: int, **opts: Any) -> Any:
    @raysync.synced_model("policy", hub=hub_name, **opts)
    class Pooled:
        """A rollout worker whose method hands work to its own pool, which calls the actor again."""

        def __init__(self) -> None:
            self.policy = soak.Filled(SIZE_MIB, TENSORS)
            self.pool = concurrent.futures.ThreadPoolExecutor(2)

        def rollout(self, gate: Any) -> int | None:
            def step() -> int | None:
                ray.get(gate.wait.remote())
                return self.act()  # another public method, from a pool thread

            return self.pool.submit(step).result()

        def act(self) -> int | None:
            return self.raysync_version()  # type: ignore[attr-defined,no-any-return]

        def long(self, gate: Any) -> None:
            ray.get(gate.wait.remote())

        def applies_waiting(self) -> int:
            return int(self._raysync_actor_sync.lock.writers_waiting())  # type: ignore[attr-defined]

        def check(self) -> dict[str, Any]:
            from tests.integration.test_reliability import _report

            return _report(self)

    return ray.remote(num_cpus=0, max_concurrency=concurrency)(Pooled).remote()


@pytest.mark.parametrize("kind", ["threaded", "prefetch"])
def test_case07_push_during_a_method_that_calls_the_actor_from_its_pool_does_not_deadlock(
    hub: raysync.HubClient, hub_name: str, kind: str
) -> None:
    sub = (
        _pool_sub(hub_name, concurrency=2)
        if kind == "threaded"
        else _pool_sub(hub_name, concurrency=1, prefetch=True)
    )
    push(hub, 1)
    hub.wait(1, timeout=CALL_S)
    gate = Gate.remote()
    rollout = sub.rollout.remote(gate)
    wait_for_condition(
        lambda: ray.get(gate.waiters.remote()) == 1, timeout=2 * CALL_S, what="the rollout is running"
    )
    push(hub, 2)
    if kind == "threaded":  # the hub's delivery waits for the write lock while the rollout runs
        wait_for_condition(lambda: ray.get(sub.applies_waiting.remote(), timeout=CALL_S), what="apply waits")
    else:
        time.sleep(0.5)  # let the prefetch thread stage version 2 and ask for the write lock
    ray.get(gate.open.remote())
    assert ray.get(rollout, timeout=CALL_S) == 1  # the whole rollout ran with version 1
    hub.wait(2, timeout=CALL_S)
    assert holds(sub, 2)


def test_case07_a_push_during_one_long_method_does_not_block_the_others(
    hub: raysync.HubClient, hub_name: str
) -> None:
    sub = _pool_sub(hub_name, concurrency=3)
    push(hub, 1)
    hub.wait(1, timeout=CALL_S)
    gate = Gate.remote()
    long = sub.long.remote(gate)
    wait_for_condition(
        lambda: ray.get(gate.waiters.remote()) == 1, timeout=2 * CALL_S, what="the long method runs"
    )
    push(hub, 2)
    wait_for_condition(lambda: ray.get(sub.applies_waiting.remote(), timeout=CALL_S), what="apply waits")
    for _ in range(5):
        assert ray.get(sub.act.remote(), timeout=CALL_S) == 1  # not version 2: the long method reads 1
    # Each answered (within CALL_S) while the apply still waits behind the long method, which runs
    # until the gate opens: short calls are not held back until the long method ends.
    assert ray.get(sub.applies_waiting.remote(), timeout=CALL_S), "the apply went in: nothing shown"
    assert not ray.wait([long], timeout=0)[0], "the long method ended: nothing shown"
    assert ray.get(sub.raysync_version.remote(), timeout=CALL_S) == 1
    ray.get(gate.open.remote())
    ray.get(long, timeout=CALL_S)
    hub.wait(2, timeout=CALL_S)
    assert holds(sub, 2)


# ---------------------------------------------------------------------- case 8: dead failed subscriber


def test_case08_a_dead_subscriber_that_failed_never_blocks_pushes(
    hub: raysync.HubClient, hub_name: str
) -> None:
    good = make_sub(hub_name)
    push(hub, 1)
    hub.wait(1, timeout=CALL_S)

    bad = mismatched_subscriber(hub_name)
    assert push(hub, 2) == 2  # its model does not fit: its own error (a misfit), not the push's
    hub.wait(2, timeout=CALL_S)  # nor waited for: it can never apply it
    wait_for_condition(
        lambda: "missing keys" in ((_status_row(hub, bad) or {}).get("misfit") or ""),
        what="status says why it misfits",
    )
    ray.kill(bad)
    wait_for_condition(lambda: _dead(bad), what="the mismatched subscriber is dead")
    assert push(hub, 3) == 3
    hub.wait(3, timeout=CALL_S)  # no ApplyError for the dead one
    assert holds(good, 3)
    wait_for_condition(
        lambda: _status_row(hub, bad) is None, timeout=30, what="the dead subscriber is dropped"
    )


def test_case08_a_killed_subscriber_stuck_short_of_the_newest_is_reaped_without_a_waiter(
    hub_name: str,
) -> None:
    # silent 4 s (not the default 10) before the hub checks it
    hub = raysync.connect(f"{hub_name}-sweep", settings=raysync.HubSettings(drop_silent_s=4))
    try:
        push(hub, 1)
        sub = mismatched_subscriber(hub.name)  # the newest does not fit it: it holds nothing, and says why
        wait_for_condition(
            lambda: "missing keys" in ((_status_row(hub, sub) or {}).get("waiting_for") or ""),
            what="it registered and status says what it waits for",
        )
        ray.kill(sub)
        # Nobody waits and nobody pushes: the hub notices by itself that it stopped checking in.
        wait_for_condition(
            lambda: _status_row(hub, sub) is None, timeout=40, what="the killed subscriber is reaped"
        )
    finally:
        ray.kill(hub.actor)


# ---------------------------------------------------------------------- case 9: max_lag after a failure


@ray.remote(num_cpus=0)
class _Pusher:
    def __init__(self, hub_name: str, takeover: bool = False) -> None:
        self.hub = raysync.connect(hub_name, takeover=takeover)

    def push(self, value: int | None) -> int:
        return push(self.hub, self.hub.next_version() if value is None else value)


def test_case09_one_failed_apply_does_not_make_max_lag_pushes_fail_forever(
    hub: raysync.HubClient, hub_name: str
) -> None:
    trainer = _Pusher.remote(hub_name)
    assert ray.get(trainer.push.remote(1), timeout=CALL_S) == 1
    kill_until_gone(trainer)  # its version's bytes go with its process
    sub = make_sub(hub_name)  # starts from version 1, whose bytes are gone: that apply fails
    wait_for_condition(lambda: (_status_row(hub, sub) or {}).get("last_error"), what="the failed apply")
    for _ in range(2):  # a new writer: its numbers start past the dead trainer's block
        v = push(hub, hub.next_version(), max_lag=1, timeout=CALL_S)
        hub.wait(v, timeout=CALL_S)
        assert holds(sub, v)


# ---------------------------------------------------------------------- case 11: timeouts


@pytest.mark.parametrize("bad", [float("nan"), True, -1, "5"])
def test_case11_timeouts_that_are_not_seconds_are_refused(hub: raysync.HubClient, bad: Any) -> None:
    push(hub, 1)
    with pytest.raises(ValueError, match="timeout"):
        hub.wait(1, timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        hub.push(filled(2), wait=True, timeout=bad)
    with pytest.raises(ValueError, match="fetch_timeout"):
        raysync.synced_model("policy", fetch_timeout=bad)
    assert hub.latest() == 1  # nothing was pushed by the refused calls


def test_case11_raysync_sync_refuses_nan(hub: raysync.HubClient, hub_name: str) -> None:
    sub = make_sub(hub_name, "pull")
    ray.get(sub.check.remote(), timeout=CALL_S)  # registered before the push: holds nothing
    push(hub, 1)
    with pytest.raises(ray.exceptions.RayTaskError, match="timeout must be"):
        ray.get(sub.raysync_sync.remote(timeout=math.nan), timeout=CALL_S)
    assert ray.get(sub.raysync_version.remote(), timeout=CALL_S) is None


# ---------------------------------------------------------------------- case 12: pull subscribers


def test_case12_pull_subscribers_do_not_stall_push_wait_or_max_lag(
    hub: raysync.HubClient, hub_name: str
) -> None:
    collector = make_sub(hub_name)
    evaluator = make_sub(hub_name, "pull")
    ray.get([collector.check.remote(), evaluator.check.remote()], timeout=CALL_S)
    # A push that waited for the evaluator (which never syncs) would raise SyncTimeoutError after
    # CALL_S; each returns, within the bound of its timeout.
    for v in range(1, 6):
        started = time.monotonic()
        if v < 4:
            push(hub, v, wait=True, timeout=CALL_S)
        else:
            push(hub, v, max_lag=1, timeout=CALL_S)
        assert time.monotonic() - started < CALL_S + ANSWER_GRACE_S + CLIENT_MARGIN_S
    hub.wait(5, timeout=CALL_S)
    assert holds(collector, 5) and holds(evaluator, None)
    with pytest.raises(raysync.SyncTimeoutError, match="did not apply version 5"):
        hub.wait(5, timeout=1, include_pull=True)  # asked for: the evaluator is waited for
    assert ray.get(evaluator.sync.remote(), timeout=CALL_S) is True
    hub.wait(5, timeout=CALL_S, include_pull=True)
    assert holds(evaluator, 5)


def test_case12_a_wait_short_of_subscribers_names_the_pull_mode_ones_it_did_not_count(
    hub: raysync.HubClient, hub_name: str
) -> None:
    # Issue 48, item 2: one push-mode and one pull-mode actor; subscribers=2 counts push-mode ones
    # only (the pull-mode one moves only when it syncs), and the timeout says so and how to count it.
    collector = make_sub(hub_name)
    evaluator = make_sub(hub_name, "pull")
    ray.get([collector.check.remote(), evaluator.check.remote()], timeout=CALL_S)
    push(hub, 1, wait=True, timeout=CALL_S)
    started = time.monotonic()
    with pytest.raises(raysync.SyncTimeoutError) as info:
        hub.wait(1, subscribers=2, timeout=2)
    assert time.monotonic() - started < 2 + ANSWER_GRACE_S + CLIENT_MARGIN_S
    text = str(info.value)
    assert "only 1 of the 2 push-mode subscribers waited for (subscribers=2) registered" in text
    assert "1 pull-mode subscriber(s) registered too, which would make 2" in text
    assert "include_pull=True" in text
    assert "-;" not in text and "0 subscriber(s)" not in text
    assert ray.get(evaluator.sync.remote(), timeout=CALL_S) is True
    hub.wait(1, subscribers=2, timeout=CALL_S, include_pull=True)  # counted, as the message said


# ---------------------------------------------------------------------- case 13: raw errors


def _bytes_gone(hub: raysync.HubClient) -> bool:
    """Whether the newest kept version can no longer be fetched (Ray freed it with its owner)."""
    info = ray.get(hub.actor.get.remote("policy"), timeout=CALL_S)
    try:
        ray.get(list(info.refs), timeout=CALL_S)
    except (ray.exceptions.ObjectLostError, ray.exceptions.RayTaskError):
        return True
    return False


def test_case13_after_the_trainer_died_delta_falls_back_and_keys_says_why(
    hub: raysync.HubClient, hub_name: str
) -> None:
    sub = make_sub(hub_name)
    trainer = _Pusher.remote(hub_name)
    assert ray.get(trainer.push.remote(1), timeout=CALL_S) == 1
    hub.wait(1, timeout=CALL_S)
    ray.kill(trainer)
    wait_for_condition(lambda: _bytes_gone(hub), what="the dead trainer's version is gone")
    v = push(hub, hub.next_version(), delta=True)  # the previous version's bytes are gone: a full push
    hub.wait(v, timeout=CALL_S)
    assert holds(sub, v)
    trainer = _Pusher.remote(hub_name, takeover=True)  # the driver, alive, holds the lease now
    v = ray.get(trainer.push.remote(None), timeout=CALL_S)
    hub.wait(v, timeout=CALL_S)
    ray.kill(trainer)
    wait_for_condition(lambda: _bytes_gone(hub), what="the second trainer's version is gone")
    with pytest.raises(raysync.InvalidWeightsError, match=r"bytes are gone.*push the whole model"):
        hub.push(filled(4), keys=["p0"], bucket_bytes=BUCKET_BYTES)
    assert holds(sub, v)


def test_case13_tasks_of_one_job_share_the_writer_lease(hub: raysync.HubClient) -> None:
    @ray.remote(num_cpus=0)
    def push_from_task(client: raysync.HubClient) -> int:
        return push(client, client.next_version())

    # Each process stamps from a block of its own (a new process: a new block).
    first = ray.get(push_from_task.remote(hub), timeout=CALL_S)
    second = ray.get(push_from_task.remote(hub), timeout=CALL_S)
    third = push(hub, hub.next_version())  # the driver of the same job too
    assert first < second < third and hub.latest() == third
    writer = hub.status()["models"]["policy"]["writer"]
    assert (
        writer["kind"] in ("tasks", "driver") and writer["job_id"] == ray.get_runtime_context().get_job_id()
    )


def test_case13_raysync_sync_timeout_raises_sync_timeout_error(hub: raysync.HubClient, hub_name: str) -> None:
    @raysync.synced_model("policy", hub=hub_name, mode="pull")
    class Impatient:
        def __init__(self) -> None:
            self.policy = soak.Filled(SIZE_MIB, TENSORS)

        def sync(self, timeout: float) -> str:
            try:
                self.raysync_sync(timeout=timeout)  # type: ignore[attr-defined]
            except raysync.SyncTimeoutError as err:
                return f"SyncTimeoutError: {err}"
            return "synced"

    sub = ray.remote(num_cpus=0)(Impatient).remote()
    ray.get(sub.raysync_version.remote(), timeout=CALL_S)  # registered before the push: holds nothing
    push(hub, 1)
    assert hub.latest() == 1  # the hub has read the push (a push returns before it has)
    # timeout=0: the newest version if it is at hand at once (a tiny one can be, on a slow
    # machine), else SyncTimeoutError holding nothing; never one of Ray's errors.
    got = ray.get(sub.sync.remote(0), timeout=CALL_S)
    held = ray.get(sub.raysync_version.remote(), timeout=CALL_S)
    assert (got, held) == ("synced", 1) or (got.startswith("SyncTimeoutError") and held is None), (got, held)
    assert ray.get(sub.sync.remote(30), timeout=CALL_S) == "synced"
    assert ray.get(sub.raysync_version.remote(), timeout=CALL_S) == 1
    # A hub that cannot answer in time (restarting: a new process takes seconds) is a
    # SyncTimeoutError too, not Ray's ActorUnavailableError; the version held stays.
    # Asked once the old process is gone (a new one takes seconds).
    kill_until_gone(hub.actor, no_restart=False)
    got = ray.get(sub.sync.remote(0.2), timeout=CALL_S)
    assert got.startswith("SyncTimeoutError") and "ran out asking the hub" in got, got
    assert ray.get(sub.raysync_version.remote(), timeout=CALL_S) == 1
    push(hub, 2)  # the client waits through the restart
    assert hub.latest() == 2
    assert ray.get(sub.sync.remote(30), timeout=CALL_S * 2) == "synced"
    assert ray.get(sub.raysync_version.remote(), timeout=CALL_S) == 2

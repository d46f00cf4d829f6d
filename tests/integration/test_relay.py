"""Delivery through one relay per node: one hub message per node per version; dying relays lose nothing.

On one machine the only node is the hub's own, whose doorbells the hub rings itself by
default; these tests start hubs with ``HubSettings(rings_own_node=False)`` so that a relay serves it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import ray

import raysync
from raysync._protocol import DEFAULT_NAMESPACE
from raysync.hub.relay import relay_name
from raysync.hub.relay_handles import REPLACE_AFTER_STALLS
from raysync.hub.settings import DEFAULT_RING_ACK_S
from tests._support import (
    assert_same_weights,
    doorbell_address,
    kill_until_gone,
    small_policy,
    wait_for_condition,
)
from tests.integration.test_synced import make_collector

# The ``hub`` fixture's settings: a hub that leaves its own node to a relay too (by default it
# rings doorbells there itself).
HUB_SETTINGS = raysync.HubSettings(rings_own_node=False)


def _relay(hub: raysync.HubClient) -> Any:
    """The hub's relay on this (the only) node, once it is up."""
    node = ray.get_runtime_context().get_node_id()
    wait_for_condition(lambda: node in hub.status()["relays"], what="the node's relay is up")
    name = hub.status()["relays"][node]
    assert name == relay_name(hub.name, hub.actor._actor_id.hex(), node)
    return ray.get_actor(name, namespace=DEFAULT_NAMESPACE)


def _until_rung(
    hub: raysync.HubClient, push: Callable[[], int], stats: Callable[[], dict[str, Any]], *, pushes: int = 5
) -> list[int]:
    """Push versions until one was rung by whoever rings this node; ``stats()`` are its counts.
    Returns the versions pushed.

    The hub rings its own node's doorbells from the first version on. A relay rings from the
    first delivery the hub hands it: the hub does so once the relay answered its ping (then
    ``status()["relays"]`` lists it: :func:`_relay`); before that, and while it is lost (died,
    restarting) or stalled, the hub calls the node's subscribers itself. That first delivery
    names the node's subscribers to the relay, which rings those whose process has a doorbell
    (when the version fits ``doorbell_bytes``) and calls the others. So this pushes versions
    (``push()`` pushes one and returns its number; each is waited for) until the ringer's
    ``rung`` moved: from then on every small version rings them, unless the ringer dies or
    stalls (which the counts a test compares then show: ``pid``, ``stalled_relays``).
    """
    seen: list[dict[str, Any]] = []
    versions: list[int] = []
    for _ in range(pushes):
        before = stats()
        versions.append(push())
        hub.wait(versions[-1], timeout=60)
        seen.append(stats())
        if seen[-1]["pid"] == before["pid"] and seen[-1]["rung"] > before["rung"]:
            return versions
    status = hub.status()
    raise AssertionError(
        f"{pushes} versions pushed, none rung: the ringer's stats {seen}; relays {status['relays']}, "
        f"stalled {status['stalled_relays']}, delivery {status['delivery']}"
    )


def _pid(relay: Any) -> int:
    """The relay's process, once it answers (Ray refuses calls while it restarts)."""

    def answer() -> int | None:
        try:
            return int(ray.get(relay.stats.remote(), timeout=10)["pid"])
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return None

    return int(wait_for_condition(answer, timeout=60, what="the relay answers"))


def _relay_stats(relay: Any) -> Callable[[], dict[str, Any]]:
    """What :func:`_until_rung` reads of a relay: its stats."""
    return lambda: dict(ray.get(relay.stats.remote(), timeout=30))


def _calls(hub: raysync.HubClient) -> int:
    return int(hub.status()["delivery"]["calls"])


def _check_all(hub: raysync.HubClient, actors: list[Any], version: int, seed: int) -> None:
    hub.wait(version, timeout=60)
    expected = small_policy(seed).state_dict()
    for actor in actors:
        assert ray.get(actor.raysync_version.remote()) == version
        assert_same_weights(ray.get(actor.weights.remote()), expected)


@ray.remote(num_cpus=0)
class _Engine:
    """An undecorated actor whose engine-like target (a ``WeightsLoader``) a Follower feeds."""

    def __init__(self, hub_name: str) -> None:
        self.params: dict[str, Any] = {}
        loader = raysync.WeightsLoader(lambda pairs: self.params.update((k, v.clone()) for k, v in pairs))
        self.follower = raysync.follow(target=loader, hub=hub_name)

    def held(self) -> tuple[int | None, dict[str, Any]]:
        with self.follower.paused():
            return self.follower.version, dict(self.params)


def test_one_hub_message_per_node_for_every_kind(hub: raysync.HubClient, hub_name: str) -> None:
    copies = [make_collector(hub_name).remote() for _ in range(2)]
    view = make_collector(hub_name, apply="view").remote()
    prefetching = make_collector(hub_name, prefetch=True).remote()
    puller = make_collector(hub_name, mode="pull").remote()
    engine = _Engine.remote(hub_name)  # a Follower in an actor, and one in this plain process
    evaluator = small_policy(9)
    follower = raysync.follow(evaluator, hub=hub_name, label="evaluator")
    batched = [*copies, view, prefetching]
    ray.get([a.raysync_version.remote() for a in [*batched, puller]] + [engine.held.remote()])
    relay = _relay(hub)
    assert hub.status()["delivery"]["nodes"] == [ray.get_runtime_context().get_node_id()]
    _until_rung(hub, lambda: hub.push(small_policy(0)), _relay_stats(relay))  # it serves the node now
    for seed in (1, 2, 3):
        before, delivered = _calls(hub), ray.get(relay.stats.remote())["delivered"]
        v = hub.push(small_policy(seed))
        _check_all(hub, batched, v, seed)
        assert _calls(hub) - before == 1  # one message for the node, whatever the subscribers on it
        # the Followers heard of it from the relay too (called: they have no doorbell), none by a
        # long poll of their own; each holds what it reports, bit for bit
        assert ray.get(relay.stats.remote())["delivered"] - delivered >= 3  # + the prefetching one
        version, params = ray.get(engine.held.remote(), timeout=60)
        assert version == v
        assert_same_weights(params, small_policy(seed).state_dict())
        assert follower.wait_for(v, timeout=60) == v
        with follower.paused():
            assert_same_weights(evaluator.state_dict(), small_policy(seed).state_dict())
    follower.stop()
    stats = ray.get(relay.stats.remote())
    assert stats["deliveries"] >= 3
    # the hub's and the relay's start-up objects (Ray's and raysync's imports) are out of the
    # garbage collector's full scans: ~50 ms each otherwise, a stall of every model's deliveries
    assert stats["gc_frozen"] > 10_000 and ray.get(hub.actor.configure.remote())["gc_frozen"] > 10_000
    assert stats["rung"] >= 3 * (len(copies) + 1)  # the copies and the view by doorbell
    assert stats["delivered"] >= 3  # the prefetching one by call
    assert ray.get(puller.raysync_version.remote()) is None  # pull mode: only when it asks
    assert ray.get(puller.sync_now.remote())
    assert ray.get(puller.raysync_version.remote()) == v


def test_killed_relay_is_restarted_and_nothing_is_lost(hub: raysync.HubClient, hub_name: str) -> None:
    actors = [make_collector(hub_name).remote() for _ in range(2)]
    ray.get([a.raysync_version.remote() for a in actors])
    relay = _relay(hub)
    pids = [_pid(relay)]
    seen: list[int] = []
    for seed in range(1, 4):  # 3 kills, each push right after one: the 2nd and 3rd hit a restarted relay
        ray.kill(relay, no_restart=False)
        v = hub.push(small_policy(seed))
        _check_all(hub, actors, v, seed)
        seen.append(v)
        # ray.kill returns before the process dies (seconds later on a loaded machine): once it is
        # gone, Ray restarts it, and the next kill hits the new process
        wait_for_condition(
            lambda p=pids[-1]: not psutil.pid_exists(p), timeout=60, what="the killed relay gone"
        )
        pids.append(_pid(relay))
    assert seen == sorted(seen)
    assert len(set(pids)) == len(pids), pids  # Ray restarted it each time; the hub delivers through it again
    wait_for_condition(lambda: hub.status()["relays"], what="the hub uses the restarted relay")
    # ray.kill returns before the relay dies: the last push may have reached the old process, and
    # then the hub learns of the restart from the new one's first reply (one call more, once)
    _until_rung(hub, lambda: hub.push(small_policy(8)), _relay_stats(relay))
    _check_all(hub, actors, hub.latest(), 8)
    before = _calls(hub)
    v = hub.push(small_policy(9))
    _check_all(hub, actors, v, 9)
    assert _calls(hub) - before == 1


def test_settings_are_the_hubs_for_its_life(hub_name: str, caplog: pytest.LogCaptureFixture) -> None:
    """``connect(settings=...)`` makes a hub without relays: it calls every subscriber itself;
    a later connect asking for others gets a warning naming them, and the hub keeps its own."""
    direct = raysync.connect(hub_name, settings=raysync.HubSettings(relays=False, doorbell_bytes=0))
    try:
        assert direct.settings().relays is False and direct.settings().doorbell_bytes == 0
        actors = [make_collector(hub_name).remote() for _ in range(2)]
        ray.get([a.raysync_version.remote() for a in actors])
        for seed in (1, 2):
            before = _calls(direct)
            v = direct.push(small_policy(seed))
            _check_all(direct, actors, v, seed)
            assert _calls(direct) - before == 2  # one call per subscriber: no relay, no doorbell
        assert direct.status()["relays"] == {}
        with caplog.at_level("WARNING", logger="raysync.client.connect"):
            again = raysync.connect(hub_name, settings=raysync.HubSettings(relays=True))
        assert "relays=False (asked True)" in caplog.text
        assert again.settings().relays is False
    finally:
        ray.kill(direct.actor)


def _arm(relay: Any, fault: str) -> None:
    """Make the relay's process die at a chosen point of its next delivery: a fault injected from
    the test (into the relay's own objects), not a hook in the relay's code."""

    def arm(self: Any) -> None:
        import os

        node = self._node
        if fault == "exit_before_reply":  # every subscriber applied it; the relay dies before answering
            deliver = node.deliver

            async def deliver_then_die(delivery: Any) -> Any:
                await deliver(delivery)
                os._exit(1)

            node.deliver = deliver_then_die
        else:  # exit_mid_delivery: the first subscriber's ack is in, the others' not yet
            ringer = node._doorbell()[0]
            ack = ringer._ack

            def ack_then_die(address: str, msg: Any) -> None:
                ack(address, msg)
                os._exit(1)

            ringer._ack = ack_then_die

    ray.get(relay.__ray_call__.remote(arm))


@pytest.mark.parametrize("fault", ["exit_mid_delivery", "exit_before_reply"])
def test_relay_dying_mid_delivery_or_mid_ack_loses_nothing(
    hub: raysync.HubClient, hub_name: str, fault: str
) -> None:
    actors = [make_collector(hub_name).remote() for _ in range(2)]  # one acked before it dies, one not
    ray.get([a.raysync_version.remote() for a in actors])
    relay = _relay(hub)
    _until_rung(hub, lambda: hub.push(small_policy(1)), _relay_stats(relay))  # the next version goes to it
    _check_all(hub, actors, hub.latest(), 1)
    pid = _pid(relay)
    _arm(relay, fault)
    v2 = hub.push(small_policy(2))
    _check_all(hub, actors, v2, 2)  # some applied before the relay died, the rest after: all hold v2
    assert _pid(relay) != pid  # it did die, and came back
    v3 = hub.push(small_policy(3))
    _check_all(hub, actors, v3, 3)
    assert all(s["applied"] == v3 and s["last_error"] is None for s in hub.status()["subscribers"])


def test_wait_with_a_dead_subscriber_behind_a_relay_names_it_or_drops_it(
    hub: raysync.HubClient, hub_name: str
) -> None:
    live = make_collector(hub_name).remote()
    doomed = make_collector(hub_name).remote()
    ray.get([live.raysync_version.remote(), doomed.raysync_version.remote()])
    _relay(hub)
    ray.kill(doomed)
    v = hub.push(small_policy(1))
    hub.wait(v, timeout=30)  # the relay reports the dead actor; the hub drops it instead of waiting
    # Dropped by the relay's report, or (on a loaded machine, first) left out of the wait as
    # silent and dropped once the GCS confirms the death.
    only_live = [f"{live._actor_id.hex()}:policy"]
    wait_for_condition(
        lambda: [s["subscriber"] for s in hub.status()["subscribers"]] == only_live,
        timeout=30,
        what="the dead subscriber dropped",
    )


def test_relays_come_back_after_a_hub_restart(hub: raysync.HubClient, hub_name: str) -> None:
    actors = [make_collector(hub_name).remote() for _ in range(2)]
    ray.get([a.raysync_version.remote() for a in actors])
    _check_all(hub, actors, hub.push(small_policy(1)), 1)
    _relay(hub)
    kill_until_gone(hub.actor, no_restart=False)  # its relays go with it (they are its children)
    wait_for_condition(
        lambda: (
            len(hub.status()["subscribers"]) == 2
            and all(s["state"] == "live" for s in hub.status()["subscribers"])
        ),
        timeout=60,
        what="subscribers registered again with the restarted hub",
    )
    v = hub.push(small_policy(2))
    _check_all(hub, actors, v, 2)
    relay = _relay(hub)  # a new relay for the new hub
    _until_rung(hub, lambda: hub.push(small_policy(2)), _relay_stats(relay))
    before = _calls(hub)
    v = hub.push(small_policy(3))
    _check_all(hub, actors, v, 3)
    assert _calls(hub) - before == 1


def _user_code_in(actor: Any) -> list[str]:
    """The modules of the subscribers' code (torch, the tests' own) that ``actor``'s process imported."""

    def imported(self: Any) -> list[str]:
        import sys

        heavy = ("torch", "tensordict", "torchrl")
        return sorted(m for m in sys.modules if m in heavy or m.startswith("tests"))

    found: list[str] = ray.get(actor.__ray_call__.remote(imported), timeout=60)
    return found


def test_the_hub_and_relays_call_subscribers_without_importing_their_code(
    hub: raysync.HubClient, hub_name: str
) -> None:
    # Subscribers whose class lives in the tests' modules and builds a torch model: a hub or
    # relay that loaded that class to call it would import both.
    copy = make_collector(hub_name).remote()
    called = make_collector(hub_name, prefetch=True).remote()  # called by the relay, not rung
    ray.get([copy.raysync_version.remote(), called.raysync_version.remote()])
    relay = _relay(hub)
    _until_rung(hub, lambda: hub.push(small_policy(1)), _relay_stats(relay))  # the next versions go to it
    delivered = ray.get(relay.stats.remote())["delivered"]
    for seed in (1, 2):
        _check_all(hub, [copy, called], hub.push(small_policy(seed)), seed)
    assert ray.get(relay.stats.remote())["delivered"] - delivered >= 2  # its calls went through the relay
    assert _user_code_in(hub.actor) == []
    assert _user_code_in(relay) == []
    # After a restart the new hub process builds the handles again (from the GCS), likewise.
    kill_until_gone(hub.actor, no_restart=False)
    wait_for_condition(
        lambda: [s["state"] for s in hub.status()["subscribers"]] == ["live", "live"],
        timeout=60,
        what="both registered again with the restarted hub",
    )
    _check_all(hub, [copy, called], hub.push(small_policy(3)), 3)
    assert _user_code_in(hub.actor) == []


def _stalling_hub(hub_name: str, stall_s: float) -> raysync.HubClient:
    """A hub whose relay serves its own node too, with a stall bound of ``stall_s`` (past ring_ack_s)."""
    return raysync.connect(
        hub_name, settings=raysync.HubSettings(rings_own_node=False, relay_stall_s=stall_s)
    )


def _record_versions(actor: Any) -> None:
    """From now on the actor's subscription records each version it takes, however it takes it
    (rung, called, a prefetched swap): observed in its process, on the version it says it holds."""

    def record(self: Any) -> None:
        applier = self.__dict__["_raysync_actor_sync"].subs["policy"].applier  # holds its version
        held = type(applier).version

        class Recording(type(applier)):  # type: ignore[misc]
            @property
            def version(self) -> int | None:
                return held.fget(self)

            @version.setter
            def version(self, version: int | None) -> None:
                if version is not None and version != held.fget(self):
                    self.__dict__["taken"].append(version)
                held.fset(self, version)

        applier.__dict__["taken"] = []
        applier.__class__ = Recording

    ray.get(actor.__ray_call__.remote(record), timeout=60)


def _taken(actor: Any) -> list[int]:
    def taken(self: Any) -> list[int]:
        return list(self.__dict__["_raysync_actor_sync"].subs["policy"].applier.__dict__["taken"])

    found: list[int] = ray.get(actor.__ray_call__.remote(taken), timeout=60)
    return found


def test_a_stalled_relay_holds_back_nobody_and_is_used_again_when_it_resumes(hub_name: str) -> None:
    """A relay stopped (SIGSTOP) mid-run: its node's subscribers get the next version directly within
    the stall bound, status names the relay stalled, and once it resumes versions go through it again;
    no subscriber applies a version twice or backwards."""
    hub = _stalling_hub(hub_name, 3.0)
    bound = DEFAULT_RING_ACK_S + 3.0  # well before the relay would be replaced instead (6 bounds)
    try:
        actors = [make_collector(hub_name).remote() for _ in range(2)]
        actors.append(make_collector(hub_name, prefetch=True).remote())  # called by the relay, not rung
        ray.get([a.raysync_version.remote() for a in actors])
        _check_all(hub, actors, hub.push(small_policy(1)), 1)
        relay = _relay(hub)
        pid = _pid(relay)
        node = ray.get_runtime_context().get_node_id()
        for actor in actors:
            _record_versions(actor)
        deliveries = ray.get(relay.stats.remote())["deliveries"]
        os.kill(pid, signal.SIGSTOP)
        try:
            v2 = hub.push(small_policy(2))
            hub.wait(v2, timeout=bound + 15)  # SyncTimeoutError if held back past the bound
            _check_all(hub, actors, v2, 2)
            status = hub.status()
            assert psutil.Process(pid).status() == psutil.STATUS_STOPPED  # delivered around it
            assert node in status["stalled_relays"] and node not in status["relays"]
            assert status["stalled_relays"][node]["relay"] == relay_name(
                hub.name, hub.actor._actor_id.hex(), node
            )
            assert status["stalled_relays"][node]["silent_s"] >= bound
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for_condition(
            lambda: node in hub.status()["relays"] and not hub.status()["stalled_relays"],
            timeout=60,
            what="the resumed relay is used again",
        )
        assert _pid(relay) == pid  # resumed, not replaced
        assert ray.get(relay.stats.remote())["deliveries"] > deliveries  # it took the stalled one late
        rung = _until_rung(hub, lambda: hub.push(small_policy(3)), _relay_stats(relay))  # it rings again
        _check_all(hub, actors, rung[-1], 3)
        before = _calls(hub)
        v4 = hub.push(small_policy(4))
        _check_all(hub, actors, v4, 4)
        assert _calls(hub) - before == 1  # through the relay again: one message for the node
        assert [_taken(a) for a in actors] == [[v2, *rung, v4]] * len(actors)  # each once, in order
        assert all(s["applied"] == v4 and s["last_error"] is None for s in hub.status()["subscribers"])
    finally:
        ray.kill(hub.actor)


def test_a_relay_stalled_for_good_is_replaced(hub_name: str) -> None:
    """A relay that stays stopped is delivered around, then killed and started again by Ray;
    versions then go through the new relay process."""
    hub = _stalling_hub(hub_name, 1.0)
    replace_s = REPLACE_AFTER_STALLS * (DEFAULT_RING_ACK_S + 1.0)
    try:
        actors = [make_collector(hub_name).remote()]  # the new relay's counts tell how its versions came
        ray.get([a.raysync_version.remote() for a in actors])
        _check_all(hub, actors, hub.push(small_policy(1)), 1)
        relay = _relay(hub)
        pid = _pid(relay)
        os.kill(pid, signal.SIGSTOP)
        try:
            v2 = hub.push(small_policy(2))
            _check_all(hub, actors, v2, 2)  # directly, while it is stopped
            wait_for_condition(
                lambda: not psutil.pid_exists(pid), timeout=replace_s + 60, what="the stopped relay killed"
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert _pid(relay) != pid  # Ray started it again
        node = ray.get_runtime_context().get_node_id()
        wait_for_condition(
            lambda: node in hub.status()["relays"] and not hub.status()["stalled_relays"],
            timeout=60,
            what="the new relay process is used",
        )
        _until_rung(hub, lambda: hub.push(small_policy(3)), _relay_stats(relay))  # it rings
        _check_all(hub, actors, hub.latest(), 3)
        before, relayed = _calls(hub), ray.get(relay.stats.remote())
        v4 = hub.push(small_policy(4))
        _check_all(hub, actors, v4, 4)
        assert _calls(hub) - before == 1
        after = ray.get(relay.stats.remote())  # the new process took it, and rang the subscriber
        assert after["pid"] == relayed["pid"] != pid, (pid, relayed, after)
        assert (after["deliveries"] - relayed["deliveries"], after["rung"] - relayed["rung"]) == (1, 1)
    finally:
        ray.kill(hub.actor)


@pytest.mark.parametrize("served_by", ["hub", "relay"])
def test_subscribers_that_came_and_went_leave_nothing_behind(hub_name: str, served_by: str) -> None:
    """Actors come, take versions, and are killed: the hub (and the node's relay) keep no mailbox
    or member record for them, and their doorbell sockets go when the next subscriber starts."""
    settings = raysync.HubSettings(rings_own_node=served_by == "hub", drop_silent_s=4.0)
    hub = raysync.connect(hub_name, settings=settings)
    try:
        keeper = make_collector(hub_name).remote()
        ray.get(keeper.raysync_version.remote())
        gone = [make_collector(hub_name).remote() for _ in range(2)]
        ray.get([a.raysync_version.remote() for a in gone])
        _check_all(hub, [keeper, *gone], hub.push(small_policy(1)), 1)
        node = ray.get(keeper.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
        relay = _relay(hub) if served_by == "relay" else None
        sockets = ray.get([a.__ray_call__.remote(doorbell_address) for a in gone])
        assert all(sockets) and all(os.path.exists(s) for s in sockets)
        for actor in gone:
            kill_until_gone(actor)

        def kept() -> dict[str, Any]:
            status = hub.status()
            where = status["here"] if relay is None else ray.get(relay.stats.remote(), timeout=30)
            mailboxes = ray.get(hub.actor.__ray_call__.remote(lambda self: len(self._mail)), timeout=30)
            return {
                "subscribers": len(status["subscribers"]),
                "hub_mailboxes": mailboxes,
                "members": where["members"],
                "node_mailboxes": where["mailboxes"],
            }

        expected = {"subscribers": 1, "hub_mailboxes": 1, "members": 1, "node_mailboxes": 1}  # the keeper's
        seen: list[dict[str, Any]] = []
        try:
            wait_for_condition(lambda: seen.append(kept()) or seen[-1] == expected, timeout=60)
        except AssertionError:
            raise AssertionError(
                f"node {node[:8]}: the hub keeps {seen[-1]}, not only the keeper's"
            ) from None
        newcomer = make_collector(hub_name).remote()  # its process's doorbell sweeps the dead ones' sockets
        ray.get(newcomer.raysync_version.remote())
        assert not any(os.path.exists(s) for s in sockets)
        _check_all(hub, [keeper, newcomer], hub.push(small_policy(2)), 2)
    finally:
        ray.kill(hub.actor)

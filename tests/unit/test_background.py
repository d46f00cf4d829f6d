"""raysync's threads hold ``ray.shutdown()`` off around their calls into Ray, never into a deadlock.

No cluster: ``ray.shutdown()`` is modelled by what it does first, taking Ray's init/shutdown lock
(``tests/unit/test_compat.py`` probes that it does), and Ray's state by ``ray.is_initialized``.
"""

from __future__ import annotations

import threading

import pytest
import ray

from raysync import _compat
from raysync.client import background
from raysync.errors import RayNotRunningError
from tests._support import wait_for_condition


def test_an_apply_waiting_for_a_paused_block_lets_a_shutdown_from_that_block_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    running = True
    monkeypatch.setattr(ray, "is_initialized", lambda: running)
    paused = threading.RLock()  # a Follower's paused() block, held by the thread that shuts Ray down
    inside = threading.Event()
    outcome: list[str] = []

    def apply() -> None:  # what a follower's thread does with a version
        try:
            with background.held("apply"):
                inside.set()
                with background.taking("apply", paused):
                    outcome.append("applied")
        except RayNotRunningError:
            outcome.append("stopped")

    thread = threading.Thread(target=apply, daemon=True)
    shutdown = _compat.shutdown_lock()
    with paused:
        thread.start()
        assert inside.wait(10)
        # ray.shutdown() from inside the block: it gets Ray's lock, though the apply holds it
        # while it runs, since the apply lets it go while it waits for the block
        assert shutdown.acquire(timeout=10), "deadlocked: the apply held ray.shutdown() off"
        running = False
        shutdown.release()
    thread.join(10)
    assert outcome == ["stopped"]  # it never applied into a Ray that was shut down meanwhile

    def free() -> None:
        if shutdown.acquire(blocking=False):
            shutdown.release()
            outcome.append("free")

    checker = threading.Thread(target=free)
    checker.start()
    checker.join(10)
    assert outcome[-1] == "free", "the apply's thread left Ray's lock held"


def test_a_thread_holding_ray_running_delays_a_shutdown_and_stops_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    running = True
    monkeypatch.setattr(ray, "is_initialized", lambda: running)
    steps: list[str] = []
    release, shut = threading.Event(), threading.Event()

    def call() -> None:  # a follower's call into Ray, then its next one
        with background.held("call"):
            steps.append("in Ray")
            release.wait(10)
        shut.wait(10)
        try:
            with background.held("call"):
                steps.append("in Ray again")
        except RayNotRunningError:
            steps.append("stopped")

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    wait_for_condition(lambda: steps, timeout=10)
    shutdown = _compat.shutdown_lock()
    assert not shutdown.acquire(timeout=0.2), "ray.shutdown() ran during the thread's call into Ray"
    release.set()
    assert shutdown.acquire(timeout=10)
    running = False
    shutdown.release()
    shut.set()
    thread.join(10)
    assert steps == ["in Ray", "stopped"]


def test_a_hub_lookup_ray_never_answers_holds_a_shutdown_off_for_a_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A subscriber's heartbeat looks its hub up by name under Ray's lock once the hub died. At a
    cluster's shutdown the GCS is gone and Ray never answers that lookup: the process's own
    ``ray.shutdown()`` at exit then waited for the lock forever (seen: subscriber processes
    left running, a core busy, after their cluster stopped)."""
    from raysync.receivers import membership

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    gcs_back = threading.Event()
    found = object()
    lookups: list[str] = []

    def get_actor(name: str, namespace: str | None = None) -> object:  # the GCS gone: no answer till back
        lookups.append(name)
        gcs_back.wait(60)
        return found

    monkeypatch.setattr(_compat, "get_actor_no_start", get_actor)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    hub = membership._Hub("a-hub", None)
    old = hub._handle = object()  # the handle of the hub that died
    got: list[object] = []

    def beat() -> None:  # membership._beat after an ActorDiedError
        with background.held("find the hub"):
            got.append(hub.handle(fresh=True))

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    shutdown = _compat.shutdown_lock()
    try:
        assert shutdown.acquire(timeout=15), "shutdown waited on the lookup (for good, were the GCS gone)"
        shutdown.release()
        thread.join(10)
        assert got == [old]  # the old handle meanwhile: its calls fail, and the caller asks again
        again = threading.Thread(target=beat, daemon=True)
        again.start()  # asks again while the first lookup is still unanswered: no second lookup
        gcs_back.set()
        again.join(10)
        assert lookups == ["a-hub"]
        wait_for_condition(lambda: hub.handle(fresh=True) is found, timeout=10, what="the answered lookup")
    finally:
        gcs_back.set()

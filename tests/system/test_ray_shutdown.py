"""After ``ray.shutdown()`` a client raises a raysync error that says so, and never starts a cluster;
a follower running at ``ray.shutdown()`` (or at the end of the script) stops quietly.

One process of its own runs the client's cases and the follower's at ``ray.shutdown()`` (a Ray start
is the most of their time): ``connect()`` starts a local Ray and says so once, a follower follows,
then the calls after ``ray.shutdown()``. A second process ends with its follower still running.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, threading
    import ray, torch, raysync

    hub = raysync.connect("shutdown-test")  # no Ray in this process: it starts one, and says so
    raysync.connect("shutdown-test")  # Ray is up now: nothing more to say
    try:
        ray.init()
    except RuntimeError as err:
        print("second init:", err)
    model = torch.nn.Linear(4, 2)
    v = hub.push(model)
    hub.wait(v, timeout=30)
    v_ref, hub_actor = ray.put(1), hub.actor
    # A follower running at ray.shutdown(), of a model of its own: its thread applied a version and
    # waits in its long poll for the next one (the pushes below are of another model)
    hub.push(model, "followed")
    follower = raysync.follow(torch.nn.Linear(4, 2), "followed", hub="shutdown-test")
    follower.wait_for(hub.push(model, "followed"), timeout=60)
    print("following", follower.version, flush=True)

    errors = []
    # A trainer's push loop in another thread: it pushed before ray.shutdown() and pushes again
    # after it. (Never inside a push while ray.shutdown() runs: a Ray call in one thread while
    # another runs ray.shutdown() can crash the process inside Ray's core worker, raysync or not;
    # seen here as a SIGSEGV in ProfileEvent's destructor under actor.remote().)
    go, pushed = threading.Semaphore(0), threading.Semaphore(0)
    def pushes():
        while go.acquire(timeout=60):
            try:
                hub.push(model)
            except Exception as err:
                errors.append(("thread", type(err).__name__, str(err)))
                return
            pushed.release()
    thread = threading.Thread(target=pushes)
    thread.start()
    for _ in range(3):
        go.release()
        assert pushed.acquire(timeout=60), "the push loop never pushed"
    ray.shutdown()
    print("after shutdown", flush=True)
    go.release()  # its next push
    thread.join(60)

    calls = {
        "push": lambda: hub.push(model),
        "wait": lambda: hub.wait(v, timeout=5),
        "pull": lambda: hub.pull(),
        "latest": lambda: hub.latest(),
        "status": lambda: hub.status(),
        "next_version": lambda: hub.next_version(),
    }
    for name, call in calls.items():
        try:
            call()
            errors.append((name, None, "no error"))
        except Exception as err:
            errors.append((name, type(err).__name__, str(err)))
            assert isinstance(err, raysync.RaySyncError) and isinstance(err, RuntimeError)
    # What the client calls through: Ray's calls without its auto-init (raysync/_compat.py). A
    # public ray.put here would start a new local Ray; these raise and start nothing.
    from raysync import _compat
    for name, call in {
        "put_no_start": lambda: _compat.put_no_start(b"x"),
        "get_no_start": lambda: _compat.get_no_start(v_ref, timeout=5),
        "call_no_start": lambda: _compat.call_no_start(hub_actor.status),
    }.items():
        try:
            call()
            errors.append((name, None, "no error"))
        except Exception as err:
            errors.append((name, type(err).__name__, str(err)))
        assert not ray.is_initialized(), name
    # What a push asks of Ray besides (the node's store size): a push racing ray.shutdown() hit it in CI once
    from raysync.client.push import _store_capacity
    assert _store_capacity() is None and not ray.is_initialized(), "store capacity"
    print(json.dumps({"errors": errors, "ray_running": ray.is_initialized()}))
    """
)


# Ray gives a new node's raylet a fixed 30 s to register with the GCS; on a loaded 2-core machine
# that can run out, and the script fails at its first line. Such a run is tried again, once.
_STARTUP_TIMED_OUT = "timed out during startup"


def _python(script: str) -> subprocess.CompletedProcess[str]:
    """``python -c script``: what it printed and its exit code."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    if out.returncode != 0 and _STARTUP_TIMED_OUT in out.stderr:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    return out


@pytest.fixture(scope="module")
def run() -> Any:
    """The script's run: its output, once for the three tests that read it."""
    out = _python(_SCRIPT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_calls_after_ray_shutdown_raise_and_start_no_cluster(run: Any) -> None:
    out = run
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ray_running"] is False  # no call started a cluster of its own
    by_call = {name: (kind, msg) for name, kind, msg in result["errors"]}
    assert {n: by_call.pop(n)[0] for n in ("put_no_start", "get_no_start", "call_no_start")} == dict.fromkeys(
        ("put_no_start", "get_no_start", "call_no_start"), "RaySystemError"
    )
    assert set(by_call) == {"thread", "push", "wait", "pull", "latest", "status", "next_version"}
    for name, (kind, msg) in by_call.items():
        assert kind == "RayNotRunningError", (name, kind, msg)
        assert "Ray is not running" in msg and "ray.init" in msg, (name, msg)


def test_connect_says_once_that_it_started_a_local_ray(run: Any) -> None:
    # once in the whole run: neither the second connect() nor any call after ray.shutdown()
    # started (or said it started) a Ray of its own
    said = [line for line in run.stderr.splitlines() if "started a local Ray" in line]
    assert len(said) == 1 and "call ray.init(...) before raysync.connect()" in said[0]
    assert "second init:" in run.stdout  # what the warning warned of


_FOLLOWER_SCRIPT = textwrap.dedent(
    """
    import ray, torch, raysync

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    hub = raysync.connect("follow-shutdown")
    hub.push(torch.nn.Linear(4, 2))
    follower = raysync.follow(torch.nn.Linear(4, 2), hub="follow-shutdown")
    # the follower's thread applies the next version: it is in its long poll from now on
    follower.wait_for(hub.push(torch.nn.Linear(4, 2)), timeout=60)
    print("following", follower.version, flush=True)
    # the script simply ends: Ray's own shutdown at exit meets the running follower
    """
)


@pytest.mark.parametrize("end", ["shutdown", "exit"])
def test_a_running_follower_stops_quietly_at_ray_shutdown(end: str, request: pytest.FixtureRequest) -> None:
    if end == "shutdown":  # the first script's follower: running at its ray.shutdown()
        out = request.getfixturevalue("run")
    else:  # a script that simply ends: Ray's own shutdown at exit meets the running follower
        out = _python(_FOLLOWER_SCRIPT)
    said = out.stdout + out.stderr
    # Ray's core worker, torn down under a call of the follower's thread, ends the process with:
    assert "The process will exit" not in said, said[-3000:]
    assert out.returncode == 0, said[-3000:]
    assert "following 2" in out.stdout, said[-3000:]  # on the version its thread applied
    assert ("after shutdown" in out.stdout) == (end == "shutdown"), said[-3000:]

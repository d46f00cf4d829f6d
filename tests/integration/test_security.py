"""What a hostile local process can do to raysync's node-local doorbells: nothing.

The attacker (``tests/_attacker.py``) has Python's standard library and raysync's
public formats, no Ray and no token. Each test runs it twice: as another Unix user
(``nobody``, when the tests run as root: the sockets are out of its reach) and as the
same user as the cluster (another job of the same uid: every datagram it can send
is checked and dropped). After each attack a real push is the barrier: the victim's
socket queue holds the attacker's datagrams before that push's ring, so by the time
``hub.wait`` returns the doorbell has dealt with all of them.

The attacker is told the victims' pids and attacks their sockets alone: the test in the other
pytest worker has doorbells too, and a flood of them would turn its rings into Ray calls
(nothing lost, but a test there that checks how its versions came would fail).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import raysync
from raysync.transports import doorbell
from tests._support import PATH_RING_ACK_S, assert_same_weights, raysync_files_in_shm, small_policy

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="needs Linux (memfd, SO_PASSCRED)")

_OTHER_PYTHON = "/usr/bin/python3"  # the system's interpreter: readable by nobody (a venv under /root is not)

# The ``hub`` fixture's settings: rung subscribers get ``PATH_RING_ACK_S`` to ack, so a Ray call
# made to one means it was wedged, not that the machine was busy (and a wedged one makes
# ``hub.wait`` run out instead of being handed its version by call unseen).
HUB_SETTINGS = raysync.HubSettings(ring_ack_s=PATH_RING_ACK_S)


@pytest.fixture(scope="module")
def public_dir() -> Iterator[Path]:
    """A directory every user can read and write (pytest's own are the test user's alone)."""
    where = Path(tempfile.mkdtemp(prefix="attacker-"))
    os.chmod(where, 0o777)
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(params=["other-user", "same-user"])
def attacker(request: pytest.FixtureRequest, public_dir: Path) -> list[str]:
    """The command line that runs ``tests/_attacker.py`` as the attacker."""
    script = public_dir / "attacker.py"
    shutil.copy(Path(__file__).parents[1] / "_attacker.py", script)
    os.chmod(script, 0o644)
    if request.param == "same-user":
        return [sys.executable, str(script)]
    if os.getuid() != 0 or shutil.which("setpriv") is None or not os.path.exists(_OTHER_PYTHON):
        pytest.skip("another user's attack needs root (to switch to nobody), setpriv and /usr/bin/python3")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", _OTHER_PYTHON, str(script)]


def _attack(cmd: list[str], mode: str, victims: list[Any], **args: Any) -> dict[str, Any]:
    out = subprocess.run([*cmd, mode, _args(victims, args)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    summary: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["targets"], "the attacker found no raysync socket to attack"
    return summary


def _args(victims: list[Any], args: dict[str, Any]) -> str:
    """An attack's arguments, with the pids of the processes whose sockets it attacks."""
    return json.dumps({**args, "pids": ray.get([v.pid.remote() for v in victims])})


def _other_user(cmd: list[str]) -> bool:
    return cmd[0] == "setpriv"


def _victim(hub_name: str) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name)
    class Victim:
        def __init__(self) -> None:
            self.policy = small_policy(0)
            self.records: list[str] = []

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

        def pid(self) -> int:
            return os.getpid()

        def watch_logs(self) -> None:
            victim = self

            class Keep(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    victim.records.append(record.getMessage())

            handler = Keep(logging.WARNING)
            for name in ("raysync.transports.doorbell", "raysync.receivers"):
                logging.getLogger(name).addHandler(handler)

        def logged(self) -> list[str]:
            return list(self.records)

    actor = Victim.remote()
    ray.get(actor.raysync_version.remote(), timeout=60)
    return actor


def _push_and_check(hub: raysync.HubClient, actors: list[Any], seed: int) -> int:
    """The barrier: a real push, waited for; every actor holds it bit for bit and says so."""
    v = hub.push(small_policy(seed))
    hub.wait(v, timeout=60)
    for actor in actors:
        assert ray.get(actor.raysync_version.remote()) == v
        assert_same_weights(ray.get(actor.weights.remote()), small_policy(seed).state_dict())
    rows = hub.status()["subscribers"]
    assert all(r["applied"] == v and r["lag"] == 0 for r in rows), rows
    return v


def _schema() -> dict[str, list[int]]:
    return {k: list(t.shape) for k, t in small_policy(0).state_dict().items()}


def test_forged_rings_change_no_weights_and_no_version(
    attacker: list[str], hub: raysync.HubClient, hub_name: str
) -> None:
    victims = [_victim(hub_name)]
    _push_and_check(hub, victims, 1)
    sub_ids = [r["subscriber"] for r in hub.status()["subscribers"]]  # in Ray's logs: readable by all
    summary = _attack(attacker, "forge", victims, version=10**9, sub_ids=sub_ids, schema=_schema(), fill=7.0)
    if _other_user(attacker):
        assert summary["sent"] == 0 and summary["refused"]  # the sockets are out of its reach
    v = _push_and_check(hub, victims, 2)  # not 1,000,000,000, and v's own weights
    assert hub.latest() == v


def test_pickled_datagrams_run_no_code(
    attacker: list[str], hub: raysync.HubClient, hub_name: str, public_dir: Path
) -> None:
    victim = _victim(hub_name)
    _push_and_check(hub, [victim], 1)
    marker = public_dir / f"ran-{uuid.uuid4().hex[:6]}"
    _attack(attacker, "pickle", [victim], marker=str(marker))
    _push_and_check(hub, [victim], 2)
    assert not marker.exists()


def test_a_ring_naming_a_fifo_wedges_nothing(
    attacker: list[str], hub: raysync.HubClient, hub_name: str, public_dir: Path
) -> None:
    victim = _victim(hub_name)
    _push_and_check(hub, [victim], 1)
    fifo = public_dir / f"fifo-{uuid.uuid4().hex[:6]}"
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    sub_ids = [r["subscriber"] for r in hub.status()["subscribers"]]
    _attack(attacker, "fifo", [victim], fifo=str(fifo), sub_ids=sub_ids)
    before = hub.status()["here"]
    for seed in (2, 3, 4):
        _push_and_check(hub, [victim], seed)
    # still by doorbell: no ring went unanswered, so no version fell back to a Ray call
    after = hub.status()["here"]
    assert after["rung"] - before["rung"] == 3
    assert after["delivered"] == before["delivered"]


def test_floods_of_junk_are_logged_once_per_interval(
    attacker: list[str], hub: raysync.HubClient, hub_name: str
) -> None:
    victim = _victim(hub_name)
    _push_and_check(hub, [victim], 1)
    ray.get(victim.watch_logs.remote())
    summary = _attack(attacker, "junk", [victim], count=1000)
    _push_and_check(hub, [victim], 2)
    logged = ray.get(victim.logged.remote())
    if _other_user(attacker):
        assert summary["sent"] == 0 and logged == []
    else:
        assert summary["sent"] > 0  # some reached the doorbell (most found its queue full: refused)
        assert len(logged) <= 1, logged[:3]
        assert all("refused what was not from raysync" in line for line in logged), logged[:3]


def test_segments_of_other_namespaces_are_left_alone(hub: raysync.HubClient, hub_name: str) -> None:
    """Nothing in /dev/shm is raysync's any more: nothing there is written, swept or deleted.

    The old sweep deleted any ``raysync-v-<pid>-...`` whose pid it could not see, which from
    another PID namespace sharing /dev/shm was a live writer's segment.
    """
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    other = Path(f"/dev/shm/raysync-v-4194000-policy-{uuid.uuid4().hex[:8]}-1")  # a pid not visible here
    other.write_bytes(b"a live writer's segment in another PID namespace")
    before = raysync_files_in_shm() - {other.name}
    try:
        victim = _victim(hub_name)
        for seed in (1, 2):
            _push_and_check(hub, [victim], seed)
        assert other.exists()
        assert raysync_files_in_shm() - {other.name} == before  # no file of ours appeared
    finally:
        other.unlink(missing_ok=True)


def test_a_flood_during_pushes_changes_nothing(
    hub: raysync.HubClient, hub_name: str, attacker: list[str]
) -> None:
    """Junk at the victim's doorbell while versions go out, for as long as it lasts: each arrives
    whole, bit for bit."""
    victims = [_victim(hub_name)]
    _push_and_check(hub, victims, 1)
    flood = subprocess.Popen([*attacker, "junk", _args(victims, {"seconds": 2.0})], stdout=subprocess.PIPE)
    try:
        seed = 2
        while flood.poll() is None or seed < 4:  # until the flood is over (two versions at least)
            assert seed < 500, "the flood did not end"
            _push_and_check(hub, victims, seed)
            seed += 1
    finally:
        out, _ = flood.communicate(timeout=60)
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["sent"] > 0 or _other_user(attacker)

"""Doorbell socket files of processes that are gone are removed (raysync/transports/doorbell/sockets.py);
nothing else in the runtime directory is touched. No Ray."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raysync.transports import doorbell
from raysync.transports.doorbell import Doorbell, Ringer, sockets

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="needs Linux (memfd, SO_PASSCRED)")


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private runtime directory of this test's own (the machine's is shared with other runs)."""
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    monkeypatch.setattr(sockets, "_RUNTIME", [str(base)])
    return base


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def live_pid() -> Iterator[int]:
    """The pid of a process that runs for the test's length."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield child.pid
    child.kill()
    child.wait()


def _left_behind(path: Path) -> Path:
    """A socket file nobody listens on: what a process killed with SIGKILL leaves."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(path))
    sock.close()
    return path


def _listening(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(path))
    sock.listen(1)
    return sock


def test_a_killed_subscribers_socket_is_swept_by_the_next_doorbell(runtime: Path) -> None:
    """A subscriber process killed outright (no exit handler) leaves its socket file; the next
    doorbell made on the node removes it, and its own stays until it closes."""
    code = (
        "import os; from raysync.transports.doorbell import sockets; "
        "sock, path = sockets.listen('sub'); print(path, flush=True); os._exit(0)"
    )
    env = {**os.environ, "RAYSYNC_RUNTIME_DIR": str(runtime)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    stale = out.stdout.strip()
    assert os.path.dirname(stale) == str(runtime) and os.path.exists(stale)  # left behind
    bell = Doorbell()
    try:
        assert not os.path.exists(stale)
        assert os.listdir(runtime) == [os.path.basename(bell.address)]
    finally:
        bell.close()
    assert os.listdir(runtime) == []


def test_a_new_ringer_sweeps_too(runtime: Path, dead_pid: int) -> None:
    stale = _left_behind(runtime / f"sub-{dead_pid}-0123456789ab")
    Ringer().close()
    assert not stale.exists()


def test_only_dead_doorbells_of_this_user_go(
    runtime: Path, dead_pid: int, live_pid: int, tmp_path: Path
) -> None:
    stale = [_left_behind(runtime / f"sub-{dead_pid}-{i:012x}") for i in range(3)]
    # a live process's socket, even one nobody listens on yet (bound, listen() not called yet)
    live = _left_behind(runtime / f"sub-{live_pid}-0123456789ab")
    # the pid is gone here, yet someone listens (a process of another pid namespace): kept
    answered = runtime / f"sub-{dead_pid}-aaaaaaaaaaaa"
    listener = _listening(answered)
    # a symlink named like ours, to a dead socket elsewhere: neither it nor its target goes
    elsewhere = _left_behind(tmp_path / "elsewhere")
    link = runtime / f"sub-{dead_pid}-bbbbbbbbbbbb"
    link.symlink_to(elsewhere)
    # a plain file named like ours, and a dead socket not named like ours
    plain = runtime / f"sub-{dead_pid}-cccccccccccc"
    plain.write_bytes(b"not a socket")
    other = _left_behind(runtime / f"other-{dead_pid}-dddddddddddd")
    try:
        assert sockets.sweep() == 3
        assert not any(path.exists() for path in stale)
        assert all(os.path.lexists(p) for p in (live, answered, link, elsewhere, plain, other))
        assert sockets.sweep() == 0
    finally:
        listener.close()


def test_nothing_is_swept_from_a_directory_that_is_not_this_users_alone(
    tmp_path: Path, dead_pid: int
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # as another user might have made it: not ours to clean
    stale = _left_behind(shared / f"sub-{dead_pid}-0123456789ab")
    assert sockets.sweep(str(shared)) == 0
    assert stale.exists()

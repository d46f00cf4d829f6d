"""What ``raysync status`` says when it cannot connect, and ``raysync --version``, without a Ray cluster.

A cluster started with ``ray start`` (Ray 2.60) refuses a client without ``RAY_AUTH_MODE=token``,
and Ray's ``ray.init`` then retries for minutes, logging ``Unauthenticated ... InvalidAuthToken``
per attempt to the process's standard error. Here ``ray.init`` is replaced by one that does just
that (the real cluster: tests/system/test_job.py), in a process of its own: the command ends it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

# ray.init as Ray 2.60 behaves against a token-authenticated GCS without the token: its core logs a
# refusal to file descriptor 2 about once a second and ray.init does not return.
_REFUSED_RAYSYNC = (
    "import os, sys, time, ray\n"
    "def init(**_):\n"
    "    for _ in range(600):\n"
    "        os.write(2, b'[W 1 1] gcs_client.cc:210: Failed to get cluster ID from '\n"
    "                 b'GCS server: Unauthenticated: RPC error: InvalidAuthToken: Authentication token is '\n"
    "                 b'missing or incorrect\\n')\n"
    "        time.sleep(1)\n"
    "ray.init = init\n"
    "ray.is_initialized = lambda: False\n"
    "from raysync.ops.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.fixture
def listening() -> Iterator[str]:
    """An address that accepts TCP connections (the command's probe passes)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        yield f"127.0.0.1:{server.getsockname()[1]}"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    return env | extra


def test_status_against_a_token_cluster_without_the_token_fails_at_once_token_hint_first(
    listening: str,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _REFUSED_RAYSYNC, "status", "--address", listening, "--timeout", "120"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert done.returncode == 1, done.stderr
    (message,) = done.stderr.strip().splitlines()  # one line: none of Ray's per-attempt warnings
    assert message.startswith(
        f"raysync status: error: the Ray cluster at {listening!r} refused this client's authentication: "
        "set RAY_AUTH_MODE=token"
    ), message
    assert "within --timeout" not in message and "slow cluster" not in message  # not a timeout
    assert "InvalidAuthToken" in message  # what Ray said, at the end
    assert done.stdout == ""


def test_status_with_a_wrong_token_says_the_token_is_not_the_clusters(listening: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _REFUSED_RAYSYNC, "status", "--address", listening, "--timeout", "120"],
        capture_output=True,
        text=True,
        env=_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32),
        timeout=240,
    )
    assert done.returncode == 1, done.stderr
    (message,) = done.stderr.strip().splitlines()
    assert "refused this client's authentication: RAY_AUTH_MODE=token is set, so the token" in message
    assert "RAY_AUTH_TOKEN" in message


@pytest.mark.parametrize(
    "command", [[sys.executable, "-m", "raysync"], [str(Path(sys.executable).parent / "raysync")]]
)
def test_version_prints_the_installed_version(command: list[str]) -> None:
    done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"raysync {version('raysync')}"

"""Connecting the ``raysync`` command to a Ray cluster, bounded, with one clear message on failure.

``ray.init`` to an address where no GCS answers retries for many minutes and prints a
warning per attempt; to a cluster started with ``ray start`` (token authentication on, Ray
2.60) from a client without ``RAY_AUTH_MODE=token`` it retries just as long, each attempt
refused with ``Unauthenticated ... InvalidAuthToken``. :func:`connect` turns a closed port
away at once (a TCP probe), holds the process's standard error while connecting (see
:class:`HeldStderr`), fails at once, token hint first, when Ray logs an authentication
refusal there, and ends the process with one message at the deadline otherwise.

Example:
    >>> deadline = time.monotonic() + 30.0
    >>> connect("10.0.0.5:6379", timeout=30.0, deadline=deadline, command="status")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Any

__all__ = ["ClusterUnreachable", "HeldStderr", "auth_refused", "connect", "endpoint"]

logger = logging.getLogger(__name__)

POLL_S = 0.1
"""How often the watch thread reads what Ray wrote while connecting."""

AUTH_REFUSALS = ("InvalidAuthToken", "Unauthenticated")
"""What Ray's core logs (``gcs_client.cc: Failed to get cluster ID from GCS server: Unauthenticated:
RPC error: InvalidAuthToken: Authentication token is missing or incorrect``, Ray 2.60) for each
connection attempt its GCS refused for want of the cluster's token."""


class ClusterUnreachable(Exception):
    """No connection to the cluster; the message says why and what to check (one line)."""


def error_line(command: str, err: object) -> str:
    """The one line the ``raysync`` command prints for a failure."""
    return f"raysync {command}: error: {err}"


def auth_refused(text: str) -> str | None:
    """The line of Ray's log ``text`` that says its GCS refused this client's authentication, or None.

    Example:
        >>> auth_refused("W gcs_client.cc:210: ... Unauthenticated: RPC error: InvalidAuthToken: missing")
        'W gcs_client.cc:210: ... Unauthenticated: RPC error: InvalidAuthToken: missing'
    """
    for line in text.splitlines():
        if any(word in line for word in AUTH_REFUSALS):
            return line.strip()
    return None


def token_message(target: str, ray_said: str) -> str:
    """The message for a cluster that refused this client's authentication: the token hint first."""
    mode = os.environ.get("RAY_AUTH_MODE")
    said = ray_said.split("Unauthenticated:", 1)[-1].strip()[:200]
    if mode == "token":
        fix = (
            "RAY_AUTH_MODE=token is set, so the token this client sent is not the cluster's: set "
            "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the token `ray start` used, by default "
            "~/.ray/auth_token on the head node"
        )
    else:
        fix = (
            "set RAY_AUTH_MODE=token (e.g. `RAY_AUTH_MODE=token raysync status ...`): a cluster started "
            "with `ray start` on Ray 2.60 requires token authentication; the token is read from "
            "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (the head node's)"
        )
    return f"the Ray cluster at {target!r} refused this client's authentication: {fix} (Ray: {said})"


def connect(address: str | None, *, timeout: float, deadline: float, command: str) -> bool:
    """Connect this process to a cluster unless it already is; True if we connected it.

    A TCP probe first turns a closed port away at once; the process's standard error is
    held back while connecting (see :class:`HeldStderr`); a watch thread ends the process
    with one message and exit code 1 (:func:`os._exit`: ``ray.init`` cannot be interrupted,
    and Ray's exit hook would wait on it) as soon as Ray logs that the cluster refused this
    client's authentication, or at ``deadline`` (a :func:`time.monotonic` time) if the
    probe or ``ray.init`` is still going then.

    Args:
        address: the cluster (``HOST:PORT``, ``ray://...``); None: ``RAY_ADDRESS``, else ``auto``.
        timeout: the seconds ``deadline`` stands for, for the message.
        deadline: when to give up.
        command: the ``raysync`` subcommand, for the message.

    Raises:
        ClusterUnreachable: nothing accepts connections at the address, or ``ray.init`` failed.
    """
    import ray

    if ray.is_initialized():
        return False
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    where_to = endpoint(target)
    where = f"{where_to[0]}:{where_to[1]}" if where_to is not None else "there"
    within = f"within --timeout {timeout:g} s (a slow cluster may need more)"
    stage = ["probe" if where_to is not None else "init"]  # how far connecting got
    settled = threading.Lock()  # taken by whichever comes first: the connection or the watch thread
    held = HeldStderr()
    done = threading.Event()

    def give_up(message: str) -> None:
        if not settled.acquire(blocking=False):
            return  # connected (or failed) in time
        held.close()
        print(error_line(command, message), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def watch() -> None:
        while not done.wait(min(POLL_S, max(deadline - time.monotonic(), 0.0))):
            refused = auth_refused(held.peek())
            if refused is not None:
                give_up(token_message(target, refused))
                return
            if time.monotonic() >= deadline:
                if stage[0] == "probe":
                    why = f"no TCP connection to {where} {within}"
                elif where_to is not None:
                    why = f"{where} accepts connections, but no Ray GCS answered {within}"
                else:
                    why = f"no Ray GCS answered {within}"
                give_up(unreachable(target, why))
                return

    watcher = threading.Thread(target=watch, name="raysync-connect-watch", daemon=True)
    try:
        with held:
            watcher.start()
            try:
                if where_to is not None:
                    with socket.create_connection(where_to, timeout=max(deadline - time.monotonic(), 0.01)):
                        pass
                    stage[0] = "init"
                ray.init(address=target, logging_level=logging.WARNING, log_to_driver=False)
            finally:
                settled.acquire()  # blocks for good if the watch thread is already ending the process
                done.set()
    except Exception as err:
        refused = auth_refused(held.text)
        if refused is not None:
            raise ClusterUnreachable(token_message(target, refused)) from None
        if stage[0] == "probe" and isinstance(err, TimeoutError):  # a hair before the watch thread
            why = f"no TCP connection to {where} {within}"
        elif stage[0] == "probe" and isinstance(err, OSError):
            why = f"cannot open a TCP connection to {where} ({err.strerror or type(err).__name__})"
        else:
            why = f"{type(err).__name__}: {str(err).strip()[:300]}"
        raise ClusterUnreachable(unreachable(target, why)) from None
    finally:
        if held.text and ray.is_initialized():
            sys.stderr.write(held.text)  # a connection that worked: Ray's own warnings stay visible
        elif held.text:
            logger.debug("while connecting to %r, Ray wrote:\n%s", target, held.text)
    return True


def endpoint(target: str) -> tuple[str, int] | None:
    """``(host, port)`` of an address such as ``10.0.0.5:6379``, ``[::1]:6379`` or ``ray://h:10001``.

    None for anything else (``auto``, ``local``, a host without a port): ``ray.init`` resolves
    and checks those itself.

    Example:
        >>> endpoint("[::1]:6379")
        ('::1', 6379)
    """
    rest = target.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host, int(port)) if host and 0 < int(port) < 65536 else None


def unreachable(target: str, why: str) -> str:
    """The one-line message for a cluster this command could not connect to."""
    why = why.rstrip().rstrip(".")  # Ray's own messages end with one
    return (
        f"no Ray cluster at {target!r}: {why}. Check that a cluster is running there (`ray status "
        f"--address {target}`; start one with `ray start --head`), that --address or RAY_ADDRESS "
        "names its GCS as HOST:PORT (port 6379 by default), and, for a cluster started with "
        "`ray start` on Ray 2.60, that RAY_AUTH_MODE=token is set"
    )


class HeldStderr:
    """Sends file descriptor 2 to a temporary file while open; ``text`` is what landed there.

    Ray's core (C++) logs a warning to the process's standard error for every failed GCS
    attempt; redirecting ``sys.stderr`` would not catch those.
    """

    def __init__(self) -> None:
        self.text = ""
        self._file: Any = None
        self._saved: int | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> HeldStderr:
        sys.stderr.flush()
        try:
            self._saved = os.dup(2)
        except OSError:  # no standard error to hold back
            return self
        self._file = tempfile.TemporaryFile()
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def peek(self, limit: int = 1 << 20) -> str:
        """What landed so far (its first ``limit`` bytes), while held; ``text`` once closed."""
        with self._lock:
            if self._saved is None:
                return self.text
            return os.pread(self._file.fileno(), limit, 0).decode(errors="replace")

    def close(self) -> None:
        """Give file descriptor 2 back and read what was held (once; later calls do nothing)."""
        with self._lock:
            if self._saved is None:
                return
            sys.stderr.flush()
            os.dup2(self._saved, 2)
            os.close(self._saved)
            self._saved = None
            self._file.seek(0)
            self.text = self._file.read().decode(errors="replace")
            self._file.close()

"""Ports for the servers a test or benchmark starts on this machine (a gloo group, a `ray start`).

Asking the kernel for a free port (bind to port 0, read it, close) and handing the number to
another process to bind races with every process that binds or connects meanwhile: the kernel
gives out the same ephemeral range to all of them, and Ray's workers take ports of their own
(10002-19999 by default) as they start. On the 2-core machine, with a second pytest worker
starting actors beside it, a gloo group's port was taken that way (EADDRINUSE). So ports are
drawn at random from outside both ranges, where nothing binds unless told a number, and checked
free as they are drawn.

Example:
    >>> port = free_port()
    >>> 20000 <= port < 65536
    True
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_ports"]

_RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default --min-worker-port .. --max-worker-port
_LOWEST = 20000
_TRIES = 200


def _ephemeral_range() -> range:
    """The kernel's range for port 0 and outgoing connections (Linux; a wide guess elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 65536)


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_ports(n: int, *, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that nothing listens on now and that no process takes by itself.

    Raises:
        RuntimeError: no ``n`` such ports were found in a few hundred draws.
    """
    ephemeral = _ephemeral_range()
    rng = random.SystemRandom()
    found: list[int] = []
    for _ in range(_TRIES):
        port = rng.randrange(_LOWEST, 65536)
        if port in ephemeral or port in _RAY_WORKER_PORTS or port in found:
            continue
        if _bindable(port, host):
            found.append(port)
            if len(found) == n:
                return found
    raise RuntimeError(f"found {len(found)} free ports of {n} outside {ephemeral} in {_TRIES} draws")


def free_port(*, host: str = "127.0.0.1") -> int:
    """One port as :func:`free_ports` draws them."""
    return free_ports(1, host=host)[0]

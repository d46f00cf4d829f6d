"""The doorbell's sockets: a directory of the Ray session's user alone, datagrams with credentials.

Every socket lives in :func:`runtime_dir` (mode 0700, owned by this user, checked), so
no other Unix user can even send to it; each datagram arrives with its sender's uid
(``SO_PASSCRED``), checked again; what is refused is counted and logged at most once
per :data:`LOG_EVERY_S` (:class:`Drops`).
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

from raysync.transports.doorbell import wire

__all__ = [
    "LOG_EVERY_S",
    "Datagram",
    "Drops",
    "available",
    "bind",
    "max_bytes",
    "receive",
    "runtime_dir",
    "unlink",
]

logger = logging.getLogger(__name__)

_DEFAULT_MAX_BYTES = 8 << 20
_SOCK_BUF = 4 << 20
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANC = socket.CMSG_SPACE(_CREDS.size) + socket.CMSG_SPACE(array.array("i").itemsize * 4)
LOG_EVERY_S = 10.0
"""Dropped datagrams are logged at most this often (with the counts since the last line)."""


def max_bytes() -> int:
    """The largest version (bytes) a relay hands over by doorbell; ``0``: never.

    ``RAYSYNC_DOORBELL_BYTES`` in the relay's environment sets it (8 MiB by default):
    above it, one Ray call per subscriber costs less than the extra copy into
    shared memory.

    Example:
        >>> max_bytes()
        8388608
    """
    raw = os.environ.get("RAYSYNC_DOORBELL_BYTES", "")
    if not raw:
        return _DEFAULT_MAX_BYTES
    try:
        return max(0, int(raw))
    except ValueError:
        logger.warning(
            "RAYSYNC_DOORBELL_BYTES=%r is not a number of bytes; using %d", raw, _DEFAULT_MAX_BYTES
        )
        return _DEFAULT_MAX_BYTES


def available() -> bool:
    """Whether this process can use the doorbell: Linux (sealed memfds, credentials), a private directory."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and runtime_dir() is not None


_RUNTIME: list[str | None] = []
_RUNTIME_LOCK = threading.Lock()


def runtime_dir() -> str | None:
    """The directory of this user's doorbell sockets (mode 0700, owned by this user); None if none.

    ``RAYSYNC_RUNTIME_DIR``, else ``<tmp>/raysync-<uid>``. A directory that exists but
    is not this user's alone (another user made it first, a symlink, group or other
    bits) is never used: this process then takes a fresh private one (``mkdtemp``).
    Peers need not guess it: every socket's full path reaches them through the hub.

    Example:
        >>> runtime_dir()
        '/tmp/raysync-0'
    """
    with _RUNTIME_LOCK:
        if not _RUNTIME:
            _RUNTIME.append(_make_runtime_dir())
        return _RUNTIME[0]


def _make_runtime_dir() -> str | None:
    uid = os.getuid()
    base = os.environ.get("RAYSYNC_RUNTIME_DIR") or os.path.join(tempfile.gettempdir(), f"raysync-{uid}")
    with contextlib.suppress(FileExistsError, OSError):
        os.mkdir(base, 0o700)
    if _private(base, uid):
        return base
    logger.warning("%s is not a directory of this user's alone (mode 0700): using a fresh private one", base)
    try:
        return tempfile.mkdtemp(prefix=f"raysync-{uid}-")
    except OSError as err:
        logger.info("no private directory for doorbells (%s): versions come by Ray call", err)
        return None


def _private(path: str, uid: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) & 0o077 == 0


def bind(kind: str) -> tuple[socket.socket, str]:
    """A datagram socket bound in the runtime directory, receiving senders' credentials."""
    base = runtime_dir()
    if base is None:
        raise OSError(errno.ENOENT, "no private directory for doorbell sockets")
    path = os.path.join(base, f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    if len(path.encode()) > 107:
        raise OSError(errno.ENAMETOOLONG, f"socket path too long: {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    old = os.umask(0o177)  # the socket file: this user only (the directory is too)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    return sock, path


def unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class Drops:
    """Datagrams refused, by reason; logged at most once per :data:`LOG_EVERY_S`."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.total: collections.Counter[str] = collections.Counter()
        self._since: collections.Counter[str] = collections.Counter()
        self._logged = 0.0

    def drop(self, reason: str) -> None:
        self.total[reason] += 1
        self._since[reason] += 1
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            counts = ", ".join(f"{n} {r}" for r, n in self._since.most_common())
            logger.warning(
                "%s: dropped datagrams not from raysync (%s); the next such line in %.0f s at the earliest",
                self.where,
                counts,
                LOG_EVERY_S,
            )
            self._since.clear()


@dataclass
class Datagram:
    data: bytes
    fds: list[int]
    uid: int | None
    truncated: bool

    def close_fds(self, keep: int | None = None) -> None:
        for fd in self.fds:
            if fd != keep:
                with contextlib.suppress(OSError):
                    os.close(fd)


def receive(sock: socket.socket, flags: int = 0) -> Datagram:
    data, anc, msg_flags, _ = sock.recvmsg(wire.MAX_DATAGRAM + 1, _ANC, flags)
    fds: list[int] = []
    uid = None
    for level, kind, cdata in anc:
        if level != socket.SOL_SOCKET:
            continue
        if kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", cdata[: len(cdata) - len(cdata) % 4]))
        elif kind == socket.SCM_CREDENTIALS and len(cdata) >= _CREDS.size:
            uid = _CREDS.unpack_from(cdata)[1]
    truncated = bool(msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)) or len(data) > wire.MAX_DATAGRAM
    return Datagram(data, fds, uid, truncated)

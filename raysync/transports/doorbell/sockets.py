"""The doorbell's sockets: in a directory of the Ray session's user alone, one connection per ringer.

A subscriber process listens on a ``SOCK_SEQPACKET`` Unix socket in :func:`runtime_dir`
(mode 0700, owned by this user, checked), so no other Unix user can even connect; the
peer's uid is checked again (``SO_PEERCRED``). A ringer (relay or hub) keeps one
connection per subscriber process: its rings and the acks travel on it, message by
message (``SCM_RIGHTS`` carries each ring's segment), in a queue no other process can
write into. What is refused is counted and logged at most once per :data:`LOG_EVERY_S`
(:class:`Drops`).

A socket file goes with its process: unlinked at exit, and, when the process was killed
(no exit handler runs), by the next doorbell or ringer made on the node (:func:`sweep`).
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import logging
import os
import re
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
    "Drops",
    "Message",
    "available",
    "connect",
    "listen",
    "peer_uid",
    "receive",
    "runtime_dir",
    "sweep",
    "unlink",
]

logger = logging.getLogger(__name__)

_SOCK_BUF = 4 << 20
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANC = socket.CMSG_SPACE(array.array("i").itemsize * 4)  # room for a few descriptors (more are refused)
_BACKLOG = 16
LOG_EVERY_S = 10.0
"""Dropped datagrams are logged at most this often (with the counts since the last line)."""


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


_OURS = re.compile(r"sub-([0-9]{1,10})-[0-9a-f]{12}")  # what listen("sub") names: sub-<pid>-<random>


def sweep(base: str | None = None) -> int:
    """Remove the doorbell sockets of processes that are gone from ``base`` (:func:`runtime_dir`);
    how many were removed.

    Only what is provably a dead doorbell of this user goes: a name :func:`listen` makes, a
    socket (``lstat``: a symlink is never followed, nor removed), owned by this user, whose
    process (the pid in its name) does not exist, and on which nobody listens (``connect``
    refused). Anything else stays, in a directory that is not this user's alone too.

    Example:
        >>> sweep()   # in a new subscriber process or relay
        3
    """
    base = runtime_dir() if base is None else base
    uid = os.getuid()
    if base is None or not _private(base, uid):
        return 0
    removed = 0
    try:
        entries = list(os.scandir(base))
    except OSError as err:
        logger.debug("could not list %s: %s", base, err)
        return 0
    for entry in entries:
        found = _OURS.fullmatch(entry.name)
        if found is None or int(found.group(1)) == os.getpid():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid or _process_exists(int(found.group(1))):
            continue
        if _refused(entry.path):
            unlink(entry.path)
            removed += 1
    if removed:
        logger.info("removed %d doorbell socket(s) of processes that are gone from %s", removed, base)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's, or no pid at all: keep
        return True
    return True


def _refused(path: str) -> bool:
    """Whether nobody listens on the socket at ``path`` (a live doorbell accepts, or is busy)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.setblocking(False)
        probe.connect(path)
    except OSError as err:
        return err.errno == errno.ECONNREFUSED
    finally:
        probe.close()
    return False


def listen(kind: str) -> tuple[socket.socket, str]:
    """A listening ``SOCK_SEQPACKET`` socket in the runtime directory (non-blocking); its path."""
    base = runtime_dir()
    if base is None:
        raise OSError(errno.ENOENT, "no private directory for doorbell sockets")
    path = os.path.join(base, f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    if len(path.encode()) > 107:
        raise OSError(errno.ENAMETOOLONG, f"socket path too long: {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)  # the socket file: this user only (the directory is too)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(_BACKLOG)
    sock.setblocking(False)
    return sock, path


def connect(address: str) -> socket.socket:
    """A non-blocking connection to a doorbell, whose peer runs as this user.

    Raises:
        OSError: nobody listens there (``ECONNREFUSED``, ``ENOENT``), its queue of new
            connections is full (``EAGAIN``), or its peer is another user.
    """
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.setblocking(False)
        conn.connect(address)
        if peer_uid(conn) != os.getuid():
            raise OSError(errno.EPERM, f"{address} belongs to another user")
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    except BaseException:
        conn.close()
        raise
    return conn


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a connection (the kernel's word, ``SO_PEERCRED``)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    return int(_CREDS.unpack(raw)[1])


def unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class Drops:
    """Messages and connections refused, by reason; logged at most once per :data:`LOG_EVERY_S`."""

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
                "%s: refused what was not from raysync (%s); the next such line in %.0f s at the earliest",
                self.where,
                counts,
                LOG_EVERY_S,
            )
            self._since.clear()


@dataclass
class Message:
    """One message off a connection: its bytes and the descriptors that came with it."""

    data: bytes
    fds: list[int]
    truncated: bool

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def receive(conn: socket.socket) -> Message | None:
    """The next message of a connection (``None``: the peer closed it).

    Raises:
        BlockingIOError: none waiting.
        OSError: the connection broke.
    """
    data, anc, msg_flags, _ = conn.recvmsg(wire.MAX_MESSAGE + 1, _ANC)
    fds: list[int] = []
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", cdata[: len(cdata) - len(cdata) % 4]))
    if not data and not fds:
        return None
    truncated = bool(msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)) or len(data) > wire.MAX_MESSAGE
    return Message(data, fds, truncated)

"""The node-local hop from a relay to its node's subscriber processes: shared memory and a doorbell.

A relay hands a version to the subscribers on its node. Made as one Ray actor call
per subscriber, that hop costs about a millisecond of CPU each. For versions of up
to :func:`max_bytes` (8 MiB by default) a relay instead

1. writes the version once into a shared-memory segment of its node
   (:class:`SegmentWriter`, a file in ``/dev/shm``: a header with the manifest and
   bucket ids, then the buckets),
2. rings each subscriber process's doorbell (:class:`Ringer`): one small datagram
   to a Unix socket in Linux's abstract namespace, naming the segment and every
   subscription of that process,
3. collects the acks, one datagram per process (:class:`Ringer.wait`).

In each subscriber process one daemon thread (:class:`Doorbell`) waits on its
socket, opens the segment read-only and hands it to each subscription named
(which copies what changed into its model under the actor's write lock, between
user calls) and answers. A segment is never written again once rung, so a reader
never sees two versions mixed; the relay unlinks a model's older segments (a
reader that still maps one keeps it until it lets go). Whatever does not fit this
path (no ``/dev/shm``, a subscriber that died or cannot be reached, versions over
the size limit, NIXL versions) goes by Ray actor call as before.

``RAYSYNC_DOORBELL_BYTES`` in the relay's environment sets the size limit (``0``
turns the doorbell off).

Example:
    >>> # a subscriber process
    >>> bell = doorbell()
    >>> bell.register("a1:policy", lambda ring, segment: ApplyReport(applied=ring.version))
    >>> # the relay of its node
    >>> ringer = Ringer()
    >>> path = SegmentWriter().write("policy", 3, manifest, ids, arrays)
    >>> token = ringer.ring(bell.address, "policy", 3, path, ("a1:policy",))
    >>> replies = await ringer.wait([token], timeout=0.2)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import glob
import itertools
import logging
import mmap
import os
import pickle
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysync._protocol import ApplyReport, RelayAck, Ring, RingAck, compact, expand

__all__ = [
    "Doorbell",
    "Ringer",
    "Segment",
    "SegmentWriter",
    "available",
    "doorbell",
    "max_bytes",
    "read_segment",
    "sweep_segments",
]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "raysync-v"
_ALIGN = 64
_KEEP = 4  # segments kept per model: a reader a few versions behind still finds its own
_DEFAULT_MAX_BYTES = 8 << 20
_CHUNK = 256  # subscriptions per datagram (a datagram stays far below the socket's limit)
_SOCK_BUF = 4 << 20
_IOV_MAX = 512  # buffers per pwritev (the system's limit is 1024)
_STALE_S = 300.0  # a ring unanswered this long is forgotten


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
    """Whether this process can use the doorbell: Linux (abstract sockets) with a writable ``/dev/shm``."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _address(kind: str) -> str:
    # Linux's abstract namespace: no file to clean up, gone with the process.
    return f"\0raysync-{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _datagram_socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
    sock.bind(address)
    return sock


# ---------------------------------------------------------------------------- segments
@dataclass
class Segment:
    """A version as a subscriber reads it from shared memory.

    Attributes:
        model_id: the model.
        version: the version.
        manifest: its :class:`~raysync.core.layout.Manifest`.
        ids: each bucket's identity (the hex of the object it came from).
        buckets: each bucket's tensors, as read-only uint8 arrays over the mapping.
    """

    model_id: str
    version: int
    manifest: Any
    ids: list[str | None]
    buckets: list[list[np.ndarray]]


def _segment_name(pid: int, model_id: str, version: int) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in model_id)[:40]
    return f"{SEGMENT_PREFIX}-{pid}-{safe}-{uuid.uuid4().hex[:8]}-{version}"


class SegmentWriter:
    """A relay's segments: one per version rung, the newest few kept per model.

    Example:
        >>> writer = SegmentWriter()
        >>> path = writer.write("policy", 3, manifest, ids, arrays)
        >>> writer.close()   # unlink every segment this writer made
    """

    def __init__(self, keep: int = _KEEP) -> None:
        self._keep = keep
        self._paths: dict[str, collections.deque[str]] = {}

    def write(
        self,
        model_id: str,
        version: int,
        manifest: Any,
        ids: Sequence[str | None],
        buckets: Sequence[Sequence[np.ndarray]],
    ) -> str:
        """Write a version (each bucket: its tensors' uint8 arrays) into a new segment; its path.

        Raises:
            OSError: ``/dev/shm`` is full or missing (the caller falls back to actor calls).
        """
        sizes = [[int(a.nbytes) for a in arrays] for arrays in buckets]
        header = pickle.dumps(
            (model_id, version, manifest, list(ids), sizes), protocol=pickle.HIGHEST_PROTOCOL
        )
        # One gathered write (pwritev) of header, buckets and the padding between them: no
        # mapping to fault in and tear down, and a full /dev/shm is an error here, never a SIGBUS.
        parts: list[Any] = [len(header).to_bytes(8, "little"), header]
        end = 8 + len(header)
        for arrays in buckets:
            for a in arrays:
                pad = _aligned(end) - end
                if pad:
                    parts.append(bytes(pad))
                n = int(a.nbytes)
                if n:
                    parts.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
                end += pad + n
        path = os.path.join(SHM_DIR, _segment_name(os.getpid(), model_id, version))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            offset = 0
            for i in range(0, len(parts), _IOV_MAX):
                chunk = parts[i : i + _IOV_MAX]
                want = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in chunk)
                if os.pwritev(fd, chunk, offset) != want:
                    raise OSError(errno.ENOSPC, f"short write to {path}")
                offset += want
        except OSError:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        kept = self._paths.setdefault(model_id, collections.deque())
        kept.append(path)
        while len(kept) > self._keep:
            _unlink(kept.popleft())
        return path

    def close(self) -> None:
        """Unlink every segment this writer still keeps."""
        for kept in self._paths.values():
            while kept:
                _unlink(kept.popleft())


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def read_segment(path: str) -> Segment:
    """Map a segment read-only (a subscriber's side).

    Raises:
        FileNotFoundError: the relay unlinked it already (newer versions followed).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    hlen = int.from_bytes(mm[:8], "little")
    model_id, version, manifest, ids, sizes = pickle.loads(mm[8 : 8 + hlen])
    buckets: list[list[np.ndarray]] = []
    end = _aligned(8 + hlen)
    for bucket in sizes:
        arrays = []
        for n in bucket:
            arrays.append(np.frombuffer(mm, dtype=np.uint8, count=n, offset=end))
            end = _aligned(end + n)
        buckets.append(arrays)
    return Segment(model_id, version, manifest, ids, buckets)


def sweep_segments() -> int:
    """Unlink segments left by relays that died (their pid is gone); how many.

    Example:
        >>> sweep_segments()   # a relay does this when it starts
        0
    """
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}-*")):
        try:
            pid = int(os.path.basename(path).split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            _unlink(path)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------- the relay's side
class Ringer:
    """A relay's end of the doorbells: rings subscriber processes, collects their acks.

    Example:
        >>> ringer = Ringer()
        >>> token = ringer.ring(address, "policy", 3, path, ("a1:policy",))
        >>> acks, missing = await ringer.wait([token], timeout=0.2)
    """

    def __init__(self) -> None:
        self.address = _address("relay")
        self._sock = _datagram_socket(self.address)
        self._sock.setblocking(False)
        self._tokens = itertools.count(1)
        self._open: dict[int, _Rung] = {}
        self._reading: asyncio.AbstractEventLoop | None = None
        self.late: Callable[[str, int, list[RelayAck]], None] | None = None

    def ring(
        self, address: str, model_id: str, version: int, segment: str, sub_ids: Sequence[str]
    ) -> list[int]:
        """Ring one process for ``sub_ids``; the tokens to :meth:`wait` on (one per datagram).

        Callable from a worker thread (what it rings is registered before it is sent).

        Raises:
            OSError: the process is gone or cannot be reached (``ECONNREFUSED``,
                ``ENOENT``), or its queue is full (``EAGAIN``): call it the Ray way.
        """
        self._drop_stale()
        tokens = []
        try:
            for i in range(0, len(sub_ids), _CHUNK):
                chunk = tuple(sub_ids[i : i + _CHUNK])
                token = next(self._tokens)
                ring = Ring(token, model_id, version, segment, chunk, self.address)
                self._open[token] = _Rung(model_id, version, set(chunk))
                tokens.append(token)
                self._sock.sendto(pickle.dumps(ring, protocol=pickle.HIGHEST_PROTOCOL), address)
        except OSError:
            self.forget(tokens)
            raise
        return tokens

    def _drop_stale(self) -> None:
        """Forget rings whose process never answered (it died): the Ray call settled them."""
        cutoff = time.monotonic() - _STALE_S
        for token, rung in list(self._open.items()):
            if rung.late and rung.since < cutoff:
                self._open.pop(token, None)

    async def wait(self, tokens: Sequence[int], timeout: float | None) -> tuple[list[RelayAck], list[str]]:
        """The acks of ``tokens`` that came within ``timeout``, and the subscriptions still applying.

        Acks that come later go to :attr:`late` ``(model_id, version, acks)``. Call it on
        the event loop that reads the acks (the first call starts reading).
        """
        self._start_reading()
        rungs = [self._open[t] for t in tokens if t in self._open]
        waits = [r.done for r in rungs if not r.done.is_set()]
        if waits:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(w.wait() for w in waits)), timeout)
        acks: list[RelayAck] = []
        missing: list[str] = []
        for token, rung in zip(tokens, rungs, strict=False):
            acks.extend(rung.acks)
            rung.acks = []
            if rung.done.is_set():
                self._open.pop(token, None)
            else:
                rung.late = True
                missing.extend(sorted(rung.expected))
        return acks, missing

    def forget(self, tokens: Sequence[int]) -> None:
        """Stop waiting for ``tokens`` (their subscriptions are handed over another way)."""
        for token in tokens:
            self._open.pop(token, None)

    def _start_reading(self) -> None:
        if self._reading is not None:
            return
        loop = asyncio.get_running_loop()
        loop.add_reader(self._sock.fileno(), self._readable)
        self._reading = loop

    def _readable(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return
            try:
                ack: RingAck = pickle.loads(data)
            except Exception as err:  # not ours: ignore
                logger.debug("relay doorbell: unreadable datagram: %s", err)
                continue
            rung = self._open.get(ack.token)
            if rung is None:
                continue
            acks = expand(ack.reply, rung.version)
            for a in acks:
                rung.expected.discard(a.sub_id)
            if rung.late:
                if self.late is not None and acks:
                    self.late(rung.model_id, rung.version, acks)
            else:
                rung.acks.extend(acks)
            if not rung.expected:
                rung.done.set()
                if rung.late:
                    self._open.pop(ack.token, None)

    def close(self) -> None:
        if self._reading is not None:
            with contextlib.suppress(Exception):
                self._reading.remove_reader(self._sock.fileno())
        self._sock.close()


@dataclass
class _Rung:
    model_id: str
    version: int
    expected: set[str]
    acks: list[RelayAck] = None  # type: ignore[assignment]
    done: asyncio.Event = None  # type: ignore[assignment]
    late: bool = False
    since: float = 0.0

    def __post_init__(self) -> None:
        self.acks = []
        self.done = asyncio.Event()
        self.since = time.monotonic()


# ---------------------------------------------------------------------------- a subscriber process's side
Handler = Callable[[Ring, "Segment | None"], ApplyReport]
"""What a subscription does when rung: apply the segment's version (``None``: the segment is gone)."""


class Doorbell:
    """A process's doorbell: one socket and one daemon thread for every subscription in it.

    Handlers run on the doorbell's thread, one ring at a time; each takes its
    actor's write lock itself.
    """

    def __init__(self) -> None:
        self.address = _address("sub")
        self._sock = _datagram_socket(self.address)
        self._handlers: dict[str, Handler] = {}
        self._lock = threading.Lock()
        self.rings = 0
        self._thread = threading.Thread(target=self._loop, name="raysync-doorbell", daemon=True)
        self._thread.start()

    def register(self, sub_id: str, handler: Handler) -> str:
        """Route rings for ``sub_id`` to ``handler``; this doorbell's address (for the hub)."""
        with self._lock:
            self._handlers[sub_id] = handler
        return self.address

    def unregister(self, sub_id: str) -> None:
        with self._lock:
            self._handlers.pop(sub_id, None)

    def _loop(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except OSError as err:  # closed
                logger.debug("doorbell: %s", err)
                return
            rings = [data]
            # Rings that queued meanwhile: the newest version per subscription wins.
            while True:
                try:
                    rings.append(self._sock.recv(1 << 20, socket.MSG_DONTWAIT))
                except (BlockingIOError, InterruptedError):
                    break
            try:
                self._serve([pickle.loads(r) for r in rings])
            except Exception:  # never let the thread die
                logger.exception("doorbell: could not serve a ring")

    def _serve(self, rings: list[Ring]) -> None:
        newest: dict[str, int] = {}
        for ring in rings:
            for sub_id in ring.sub_ids:
                newest[sub_id] = max(newest.get(sub_id, 0), ring.version)
        for ring in sorted(rings, key=lambda r: -r.version):  # the newest first: the others' acks say it
            self.rings += 1
            t0 = time.perf_counter()
            segment: Segment | None = None
            if any(newest[s] == ring.version for s in ring.sub_ids):
                with contextlib.suppress(FileNotFoundError):
                    segment = read_segment(ring.segment)
            acks = []
            for sub_id in ring.sub_ids:
                with self._lock:
                    handler = self._handlers.get(sub_id)
                if handler is None:
                    acks.append(RelayAck(sub_id, None, "unknown"))
                    continue
                try:
                    report = handler(ring, segment if newest[sub_id] == ring.version else None)
                except Exception as err:  # a handler's own bug: report, keep serving
                    report = ApplyReport(failed=ring.version, error=_portable(err))
                acks.append(RelayAck(sub_id, report))
            del segment
            self._answer(ring, acks)
            logger.debug(
                "doorbell: %r version %d for %d in %.4f s",
                ring.model_id,
                ring.version,
                len(ring.sub_ids),
                time.perf_counter() - t0,
            )

    def _answer(self, ring: Ring, acks: list[RelayAck]) -> None:
        reply = compact(ring.version, acks)
        data = pickle.dumps(RingAck(ring.token, reply), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._sock.sendto(data, ring.reply_to)
        except OSError as err:
            if err.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                logger.warning("doorbell: could not answer the relay: %s", err)
            # a relay that died meanwhile: the hub hands the newest version again


def _portable(err: BaseException) -> BaseException:
    return RuntimeError(f"{type(err).__name__}: {str(err)[:500]}")


_DOORBELL: Doorbell | None = None
_DOORBELL_LOCK = threading.Lock()


def doorbell() -> Doorbell | None:
    """This process's :class:`Doorbell` (made on first use); ``None`` where there can be none."""
    global _DOORBELL
    with _DOORBELL_LOCK:
        if _DOORBELL is None and available():
            try:
                _DOORBELL = Doorbell()
            except OSError as err:
                logger.info("no doorbell in this process (%s): versions come by Ray call", err)
                return None
        return _DOORBELL

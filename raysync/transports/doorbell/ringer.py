"""A relay's end of the doorbells: one connection per subscriber process; rings out, acks back.

The relay (or the hub, on its own node) connects to each subscriber process's doorbell
once and keeps the connection: rings go out on it, each with its sealed segment, and
the acks come back on it. It listens on nothing, so there is nothing of the relay's
for another process to flood.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import itertools
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from raysync._protocol import AppliedRow, RelayAck, RelayReply, Ring, expand
from raysync.transports.doorbell import wire
from raysync.transports.doorbell.segments import SegmentHandle
from raysync.transports.doorbell.sockets import Drops, Message, connect, receive, runtime_dir, sweep, unlink

__all__ = ["CONNECTIONS_QUEUED_FULL", "Ringer"]

logger = logging.getLogger(__name__)

_STALE_S = 300.0  # a ring unanswered this long is forgotten
_BATCH = 256  # acks read per callback: the event loop gets its turn
_GONE = (errno.ECONNREFUSED, errno.ENOENT, errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)
CONNECTIONS_QUEUED_FULL = "new connections queued full"
"""Why :meth:`Ringer.ring` found a doorbell busy when it could not connect: its process is slow
to accept, or others flood it with connections (a ring on a connection already made is not held
back by that)."""


class Ringer:
    """Rings subscriber processes and collects their acks.

    Make it on the event loop that reads the acks (or call :meth:`wait` there first);
    :meth:`ring` may be called from a worker thread.

    Example:
        >>> ringer = Ringer()
        >>> tokens = ringer.ring(address, key, "policy", 3, segment, ("a1:policy",))
        >>> acks, missing = await ringer.wait(tokens, timeout=0.2)
    """

    def __init__(self) -> None:
        self._tokens = itertools.count(secrets.randbits(32) << 16)
        self._open: dict[int, _Rung] = {}
        self._conns: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self.late: Callable[[str, int, list[RelayAck]], None] | None = None
        self.drops = Drops("relay doorbell")
        sweep()  # the sockets of the node's subscriber processes that were killed (no exit handler ran)

    def ring(
        self,
        address: str,
        key: bytes,
        model_id: str,
        version: int,
        segment: SegmentHandle,
        sub_ids: Sequence[str],
    ) -> list[int]:
        """Ring one process for ``sub_ids``; the tokens to :meth:`wait` on (one per message).

        Raises:
            OSError: the process is gone (``ECONNREFUSED``, ``ENOENT``, ``EPIPE``: stop
                ringing it), or busy (``BlockingIOError``: its queue of rings is full, or of
                new connections, :data:`CONNECTIONS_QUEUED_FULL`; call it the Ray way this time).
            ValueError: a ring the wire format cannot carry: call it the Ray way.
        """
        if len(key) != wire.KEY_BYTES:
            raise ValueError("a doorbell key of the wrong length")
        self._drop_stale()
        tokens: list[int] = []
        conn = self._connection(address)
        try:
            for chunk in _chunks(model_id, sub_ids):
                token = next(self._tokens)
                ring = Ring(token, model_id, version, chunk, segment.size, segment.inode, segment.device)
                data = wire.encode_ring(key, ring)
                self._open[token] = _Rung(model_id, version, set(chunk), key, address)
                tokens.append(token)
                fds = array.array("i", [segment.fd])
                conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except (OSError, ValueError) as err:
            self.forget(tokens)
            if isinstance(err, OSError) and err.errno in _GONE:
                self._disconnect(address, conn)
            raise
        return tokens

    def _connection(self, address: str) -> socket.socket:
        with self._lock:
            conn = self._conns.get(address)
        if conn is not None:
            return conn
        try:
            conn = connect(address)
        except BlockingIOError as err:  # its queue of connections not yet accepted is full
            raise BlockingIOError(err.errno, CONNECTIONS_QUEUED_FULL) from err
        except OSError as err:
            if err.errno == errno.ECONNREFUSED:
                _remove_dead_socket(address)
            raise
        with self._lock:
            self._conns[address] = conn
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._watch, address, conn)
        return conn

    def _watch(self, address: str, conn: socket.socket) -> None:
        if self._conns.get(address) is conn and conn.fileno() >= 0:
            assert self._loop is not None
            self._loop.add_reader(conn.fileno(), self._readable, address, conn)

    def _disconnect(self, address: str, conn: socket.socket) -> None:
        with self._lock:
            if self._conns.get(address) is conn:
                del self._conns[address]
        if self._loop is not None and conn.fileno() >= 0:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(conn.fileno())
        conn.close()

    def _drop_stale(self) -> None:
        """Forget rings whose process never answered (it died): the Ray call settled them."""
        cutoff = time.monotonic() - _STALE_S
        for token, rung in list(self._open.items()):
            if rung.late and rung.since < cutoff:
                self._open.pop(token, None)

    async def wait(self, tokens: Sequence[int], timeout: float | None) -> tuple[list[RelayAck], list[str]]:
        """The acks of ``tokens`` that came within ``timeout``, and the subscriptions still applying.

        Acks that come later go to :attr:`late` ``(model_id, version, acks)``.
        """
        replies, missing = await self._collect(tokens, timeout)
        return [ack for version, reply in replies for ack in expand(reply, version)], missing

    async def wait_compact(
        self, tokens: Sequence[int], timeout: float | None
    ) -> tuple[RelayReply, list[str]]:
        """:meth:`wait` for the rings of one version, the plain applies kept as compact rows
        (:func:`~raysync._protocol.compact`): what a relay's reply carries, no record per subscription."""
        replies, missing = await self._collect(tokens, timeout)
        acks = tuple(a for _, reply in replies for a in reply.acks)
        return RelayReply(acks, tuple(row for _, reply in replies for row in reply.applied)), missing

    async def _collect(
        self, tokens: Sequence[int], timeout: float | None
    ) -> tuple[list[tuple[int, RelayReply]], list[str]]:
        """Each ring's version and what came back for it within ``timeout``; who is still applying."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            with self._lock:
                conns = list(self._conns.items())
            for address, conn in conns:
                self._watch(address, conn)
        rungs = [self._open[t] for t in tokens if t in self._open]
        waits = [r.done for r in rungs if not r.done.is_set()]
        if waits:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(w.wait() for w in waits)), timeout)
        replies: list[tuple[int, RelayReply]] = []
        missing: list[str] = []
        for token, rung in zip(tokens, rungs, strict=False):
            replies.append((rung.version, RelayReply(tuple(rung.acks), tuple(rung.rows))))
            rung.acks, rung.rows = [], []
            if rung.done.is_set():
                self._open.pop(token, None)
            else:
                rung.late = True
                missing.extend(sorted(rung.expected))
        return replies, missing

    def forget(self, tokens: Sequence[int]) -> None:
        """Stop waiting for ``tokens`` (their subscriptions are handed over another way)."""
        for token in tokens:
            self._open.pop(token, None)

    def _readable(self, address: str, conn: socket.socket) -> None:
        for _ in range(_BATCH):
            try:
                msg = receive(conn)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                logger.debug("relay doorbell %s: %s", address, err)
                msg = None
            if msg is None:  # the subscriber process is gone: its rings time out, the Ray call tells
                self._disconnect(address, conn)
                return
            msg.close_fds()  # acks carry none
            self._ack(address, msg)

    def _ack(self, address: str, msg: Message) -> None:
        """Count an ack of an open ring of this connection, MAC'd by the process rung."""
        if msg.truncated:
            self.drops.drop("malformed")
            return
        try:
            token = wire.ack_token(msg.data)
            rung = self._open.get(token)
            if rung is None or rung.address != address:
                self.drops.drop("unknown token")
                return
            _, version, reply = wire.decode_ack(rung.key, msg.data)
        except wire.WireError:
            self.drops.drop("malformed or bad MAC")
            return
        if version != rung.version:
            self.drops.drop("wrong version")
            return
        expected = rung.expected
        acks = [a for a in reply.acks if a.sub_id in expected]  # kept compact: one row per plain apply
        rows = [row for row in reply.applied if row[0] in expected]
        expected.difference_update([a.sub_id for a in acks])
        expected.difference_update([row[0] for row in rows])
        if rung.late:
            if self.late is not None and (acks or rows):
                self.late(rung.model_id, rung.version, acks + expand(RelayReply((), tuple(rows)), version))
        else:
            rung.acks.extend(acks)
            rung.rows.extend(rows)
        if not rung.expected:
            rung.done.set()
            if rung.late:
                self._open.pop(token, None)

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.items())
        for address, conn in conns:
            self._disconnect(address, conn)


def _chunks(model_id: str, sub_ids: Sequence[str]) -> list[tuple[str, ...]]:
    """``sub_ids`` split so that each ring stays well below the wire's message limit."""
    budget = wire.MAX_MESSAGE // 2 - len(model_id.encode()) - 512
    chunks: list[tuple[str, ...]] = []
    chunk: list[str] = []
    used = 0
    for sub_id in sub_ids:
        n = len(sub_id.encode()) + 2
        if chunk and used + n > budget:
            chunks.append(tuple(chunk))
            chunk, used = [], 0
        chunk.append(sub_id)
        used += n
    if chunk:
        chunks.append(tuple(chunk))
    return chunks


def _remove_dead_socket(address: str) -> None:
    """A socket no process listens on any more (its process died): remove it from our directory."""
    base = runtime_dir()
    if base is not None and address.rsplit("/", 1)[0] == base:
        unlink(address)


@dataclass
class _Rung:
    model_id: str
    version: int
    expected: set[str]
    key: bytes
    address: str
    acks: list[RelayAck] = field(default_factory=list)
    rows: list[AppliedRow] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    late: bool = False
    since: float = field(default_factory=time.monotonic)

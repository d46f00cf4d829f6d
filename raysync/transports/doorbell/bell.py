"""A subscriber process's doorbell: one listening socket and one thread for every subscription in it.

Relays (and the hub) connect once and ring on their connection. A new connection is
on probation until its first message: a ring MAC'd with this doorbell's key makes it
trusted for good; anything else closes it. Trusted connections are read first, every
round, so whatever else reaches the socket (connections that send junk, that send
nothing, that never stop coming) cannot delay a ring: new connections are accepted at
a bounded rate (:data:`ACCEPT_PER_S`), at most :data:`PROBATION` wait at a time, each
for at most :data:`PROBATION_S`.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

from raysync._protocol import ApplyReport, RelayAck, Ring, compact
from raysync.transports.doorbell import wire
from raysync.transports.doorbell.segments import Segment, read_segment
from raysync.transports.doorbell.sockets import (
    Drops,
    Message,
    available,
    listen,
    peer_uid,
    receive,
    sweep,
    unlink,
)

__all__ = ["ACCEPT_PER_S", "PROBATION", "PROBATION_S", "Doorbell", "Handler", "doorbell"]

logger = logging.getLogger(__name__)

_BATCH = 64  # messages read per trusted connection per round
ACCEPT_PER_S = 20.0
"""New connections accepted per second at most (a ringer connects once per process it rings)."""
PROBATION = 16
"""Connections that have not yet sent a ring, at most (others wait in the kernel's queue)."""
PROBATION_S = 2.0
"""How long a new connection may stay silent before it is closed."""


Handler = Callable[[Ring, "Segment | None"], ApplyReport]
"""What a subscription does when rung: apply the segment's version (``None``: a newer one is on its way)."""


class Doorbell:
    """A process's doorbell: one socket and one daemon thread for every subscription in it.

    Handlers run on the doorbell's thread, one ring at a time; each takes its
    actor's write lock itself. :attr:`key` is the secret rings must be MAC'd with;
    it leaves the process only in the subscriptions' registrations (Ray calls).
    """

    def __init__(self) -> None:
        self._listener, self.address = listen("sub")
        self.key = secrets.token_bytes(wire.KEY_BYTES)
        self._handlers: dict[str, Handler] = {}
        self._lock = threading.Lock()
        self.rings = 0
        self.drops = Drops("doorbell")
        self._trusted: set[socket.socket] = set()
        self._probation: dict[socket.socket, float] = {}  # connection -> when it is closed unheard
        self._tokens = ACCEPT_PER_S  # accept budget (a token bucket of one second's worth)
        self._refilled = time.monotonic()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._listening = True
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        atexit.register(unlink, self.address)
        self._thread = threading.Thread(target=self._loop, name="raysync-doorbell", daemon=True)
        self._thread.start()
        sweep()  # the sockets that killed processes (no exit handler ran) left behind

    def register(self, sub_id: str, handler: Handler) -> str:
        """Route rings for ``sub_id`` to ``handler``; this doorbell's address (for the hub)."""
        with self._lock:
            self._handlers[sub_id] = handler
        return self.address

    def unregister(self, sub_id: str) -> None:
        with self._lock:
            self._handlers.pop(sub_id, None)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        try:
            while not self._closed:
                ready = {key.fileobj for key, _ in self._selector.select(self._next_timeout())}
                if self._closed:
                    return
                rings: list[tuple[Ring, int, socket.socket]] = []
                for conn in [c for c in self._trusted if c in ready]:  # rings first, always
                    rings += self._read_trusted(conn)
                for conn in [c for c in self._probation if c in ready]:
                    rings += self._read_probation(conn)
                try:
                    self._serve(rings)
                except Exception:  # never let the thread die
                    logger.exception("doorbell: could not serve a ring")
                finally:
                    for _, fd, _ in rings:
                        with contextlib.suppress(OSError):
                            os.close(fd)
                if self._listener in ready:
                    self._accept()
                self._expire()
        except Exception:
            if not self._closed:
                logger.exception("doorbell: stopped; versions come by Ray call from now on")

    def _next_timeout(self) -> float | None:
        now = time.monotonic()
        waits = [deadline - now for deadline in self._probation.values()]
        if not self._listening:
            waits.append(1.0 / ACCEPT_PER_S)
        return max(0.0, min(waits)) if waits else None

    def _read_trusted(self, conn: socket.socket) -> list[tuple[Ring, int, socket.socket]]:
        rings = []
        for _ in range(_BATCH):
            try:
                msg = receive(conn)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                msg = None
            if msg is None:  # the ringer went away (a relay restarts): it connects again
                self._close(conn)
                break
            checked = self._check(msg)
            if checked is None:  # a trusted peer never sends what does not check: end it
                self._close(conn)
                break
            rings.append((*checked, conn))
        return rings

    def _read_probation(self, conn: socket.socket) -> list[tuple[Ring, int, socket.socket]]:
        try:
            msg = receive(conn)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            msg = None
        checked = None if msg is None else self._check(msg)
        if checked is None:
            self._close(conn)
            return []
        del self._probation[conn]
        self._trusted.add(conn)  # its first message was a ring made with our key: a ringer's
        return [(*checked, conn), *self._read_trusted(conn)]

    def _may_accept(self, now: float) -> bool:
        """Top the accept budget up to ``now``: whether a new connection may be accepted."""
        self._tokens = min(ACCEPT_PER_S, self._tokens + (now - self._refilled) * ACCEPT_PER_S)
        self._refilled = now
        return self._tokens >= 1 and len(self._probation) < PROBATION

    def _accept(self) -> None:
        now = time.monotonic()
        while self._may_accept(now):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as err:  # out of descriptors, ...: try again later
                logger.debug("doorbell: accept: %s", err)
                break
            self._tokens -= 1
            conn.setblocking(False)
            if peer_uid(conn) != os.getuid():  # the directory keeps others out; the kernel's word too
                self.drops.drop("from another user")
                conn.close()
                continue
            self._probation[conn] = now + PROBATION_S
            self._selector.register(conn, selectors.EVENT_READ)
        if self._listening and not self._may_accept(now):  # leave the rest in the kernel's queue for now
            self._selector.unregister(self._listener)
            self._listening = False

    def _expire(self) -> None:
        now = time.monotonic()
        for conn, deadline in list(self._probation.items()):
            if deadline <= now:
                self.drops.drop("silent connection")
                self._close(conn)
        if not self._listening and self._may_accept(now):
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._listening = True

    def _close(self, conn: socket.socket) -> None:
        self._probation.pop(conn, None)
        self._trusted.discard(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    def _check(self, msg: Message) -> tuple[Ring, int] | None:
        """A message's ring and segment descriptor, if it is a ring MAC'd with this doorbell's key."""
        ring = None
        reason = "malformed"
        if not msg.truncated and len(msg.fds) == 1:
            try:
                ring = wire.decode_ring(self.key, msg.data)
            except wire.WireError:
                reason = "malformed or bad MAC"
        if ring is None:
            msg.close_fds()
            self.drops.drop(reason)
            return None
        return ring, msg.fds[0]

    def _serve(self, rings: list[tuple[Ring, int, socket.socket]]) -> None:
        segments: list[tuple[Ring, Segment, socket.socket]] = []
        for ring, fd, conn in rings:
            try:
                segments.append((ring, read_segment(fd, ring), conn))
            except (ValueError, OSError):  # MAC'd, yet not with the segment it names: a replay
                self.drops.drop("segment not the one rung")
        newest: dict[str, int] = {}
        for ring, _, _ in segments:
            for sub_id in ring.sub_ids:
                newest[sub_id] = max(newest.get(sub_id, 0), ring.version)
        segments.sort(key=lambda r: -r[0].version)  # the newest first: the others' acks say it
        while segments:
            ring, segment, conn = segments.pop(0)
            self.rings += 1
            t0 = time.perf_counter()
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
                    report = ApplyReport(
                        failed=ring.version, error=RuntimeError(f"{type(err).__name__}: {err}")
                    )
                acks.append(RelayAck(sub_id, report))
            del segment
            self._answer(ring, conn, acks)
            logger.debug(
                "doorbell: %r version %d for %d in %.4f s",
                ring.model_id,
                ring.version,
                len(ring.sub_ids),
                time.perf_counter() - t0,
            )

    def _answer(self, ring: Ring, conn: socket.socket, acks: list[RelayAck]) -> None:
        """Send the acks of a ring on its connection, in as many messages as their size takes."""
        parts = [acks]
        while parts:
            part = parts.pop()
            try:
                data = wire.encode_ack(self.key, ring.token, ring.version, compact(ring.version, part))
            except wire.WireError:
                if len(part) > 1:
                    parts += [part[len(part) // 2 :], part[: len(part) // 2]]
                else:
                    logger.warning("doorbell: the ack of %s does not fit a message", part[0].sub_id)
                continue
            try:
                conn.send(data)
            except OSError as err:
                if err.errno not in (errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENOTCONN):
                    logger.warning("doorbell: could not answer the relay: %s", err)
                return  # a relay that died (or is stuck): the hub hands the newest version again

    def close(self) -> None:
        """Stop serving (tests): the socket closes, the thread ends."""
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(10)
        for conn in [*self._trusted, *self._probation]:
            conn.close()
        self._listener.close()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        unlink(self.address)


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

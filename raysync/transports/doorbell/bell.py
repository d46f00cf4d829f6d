"""A subscriber process's doorbell: one socket and one thread for every subscription in it."""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from raysync._protocol import ApplyReport, RelayAck, Ring, compact
from raysync.transports.doorbell import wire
from raysync.transports.doorbell.segments import Segment, read_segment
from raysync.transports.doorbell.sockets import Datagram, Drops, available, bind, receive, unlink

__all__ = ["Doorbell", "Handler", "doorbell"]

logger = logging.getLogger(__name__)

_BATCH = 64  # datagrams read per round: a flood cannot keep a round from ending


Handler = Callable[[Ring, "Segment | None"], ApplyReport]
"""What a subscription does when rung: apply the segment's version (``None``: a newer one is on its way)."""


class Doorbell:
    """A process's doorbell: one socket and one daemon thread for every subscription in it.

    Handlers run on the doorbell's thread, one ring at a time; each takes its
    actor's write lock itself. :attr:`key` is the secret rings must be MAC'd with;
    it leaves the process only in the subscriptions' registrations (Ray calls).
    """

    def __init__(self) -> None:
        self._sock, self.address = bind("sub")
        self.key = secrets.token_bytes(wire.KEY_BYTES)
        self._handlers: dict[str, Handler] = {}
        self._lock = threading.Lock()
        self.rings = 0
        self.drops = Drops("doorbell")
        self._closed = False
        atexit.register(unlink, self.address)
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
                batch = [receive(self._sock)]
                # Rings that queued meanwhile (a bounded number): the newest version per subscription wins.
                while len(batch) < _BATCH:
                    try:
                        batch.append(receive(self._sock, socket.MSG_DONTWAIT))
                    except (BlockingIOError, InterruptedError):
                        break
            except OSError as err:  # closed
                logger.debug("doorbell: %s", err)
                return
            if self._closed:
                for dgram in batch:
                    dgram.close_fds()
                return
            rings = [r for r in (self._check(d) for d in batch) if r is not None]
            try:
                self._serve(rings)
            except Exception:  # never let the thread die
                logger.exception("doorbell: could not serve a ring")
            finally:
                for _, fd in rings:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _check(self, dgram: Datagram) -> tuple[Ring, int] | None:
        """A datagram's ring and segment descriptor, if it is a ring MAC'd with this doorbell's key."""
        reason = None
        ring = None
        if dgram.uid != os.getuid():
            reason = "from another user"
        elif dgram.truncated or len(dgram.fds) != 1:
            reason = "malformed"
        else:
            try:
                ring = wire.decode_ring(self.key, dgram.data)
            except wire.WireError:
                reason = "malformed or bad MAC"
        if ring is None:
            dgram.close_fds()
            self.drops.drop(reason or "malformed")
            return None
        return ring, dgram.fds[0]

    def _serve(self, rings: list[tuple[Ring, int]]) -> None:
        segments: list[tuple[Ring, Segment]] = []
        for ring, fd in rings:
            try:
                segments.append((ring, read_segment(fd, ring)))
            except (ValueError, OSError):  # MAC'd, yet not with the segment it names: a replay
                self.drops.drop("segment not the one rung")
        newest: dict[str, int] = {}
        for ring, _ in segments:
            for sub_id in ring.sub_ids:
                newest[sub_id] = max(newest.get(sub_id, 0), ring.version)
        segments.sort(key=lambda r: -r[0].version)  # the newest first: the others' acks say it
        while segments:
            ring, segment = segments.pop(0)
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
            self._answer(ring, acks)
            logger.debug(
                "doorbell: %r version %d for %d in %.4f s",
                ring.model_id,
                ring.version,
                len(ring.sub_ids),
                time.perf_counter() - t0,
            )

    def _answer(self, ring: Ring, acks: list[RelayAck]) -> None:
        """Send the acks of a ring, in as many datagrams as their size takes (the relay adds them up)."""
        parts = [acks]
        while parts:
            part = parts.pop()
            try:
                data = wire.encode_ack(self.key, ring.token, ring.version, compact(ring.version, part))
            except wire.WireError:
                if len(part) > 1:
                    parts += [part[len(part) // 2 :], part[: len(part) // 2]]
                else:
                    logger.warning("doorbell: the ack of %s does not fit a datagram", part[0].sub_id)
                continue
            try:
                self._sock.sendto(data, ring.reply_to)
            except OSError as err:
                if err.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                    logger.warning("doorbell: could not answer the relay: %s", err)
                return  # a relay that died meanwhile: the hub hands the newest version again

    def close(self) -> None:
        """Stop serving (tests): the socket closes, the thread ends."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
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

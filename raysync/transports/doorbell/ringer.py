"""A relay's end of the doorbells: rings subscriber processes, collects their acks."""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import itertools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from raysync._protocol import RelayAck, Ring, expand
from raysync.transports.doorbell import wire
from raysync.transports.doorbell.segments import SegmentHandle
from raysync.transports.doorbell.sockets import Datagram, Drops, bind, receive, runtime_dir, unlink

__all__ = ["Ringer"]

logger = logging.getLogger(__name__)

_STALE_S = 300.0  # a ring unanswered this long is forgotten
_BATCH = 256  # datagrams read per callback: a flood cannot hold the event loop


class Ringer:
    """A relay's end of the doorbells: rings subscriber processes, collects their acks.

    Example:
        >>> ringer = Ringer()
        >>> tokens = ringer.ring(address, key, "policy", 3, segment, ("a1:policy",))
        >>> acks, missing = await ringer.wait(tokens, timeout=0.2)
    """

    def __init__(self) -> None:
        self._sock, self.address = bind("relay")
        self._sock.setblocking(False)
        self._tokens = itertools.count(secrets.randbits(32) << 16)
        self._open: dict[int, _Rung] = {}
        self._reading: asyncio.AbstractEventLoop | None = None
        self.late: Callable[[str, int, list[RelayAck]], None] | None = None
        self.drops = Drops("relay doorbell")

    def ring(
        self,
        address: str,
        key: bytes,
        model_id: str,
        version: int,
        segment: SegmentHandle,
        sub_ids: Sequence[str],
    ) -> list[int]:
        """Ring one process for ``sub_ids``; the tokens to :meth:`wait` on (one per datagram).

        Callable from a worker thread (what it rings is registered before it is sent).

        Raises:
            OSError: the process is gone or cannot be reached (``ECONNREFUSED``,
                ``ENOENT``), or its queue is full (``EAGAIN``): call it the Ray way.
            ValueError: a ring the wire format cannot carry: call it the Ray way.
        """
        if len(key) != wire.KEY_BYTES:
            raise ValueError("a doorbell key of the wrong length")
        self._drop_stale()
        tokens: list[int] = []
        try:
            for chunk in _chunks(model_id, sub_ids):
                token = next(self._tokens)
                ring = Ring(
                    token, model_id, version, chunk, self.address, segment.size, segment.inode, segment.device
                )
                data = wire.encode_ring(key, ring)
                self._open[token] = _Rung(model_id, version, set(chunk), key)
                tokens.append(token)
                self._sock.sendmsg(
                    [data],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [segment.fd]))],
                    0,
                    address,
                )
        except (OSError, ValueError) as err:
            self.forget(tokens)
            if isinstance(err, OSError) and err.errno == errno.ECONNREFUSED:
                _remove_dead_socket(address)
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
        for _ in range(_BATCH):  # then let the loop run; it calls again while more wait
            try:
                dgram = receive(self._sock)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                logger.debug("relay doorbell: %s", err)
                return
            dgram.close_fds()  # acks carry none
            token, acks = self._check(dgram)
            if token is None:
                continue
            rung = self._open[token]
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
                    self._open.pop(token, None)

    def _check(self, dgram: Datagram) -> tuple[int | None, list[RelayAck]]:
        """A datagram's token and acks, if it is an ack of an open ring MAC'd by the process rung."""
        if dgram.uid != os.getuid():
            self.drops.drop("from another user")
        elif dgram.truncated or dgram.fds:
            self.drops.drop("malformed")
        else:
            try:
                token = wire.ack_token(dgram.data)
                rung = self._open.get(token)
                if rung is None:
                    self.drops.drop("unknown token")
                    return None, []
                _, version, reply = wire.decode_ack(rung.key, dgram.data)
            except wire.WireError:
                self.drops.drop("malformed or bad MAC")
                return None, []
            if version != rung.version:
                self.drops.drop("wrong version")
                return None, []
            acks = [a for a in expand(reply, version) if a.sub_id in rung.expected]
            return token, acks
        return None, []

    def close(self) -> None:
        if self._reading is not None:
            with contextlib.suppress(Exception):
                self._reading.remove_reader(self._sock.fileno())
        self._sock.close()
        unlink(self.address)


def _chunks(model_id: str, sub_ids: Sequence[str]) -> list[tuple[str, ...]]:
    """``sub_ids`` split so that each ring stays well below the wire's datagram limit."""
    budget = wire.MAX_DATAGRAM // 2 - len(model_id.encode()) - 512
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
    if base is not None and os.path.dirname(address) == base:
        unlink(address)


@dataclass
class _Rung:
    model_id: str
    version: int
    expected: set[str]
    key: bytes
    acks: list[RelayAck] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    late: bool = False
    since: float = field(default_factory=time.monotonic)

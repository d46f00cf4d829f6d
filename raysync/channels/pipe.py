"""Pipes for signals, shared memory for bytes: the multiprocess data path of :mod:`raysync.schemes`.

Lifecycle of one version (which side runs what):

- **sender** (:class:`SnapshotPool`, owned by a ``WeightSender`` and shared by
  all its transports): copy the weights once into a set of flat uint8 buckets
  in shared memory laid out by :func:`raysync.core.layout.plan_layout` (the trainer
  may change its model right after). A set that any worker may still read is
  never written: a new one is allocated instead.
- **sender** (:class:`MPTransport`, one per worker): send a small message over
  the worker's pipe: model id, manifest, which snapshot set, and the set's
  shared-memory handles the first time that worker sees it. Then wait for the
  worker's ack (with a timeout).
- **worker** (:meth:`MPTransport.receive_weights`): copy the whole version out
  of the snapshot into private memory, return ``(model_id, tensors)``; the
  ``WeightReceiver`` validates and applies it and calls :meth:`send_ack`.

Messages on the pipe that are not raysync's (a collector's own commands) are
never dropped: both sides queue them; read them with :meth:`MPTransport.next_message`.

Example:
    >>> parent, child = multiprocessing.Pipe()
    >>> MPTransport(parent).send_weights("policy", model)  # doctest: +SKIP
    >>> # in the worker:
    >>> model_id, tensors = MPTransport(child).receive_weights(timeout=5)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from raysync._checks import check_timeout
from raysync.channels.base import DEFAULT_TIMEOUT, ack_error, split_send_args
from raysync.core import codec
from raysync.core.extract import extract_tensors
from raysync.core.layout import Manifest, plan_layout
from raysync.errors import RaySyncError, SyncTimeoutError

__all__ = ["MPTransport", "Snapshot", "SnapshotPool"]

logger = logging.getLogger(__name__)

WEIGHTS_TAG = "raysync.weights"
ACK_TAG = "raysync.ack"


@dataclass
class Snapshot:
    """One version written into a shared-memory buffer set (sender side).

    Attributes:
        manifest: the layout of the buckets.
        set_id: which buffer set of the pool holds it.
        buffers: one flat, shared uint8 tensor per bucket.
        pool: the pool it came from (it tracks which workers still read which set).
    """

    manifest: Manifest
    set_id: str
    buffers: list[torch.Tensor]
    pool: SnapshotPool


class SnapshotPool:
    """Sender side: shared-memory buffer sets for one model, reused when no worker reads them.

    Example:
        >>> pool = SnapshotPool()
        >>> snap = pool.write(extract_tensors(model))  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._sets: dict[str, list[torch.Tensor]] = {}
        self._layout: str | None = None
        self._in_use: dict[int, set[str]] = {}
        self._lock = threading.Lock()

    def write(self, tensors: dict[str, torch.Tensor], manifest: Manifest | None = None) -> Snapshot:
        """Copy ``tensors`` (flat, sorted) into a free buffer set: the one copy a version costs."""
        manifest = manifest or plan_layout(tensors)
        with self._lock:
            if manifest.layout_hash != self._layout:
                self._sets = {}  # workers drop the old sets when told the live ones
                self._layout = manifest.layout_hash
            busy = set().union(*self._in_use.values()) if self._in_use else set()
            free = [s for s in self._sets if s not in busy]
            if free:
                set_id = free[0]
            else:
                set_id = uuid.uuid4().hex[:12]
                self._sets[set_id] = codec.allocate(manifest, shared=True)
            buffers = self._sets[set_id]
        codec.write(tensors, manifest, buffers)
        return Snapshot(manifest, set_id, buffers, self)

    def live_sets(self) -> list[str]:
        """The ids of the sets of the current layout."""
        with self._lock:
            return list(self._sets)

    def mark_sent(self, reader: int, set_id: str) -> None:
        """A worker may read ``set_id`` from now on (until it acks)."""
        with self._lock:
            self._in_use.setdefault(reader, set()).add(set_id)

    def mark_acked(self, reader: int, set_id: str, *, keeps: bool) -> None:
        """A worker acked ``set_id``; ``keeps``: its model now points into that set."""
        with self._lock:
            self._in_use[reader] = {set_id} if keeps else set()

    def forget(self, reader: int) -> None:
        """A worker is gone: its sets may be reused."""
        with self._lock:
            self._in_use.pop(reader, None)


_reader_ids = itertools.count()


class MPTransport:
    """One worker's pipe: signals (manifest, acks) on the pipe, bytes in shared memory.

    Args:
        pipe_connection: this side's end of a ``multiprocessing.Pipe``.
        timeout: default seconds :meth:`wait_ack` waits before raising
            :class:`raysync.SyncTimeoutError`.

    Which side runs what: ``send_weights``, ``send_weights_async``,
    ``wait_ack`` on the sender; ``receive_weights``, ``send_ack`` on the
    worker; ``next_message`` and ``check_connection`` on either.

    Messages that are not raysync's are queued, never dropped: read them with
    :meth:`next_message`.

    Example:
        >>> parent, child = multiprocessing.Pipe()
        >>> sender = MPTransport(parent, timeout=30)
        >>> sender.send_weights_async("policy", model)  # doctest: +SKIP
        >>> sender.wait_ack()  # doctest: +SKIP
    """

    keeps_snapshot = False  # the worker copies out; SharedMemTransport's workers keep pointing in

    def __init__(self, pipe_connection: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
        check_timeout(timeout, allow_none=False, positive=True)
        self.pipe = pipe_connection
        self.timeout = float(timeout)
        self._reader = next(_reader_ids)
        self._own_pool: SnapshotPool | None = None
        self._sent_sets: set[str] = set()
        self._seq = 0
        self._pending: tuple[int, Snapshot] | None = None
        self._messages: collections.deque[Any] = collections.deque()
        self._weights: collections.deque[Any] = collections.deque()
        self._acks: collections.deque[Any] = collections.deque()
        # worker side
        self._sets: dict[str, list[torch.Tensor]] = {}
        self._last_seq: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"{type(self).__name__} holds a live pipe and cannot be pickled: pickle the scheme "
            "(it drops its transports) and create the transport where the pipe end lives"
        )

    # ------------------------------------------------------------------ sender
    @property
    def reader(self) -> int:
        """This worker's id in its snapshot pool (what the pool tracks reads by)."""
        return self._reader

    def send_weights(self, *args: Any) -> None:
        """Send ``weights`` or ``(model_id, weights)`` and wait for the worker's ack."""
        self.send_weights_async(*args)
        self.wait_ack()

    def send_weights_async(self, *args: Any) -> None:
        """Start sending: snapshot into shared memory (unless given a :class:`Snapshot`); signal."""
        model_id, weights = split_send_args(args)
        if isinstance(weights, Snapshot):
            snap = weights
        else:
            if self._own_pool is None:
                self._own_pool = SnapshotPool()
            snap = self._own_pool.write(extract_tensors(weights))
        self._seq += 1
        first = snap.set_id not in self._sent_sets
        snap.pool.mark_sent(self._reader, snap.set_id)
        message = (
            WEIGHTS_TAG,
            self._seq,
            model_id,
            snap.manifest,
            snap.set_id,
            snap.buffers if first else None,
            snap.pool.live_sets(),
        )
        try:
            self.pipe.send(message)
        except (BrokenPipeError, EOFError, OSError) as err:
            raise RaySyncError(f"worker pipe is closed ({err}); the worker process has exited") from err
        self._sent_sets.add(snap.set_id)
        self._sent_sets &= set(snap.pool.live_sets())
        self._pending = (self._seq, snap)

    def wait_ack(self, timeout: float | None = None) -> None:
        """Wait for the ack of the last send.

        Raises:
            SyncTimeoutError: no ack within ``timeout`` (default ``self.timeout``).
            ApplyError: the worker refused or failed to apply the version.
            RaySyncError: the worker's end of the pipe closed.
        """
        if self._pending is None:
            raise RuntimeError("no send to wait for: call send_weights_async() first")
        seq, snap = self._pending
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            while self._acks:
                _, acked, text = self._acks.popleft()
                if acked != seq:
                    continue  # the late ack of a send that timed out
                self._pending = None
                snap.pool.mark_acked(
                    self._reader, snap.set_id, keeps=self.keeps_snapshot and not str(text).startswith("error")
                )
                ack_error(str(text), worker=f"worker on pipe {self._reader}")
                return
            try:
                got = self._pull(deadline)
            except RaySyncError:
                self._pending = None
                snap.pool.forget(self._reader)
                raise
            if not got:
                # The set stays marked as read by this worker, so it is never overwritten under it.
                raise SyncTimeoutError(
                    f"worker on pipe {self._reader} did not acknowledge weights #{seq} within {limit} s",
                    laggards=[{"subscriber": f"pipe-{self._reader}", "applied": None, "error": None}],
                )

    def check_connection(self) -> bool:
        """Whether the pipe is still open on this side."""
        return not getattr(self.pipe, "closed", False)

    # ------------------------------------------------------------------ reading
    def _pull(self, deadline: float | None) -> bool:
        """Read one message into its queue; False if none came before ``deadline``."""
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            if not self.pipe.poll(remaining):
                return False
            message = self.pipe.recv()
        except (EOFError, OSError) as err:
            if self._messages or self._weights or self._acks:
                return False  # let the caller read what came before the close first
            raise RaySyncError(f"the other end of the pipe closed (its process exited?): {err!r}") from err
        if isinstance(message, tuple) and len(message) == 7 and message[0] == WEIGHTS_TAG:
            self._weights.append(message)
        elif isinstance(message, tuple) and len(message) == 3 and message[0] == ACK_TAG:
            self._acks.append(message)
        else:
            self._messages.append(message)
        return True

    # ------------------------------------------------------------------ worker
    def _next_weights(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        queued = len(self._messages)
        while not self._weights:
            if len(self._messages) > queued or not self._pull(deadline):
                return None  # a control message came first: the worker loop sees it now
        return self._weights.popleft()

    def _take(self, message: Any) -> tuple[str, Manifest, list[torch.Tensor]]:
        _, seq, model_id, manifest, set_id, buffers, live = message
        self._last_seq = seq
        if buffers is not None:
            self._sets[set_id] = buffers
        for stale in [s for s in self._sets if s not in live]:
            del self._sets[stale]
        if set_id not in self._sets:
            raise RaySyncError(f"weights arrived in shared-memory set {set_id!r} this worker was never given")
        return model_id, manifest, self._sets[set_id]

    def receive_weights(self, timeout: float | None = 1.0) -> tuple[str, dict[str, torch.Tensor]] | None:
        """Worker: a whole version in private memory, or ``None`` after ``timeout`` seconds.

        Other messages are never dropped: they are queued for :meth:`next_message`, and
        one arriving before any weights makes this return ``None`` at once, so the
        worker loop can act on it.
        """
        message = self._next_weights(timeout)
        if message is None:
            return None
        model_id, manifest, shared = self._take(message)
        private = [buf.clone() for buf in shared]
        return model_id, codec.views(manifest, private)

    def receive_snapshot(
        self, timeout: float | None = 1.0
    ) -> tuple[str, Manifest, list[torch.Tensor]] | None:
        """Worker: ``(model_id, manifest, shared buffers)`` of the next version, without copying."""
        message = self._next_weights(timeout)
        if message is None:
            return None
        return self._take(message)

    def send_ack(self, message: str = "updated") -> None:
        """Worker: acknowledge the last version (``"error: <text>"`` for a failed apply)."""
        self.pipe.send((ACK_TAG, self._last_seq, message))

    # ------------------------------------------------------------------ either side
    def next_message(self, timeout: float | None = 0.0) -> Any:
        """The next message on the pipe that is not raysync's (queued ones first), or ``None``.

        Weights and acks read meanwhile stay queued for their readers.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._messages:
            if not self._pull(deadline):
                return None
        return self._messages.popleft()

    def send_message(self, message: Any) -> None:
        """Send a message of your own on the same pipe (read with :meth:`next_message`)."""
        self.pipe.send(message)

    def pending_messages(self) -> list[Any]:
        """The queued messages that are not raysync's (not removed)."""
        return list(self._messages)

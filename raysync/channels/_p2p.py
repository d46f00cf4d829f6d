"""Shared plumbing of the torch.distributed transports (:mod:`.rpc`, :mod:`.distributed`).

Both move a version alike and differ only in how they signal (an RPC, or a TCPStore
mailbox). Lifecycle of one version, and which side runs what:

1. **sender** ``send_weights_async(model_id, weights)``: snapshots the weights
   into flat uint8 buckets laid out by :func:`raysync.core.layout.plan_layout`
   (the trainer may change its model as soon as this returns), signals the
   worker with the :class:`~raysync.core.layout.Manifest` and one tag per bucket,
   then posts one ``isend`` per bucket (signal first: the deadlock-free order
   torchrl documents).
2. **worker**: allocates the buckets from the manifest and receives them, always
   whole (even a version the worker will refuse, so the sender is never left
   blocked in a send); ``receive_weights(timeout)`` returns ``(model_id, {key:
   tensor})`` in canonical key order, backed by private memory.
3. **worker** ``send_ack("updated")`` or ``send_ack("error: <text>")``.
4. **sender** ``wait_ack(timeout)``: waits for the bytes to go and the ack to
   come; raises :class:`raysync.SyncTimeoutError` past the timeout and
   :class:`raysync.ApplyError` on an error ack. Never hangs. ``send_weights`` is
   ``send_weights_async`` + ``wait_ack``.

Bytes travel as one flat uint8 tensor per bucket, laid out exactly as
:func:`raysync.core.layout.plan_layout` says (so a receiver allocates each bucket
from the manifest and rebuilds tensors with :func:`raysync.core.codec.unpack`).
Every wait has a deadline (see :class:`Transfer`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raysync._checks import check_timeout
from raysync.channels.base import ack_error, split_send_args
from raysync.core import codec
from raysync.core.extract import extract_tensors
from raysync.core.layout import DEFAULT_BUCKET_BYTES, Manifest, plan_layout
from raysync.errors import RaySyncError, SyncTimeoutError

__all__ = [
    "P2PTransport",
    "Packed",
    "Pending",
    "Transfer",
    "check_group",
    "next_tags",
    "pack_version",
    "post_buckets",
    "receive_version",
    "wait_until",
]

logger = logging.getLogger(__name__)

_TAG_LOCK = threading.Lock()
# gloo matches a recv to a send by (peer, tag): every bucket this process sends gets a tag of
# its own, so versions (and models) in flight at once never take each other's bytes.
_TAGS = itertools.count(1)
_TAG_SPACE = 2**31 - 1


@dataclass(frozen=True)
class Packed:
    """One version ready to send: its manifest and one flat uint8 tensor per bucket."""

    model_id: str
    manifest: Manifest
    buckets: list[torch.Tensor]


class Transfer:
    """Gloo works in flight, finished by a helper thread; keeps their buffers alive until done.

    Gloo's point-to-point works only complete inside ``wait()`` (``is_completed``
    stays False until then), and a ``wait(timeout)`` that expires leaves the
    work unusable. So one daemon thread per transfer waits for its works, and
    callers wait on an event with their own deadline.
    """

    def __init__(self, works: Sequence[Any], buffers: Sequence[torch.Tensor]) -> None:
        self.works = list(works)
        self.buffers = list(buffers)
        self.error: BaseException | None = None
        self._event = threading.Event()
        if self.works:
            threading.Thread(target=self._run, name="raysync-p2p", daemon=True).start()
        else:
            self._event.set()

    def _run(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except BaseException as err:
            self.error = err
        finally:
            self._event.set()

    def wait(self, deadline: float | None, what: str) -> None:
        """Wait until done; raise the transfer's error, or :class:`SyncTimeoutError` past ``deadline``."""
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self._event.wait(remaining):
            raise SyncTimeoutError(f"timed out waiting for {what}")
        if self.error is not None:
            raise RaySyncError(f"{what} failed: {self.error}") from self.error


def pack_version(model_id: str, weights: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Packed:
    """Snapshot ``weights`` into flat bucket tensors (the one copy a send costs).

    The caller may change its model as soon as this returns.
    """
    if isinstance(weights, Packed):  # packed once already (a send to many workers)
        return weights
    tensors = extract_tensors(weights)
    manifest = plan_layout(tensors, bucket_bytes=bucket_bytes)
    flats = codec.allocate(manifest)
    codec.write(tensors, manifest, flats)
    return Packed(model_id, manifest, flats)


def next_tags(count: int) -> list[int]:
    """``count`` tags no other send of this process uses."""
    with _TAG_LOCK:
        return [next(_TAGS) % _TAG_SPACE or 1 for _ in range(count)]


def check_group() -> None:
    """Raise unless the process group is up and moves CPU tensors (gloo)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call init_process_group('gloo', ...) in every "
            "process before sending or receiving weights"
        )
    backend = str(dist.get_backend())
    if backend != "gloo":
        raise ValueError(
            f"the process group's backend is {backend!r}; these transports move CPU buckets and "
            "need a gloo group (init_process_group('gloo', ...))"
        )


def post_buckets(
    op: Callable[..., Any], flats: list[torch.Tensor], peer: int, tags: Sequence[int]
) -> Transfer:
    """Post ``op`` (``dist.isend`` or ``dist.irecv``) of every non-empty bucket with ``peer``, a tag
    each; returns at once."""
    check_group()
    works = [op(flat, peer, tag=tag) for flat, tag in zip(flats, tags, strict=True) if flat.numel()]
    return Transfer(works, flats)


def receive_version(
    manifest: Manifest, src: int, tags: Sequence[int], *, timeout: float, what: str = "version"
) -> list[torch.Tensor]:
    """Receive every bucket of a version from ``src`` into fresh buffers allocated from ``manifest``.

    Raises:
        SyncTimeoutError: the bytes did not all arrive within ``timeout``.
    """
    import torch.distributed as dist

    flats = codec.allocate(manifest)
    # On a timeout the receives stay posted; the transfer's thread keeps their buffers alive.
    post_buckets(dist.irecv, flats, src, tags).wait(
        time.monotonic() + timeout, f"the bytes of {what} from rank {src}"
    )
    return flats


def wait_until(predicate: Callable[[], bool], deadline: float | None) -> bool:
    """Poll ``predicate`` (1 ms growing to 20 ms) until true or past ``deadline``; no deadline: forever."""
    interval = 0.001
    while True:
        if predicate():
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        pause = interval if deadline is None else min(interval, max(deadline - time.monotonic(), 0.0))
        time.sleep(pause)
        interval = min(interval * 2, 0.02)


@dataclass
class Pending:
    """The newest send of a sender transport, until its ack arrives."""

    number: int  # the send's number (RPC: its sequence number; store: its mailbox message)
    model_id: str
    outgoing: Transfer
    future: Any = None  # RPC: the torch.futures.Future of the signal ("received" or the worker's error)


class P2PTransport:
    """What the torch.distributed transports share: configuration, pickling, the send, the wait for
    the ack and the worker's receive and ack; they differ in how they signal.

    Subclasses provide ``_init_runtime``, ``_check_peer``, ``_rank``, ``_signal``, ``_await_ack``,
    ``receive_snapshot`` and ``_post_ack``, and name in ``_config`` the attributes pickling keeps
    and in ``_handles`` the live handles it drops (``None`` after unpickling).
    """

    keeps_snapshot = True
    """Received buckets are private to each version: a receiver may adopt them without a copy."""
    _config: tuple[str, ...] = ("timeout", "channel", "bucket_bytes")
    _handles: tuple[str, ...] = ()
    timeout: float
    channel: str
    bucket_bytes: int
    _pending: Pending | None  # sender: the newest send until its ack
    _last: Any  # worker: what acknowledges the version receive_snapshot last returned (None: none)

    def _configure(self, timeout: float, channel: str, bucket_bytes: int) -> None:
        check_timeout(timeout, allow_none=False, positive=True)
        self.timeout = float(timeout)
        self.channel = channel
        self.bucket_bytes = bucket_bytes

    def _init_runtime(self) -> None:
        raise NotImplementedError

    # Pickling keeps the configuration and drops runtime state (connections, pending sends).
    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for handle in self._handles:
            setattr(self, handle, None)
        self._init_runtime()

    # ------------------------------------------------------------------ sender side

    def _check_peer(self) -> None:
        """Raise unless this transport knows the worker to send to."""
        raise NotImplementedError

    def _rank(self) -> int:
        """The worker's rank in the default process group."""
        raise NotImplementedError

    def _signal(self, message: dict[str, Any]) -> tuple[int, Any]:
        """Announce a version (``message``: model id, manifest, tags, source rank) to the worker;
        return its number and (RPC) the future of the signal."""
        raise NotImplementedError

    def _await_ack(self, pending: Pending, deadline: float, limit: float) -> tuple[str, str]:
        """Wait for ``pending``'s bytes to go and its ack to come; return the ack and who sent it."""
        raise NotImplementedError

    def send_weights_async(self, *args: Any) -> None:
        """Sender: snapshot and start sending a version; returns once the transfer is started.

        The caller may change its model as soon as this returns. Call :meth:`wait_ack`
        for the worker's ack.

        Example:
            >>> transport.send_weights_async(model); transport.wait_ack()  # doctest: +SKIP
        """
        import torch.distributed as dist

        model_id, weights = split_send_args(args)
        self._check_peer()
        packed = pack_version(model_id, weights, bucket_bytes=self.bucket_bytes)
        check_group()
        tags = next_tags(packed.manifest.num_buckets)
        message = {"model_id": model_id, "manifest": packed.manifest, "tags": tags, "src": dist.get_rank()}
        # 1. signal first (non-blocking): the worker starts receiving; 2. then post the sends.
        number, future = self._signal(message)
        outgoing = post_buckets(dist.isend, packed.buckets, self._rank(), tags)
        self._pending = Pending(number, model_id, outgoing, future)
        logger.debug(
            "sent %r #%d to rank %d (%d bytes)", model_id, number, self._rank(), packed.manifest.total_nbytes
        )

    def wait_ack(self, timeout: float | None = None) -> None:
        """Sender: wait for the worker's ack of the newest send.

        Args:
            timeout: seconds; defaults to the transport's ``timeout``.

        Raises:
            SyncTimeoutError: the bytes or the ack did not come in time.
            ApplyError: the worker could not receive the version or acked an error.

        Example:
            >>> transport.wait_ack(timeout=5)  # doctest: +SKIP
        """
        pending = self._pending
        if pending is None:
            return
        limit = self.timeout if timeout is None else timeout
        message, worker = self._await_ack(pending, time.monotonic() + limit, limit)
        self._pending = None
        ack_error(message, worker=worker)

    def send_weights(self, *args: Any) -> None:
        """Sender: send a version and wait for the worker's ack.

        Call as ``send_weights(weights)`` (model id ``"policy"``) or
        ``send_weights(model_id, weights)``.

        Raises:
            SyncTimeoutError: no ack within ``timeout``.
            ApplyError: the worker acked an error.

        Example:
            >>> transport.send_weights("policy", model)  # doctest: +SKIP
        """
        self.send_weights_async(*args)
        self.wait_ack()

    def setup_connection_and_weights_on_sender(self) -> None:
        """No-op (torchrl call shape): the connection is the process group (and RPC or the store)."""

    def setup_connection_and_weights_on_receiver(self, *, worker_idx: int | None = None, **_: Any) -> None:
        """No-op (torchrl call shape): versions arrive through :meth:`receive_weights`."""

    # ------------------------------------------------------------------ worker side

    def receive_snapshot(
        self, timeout: float | None = 1.0
    ) -> tuple[str, Manifest, list[torch.Tensor]] | None:
        """Worker: ``(model_id, manifest, buckets)`` of the next version, as received (no copy).

        The flat uint8 buckets belong to this version alone, so a receiver may
        adopt them as its parameters' storage (``keeps_snapshot``).

        Example:
            >>> model_id, manifest, buckets = transport.receive_snapshot(timeout=5)  # doctest: +SKIP
        """
        raise NotImplementedError

    def receive_weights(self, timeout: float | None = 1.0) -> tuple[str, dict[str, torch.Tensor]] | None:
        """Worker: the next whole version, oldest first, or None if none arrives in time.

        Control messages met on the way are kept (see the subclass).

        Args:
            timeout: seconds to wait; None waits until a version arrives.

        Returns:
            ``(model_id, {dotted_key: tensor})`` in canonical key order; the
            tensors are this process's own memory (safe to keep).

        Example:
            >>> model_id, tensors = transport.receive_weights(timeout=5)  # doctest: +SKIP
        """
        snapshot = self.receive_snapshot(timeout)
        if snapshot is None:
            return None
        model_id, manifest, buckets = snapshot
        return model_id, codec.views(manifest, buckets)

    def _post_ack(self, last: Any, message: str) -> None:
        """Send the ack ``message`` of the version ``last`` names."""
        raise NotImplementedError

    def send_ack(self, message: str = "updated") -> None:
        """Worker: acknowledge the version :meth:`receive_weights` last returned.

        Args:
            message: ``"updated"``, or ``"error: <text>"`` if it could not be applied
                (the sender's ``wait_ack`` then raises :class:`raysync.ApplyError`).

        Example:
            >>> transport.send_ack("error: shapes differ")  # doctest: +SKIP
        """
        if self._last is None:
            raise RuntimeError(
                "send_ack() before receive_weights() returned a version: nothing to acknowledge"
            )
        self._post_ack(self._last, message)

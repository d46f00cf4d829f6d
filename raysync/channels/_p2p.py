"""Shared plumbing of the torch.distributed transports (:mod:`.rpc`, :mod:`.distributed`).

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
from raysync.core import codec
from raysync.core.extract import extract_tensors
from raysync.core.layout import DEFAULT_BUCKET_BYTES, Manifest, plan_layout
from raysync.errors import RaySyncError, SyncTimeoutError

__all__ = [
    "P2PTransport",
    "Packed",
    "Transfer",
    "check_group",
    "next_tags",
    "pack_version",
    "post_sends",
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

    def done(self) -> bool:
        """Whether every work finished (successfully or not)."""
        return self._event.is_set()

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


def check_group(group: Any = None) -> None:
    """Raise unless the process group is up and moves CPU tensors (gloo)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call init_process_group('gloo', ...) in every "
            "process before sending or receiving weights"
        )
    backend = str(dist.get_backend(group))
    if backend != "gloo":
        raise ValueError(
            f"the process group's backend is {backend!r}; these transports move CPU buckets and "
            "need a gloo group (init_process_group('gloo', ...))"
        )


def post_sends(packed: Packed, dst: int, tags: Sequence[int], *, group: Any = None) -> Transfer:
    """``isend`` every non-empty bucket to ``dst``; returns at once."""
    import torch.distributed as dist

    check_group(group)
    works = [
        dist.isend(flat, dst, group=group, tag=tag)
        for flat, tag in zip(packed.buckets, tags, strict=True)
        if flat.numel()
    ]
    return Transfer(works, packed.buckets)


def receive_version(
    manifest: Manifest,
    src: int,
    tags: Sequence[int],
    *,
    timeout: float,
    group: Any = None,
    what: str = "version",
) -> list[torch.Tensor]:
    """Receive every bucket of a version from ``src`` into fresh buffers allocated from ``manifest``.

    Raises:
        SyncTimeoutError: the bytes did not all arrive within ``timeout``.
    """
    import torch.distributed as dist

    check_group(group)
    flats = codec.allocate(manifest)
    works = [
        dist.irecv(flat, src, group=group, tag=tag)
        for flat, tag in zip(flats, tags, strict=True)
        if flat.numel()
    ]
    # On a timeout the receives stay posted; the transfer's thread keeps their buffers alive.
    Transfer(works, flats).wait(time.monotonic() + timeout, f"the bytes of {what} from rank {src}")
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


class P2PTransport:
    """What the torch.distributed transports share: configuration, pickling, the blocking send and
    the worker's receive.

    Subclasses provide ``_init_runtime``, ``send_weights_async``, ``wait_ack`` and
    ``receive_snapshot``, and name in ``_config`` the attributes pickling keeps and in
    ``_handles`` the live handles it drops (``None`` after unpickling).
    """

    _config: tuple[str, ...] = ("timeout", "channel", "bucket_bytes")
    _handles: tuple[str, ...] = ()
    timeout: float
    channel: str
    bucket_bytes: int

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

    def send_weights_async(self, *args: Any) -> None:
        raise NotImplementedError

    def wait_ack(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def receive_snapshot(
        self, timeout: float | None = 1.0
    ) -> tuple[str, Manifest, list[torch.Tensor]] | None:
        raise NotImplementedError

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

"""RPCTransport: signal over ``torch.distributed.rpc``, move bytes with torch.distributed send/recv.

One transport object serves one receiver (one worker), as in torchrl. The
processes must already have joined a default process group
(``torch.distributed.init_process_group``, gloo on CPU) and an RPC group
(``torch.distributed.rpc.init_rpc``). Lifecycle of one version, and which side
runs what: as :mod:`raysync.channels._p2p` says, with a non-blocking
``rpc_async`` for the signal and an RPC back to the sender, naming the version,
for the ack. On the worker the signal's RPC thread (no user code) receives the
bytes (bounded by the sender's ``timeout``) and queues the whole version in the
worker's inbox for its ``channel``, so bytes flow even while the worker's main
thread is busy; ``receive_weights`` takes the next version from the inbox,
oldest first. Every delivery is queued until taken; nothing is dropped.

``close()`` (sender) unregisters the transport's ack box. A new send waits
(bounded) until the worker holds the previous one, so versions arrive in the
order they were sent. Transports on one worker share an inbox per
``channel``: give each receiving transport in a process its own channel (and
the matching sender transports the same one), or use one receiving transport
that returns every ``model_id``.

Example:
    >>> # trainer (rank 0, RPC name "trainer")
    >>> t = RPCTransport("worker1", worker_rank=1, timeout=30)  # doctest: +SKIP
    >>> t.send_weights("policy", model)                          # doctest: +SKIP
    >>> # worker (rank 1, RPC name "worker1")
    >>> t = RPCTransport()                                        # doctest: +SKIP
    >>> model_id, tensors = t.receive_weights(timeout=5)          # doctest: +SKIP
    >>> t.send_ack()                                              # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from raysync.channels._p2p import P2PTransport, Pending, receive_version, wait_until
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.core.layout import DEFAULT_BUCKET_BYTES, Manifest
from raysync.errors import ApplyError, SyncTimeoutError

__all__ = ["RPCTransport"]

logger = logging.getLogger(__name__)

DEFAULT_CHANNEL = "raysync"


@dataclass
class _Delivery:
    """A whole version in a worker's inbox."""

    model_id: str
    manifest: Manifest
    buckets: list[torch.Tensor]
    reply_to: str
    uid: str
    seq: int


# Worker side: one inbox per channel, filled by the signal RPC. Sender side: one ack box per
# transport, filled by the workers' ack RPCs. Both live in the module because an RPC runs a
# module-level function, not a method of a particular transport object.
_LOCK = threading.Lock()
_INBOXES: dict[str, queue.Queue[_Delivery]] = {}
_ACK_BOXES: dict[str, queue.Queue[tuple[int, str]]] = {}


def _inbox(channel: str) -> queue.Queue[_Delivery]:
    with _LOCK:
        return _INBOXES.setdefault(channel, queue.Queue())


def _on_weights(channel: str, message: dict[str, Any]) -> str:
    """Worker, RPC thread: receive the announced version's bytes and queue it whole."""
    manifest: Manifest = message["manifest"]
    buckets = receive_version(
        manifest,
        message["src"],
        message["tags"],
        timeout=message["timeout"],
        what=f"version {message['seq']} of {message['model_id']!r}",
    )
    _inbox(channel).put(
        _Delivery(message["model_id"], manifest, buckets, message["reply_to"], message["uid"], message["seq"])
    )
    logger.debug("queued %r (%d bytes) on channel %r", message["model_id"], manifest.total_nbytes, channel)
    return "received"


def _on_ack(uid: str, seq: int, message: str) -> bool:
    """Sender, RPC thread: file a worker's ack; False if that transport is gone."""
    with _LOCK:
        box = _ACK_BOXES.get(uid)
    if box is None:
        logger.warning("ack %r for send %d of a closed RPCTransport dropped", message, seq)
        return False
    box.put((seq, message))
    return True


def _name_of(info: Any) -> str | None:
    if info is None or isinstance(info, str):
        return info
    name = getattr(info, "name", None)  # rpc.WorkerInfo
    if not isinstance(name, str):
        raise TypeError(f"collector_info must be an RPC worker name or WorkerInfo, got {info!r}")
    return name


class RPCTransport(P2PTransport):
    """Weights to one worker: RPC to signal, torch.distributed send/recv for the bytes.

    Create it on the sender with the worker's RPC name (``collector_info``)
    and on the worker with no arguments; see the module docstring for which
    side runs each method.

    Args:
        collector_info: the worker's RPC name or ``WorkerInfo`` (sender side;
            None on the worker).
        collector_rref: accepted for torchrl compatibility; unused (the worker
            needs no remote object, its inbox receives the version).
        collector_class: accepted for torchrl compatibility; unused.
        worker_rank: the worker's rank in the default process group (sender
            side); defaults to its RPC rank.
        timeout: seconds any wait may take (``wait_ack``'s default, the
            worker's receive of the bytes, the ack RPC).
        channel: the inbox on the worker; sender and worker must agree.
        bucket_bytes: target bucket size (see :func:`raysync.core.layout.plan_layout`).

    Example:
        >>> sender = RPCTransport("worker1", worker_rank=1, timeout=10)  # doctest: +SKIP
        >>> sender.send_weights(model)          # model_id "policy"      # doctest: +SKIP
    """

    _config = ("worker_name", "worker_rank", *P2PTransport._config)
    _handles = ("collector_rref", "collector_class")  # pickling drops pending sends and handles

    def __init__(
        self,
        collector_info: Any = None,
        collector_rref: Any = None,
        collector_class: Any = None,
        worker_rank: int | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        channel: str = DEFAULT_CHANNEL,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self._configure(timeout, channel, bucket_bytes)
        self.worker_name = _name_of(collector_info)
        self.collector_rref = collector_rref
        self.collector_class = collector_class
        self.worker_rank = worker_rank
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._uid = uuid.uuid4().hex
        self._seq = itertools.count(1)
        self._pending = None
        self._last: tuple[str, str, int] | None = None  # (reply_to, uid, seq) of the last version taken
        self._acks: queue.Queue[tuple[int, str]] = queue.Queue()
        if self.worker_name is not None:
            with _LOCK:
                _ACK_BOXES[self._uid] = self._acks

    def __repr__(self) -> str:
        return (
            f"RPCTransport(worker={self.worker_name!r}, worker_rank={self.worker_rank}, "
            f"channel={self.channel!r}, timeout={self.timeout})"
        )

    # ------------------------------------------------------------------ sender side

    def _check_peer(self) -> None:
        if self.worker_name is None:
            raise ValueError(
                "this RPCTransport has no worker to send to: create the sender's transport "
                "with the worker's RPC name, RPCTransport(collector_info='worker1', worker_rank=1)"
            )

    def _rank(self) -> int:
        if self.worker_rank is None:
            from torch.distributed import rpc

            self.worker_rank = rpc.get_worker_info(self.worker_name).id
        return self.worker_rank

    def _signal(self, message: dict[str, Any]) -> tuple[int, Any]:
        from torch.distributed import rpc

        self._await_received()
        self._rank()
        seq = next(self._seq)
        message |= {
            "reply_to": rpc.get_worker_info().name,
            "uid": self._uid,
            "seq": seq,
            "timeout": self.timeout,
        }
        future = rpc.rpc_async(
            self.worker_name, _on_weights, args=(self.channel, message), timeout=self.timeout + 5.0
        )
        return seq, future

    def _await_received(self) -> None:
        # Versions go in order: the worker must hold the previous one before the next is announced.
        pending = self._pending
        if pending is None or pending.future.done():
            return
        if not wait_until(pending.future.done, time.monotonic() + self.timeout):
            raise SyncTimeoutError(
                f"worker {self.worker_name!r} has not received the previous version of "
                f"{pending.model_id!r} after {self.timeout} s; is it alive?",
                [{"subscriber": self.worker_name, "actor": None, "applied": None, "error": None}],
            )

    def _await_ack(self, pending: Pending, deadline: float, limit: float) -> tuple[str, str]:
        where = f"worker {self.worker_name!r}"
        what = f"version #{pending.number} of {pending.model_id!r}"
        laggard = [{"subscriber": self.worker_name, "actor": None, "applied": None, "error": None}]
        if not wait_until(pending.future.done, deadline):
            raise SyncTimeoutError(f"{where} did not receive {what} within {limit} s", laggard)
        try:
            pending.future.wait()
        except Exception as err:
            self._pending = None
            raise ApplyError(
                f"{where} failed to receive {what}: {err}",
                [{"subscriber": self.worker_name, "error": str(err)}],
            ) from err
        pending.outgoing.wait(deadline, f"the bytes of {what} to {where}")
        while True:
            try:
                seq, message = self._acks.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise SyncTimeoutError(
                    f"{where} did not acknowledge {what} within {limit} s "
                    "(it holds the version: is it calling receive_weights() and send_ack()?)",
                    laggard,
                ) from None
            if seq == pending.number:
                return message, f"{where} ({what})"
            logger.debug("late ack %r for send #%d ignored", message, seq)  # from a send that timed out

    def check_connection(self) -> bool:
        """Whether the process group and RPC are up (and, on the sender, the worker is known).

        Example:
            >>> transport.check_connection()  # doctest: +SKIP
            True
        """
        import torch.distributed as dist
        from torch.distributed import rpc

        if not dist.is_initialized() or not rpc.api._is_current_rpc_agent_set():
            return False
        if self.worker_name is not None:
            try:
                rpc.get_worker_info(self.worker_name)
            except Exception:
                return False
        return True

    def close(self) -> None:
        """Sender: stop accepting acks for this transport (late acks are then logged and dropped)."""
        with _LOCK:
            _ACK_BOXES.pop(self._uid, None)

    # ------------------------------------------------------------------ worker side

    def receive_snapshot(
        self, timeout: float | None = 1.0
    ) -> tuple[str, Manifest, list[torch.Tensor]] | None:
        try:
            delivery = _inbox(self.channel).get(timeout=timeout)
        except queue.Empty:
            return None
        self._last = (delivery.reply_to, delivery.uid, delivery.seq)  # not the buckets: they may be adopted
        return delivery.model_id, delivery.manifest, delivery.buckets

    def _post_ack(self, last: tuple[str, str, int], message: str) -> None:
        from torch.distributed import rpc

        reply_to, uid, seq = last
        rpc.rpc_sync(reply_to, _on_ack, args=(uid, seq, message), timeout=self.timeout)

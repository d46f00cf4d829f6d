"""DistributedTransport: signal through a TCPStore, move bytes with torch.distributed send/recv.

One transport object serves one receiver (one worker rank), as in torchrl.
Sender and worker share a ``torch.distributed.Store`` (usually the TCPStore
the process group was made with) and the default process group (gloo on
CPU). The store holds one mailbox per direction and worker, like the
reference's ``NODE_{rank}_in`` / ``NODE_{rank}_out`` keys, but numbered so no
message is ever overwritten or lost:

- ``raysync/<channel>/<rank>/in/<n>``: the n-th message to the worker
  (``in/next`` counts them, ``in/read`` how many the worker took);
- ``raysync/<channel>/<rank>/ack/<n>``: the worker's ack of message n.

A version goes as :mod:`raysync.channels._p2p` says; the signal is message n in the
worker's mailbox, and the ack the worker writes for it. ``receive_weights``
takes the messages in order: any that is not a version (for instance a
reference-style ``b"update_weights"``) is kept, never dropped: read it with
:meth:`DistributedTransport.next_message`.

Every wait polls with a deadline; nothing blocks on the store without one. One receiving
transport per (rank, channel): two would take each other's messages.

Example:
    >>> store = torch.distributed.TCPStore("127.0.0.1", port, 3, is_master=rank == 0)  # doctest: +SKIP
    >>> torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=3)  # doctest: +SKIP
    >>> DistributedTransport(store, 1).send_weights("policy", model)  # rank 0  # doctest: +SKIP
    >>> t = DistributedTransport(store, 1)                            # rank 1  # doctest: +SKIP
    >>> model_id, tensors = t.receive_weights(timeout=5); t.send_ack()          # doctest: +SKIP
"""

from __future__ import annotations

import collections
import functools
import logging
import pickle
import time
from typing import Any

import torch

from raysync.channels._p2p import P2PTransport, Pending, Transfer, receive_version, wait_until
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.core.layout import DEFAULT_BUCKET_BYTES, Manifest
from raysync.errors import SyncTimeoutError

__all__ = ["DistributedTransport"]

logger = logging.getLogger(__name__)

DEFAULT_CHANNEL = "raysync"
_MAGIC = b"raysync/1:"  # our messages; anything else in the mailbox is kept for the caller


class DistributedTransport(P2PTransport):
    """Weights to one worker rank: a TCPStore mailbox to signal, send/recv for the bytes.

    Create one per worker on the sender and one on the worker itself, with the
    same store, rank and channel; see the module docstring for which side runs
    each method.

    Args:
        store: the ``torch.distributed.Store`` both sides reach (a TCPStore).
        rank: the worker's rank in the default process group; on the worker,
            defaults to its own rank.
        sync: accepted for compatibility with the reference; sends are always
            posted non-blocking and ``send_weights`` waits for the ack.
        weights_buffer: accepted for torchrl 0.14 compatibility; unused (the
            worker allocates each version's buckets from its manifest).
        timeout: seconds any wait may take (``wait_ack``'s default, receiving
            a version's bytes).
        channel: names the mailboxes; sender and worker must agree.
        bucket_bytes: target bucket size (see :func:`raysync.core.layout.plan_layout`).

    Example:
        >>> sender = DistributedTransport(store, 1, timeout=10)  # doctest: +SKIP
        >>> sender.send_weights(model)        # model_id "policy"  # doctest: +SKIP
    """

    _config = ("rank", "sync", *P2PTransport._config)
    _handles = ("store",)  # pickling drops the store connection

    def __init__(
        self,
        store: Any = None,
        rank: int | None = None,
        sync: bool = True,
        *,
        weights_buffer: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        channel: str = DEFAULT_CHANNEL,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self._configure(timeout, channel, bucket_bytes)
        self.store = store
        self.rank = rank
        self.sync = sync
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._pending = None
        self._abandoned: list[int] = []  # messages whose ack wait timed out: their late acks get deleted
        self._messages: collections.deque[bytes] = collections.deque()
        self._last: int | None = None

    def __repr__(self) -> str:
        return f"DistributedTransport(rank={self.rank}, channel={self.channel!r}, timeout={self.timeout})"

    def mailbox_key(self, *parts: object) -> str:
        """The store key of this worker's mailbox entry ``parts`` (``"ready"``, number...)."""
        return "/".join(["raysync", self.channel, str(self._rank()), *map(str, parts)])

    def _rank(self) -> int:
        if self.rank is None:
            import torch.distributed as dist

            self.rank = dist.get_rank()
        return self.rank

    def _store(self) -> Any:
        if self.store is None:
            raise ValueError(
                "this DistributedTransport has no store: pass the TCPStore both sides share, "
                "DistributedTransport(store, rank)"
            )
        return self.store

    # ------------------------------------------------------------------ sender side

    def _check_peer(self) -> None:
        self._store()
        if self.rank is None:
            raise ValueError("the sender's DistributedTransport needs the worker's rank")

    def _signal(self, message: dict[str, Any]) -> tuple[int, Any]:
        return self.announce(message | {"kind": "weights"}), None

    def send_weights_async(self, *args: Any) -> None:
        previous = self._pending
        super().send_weights_async(*args)
        if previous is not None:  # replaced before its ack came: its late ack gets deleted
            self._abandoned = [*self._abandoned[-999:], previous.number]  # bounded if a worker died

    def send_message(self, message: bytes) -> int:
        """Sender: put a raw control message in the worker's mailbox; returns its number.

        The worker reads it with :meth:`next_message` (in order with the versions).

        Example:
            >>> transport.send_message(b"pause")  # doctest: +SKIP
            4
        """
        if not isinstance(message, bytes) or message.startswith(_MAGIC):
            raise ValueError(f"a control message must be bytes not starting with {_MAGIC!r}")
        store = self._store()
        number = int(store.add(self.mailbox_key("in", "next"), 1))
        store.set(self.mailbox_key("in", number), message)
        return number

    def announce(self, message: dict[str, Any]) -> int:
        """Sender: post a message (a dict) in the worker's mailbox; returns its number."""
        store = self._store()
        number = int(store.add(self.mailbox_key("in", "next"), 1))
        store.set(self.mailbox_key("in", number), _MAGIC + pickle.dumps(message | {"number": number}))
        return number

    def expect_ack(self, number: int, model_id: str) -> None:
        """Sender: message ``number`'s bytes went by other means; :meth:`wait_ack` waits for its ack."""
        self._pending = Pending(number, model_id, Transfer([], []))

    def _await_ack(self, pending: Pending, deadline: float, limit: float) -> tuple[str, str]:
        store = self._store()
        self._drop_late_acks()
        where = f"worker rank {self.rank}"
        what = f"message {pending.number} ({pending.model_id!r})"
        laggard = [{"subscriber": f"rank {self.rank}", "actor": None, "applied": None, "error": None}]
        try:
            pending.outgoing.wait(deadline, f"{where} to receive {what}")
        except SyncTimeoutError as err:
            raise SyncTimeoutError(
                f"{where} did not receive {what} within {limit} s (is it calling receive_weights()?)",
                laggard,
            ) from err
        key = self.mailbox_key("ack", pending.number)
        if not wait_until(functools.partial(store.check, [key]), deadline):
            raise SyncTimeoutError(f"{where} did not acknowledge {what} within {limit} s", laggard)
        message = bytes(store.get(key)).decode(errors="replace")
        store.delete_key(key)
        return message, f"{where} ({what})"

    def _drop_late_acks(self) -> None:
        store = self._store()
        for number in list(self._abandoned):
            if store.delete_key(self.mailbox_key("ack", number)):
                self._abandoned.remove(number)

    def check_connection(self) -> bool:
        """Whether the process group is up and the store answers.

        Example:
            >>> transport.check_connection()  # doctest: +SKIP
            True
        """
        import torch.distributed as dist

        if self.store is None or not dist.is_initialized():
            return False
        try:
            self.store.check([self.mailbox_key("in", "next")])
        except Exception:
            return False
        return True

    # ------------------------------------------------------------------ worker side

    def receive_snapshot(
        self, timeout: float | None = 1.0
    ) -> tuple[str, Manifest, list[torch.Tensor]] | None:
        """Worker: as :meth:`P2PTransport.receive_snapshot`; control messages met on the way are
        kept for :meth:`next_message`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        message = self._take_next(deadline, keep_weights=False)
        if message is None:
            return None
        number, payload = message
        buckets = self._receive_buckets(number, payload)
        self._last = number
        return payload["model_id"], payload["manifest"], buckets

    def _receive_buckets(self, number: int, payload: dict[str, Any]) -> list[torch.Tensor]:
        """The bytes of weights message ``number``, from its sender's ``isend``s."""
        return receive_version(
            payload["manifest"],
            payload["src"],
            payload["tags"],
            timeout=self.timeout,
            what=f"message {number} ({payload['model_id']!r})",
        )

    def _take_next(self, deadline: float | None, *, keep_weights: bool) -> tuple[int, dict[str, Any]] | None:
        """Take mailbox messages in order until a weights message (returned) or ``deadline``.

        Control messages are kept for :meth:`next_message`. With
        ``keep_weights`` a weights message is left in the mailbox and None returned.
        """
        store = self._store()
        while True:
            number = int(store.add(self.mailbox_key("in", "read"), 0)) + 1
            key = self.mailbox_key("in", number)
            if not wait_until(functools.partial(store.check, [key]), deadline):
                return None
            raw = bytes(store.get(key))
            ours = raw.startswith(_MAGIC)
            payload = pickle.loads(raw[len(_MAGIC) :]) if ours else None
            is_weights = payload is not None and payload.get("kind") == "weights"
            if is_weights and keep_weights:
                return None
            store.delete_key(key)
            store.add(self.mailbox_key("in", "read"), 1)
            if is_weights:
                assert payload is not None
                return number, payload
            self._messages.append(raw)
            logger.debug("kept control message %d: %r", number, raw[:64])

    def next_message(self, timeout: float | None = 0.0) -> bytes | None:
        """Worker: the next control message (not a version), or None.

        Messages that :meth:`receive_weights` met on the way come first; then
        the mailbox is read until ``timeout``, stopping before a version
        (versions stay for :meth:`receive_weights`, never dropped).

        Example:
            >>> transport.next_message()  # doctest: +SKIP
            b'pause'
        """
        if not self._messages:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._take_next(deadline, keep_weights=True)
        return self._messages.popleft() if self._messages else None

    def pending_messages(self) -> list[bytes]:
        """Worker: the control messages kept so far (not removed).

        Example:
            >>> transport.pending_messages()  # doctest: +SKIP
            [b'pause']
        """
        return list(self._messages)

    def _post_ack(self, last: int, message: str) -> None:
        self._store().set(self.mailbox_key("ack", last), message.encode())

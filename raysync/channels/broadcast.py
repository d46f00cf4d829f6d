"""One-to-many over a gloo group: the worker side of a broadcast (``DistributedAdapter``'s ranks).

Built on :class:`~raysync.channels.distributed.DistributedTransport`'s mailboxes for the
signals (message, ready, go, ack); the bytes move with one ``broadcast`` per bucket from rank 0.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any

import torch

from raysync.channels._p2p import Transfer, wait_until
from raysync.channels.distributed import DistributedTransport
from raysync.core import codec
from raysync.core.layout import Manifest
from raysync.errors import SyncTimeoutError

__all__ = ["BroadcastTransport", "broadcast_buckets"]


def _join_group(store: Any, channel: str, generation: int, rank: int, world: int, timeout: float) -> None:
    """(Re)form the gloo group of one generation (membership changes start a new one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"raysync/{channel}/group/{generation}", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )


def broadcast_buckets(flats: list[torch.Tensor], timeout: float, what: str) -> list[torch.Tensor]:
    """One ``broadcast`` from rank 0 per non-empty bucket (rank 0 sends ``flats``, the others fill
    theirs); raises :class:`SyncTimeoutError` past ``timeout``."""
    import torch.distributed as dist

    works = [dist.broadcast(f, src=0, async_op=True) for f in flats if f.numel()]
    Transfer(works, flats).wait(time.monotonic() + timeout, what)
    return flats


class BroadcastTransport(DistributedTransport):
    """Worker side of a DistributedAdapter: the mailbox of DistributedTransport, bytes by broadcast.

    For each version: take the message, say "ready", wait for "go" (the
    group generation and this worker's rank in it), join that group if it
    is new, then receive every bucket by ``broadcast`` from rank 0.
    """

    generation: int | None = None

    def _receive_buckets(self, number: int, payload: dict[str, Any]) -> list[torch.Tensor]:
        store = self._store()
        store.set(self.mailbox_key("ready", number), b"1")
        go_key = self.mailbox_key("go", number)
        if not wait_until(lambda: bool(store.check([go_key])), time.monotonic() + self.timeout):
            raise SyncTimeoutError(f"the adapter did not start broadcasting message {number}")
        go = pickle.loads(bytes(store.get(go_key)))
        store.delete_key(go_key)
        if go["generation"] != self.generation:
            _join_group(store, self.channel, go["generation"], go["rank"], go["world"], self.timeout)
            self.generation = go["generation"]
        manifest: Manifest = payload["manifest"]
        return broadcast_buckets(codec.allocate(manifest), self.timeout, f"broadcast of message {number}")

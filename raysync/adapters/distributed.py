"""``DistributedAdapter``: K ranks of a gloo group; the adapter is rank 0 and broadcasts."""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import time
from typing import Any

from raysync.adapters._workers import _broadcast_rank
from raysync.adapters.base import _Adapter, _Receiver
from raysync.channels._p2p import wait_until
from raysync.channels.broadcast import _join_group, broadcast_buckets
from raysync.channels.distributed import DistributedTransport
from raysync.core import codec
from raysync.core.layout import Manifest
from raysync.errors import RaySyncError

__all__ = ["DistributedAdapter"]


class DistributedAdapter(_Adapter):
    """Rank 0 of a gloo group with K worker processes: one broadcast per bucket per version.

    Each worker runs ``fn(receiver, *args)`` like :class:`PipeAdapter`'s. Per
    version the adapter posts the manifest in each worker's mailbox (the
    group's TCPStore), waits until every worker is ready, then broadcasts each
    bucket once and collects the acks. A worker that is not ready within
    ``timeout`` (dead or stuck: a collective cannot wait for it) is stopped
    and dropped, and the others form a new group without it.

    Args: as :class:`PipeAdapter`.

    Example:
        >>> adapter = raysync.adapters.start("distributed", worker_loop, model_factory=make_policy)
    """

    kind = "distributed"

    def _start_receivers(self, count: int) -> None:
        import torch.distributed as dist

        self._channel = f"adapter-{os.getpid()}"
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout),
        )
        self._generation = 0
        self._members: list[int] | None = None
        port = int(self._store.port)
        for i in range(count):
            connect = functools.partial(_broadcast_rank, "127.0.0.1", port, i, self._channel)
            transport = DistributedTransport(self._store, i, timeout=self.timeout, channel=self._channel)
            self._add_receiver(i, f"{self.name}/rank-{i + 1}", connect, transport)

    def _ready_or_gone(self, key: str, r: _Receiver) -> bool:
        return bool(self._store.check([key])) or not r.process.is_alive()

    def _fan_out(
        self, model_id: str, version: int, manifest: Manifest, buckets: list[Any], live: list[_Receiver]
    ) -> None:
        numbers = {}
        for r in live:
            message = {"kind": "weights", "model_id": model_id, "manifest": manifest, "tags": [], "src": 0}
            numbers[r.index] = r.transport.announce(message)
        deadline = time.monotonic() + self.timeout
        ready: list[_Receiver] = []
        for r in live:
            key = r.transport.mailbox_key("ready", numbers[r.index])
            ok = wait_until(functools.partial(self._ready_or_gone, key, r), deadline)
            if ok and self._store.check([key]):
                self._store.delete_key(key)
                ready.append(r)
            elif not r.process.is_alive():
                self._drop(r, f"receiver process exited (exit code {r.process.exitcode})")
            else:
                self._drop(r, f"did not take version {version} within {self.timeout} s (stopped)")
        if not ready:
            return
        members = [r.index for r in ready]
        if members != self._members:
            self._generation += 1
            self._members = members
        for rank, r in enumerate(ready, start=1):
            go = {"generation": self._generation, "rank": rank, "world": len(ready) + 1}
            self._store.set(r.transport.mailbox_key("go", numbers[r.index]), pickle.dumps(go))  # type: ignore[arg-type]
        if getattr(self, "_joined", None) != self._generation:
            _join_group(self._store, self._channel, self._generation, 0, len(ready) + 1, self.timeout)
            self._joined = self._generation
        # One broadcast per bucket, straight from the object store (rank 0 only reads them).
        try:
            broadcast_buckets(
                codec.flats_of(manifest, buckets), self.timeout, f"broadcast of version {version}"
            )
        except RaySyncError as err:
            self._members = None  # the group is unusable after a failed collective: form a new one
            for r in ready:
                self._check(r, version, err if r.process.is_alive() else RaySyncError(str(err)))
            return
        for r in ready:
            r.transport.expect_ack(numbers[r.index], model_id)
        self._collect_acks(version, ready, deadline, grace=self.timeout)

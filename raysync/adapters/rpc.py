"""``RPCAdapter``: K torch.distributed.rpc workers; manifest by RPC, bytes by send/recv."""

from __future__ import annotations

import functools
import os
from typing import Any

from raysync.adapters._workers import _free_port, _join_rpc, _rpc_rank
from raysync.adapters.base import _Adapter, _Receiver
from raysync.channels._p2p import Packed
from raysync.channels.rpc import RPCTransport
from raysync.core import codec
from raysync.core.layout import Manifest
from raysync.errors import RaySyncError

__all__ = ["RPCAdapter"]


class RPCAdapter(_Adapter):
    """Rank 0 of a ``torch.distributed.rpc`` group with K RPC worker processes.

    Each worker runs ``fn(receiver, *args)`` like :class:`PipeAdapter`'s. Per
    version the adapter signals every worker by RPC (the manifest) and sends
    the bytes with torch.distributed ``isend`` (gloo), through
    :class:`raysync.channels.rpc.RPCTransport`; the worker's RPC thread
    receives them whole, its loop applies them and acks by RPC. A worker that
    dies is reported and dropped (nothing more is sent to it).

    Args: as :class:`PipeAdapter`.

    Example:
        >>> adapter = raysync.adapters.start("rpc", worker_loop, model_factory=make_policy)
    """

    kind = "rpc"

    def _start_receivers(self, count: int) -> None:
        host = "127.0.0.1"
        port, rpc_port = _free_port(), _free_port()
        world = count + 1
        channel = f"adapter-{os.getpid()}"
        for i in range(count):
            connect = functools.partial(_rpc_rank, host, port, rpc_port, i + 1, world, channel)
            transport = RPCTransport(f"rank{i + 1}", worker_rank=i + 1, timeout=self.timeout, channel=channel)
            self._add_receiver(i, f"{self.name}/rank{i + 1}", connect, transport)
        _join_rpc(host, port, rpc_port, 0, world, self.timeout)

    def _fan_out(
        self, model_id: str, version: int, manifest: Manifest, buckets: list[Any], live: list[_Receiver]
    ) -> None:
        # Packed once: every receiver's sends read the same buckets, straight from the object store.
        packed = Packed(model_id, manifest, codec.flats_of(manifest, buckets))
        self._send_all(model_id, version, packed, live)

    def _failed(self, r: _Receiver, version: int, err: RaySyncError, *, sent: bool) -> None:
        if sent and (not r.process.is_alive() or "failed to receive" in str(err)):
            r.process.join(timeout=1.0)
            self._drop(r, f"RPC worker unreachable (exit code {r.process.exitcode}): {err}"[:500])
        else:
            self._check(r, version, err)

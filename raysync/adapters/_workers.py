"""The receiver processes' entry point and how each kind connects: pipe workers, distributed ranks,
RPC workers.

Each runs ``fn(receiver, *args)`` (the user's loop) and exits when its adapter dies.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from raysync.channels.broadcast import BroadcastTransport
from raysync.channels.rpc import RPCTransport
from raysync.errors import RaySyncError

__all__ = []

logger = logging.getLogger(__name__)


def _watch_parent(parent: int) -> None:
    """Exit when the adapter that started this worker is gone (it may have been killed)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the Ray worker's handler, inherited by fork

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=loop, name="raysync-parent-watch", daemon=True).start()


def _receiver_main(
    connect: Callable[[float], tuple[Any, dict[str, Any]]],
    fn: Callable[..., Any],
    args: Sequence[Any],
    model_factory: Callable[[], Any],
    model_id: str,
    timeout: float,
    parent: int,
    name: str,
) -> None:
    """Entry point of an adapter's receiver process: ``connect(timeout)`` gives the scheme and its
    endpoint (one of the functions below, bound to the adapter's side), then ``fn`` runs."""
    _watch_parent(parent)
    scheme, endpoint = connect(timeout)
    scheme.init_on_receiver(model_id=model_id, **endpoint, model=model_factory())
    try:
        fn(scheme.get_receiver(), *args)
    except RaySyncError as err:
        # The adapter closed its end (shutdown or death): a normal way for the loop to end.
        logger.info("%s: stopping: %s", name, err)


def _pipe_end(conn: Any, timeout: float) -> tuple[Any, dict[str, Any]]:
    """A PipeAdapter worker: its end of the pipe."""
    from raysync.torchrl.schemes import MultiProcessWeightSyncScheme

    return MultiProcessWeightSyncScheme(timeout=timeout), {"pipe": conn}


def _broadcast_rank(
    host: str, port: int, index: int, channel: str, timeout: float
) -> tuple[Any, dict[str, Any]]:
    """A DistributedAdapter worker: the adapter's store, bytes by broadcast."""
    import torch.distributed as dist

    from raysync.torchrl.schemes import DistributedWeightSyncScheme

    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    transport = BroadcastTransport(store, index, timeout=timeout, channel=channel)
    return DistributedWeightSyncScheme(timeout=timeout), {"endpoint": transport}


def _rpc_rank(
    host: str, port: int, rpc_port: int, rank: int, world: int, channel: str, timeout: float
) -> tuple[Any, dict[str, Any]]:
    """An RPCAdapter worker: rank ``rank`` of the gloo and RPC groups."""
    from raysync.torchrl.schemes import RPCWeightSyncScheme

    _join_rpc(host, port, rpc_port, rank, world, timeout)
    scheme = RPCWeightSyncScheme(timeout=timeout)
    return scheme, {"endpoint": RPCTransport(timeout=timeout, channel=channel)}


def _join_rpc(host: str, port: int, rpc_port: int, rank: int, world: int, timeout: float) -> None:
    """Join the default gloo group (bytes) and the RPC group (signals) of an RPCAdapter."""
    import torch.distributed as dist
    from torch.distributed import rpc

    store = dist.TCPStore(
        host, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{host}:{rpc_port}", num_worker_threads=8, rpc_timeout=timeout
    )
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=world, rpc_backend_options=options)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

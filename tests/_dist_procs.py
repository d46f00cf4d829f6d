"""Child processes for tests/test_transports_dist.py: one sender (rank 0) and workers.

Each child joins a gloo process group (over a TCPStore) and an RPC group, builds
the transports of its role, then runs commands sent by the test process over a
pipe until told to stop. Results go back pickled (tensors by value), errors as
``("err", type_name, message)``. Only torch and raysync are imported here.
"""

from __future__ import annotations

import datetime
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

TIMEOUT = 20.0  # any wait inside a child: a broken test fails, it never hangs
BUCKET_BYTES = 4096  # small buckets: every version spans several sends


def make_weights(seed: int, *, out: int = 4) -> dict[str, torch.Tensor]:
    """Parameters and buffers of several dtypes, inserted out of key order, with NaN and -0.0."""
    g = torch.Generator().manual_seed(seed)
    weights = {
        "net.2.weight": torch.randn(out, 64, generator=g),
        "net.0.weight": torch.randn(64, 8, generator=g),
        "net.0.bias": torch.randn(64, generator=g),
        "norm.running_mean": torch.randn(64, generator=g).to(torch.float64),
        "norm.num_batches_tracked": torch.tensor(seed, dtype=torch.int64),
        "emb.weight": torch.randn(50, 3, generator=g).to(torch.bfloat16),
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
        "net.2.bias": torch.randn(out, generator=g),
    }
    weights["net.0.bias"][0] = float("nan")
    weights["net.0.bias"][1] = -0.0
    return weights


def make_module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))


class _State:
    def __init__(self, rank: int, world: int, store: Any) -> None:
        from raysync.channels.distributed import DistributedTransport
        from raysync.channels.rpc import RPCTransport

        self.rank = rank
        self.world = world
        self.store = store
        self.schemes: dict[str, Any] = {}
        self.models: dict[str, torch.nn.Module] = {}
        self.tx: dict[str, dict[int, Any]] = {"rpc": {}, "dist": {}}
        if rank == 0:
            for r in range(1, world):
                self.tx["rpc"][r] = RPCTransport(
                    f"rank{r}", worker_rank=r, timeout=TIMEOUT, bucket_bytes=BUCKET_BYTES
                )
                self.tx["dist"][r] = DistributedTransport(
                    store, r, timeout=TIMEOUT, bucket_bytes=BUCKET_BYTES
                )
        else:
            self.tx["rpc"][rank] = RPCTransport(timeout=TIMEOUT)
            self.tx["dist"][rank] = DistributedTransport(store, timeout=TIMEOUT)

    # ---------------------------------------------------------------- sender commands

    def send(
        self,
        kind: str,
        ranks: list[int],
        model_id: str | None,
        seeds: list[int],
        what: str = "dict",
        timeout: float | None = None,
    ) -> dict[int, Any]:
        """Send each seed's weights to every rank (async), then wait for the newest one's acks."""
        for seed in seeds:
            weights = make_weights(seed) if what == "dict" else make_module(seed)
            for r in ranks:
                tx = self.tx[kind][r]
                if model_id is None:
                    tx.send_weights_async(weights)  # torchrl 0.14 call shape
                else:
                    tx.send_weights_async(model_id, weights)
            if what == "dict":
                weights["net.0.weight"].add_(1.0)  # the trainer moves on: the sent snapshot must not
        outcome: dict[int, Any] = {}
        for r in ranks:
            t0 = time.monotonic()
            try:
                self.tx[kind][r].wait_ack(timeout)
                outcome[r] = "ok"
            except Exception as err:
                outcome[r] = (type(err).__name__, str(err), time.monotonic() - t0)
        return outcome

    def send_message(self, kind: str, rank: int, message: bytes) -> int:
        return int(self.tx[kind][rank].send_message(message))

    # ---------------------------------------------------------------- raysync.schemes on top

    def _endpoint(self, kind: str, rank: int | None) -> dict[str, Any]:
        # Channel "scheme": apart from the raw transports above, which use the default one.
        if kind == "dist":
            return {"store": self.store, "rank": rank, "channel": "scheme"}
        if rank is None:  # the worker's own end
            return {"channel": "scheme"}
        return {"collector_info": f"rank{rank}", "worker_rank": rank, "channel": "scheme"}

    def scheme_init(self, kind: str) -> list[str]:
        from raysync.torchrl.schemes import DistributedWeightSyncScheme, RPCWeightSyncScheme

        cls = RPCWeightSyncScheme if kind == "rpc" else DistributedWeightSyncScheme
        scheme = self.schemes[kind] = cls(timeout=TIMEOUT)
        if self.rank == 0:
            endpoints = [self._endpoint(kind, r) for r in range(1, self.world)]
            scheme.init_on_sender(model_id="policy", endpoints=endpoints, model=make_module(100))
            return []
        model = self.models[kind] = make_module(0)
        self._params = [id(p) for p in model.parameters()]
        own_rank = self.rank if kind == "dist" else None
        scheme.init_on_receiver(model_id="policy", endpoint=self._endpoint(kind, own_rank), model=model)
        return list(model.state_dict())

    def scheme_connect(self, kind: str) -> Any:
        self.schemes[kind].connect()
        return self._model_state(kind) if self.rank else "ok"

    def scheme_send(self, kind: str, seed: int, worker_ids: Any = None, bad: bool = False) -> Any:
        weights: Any = make_module(seed)
        if bad:
            weights = torch.nn.Sequential(torch.nn.Linear(8, 15))  # another model's schema
        try:
            self.schemes[kind].send(weights, worker_ids)
        except Exception as err:
            return type(err).__name__, str(err)
        return "ok"

    def send_raw(self, kind: str, rank: int, channel: str, model_id: str, seed: int) -> Any:
        """Send with a bare transport on ``channel`` (e.g. a model the worker's scheme does not know)."""
        from raysync.channels.distributed import DistributedTransport
        from raysync.channels.rpc import RPCTransport

        if kind == "rpc":
            tx: Any = RPCTransport(f"rank{rank}", worker_rank=rank, timeout=TIMEOUT, channel=channel)
        else:
            tx = DistributedTransport(self.store, rank, timeout=TIMEOUT, channel=channel)
        try:
            tx.send_weights(model_id, make_weights(seed))
        except Exception as err:
            return type(err).__name__, str(err)
        finally:
            if kind == "rpc":
                tx.close()
        return "ok"

    def scheme_receive(self, kind: str, timeout: float = TIMEOUT) -> Any:
        receiver = self.schemes[kind].get_receiver()
        applied = self.schemes[kind].receive(timeout)
        error = receiver.last_error
        return applied, type(error).__name__ if error else None, self._model_state(kind)

    def _model_state(self, kind: str) -> Any:
        model = self.models[kind]
        same_params = [id(p) for p in model.parameters()] == self._params
        return {k: v.clone() for k, v in model.state_dict().items()}, same_params

    # ---------------------------------------------------------------- worker commands

    def receive(self, kind: str, timeout: float = TIMEOUT, ack: str | None = "updated") -> Any:
        tx = self.tx[kind][self.rank]
        got = tx.receive_weights(timeout=timeout)
        if got is not None and ack is not None:
            tx.send_ack(ack)
        if got is None:
            return None
        model_id, tensors = got
        return model_id, list(tensors), {k: t.clone() for k, t in tensors.items()}

    def next_message(self, kind: str, timeout: float = 0.0) -> bytes | None:
        result: bytes | None = self.tx[kind][self.rank].next_message(timeout)
        return result


def main(rank: int, world: int, store_port: int, rpc_port: int, conn: Connection) -> None:
    """Entry point of a child: set up, then serve commands until ``stop``."""
    import torch.distributed as dist
    from torch.distributed import rpc

    try:
        store = dist.TCPStore(
            "127.0.0.1", store_port, world, rank == 0, timeout=datetime.timedelta(seconds=60)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{rpc_port}", num_worker_threads=8, rpc_timeout=60
        )
        rpc.init_rpc(f"rank{rank}", rank=rank, world_size=world, rpc_backend_options=options)
        state = _State(rank, world, store)
    except Exception:
        conn.send_bytes(pickle.dumps(("err", "SetupError", traceback.format_exc())))
        raise
    conn.send_bytes(pickle.dumps(("ok", "ready")))
    while True:
        name, kwargs = pickle.loads(conn.recv_bytes())
        if name == "stop":
            break
        try:
            method: Callable[..., Any] = getattr(state, name)
            reply: tuple[Any, ...] = ("ok", method(**kwargs))
        except Exception as err:
            reply = ("err", type(err).__name__, f"{err}\n{traceback.format_exc()}")
        conn.send_bytes(pickle.dumps(reply))
    rpc.shutdown(graceful=True)
    dist.destroy_process_group()
    conn.send_bytes(pickle.dumps(("ok", "stopped")))

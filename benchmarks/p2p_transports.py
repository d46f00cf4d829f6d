"""RPCTransport and DistributedTransport on one node: time to deliver a version to N ranks.

One sender (rank 0) and ``--workers`` worker processes join a gloo group over
localhost (plus an RPC group). For each transport and model size (an fp32
state dict of 16 equal tensors), the sender times ``--repeats`` versions (after
one untimed warm-up) from ``send_weights_async`` to every worker until the last
``wait_ack`` returned; each worker loops ``receive_weights`` + ``send_ack``.
Medians are printed with the effective rate (model bytes x N / time); every
sample goes to ``--json`` (default ``benchmarks/results/p2p_transports.json``).

Usage:
    python benchmarks/p2p_transports.py --mib 16 64 --workers 2 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

import _harness as harness
from _ports import free_ports

RESULTS = Path(__file__).resolve().parent / "results"


def _model(mib: int) -> dict[str, torch.Tensor]:
    return harness.make_state_dict(mib * harness.MIB, 16, name="layer{i:02d}.weight", random=True)


def _child(rank: int, world: int, ports: tuple[int, int], args: Any, conn: Connection) -> None:
    import torch.distributed as dist
    from torch.distributed import rpc

    from raysync.channels.distributed import DistributedTransport
    from raysync.channels.rpc import RPCTransport

    store = dist.TCPStore("127.0.0.1", ports[0], world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{ports[1]}", rpc_timeout=120)
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    count = args.repeats + 1
    rows = []
    for kind in ("rpc", "dist"):
        for mib in args.mib:
            if rank == 0:
                txs: list[Any] = [
                    RPCTransport(f"rank{r}", worker_rank=r, timeout=120)
                    if kind == "rpc"
                    else DistributedTransport(store, r, timeout=120)
                    for r in range(1, world)
                ]
                weights = _model(mib)
                times = []
                for _ in range(count):
                    t0 = time.perf_counter()
                    for tx in txs:
                        tx.send_weights_async("policy", weights)
                    for tx in txs:
                        tx.wait_ack()
                    times.append(time.perf_counter() - t0)
                rows.append({"transport": kind, "mib": mib, "workers": world - 1, "samples_s": times[1:]})
            else:
                rx: Any = RPCTransport() if kind == "rpc" else DistributedTransport(store, rank)
                for _ in range(count):
                    got = rx.receive_weights(timeout=120)
                    assert got is not None
                    rx.send_ack()
            dist.barrier()
    rpc.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        conn.send(rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 64], help="model sizes in MiB")
    parser.add_argument("--workers", type=int, default=2, help="worker ranks N")
    harness.add_options(parser, repeats=5, json=RESULTS / "p2p_transports.json")
    args = parser.parse_args(argv)
    t_start = time.time()
    ctx = mp.get_context("spawn")
    world = args.workers + 1
    ports = tuple(free_ports(2))
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_child, args=(r, world, ports, args, child)) for r in range(world)]
    for p in procs:
        p.start()
    rows = parent.recv()
    for p in procs:
        p.join()
    print(f"torch {torch.__version__}, gloo over localhost")
    print("| transport | MiB | N | ms per version (median) | GiB/s (bytes x N) |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        median = harness.median(row["samples_s"]) or float("nan")
        rate = row["mib"] * row["workers"] / 1024 / median
        print(f"| {row['transport']} | {row['mib']} | {row['workers']} | {median * 1e3:.1f} | {rate:.2f} |")
    meta = harness.run_meta("benchmarks/p2p_transports.py", argv, started=t_start)
    harness.write_json(args.json, {"meta": meta, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()

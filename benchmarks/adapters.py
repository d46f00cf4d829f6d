"""Adapters against actors fetching on their own: N receivers behind one adapter vs N actors.

For every model size (an fp32 module of ``--tensors`` equal parameters) this
script measures, with ``--repeats`` timed pushes (medians) after one untimed:

``actors``
    N ``@raysync.synced_model`` actors (``apply="copy"``), each a subscriber
    of the hub fetching every version from the object store itself.
``pipe`` / ``distributed`` / ``rpc``
    ONE adapter (:mod:`raysync.adapters`) with N receiver processes behind
    it: the hub sees one subscriber, which fetches each version once and fans
    it out (shared memory + pipes, one gloo broadcast per bucket, or RPC +
    send/recv).

Columns: ``applied_s`` is ``hub.push(model, wait=True)`` until every receiver
applied the version; ``subs`` the subscribers the hub delivers to;
``fetched_MiB/v`` the bytes taken from the object store per version (the sum
of ``last_bytes_fetched`` over the hub's subscribers).

Run::

    python benchmarks/adapters.py                      # 64 and 256 MiB, N = 8
    python benchmarks/adapters.py --quick              # 16 MiB, N = 8, 2 repeats

Results: a table on stdout and JSON in ``--json`` (default
``benchmarks/results/adapters.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch

import raysync
import raysync.adapters

MIB = 2**20
DEFAULT_JSON = Path(__file__).parent / "results" / "adapters.json"


class Blob(torch.nn.Module):
    """``num`` fp32 parameters of ``numel`` elements each."""

    def __init__(self, num: int, numel: int) -> None:
        super().__init__()
        for i in range(num):
            self.register_parameter(f"t{i:02d}", torch.nn.Parameter(torch.zeros(numel)))


class BlobFactory:
    """A picklable model factory for the receivers."""

    def __init__(self, num: int, numel: int) -> None:
        self.num, self.numel = num, numel

    def __call__(self) -> torch.nn.Module:
        return Blob(self.num, self.numel)


def receive_loop(receiver: Any) -> None:
    while True:
        receiver.receive(timeout=0.01)


class Holder:
    def __init__(self, factory: BlobFactory) -> None:
        self.model = factory()

    def ready(self) -> bool:
        return True


def measure(kind: str, size_mib: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    numel = size_mib * MIB // 4 // args.tensors
    factory = BlobFactory(args.tensors, numel)
    name = f"bench-adapters-{uuid.uuid4().hex[:6]}"
    hub = raysync.connect(name)
    handles: list[Any] = []
    try:
        if kind == "actors":
            cls = ray.remote(num_cpus=0)(raysync.synced_model("model", hub=name)(Holder))
            handles = [cls.remote(factory) for _ in range(n)]
            ray.get([h.ready.remote() for h in handles])
        else:
            handles = [
                raysync.adapters.start(
                    kind,  # type: ignore[arg-type]
                    receive_loop,
                    model_factory=factory,
                    num_receivers=n,
                    hub=name,
                    timeout=args.timeout,
                    num_cpus=0,
                    model_id="policy",
                )
            ]
            ray.get([h._raysync_ping.remote() for h in handles])
        model_id = "policy"
        trainer = factory()
        times = []
        for i in range(args.repeats + 1):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.fill_(float(i + 1))
            t0 = time.perf_counter()
            hub.push(trainer, model_id, wait=True, timeout=args.timeout)
            if i:
                times.append(time.perf_counter() - t0)
        subs = hub.status()["subscribers"]
        fetched = sum(s["last_bytes_fetched"] or 0 for s in subs)
        return {
            "kind": kind,
            "size_mib": size_mib,
            "receivers": n,
            "subs": len(subs),
            "applied_s": statistics.median(times),
            "samples": times,
            "fetched_mib_per_version": fetched / MIB,
        }
    finally:
        for h in handles:
            ray.kill(h)
        ray.kill(hub.actor)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    p.add_argument("--receivers", type=int, default=8)
    p.add_argument("--kinds", nargs="+", default=["actors", "pipe", "distributed", "rpc"])
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--quick", action="store_true", help="16 MiB, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes_mib, args.repeats = [16], 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ray.init(
        address="local",  # a cluster of its own, never one found on this machine
        num_cpus=4,
        object_store_memory=max(2**30, 4 * max(args.sizes_mib) * MIB),
        include_dashboard=False,
        logging_level="warning",
        log_to_driver=False,
    )
    rows = [measure(k, s, args.receivers, args) for s in args.sizes_mib for k in args.kinds]
    print(f"{'kind':>12} {'MiB':>5} {'N':>3} {'subs':>4} {'applied_s':>9} {'fetched_MiB/v':>13}")
    for r in rows:
        print(
            f"{r['kind']:>12} {r['size_mib']:>5} {r['receivers']:>3} {r['subs']:>4} "
            f"{r['applied_s']:>9.3f} {r['fetched_mib_per_version']:>13.1f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

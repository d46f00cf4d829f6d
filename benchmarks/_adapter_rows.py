"""Adapters against actors fetching on their own: N receivers behind one adapter vs N actors.

For every model size (an fp32 module of ``--tensors`` equal parameters) this
scenario measures, with ``--repeats`` timed pushes (medians) after one untimed:

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

(``benchmarks/push_fanout.py --adapters`` adds the same rows to the fan-out.)
Results: a table on stdout and JSON in ``--json`` (default
``benchmarks/results/adapters.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
import torch

import _harness as harness
import raysync
import raysync.adapters
from _harness import MIB

__all__ = ["KINDS", "Holder", "main", "measure", "parse_args", "print_table", "receive_loop"]

KINDS = ("actors", "pipe", "distributed", "rpc")
"""What is measured: N synced actors, or one adapter of each kind with N receivers."""


def receive_loop(receiver: Any) -> None:
    """An adapter receiver's loop: apply every version as it comes (runs until the adapter stops).

    Example:
        >>> factory = harness.FlatModelFactory(16 * MIB)
        >>> raysync.adapters.start("pipe", receive_loop, model_factory=factory, num_receivers=8)
    """
    while True:
        receiver.receive(timeout=0.01)


class Holder:
    """An actor that holds a model built by ``factory`` in ``self.model`` (decorated per run).

    Example:
        >>> cls = ray.remote(raysync.synced_model("model", hub="h")(Holder))  # doctest: +SKIP
        >>> cls.remote(harness.FlatModelFactory(harness.MIB, 4))  # doctest: +SKIP
    """

    def __init__(self, factory: harness.FlatModelFactory) -> None:
        self.model = factory()

    def ready(self) -> bool:
        """True once the actor is up (and registered with the hub)."""
        return True


def measure(
    kind: str, size_mib: int, n: int, *, tensors: int = 16, repeats: int = 5, timeout: float = 300.0
) -> dict[str, Any]:
    """One row: ``repeats`` timed ``push(wait=True)`` to N receivers of one kind (see :data:`KINDS`).

    Example:
        >>> measure("pipe", 16, 8, repeats=2)["fetched_mib_per_version"]  # doctest: +SKIP
        16.0
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    factory = harness.FlatModelFactory(size_mib * MIB, tensors, fill=0.0, name="t{i:02d}")
    name = f"bench-adapters-{uuid.uuid4().hex[:6]}"
    hub = raysync.connect(name)
    handles: list[Any] = []
    try:
        if kind == "actors":
            cls = ray.remote(num_cpus=0)(raysync.synced_model("model", hub=name)(Holder))
            handles = [cls.remote(factory) for _ in range(n)]
            ray.get([h.ready.remote() for h in handles], timeout=timeout)
        else:
            handles = [
                raysync.adapters.start(
                    kind,  # type: ignore[arg-type]
                    receive_loop,
                    model_factory=factory,
                    num_receivers=n,
                    hub=name,
                    timeout=timeout,
                    num_cpus=0,
                    model_id="policy",
                )
            ]
            ray.get([h._raysync_ping.remote() for h in handles], timeout=timeout)
        trainer = factory()
        times = []
        for i in range(repeats + 1):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.fill_(float(i + 1))
            t0 = time.perf_counter()
            hub.push(trainer, "policy", wait=True, timeout=timeout)
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
        harness.kill_all([*handles, hub.actor])


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """The adapter rows as a table on stdout.

    Example:
        >>> print_table([{"kind": "pipe", "size_mib": 16, "receivers": 8, "subs": 1, "applied_s": 0.2,
        ...               "fetched_mib_per_version": 16.0}])
                kind   MiB   N subs applied_s fetched_MiB/v
                pipe    16   8    1     0.200          16.0
    """
    print(f"{'kind':>12} {'MiB':>5} {'N':>3} {'subs':>4} {'applied_s':>9} {'fetched_MiB/v':>13}")
    for r in rows:
        print(
            f"{r['kind']:>12} {r['size_mib']:>5} {r['receivers']:>3} {r['subs']:>4} "
            f"{r['applied_s']:>9.3f} {r['fetched_mib_per_version']:>13.1f}"
        )


def parse_args(
    argv: Sequence[str] | None = None, *, results_dir: str | os.PathLike[str] | None = None
) -> argparse.Namespace:
    """The scenario's options; ``--quick`` is 16 MiB and 2 repeats.

    Example:
        >>> parse_args(["--quick"]).sizes_mib
        [16]
    """
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    harness.add_options(p, sizes_mib=[64, 256])
    p.add_argument("--receivers", type=int, default=8, help="receivers N (default: 8)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    harness.add_options(
        p, tensors=16, repeats=5, timeout=300.0, json=harness.results_path("adapters.json", results_dir)
    )
    p.add_argument("--quick", action="store_true", help="16 MiB, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes_mib, args.repeats = [16], 2
    return args


def main(argv: Sequence[str] | None = None, *, results_dir: str | os.PathLike[str] | None = None) -> int:
    """Measure every kind at every size on a local cluster of its own; print the table, write JSON.

    Example:
        >>> main(["--quick", "--kinds", "actors", "pipe"])  # doctest: +SKIP
        0
    """
    args = parse_args(argv, results_dir=results_dir)
    t_start = time.time()
    with harness.local_cluster(num_cpus=4, object_store_bytes=max(2**30, 4 * max(args.sizes_mib) * MIB)):
        rows = [
            measure(k, s, args.receivers, tensors=args.tensors, repeats=args.repeats, timeout=args.timeout)
            for s in args.sizes_mib
            for k in args.kinds
        ]
    print_table(rows)
    meta = harness.run_meta("benchmarks/adapters.py", argv, started=t_start)
    print(f"\nJSON: {harness.write_json(args.json, {'meta': meta, 'args': args, 'rows': rows}, indent=1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

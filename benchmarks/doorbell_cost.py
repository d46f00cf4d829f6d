"""What waking N subscriber processes on one node costs: a Ray actor call each, or a shared-memory doorbell.

The relay's step "hand this version to the N subscribers on my node" done three
ways, each until every subscriber answered:

``actor_calls``
    what the relay does for versions over the doorbell's limit (and views, async
    actors): one Ray actor call per subscriber (an async
    actor per subscriber, ``num_cpus=0``), all in flight at once, then one
    ``ray.wait`` for all replies.
``raysync_doorbell``
    what relays do now for versions up to 8 MiB (``raysync.transports.doorbell``):
    N plain processes, each with raysync's ``Doorbell`` (a Unix datagram socket
    and a thread); per round the ringer writes a 4 KiB version into a new
    shared-memory segment, rings every process and waits for every ack datagram
    on an event loop (``Ringer``). The subscribers' handlers answer at once.
``doorbell``
    N plain processes, each blocked on its own POSIX semaphore in shared memory;
    the ringer writes the version into shared memory, posts each semaphore,
    and waits for N posts of an ack semaphore (each waiter writes the version
    it saw into its slot first). No Ray on the path: the floor of a node-local
    wake-up, not a complete delivery.

Medians over ``--rounds``, wall time and the ringer's CPU time per round.

Run::

    python benchmarks/doorbell_cost.py --subscribers 10 100 250
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import ray


def _waiter(index: int, bell: Any, acks: Any, slots: Any, version: Any) -> None:
    while True:
        bell.acquire()
        v = version.value
        if v < 0:
            return
        slots[index] = v  # "applied"
        acks.release()


def doorbell(n: int, rounds: int) -> dict[str, float]:
    ctx = mp.get_context("fork")
    bells, acks = [ctx.Semaphore(0) for _ in range(n)], ctx.Semaphore(0)
    slots = ctx.Array("q", n, lock=False)
    version = ctx.Value("q", 0, lock=False)
    procs = [
        ctx.Process(target=_waiter, args=(i, bells[i], acks, slots, version), daemon=True) for i in range(n)
    ]
    for p in procs:
        p.start()
    walls, cpus = [], []
    for r in range(1, rounds + 1):
        c0, t0 = time.process_time(), time.perf_counter()
        version.value = r
        for bell in bells:
            bell.release()
        for _ in range(n):
            acks.acquire()
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
        assert all(s == r for s in slots)
    version.value = -1
    for bell in bells:
        bell.release()
    for p in procs:
        p.join(5)
    return {"wall_ms": statistics.median(walls), "ringer_cpu_ms": statistics.median(cpus)}


def _bell_waiter(conn: Any) -> None:
    from raysync._protocol import ApplyReport
    from raysync.transports.doorbell import Doorbell

    bell = Doorbell()
    bell.register("s", lambda ring, segment: ApplyReport(applied=ring.version, apply_s=0.0))
    conn.send((bell.address, bell.key))
    time.sleep(3600)  # the doorbell's thread answers; the parent ends this process


def raysync_doorbell(n: int, rounds: int) -> dict[str, float]:
    import asyncio

    import numpy as np
    import torch

    from raysync.core.layout import plan_layout
    from raysync.transports.doorbell import Ringer, SegmentWriter

    ctx = mp.get_context("fork")
    procs, addresses = [], []
    for _ in range(n):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_bell_waiter, args=(theirs,), daemon=True)
        proc.start()
        procs.append(proc)
        addresses.append(ours.recv())
    version = [[np.zeros(4096, dtype=np.uint8)]]
    manifest = plan_layout({"w": torch.zeros(4096, dtype=torch.uint8)})

    async def run() -> dict[str, float]:
        ringer, writer = Ringer(), SegmentWriter()
        walls, cpus = [], []
        for r in range(1, rounds + 1):
            c0, t0 = time.process_time(), time.perf_counter()
            segment = writer.write("policy", r, manifest, ["x"], version)
            tokens = [t for a, key in addresses for t in ringer.ring(a, key, "policy", r, segment, ["s"])]
            segment.close()
            acks, missing = await ringer.wait(tokens, timeout=30)
            walls.append((time.perf_counter() - t0) * 1e3)
            cpus.append((time.process_time() - c0) * 1e3)
            assert not missing and all(a.report is not None and a.report.applied == r for a in acks)
        ringer.close()
        return {"wall_ms": statistics.median(walls), "ringer_cpu_ms": statistics.median(cpus)}

    try:
        return asyncio.run(run())
    finally:
        for proc in procs:
            proc.kill()


@ray.remote(num_cpus=0)
class _Sub:
    async def notify(self, v: int) -> int:
        return v


def actor_calls(n: int, rounds: int) -> dict[str, float]:
    subs = [_Sub.remote() for _ in range(n)]  # type: ignore[attr-defined]
    ray.get([s.notify.remote(0) for s in subs])
    walls, cpus = [], []
    for r in range(1, rounds + 1):
        c0, t0 = time.process_time(), time.perf_counter()
        refs = [s.notify.remote(r) for s in subs]
        ray.wait(refs, num_returns=len(refs))
        assert ray.get(refs) == [r] * n
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
    for s in subs:
        ray.kill(s)
    return {"wall_ms": statistics.median(walls), "ringer_cpu_ms": statistics.median(cpus)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--subscribers", type=int, nargs="+", default=[10, 100, 250])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    rows = []
    for n in args.subscribers:  # before Ray starts: forked waiters must not inherit its threads
        rows.append({"subscribers": n, "way": "doorbell", **doorbell(n, args.rounds)})
        print(json.dumps(rows[-1]), flush=True)
        rows.append({"subscribers": n, "way": "raysync_doorbell", **raysync_doorbell(n, args.rounds)})
        print(json.dumps(rows[-1]), flush=True)
    ray.init(num_cpus=2, object_store_memory=128 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        for n in args.subscribers:
            rows.append({"subscribers": n, "way": "actor_calls", **actor_calls(n, args.rounds)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    rows.sort(key=lambda r: (r["subscribers"], r["way"]))
    print("| subscribers | way | wall ms | ringer CPU ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['subscribers']} | {r['way']} | {r['wall_ms']:.2f} | {r['ringer_cpu_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

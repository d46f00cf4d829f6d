"""What a driver's push pays for the lease check of a job's writers, interleaved with and without it.

A job's driver and tasks share one writer lease; each push of one reads the lease's epoch
from the GCS (:class:`raysync.client.writer_lease.LeaseMoved`, in a thread, overlapping the
snapshot) so that it never hands out a number from a block another process of the job took
over. This measures the trainer's block in ``hub.push`` (256 KiB in 8 tensors to 8
``@synced_model`` actors, push then wait) in alternating stretches of ``--stretch`` pushes:

check (as shipped)
    the epoch read in a thread beside the snapshot, waited for before stamping;
no check
    the read skipped: what a push costs without the guarantee (not a mode raysync offers);
inline
    the read made on the trainer's thread, right before stamping, with no thread.

Run::

    python benchmarks/lease_check_cost.py
    python benchmarks/lease_check_cost.py --pushes 600 --actors 8 --size-kib 256

Example:
    >>> rows = measure(256 * 1024, actors=8, pushes=300, stretch=20)  # doctest: +SKIP
    >>> rows["check"] > rows["no check"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

import _harness as harness
import raysync
from _fanout import receiver_class
from raysync.client.writer_lease import LeaseMoved, WriterLease
from raysync.hub.persistence import lease_epoch

__all__ = ["main", "measure"]


def _inline(self: LeaseMoved, model_id: str, lease: WriterLease) -> None:
    epoch = lease_epoch(self._hub, model_id) if lease.epoch is not None else None
    if epoch is not None and lease.epoch is not None and epoch > lease.epoch:
        lease.lose()


def _modes() -> dict[str, tuple[Callable[..., None], Callable[..., None]]]:
    """Each mode's (ask, take_back_if_moved)."""
    ask, take = LeaseMoved.ask, LeaseMoved.take_back_if_moved

    def skip(*_: Any) -> None:
        return None

    return {"check": (ask, take), "no check": (skip, take), "inline": (skip, _inline)}


def measure(size: int, *, actors: int, pushes: int, stretch: int, warmup: int = 40) -> dict[str, float]:
    """Median ms ``hub.push`` blocks, per mode, the modes alternating every ``stretch`` pushes."""
    sd = harness.make_state_dict(size, 8)
    hub_name = f"bench-lease-{uuid.uuid4().hex[:8]}"
    hub = raysync.connect(hub_name)
    receivers = [
        receiver_class("copy", hub_name).remote(harness.model_bytes(sd), len(sd)) for _ in range(actors)
    ]
    modes = _modes()
    names = list(modes)
    blocked: dict[str, list[float]] = {name: [] for name in names}
    first = next(iter(sd.values()))
    try:
        ray.get([r.ready.remote() for r in receivers])
        for i in range(warmup + pushes):
            name = names[(i // stretch) % len(names)]
            LeaseMoved.ask, LeaseMoved.take_back_if_moved = modes[name]  # type: ignore[method-assign]
            first[0] = float(i)
            t0 = time.perf_counter()
            version = hub.push(sd)
            t1 = time.perf_counter()
            hub.wait(version, timeout=120)
            if i >= warmup:
                blocked[name].append(t1 - t0)
    finally:
        LeaseMoved.ask, LeaseMoved.take_back_if_moved = modes["check"]  # type: ignore[method-assign]
        harness.kill_all([*receivers, hub.actor])
    return {name: statistics.median(v) * 1e3 for name, v in blocked.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-kib", type=int, default=256)
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--pushes", type=int, default=600)
    parser.add_argument("--stretch", type=int, default=20)
    args = parser.parse_args()
    with harness.local_cluster(num_cpus=args.actors + 4, object_store_bytes=2**30):
        rows = measure(args.size_kib * 1024, actors=args.actors, pushes=args.pushes, stretch=args.stretch)
    for name, ms in rows.items():
        print(f"{name:>9}: trainer blocked in push, median {ms:.3f} ms")


if __name__ == "__main__":
    main()

"""Sharded trainers: 1, 2 and 4 writers pushing one model to N ``@synced_model`` actors.

Each row is one group size W; the groups push models of their own (``w1``, ``w2``, ``w4``) to the
same N actors, interleaved (each round pushes every group once), so the rows share the machine's
moments:

- W = 1: one trainer actor pushes the whole (plain) model: the single-writer reference.
- W = 2, 4: W gloo ranks (Ray actors) hold the model as ``DTensor``\\ s (every tensor
  ``Shard(0)``) and each calls ``hub.push(model)``: each puts only its shard.

Per row: the time from the driver's call to the ranks (each first changes its shard in place, as
a training step would, then pushes) until all N actors applied it (median of ``--repeats``),
beside the single writer's, and beside Ray's floor for the same W in the same round (each rank
puts its shard as uint8 arrays with ``ray.put``, one copy, and each of the N actors gets the W
objects with ``ray.get`` and copies them into warm buffers of its own: what Ray alone takes to
move W parts to N actors, so its ratio to W = 1 is what W writers cost Ray itself), and beside
the hub floor for the same W (:class:`_floor.Mailbox`: each rank's training step and put, then
one message per rank to one async actor, which answers the N actors' waiting calls once every
part is in; they get and copy as above: the least any hub that publishes a version once every
rank's part is in pays, with no version checks, layout or lease); each rank's
blocking in ``push`` (and the snapshot part of it)
beside a memcpy of its own shard (``copy_`` into warm buffers: the floor; a ``clone()``,
fresh pages included, beside it), and each rank's peak private memory above what it held as
each push started (the most over its pushes; sampled every 2 ms during each push of the warm-up
rounds and of one more round after the timed ones, so the sampling thread is not in the timed
rounds; the object store's pages are shared, not counted).

``--keys w00``: every push after the first sends only those keys (``hub.push(model, keys=...)``).

``--late-ms``: the last rank of each group starts its push that much later than the others
(a straggler); the others' blocking then shows whether a push waits for it.

    python benchmarks/sharded_push.py --mib 256 --actors 8 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import ray
import torch

import _harness as harness
import raysync
from _floor import Mailbox


def _model(mib: int, tensors: int) -> torch.nn.Module:
    rows = mib * 2**20 // 4 // tensors // 1024
    model = torch.nn.Module()
    for i in range(tensors):
        model.register_parameter(f"w{i:02d}", torch.nn.Parameter(torch.full((rows, 1024), float(i))))
    return model


@ray.remote(num_cpus=0)
class Writer:
    """One rank (``world`` > 1: a gloo rank with DTensor weights; 1: a plain trainer)."""

    def __init__(
        self, rank: int, world: int, port: int, mib: int, tensors: int, hub: str, model_id: str
    ) -> None:
        self.rank, self.world, self.model_id = rank, world, model_id
        model = _model(mib, tensors)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            harness.join_gloo(rank, world, port)
            mesh = init_device_mesh("cpu", (world,))
            for name, p in list(model.named_parameters()):
                setattr(model, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        self.model = model
        self.hub = raysync.connect(hub)
        self.peak = 0.0  # the most private memory a push added, MiB

    def local(self) -> list[torch.Tensor]:
        return [p.to_local() if self.world > 1 else p.detach() for p in self.model.parameters()]

    def memcpy_s(self, repeats: int = 5) -> tuple[float, float]:
        """This rank's shard copied once: ``(clone, copy into warm buffers)`` in s, medians.

        ``clone()`` allocates fresh memory (its page faults included, as a first ``ray.put``
        into a fresh store pays); ``copy_`` into buffers touched before is the bare memcpy.
        """
        local = self.local()
        clones, copies = [], []
        dst = [torch.empty_like(t) for t in local]
        for d, t in zip(dst, local, strict=True):
            d.copy_(t)
        for _ in range(repeats):
            t0 = time.perf_counter()
            fresh = [t.clone() for t in local]
            clones.append(time.perf_counter() - t0)
            del fresh
            t0 = time.perf_counter()
            for d, t in zip(dst, local, strict=True):
                d.copy_(t)
            copies.append(time.perf_counter() - t0)
        return statistics.median(clones), statistics.median(copies)

    def floor_put(self) -> tuple[list[Any], float]:
        """Ray's floor of this rank's part: its tensors ``ray.put`` as uint8 arrays; ``([ref], s)``."""
        t0 = time.perf_counter()
        ref = ray.put([t.detach().numpy().view(np.uint8) for t in self.local()])
        return [ref], time.perf_counter() - t0

    def floor_push(self, mailbox: Any, round: int) -> float:
        """The hub floor's part of this rank: its training step, its shard ``ray.put`` as uint8
        arrays, one message carrying the ref to ``mailbox`` (one way); the put's seconds."""
        self.step()
        refs, put_s = self.floor_put()
        self.floor_ref = refs[0]  # held here until the next round: the mailbox only borrows it
        mailbox.post.remote(round, refs, self.world)
        return put_s

    def step(self) -> None:
        """A training step's change of this rank's shard, in place."""
        with torch.no_grad():
            for t in self.local():
                t.add_(1.0)

    def push(
        self, step: int, late_s: float = 0.0, keys: list[str] | None = None, sample: bool = False
    ) -> tuple[int, float, float]:
        """One training step and push; ``(version, blocking s, snapshot s)``. With ``sample``, a thread
        samples this rank's private memory every 2 ms meanwhile (in rounds that are not timed)."""
        time.sleep(late_s)  # a rank that comes late (its own blocking is timed from its push)
        self.step()
        done = threading.Event()
        before = _private_mib()

        def sampling() -> None:  # private (not shared) resident memory, every 2 ms, during the push
            while not done.is_set():
                self.peak = max(self.peak, _private_mib() - before)
                time.sleep(0.002)

        sampler = threading.Thread(target=sampling, daemon=True)
        if sample:
            sampler.start()
        t0 = time.perf_counter()
        version = self.hub.push(self.model, self.model_id, timeout=120, keys=keys)
        dt = time.perf_counter() - t0
        done.set()
        if sample:
            sampler.join()
        return version, dt, float(self.hub.last_push.get("snapshot_s", 0.0))

    def peak_growth_mib(self) -> float:
        """The most private memory a push added above what the rank held as it started (MiB), sampled."""
        return self.peak


def _private_mib() -> float:
    """Resident memory not shared with other processes (the object store's pages are shared)."""
    with open("/proc/self/statm") as f:
        _, resident, shared = (int(x) for x in f.read().split()[:3])
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE") / 2**20


@ray.remote(num_cpus=0)
@raysync.synced_model("w1", model_id="w1", hub="bench-sharded")
@raysync.synced_model("w2", model_id="w2", hub="bench-sharded")
@raysync.synced_model("w4", model_id="w4", hub="bench-sharded")
class Actor:
    """A receiver of all three writer groups' models (one model each, so the rows interleave)."""

    def __init__(self, mib: int, tensors: int, worlds: list[int]) -> None:
        for w in (1, 2, 4):
            setattr(self, f"w{w}", _model(mib if w in worlds else 1, tensors))

    def ready(self) -> bool:
        return True

    def follow_floor(self, mailbox: Any, round: int) -> int:
        """The hub floor at a receiver: a call waiting at ``mailbox`` for the round's refs; :meth:`take`."""
        return self.take(ray.get(mailbox.wait.remote(round)))

    def take(self, refs: list[Any]) -> int:
        """Ray's floor at a receiver: ``ray.get`` the parts (zero-copy), copy them into warm buffers."""
        arrays = [a.reshape(-1) for part in ray.get(refs) for a in part]
        total = sum(a.nbytes for a in arrays)
        floor = getattr(self, "floor", None)
        if floor is None or floor.nbytes < total:
            floor = self.floor = np.ones(total, dtype=np.uint8)  # touched: warm
        offset = 0
        for a in arrays:
            np.copyto(floor[offset : offset + a.nbytes], a)
            offset += a.nbytes
        return offset


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    hub = raysync.connect("bench-sharded")
    actors = [Actor.remote(args.mib, args.tensors, args.writers) for _ in range(args.actors)]
    ray.get([a.ready.remote() for a in actors], timeout=600)
    groups = {}
    for world in args.writers:
        port = _port()
        groups[world] = [
            Writer.remote(r, world, port, args.mib, args.tensors, "bench-sharded", f"w{world}")
            for r in range(world)
        ]
    memcpy = {w: ray.get([x.memcpy_s.remote() for x in g], timeout=600) for w, g in groups.items()}
    applied: dict[int, list[float]] = {w: [] for w in groups}
    floor: dict[int, list[float]] = {w: [] for w in groups}
    floor_put: dict[int, list[list[float]]] = {w: [] for w in groups}
    hub_floor: dict[int, list[float]] = {w: [] for w in groups}
    mailbox = ray.remote(num_cpus=0)(Mailbox).remote()
    rounds = 0
    blocking: dict[int, list[list[float]]] = {w: [] for w in groups}
    snapshot: dict[int, list[list[float]]] = {w: [] for w in groups}
    for step in range(args.warmup + args.repeats + 1):
        for world, writers in groups.items():  # interleaved: each round pushes every group once
            t0 = time.perf_counter()
            late = [args.late_ms / 1e3 if r == world - 1 and world > 1 else 0.0 for r in range(world)]
            keys = args.keys if args.keys and step >= 1 else None  # the first push is whole
            # memory is sampled in the warm-up rounds and one round after the timed ones, not timed
            sample = step < args.warmup or step == args.warmup + args.repeats
            calls = [w.push.remote(step, s, keys, sample) for w, s in zip(writers, late, strict=True)]
            pushed = ray.get(calls, timeout=600)
            hub.wait(pushed[0][0], f"w{world}", timeout=300, subscribers=args.actors)
            took = time.perf_counter() - t0
            if sample:
                continue
            t0 = time.perf_counter()  # Ray's floor for this W, right after: the same moment's machine
            puts = ray.get([w.floor_put.remote() for w in writers], timeout=600)
            refs = [ref for box, _ in puts for ref in box]
            ray.get([a.take.remote(refs) for a in actors], timeout=600)
            ray_floor = time.perf_counter() - t0
            del refs
            rounds += 1  # the hub floor: the receivers' calls wait at the mailbox before the clock starts
            waiting = [a.follow_floor.remote(mailbox, rounds) for a in actors]
            deadline = time.monotonic() + 60
            while ray.get(mailbox.waiters.remote(rounds)) < len(actors):
                if time.monotonic() > deadline:
                    raise RuntimeError("the receivers' calls did not reach the hub floor's mailbox in 60 s")
                time.sleep(0.002)
            t0 = time.perf_counter()
            ray.get([w.floor_push.remote(mailbox, rounds) for w in writers], timeout=600)
            ray.get(waiting, timeout=600)
            if step >= args.warmup:
                hub_floor[world].append(time.perf_counter() - t0)
                applied[world].append(took)
                floor[world].append(ray_floor)
                floor_put[world].append([s for _, s in puts])
                blocking[world].append([s for _, s, _ in pushed])
                snapshot[world].append([s for _, _, s in pushed])
    rows = []
    for world, writers in groups.items():
        peaks = ray.get([w.peak_growth_mib.remote() for w in writers], timeout=60)
        rows.append(
            {
                "writers": world,
                "applied_s": statistics.median(applied[world]),
                "applied_all": applied[world],
                "floor_s": statistics.median(floor[world]),
                "floor_all": floor[world],
                "hub_floor_s": statistics.median(hub_floor[world]),
                "hub_floor_all": hub_floor[world],
                "floor_put_s": [statistics.median(b[r] for b in floor_put[world]) for r in range(world)],
                "blocking_s": [statistics.median(b[r] for b in blocking[world]) for r in range(world)],
                "snapshot_s": [statistics.median(b[r] for b in snapshot[world]) for r in range(world)],
                "clone_s": [c for c, _ in memcpy[world]],
                "memcpy_s": [m for _, m in memcpy[world]],
                "shard_mib": args.mib / world,
                "peak_private_growth_mib": peaks,
            }
        )
        harness.kill_all(writers)
    harness.kill_all(actors)
    ray.kill(mailbox)
    ray.kill(hub.actor)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--writers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--late-ms", type=float, default=0.0, help="the last rank of a group comes this late")
    parser.add_argument(
        "--keys",
        type=lambda v: v.split(","),
        default=None,
        help="push only these keys (say w00) after the first push; the first 2 pushes are warm-up",
    )
    parser.add_argument("--object-store-mib", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.keys:  # the first keys= push lays the keys apart (puts everything): warm-up too
        args.warmup = max(args.warmup, 2)
    started = time.time()
    with harness.local_cluster(num_cpus=args.actors + 8, object_store_bytes=args.object_store_mib * 2**20):
        rows = run(args)
    single = next((r["applied_s"] for r in rows if r["writers"] == 1), None)
    single_floor = next((r["floor_s"] for r in rows if r["writers"] == 1), None)
    single_hub = next((r["hub_floor_s"] for r in rows if r["writers"] == 1), None)
    late = f", the last rank {args.late_ms:g} ms late" if args.late_ms else ""
    only = f", keys={','.join(args.keys)}" if args.keys else ""
    print(f"{args.mib} MiB to {args.actors} actors, median of {args.repeats}{late}{only}")
    print(
        "writers | all applied (s) | vs 1 writer | Ray's floor (s) | floor vs 1 writer's | "
        "hub floor (s) | hub floor vs 1 writer's | applied / hub floor | "
        "per-rank blocking (s) | of it snapshot (s) | Ray's put of shard (s) | memcpy of shard (s) | "
        "blocking / memcpy | "
        "clone() of shard (s) | peak +MiB"
    )
    for r in rows:
        vs = f"{r['applied_s'] / single:.2f}x" if single else "-"
        floor_vs = f"{r['floor_s'] / single_floor:.2f}x" if single_floor else "-"
        hub_vs = f"{r['hub_floor_s'] / single_hub:.2f}x" if single_hub else "-"
        of_hub = f"{r['applied_s'] / r['hub_floor_s']:.2f}x"
        block = ", ".join(f"{b:.4f}" for b in r["blocking_s"])
        snap = ", ".join(f"{b:.4f}" for b in r["snapshot_s"])
        copy = ", ".join(f"{m:.4f}" for m in r["memcpy_s"])
        put = ", ".join(f"{m:.4f}" for m in r["floor_put_s"])
        ratio = ", ".join(f"{b / m:.2f}x" for b, m in zip(r["blocking_s"], r["memcpy_s"], strict=True))
        clone = ", ".join(f"{m:.4f}" for m in r["clone_s"])
        peak = ", ".join(f"{p:.0f}" for p in r["peak_private_growth_mib"])
        print(
            f"{r['writers']:7d} | {r['applied_s']:15.3f} | {vs:>11} | {r['floor_s']:.3f} | {floor_vs} | "
            f"{r['hub_floor_s']:.3f} | {hub_vs} | {of_hub} | "
            f"{block} | {snap} | {put} | {copy} | {ratio} | "
            f"{clone} | {peak}"
        )
    harness.write_json(
        harness.results_path("sharded_push.json"),
        {"meta": harness.run_meta("benchmarks/sharded_push.py", argv, started=started), "rows": rows},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

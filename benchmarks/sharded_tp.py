"""A tensor-parallel receiver of a sharded trainer: its bytes and apply time beside a copy of them.

W gloo ranks (Ray actors, ``benchmarks/sharded_push.py``'s ``Writer``: every tensor ``Shard(0)``)
push ``--mib`` of fp32 tensors (``--world 1``: one plain trainer pushing whole tensors); one
receiver in an actor, with ``TensorParallel(rank, k, {"*": --dim})``, takes its part of every
tensor: ``--receiver loader``, a ``WeightsLoader`` under a ``Follower`` copying each part into
buffers of its own; ``--receiver module``, a module holding only its parts
(``raysync.follow(module, placement=...)``), the apply copying into its parameters. Per push
(median of ``--repeats``): the receiver's apply time (``hub.status()``'s ``last_apply_s``:
plan, fetch, copy) and the copy in the loader's callback, beside a ``copy_`` of exactly its
bytes into the same (warm) buffers; its bytes copied (exact: its parts) and read (the buckets
that hold any of them, each whole: an object-store object is one unit).

    python benchmarks/sharded_tp.py --mib 64 --dim 1
    python benchmarks/sharded_tp.py --mib 64 --dim 1 --world 1 --receiver module
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
import ray
import torch

import _harness as harness
import raysync
from raysync.core.placement import reshard
from sharded_push import Writer, _model, _port


@ray.remote(num_cpus=0)
class TPReceiver:
    """A ``WeightsLoader`` taking part ``rank`` of ``size`` of every tensor (split along ``dim``)."""

    def __init__(
        self, hub: str, model_id: str, rank: int, size: int, dim: int, mib: int, tensors: int, kind: str
    ) -> None:
        tp = raysync.TensorParallel(rank, size, {"*": dim})
        self.parts: dict[str, torch.Tensor] = {}
        for key, p in _model(mib, tensors).named_parameters():
            box = tp.box(key, tuple(p.shape))
            self.parts[key] = torch.zeros(box[1] if box is not None else p.shape)
        self.load_s: list[float] = []
        self.copied = 0

        def load(pairs: Any) -> None:
            t0 = time.perf_counter()
            copied = 0
            for key, t in pairs:
                self.parts[key].copy_(t)
                copied += t.nbytes
            self.load_s.append(time.perf_counter() - t0)
            self.copied = copied

        if kind == "module":  # a module of parts: the apply copies straight into its parameters
            self.module = torch.nn.Module()
            for key, t in self.parts.items():
                self.module.register_buffer(key, t)
            self.follower = raysync.follow(self.module, model_id, hub=hub, placement=tp)
            self.copied = sum(t.nbytes for t in self.parts.values())
        else:
            self.loader = raysync.WeightsLoader(load, placement=tp)
            self.follower = raysync.Follower(target=self.loader, model_id=model_id, hub=hub).start()

    def floor_s(self, repeats: int = 5) -> float:
        """A ``copy_`` of exactly this receiver's bytes into its (warm) buffers, median."""
        sources = {k: torch.randn(t.shape) for k, t in self.parts.items()}
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for k, t in self.parts.items():
                t.copy_(sources[k])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def store_floor_s(self, repeats: int = 5) -> float:
        """Ray's floor under the apply: ``ray.get`` of exactly this receiver's bytes, put fresh in
        the object store (one object per part, as uint8), and a ``copy_`` of them into its
        buffers, median. What a receiver must do at least, reading its parts from the store."""
        times = []
        for _ in range(repeats):
            fresh = [torch.randn(t.shape).numpy().view(np.uint8).reshape(-1) for t in self.parts.values()]
            refs = [ray.put(a) for a in fresh]
            t0 = time.perf_counter()
            arrays = ray.get(refs)
            for t, a in zip(self.parts.values(), arrays, strict=True):
                t.view(-1).view(torch.uint8).copy_(torch.from_numpy(a))
            times.append(time.perf_counter() - t0)
            del arrays, refs
        return statistics.median(times)

    def stats(self) -> tuple[int | None, list[float], int, int]:
        owned = sum(t.nbytes for t in self.parts.values())
        return self.follower.version, list(self.load_s), self.copied, owned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--world", type=int, default=2, help="trainer ranks")
    parser.add_argument("--k", type=int, default=2, help="tensor-parallel size of the receiver")
    parser.add_argument("--dim", type=int, default=1, help="the receiver's split dimension (trainer: 0)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--receiver", choices=("loader", "module"), default="loader")
    args = parser.parse_args(argv)
    started = time.time()
    model_id = "tp"
    with harness.local_cluster(num_cpus=args.world + 4, object_store_bytes=2048 * 2**20):
        hub = raysync.connect("bench-tp")
        port = _port()
        writers = [
            Writer.remote(r, args.world, port, args.mib, args.tensors, "bench-tp", model_id)
            for r in range(args.world)
        ]
        receiver = TPReceiver.remote(
            "bench-tp", model_id, 0, args.k, args.dim, args.mib, args.tensors, args.receiver
        )
        tp = raysync.TensorParallel(0, args.k, {"*": args.dim})
        ray.get(receiver.stats.remote(), timeout=300)
        apply_s, fetched = [], []
        for step in range(args.repeats + 1):
            pushed = ray.get([w.push.remote(step) for w in writers], timeout=300)
            hub.wait(pushed[0][0], model_id, timeout=120, subscribers=1)
            (row,) = [s for s in hub.status()["subscribers"] if s.get("model_id") == model_id]
            if step:
                apply_s.append(row["last_apply_s"])
                fetched.append(row["last_bytes_fetched"])
        # what it reads: the trainer ranks' buckets holding any of its parts, each whole
        view = reshard(ray.get(hub.actor.get.remote(model_id), timeout=60).manifest, tp)
        assert view.shards is not None
        wanted = view.shards.buckets_of([e.key for e in view.entries])
        rank_bytes = sum(view.shards.bucket_nbytes[b] for b in wanted)
        n_rank_buckets = len(view.shards.bucket_nbytes)
        floor = ray.get(receiver.floor_s.remote(), timeout=120)
        store_floor = ray.get(receiver.store_floor_s.remote(), timeout=120)
        _, load_s, copied, owned = ray.get(receiver.stats.remote(), timeout=60)
        harness.kill_all([*writers, receiver])
        ray.kill(hub.actor)
    result = {
        "mib": args.mib,
        "world": args.world,
        "k": args.k,
        "dim": args.dim,
        "receiver": args.receiver,
        "bytes_owned": owned,
        "bytes_copied": copied,
        "bytes_read": rank_bytes,
        "bytes_fetched_reported": statistics.median(fetched),
        "apply_s": statistics.median(apply_s),
        "load_s": statistics.median(load_s[1:]) if load_s else None,
        "copy_floor_s": floor,
        "store_floor_s": store_floor,
    }
    trainer = f"{args.world} trainer ranks (Shard(0))" if args.world > 1 else "one writer (whole tensors)"
    its_copy = f" (its copy {result['load_s'] * 1e3:.1f} ms)" if result["load_s"] is not None else ""
    print(
        f"{args.mib} MiB from {trainer}, {args.receiver} receiver TP rank 0 of {args.k} "
        f"(Shard({args.dim})): owns {owned / 2**20:.1f} MiB, copied {copied / 2**20:.1f} MiB, reads "
        f"{rank_bytes / 2**20:.1f} MiB of buckets ({len(wanted)} of {n_rank_buckets}); "
        f"apply {result['apply_s'] * 1e3:.1f} ms{its_copy} beside a copy of its bytes {floor * 1e3:.1f} ms: "
        f"{result['apply_s'] / floor:.2f}x; ray.get of its bytes put fresh + copy {store_floor * 1e3:.1f} "
        f"ms: "
        f"{result['apply_s'] / store_floor:.2f}x"
    )
    harness.write_json(
        harness.results_path("sharded_tp.json"),
        {"meta": harness.run_meta("benchmarks/sharded_tp.py", argv, started=started), "result": result},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

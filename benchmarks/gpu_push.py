"""Push from a module on a GPU to receivers whose modules are on the same GPU, beside the floors.

For a lent GPU machine (``../shared/gpu/README.md``); ``--device cpu`` runs the same scenario on
CPU, to check the script without a GPU. One run measures, per size:

- **raysync**, per transport (``object_store``, ``nixl``) and receiver count N (all on the one
  GPU): the trainer's blocking time (``hub.push`` returning) and push-to-all-applied
  (``hub.wait``), medians over ``--repeats``. Each configuration checks, once, that every
  receiver holds the trainer's weights (a per-tensor sum in float64) at the version it reports.
- **the floors, in the same run**: a device-to-device copy of one contiguous buffer (what
  ANCHORS.md's same-device target is measured against); a pinned device-to-host copy plus a
  host-to-device copy (the least a path staged through host memory pays); and Ray alone
  moving the same bytes through its object store (``.cpu()``, ``ray.put`` of uint8 views, each
  of N actors ``ray.get`` and copies to its GPU).

Run::

    python benchmarks/gpu_push.py                       # 256 MiB and 2 GiB, N = 1 4
    python benchmarks/gpu_push.py --sizes-mib 64 --actors 1 --repeats 2 --device cpu   # a check

Results: a table on stdout and JSON in ``--json`` (default ``benchmarks/results/gpu_push.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

import _harness as harness
import raysync

MIB = harness.MIB
RESULTS = Path(__file__).resolve().parent / "results"


def flat_bf16(total_bytes: int, tensors: int, device: str, fill: float) -> torch.nn.Module:
    """A model of ``tensors`` equal bf16 parameters of ``total_bytes`` in all, on ``device``."""
    net = torch.nn.Module()
    numel = max(1, total_bytes // 2 // tensors)
    for i in range(tensors):
        data = torch.full((numel,), fill, dtype=torch.bfloat16, device=device)
        net.register_parameter(f"w{i:02d}", torch.nn.Parameter(data, requires_grad=False))
    return net


def fingerprint(net: torch.nn.Module) -> list[float]:
    """Each parameter's sum in float64 (equal weights, equal fingerprints)."""
    return [float(p.detach().double().sum()) for p in net.parameters()]


class GpuReceiver:
    """A receiver whose ``policy`` lives on ``device`` (decorated per run with ``synced_model``)."""

    def __init__(self, total_bytes: int, tensors: int, device: str) -> None:
        self.policy = flat_bf16(total_bytes, tensors, device, 0.0)

    def probe(self) -> tuple[int | None, list[float], str]:
        return self.raysync_version(), fingerprint(self.policy), str(next(self.policy.parameters()).device)  # type: ignore[attr-defined]


class RayOnlyReceiver:
    """Ray alone: ``ray.get`` a version's uint8 views and copy them into a buffer on ``device``."""

    def __init__(self, total_bytes: int, device: str) -> None:
        self.device = device
        self.dst = torch.empty(total_bytes, dtype=torch.uint8, device=device)

    def take(self, refs: list[Any]) -> float:
        t0 = time.perf_counter()
        parts = ray.get(refs[0])
        offset = 0
        for part in parts:
            n = part.nbytes
            self.dst[offset : offset + n].copy_(torch.from_numpy(part), non_blocking=False)
            offset += n
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def floors(total_bytes: int, device: str, repeats: int) -> dict[str, float | None]:
    """A D2D copy of one buffer, and a pinned D2H plus an H2D copy, medians in seconds."""
    src = torch.ones(total_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    host = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=device == "cuda")

    def run(fn: Any) -> float:
        fn()
        _sync(device)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    d2d = run(lambda: dst.copy_(src))
    staged = run(lambda: (host.copy_(src), dst.copy_(host)))
    return {"d2d_copy_s": d2d, "pinned_d2h_h2d_s": staged}


def ray_only(total_bytes: int, n: int, device: str, repeats: int, share: float) -> float:
    """Ray alone: the trainer's ``.cpu()`` and ``ray.put``, then N actors take it onto their GPU."""
    src = torch.ones(total_bytes, dtype=torch.uint8, device=device)
    actors = [
        ray.remote(num_cpus=0, num_gpus=share)(RayOnlyReceiver).remote(total_bytes, device) for _ in range(n)
    ]
    ray.get([a.take.remote([ray.put([np.zeros(1, np.uint8)])]) for a in actors])  # up, warm
    samples = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        host = src.cpu().numpy()
        chunk = max(1, total_bytes // 64)
        ref = ray.put([host[i : i + chunk] for i in range(0, total_bytes, chunk)])
        ray.get([a.take.remote([ref]) for a in actors])
        samples.append(time.perf_counter() - t0)
        del ref
    harness.kill_all(actors)
    return statistics.median(samples[1:])


def raysync_rows(
    args: argparse.Namespace, total_bytes: int, n: int, transport: str, share: float
) -> dict[str, Any]:
    hub_name = f"gpu-bench-{uuid.uuid4().hex[:6]}"
    hub = raysync.connect(hub_name, transport=transport)  # type: ignore[arg-type]
    cls = ray.remote(num_cpus=0, num_gpus=share)(raysync.synced_model("policy", hub=hub_name)(GpuReceiver))
    actors = [cls.remote(total_bytes, args.tensors, args.device) for _ in range(n)]
    trainer = flat_bf16(total_bytes, args.tensors, args.device, 1.0)
    blocked, applied = [], []
    try:
        ray.get([a.probe.remote() for a in actors], timeout=args.timeout)
        for k in range(args.warmup + args.repeats):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1.0)
            _sync(args.device)
            t0 = time.perf_counter()
            version = hub.push(trainer, timeout=args.timeout)
            t1 = time.perf_counter()
            hub.wait(version, timeout=args.timeout)
            t2 = time.perf_counter()
            if k >= args.warmup:
                blocked.append(t1 - t0)
                applied.append(t2 - t0)
        want = fingerprint(trainer)
        checks = ray.get([a.probe.remote() for a in actors], timeout=args.timeout)
        ok = all(v == version and fp == want and dev.startswith(args.device) for v, fp, dev in checks)
        wrong = [
            {
                "receiver": i,
                "version": v,
                "want": version,
                "device": dev,
                "tensors_off": sum(a != b for a, b in zip(fp, want, strict=True)),
            }
            for i, (v, fp, dev) in enumerate(checks)
            if not (v == version and fp == want)
        ]
        return {
            "transport": transport,
            "n": n,
            "blocked_s": statistics.median(blocked),
            "applied_s": statistics.median(applied),
            "weights_ok": ok,
            "wrong": wrong,
            "error": None,
        }
    except Exception as err:  # a transport that fails on GPU memory is a result too
        where = "".join(traceback.format_exception(err)[-6:])
        return {"transport": transport, "n": n, "error": f"{type(err).__name__}: {err}", "traceback": where}
    finally:
        harness.kill_all(actors)
        harness.kill_all([hub.actor])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_options(
        parser,
        sizes_mib=[256, 2048],
        actors=[1, 4],
        repeats=3,
        warmup=1,
        tensors=64,
        timeout=300.0,
        object_store_mib=12 * 1024,
        json=harness.results_path("gpu_push.json", RESULTS),
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--transports", nargs="+", default=["object_store", "nixl"])
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_push: no CUDA GPU here (use --device cpu to check the script)", file=sys.stderr)
        return 2
    started = time.time()
    rows: list[dict[str, Any]] = []
    with harness.local_cluster(
        num_cpus=max(4, max(args.actors) + 2), object_store_bytes=args.object_store_mib * MIB
    ):
        for size in args.sizes_mib:
            total = size * MIB
            base = floors(total, args.device, args.repeats + 2)
            for n in args.actors:
                share = round(1.0 / (n + 1), 3) if args.device == "cuda" else 0.0
                ray_s = ray_only(total, n, args.device, args.repeats, share)
                for transport in args.transports:
                    row = raysync_rows(args, total, n, transport, share)
                    row.update(size_mib=size, ray_object_store_s=ray_s, **base)
                    rows.append(row)
                    print(_line(row), flush=True)
    meta = harness.run_meta("benchmarks/gpu_push.py", argv, started=started, device=args.device)
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(0)
    harness.write_json(args.json, {"meta": meta, "rows": rows})
    return 0


def _line(row: dict[str, Any]) -> str:
    head = f"{row['size_mib']:>5} MiB N={row['n']} {row['transport']:<12}"
    floor = (
        f"d2d {row['d2d_copy_s'] * 1e3:.2f} ms, pinned d2h+h2d {row['pinned_d2h_h2d_s'] * 1e3:.1f} ms, "
        f"Ray object store {row['ray_object_store_s'] * 1e3:.1f} ms"
    )
    if row.get("error"):
        return f"{head} FAILED {row['error']} | {floor}"
    gbps = row["size_mib"] * MIB / row["applied_s"] / 1e9
    return (
        f"{head} blocked {row['blocked_s'] * 1e3:.1f} ms, applied {row['applied_s'] * 1e3:.1f} ms "
        f"({gbps:.1f} GB/s), weights {'ok' if row['weights_ok'] else 'WRONG'} | {floor}"
    )


if __name__ == "__main__":
    sys.exit(main())

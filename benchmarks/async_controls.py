"""Bytes moved and rollout pause per version for raysync's async-RL push controls.

For one model (default 256 MiB of fp32 "base" in 16 tensors plus two small
LoRA-style adapters) and one follower actor, each scenario pushes ``--versions``
versions and reports medians of:

- ``bytes_put``: bytes the trainer wrote into the object store for the version
  (``HubClient.last_push``);
- ``bytes_fetched``: bytes the follower copied in (``hub.status()``);
- ``pause_ms``: how long the follower's user methods were held back while the
  version was applied (time under the apply's write lock); this is the
  rollout pause;
- ``push_to_applied_ms``: from ``push()`` to the follower holding the version.

Scenarios:

- ``full``: the whole model every version;
- ``partial``: ``push(keys=["lora_*"])`` (adapters only, after one full push);
- ``cast``: ``push(dtype=torch.bfloat16)`` to a bf16 follower;
- ``delta``: ``push(delta=True)`` while one base tensor in eight changes;
- ``prefetch-off`` / ``prefetch-on``: full pushes while the follower is busy in
  rollout calls; with ``prefetch=True`` it copies the next version in the
  background and swaps at the next call.

Run::

    python benchmarks/async_controls.py                  # 256 MiB, 5 versions
    python benchmarks/async_controls.py --size-mib 32 --versions 3   # quick
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch

import _harness as harness
import raysync
from _harness import MIB as MiB

logger = logging.getLogger("async_controls")
TENSORS = 16
RESULTS = Path(__file__).resolve().parent / "results"


class Policy(torch.nn.Module):
    """``TENSORS`` base matrices plus two adapters (``lora_a``, ``lora_b``)."""

    def __init__(self, size_mib: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        per = size_mib * MiB // TENSORS // 4
        rows = 1024
        for i in range(TENSORS):
            self.register_parameter(f"base{i:02d}", torch.nn.Parameter(torch.zeros(rows, per // rows)))
        self.lora_a = torch.nn.Parameter(torch.zeros(16, rows))
        self.lora_b = torch.nn.Parameter(torch.zeros(rows, 16))
        self.to(dtype)


def make_follower(size_mib: int, dtype: torch.dtype, prefetch: bool, hub_name: str) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name, prefetch=prefetch)
    class Follower:
        def __init__(self) -> None:
            self.policy = Policy(size_mib, dtype)

        def rollout(self, seconds: float) -> int | None:
            time.sleep(seconds)  # stands in for stepping an environment with self.policy
            return self.raysync_version()

    return Follower


def _row(hub: raysync.HubClient) -> dict[str, Any]:
    (row,) = hub.status()["subscribers"]
    return row


def _wait_applied(hub: raysync.HubClient, version: int, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = _row(hub)
        if (row["applied"] or 0) >= version:
            return row
        time.sleep(0.002)
    raise TimeoutError(f"follower did not apply version {version} in {timeout} s")


def run_scenario(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Push ``args.versions`` versions in one scenario; return the medians."""
    hub_name = f"bench-{name}-{os.getpid()}"
    hub = raysync.connect(hub_name, keep=2)
    dtype = torch.bfloat16 if name == "cast" else torch.float32
    prefetch = name == "prefetch-on"
    follower = make_follower(args.size_mib, dtype, prefetch, hub_name).remote()
    ray.get(follower.rollout.remote(0))
    trainer = Policy(args.size_mib)
    opts: dict[str, Any] = {"bucket_bytes": args.bucket_mib * MiB}
    if name == "cast":
        opts["dtype"] = torch.bfloat16
    if name == "delta":
        opts["delta"] = True
    # First version: binds the follower's layout (and fills delta / partial's base).
    first = hub.push(trainer, **opts)
    _wait_applied(hub, first)
    if name == "partial":
        hub.push(trainer, keys=["lora_*"], **opts)  # re-lays out the adapters apart, once
        _wait_applied(hub, first + 1)
        opts["keys"] = ["lora_*"]
    samples: dict[str, list[float]] = {k: [] for k in ("bytes_put", "bytes_fetched", "pause_ms", "e2e_ms")}
    stop = threading.Event()
    busy = name.startswith("prefetch")

    def rollouts() -> None:  # a collector that is always in the middle of a rollout
        while not stop.is_set():
            ray.get(follower.rollout.remote(0.05))

    loop = threading.Thread(target=rollouts, daemon=True)
    if busy:
        loop.start()
    try:
        for i in range(args.versions):
            with torch.no_grad():
                if name == "delta":
                    getattr(trainer, f"base{i % TENSORS:02d}").add_(1.0)
                else:
                    for p in trainer.parameters():
                        p.add_(1.0)
            t0 = time.perf_counter()
            version = hub.push(trainer, **opts)
            row = _wait_applied(hub, version)
            samples["e2e_ms"].append((time.perf_counter() - t0) * 1e3)
            samples["bytes_put"].append(hub.last_push["bytes_put"])
            samples["bytes_fetched"].append(row["last_bytes_fetched"] or 0)
            samples["pause_ms"].append((row["last_pause_s"] or 0.0) * 1e3)
            if busy:
                time.sleep(0.2)  # let rollouts run between versions
    finally:
        stop.set()
        if busy:
            loop.join()
        ray.kill(follower)
        ray.kill(hub.actor)
    result = {"scenario": name, **{k: statistics.median(v) for k, v in samples.items()}}
    result["samples"] = samples
    logger.info("%s: %s", name, {k: v for k, v in result.items() if k != "samples"})
    return result


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="base model size")
    parser.add_argument("--versions", type=int, default=5, help="versions pushed per scenario")
    parser.add_argument("--bucket-mib", type=int, default=None, help="bucket size (default: model / 8)")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=["full", "partial", "cast", "delta", "prefetch-off", "prefetch-on"],
    )
    harness.add_options(parser, json=RESULTS / "async_controls.json")
    args = parser.parse_args(argv)
    t_start = time.time()
    args.bucket_mib = args.bucket_mib or max(1, args.size_mib // 8)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with harness.local_cluster(num_cpus=4, object_store_bytes=max(1024, 6 * args.size_mib) * MiB):
        rows = [run_scenario(name, args) for name in args.scenarios]
    print(
        f"\nmodel {args.size_mib} MiB fp32 + adapters, buckets {args.bucket_mib} MiB, "
        f"{args.versions} versions per scenario, medians"
    )
    print(f"{'scenario':>13} {'MiB put':>9} {'MiB fetched':>12} {'pause ms':>9} {'push->applied ms':>17}")
    for r in rows:
        print(
            f"{r['scenario']:>13} {r['bytes_put'] / MiB:>9.2f} {r['bytes_fetched'] / MiB:>12.2f} "
            f"{r['pause_ms']:>9.2f} {r['e2e_ms']:>17.1f}"
        )
    meta = harness.run_meta("benchmarks/async_controls.py", argv, started=t_start)
    print(f"\nJSON: {harness.write_json(args.json, {'meta': meta, 'config': args, 'rows': rows}, indent=1)}")
    return rows


if __name__ == "__main__":
    main()

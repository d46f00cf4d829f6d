"""raysync adapters: receivers that are not Ray actors, fed from their placement-group bundle.

A two-bundle placement group stands in for an inference engine's placement:

- bundle 0: a ``PipeAdapter`` feeding 2 worker processes (a collector's
  subprocesses) through pipes and one shared-memory copy per version;
- bundle 1: a ``DistributedAdapter``, rank 0 of a gloo group whose 2 other
  ranks are the receivers (tensor-parallel ranks), one broadcast per bucket.

The hub sees two subscribers; each adapter fetches every version from the
object store once and fans it out. The trainer pushes a few versions; then we
print what each receiver applied, as ``hub.status()`` reports it, and a
checksum each worker computed of its own weights.

Run it on an embedded local Ray::

    python examples/placement_groups.py

or submit it unchanged to a running cluster::

    ray job submit --working-dir . -- python examples/placement_groups.py
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import ray
import torch

import raysync
import raysync.adapters

OBS, ACT = 16, 4


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(OBS, 64), torch.nn.Tanh(), torch.nn.Linear(64, ACT))


def checksum(module: torch.nn.Module) -> float:
    return float(sum(p.double().sum() for p in module.state_dict().values()))


def worker_loop(receiver: Any, label: str) -> None:
    """Each receiver process: act with the weights it holds, take a new version when one arrives."""
    policy = receiver.model
    while True:
        if receiver.receive(timeout=0.05):  # applies a whole version, in order, or nothing
            print(
                f"[{label} pid {os.getpid()}] applied version #{receiver.version_count}, "
                f"checksum {checksum(policy):.6f}",
                flush=True,
            )
        with torch.no_grad():
            policy(torch.randn(8, OBS))  # stands in for a rollout or a forward pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=3, help="versions to push")
    parser.add_argument("--receivers", type=int, default=2, help="receivers behind each adapter")
    args = parser.parse_args()

    ray.init()  # a local Ray, or the cluster when run with `ray job submit`
    hub = raysync.connect("placement-groups-example")
    pg = ray.util.placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    common: dict[str, Any] = {
        "model_factory": make_policy,
        "num_receivers": args.receivers,
        "hub": "placement-groups-example",
        "timeout": 60.0,
    }
    pipe = raysync.adapters.for_placement_group(
        pg, "pipe", fn=worker_loop, args=("pipe",), bundles=[0], **common
    )
    dist = raysync.adapters.for_placement_group(
        pg, "distributed", fn=worker_loop, args=("gloo",), bundles=[1], **common
    )
    for handle in pipe + dist:
        where = ray.get(handle.placement.remote())
        print(
            f"{ray.get(handle.stats.remote())['name']}: node {where['node_id'][:8]}, "
            f"placement group {where['placement_group_id'][:8]}, bundle {where['bundle_index']}"
        )

    torch.manual_seed(0)
    policy = make_policy()
    for _ in range(args.versions):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01 * torch.randn_like(p))  # stands in for a training step
        t0 = time.perf_counter()
        version = hub.push(policy, wait=True, timeout=60)  # every receiver behind every adapter
        print(
            f"pushed version {version} (checksum {checksum(policy):.6f}); all receivers applied it "
            f"in {(time.perf_counter() - t0) * 1e3:.1f} ms"
        )

    print(f"\n{'adapter':>18} {'bundle':>6} {'fetches':>7} {'receiver':>28} {'applied':>7} {'state':>5}")
    for row in hub.status()["subscribers"]:
        stats = ray.get(
            next(h for h in pipe + dist if ray.get(h.placement.remote())["pid"] == row["pid"]).stats.remote()
        )
        for r in row["receivers"]:
            print(
                f"{row['class_name']:>18} {row['placement']['bundle_index']:>6} {stats['fetches']:>7} "
                f"{r['receiver']:>28} {r['applied']:>7} {r['state']:>5}"
            )
            assert r["applied"] == version, r
    for handle in pipe + dist:
        ray.get(handle.shutdown.remote())
    ray.util.remove_placement_group(pg)


if __name__ == "__main__":
    main()

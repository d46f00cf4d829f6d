"""What ``push(check_finite=True)`` costs: ``torch.isfinite`` over a 64 MiB state beside the push itself.

Run: ``python benchmarks/check_finite_cost.py`` (a local Ray of its own). Issue 48 asked whether the
check is cheap enough (under ~5% of a push) to be on by default; it is not (see docs/api.md, push).
"""

from __future__ import annotations

import json
import statistics
import time

import ray
import torch

import raysync


def main(repeats: int = 15) -> dict[str, float]:
    """Median milliseconds of the check alone, and of pushes without and with it."""
    ray.init(num_cpus=2, object_store_memory=800 * 2**20, include_dashboard=False)
    try:
        hub = raysync.connect("check-finite-cost")
        sd = {f"layer{i}.weight": torch.randn(2048, 512) for i in range(16)}  # 16 x 4 MiB float32
        for _ in range(3):
            hub.push(sd, wait=True, timeout=60)
        times: dict[str, list[float]] = {"check": [], "push": [], "push_checked": []}
        for _ in range(repeats):
            t0 = time.perf_counter()
            _ = [bool(torch.isfinite(t).all()) for t in sd.values()]
            times["check"].append(time.perf_counter() - t0)
            for key, checked in (("push", False), ("push_checked", True)):
                t0 = time.perf_counter()
                hub.push(sd, wait=True, timeout=60, check_finite=checked)
                times[key].append(time.perf_counter() - t0)
        return {key: statistics.median(v) * 1e3 for key, v in times.items()}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    ms = main()
    print(json.dumps({k: round(v, 2) for k, v in ms.items()}))
    print(f"the check is {ms['check'] / ms['push']:.1f}x a push(wait=True) of 64 MiB")

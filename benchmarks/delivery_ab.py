"""Push to all applied, N ``@synced_model`` actors on one node, through raysync's public API only.

Only ``raysync.connect``, ``@raysync.synced_model``, ``hub.push(wait=True)`` and
``raysync_version()`` are used, so the same script measures any tree of raysync, old or
new: put the tree first on ``PYTHONPATH`` and alternate. A model of 16 equal fp32
tensors; for each configuration a fresh Ray, hub and actors, 5 untimed pushes, then
``--pushes`` timed ``hub.push(sd, wait=True)`` (every actor applied), 50 ms apart.
Prints one line per configuration: size, apply, N and the median in ms.

Run::

    PYTHONPATH=/path/to/a/raysync/tree python benchmarks/delivery_ab.py \\
        --configs 4k:view:8 64m:view:8 256m:view:1 256m:view:8
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

import raysync

_UNITS = {"k": 2**10, "m": 2**20}


class Flat(torch.nn.Module):
    """``n`` equal fp32 parameters holding ``total`` bytes in all."""

    def __init__(self, total: int, n: int) -> None:
        super().__init__()
        for i in range(n):
            weight = torch.nn.Parameter(torch.empty(total // 4 // n), requires_grad=False)
            self.register_parameter(f"w{i:02d}", weight)


class Receiver:
    """An actor holding a :class:`Flat` model in ``self.policy``."""

    def __init__(self, total: int, n: int) -> None:
        self.policy = Flat(total, n)

    def ready(self) -> int:
        version: int | None = self.raysync_version()  # type: ignore[attr-defined]
        return -1 if version is None else version


def parse_config(text: str) -> tuple[int, str, int]:
    """``"64m:view:8"`` -> (bytes, apply, N)."""
    size, apply, n = text.split(":")
    if apply not in ("copy", "view"):
        raise argparse.ArgumentTypeError(f"apply must be copy or view, got {apply!r}")
    return int(size[:-1]) * _UNITS[size[-1].lower()], apply, int(n)


def measure(nbytes: int, apply: str, n: int, pushes: int, tensors: int) -> float:
    """Median ms of ``hub.push(wait=True)`` to ``n`` actors (a fresh Ray for each configuration)."""
    ray.init(object_store_memory=2 << 30, num_cpus=n + 4, include_dashboard=False, log_to_driver=False)
    try:
        sd = {k: v.detach().clone().normal_() for k, v in Flat(nbytes, tensors).state_dict().items()}
        hub_name = f"ab-{uuid.uuid4().hex[:8]}"  # a client remembers a hub's writer lease by its name
        decorate = raysync.synced_model("policy", model_id="policy", hub=hub_name, apply=apply)  # type: ignore[arg-type]
        cls: Any = ray.remote(num_cpus=0)(decorate(Receiver))
        actors = [cls.remote(nbytes, tensors) for _ in range(n)]
        hub = raysync.connect(hub_name, keep=2)
        ray.get([a.ready.remote() for a in actors])
        for _ in range(5):
            hub.push(sd, "policy", wait=True, timeout=60)
        times = []
        for i in range(pushes):
            sd["w00"][0] = float(i)
            t0 = time.perf_counter()
            hub.push(sd, "policy", wait=True, timeout=60)
            times.append(time.perf_counter() - t0)
            time.sleep(0.05)
        return statistics.median(times) * 1e3
    finally:
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        type=parse_config,
        default=[parse_config(c) for c in ("4k:view:8", "64m:view:8", "256m:view:1", "256m:view:8")],
        help="size:apply:N each, size with k or m (default: 4k:view:8 64m:view:8 256m:view:1 256m:view:8)",
    )
    parser.add_argument("--pushes", type=int, default=30, help="timed pushes per configuration (default: 30)")
    parser.add_argument("--tensors", type=int, default=16, help="tensors per model (default: 16)")
    args = parser.parse_args(argv)
    print(f"raysync from {os.path.dirname(raysync.__file__)}", flush=True)
    for nbytes, apply, n in args.configs:
        ms = measure(nbytes, apply, n, args.pushes, args.tensors)
        print(f"{nbytes / 2**20:9.3f} MiB  {apply}  N={n:<3} push to all applied {ms:7.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

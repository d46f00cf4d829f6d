"""One ``apply="view"`` actor: what an apply costs it, and what its first read after one costs.

(``--apply view copy``: an ``apply="copy"`` actor too, for comparison.)

Through raysync's public API only, so one run measures several trees of raysync side by
side (each round runs every tree once, in a child process with that tree first on
``PYTHONPATH``, alternating). For each size, a fresh Ray, hub and one view actor holding a
model of 16 equal fp32 tensors; 3 untimed pushes, then ``--pushes`` timed
``hub.push(sd, wait=True)``; after each, the actor's own report (``hub.status()``:
``last_apply_s``, fetch and apply; ``last_pause_s``, the part under its lock) and, in the
actor, the time of one full read of its weights (a sum over every parameter: the first
forward pass after an apply, page faults included). Also the actor's private memory
(RSS less shared pages) at the end (a view holds no copy), and its first apply (with the
process's one-time page-table fills of the store, raysync/core/prefault.py).

Run::

    python benchmarks/view_apply.py --trees /work/main /work/wt-r41-views --sizes-mib 64 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

_TENSORS = 16


def _child(size_mib: int, pushes: int, apply: str) -> dict[str, Any]:
    import psutil
    import ray
    import torch

    import raysync

    class Flat(torch.nn.Module):
        def __init__(self, total: int) -> None:
            super().__init__()
            for i in range(_TENSORS):
                self.register_parameter(
                    f"w{i:02d}", torch.nn.Parameter(torch.zeros(total // 4 // _TENSORS), requires_grad=False)
                )

    class Viewer:
        def __init__(self, total: int) -> None:
            self.policy = Flat(total)

        def ready(self) -> int:
            version: int | None = self.raysync_version()  # type: ignore[attr-defined]
            return -1 if version is None else version

        def read_s(self) -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                for p in self.policy.parameters():
                    p.sum()
            return time.perf_counter() - t0

        def private_mib(self) -> float:
            info = psutil.Process().memory_info()
            return (info.rss - getattr(info, "shared", 0)) / 2**20

    nbytes = size_mib * 2**20
    ray.init(object_store_memory=2 << 30, num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        hub_name = f"view-{uuid.uuid4().hex[:8]}"
        cls: Any = ray.remote(num_cpus=0)(raysync.synced_model("policy", hub=hub_name, apply=apply)(Viewer))
        actor = cls.remote(nbytes)
        hub = raysync.connect(hub_name, keep=2)
        ray.get(actor.ready.remote())
        sd = {k: v.detach().clone().normal_() for k, v in Flat(nbytes).state_dict().items()}
        rows: dict[str, list[float]] = {
            "apply_ms": [],
            "pause_ms": [],
            "first_read_ms": [],
            "read_again_ms": [],
        }
        for i in range(3 + pushes):
            sd["w00"][0] = float(i)
            hub.push(sd, wait=True, timeout=120)
            first, again = ray.get(actor.read_s.remote()), ray.get(actor.read_s.remote())
            [row] = hub.status()["subscribers"]
            if i == 0:
                first_apply_ms = row["last_apply_s"] * 1e3  # with the process's one-time page-table fills
            if i >= 3:
                rows["apply_ms"].append(row["last_apply_s"] * 1e3)
                rows["pause_ms"].append(row["last_pause_s"] * 1e3)
                rows["first_read_ms"].append(first * 1e3)
                rows["read_again_ms"].append(again * 1e3)
            time.sleep(0.05)
        out: dict[str, Any] = {k: statistics.median(v) for k, v in rows.items()}
        out["first_apply_ms"] = first_apply_ms
        out["private_MiB"] = ray.get(actor.private_mib.remote())
        out["raysync"] = os.path.dirname(raysync.__file__)
        return out
    finally:
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--trees", nargs="+", default=[os.getcwd()], help="raysync checkouts to compare")
    p.add_argument("--sizes-mib", nargs="+", type=int, default=[64, 256])
    p.add_argument("--pushes", type=int, default=10, help="timed pushes per run (default: 10)")
    p.add_argument("--rounds", type=int, default=2, help="runs of every tree per size, alternating")
    p.add_argument("--apply", nargs="+", choices=["view", "copy"], default=["view"], help="(default: view)")
    p.add_argument("--child", nargs=3, metavar=("SIZE_MIB", "PUSHES", "APPLY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        size, pushes, apply = args.child
        print(json.dumps(_child(int(size), int(pushes), apply)), flush=True)
        return 0
    print(
        "size  apply  tree                           apply ms  pause ms  1st read ms  read ms  private MiB",
        end="",
    )
    print("  first apply ms")
    for size in args.sizes_mib:
        for _ in range(args.rounds):
            for apply, tree in [(a, t) for a in args.apply for t in args.trees]:
                env = {**os.environ, "PYTHONPATH": tree}  # and its folder: Ray workers import from there
                cmd = [sys.executable, __file__, "--child", str(size), str(args.pushes), apply]
                done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
                if done.returncode:
                    print(f"{size:4d}  {apply}  {tree[-30:]:30s} failed:\n{done.stderr[-3000:]}", flush=True)
                    continue
                r = json.loads(done.stdout.strip().splitlines()[-1])
                print(
                    f"{size:4d}  {apply:5s}  {tree[-30:]:30s} {r['apply_ms']:8.1f}  {r['pause_ms']:8.2f}  "
                    f"{r['first_read_ms']:11.1f}  {r['read_again_ms']:7.1f}  {r['private_MiB']:11.0f}  "
                    f"{r['first_apply_ms']:14.0f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sparse deltas (``delta="sparse"``) against ``delta=True``: bytes and time per optimizer step.

A trainer with fp32 master weights (8 ``Linear(2048, 2048)``: 64 MiB in bf16) takes Adam steps
(``foreach=True``) and pushes a bf16 copy in 16 MiB buckets to 2 ``@synced_model`` actors, with
``delta=True`` and with ``delta="sparse"``, at each learning rate (default 1e-5 and 1e-4). For
each, medians of ``--repeats`` steps (after one whole push and one step not kept: Adam's first
moves every element by the learning rate):

changed
    the fraction of the bf16 elements whose bits changed in the step.
fetched per receiver
    ``bytes_fetched`` each actor reported for the version (hub status).
put
    the pusher's bytes: whole buckets (``bytes_put``) and patches (``bytes_patches``).
push to applied
    ``hub.push`` until both actors applied the version (``hub.wait``).
receiver's apply
    each actor's own ``apply_s`` (fetch, rebuild, verify, commit), as it reported it.
pusher
    ``hub.push`` returning (the trainer blocked: cast, compare, put).

Run::

    python benchmarks/sparse_delta.py                 # lr 1e-5 and 1e-4, 5 steps each
    python benchmarks/sparse_delta.py --lrs 1e-5 --repeats 9
    python benchmarks/sparse_delta.py --second-raylet   # the actors' bytes cross between object stores
    python benchmarks/sparse_delta.py --densities 0.001 0.01 0.05 0.25 --repeats 3   # 256 MiB, by density
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import ray
import torch

import raysync

MIB = 2**20
LAYERS, WIDTH, BUCKET = 8, 2048, 16 * MIB


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def receiver(hub_name: str, far: bool) -> Any:
    @raysync.synced_model("policy", hub=hub_name)
    class Rollout:
        def __init__(self) -> None:
            self.policy = net().to(torch.bfloat16)

        def ready(self) -> int | None:
            return self.raysync_version()

    return ray.remote(num_cpus=0, resources={"far": 1} if far else None)(Rollout).remote()


def measure(hub: raysync.HubClient, actors: list[Any], lr: float, delta: Any, repeats: int) -> dict[str, Any]:
    """One learning rate and one ``delta=``: medians over ``repeats`` steps."""
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=lr, foreach=True)
    torch.manual_seed(1)
    opts: dict[str, Any] = {"dtype": torch.bfloat16, "delta": delta, "bucket_bytes": BUCKET}
    hub.wait(hub.push(model, **opts), timeout=120)  # the base: whole
    ids = {a._actor_id.hex() for a in actors}
    keys = ("changed", "fetched", "put", "patches", "sparse", "applied", "apply", "pusher")
    rows: dict[str, list[float]] = {k: [] for k in keys}
    for step in range(repeats + 1):  # the first step is Adam's first (every element moves by lr): not kept
        before = [p.detach().to(torch.bfloat16) for p in model.parameters()]
        opt.zero_grad()
        model(torch.randn(8, WIDTH)).pow(2).mean().backward()
        opt.step()
        after = [p.detach().to(torch.bfloat16) for p in model.parameters()]
        changed = sum(
            int((a.view(torch.int16) != b.view(torch.int16)).sum())
            for a, b in zip(after, before, strict=True)
        )
        t0 = time.perf_counter()
        v = hub.push(model, **opts)
        t1 = time.perf_counter()
        hub.wait(v, timeout=120)
        t2 = time.perf_counter()
        stats = hub.last_push
        if step == 0:
            continue
        rows["changed"].append(changed / sum(p.numel() for p in after))
        mine = [s for s in hub.status()["subscribers"] if s["actor_id"] in ids]
        rows["fetched"].append(statistics.median(s["last_bytes_fetched"] for s in mine))
        rows["apply"].append(statistics.median(s["last_apply_s"] for s in mine))
        rows["put"].append(stats["bytes_put"])
        rows["patches"].append(stats.get("bytes_patches", 0))
        rows["sparse"].append(stats.get("buckets_sparse", 0))
        rows["applied"].append(t2 - t0)
        rows["pusher"].append(t1 - t0)
    return {"lr": lr, "delta": delta, **{k: statistics.median(v) for k, v in rows.items()}, "samples": rows}


SWEEP_LAYERS, SWEEP_WIDTH = 8, 4096  # 8 bf16 Linear(4096, 4096): 256 MiB


def sweep_net() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = (torch.nn.Linear(SWEEP_WIDTH, SWEEP_WIDTH, bias=False) for _ in range(SWEEP_LAYERS))
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def sweep_receiver(hub_name: str) -> Any:
    @raysync.synced_model("policy", model_id="sweep", hub=hub_name)
    class Rollout:
        def __init__(self) -> None:
            self.policy = sweep_net()

        def ready(self) -> int | None:
            return self.raysync_version()

    return ray.remote(num_cpus=0)(Rollout).remote()


def measure_density(
    hub: raysync.HubClient, actors: list[Any], density: float, delta: Any, repeats: int
) -> dict[str, Any]:
    """Exactly ``density`` of the elements of a 256 MiB bf16 model changed per step (every k-th
    element from a random offset, its bits moved by one: a neighbouring bf16 value)."""
    model = sweep_net()
    opts: dict[str, Any] = {"delta": delta, "bucket_bytes": 4 * BUCKET}
    hub.wait(hub.push(model, "sweep", **opts), "sweep", timeout=300)  # the base: whole
    ids = {a._actor_id.hex() for a in actors}
    stride = max(1, round(1 / density))
    rows: dict[str, list[float]] = {
        k: [] for k in ("changed", "put", "patches", "fetched", "applied", "pusher")
    }
    for step in range(repeats):
        changed = 0
        with torch.no_grad():
            for p in model.parameters():
                bits = p.view(-1).view(torch.int16)
                picked = bits[(step * 7919) % stride :: stride]
                picked.add_(1)
                changed += picked.numel()
        t0 = time.perf_counter()
        v = hub.push(model, "sweep", **opts)
        t1 = time.perf_counter()
        hub.wait(v, "sweep", timeout=300)
        t2 = time.perf_counter()
        stats = hub.last_push
        mine = [s for s in hub.status()["subscribers"] if s["actor_id"] in ids]
        rows["changed"].append(changed)
        rows["put"].append(stats["bytes_put"])
        rows["patches"].append(stats.get("bytes_patches", 0))
        rows["fetched"].append(statistics.median(s["last_bytes_fetched"] for s in mine))
        rows["applied"].append(t2 - t0)
        rows["pusher"].append(t1 - t0)
    return {"density": density, "delta": delta, **{k: statistics.median(v) for k, v in rows.items()}}


def sweep(densities: list[float], repeats: int) -> None:
    """Bytes and time against density (``--densities``), one node, 2 actors."""
    ray.init(num_cpus=4, object_store_memory=1536 * MIB, include_dashboard=False, log_to_driver=False)
    try:
        hub = raysync.connect("sparse-sweep-bench")
        actors = [sweep_receiver(hub.name) for _ in range(2)]
        ray.get([a.ready.remote() for a in actors], timeout=300)
        results = [measure_density(hub, actors, d, m, repeats) for d in densities for m in (True, "sparse")]
    finally:
        ray.shutdown()
    print(
        "| changed | delta | changed elements' bytes + 2-byte gaps | patches put | / that "
        "| whole buckets put | fetched per receiver | push to applied | pusher |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        need = r["changed"] * 4  # bf16 value + a 2-byte gap per changed element
        print(
            f"| {100 * r['density']:g}% | `{r['delta']!r}` | {need / MIB:.2f} MiB "
            f"| {r['patches'] / MIB:.2f} MiB "
            f"| {r['patches'] / need:.3f}x | {r['put'] / MIB:.1f} MiB | {r['fetched'] / MIB:.2f} MiB "
            f"| {r['applied']:.3f} s | {r['pusher']:.3f} s |"
        )
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-4])
    parser.add_argument(
        "--densities",
        type=float,
        nargs="+",
        help="instead: a 256 MiB bf16 model with exactly these fractions of its elements changed per "
        "step (say 0.001 0.01 0.05 0.25)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--second-raylet",
        action="store_true",
        help="the actors on a second raylet of this machine: the bytes they fetch cross between stores",
    )
    args = parser.parse_args()
    if args.densities:
        sweep(args.densities, args.repeats)
        return
    cluster = None
    if args.second_raylet:
        from ray.cluster_utils import Cluster

        ray._private.utils.write_ray_address = lambda *_a, **_k: None  # keep the cluster private
        head = {"num_cpus": 2, "object_store_memory": 1536 * MIB, "include_dashboard": False}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        cluster.add_node(num_cpus=2, object_store_memory=1536 * MIB, resources={"far": 100})
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    else:
        ray.init(num_cpus=4, object_store_memory=1536 * MIB, include_dashboard=False, log_to_driver=False)
    try:
        hub = raysync.connect("sparse-delta-bench")
        actors = [receiver(hub.name, args.second_raylet) for _ in range(2)]
        ray.get([a.ready.remote() for a in actors], timeout=120)
        results = [measure(hub, actors, lr, d, args.repeats) for lr in args.lrs for d in (True, "sparse")]
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print(
        "| lr | delta | changed | fetched per receiver | put (buckets + patches) | push to applied "
        "| receiver's apply | pusher |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['lr']:g} | `{r['delta']!r}` | {100 * r['changed']:.1f}% | {r['fetched'] / MIB:.1f} MiB "
            f"| {r['put'] / MIB:.1f} + {r['patches'] / MIB:.1f} MiB "
            f"| {r['applied']:.3f} s | {r['apply']:.3f} s | {r['pusher']:.3f} s |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()

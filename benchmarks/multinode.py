"""Many nodes on one machine: each node receives a version's bytes once, whatever its subscribers.

Starts a ``ray.cluster_utils.Cluster``: a head node and ``len(--subs-per-node)``
worker nodes, each a raylet with its own object store (``--store-mib``),
tagged with a custom resource ``node<i>``. ``@raysync.synced_model``
subscribers are pinned to nodes with that resource: ``--head-subs`` on the
head (where the trainer, this driver, puts each version) and
``--subs-per-node`` on the workers (for example ``1 3`` puts one subscriber
on worker 1 and three on worker 2). Then it pushes ``--pushes`` versions of a
``--size-mib`` fp32 model and, for every version, reads from every raylet:

``created_MiB``
    the growth of the node's ``cumulative_created_bytes`` (its object store's
    running total of bytes created, the trainer's puts on the head and the
    copies pulled from other nodes everywhere else) over that version.
``x_version``
    ``created_MiB`` over the version's size: ``1.00`` means the node got the
    version's bytes once, whatever the number of subscribers on it (a
    ``@synced_model`` fetch pulls a bucket onto the node once; every actor
    there reads that one copy).
``used_MiB``
    the node's object-store bytes in use after the version (the hub keeps
    ``keep=2`` versions).

Every subscriber must hold the version, bit-equal to what was pushed (checked
through a checksum of its weights), before the next push. ``applied_s`` is
``hub.push(..., wait=True)``: push until every subscriber applied it.

Run::

    python benchmarks/multinode.py                              # 3 workers with 1, 3, 5 subscribers
    python benchmarks/multinode.py --quick                      # 2 workers, 2 + 3 subscribers, 8 MiB
    python benchmarks/multinode.py --subs-per-node 2 2 --size-mib 64 --pushes 3

Results: a table on stdout and JSON in ``--json`` (default
``benchmarks/results/multinode.json``). Exits 1 if a subscriber did not
converge or a node created more than ``--max-ratio`` x a version's bytes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray._private import internal_api

import _harness as harness
import raysync
from _harness import MIB

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "multinode.json"
TENSORS = 4


def flat_model(nbytes: int) -> torch.nn.Module:
    """The model: ``nbytes`` of fp32 zeros in :data:`TENSORS` equal parameters."""
    return harness.FlatModel(nbytes, TENSORS, fill=0.0)


def checksum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def subscriber_class(hub_name: str, nbytes: int) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name)
    class Subscriber:
        def __init__(self) -> None:
            self.policy = flat_model(nbytes)

        def probe(self) -> tuple[int | None, float, str]:
            return self.raysync_version(), checksum(self.policy), ray.get_runtime_context().get_node_id()

    return Subscriber


def node_table() -> list[dict[str, Any]]:
    """Alive nodes with their ``node<i>`` tag, raylet address and port."""
    rows = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        tags = [k for k in node["Resources"] if k.startswith("node") and k[4:].isdigit()]
        rows.append(
            {
                "tag": tags[0] if tags else "?",
                "node_id": node["NodeID"],
                "address": node["NodeManagerAddress"],
                "port": node["NodeManagerPort"],
            }
        )
    return sorted(rows, key=lambda r: int(r["tag"][4:]) if r["tag"][4:].isdigit() else 99)


def store_stats(node: dict[str, Any]) -> dict[str, int]:
    """One raylet's own object-store counters (not the cluster-wide sum)."""
    stats = internal_api.node_stats(node["address"], node["port"], include_memory_info=False).store_stats
    return {"created": int(stats.cumulative_created_bytes), "used": int(stats.object_store_bytes_used)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = args.size_mib * MIB
    store = args.store_mib * MIB
    phases: dict[str, float] = {}
    t_phase = time.perf_counter()
    with harness.simulated_nodes(1 + len(args.subs_per_node), num_cpus=1, object_store_bytes=store):
        nodes = node_table()
        phases["cluster_s"] = time.perf_counter() - t_phase
        hub_name = f"bench-multinode-{uuid.uuid4().hex[:6]}"
        hub = raysync.connect(hub_name, keep=2)
        cls = subscriber_class(hub_name, nbytes)
        placement = [("node0", args.head_subs)] + [
            (f"node{i}", n) for i, n in enumerate(args.subs_per_node, start=1)
        ]
        subs: list[tuple[str, Any]] = []
        for tag, n in placement:
            subs += [(tag, cls.options(resources={tag: 1}).remote()) for _ in range(n)]
        ray.get([s.probe.remote() for _, s in subs])  # every subscriber registered
        phases["subscribers_s"] = time.perf_counter() - t_phase - phases["cluster_s"]
        model = flat_model(nbytes)
        versions = []
        converged = True
        for k in range(args.pushes):
            with torch.no_grad():
                for j, p in enumerate(model.parameters()):
                    p.fill_(k + 1 + j / 8)
            want = checksum(model)
            before = {n["tag"]: store_stats(n) for n in nodes}
            t0 = time.perf_counter()
            v = hub.push(model, wait=True, timeout=args.timeout)
            applied_s = time.perf_counter() - t0
            probes = ray.get([s.probe.remote() for _, s in subs])
            ok = all(p[0] == v and abs(p[1] - want) <= 1e-6 * max(1.0, abs(want)) for p in probes)
            converged &= ok
            time.sleep(0.2)  # let the raylets' counters catch up with the last pulls
            after = {n["tag"]: store_stats(n) for n in nodes}
            per_node = {}
            for tag, n in placement:
                created = after[tag]["created"] - before[tag]["created"]
                per_node[tag] = {
                    "subscribers": n,
                    "created_MiB": created / MIB,
                    "x_version": created / nbytes,
                    "used_MiB": after[tag]["used"] / MIB,
                }
            versions.append({"version": v, "applied_s": applied_s, "converged": ok, "nodes": per_node})
        return {
            "size_mib": args.size_mib,
            "store_mib": args.store_mib,
            "placement": dict(placement),
            "subscribers": len(subs),
            "converged": converged,
            "versions": versions,
            "phases": phases,
        }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"model {result['size_mib']} MiB, {result['subscribers']} subscribers, "
        f"placement {result['placement']}"
    )
    print("| version | node | subscribers | created_MiB | x_version | used_MiB | applied_s |")
    print("|---|---|---|---|---|---|---|")
    for row in result["versions"]:
        for tag, n in row["nodes"].items():
            print(
                f"| {row['version']} | {tag} | {n['subscribers']} | {n['created_MiB']:.1f} | "
                f"{n['x_version']:.2f} | {n['used_MiB']:.1f} | {row['applied_s']:.3f} |"
            )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--subs-per-node", type=int, nargs="+", default=[1, 3, 5], help="subscribers per worker")
    p.add_argument("--head-subs", type=int, default=2, help="subscribers on the head (the trainer's node)")
    p.add_argument("--size-mib", type=int, default=64, help="model size (fp32, 4 tensors)")
    p.add_argument("--store-mib", type=int, default=400, help="object store of each node")
    p.add_argument("--pushes", type=int, default=3)
    harness.add_options(p, timeout=120.0)
    p.add_argument("--max-ratio", type=float, default=1.2, help="fail above this many copies per node")
    p.add_argument("--quick", action="store_true", help="2 workers with 2 and 3 subscribers, 8 MiB, 2 pushes")
    harness.add_options(p, json=DEFAULT_JSON)
    args = p.parse_args(argv)
    if args.quick:
        args.subs_per_node, args.head_subs, args.size_mib, args.store_mib, args.pushes = [2, 3], 1, 8, 100, 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    meta = harness.run_meta("benchmarks/multinode.py", argv, started=t_start)
    result["meta"] = {**meta, "time": time.time()}
    print_table(result)
    harness.write_json(args.json, result, indent=1)
    worst = max(n["x_version"] for row in result["versions"] for n in row["nodes"].values())
    print(f"converged: {result['converged']}; most bytes created on one node per version: {worst:.2f}x")
    return 0 if result["converged"] and worst <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())

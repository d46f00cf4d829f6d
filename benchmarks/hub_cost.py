"""The hub's cost per version against nodes and subscriptions: relays (the default) against direct delivery.

Starts a ``ray.cluster_utils.Cluster`` of ``max(--nodes)`` simulated nodes (a
head and workers, ``--cpus-per-node`` CPUs each) on this machine. On every node,
``--actors-per-node`` light async actors (``num_cpus=0``) hold the subscriptions:
they answer each notification at once without fetching anything, so what is
measured is the control plane. As ``@synced_model`` processes do, each actor
has a doorbell that its node's relay (on the hub's node, the hub) rings once per
version for all its subscriptions; with ``--no-doorbell`` each subscription is
notified by its own Ray call (what one ``@synced_model`` actor per subscription
cost before doorbells). With ``--followers`` the
subscriptions are real Followers (:class:`raysync.Follower`) in those actors, each feeding a
``WeightsLoader`` that keeps nothing (what an inference engine's follower is): they
register themselves, fetch every version and hear of it from their node's relay like
any receiver (the hub is started with ``rings_own_node=False`` so that a relay serves
its node too, and the count is one message per node).

For every (nodes, subscriptions, delivery) a fresh hub: ``relay`` is the
default (one relay per node, one hub message per node per version),
``direct`` a hub started with ``RAYSYNC_RELAY=0`` (one hub call per
subscriber per version). Medians over ``--pushes`` pushes of a small model:

``msgs_per_version``
    the hub's outgoing delivery calls per version (``status()["delivery"]["calls"]``),
    exact: every value seen is listed in ``msgs_seen``, beside ``msgs_expected``, the
    nodes with subscribers but the hub's own when the hub rings its doorbells itself
    (``hub_node_used``: the hub landed on one of the subscribers' nodes; it rings them
    itself while they are at most ``raysync.hub.delivery.HERE_MAX_MEMBERS``, and its
    node's relay does beyond).
``hub_cpu_ms``
    CPU time of the hub process (its own ``time.process_time()``) from just before
    ``hub.push`` until ``hub.wait`` returned.
``floor_hub_cpu_ms`` (relay rows)
    the floor of a hub's work per version, measured in the same run: an async actor that sends
    one message to each node's relay (an actor answering at once with a compact row per
    subscription it names) and reads the replies; its CPU per round.
``relay_cpu_ms``
    CPU time of all relay processes over the same window (the work relays took over;
    psutil, 10 ms ticks).
``push_ms`` / ``applied_ms``
    ``hub.push`` alone; from ``hub.push`` returning until ``hub.wait(v)`` returned
    (every subscription recorded as holding the version).

Run::

    python benchmarks/hub_cost.py                          # 1 2 4 nodes x 10 100 1000, relay + direct
    python benchmarks/hub_cost.py --nodes 4 --subscriptions 1000 --delivery relay --pushes 20

Results: a table on stdout and JSON in ``--json`` (default
``benchmarks/results/hub_cost.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import _harness as harness
import raysync
from raysync._protocol import DEFAULT_NAMESPACE, Announcement, ApplyReport, Registration, SubscriberInfo
from raysync.hub.delivery import HERE_MAX_MEMBERS
from raysync.receivers.membership import membership
from raysync.transports.doorbell import doorbell

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "hub_cost.json"


@ray.remote(num_cpus=0)
class LightSubscribers:
    """An async actor standing in for many subscribers on its node: it acknowledges every version at once."""

    async def _raysync_notify(self, a: Announcement) -> ApplyReport:
        return ApplyReport(applied=a.version, apply_s=0.0)

    async def _raysync_ping(self) -> bool:
        return True

    async def serve(self, hub_name: str) -> None:
        """Answer the calls ``hub_name`` (and its relay here) queue for this actor, as every
        subscriber process does (raysync/receivers/poller.py)."""
        hub = SimpleNamespace(hub_name=hub_name, hub_namespace=None)
        membership().serve(hub, self)  # type: ignore[arg-type]

    async def follow(self, hub_name: str, count: int) -> None:
        """Start ``count`` Followers of ``hub_name``'s ``policy``, each into a loader that keeps nothing."""

        def start() -> list[raysync.Follower]:
            loaders = [raysync.WeightsLoader(lambda pairs: None) for _ in range(count)]
            return [raysync.follow(target=loader, hub=hub_name) for loader in loaders]

        self.followers = await asyncio.to_thread(start)

    async def unfollow(self) -> None:
        for follower in getattr(self, "followers", []):
            await asyncio.to_thread(follower.stop)
        self.followers = []

    async def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    async def doorbell(self, sub_ids: list[str]) -> tuple[str, bytes] | None:
        """Answer rings for ``sub_ids`` as a ``@synced_model`` process would (at once); address and key."""
        bell = doorbell()
        if bell is None:
            return None
        for sub_id in sub_ids:
            bell.register(sub_id, lambda ring, segment: ApplyReport(applied=ring.version, apply_s=0.0))
        return bell.address, bell.key


@ray.remote(num_cpus=0)
class FloorRelay:
    """The floor's relay: answers each message at once with one compact row per subscription named."""

    async def deliver(self, announcement: tuple[str, int, tuple[str, ...]]) -> tuple[Any, ...]:
        return tuple((sub_id, 0.001, None, None, None) for sub_id in announcement[2])


@ray.remote(num_cpus=0)
class FloorHub:
    """The floor of a hub's work per version: one message to each node's relay naming its
    subscriptions, and their replies read (CPU time per round, this process's)."""

    def __init__(self, relays: list[Any]) -> None:
        self.relays = relays

    async def round(self, per_node: list[tuple[str, ...]]) -> float:
        t0 = time.process_time()
        calls = [r.deliver.remote(("policy", 1, ids)) for r, ids in zip(self.relays, per_node, strict=True)]
        await asyncio.gather(*calls)
        return time.process_time() - t0


def measure_floor(nodes: int, n: int, actors: dict[str, list[Any]], rounds: int) -> float:
    """Median CPU ms per round of :class:`FloorHub` over ``nodes`` relays, ``n`` subscriptions in all."""
    used = list(actors)[:nodes]
    relays = [
        FloorRelay.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()  # type: ignore[attr-defined]
        for node in used
    ]
    hub = FloorHub.remote(relays)
    per_node = [tuple(f"light-abcdef12-{i}:policy" for i in range(k, n, nodes)) for k in range(nodes)]
    try:
        for _ in range(3):
            ray.get(hub.round.remote(per_node))
        return statistics.median(ray.get(hub.round.remote(per_node)) for _ in range(rounds)) * 1e3
    finally:
        for actor in [hub, *relays]:
            ray.kill(actor)


def start_hub(name: str, delivery: str, followers: bool = False) -> raysync.HubClient:
    """A fresh hub; ``direct``: one without relays (it calls every subscription itself);
    ``followers``: a relay serves the hub's own node too."""
    settings = raysync.HubSettings(relays=delivery != "direct", rings_own_node=not followers)
    return raysync.connect(name, keep=2, settings=settings)


def measure(
    nodes: int, n: int, delivery: str, actors: dict[str, list[Any]], args: argparse.Namespace
) -> dict[str, Any]:
    name = f"bench-hubcost-{uuid.uuid4().hex[:6]}"
    hub = start_hub(name, delivery, args.followers)
    used = [(node, a) for node in list(actors)[:nodes] for a in actors[node]]
    subs: dict[Any, list[str]] = {}
    try:
        for i in range(n):
            node, actor = used[i % len(used)]
            subs.setdefault(actor, []).append(f"light-{actor._actor_id.hex()[:8]}-{i}:policy")
        model = harness.small_policy()
        if args.followers:  # real Followers register themselves, once there is a version to follow
            hub.push(model)
            ray.get([a.follow.remote(name, len(ids)) for a, ids in subs.items()])
        bells = {
            a: ray.get(a.doorbell.remote(ids)) if args.doorbell and not args.followers else None
            for a, ids in subs.items()
        }
        if not args.followers:
            ray.get([a.serve.remote(name) for a in subs])
        pending = []
        for i in range(0 if args.followers else n):
            node, actor = used[i % len(used)]
            aid = actor._actor_id.hex()
            info = SubscriberInfo(
                actor_id=aid,
                class_name="LightSubscribers",
                node_id=node,
                doorbell=bells[actor][0] if bells[actor] else None,
            )
            key = bells[actor][1] if bells[actor] else None
            reg = Registration(f"light-{aid[:8]}-{i}:policy", "policy", True, info, doorbell_key=key)
            pending.append(hub.actor.register.remote(reg))
        ray.get(pending)
        for _ in range(2):  # warm-up: relays start (the hub delivers directly meanwhile)
            hub.wait(hub.push(model), timeout=args.timeout)
        # Every used node gets a relay message per version, but the hub's own when the hub rings
        # its doorbells itself; direct delivery: one call per subscription.
        rung_here = args.doorbell and not args.followers
        here = (hub.status().get("here") or {}).get("node_id") if rung_here else None
        hub_node_used = here in {node for node, _ in used}
        on_hub_node = sum(1 for i in range(n) if used[i % len(used)][0] == here)
        if on_hub_node > HERE_MAX_MEMBERS:  # a large group on the hub's node: its relay serves it
            here = None
        expected = len({node for node, _ in used} - {here}) if delivery == "relay" else n
        if delivery == "relay":
            deadline = time.monotonic() + 60
            while len(hub.status()["relays"]) < expected:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"relays did not start on {expected} nodes: {hub.status()['relays']}")
                time.sleep(0.1)
            hub.wait(hub.push(model), timeout=args.timeout)
        relay_procs = [psutil.Process(pid) for pid in relay_pids(name, nodes, delivery)]
        msgs, cpu, relay_cpu, push_ms, applied_ms = [], [], [], [], []
        for _ in range(args.pushes):
            before = ray.get(hub.actor.configure.remote())
            r0 = sum(cpu_s(p) for p in relay_procs)
            t0 = time.perf_counter()
            v = hub.push(model)
            t1 = time.perf_counter()
            hub.wait(v, timeout=args.timeout)
            t2 = time.perf_counter()
            after = ray.get(hub.actor.configure.remote())
            r1 = sum(cpu_s(p) for p in relay_procs)
            msgs.append(after["delivery_calls"] - before["delivery_calls"])
            cpu.append((after["cpu_s"] - before["cpu_s"]) * 1e3)
            relay_cpu.append((r1 - r0) * 1e3)
            push_ms.append((t1 - t0) * 1e3)
            applied_ms.append((t2 - t1) * 1e3)
        status = hub.status()
        held = [s["applied"] for s in status["subscribers"]]
        assert len(held) == n and all(h == v for h in held), "not every subscription holds the newest version"
        return {
            "nodes": nodes,
            "subscriptions": n,
            "delivery": delivery,
            "doorbell": args.doorbell and not args.followers,
            "followers": args.followers,
            "actors": len(used),
            "msgs_per_version": statistics.median(msgs),
            "msgs_seen": sorted(set(msgs)),
            "msgs_expected": expected,
            "hub_node_used": hub_node_used,
            "hub_cpu_ms": statistics.median(cpu),
            "relay_cpu_ms": statistics.median(relay_cpu),
            "push_ms": statistics.median(push_ms),
            "applied_ms": statistics.median(applied_ms),
            "applied_ms_max": max(applied_ms),
            "applied_ms_all": applied_ms,
            "hub_cpu_ms_all": cpu,
        }
    finally:
        if args.followers:
            ray.get([a.unfollow.remote() for a in subs])
        harness.kill_all([hub.actor])


def relay_pids(hub_name: str, nodes: int, delivery: str) -> list[int]:
    if delivery != "relay":
        return []
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if hub_name in a["name"]]
    relays = [ray.get_actor(n, namespace=DEFAULT_NAMESPACE) for n in names if n.startswith("raysync-relay:")]
    return [ray.get(r.stats.remote())["pid"] for r in relays]


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        ("nodes", "d"),
        ("subscriptions", "d"),
        ("delivery", "s"),
        ("msgs_per_version", ".0f"),
        ("msgs_seen", "s"),
        ("msgs_expected", "d"),
        ("hub_node_used", "s"),
        ("hub_cpu_ms", ".1f"),
        ("floor_hub_cpu_ms", ".1f"),
        ("relay_cpu_ms", ".1f"),
        ("push_ms", ".1f"),
        ("applied_ms", ".1f"),
        ("applied_ms_max", ".1f"),
    ]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = ("-" if c not in r else format(r[c], f) if f != "s" else str(r[c]) for c, f in cols)
        print("| " + " | ".join(cells) + " |")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--subscriptions", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--delivery", nargs="+", choices=["relay", "direct"], default=["relay", "direct"])
    p.add_argument("--actors-per-node", type=int, default=2, help="light actors holding the subscriptions")
    p.add_argument("--cpus-per-node", type=int, default=1)
    p.add_argument(
        "--no-doorbell",
        dest="doorbell",
        action="store_false",
        help="subscriptions without a doorbell: one Ray call each from their node's relay",
    )
    p.add_argument(
        "--followers",
        action="store_true",
        help="the subscriptions are raysync.Followers feeding WeightsLoaders (as engines are)",
    )
    p.add_argument("--pushes", type=int, default=10, help="timed pushes per configuration (medians)")
    harness.add_options(p, timeout=120.0, json=DEFAULT_JSON)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    logging.basicConfig(level=logging.WARNING)
    ray._private.utils.write_ray_address = lambda *_a, **_k: None  # keep the cluster private
    store = 128 * harness.MIB
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": args.cpus_per_node,
            "object_store_memory": store,
            "include_dashboard": False,
        },
    )
    rows = []
    try:
        for _ in range(max(args.nodes) - 1):
            cluster.add_node(num_cpus=args.cpus_per_node, object_store_memory=store, wait=False)
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        cluster.wait_for_nodes()
        node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        actors: dict[str, list[Any]] = {}
        for node in node_ids:
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            actors[node] = [
                LightSubscribers.options(max_concurrency=10_000, scheduling_strategy=strategy).remote()  # type: ignore[attr-defined]
                for _ in range(args.actors_per_node)
            ]
        ray.get([a.node.remote() for group in actors.values() for a in group])
        for nodes in args.nodes:
            for n in args.subscriptions:
                for delivery in args.delivery:
                    row = measure(nodes, n, delivery, actors, args)
                    if delivery == "relay":
                        row["floor_hub_cpu_ms"] = measure_floor(nodes, n, actors, args.pushes)
                    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
                    rows.append(row)
        print_table(rows)
        meta = harness.run_meta("benchmarks/hub_cost.py", argv, started=t_start)
        harness.write_json(args.json, {"meta": {**meta, "time": time.time()}, "rows": rows}, indent=1)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

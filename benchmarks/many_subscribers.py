"""Many subscribers on one hub: notification latency, hub CPU and memory against N.

The subscribers are light: ``--actors`` async Ray actors each hold N / actors
subscriptions of one model and answer the hub's notification at once
(``{"applied": version}``) without fetching anything, so what is measured is
the hub's own work per version: stamping, one notification per subscriber,
recording N replies and answering
``hub.wait``. They register with the hub actor directly, the way a
``@synced_model`` actor does (``hub.actor.register.remote(Registration(...))``,
the typed message of :mod:`raysync._protocol`).

For every N in ``--subscribers`` (fresh hub each time) the script pushes a
small model ``--pushes`` times and reports, medians over the pushes:

``latency_ms``
    ``hub.push(model)`` until ``hub.wait(v)`` returned: every one of the N
    subscribers recorded as holding the version.
``push_ms``
    the ``hub.push`` call alone (snapshot + publish round trip).
``notify_ms``
    from ``hub.push`` returning until ``hub.wait(v)`` returned: the
    notification fan-out itself (``latency_ms`` = ``push_ms`` + ``notify_ms``).
``hub_cpu_ms``
    CPU time (user + system) the hub process spent per push, from
    ``psutil.Process(hub_pid).cpu_times()`` around the push and wait.
``hub_rss_MiB``
    the hub process's resident memory after the last push; ``reg_s`` is the
    time to register all N subscribers, ``status_ms`` one ``hub.status()``.

Mode (``--mode``): ``single``, the only one now: each subscription gets its own
notification call (what N separate ``@synced_model`` actors without doorbells cost the
hub). The ``batch`` mode of earlier runs (one call per actor for all its subscriptions)
is gone with the batched call: a process holding many subscriptions is rung once per
version by its node's doorbell instead (``hub_cost.py``).

Run::

    python benchmarks/many_subscribers.py                          # N = 100 1000 10000
    python benchmarks/many_subscribers.py --subscribers 1000 --mode single --pushes 3

Results: a table on stdout and JSON in ``--json`` (default
``benchmarks/results/many_subscribers.json``).
"""

from __future__ import annotations

import argparse
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

import _harness as harness
import raysync
from raysync._protocol import Announcement, ApplyReport, Registration, SubscriberInfo
from raysync.receivers.membership import membership

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "many_subscribers.json"


@ray.remote(num_cpus=0)
class LightSubscribers:
    """An async actor standing in for many subscribers: it acknowledges every version at once."""

    def __init__(self) -> None:
        self.calls = 0
        self.newest = 0

    async def _raysync_notify(self, a: Announcement) -> ApplyReport:
        self.calls += 1
        self.newest = max(self.newest, a.version)
        return ApplyReport(applied=a.version, apply_s=0.0)

    async def _raysync_ping(self) -> bool:
        return True

    async def serve(self, hub_name: str) -> None:
        """Answer the calls ``hub_name`` (and its relay here) queue for this actor, as every
        subscriber process does (raysync/receivers/poller.py)."""
        hub = SimpleNamespace(hub_name=hub_name, hub_namespace=None)
        membership().serve(hub, self)  # type: ignore[arg-type]

    async def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "newest": self.newest}


def register_light(
    hub: raysync.HubClient,
    model_id: str,
    n: int,
    actors: Sequence[Any],
    *,
    schema: dict[str, Any] | None = None,
    chunk: int = 2000,
) -> list[str]:
    """Register ``n`` light subscriptions of ``model_id``, spread round-robin over ``actors``."""
    ids = [a._actor_id.hex() for a in actors]
    ray.get([a.serve.remote(hub.name) for a in actors])
    sub_ids = []
    pending = []
    for i in range(n):
        k = i % len(actors)
        sub_id = f"light-{ids[k][:8]}-{i}:{model_id}"
        info = SubscriberInfo(actor_id=ids[k], class_name="LightSubscribers")
        pending.append(hub.actor.register.remote(Registration(sub_id, model_id, True, info, schema)))
        sub_ids.append(sub_id)
        if len(pending) >= chunk:
            ray.get(pending)
            pending = []
    ray.get(pending)
    return sub_ids


def measure(n: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    name = f"bench-many-{uuid.uuid4().hex[:6]}"
    hub = raysync.connect(name)
    pid = ray.get(hub.actor.configure.remote(2))["pid"]
    proc = psutil.Process(pid)
    rss0 = proc.memory_info().rss
    actors = [LightSubscribers.options(max_concurrency=10_000).remote() for _ in range(args.actors)]  # type: ignore[attr-defined]
    model = harness.small_policy()
    try:
        t = time.perf_counter()
        register_light(hub, "policy", n, actors)
        reg_s = time.perf_counter() - t
        rss_reg = proc.memory_info().rss
        hub.wait(hub.push(model), timeout=args.timeout)  # warm-up: first delivery to every subscriber
        lat, push_ms, notify_ms, cpu = [], [], [], []
        for _ in range(args.pushes):
            c0 = proc.cpu_times()
            t0 = time.perf_counter()
            v = hub.push(model)
            t1 = time.perf_counter()
            hub.wait(v, timeout=args.timeout)
            t2 = time.perf_counter()
            c1 = proc.cpu_times()
            lat.append((t2 - t0) * 1e3)
            push_ms.append((t1 - t0) * 1e3)
            notify_ms.append((t2 - t1) * 1e3)
            cpu.append((c1.user + c1.system - c0.user - c0.system) * 1e3)
        t = time.perf_counter()
        status = hub.status()
        status_ms = (time.perf_counter() - t) * 1e3
        held = [s["applied"] for s in status["subscribers"]]
        assert len(held) == n and all(a == v for a in held), "not every subscriber holds the newest version"
        calls = sum(s["calls"] for s in ray.get([a.stats.remote() for a in actors]))
        return {
            "subscribers": n,
            "mode": mode,
            "actors": args.actors,
            "latency_ms": statistics.median(lat),
            "latency_ms_all": lat,
            "push_ms": statistics.median(push_ms),
            "notify_ms": statistics.median(notify_ms),
            "notify_ms_all": notify_ms,
            "hub_cpu_ms": statistics.median(cpu),
            "hub_cpu_ms_all": cpu,
            "hub_rss_MiB": proc.memory_info().rss / 2**20,
            "hub_rss_start_MiB": rss0 / 2**20,
            "hub_rss_registered_MiB": rss_reg / 2**20,
            "reg_s": reg_s,
            "status_ms": status_ms,
            "notify_calls_per_push": calls / (args.pushes + 1),
        }
    finally:
        harness.kill_all([*actors, hub.actor])


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        ("subscribers", "d"),
        ("mode", "s"),
        ("latency_ms", ".1f"),
        ("push_ms", ".1f"),
        ("notify_ms", ".1f"),
        ("hub_cpu_ms", ".1f"),
        ("hub_rss_MiB", ".0f"),
        ("reg_s", ".2f"),
        ("status_ms", ".0f"),
        ("notify_calls_per_push", ".0f"),
    ]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(format(r[c], f) for c, f in cols) + " |")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--subscribers", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--mode", nargs="+", choices=["single"], default=["single"])
    p.add_argument("--actors", type=int, default=4, help="light actors holding the subscriptions")
    p.add_argument("--pushes", type=int, default=5, help="timed pushes per configuration (medians)")
    harness.add_options(p, timeout=600.0, json=DEFAULT_JSON)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with harness.local_cluster(num_cpus=2, object_store_bytes=256 * harness.MIB):
        for mode in args.mode:
            for n in args.subscribers:
                row = measure(n, mode, args)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
                rows.append(row)
    print_table(rows)
    meta = harness.run_meta("benchmarks/many_subscribers.py", argv, started=t_start)
    harness.write_json(args.json, {"meta": {**meta, "time": time.time()}, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

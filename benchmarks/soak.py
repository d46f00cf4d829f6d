"""Soak: push in a loop while subscribers are killed and restarted at random; nothing lost or torn.

Every version fills every tensor with its own version number, so a
subscriber's weights are *whole* exactly when all its tensors hold one value
and that value is the version it reports. The model is split into several
buckets, so an apply that mixed two versions would show.

While the trainer (this driver) pushes, a killer picks a random subscriber
every ``--kill-every`` seconds on average and kills its process; Ray restarts
it (``max_restarts=-1``), it registers again from ``__init__`` and catches up
by itself. A poller asks every subscriber, through one of its (read-locked)
methods, which version it holds and what its weights contain. At the end the
killer stops, and every subscriber must reach the last version pushed.

Printed: versions pushed, versions applied per subscriber (summed over its
processes; each process samples the version it holds every millisecond in a
thread), versions seen by the poller, restarts, failures (pushes that raised; applies that failed),
maximum lag (newest pushed minus held, at a poll), regressions (a version
going backwards inside one process), torn reads, and whether anything was
lost (a subscriber that did not end on the last version with exactly its
weights).

``--resources`` runs the other check instead: ``--pushes`` pushes (default 50)
of ``--size-mib`` (default 256) with ``keep=2`` and waits for every subscriber
each time, measuring object-store bytes (what ``ray memory --stats-only``
reports) and each subscriber's RSS and private memory (RSS minus shared
pages) over the run.

Run::

    python benchmarks/soak.py                       # 5 minutes, 4 subscribers, 8 MiB model
    python benchmarks/soak.py --seconds 30          # a short run
    python benchmarks/soak.py --resources           # 50 pushes of 256 MiB, keep=2

Both write JSON to ``benchmarks/results/soak.json`` / ``soak_resources.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch

import raysync

logger = logging.getLogger("soak")
MiB = 2**20
UNSET = -1.0  # what a subscriber's tensors hold before its first version
KINDS = ("copy", "threaded", "view", "prefetch")
_DELIVERY_ERRORS = ("ActorDiedError", "ActorUnavailableError", "RayActorError")


class Filled(torch.nn.Module):
    """``tensors`` float32 parameters of equal size, all filled with one value."""

    def __init__(self, size_mib: float, tensors: int = 4) -> None:
        super().__init__()
        n = max(1, int(size_mib * MiB) // tensors // 4)
        for i in range(tensors):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.full((n,), UNSET)))


def subscriber_class(hub_name: str, kind: str, size_mib: float, tensors: int) -> Any:
    """A ``@synced_model`` actor class of one kind: ``copy``, ``threaded``, ``view`` or ``prefetch``."""
    opts: dict[str, Any] = {"hub": hub_name}
    if kind == "view":
        opts["apply"] = "view"
    if kind == "prefetch":
        opts["prefetch"] = True

    @raysync.synced_model("policy", **opts)
    class Subscriber:
        def __init__(self) -> None:
            self.policy = Filled(size_mib, tensors)
            self.applied: set[int] = set()
            threading.Thread(target=self._watch, daemon=True).start()

        def _watch(self) -> None:
            """Note every version this process holds (sampled every millisecond)."""
            while True:
                v = self.raysync_version()  # type: ignore[attr-defined]
                if v is not None:
                    self.applied.add(v)
                time.sleep(0.001)

        def check(self) -> dict[str, Any]:
            """The version held, every value its tensors hold (one, if whole), versions applied."""
            values: set[float] = set()
            for p in self.policy.parameters():
                lo, hi = torch.aminmax(p.detach())
                values.update((float(lo), float(hi)))
            return {
                "version": self.raysync_version(),  # type: ignore[attr-defined]
                "values": sorted(values),
                "pid": os.getpid(),
                "applied": len(self.applied),
            }

        def memory(self) -> dict[str, int]:
            import psutil  # shipped inside ray (ray/thirdparty_files), importable once ray is

            info = psutil.Process().memory_info()
            return {"rss": int(info.rss), "private": int(info.rss - info.shared)}

    concurrency = 2 if kind == "threaded" else 1
    return ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=concurrency)(
        Subscriber
    )


def torn(report: dict[str, Any]) -> bool:
    """Whether a subscriber's weights are anything but exactly the version it reports."""
    version, values = report["version"], report["values"]
    expected = UNSET if version is None else float(version)
    return values != [expected]


def _ensure_ray(object_store_mib: int) -> bool:
    if ray.is_initialized():
        return False
    ray.init(
        num_cpus=4,
        object_store_memory=object_store_mib * MiB,
        include_dashboard=False,
        logging_level="warning",
        log_to_driver=False,
    )
    return True


# ---------------------------------------------------------------------- soak


def run_soak(
    *,
    seconds: float = 300.0,
    subscribers: int = 4,
    kinds: Sequence[str] = KINDS,
    size_mib: float = 8.0,
    tensors: int = 4,
    interval: float = 0.1,
    kill_every: float = 3.0,
    settle_timeout: float = 120.0,
    seed: int | None = None,
) -> dict[str, Any]:
    """Push for ``seconds`` while killing subscribers at random; return the figures."""
    rng = random.Random(seed)
    hub_name = f"soak-{uuid.uuid4().hex[:8]}"
    hub = raysync.connect(hub_name, keep=2)
    kinds_used = [kinds[i % len(kinds)] for i in range(subscribers)]
    classes = {k: subscriber_class(hub_name, k, size_mib, tensors) for k in set(kinds_used)}
    actors = [classes[k].remote() for k in kinds_used]
    ray.get([a.check.remote() for a in actors])  # all registered
    names = [f"s{i}-{k}" for i, k in enumerate(kinds_used)]
    stats: list[dict[str, Any]] = [
        {
            "name": name,
            "kind": kind,
            "pids": set(),
            "applied": {},
            "seen": set(),
            "last": {},
            "regressions": 0,
            "torn": 0,
            "polls": 0,
            "polls_interrupted": 0,
            "max_lag": 0,
            "kills": 0,
        }
        for name, kind in zip(names, kinds_used, strict=True)
    ]
    model = Filled(size_mib, tensors)
    bucket_bytes = max(1, sum(p.numel() * 4 for p in model.parameters()) // tensors)
    pushed: list[int] = []
    push_failures: list[str] = []
    apply_errors: set[tuple[str, str]] = set()
    outstanding: dict[Any, tuple[int, int]] = {}  # ref -> (subscriber index, newest pushed when asked)

    def ask(i: int) -> None:
        outstanding[actors[i].check.remote()] = (i, pushed[-1] if pushed else 0)

    def collect(timeout: float) -> None:
        ready, _ = ray.wait(list(outstanding), num_returns=len(outstanding), timeout=timeout)
        if not ready:
            ready, _ = ray.wait(list(outstanding), num_returns=1, timeout=0)
        for ref in ready:
            i, newest = outstanding.pop(ref)
            s = stats[i]
            try:
                report = ray.get(ref)
            except ray.exceptions.RayActorError:
                s["polls_interrupted"] += 1  # killed while asked: expected
                ask(i)
                continue
            s["polls"] += 1
            version, pid = report["version"], report["pid"]
            s["pids"].add(pid)
            s["applied"][pid] = max(s["applied"].get(pid, 0), report["applied"])
            if version is not None:
                s["seen"].add(version)
                if version < s["last"].get(pid, 0):
                    s["regressions"] += 1
                s["last"][pid] = max(version, s["last"].get(pid, 0))
            s["max_lag"] = max(s["max_lag"], newest - (version or 0))
            if torn(report):
                s["torn"] += 1
                logger.error("%s torn: %s", s["name"], report)
            ask(i)

    def note_errors() -> None:
        for row in hub.status()["subscribers"]:
            err = row.get("last_error")
            if err and not err.startswith(_DELIVERY_ERRORS):
                apply_errors.add((row["subscriber"], err[:200]))

    for i in range(len(actors)):
        ask(i)
    t_start = time.monotonic()
    deadline = t_start + seconds
    next_kill = t_start + rng.expovariate(1.0 / kill_every)
    next_status = t_start + 1.0
    fill = 0
    while time.monotonic() < deadline:
        fill += 1
        for p in model.parameters():
            p.data.fill_(float(fill))
        try:
            v = hub.push(model, bucket_bytes=bucket_bytes)
            pushed.append(v)
            if v != fill:  # the weights say `fill`; the stamp must agree
                push_failures.append(f"push {fill} was stamped version {v}")
                fill = v
        except Exception as err:
            push_failures.append(f"{type(err).__name__}: {err}"[:300])
            fill -= 1
        now = time.monotonic()
        if now >= next_kill:
            i = rng.randrange(len(actors))
            ray.kill(actors[i], no_restart=False)
            stats[i]["kills"] += 1
            next_kill = now + rng.expovariate(1.0 / kill_every)
        if now >= next_status:
            note_errors()
            next_status = now + 1.0
        collect(timeout=interval)
    pushing_s = time.monotonic() - t_start

    # Settle: no more kills or pushes; every subscriber must end on the last version, whole.
    final = pushed[-1] if pushed else None
    lost: list[str] = []
    settle_s = 0.0
    if final is not None:
        t0 = time.monotonic()
        try:
            hub.wait(final, timeout=settle_timeout)
        except raysync.RaySyncError as err:
            lost.append(f"wait: {err}"[:500])
        settle_s = time.monotonic() - t0
    collect(timeout=5.0)
    note_errors()
    # A subscriber killed just after it applied the last version looks done to the hub
    # until it registers again: ask each until it answers from a process holding `final`.
    settle_deadline = time.monotonic() + settle_timeout
    finals = [_final_report(a, final, settle_deadline) for a in actors]
    for s, report in zip(stats, finals, strict=True):
        s["final"] = report["version"]
        s["pids"].add(report["pid"])
        s["applied"][report["pid"]] = max(s["applied"].get(report["pid"], 0), report["applied"])
        if torn(report):
            s["torn"] += 1
        if report["version"] != final:
            lost.append(f"{s['name']} ended on version {report['version']}, not {final}")
    registered = len(hub.status()["subscribers"])
    if registered != len(actors):
        lost.append(f"{registered} of {len(actors)} subscribers registered at the end")
    skipped = sorted(set(range(1, (final or 0) + 1)) - set(pushed))
    for a in actors:
        ray.kill(a)
    ray.kill(hub.actor)
    return {
        "seconds": round(pushing_s, 1),
        "settle_s": round(settle_s, 2),
        "size_mib": size_mib,
        "versions_pushed": len(pushed),
        "last_version": final,
        "version_numbers_skipped": skipped,
        "push_failures": push_failures,
        "apply_failures": sorted(f"{sub}: {err}" for sub, err in apply_errors),
        "kills": sum(s["kills"] for s in stats),
        "subscribers": [
            {
                "name": s["name"],
                "versions_applied": sum(s["applied"].values()),
                "versions_seen": len(s["seen"]),
                "processes": len(s["pids"]),
                "kills": s["kills"],
                "polls": s["polls"],
                "polls_interrupted": s["polls_interrupted"],
                "max_lag": s["max_lag"],
                "regressions": s["regressions"],
                "torn": s["torn"],
                "final": s["final"],
            }
            for s in stats
        ],
        "max_lag": max(s["max_lag"] for s in stats),
        "torn": sum(s["torn"] for s in stats),
        "regressions": sum(s["regressions"] for s in stats),
        "lost": lost,
        "ok": not lost
        and not push_failures
        and not skipped
        and sum(s["torn"] + s["regressions"] for s in stats) == 0,
    }


def _final_report(actor: Any, final: int | None, deadline: float) -> dict[str, Any]:
    """The subscriber's report once it holds ``final`` (or the last answer at ``deadline``)."""
    while True:
        try:
            report: dict[str, Any] = ray.get(
                actor.check.remote(), timeout=max(1.0, deadline - time.monotonic())
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
            continue
        if report["version"] == final or time.monotonic() >= deadline:
            return report
        time.sleep(0.1)


def print_soak(r: dict[str, Any]) -> None:
    print(
        f"soak: {r['seconds']} s of pushes ({r['size_mib']} MiB model), {r['kills']} kills, "
        f"settled in {r['settle_s']} s"
    )
    print(
        f"  versions pushed: {r['versions_pushed']} (last {r['last_version']}), "
        f"numbers skipped: {len(r['version_numbers_skipped'])}"
    )
    print(
        f"  {'subscriber':<14} {'applied':>7} {'seen':>5} {'procs':>5} {'kills':>5} {'polls':>6} "
        f"{'max_lag':>7} {'regress':>7} {'torn':>4} {'final':>6}"
    )
    for s in r["subscribers"]:
        print(
            f"  {s['name']:<14} {s['versions_applied']:>7} {s['versions_seen']:>5} {s['processes']:>5} "
            f"{s['kills']:>5} "
            f"{s['polls']:>6} {s['max_lag']:>7} {s['regressions']:>7} {s['torn']:>4} {s['final']!s:>6}"
        )
    print(f"  push failures: {len(r['push_failures'])} {r['push_failures'][:3]}")
    print(f"  apply failures: {len(r['apply_failures'])} {r['apply_failures'][:3]}")
    print(f"  maximum lag: {r['max_lag']} versions (at a poll, restarts included)")
    print(f"  torn: {r['torn']}, regressions: {r['regressions']}, lost: {r['lost'] or 'nothing'}")
    print(f"  {'OK' if r['ok'] else 'FAILED'}")


# ---------------------------------------------------------------------- resources


class StoreGauge:
    """Object-store bytes in use, as the raylet reports them (``ray memory --stats-only``)."""

    def __init__(self) -> None:
        from ray._private import internal_api

        self._api = internal_api
        self._state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)

    def used(self) -> int:
        return int(self._api.get_memory_info_reply(self._state).store_stats.object_store_bytes_used)

    def settle(self, at_most: int, timeout: float = 10.0) -> int:
        """Used bytes once Ray's batched frees landed (``<= at_most``), or the last read."""
        deadline = time.monotonic() + timeout
        used = self.used()
        while used > at_most and time.monotonic() < deadline:
            time.sleep(0.05)
            used = self.used()
        return used


def run_resources(
    *,
    size_mib: float = 256.0,
    pushes: int = 50,
    subscribers: int = 2,
    kinds: Sequence[str] = ("copy", "view"),
    keep: int = 2,
    tensors: int = 4,
    timeout: float = 120.0,
    every: int = 1,
) -> dict[str, Any]:
    """``pushes`` pushes with ``keep``: object-store bytes after each, subscriber memory too.

    Every ``every`` pushes (and after the last) it also waits for Ray's batched
    frees to land and reads the settled usage and each subscriber's memory.
    """
    hub_name = f"soak-res-{uuid.uuid4().hex[:8]}"
    hub = raysync.connect(hub_name, keep=keep)
    gauge = StoreGauge()
    kinds_used = [kinds[i % len(kinds)] for i in range(subscribers)]
    actors = [subscriber_class(hub_name, k, size_mib, tensors).remote() for k in kinds_used]
    ray.get([a.check.remote() for a in actors])
    model = Filled(size_mib, tensors)
    size = sum(p.numel() * 4 for p in model.parameters())
    baseline = gauge.used()
    store: list[int] = []
    settled: list[int] = []
    memory: list[list[dict[str, int]]] = []
    t0 = time.monotonic()
    for fill in range(1, pushes + 1):
        for p in model.parameters():
            p.data.fill_(float(fill))
        hub.push(model, wait=True, timeout=timeout, bucket_bytes=size // tensors)
        store.append(gauge.used() - baseline)
        if fill % every and fill != pushes:
            continue
        # Ray frees released objects in batches (about once a second): once they
        # landed, the kept versions and at most one retiring.
        settled.append(gauge.settle(baseline + (keep + 1) * size) - baseline)
        memory.append(ray.get([a.memory.remote() for a in actors]))
    elapsed = time.monotonic() - t0
    finals = ray.get([a.check.remote() for a in actors])
    torn_count = sum(torn(r) or r["version"] != pushes for r in finals)
    end = gauge.settle(baseline + keep * size) - baseline
    for a in actors:
        ray.kill(a)
    ray.kill(hub.actor)
    del hub  # the trainer's client holds its newest version (to offer a restarted hub) until it goes
    released = gauge.settle(baseline + size // 8) - baseline
    per_sub = []
    for i, kind in enumerate(kinds_used):
        rows = [m[i] for m in memory]
        per_sub.append(
            {
                "kind": kind,
                "rss_first_mib": rows[0]["rss"] / MiB,
                "rss_max_mib": max(r["rss"] for r in rows) / MiB,
                "rss_last_mib": rows[-1]["rss"] / MiB,
                "private_first_mib": rows[0]["private"] / MiB,
                "private_max_mib": max(r["private"] for r in rows) / MiB,
                "private_last_mib": rows[-1]["private"] / MiB,
            }
        )
    return {
        "size_mib": size / MiB,
        "pushes": pushes,
        "keep": keep,
        "seconds": round(elapsed, 1),
        "store_max_mib": max(store) / MiB,
        "store_mib": [round(s / MiB, 1) for s in store],
        "store_settled_max_mib": max(settled) / MiB,
        "store_settled_mib": [round(s / MiB, 1) for s in settled],
        "store_end_mib": end / MiB,
        "store_after_release_mib": released / MiB,
        "subscribers": per_sub,
        "not_whole_or_behind": torn_count,
    }


def print_resources(r: dict[str, Any]) -> None:
    size = r["size_mib"]
    print(f"resources: {r['pushes']} pushes of {size:.0f} MiB, keep={r['keep']}, {r['seconds']} s")
    print(
        f"  object store: max {r['store_max_mib']:.0f} MiB ({r['store_max_mib'] / size:.2f} versions) "
        "right after a push, max "
        f"{r['store_settled_max_mib']:.0f} MiB once frees landed ({r['store_settled_max_mib'] / size:.2f} "
        f"versions), {r['store_end_mib']:.0f} MiB at the end ({r['store_end_mib'] / size:.2f} versions), "
        f"{r['store_after_release_mib']:.0f} MiB after the hub was gone"
    )
    for s in r["subscribers"]:
        print(
            f"  subscriber ({s['kind']}): RSS {s['rss_first_mib']:.0f} -> {s['rss_last_mib']:.0f} MiB "
            f"(max {s['rss_max_mib']:.0f}); private {s['private_first_mib']:.0f} -> "
            f"{s['private_last_mib']:.0f} MiB (max {s['private_max_mib']:.0f})"
        )
    print(f"  subscribers not on the last version, whole: {r['not_whole_or_behind']}")


# ---------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300.0, help="how long to push (soak)")
    p.add_argument("--subscribers", type=int, default=None, help="soak 4, resources 2 (copy, view)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="subscriber kinds, cycled")
    p.add_argument("--size-mib", type=float, default=None, help="model size (soak 8, resources 256)")
    p.add_argument("--tensors", type=int, default=4, help="tensors (and buckets) per version")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between pushes (soak)")
    p.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between kills (soak)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resources", action="store_true", help="the keep=2 resource check instead")
    p.add_argument("--pushes", type=int, default=50, help="pushes (resources)")
    p.add_argument("--object-store-mib", type=int, default=1536, help="if this script starts Ray")
    p.add_argument("--json", type=Path, default=None, help="where to write the figures")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the soak (or ``--resources``), print the figures, write JSON; return the figures."""
    args = parse_args(argv)
    started = _ensure_ray(args.object_store_mib)
    try:
        if args.resources:
            result = run_resources(
                size_mib=args.size_mib or 256.0,
                pushes=args.pushes,
                subscribers=args.subscribers or 2,
                tensors=args.tensors,
            )
            print_resources(result)
            default_json = "soak_resources.json"
        else:
            result = run_soak(
                seconds=args.seconds,
                subscribers=args.subscribers or 4,
                kinds=args.kinds,
                size_mib=args.size_mib or 8.0,
                tensors=args.tensors,
                interval=args.interval,
                kill_every=args.kill_every,
                seed=args.seed,
            )
            print_soak(result)
            default_json = "soak.json"
    finally:
        if started:
            ray.shutdown()
    path = args.json or Path(__file__).resolve().parent / "results" / default_json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()

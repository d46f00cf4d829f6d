"""Small versions (RL policies) to N actors: raysync against Ray's floor and torchrl, one run.

For each size (default 4 KiB, 256 KiB and 4 MiB in 8 fp32 tensors) and N actors
(default 8), every row measured in the same run, medians of ``repeats`` after
``warmup``:

Ray floor
    ``ray.put`` of the weights (numpy buffers) plus N parallel calls to plain
    actors that ``ray.get`` the ref (zero-copy) and ``copy_`` it into their own
    tensors: what any Ray path that copies into N actors costs at least.
torchrl RayWeightSyncScheme
    torchrl 0.14.1's ``RayWeightSyncScheme.send`` (gloo, one send per tensor per
    actor), measured by :func:`_scheme_rows.measure_torchrl_ray`.
raysync hub, apply=copy / apply=view
    ``hub.push(sd)`` then ``hub.wait(v)`` to N ``@synced_model`` actors: push
    until every actor applied. The same loop times the trainer blocked
    (``hub.push`` returning) beside a bare ``ray.put`` of the same bytes, taken
    right before each push.
trainer blocked, no subscribers
    ``hub.push`` beside a bare ``ray.put`` of the same bytes, interleaved, and
    beside the floor of telling anyone about a put: ``ray.put`` plus one call
    to an async actor carrying the refs, at most 8 answers unread (as a push
    leaves them); the actor's CPU per call bounds how fast pushes can follow
    each other.

The breakdown of a raysync delivery (in every hub row): the push
returning, N parallel no-op calls to the receivers (Ray's cost of reaching N
actors), each subscriber's apply time as it reported it, and the wait.

Run::

    python benchmarks/small_versions.py                      # 4 KiB, 256 KiB, 4 MiB to 8 actors
    python benchmarks/small_versions.py --sizes-kib 256 --repeats 40
    python benchmarks/small_versions.py --blocking-only       # no actors: the trainer's block
    python benchmarks/small_versions.py --sizes-kib 256 --nodes 2   # actors on two simulated nodes
    python benchmarks/small_versions.py --help

Example:
    >>> rows = measure_size(256 * KIB, n=8, repeats=20, warmup=5)  # doctest: +SKIP
    >>> print_table(rows)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import ray
import torch

import _harness as harness
import _scheme_rows as scheme_rows
import raysync
from _fanout import receiver_class
from raysync.client.writer_lease import MAX_IN_FLIGHT

__all__ = [
    "KIB",
    "FloorActor",
    "SinkActor",
    "main",
    "measure_blocking",
    "measure_hub",
    "measure_ray_floor",
    "measure_size",
    "parse_args",
    "print_table",
    "targets",
]

logger = logging.getLogger(__name__)

KIB = 1024
TENSORS = 8


@ray.remote(num_cpus=1)
class FloorActor:
    """A plain actor with its own tensors: reads a ref zero-copy and ``copy_`` es it in (Ray's floor).

    Example:
        >>> actor = FloorActor.remote({"w00": 1024})  # doctest: +SKIP
        >>> ray.get(actor.apply.remote([ray.put([np.ones(1024, np.float32)])]))  # doctest: +SKIP
        1.0
    """

    def __init__(self, shapes: dict[str, int]) -> None:
        self.tensors = [torch.zeros(n) for n in shapes.values()]

    def apply(self, boxed: list[Any]) -> float:
        arrays = ray.get(boxed[0])  # zero-copy views of the object store
        for dst, src in zip(self.tensors, arrays, strict=True):
            dst.copy_(torch.from_numpy(src))
        return float(self.tensors[0][0])

    def noop(self) -> None:
        return None


@ray.remote(num_cpus=0)
class SinkActor:
    """An async actor that takes a list of refs and answers at once (the floor of a publish).

    Example:
        >>> ray.get(SinkActor.remote().take.remote([ray.put(1)]))  # doctest: +SKIP
        1
    """

    async def take(self, refs: list[Any]) -> int:
        return len(refs)


def _arrays(sd: dict[str, torch.Tensor]) -> list[np.ndarray]:
    return [t.numpy() for t in sd.values()]


def measure_ray_floor(sd: dict[str, torch.Tensor], n: int, repeats: int, warmup: int) -> dict[str, Any]:
    """``ray.put`` + N parallel actor calls that read the ref and ``copy_`` it (all returned).

    Example:
        >>> measure_ray_floor(harness.make_state_dict(256 * KIB, 8), 8, 20, 5)["send_s"]  # doctest: +SKIP
    """
    shapes = {k: v.numel() for k, v in sd.items()}
    actors = [cast(Any, FloorActor).options(**harness.placed(i)).remote(shapes) for i in range(n)]
    first = next(iter(sd.values()))
    try:
        ray.get([a.noop.remote() for a in actors])
        times, noops, value = [], [], 0.0
        for i in range(warmup + repeats):
            value = float(i + 1000)
            first[0] = value
            t0 = time.perf_counter()
            ref = ray.put(_arrays(sd))
            got = ray.get([a.apply.remote([ref]) for a in actors])
            dt = time.perf_counter() - t0
            t1 = time.perf_counter()
            ray.get([a.noop.remote() for a in actors])
            noop = time.perf_counter() - t1
            del ref
            if i >= warmup:
                times.append(dt)
                noops.append(noop)
        return {
            "path": "Ray floor: ray.put + N actor calls (get + copy_)",
            "send_s": statistics.median(times),
            "noop_calls_s": statistics.median(noops),
            "verified": all(g == value for g in got),
        }
    finally:
        harness.kill_all(actors)


def _subscribed(hub: raysync.HubClient, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(hub.status()["subscribers"]) < n:
        if time.monotonic() > deadline:
            raise harness.BenchError(f"only {len(hub.status()['subscribers'])} of {n} actors subscribed")
        time.sleep(0.05)


def _steady(hub: raysync.HubClient, sd: dict[str, torch.Tensor], timeout: float) -> None:
    """Until delivery takes its steady path: subscribers the hub does not ring itself wait for
    their node's relay to start (meanwhile the hub calls them directly)."""
    deadline = time.monotonic() + timeout
    while True:
        hub.wait(hub.push(sd), timeout=timeout)
        status = hub.status()
        rung_here = (status.get("here") or {}).get("members", 0)
        if status["relays"] or rung_here >= len(status["subscribers"]):
            return
        if time.monotonic() > deadline:
            raise harness.BenchError(f"no relay started within {timeout} s: {status['relays']}")
        time.sleep(0.2)


def measure_hub(
    sd: dict[str, torch.Tensor], n: int, repeats: int, warmup: int, apply: str, timeout: float = 120.0
) -> dict[str, Any]:
    """``hub.push`` then ``hub.wait`` to N ``@synced_model`` actors; the push's return beside a bare put.

    Example:
        >>> measure_hub(harness.make_state_dict(256 * KIB, 8), 8, 20, 5, "copy")["send_s"]  # doctest: +SKIP
    """
    hub_name = f"bench-small-{uuid.uuid4().hex[:8]}"
    hub = raysync.connect(hub_name)
    total = harness.model_bytes(sd)
    receiver = receiver_class(apply, hub_name)
    actors = [receiver.options(**harness.placed(i)).remote(total, len(sd)) for i in range(n)]
    first = next(iter(sd.values()))
    try:
        ray.get([a.ready.remote() for a in actors])
        _subscribed(hub, n)
        _steady(hub, sd, timeout)
        alls, pushes, puts, waits, noops, applies = [], [], [], [], [], []
        value = 0.0
        for i in range(warmup + repeats):
            value = float(i + 1000)
            first[0] = value
            t0 = time.perf_counter()
            bare = ray.put(_arrays(sd))  # the reference: the same bytes into the store
            put_s = time.perf_counter() - t0
            del bare
            t0 = time.perf_counter()
            version = hub.push(sd)
            t1 = time.perf_counter()
            hub.wait(version, timeout=timeout)
            t2 = time.perf_counter()
            if i >= warmup:
                alls.append(t2 - t0)
                pushes.append(t1 - t0)
                puts.append(put_s)
                waits.append(t2 - t1)
                applies += [s["last_apply_s"] for s in hub.status()["subscribers"] if s["last_apply_s"]]
                t3 = time.perf_counter()
                ray.get([a.ready.remote() for a in actors])
                noops.append(time.perf_counter() - t3)
        got = ray.get([a.probe.remote() for a in actors])
        return {
            "path": f"raysync hub.push + wait, apply={apply}",
            "send_s": statistics.median(alls),
            "push_s": statistics.median(pushes),
            "bare_put_s": statistics.median(puts),
            "wait_s": statistics.median(waits),
            "apply_s": statistics.median(applies) if applies else None,
            "noop_calls_s": statistics.median(noops),
            "verified": all(v == version and m == value for v, m in got),
        }
    finally:
        harness.kill_all([*actors, hub.actor])


def measure_blocking(sd: dict[str, torch.Tensor], repeats: int, warmup: int) -> dict[str, Any]:
    """The trainer blocked by ``hub.push`` (no subscribers) beside a bare ``ray.put``, interleaved.

    Example:
        >>> measure_blocking(harness.make_state_dict(4 * KIB, 8), 50, 10)["ratio"]  # doctest: +SKIP
    """
    hub_name = f"bench-small-{uuid.uuid4().hex[:8]}"
    hub = raysync.connect(hub_name)
    sink = cast(Any, SinkActor).remote()
    first = next(iter(sd.values()))
    try:
        ray.get(sink.take.remote([]))
        pushes, puts, floors = [], [], []
        unread: list[Any] = []
        for i in range(warmup + repeats):
            first[0] = float(i)
            t0 = time.perf_counter()
            bare = ray.put(_arrays(sd))
            t1 = time.perf_counter()
            del bare
            t2 = time.perf_counter()
            hub.push(sd)
            t3 = time.perf_counter()
            told = ray.put(_arrays(sd))
            unread.append(sink.take.remote([told]))
            if len(unread) > MAX_IN_FLIGHT:  # as a push: the oldest answers read beyond these
                ray.get(unread[:-MAX_IN_FLIGHT])
                unread = unread[-MAX_IN_FLIGHT:]
            t4 = time.perf_counter()
            del told
            if i >= warmup:
                puts.append(t1 - t0)
                pushes.append(t3 - t2)
                floors.append(t4 - t3)
        ray.get(unread)
        hub.wait(hub.latest() or 1, timeout=60)  # every publish answered (and none refused)
        push_s, put_s = statistics.median(pushes), statistics.median(puts)
        floor_s = statistics.median(floors)
        return {
            "path": "trainer blocked, no subscribers",
            "push_s": push_s,
            "bare_put_s": put_s,
            "put_and_call_s": floor_s,
            "ratio": push_s / put_s,
            "floor_ratio": floor_s / put_s,
        }
    finally:
        harness.kill_all([hub.actor, sink])


def measure_size(
    nbytes: int, *, n: int, repeats: int, warmup: int, torchrl: bool = True
) -> list[dict[str, Any]]:
    """Every row for one size: Ray's floor, torchrl, raysync copy and view, trainer blocking.

    Example:
        >>> rows = measure_size(256 * KIB, n=8, repeats=20, warmup=5)  # doctest: +SKIP
    """
    sd = harness.make_state_dict(nbytes, TENSORS)
    rows = [measure_ray_floor(sd, n, repeats, warmup)]
    if torchrl:
        try:
            row = scheme_rows.measure_torchrl_ray(sd, n, repeats, warmup)
            rows.append({"path": "torchrl 0.14.1 RayWeightSyncScheme.send", **_pick(row)})
        except ImportError as err:
            logger.warning("torchrl not installed (%s): its row is skipped", err)
    for apply in ("copy", "view"):
        rows.append(measure_hub(sd, n, repeats, warmup, apply))
    rows.append(measure_blocking(sd, repeats, warmup))
    for row in rows:
        row["bytes"] = harness.model_bytes(sd)
        row["n"] = n
    return rows


def _pick(row: dict[str, Any]) -> dict[str, Any]:
    return {"send_s": row["send_s"], "connect_s": row["connect_s"], "verified": row["verified"]}


def _size(nbytes: int) -> str:
    return f"{nbytes // KIB} KiB" if nbytes < 1024 * KIB else f"{nbytes // (1024 * KIB)} MiB"


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue-17 targets per size: at or below Ray's floor, 1.5x torchrl, blocked <= 2x a bare put.

    Example:
        >>> [t["met"] for t in targets(rows)]  # doctest: +SKIP
    """
    checks = []
    for nbytes in sorted({r["bytes"] for r in rows}):
        group = {r["path"]: r for r in rows if r["bytes"] == nbytes}
        floor = next((r for p, r in group.items() if p.startswith("Ray floor")), None)
        torchrl = next((r for p, r in group.items() if p.startswith("torchrl")), None)
        hubs = [r for p, r in group.items() if p.startswith("raysync hub")]
        best = min(hubs, key=lambda r: r["send_s"]) if hubs else None
        if floor is not None and best is not None:
            checks.append(
                {
                    "size": _size(nbytes),
                    "what": "push to all applied <= Ray floor",
                    "value": best["send_s"] / floor["send_s"],
                    "bound": 1.0,
                    "met": best["send_s"] <= floor["send_s"],
                }
            )
        if torchrl is not None and best is not None:
            checks.append(
                {
                    "size": _size(nbytes),
                    "what": "x faster than torchrl >= 1.5",
                    "value": torchrl["send_s"] / best["send_s"],
                    "bound": 1.5,
                    "met": torchrl["send_s"] / best["send_s"] >= 1.5,
                }
            )
        for r in [*hubs, *(r for p, r in group.items() if p.startswith("trainer"))]:
            ratio = r["push_s"] / r["bare_put_s"]
            floor_note = (
                f"; floor put + one call {r['floor_ratio']:.2f}x" if r.get("floor_ratio") is not None else ""
            )
            checks.append(
                {
                    "size": _size(nbytes),
                    "what": f"blocked <= 2x bare put ({r['path']}{floor_note})",
                    "value": ratio,
                    "bound": 2.0,
                    "met": ratio <= 2.0,
                }
            )
    return checks


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows and the target checks, on stdout.

    Example:
        >>> print_table(rows)  # doctest: +SKIP
    """
    print(f"\nSmall versions to N actors, {TENSORS} fp32 tensors, medians, one run:")
    head = f"{'size':>8} {'N':>2}  {'path':<48} {'all applied ms':>14} {'push ms':>8} {'put ms':>7}"
    print(head + f" {'put+call ms':>11} {'apply ms':>8} {'N no-op calls ms':>16}  ok")
    for r in rows:

        def ms(key: str, row: dict[str, Any] = r) -> str:
            value = row.get(key)
            return "-" if value is None else f"{value * 1e3:.2f}"

        print(
            f"{_size(r['bytes']):>8} {r['n']:>2}  {r['path']:<48} {ms('send_s'):>14} {ms('push_s'):>8} "
            f"{ms('bare_put_s'):>7} {ms('put_and_call_s'):>11} {ms('apply_s'):>8} "
            f"{ms('noop_calls_s'):>16}  {r.get('verified', '-')}"
        )
    print(
        "\nTargets (the project's, set on its 2-core reference machine; a MISS does not change the "
        "exit code):"
    )
    for c in targets(rows):
        print(
            f"  {'met ' if c['met'] else 'MISS'}  {c['size']:>8}  {c['what']}: "
            f"{c['value']:.2f} (bound {c['bound']})"
        )


def parse_args(
    argv: Sequence[str] | None = None, *, results_dir: str | os.PathLike[str] | None = None
) -> argparse.Namespace:
    """The options (``--help`` lists them).

    Example:
        >>> parse_args(["--sizes-kib", "256"]).sizes_kib
        [256]
    """
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--sizes-kib", type=int, nargs="+", default=[4, 256, 4096], help="sizes (default: 4 256 4096)"
    )
    harness.add_options(p, actors=[8], repeats=20, warmup=5)
    p.add_argument("--no-torchrl", action="store_true", help="skip torchrl's row")
    p.add_argument(
        "--nodes",
        type=int,
        choices=(1, 2),
        default=1,
        help="simulated nodes (raylets with their own object stores); with 2, each row's actors "
        "alternate between the trainer's node and the other",
    )
    p.add_argument(
        "--blocking-only",
        action="store_true",
        help="only the trainer blocked on a hub with no subscribers beside a bare put (no actors: quick)",
    )
    harness.add_options(p, json=harness.results_path("small_versions.json", results_dir), verbose=True)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, results_dir: str | os.PathLike[str] | None = None) -> int:
    """Run every size and N; print the table and targets; write the JSON. 0 if every row verified.

    Example:
        >>> main(["--sizes-kib", "4", "--repeats", "5"])  # doctest: +SKIP
        0
    """
    started = time.time()
    args = parse_args(argv, results_dir=results_dir)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr)
    rows: list[dict[str, Any]] = []
    n_max = max(args.actors)
    cluster = (
        harness.local_cluster(num_cpus=n_max + 2, object_store_bytes=1024 * harness.MIB)
        if args.nodes == 1
        else harness.simulated_nodes(args.nodes, num_cpus=n_max + 2, object_store_bytes=1024 * harness.MIB)
    )
    with cluster:
        for kib in args.sizes_kib:
            if args.blocking_only:
                row = measure_blocking(harness.make_state_dict(kib * KIB, TENSORS), args.repeats, args.warmup)
                rows.append({**row, "bytes": kib * KIB, "n": 0})
                continue
            for n in args.actors:
                logger.info("measuring %s to %d actors", _size(kib * KIB), n)
                measured = measure_size(
                    kib * KIB, n=n, repeats=args.repeats, warmup=args.warmup, torchrl=not args.no_torchrl
                )
                rows += [{**row, "nodes": args.nodes} for row in measured]
    print_table(rows)
    meta = harness.run_meta("benchmarks/small_versions.py", argv, started=started, options=args)
    harness.write_json(args.json, {"meta": meta, "rows": rows, "targets": targets(rows)})
    print(f"\nresults: {args.json}")
    return 0 if all(r.get("verified", True) is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

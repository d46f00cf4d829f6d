"""Push fan-out on one node: raysync against the memory-copy floor, measured in one run.

For every model size (an fp32 state dict of ``--tensors`` equal tensors, 16 by
default), every number N of receiver actors and every apply mode (``copy``,
``view``) this script measures, with ``--repeats`` timed pushes (medians
reported) after ``--warmup`` untimed ones:

push-to-all-applied
    ``hub.push(sd, wait=True, timeout=...)``: from the call until every
    ``@synced_model`` receiver applied the version. The pieces are recorded
    too: the snapshot inside ``push`` (``HubClient.last_push["snapshot_s"]``, or
    raysync's own debug log line on versions without it),
    each receiver's fetch+apply time (``last_apply_s`` in ``hub.status()``),
    and the rest (hub round trips, delivery calls).

trainer blocking
    a separate ``hub.push(sd)`` (``wait=False``), timed alone, followed by an
    untimed ``hub.wait(v)``.

object-store bytes per version
    the object store's used bytes, read from the raylet
    (``ray._private.internal_api.get_memory_info_reply(...).store_stats
    .object_store_bytes_used``, the number ``ray memory --stats-only`` prints
    as "Plasma memory usage"). ``ray.available_resources()["object_store_memory"]``
    does *not* move when objects are stored, so it is not used. Reported:
    the increase caused by the first push (one version) and, after the last
    push, ``(used - baseline) / versions kept`` (the hub keeps ``--keep``).
    One copy per version means both equal the model's size, whatever N.

the copy floor (same run, same machine state)
    one ``dst.copy_(src)`` of the whole model (one flat buffer) in the driver
    (the snapshot) plus N simultaneous ``dst.copy_(src)`` of the model in N
    plain Ray actors (the receivers), each into its own preallocated,
    pre-faulted buffer. The source is by default one ``/dev/shm`` file mapped
    by every actor (like the object store: one shared copy per node, read by
    all); ``--floor-source private`` gives each actor its own source buffer
    instead (twice the memory). The N copies start together at an agreed
    wall-clock instant (the actors share the node's clock) and the
    simultaneous time is the last end minus the first start. As a cross-check
    the driver's launch-to-done time minus the fan-out time of N empty calls is
    recorded too. floor = snapshot copy + simultaneous receiver copies.

receiver memory
    RSS and private RSS (RSS minus shared pages) of each receiver after the
    last push (``psutil``), to compare ``view`` with ``copy``.

Each configuration gets a fresh hub and fresh actors, and everything is
killed before the next one. Every receiver's final version and a marker value
written into the pushed weights are checked after the last push.

Run (a full run takes several minutes and needs about 16 GiB of RAM at its peak)::

    python benchmarks/push_fanout.py                     # 256 MiB and 1 GiB, N = 1 2 4 8
    python benchmarks/push_fanout.py --quick             # 16 MiB, N = 1 2, 2 repeats (about a minute)
    python benchmarks/push_fanout.py --sizes-mib 64 --actors 1 4 --apply view --repeats 3

Results: a table on stdout and JSON in ``--json`` (default
``benchmarks/results/push_fanout.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

import raysync

sys.path.insert(0, str(Path(__file__).resolve().parent))
import adapters as _adapter_rows  # next to this script (benchmarks/adapters.py); shipped by value
import scheme_rows as _scheme_rows  # next to this script; shipped to actors by value
from scheme_rows import (
    measure_mp_rows,
    measure_scheme_rows,
    print_scheme_checks,
    print_scheme_table,
    scheme_checks,
)

ray.cloudpickle.register_pickle_by_value(_scheme_rows)
ray.cloudpickle.register_pickle_by_value(_adapter_rows)

logger = logging.getLogger("push_fanout")

MIB = 2**20
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "push_fanout.json"

# Targets from /work/shared/ANCHORS.md ("Where raysync must land", CPU).
TARGET_APPLIED_VS_FLOOR = 1.3
TARGET_VIEW_FLAT = 1.5
TARGET_BLOCK_VS_SNAPSHOT = 1.3
TARGET_BLOCK_FLAT = 1.3  # "the same for N = 1 and N = 8": read as within the same 1.3x
TARGET_COPIES_PER_VERSION = 1.1  # one copy (allowing for Ray's per-object metadata)


# ---------------------------------------------------------------------- model


class Blob(torch.nn.Module):
    """A model that is only weights: ``num_tensors`` fp32 parameters ``w00``, ``w01``, ...

    Parameters are ``torch.empty`` (not touched, so not resident until written).
    """

    def __init__(self, total_bytes: int, num_tensors: int) -> None:
        super().__init__()
        numel = tensor_numel(total_bytes, num_tensors)
        for i in range(num_tensors):
            self.register_parameter(f"w{i:02d}", torch.nn.Parameter(torch.empty(numel), requires_grad=False))


def tensor_numel(total_bytes: int, num_tensors: int) -> int:
    """Elements per fp32 tensor so that ``num_tensors`` of them make ``total_bytes``."""
    return total_bytes // 4 // num_tensors


def make_state_dict(total_bytes: int, num_tensors: int) -> dict[str, torch.Tensor]:
    """The trainer's weights: a plain fp32 state dict, every page written (resident)."""
    numel = tensor_numel(total_bytes, num_tensors)
    return {f"w{i:02d}": torch.full((numel,), float(i)) for i in range(num_tensors)}


# ---------------------------------------------------------------------- actors


class Receiver:
    """A receiver: holds a :class:`Blob` in ``self.policy``; decorated per run with
    ``@raysync.synced_model("policy", apply=...)`` and ``@ray.remote``."""

    def __init__(self, total_bytes: int, num_tensors: int) -> None:
        self.policy = Blob(total_bytes, num_tensors)

    def ready(self) -> int:
        return os.getpid()

    def probe(self) -> tuple[int | None, float]:
        """The version held and the marker value (first element of ``w00``)."""
        version: int | None = self.raysync_version()  # type: ignore[attr-defined]
        marker = self.policy.get_parameter("w00")[0]
        return version, float(marker)

    def memory(self) -> dict[str, int]:
        import psutil  # shipped inside ray (ray/thirdparty_files), importable once ray is

        info = psutil.Process().memory_info()
        return {
            "rss": int(info.rss),
            "shared": int(info.shared),
            "private": int(info.rss - info.shared),
        }


class FloorReceiver:
    """A plain actor for the floor: a preallocated destination, one source, one ``copy_``."""

    def __init__(self, nbytes: int, src_path: str | None) -> None:
        self.dst = torch.empty(nbytes, dtype=torch.uint8)
        self.dst.fill_(0)  # fault every page in now, not during the timed copies
        self._map: np.memmap | None = None
        if src_path is None:
            self.src = torch.full((nbytes,), 1, dtype=torch.uint8)
        else:
            self._map = np.memmap(src_path, dtype=np.uint8, mode="r+", shape=(nbytes,))
            self.src = torch.from_numpy(self._map)
        self.dst.copy_(self.src)  # map the source's pages into this process

    def noop(self) -> None:
        return None

    def copy(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0

    def copy_at(self, start_at: float) -> tuple[float, float]:
        """Wait until wall-clock ``start_at``, copy, return (start, end) wall-clock times."""
        while True:
            left = start_at - time.time()
            if left <= 0:
                break
            time.sleep(min(left, 0.001) if left < 0.005 else left - 0.004)
        t0 = time.time()
        self.dst.copy_(self.src)
        return t0, time.time()


# ---------------------------------------------------------------------- measuring helpers


class ObjectStoreGauge:
    """Bytes used in the object store, as the raylet reports them (``ray memory --stats-only``)."""

    def __init__(self) -> None:
        from ray._private import internal_api

        self._api = internal_api
        self._state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)

    def used(self) -> int:
        reply = self._api.get_memory_info_reply(self._state)
        return int(reply.store_stats.object_store_bytes_used)

    def settle(self, at_most: int | None = None, timeout: float = 10.0) -> int:
        """Used bytes once frees have landed: until ``<= at_most`` or two equal reads."""
        deadline = time.monotonic() + timeout
        last = self.used()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.used()
            if (at_most is not None and now <= at_most) or (at_most is None and now == last):
                return now
            last = now
        logger.warning("object store did not settle within %.0f s (used %d bytes)", timeout, last)
        return last


class SnapshotLogCapture(logging.Handler):
    """Collect ``snapshot_s`` from raysync's debug line "pushed ... snapshot %.3f s".

    The fallback for raysync versions whose ``HubClient`` has no ``last_push``.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.snapshots: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("pushed %r version") and record.args:
            with contextlib.suppress(Exception):
                self.snapshots.append(float(record.args[-1]))  # type: ignore[index,arg-type]

    def take(self) -> float | None:
        value = self.snapshots[-1] if self.snapshots else None
        self.snapshots.clear()
        return value


def median(values: Sequence[float | None]) -> float | None:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


@contextlib.contextmanager
def shared_source(nbytes: int) -> Iterator[str]:
    """A ``/dev/shm`` file of ``nbytes`` (all written) that floor actors map as their source."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(directory, f"raysync-bench-src-{uuid.uuid4().hex[:8]}")
    mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(nbytes,))
    mm[:] = 1
    mm.flush()
    del mm
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def wait_until_quiet(busy_below: float = 50.0, timeout: float = 5.0) -> float:
    """Wait (bounded) until the node's CPUs are mostly idle, e.g. after actors started.

    Returns the last CPU utilisation seen, in percent of all cores (a noise indicator).
    """
    import psutil  # shipped inside ray (ray/thirdparty_files), importable once ray is

    deadline = time.monotonic() + timeout
    busy = psutil.cpu_percent(interval=0.2)
    while busy >= busy_below and time.monotonic() < deadline:
        busy = psutil.cpu_percent(interval=0.2)
    if busy >= busy_below:
        logger.info("CPUs still %.0f%% busy (other processes?): timings will be noisy", busy)
    return busy


def prefault_object_store(capacity: int, fraction: float = 0.9, chunk: int = 128 * MIB) -> float:
    """Fill the object store once and free it, so no timed ``ray.put`` pays first-touch faults.

    A fresh store's shared-memory pages are allocated (and zeroed) by the kernel
    the first time anything writes them, which makes the first few pushes of a
    run several times slower than the steady state a long-running trainer sees.
    Returns the seconds this took.
    """
    t0 = time.perf_counter()
    block = np.ones(chunk, dtype=np.uint8)
    held = [ray.put(block) for _ in range(int(capacity * fraction) // chunk)]
    del held, block
    logger.info(
        "object store pre-faulted (%.1f GiB) in %.1f s",
        capacity * fraction / 2**30,
        time.perf_counter() - t0,
    )
    return time.perf_counter() - t0


def kill_all(actors: Sequence[Any]) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)


# ---------------------------------------------------------------------- floor


def measure_snapshot_floor(src: torch.Tensor, repeats: int) -> dict[str, Any]:
    """One whole-model ``dst.copy_(src)`` in the driver (the snapshot), into a pre-faulted dst."""
    dst = torch.empty_like(src)
    dst.fill_(0)
    timed_copy(dst, src)  # warm-up
    samples = [timed_copy(dst, src) for _ in range(repeats)]
    del dst
    return {"snapshot_copy_s": median(samples), "snapshot_copy_samples": samples}


def measure_receiver_floor(nbytes: int, n: int, repeats: int, source: str, timeout: float) -> dict[str, Any]:
    """N simultaneous memory-to-memory copies of ``nbytes`` in N plain Ray actors."""
    floor_cls: Any = ray.remote(num_cpus=1)(FloorReceiver)
    with contextlib.ExitStack() as stack:
        path = stack.enter_context(shared_source(nbytes)) if source == "shared" else None
        actors = [floor_cls.remote(nbytes, path) for _ in range(n)]
        stack.callback(kill_all, actors)
        ray.get([a.noop.remote() for a in actors], timeout=timeout)
        ray.get([a.copy.remote() for a in actors], timeout=timeout)  # warm-up, together
        cpu_busy = wait_until_quiet()
        lead = 0.05 + 0.01 * n  # time for every call to reach its actor before the start
        walls, per_actor, driver_walls, noop_walls = [], [], [], []
        for _ in range(repeats):
            start_at = time.time() + lead
            spans = ray.get([a.copy_at.remote(start_at) for a in actors], timeout=timeout)
            walls.append(max(e for _, e in spans) - min(s for s, _ in spans))
            per_actor.append(statistics.mean(e - s for s, e in spans))
            t0 = time.perf_counter()
            ray.get([a.noop.remote() for a in actors], timeout=timeout)
            noop_walls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.get([a.copy.remote() for a in actors], timeout=timeout)
            driver_walls.append(time.perf_counter() - t0)
        noop = median(noop_walls) or 0.0
    return {
        "recv_copy_wall_s": median(walls),
        "recv_copy_wall_samples": walls,
        "recv_copy_per_actor_s": median(per_actor),
        "recv_copy_driver_s": max(0.0, (median(driver_walls) or 0.0) - noop),
        "empty_call_fanout_s": noop,
        "floor_source": source,
        "floor_cpu_busy_before": cpu_busy,
    }


# ---------------------------------------------------------------------- raysync


def receiver_class(apply: str, hub_name: str) -> Any:
    """:class:`Receiver` under ``@raysync.synced_model(apply=...)`` and ``@ray.remote``."""
    decorate = raysync.synced_model("policy", model_id="policy", hub=hub_name, apply=apply)  # type: ignore[arg-type]
    return ray.remote(num_cpus=1)(decorate(Receiver))


def measure_raysync(
    sd: dict[str, torch.Tensor],
    *,
    apply: str,
    n: int,
    args: argparse.Namespace,
    gauge: ObjectStoreGauge,
    capture: SnapshotLogCapture,
) -> dict[str, Any]:
    """One configuration: a fresh hub and N fresh receivers; warm-up, then timed pushes."""
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    hub_name = f"bench-{uuid.uuid4().hex[:8]}"
    t_setup = time.perf_counter()
    cls = receiver_class(apply, hub_name)
    # Start the receivers first: their processes start while connect() starts the hub's.
    actors = [cls.remote(model_bytes, len(sd)) for _ in range(n)]
    hub = raysync.connect(hub_name, keep=args.keep)
    pushes = 0

    def push(wait: bool) -> tuple[int, float]:
        nonlocal pushes
        pushes += 1
        sd["w00"][0] = float(pushes)  # a marker the receivers must end up holding
        t0 = time.perf_counter()
        v = hub.push(sd, "policy", wait=wait, timeout=args.timeout if wait else None)
        return v, time.perf_counter() - t0

    def apply_times() -> list[float]:
        return [s["last_apply_s"] for s in hub.status()["subscribers"] if s["last_apply_s"] is not None]

    try:
        ray.get([a.ready.remote() for a in actors], timeout=args.timeout)  # all registered
        cpu_busy = wait_until_quiet()
        baseline = gauge.settle()
        t_warm = time.perf_counter()
        push(wait=True)
        first_version_bytes = gauge.used() - baseline
        for _ in range(args.warmup - 1):
            push(wait=True)
        capture.take()
        t_timed = time.perf_counter()

        applied, blocks, waits, apply_max, apply_med = [], [], [], [], []
        snapshots: list[float | None] = []
        wait_applies: list[float] = []
        for _ in range(args.repeats):
            _, dt = push(wait=True)
            applied.append(dt)
            logged = capture.take()
            last_push = getattr(hub, "last_push", None)  # newer raysync: HubClient.last_push
            if isinstance(last_push, dict) and last_push.get("snapshot_s") is not None:
                snapshots.append(float(last_push["snapshot_s"]))
            else:
                snapshots.append(logged)
            times = apply_times()
            apply_max.append(max(times))
            apply_med.append(statistics.median(times))

            v, block = push(wait=False)
            capture.take()
            t0 = time.perf_counter()
            hub.wait(v, "policy", timeout=args.timeout)
            waits.append(time.perf_counter() - t0)
            blocks.append(block)
            wait_applies.append(max(apply_times()))

        status = hub.status()
        model_status = status["models"]["policy"]
        kept = len(model_status["versions_kept"])
        used_end = gauge.settle(at_most=baseline + kept * model_bytes + MIB) - baseline
        probes = ray.get([a.probe.remote() for a in actors], timeout=args.timeout)
        last = model_status["latest"]
        verified = all(v == last and marker == float(pushes) for v, marker in probes)
        if not verified:
            logger.error("receivers hold %s, expected version %s with marker %s", probes, last, pushes)
        mems = ray.get([a.memory.remote() for a in actors], timeout=args.timeout)
        t_down = time.perf_counter()
    finally:
        kill_all(actors)
        with contextlib.suppress(Exception):
            ray.kill(hub.actor)
    gauge.settle(at_most=baseline + MIB, timeout=30)
    logger.info(
        "setup %.1f s, warm-up %.1f s, timed %.1f s, teardown %.1f s",
        t_warm - t_setup,
        t_timed - t_warm,
        t_down - t_timed,
        time.perf_counter() - t_down,
    )

    applied_s = median(applied)
    snapshot_s = median(snapshots)
    block_s = median(blocks)
    wait_s = median(waits)
    return {
        "push_to_all_applied_s": applied_s,
        "push_to_all_applied_samples": applied,
        "snapshot_in_push_s": snapshot_s,
        "receiver_apply_max_s": median(apply_max),
        "receiver_apply_max_samples": apply_max,
        "receiver_apply_median_s": median(apply_med),
        "rest_s": None
        if applied_s is None or snapshot_s is None
        else applied_s - snapshot_s - (median(apply_max) or 0.0),
        "trainer_block_s": block_s,
        "trainer_block_samples": blocks,
        "wait_after_push_s": wait_s,
        "wait_after_push_samples": waits,
        "receiver_apply_max_after_nowait_push_samples": wait_applies,
        "block_plus_wait_s": None if block_s is None or wait_s is None else block_s + wait_s,
        "store_baseline_bytes": baseline,
        "store_first_version_bytes": first_version_bytes,
        "store_versions_kept": kept,
        "store_used_end_bytes": used_end,
        "store_bytes_per_version": used_end / kept if kept else None,
        "store_copies_per_version": (used_end / kept) / model_bytes if kept else None,
        "hub_bytes_per_version": model_status["bytes_per_version"],
        "buckets": model_status["buckets"],
        "receiver_rss_bytes": median([m["rss"] for m in mems]),
        "receiver_private_rss_bytes": median([m["private"] for m in mems]),
        "verified": verified,
        "cpu_busy_before": cpu_busy,
    }


# ---------------------------------------------------------------------- report


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'size':>8} {'apply':>5} {'N':>2} | {'applied_s':>9} {'floor_s':>8} {'ratio':>6} "
        f"{'vs_N1':>6} | {'block_s':>8} {'put_s':>6} {'snap_s':>7} {'blk/snap':>8} "
        f"{'blk_vsN1':>8} | "
        f"{'store_MiB/v':>11} {'copies/v':>8} | {'recv_apply':>10} {'priv_MiB':>8} {'ok':>3}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['size_mib']:>4} MiB {r['apply']:>5} {r['n']:>2} | "
            f"{fmt(r['push_to_all_applied_s']):>9} {fmt(r['floor_s']):>8} "
            f"{fmt(r['ratio_to_floor'], '.2f'):>6} {fmt(r['applied_vs_n1'], '.2f'):>6} | "
            f"{fmt(r['trainer_block_s']):>8} {fmt(r['snapshot_in_push_s']):>6} "
            f"{fmt(r['snapshot_copy_s']):>7} "
            f"{fmt(r['block_vs_snapshot'], '.2f'):>8} {fmt(r['block_vs_n1'], '.2f'):>8} | "
            f"{fmt(r['store_bytes_per_version'] / MIB, '.1f'):>11} "
            f"{fmt(r['store_copies_per_version'], '.2f'):>8} | "
            f"{fmt(r['receiver_apply_max_s']):>10} "
            f"{fmt(r['receiver_private_rss_bytes'] / MIB, '.0f'):>8} "
            f"{'yes' if r['verified'] else 'NO':>3}"
        )
    legend = [
        "applied_s: hub.push(wait=True) until every receiver applied (median)",
        "floor_s: one snapshot copy_ in the driver + N simultaneous copy_ in N plain actors",
        "ratio = applied_s / floor_s; vs_N1 = applied_s / same size and apply at the smallest N",
        "block_s: how long hub.push(wait=False) blocks; put_s: the snapshot (ray.put) inside push",
        "snap_s: one whole-model copy_ in the driver; blk/snap = block_s / snap_s",
        "blk_vsN1 = block_s / the same size and apply at the smallest N",
        "store_MiB/v: object-store bytes used / versions kept; copies/v = that / model bytes",
        "recv_apply: slowest receiver's fetch + apply; priv_MiB: receiver RSS minus shared pages",
        "ok: every receiver ended on the last version with the pushed marker value",
    ]
    print("\n" + "\n".join(legend))


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per target and row group: the measured value, the bound, met or not."""
    checks: list[dict[str, Any]] = []

    def add(target: str, where: str, value: float | None, bound: float) -> None:
        checks.append(
            {
                "target": target,
                "where": where,
                "value": value,
                "bound": bound,
                "met": value is not None and value <= bound,
            }
        )

    for r in rows:
        where = f"{r['size_mib']} MiB {r['apply']} N={r['n']}"
        add("push-to-all-applied / floor", where, r["ratio_to_floor"], TARGET_APPLIED_VS_FLOOR)
        add("trainer block / snapshot copy", where, r["block_vs_snapshot"], TARGET_BLOCK_VS_SNAPSHOT)
        add(
            "object-store copies per version",
            where,
            r["store_copies_per_version"],
            TARGET_COPIES_PER_VERSION,
        )
    groups = sorted({(r["size_mib"], r["apply"]) for r in rows})
    for size, apply in groups:
        grp = sorted((r for r in rows if (r["size_mib"], r["apply"]) == (size, apply)), key=lambda r: r["n"])
        if len(grp) < 2:
            continue
        lo, hi = grp[0], grp[-1]
        where = f"{size} MiB {apply} N={hi['n']}/N={lo['n']}"
        if apply == "view":
            add("view: push-to-all-applied flat in N", where, hi["applied_vs_n1"], TARGET_VIEW_FLAT)
        add("trainer block flat in N", where, hi["block_vs_n1"], TARGET_BLOCK_FLAT)
    return checks


def print_checks(checks: list[dict[str, Any]]) -> None:
    print(
        "\nTargets (ANCHORS.md): push-to-all-applied <= 1.3x floor; view N=max/N=min <= 1.5x; "
        "trainer block <= 1.3x one snapshot copy and the same for every N; one copy per version."
    )
    width = max(len(c["target"]) for c in checks) if checks else 0
    for c in checks:
        print(
            f"  {'met ' if c['met'] else 'MISS'}  {c['target']:<{width}}  {c['where']:<24} "
            f"{fmt(c['value'], '.2f'):>6} (<= {c['bound']})"
        )
    missed = sum(not c["met"] for c in checks)
    print(f"  {len(checks) - missed}/{len(checks)} met")


# ---------------------------------------------------------------------- main


def git_state() -> dict[str, Any]:
    """The checkout the numbers came from: HEAD and whether raysync/ had uncommitted changes."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", *argv], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    out: dict[str, Any] = {"commit": None, "raysync_dirty": None}
    with contextlib.suppress(Exception):
        out["commit"] = git("rev-parse", "HEAD")
        out["raysync_dirty"] = bool(git("status", "--porcelain", "--", "raysync"))
    return out


def raysync_fingerprint() -> str:
    """A hash of raysync's source files as they are on disk now.

    Actors import raysync from disk when they start, the driver once at start-up:
    if the source changes during a run, later configurations mix two versions.
    """
    digest = hashlib.sha1()
    for path in sorted(Path(raysync.__file__).resolve().parent.rglob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024], help="model sizes in MiB")
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4, 8], help="receiver counts N")
    p.add_argument("--apply", nargs="+", choices=["copy", "view"], default=["copy", "view"])
    p.add_argument("--repeats", type=int, default=5, help="timed pushes per configuration (medians)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed pushes per configuration (default: keep + 2, at least 1)",
    )
    p.add_argument("--tensors", type=int, default=16, help="equal fp32 tensors per model")
    p.add_argument("--keep", type=int, default=2, help="versions the hub keeps")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for any one wait")
    p.add_argument(
        "--floor-source",
        choices=["shared", "private"],
        default="shared",
        help="floor receivers copy from one shared /dev/shm source or each from its own buffer "
        "(private: 2x the model per actor, too much for 1 GiB x 8 on 24 GiB)",
    )
    p.add_argument(
        "--object-store-mib",
        type=int,
        default=None,
        help="object store size (default: (keep + 2) x largest model, >= 1 GiB)",
    )
    p.add_argument(
        "--no-prefault",
        action="store_true",
        help="do not fill and free the object store once before measuring",
    )
    p.add_argument(
        "--schemes",
        action="store_true",
        help="also measure torchrl 0.14's RayWeightSyncScheme beside raysync's schemes (scheme_rows.py)",
    )
    p.add_argument("--schemes-only", action="store_true", help="only the --schemes rows")
    p.add_argument(
        "--adapters",
        action="store_true",
        help="also measure N receivers behind one pipe / distributed / rpc adapter against N synced "
        "actors fetching on their own (benchmarks/adapters.py), at the largest N",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 MiB, N = 1 2, 2 repeats")
    p.add_argument("--verbose", action="store_true", help="debug logging, Ray worker logs shown")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes_mib, args.actors, args.repeats = [16], [1, 2], 2
    args.warmup = max(1, args.keep + 2 if args.warmup is None else args.warmup)
    args.actors = sorted(set(args.actors))
    if min(args.actors) < 1 or args.repeats < 1:
        p.error("--actors and --repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    capture = SnapshotLogCapture()
    hub_logger = logging.getLogger("raysync.hub")
    hub_logger.setLevel(logging.DEBUG)
    hub_logger.addHandler(capture)

    max_bytes = max(args.sizes_mib) * MIB
    store = args.object_store_mib * MIB if args.object_store_mib else max(2**30, (args.keep + 2) * max_bytes)
    ray.init(
        num_cpus=max(args.actors) + 2,
        object_store_memory=store,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=args.verbose,
    )
    gauge = ObjectStoreGauge()
    prefault_s = None if args.no_prefault else prefault_object_store(store)
    gauge.settle(at_most=MIB, timeout=30)
    rows: list[dict[str, Any]] = []
    scheme_rows: list[dict[str, Any]] = []
    adapter_rows: list[dict[str, Any]] = []
    t_start = time.time()
    source_start = raysync_fingerprint()
    try:
        for size_mib in args.sizes_mib:
            nbytes = size_mib * MIB
            sd = make_state_dict(nbytes, args.tensors)
            model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
            flat_src = torch.empty(model_bytes, dtype=torch.uint8)
            flat_src.fill_(1)
            for n in args.actors if args.schemes or args.schemes_only else ():
                logger.info("%d MiB, N=%d: torchrl and raysync schemes", size_mib, n)
                floor = measure_snapshot_floor(flat_src, args.repeats)
                floor.update(
                    measure_receiver_floor(model_bytes, n, args.repeats, args.floor_source, args.timeout)
                )
                for row in measure_scheme_rows(
                    sd,
                    n=n,
                    repeats=args.repeats,
                    warmup=args.warmup,
                    receiver_class=receiver_class,
                    floor_s=floor["snapshot_copy_s"] + floor["recv_copy_wall_s"],
                ):
                    row["size_mib"] = size_mib
                    scheme_rows.append(row)
                for row in measure_mp_rows(sd, n=n, repeats=args.repeats, warmup=args.warmup):
                    row["size_mib"] = size_mib
                    scheme_rows.append(row)
            for n in args.actors if not args.schemes_only else ():
                logger.info("%d MiB, N=%d: floor", size_mib, n)
                floor = measure_snapshot_floor(flat_src, args.repeats)
                floor.update(
                    measure_receiver_floor(model_bytes, n, args.repeats, args.floor_source, args.timeout)
                )
                floor["floor_s"] = floor["snapshot_copy_s"] + floor["recv_copy_wall_s"]
                for apply in args.apply:
                    logger.info("%d MiB, N=%d, apply=%s: raysync", size_mib, n, apply)
                    result = measure_raysync(sd, apply=apply, n=n, args=args, gauge=gauge, capture=capture)
                    row = {"size_mib": size_mib, "model_bytes": model_bytes, "apply": apply, "n": n}
                    row.update(floor)
                    row.update(result)
                    row["ratio_to_floor"] = ratio(row["push_to_all_applied_s"], row["floor_s"])
                    row["block_vs_snapshot"] = ratio(row["trainer_block_s"], row["snapshot_copy_s"])
                    rows.append(row)
            del sd, flat_src
            if args.adapters:
                ns = argparse.Namespace(tensors=args.tensors, repeats=args.repeats, timeout=args.timeout)
                for kind in ("actors", "pipe", "distributed", "rpc"):
                    logger.info("%d MiB, N=%d: %s", size_mib, max(args.actors), kind)
                    adapter_rows.append(_adapter_rows.measure(kind, size_mib, max(args.actors), ns))
    finally:
        ray.shutdown()

    for r in rows:
        base = min(
            (x for x in rows if (x["size_mib"], x["apply"]) == (r["size_mib"], r["apply"])),
            key=lambda x: x["n"],
        )
        r["applied_vs_n1"] = ratio(r["push_to_all_applied_s"], base["push_to_all_applied_s"])
        r["block_vs_n1"] = ratio(r["trainer_block_s"], base["trainer_block_s"])
    rows.sort(key=lambda r: (r["size_mib"], r["apply"], r["n"]))
    checks = check_targets(rows)
    scheme_target_rows = scheme_checks(scheme_rows)

    source_end = raysync_fingerprint()
    print()
    if rows:
        print_table(rows)
        print_checks(checks)
    if scheme_rows:
        print_scheme_table(scheme_rows)
        print_scheme_checks(scheme_target_rows)
    if adapter_rows:
        print("\nAdapters (push with wait=True until every receiver applied, median):")
        print(f"{'kind':>12} {'MiB':>5} {'N':>3} {'subs':>4} {'applied_s':>9} {'fetched_MiB/v':>13}")
        for r in adapter_rows:
            print(
                f"{r['kind']:>12} {r['size_mib']:>5} {r['receivers']:>3} {r['subs']:>4} "
                f"{r['applied_s']:>9.3f} {r['fetched_mib_per_version']:>13.1f}"
            )
    if source_end != source_start:
        print(
            "\nWARNING: raysync's source changed on disk during this run: actors and hubs started "
            "after the change ran other code than the driver. Run again on a quiet checkout."
        )

    meta = {
        "script": "benchmarks/push_fanout.py",
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t_start)),
        "duration_s": time.time() - t_start,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "raysync": raysync.__version__,
        "git": git_state(),
        "raysync_source_sha1": {"start": source_start, "end": source_end},
        "torch_threads_driver": torch.get_num_threads(),
        "object_store_bytes": store,
        "object_store_gauge": "ray._private.internal_api.get_memory_info_reply().store_stats"
        ".object_store_bytes_used",
        "floor_source": args.floor_source,
        "object_store_prefault_s": prefault_s,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "targets": checks,
                "scheme_rows": scheme_rows,
                "scheme_targets": scheme_target_rows,
                "adapter_rows": adapter_rows,
            },
            indent=2,
        )
    )
    print(f"\nJSON: {args.json}")
    # torchrl's aliasing process row cannot be verified (None): only a failed check fails the run.
    return 0 if all(r["verified"] is not False for r in rows + scheme_rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Push fan-out on one node: raysync against the memory-copy floor, measured in one run.

For every model size (an fp32 state dict of ``--tensors`` equal tensors, 16 by
default), every number N of receiver actors and every apply mode (``copy``,
``view``) this scenario measures, with ``--repeats`` timed pushes (medians
reported) after ``--warmup`` untimed ones:

push-to-all-applied
    ``hub.push(sd, wait=True, timeout=...)``: from the call until every
    ``@synced_model`` receiver applied the version. The pieces are recorded
    too: the snapshot inside ``push`` (``HubClient.last_push["snapshot_s"]``, or
    raysync's own debug log line on versions without it), each receiver's
    fetch+apply time (``last_apply_s`` in ``hub.status()``), and the rest (hub
    round trips, delivery calls).

trainer blocking
    a separate ``hub.push(sd)`` (``wait=False``), timed alone, followed by an
    untimed ``hub.wait(v)``.

object-store bytes per version
    the object store's used bytes, read from the raylet
    (:class:`_floor.ObjectStoreGauge`). Reported: the
    increase caused by the first push (one version) and, after the last push,
    ``(used - baseline) / versions kept`` (the hub keeps ``--keep``). One copy
    per version means both equal the model's size, whatever N.

the copy floor (same run, same machine state)
    one ``copy_`` of the whole model in the driver plus N simultaneous
    ``copy_`` in N plain Ray actors (:mod:`_floor`;
    ``--floor-source private`` gives each actor its own source buffer).

receiver memory
    RSS and private RSS (RSS minus shared pages) of each receiver after the
    last push, to compare ``view`` with ``copy``.

Each configuration gets a fresh hub and fresh actors, and everything is
killed before the next one. Every receiver's final version and a marker value
written into the pushed weights are checked after the last push.
``--schemes`` adds torchrl's schemes beside raysync's
(:mod:`_scheme_rows`), ``--adapters`` the adapter rows
(:mod:`_adapter_rows`), ``--png`` a plot of push-to-all-applied time against N
with the copy floor (:func:`_fanout_report.plot_fanout`).

Run it with ``benchmarks/push_fanout.py`` (``--help``: every option; a full run takes
about 5 minutes on 2 cores and about 16 GiB of RAM at its peak). ``raysync bench``
(in the package) is the compact check of a cluster; this is the full scenario.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
import torch

import _fanout_report as fanout_report
import _harness as harness
import raysync
from _floor import (
    ObjectStoreGauge,
    measure_copy_floor,
    prefault_object_store,
    process_memory,
)
from _harness import MIB, median, ratio

__all__ = [
    "QUICK",
    "Receiver",
    "SnapshotLogCapture",
    "build_parser",
    "main",
    "measure_raysync",
    "parse_args",
    "receiver_class",
]

logger = logging.getLogger(__name__)

QUICK = {"sizes_mib": [16], "actors": [1, 2], "repeats": 2}
"""What ``--quick`` sets, unless given explicitly."""
FULL = {"sizes_mib": [256, 1024], "actors": [1, 2, 4, 8], "repeats": 5}


class Receiver:
    """A receiver: holds a :class:`_harness.FlatModel` in ``self.policy``.

    :func:`receiver_class` decorates it per run with
    ``@raysync.synced_model("policy", apply=...)`` and ``@ray.remote``.

    Example:
        >>> cls = receiver_class("view", "bench-hub")  # doctest: +SKIP
        >>> actor = cls.remote(16 * MIB, 16)  # doctest: +SKIP
    """

    def __init__(self, total_bytes: int, num_tensors: int) -> None:
        self.policy = harness.FlatModel(total_bytes, num_tensors)  # torch.empty: not resident

    def ready(self) -> int:
        """The actor's pid, once it is up (and registered with the hub)."""
        return os.getpid()

    def probe(self) -> tuple[int | None, float]:
        """The version held and the marker value (first element of ``w00``)."""
        version: int | None = self.raysync_version()  # type: ignore[attr-defined]
        marker = self.policy.get_parameter("w00")[0]
        return version, float(marker)

    def memory(self) -> dict[str, int]:
        """RSS, shared and private bytes of this actor's process."""
        return process_memory()


def receiver_class(apply: str, hub_name: str) -> Any:
    """:class:`Receiver` under ``@raysync.synced_model(apply=...)`` and ``@ray.remote(num_cpus=1)``.

    Example:
        >>> actors = [receiver_class("copy", "bench-hub").remote(MIB, 4) for _ in range(2)]  # doctest: +SKIP
    """
    decorate = raysync.synced_model("policy", model_id="policy", hub=hub_name, apply=apply)  # type: ignore[arg-type]
    return ray.remote(num_cpus=1)(decorate(Receiver))


class SnapshotLogCapture(logging.Handler):
    """Collect ``snapshot_s`` from raysync's debug line "pushed ... snapshot %.3f s".

    The fallback for raysync versions whose ``HubClient`` has no ``last_push``.

    Example:
        >>> capture = SnapshotLogCapture()
        >>> logging.getLogger("raysync.hub").addHandler(capture)
        >>> capture.take() is None
        True
    """

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.snapshots: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("pushed %r version") and record.args:
            with contextlib.suppress(Exception):
                self.snapshots.append(float(record.args[-1]))  # type: ignore[index,arg-type]

    def take(self) -> float | None:
        """The newest snapshot time seen since the last call (None if none), and forget the rest."""
        value = self.snapshots[-1] if self.snapshots else None
        self.snapshots.clear()
        return value


def measure_raysync(
    sd: dict[str, torch.Tensor],
    *,
    apply: str,
    n: int,
    keep: int,
    warmup: int,
    repeats: int,
    timeout: float,
    gauge: ObjectStoreGauge,
    capture: SnapshotLogCapture,
    quiet_timeout: float = 5.0,
) -> dict[str, Any]:
    """One configuration: a fresh hub and N fresh receivers; warm-up, then timed pushes.

    Args:
        sd: the trainer's weights (``w00``'s first element is overwritten with a marker).
        apply: the receivers' apply mode, ``"copy"`` or ``"view"``.
        n: how many receivers.
        keep: versions the hub keeps.
        warmup: untimed pushes first (at least 1: the first binds the receivers' layout).
        repeats: timed rounds: one ``push(wait=True)`` and one ``push(wait=False)`` + ``wait`` each.
        timeout: seconds for any one wait.
        gauge: reads the object store's bytes in use.
        capture: a handler on ``raysync.hub`` (the snapshot time's fallback).
        quiet_timeout: seconds to wait for idle CPUs once the receivers are up (0: do not wait).

    Returns:
        The row's measurements (medians and samples; see the module docstring).

    Example:
        >>> row = measure_raysync(sd, apply="view", n=2, keep=2, warmup=4, repeats=3, timeout=60,
        ...                       gauge=ObjectStoreGauge(), capture=SnapshotLogCapture())  # doctest: +SKIP
        >>> row["verified"]  # doctest: +SKIP
        True
    """
    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup and repeats must be >= 1, got {warmup} and {repeats}")
    nbytes = harness.model_bytes(sd)
    hub_name = f"bench-{uuid.uuid4().hex[:8]}"
    t_setup = time.perf_counter()
    cls = receiver_class(apply, hub_name)
    # Start the receivers first: their processes start while connect() starts the hub's.
    actors = [cls.remote(nbytes, len(sd)) for _ in range(n)]
    hub = raysync.connect(hub_name, keep=keep)
    pushes = 0

    def push(client: raysync.HubClient, wait: bool) -> tuple[int, float]:
        nonlocal pushes
        pushes += 1
        sd["w00"][0] = float(pushes)  # a marker the receivers must end up holding
        t0 = time.perf_counter()
        v = client.push(sd, "policy", wait=wait, timeout=timeout if wait else None)
        return v, time.perf_counter() - t0

    def apply_times(client: raysync.HubClient) -> list[float]:
        return [s["last_apply_s"] for s in client.status()["subscribers"] if s["last_apply_s"] is not None]

    try:
        ray.get([a.ready.remote() for a in actors], timeout=timeout)  # all registered
        cpu_busy = harness.wait_until_quiet(timeout=quiet_timeout)
        baseline = gauge.settle()
        t_warm = time.perf_counter()
        push(hub, wait=True)
        first_version_bytes = gauge.used() - baseline
        for _ in range(warmup - 1):
            push(hub, wait=True)
        capture.take()
        t_timed = time.perf_counter()

        applied: list[float] = []
        blocks: list[float] = []
        waits: list[float] = []
        apply_max: list[float] = []
        apply_med: list[float] = []
        snapshots: list[float | None] = []
        wait_applies: list[float] = []
        for _ in range(repeats):
            _, dt = push(hub, wait=True)
            applied.append(dt)
            logged = capture.take()
            last_push = getattr(hub, "last_push", None)  # newer raysync: HubClient.last_push
            if isinstance(last_push, dict) and last_push.get("snapshot_s") is not None:
                snapshots.append(float(last_push["snapshot_s"]))
            else:
                snapshots.append(logged)
            times = apply_times(hub)
            apply_max.append(max(times))
            apply_med.append(statistics.median(times))

            v, block = push(hub, wait=False)
            capture.take()
            t0 = time.perf_counter()
            hub.wait(v, "policy", timeout=timeout)
            waits.append(time.perf_counter() - t0)
            blocks.append(block)
            wait_applies.append(max(apply_times(hub)))

        model_status = hub.status()["models"]["policy"]
        kept = len(model_status["versions_kept"])
        used_end = gauge.settle(at_most=baseline + kept * nbytes + MIB) - baseline
        probes = ray.get([a.probe.remote() for a in actors], timeout=timeout)
        last = model_status["latest"]
        verified = all(v == last and marker == float(pushes) for v, marker in probes)
        if not verified:
            logger.error("receivers hold %s, expected version %s with marker %s", probes, last, pushes)
        mems = ray.get([a.memory.remote() for a in actors], timeout=timeout)
        t_down = time.perf_counter()
    finally:
        harness.kill_all([*actors, hub.actor])
    # The client holds its newest version (to offer a restarted hub) until it goes; it is in a
    # reference cycle with its push pipeline, so only the collector frees it.
    del hub
    gc.collect()
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
        "store_copies_per_version": (used_end / kept) / nbytes if kept else None,
        "hub_bytes_per_version": model_status["bytes_per_version"],
        "buckets": model_status["buckets"],
        "receiver_rss_bytes": median([m["rss"] for m in mems]),
        "receiver_private_rss_bytes": median([m["private"] for m in mems]),
        "verified": verified,
        "cpu_busy_before": cpu_busy,
    }


# ---------------------------------------------------------------------- command line


_LATER = {
    "sizes_mib": "model sizes in MiB (default: 256 1024; --quick: 16)",
    "actors": "receiver counts N (default: 1 2 4 8; --quick: 1 2)",
    "repeats": "timed repeats per configuration, medians reported (default: 5; --quick: 2)",
    "warmup": "untimed pushes per configuration, first (default: --keep + 2)",
    "object_store_mib": "object store size in MiB (default: the larger of 1024 and "
    "(--keep + 2) x the largest --sizes-mib)",
}
"""The help of the options whose default is set after parsing (by --quick, or from other options)."""


def build_parser(
    *, results_dir: str | os.PathLike[str] | None = None, prog: str | None = None
) -> argparse.ArgumentParser:
    """The scenario's parser: every option with its default, the runs, output and exit code in the epilog.

    Args:
        results_dir: the default ``--json``'s folder (default: ``benchmarks/results``).
        prog: the program name in usage and errors.

    Example:
        >>> "--quick" in build_parser(prog="push_fanout.py").format_help()
        True
    """
    p = argparse.ArgumentParser(
        prog=prog,
        description=(__doc__ or "").split("\n\n")[0],
        epilog=fanout_report.RUNS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    harness.add_options(p, helps=_LATER, sizes_mib=None, actors=None)
    p.add_argument(
        "--apply",
        nargs="+",
        choices=["copy", "view"],
        default=["copy", "view"],
        help="the receivers' apply modes (default: copy view)",
    )
    harness.add_options(p, helps=_LATER, repeats=None, warmup=None, tensors=16)
    p.add_argument("--keep", type=int, default=2, help="versions the hub keeps (default: 2)")
    harness.add_options(p, timeout=300.0)
    p.add_argument(
        "--quiet-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for idle CPUs before timing each configuration (0: do not wait; default: 5)",
    )
    p.add_argument(
        "--floor-source",
        choices=["shared", "private"],
        default="shared",
        help="floor receivers copy from one shared /dev/shm source or each from its own buffer "
        "(private: 2x the model per actor, too much for 1 GiB x 8 on 24 GiB; default: shared)",
    )
    harness.add_options(p, helps=_LATER, object_store_mib=None)
    p.add_argument(
        "--no-prefault",
        action="store_true",
        help="do not fill and free the object store once before measuring",
    )
    p.add_argument(
        "--schemes",
        action="store_true",
        help="also measure torchrl 0.14's RayWeightSyncScheme beside raysync's schemes",
    )
    p.add_argument("--schemes-only", action="store_true", help="only the --schemes rows")
    p.add_argument(
        "--adapters",
        action="store_true",
        help="also measure N receivers behind one pipe / distributed / rpc adapter against N synced "
        "actors fetching on their own, at the largest N",
    )
    harness.add_options(p, json=harness.results_path("push_fanout.json", results_dir), verbose=True)
    png_help = "also plot push-to-all-applied time against N, with the floor, into this PNG (matplotlib)"
    harness.add_options(p, png=None, helps={"png": png_help})
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 16 MiB, N = 1 2, 2 repeats (under a minute)"
    )
    return p


def parse_args(
    argv: Sequence[str] | None = None,
    *,
    results_dir: str | os.PathLike[str] | None = None,
    prog: str | None = None,
) -> argparse.Namespace:
    """The scenario's options (``--help`` lists them), with ``--quick`` and the defaults applied.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
        results_dir: the default ``--json``'s folder (default: ``benchmarks/results``).
        prog: the program name in usage and errors.

    Example:
        >>> a = parse_args(["--quick", "--sizes-mib", "4"])
        >>> a.sizes_mib, a.actors, a.repeats, a.warmup
        ([4], [1, 2], 2, 4)
    """
    p = build_parser(results_dir=results_dir, prog=prog)
    args = p.parse_args(argv)
    for key, value in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    args.warmup = max(1, args.keep + 2 if args.warmup is None else args.warmup)
    args.actors = sorted(set(args.actors))
    if min(args.actors) < 1 or args.repeats < 1 or min(args.sizes_mib) < 1:
        p.error("--sizes-mib, --actors and --repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None, *, results_dir: str | os.PathLike[str] | None = None) -> int:
    """Run the scenario: print the table and target checks, write the JSON; 0 if every row verified.

    Example:
        >>> main(["--quick", "--json", "/tmp/fanout.json"])  # doctest: +SKIP
        0
    """
    args = parse_args(argv, results_dir=results_dir)
    if args.png:
        try:
            harness.pyplot()  # before a run of minutes, not after it
        except harness.BenchError as err:
            print(f"push_fanout: {err}; the run was not started", file=sys.stderr)
            return 1
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
    rows: list[dict[str, Any]] = []
    scheme_rows: list[dict[str, Any]] = []
    adapter_rows: list[dict[str, Any]] = []
    t_start = time.time()
    source_start = harness.raysync_fingerprint()
    try:
        with harness.local_cluster(
            num_cpus=max(args.actors) + 2, object_store_bytes=store, log_to_driver=args.verbose
        ):
            gauge = ObjectStoreGauge()
            prefault_s = None if args.no_prefault else prefault_object_store(store)
            gauge.settle(at_most=MIB, timeout=30)
            for size_mib in args.sizes_mib:
                _measure_size(size_mib, args, gauge, capture, rows, scheme_rows, adapter_rows)
    finally:
        hub_logger.removeHandler(capture)

    fanout_report.add_ratios(rows)
    checks = fanout_report.check_targets(rows)
    import _scheme_rows as schemes

    scheme_targets = schemes.scheme_checks(scheme_rows)
    source_end = harness.raysync_fingerprint()
    print()
    if rows:
        fanout_report.print_table(rows)
        fanout_report.print_checks(checks, cpus=os.cpu_count())
    if scheme_rows:
        schemes.print_scheme_table(scheme_rows)
        schemes.print_scheme_checks(scheme_targets)
    if adapter_rows:
        print("\nAdapters (push with wait=True until every receiver applied, median):")
        from _adapter_rows import print_table as print_adapter_table

        print_adapter_table(adapter_rows)
    if source_end != source_start:
        print(
            "\nWARNING: raysync's source changed on disk during this run: actors and hubs started "
            "after the change ran other code than the driver. Run again on a quiet checkout."
        )
    meta = harness.run_meta(
        "benchmarks/push_fanout.py",
        sys.argv[1:] if argv is None else argv,
        started=t_start,
        raysync_source_sha1={"start": source_start, "end": source_end},
        torch_threads_driver=torch.get_num_threads(),
        object_store_bytes=store,
        object_store_gauge="raysync._compat.object_store_bytes_used",
        floor_source=args.floor_source,
        object_store_prefault_s=prefault_s,
        config=args,
    )
    results = {
        "meta": meta,
        "rows": rows,
        "targets": checks,
        "scheme_rows": scheme_rows,
        "scheme_targets": scheme_targets,
        "adapter_rows": adapter_rows,
    }
    print(f"\nJSON: {harness.write_json(args.json, results)}")
    if args.png and rows:
        title = fanout_report.plot_title(meta)
        print(f"plot: {fanout_report.plot_fanout(rows, args.png, title=title)}")
    # torchrl's aliasing process row cannot be verified (None): only a failed check fails the run.
    return 0 if all(r["verified"] is not False for r in rows + scheme_rows) else 1


def _measure_size(
    size_mib: int,
    args: argparse.Namespace,
    gauge: ObjectStoreGauge,
    capture: SnapshotLogCapture,
    rows: list[dict[str, Any]],
    scheme_rows: list[dict[str, Any]],
    adapter_rows: list[dict[str, Any]],
) -> None:
    """Every configuration of one model size, appended to ``rows`` (and the scheme and adapter rows)."""
    sd = harness.make_state_dict(size_mib * MIB, args.tensors)
    nbytes = harness.model_bytes(sd)
    flat_src = torch.empty(nbytes, dtype=torch.uint8)
    flat_src.fill_(1)
    for n in args.actors if args.schemes or args.schemes_only else ():
        import _scheme_rows as schemes

        logger.info("%d MiB, N=%d: torchrl and raysync schemes", size_mib, n)
        floor = measure_copy_floor(
            flat_src, n, args.repeats, args.floor_source, args.timeout, quiet_timeout=args.quiet_timeout
        )
        common = {"n": n, "repeats": args.repeats, "warmup": args.warmup}
        for row in schemes.measure_scheme_rows(
            sd, **common, receiver_class=receiver_class, floor_s=floor["floor_s"]
        ) + schemes.measure_mp_rows(sd, **common):
            row["size_mib"] = size_mib
            scheme_rows.append(row)
    for n in args.actors if not args.schemes_only else ():
        logger.info("%d MiB, N=%d: floor", size_mib, n)
        floor = measure_copy_floor(
            flat_src, n, args.repeats, args.floor_source, args.timeout, quiet_timeout=args.quiet_timeout
        )
        for apply in args.apply:
            logger.info("%d MiB, N=%d, apply=%s: raysync", size_mib, n, apply)
            result = measure_raysync(
                sd,
                apply=apply,
                n=n,
                keep=args.keep,
                warmup=args.warmup,
                repeats=args.repeats,
                timeout=args.timeout,
                gauge=gauge,
                capture=capture,
                quiet_timeout=args.quiet_timeout,
            )
            row = {"size_mib": size_mib, "model_bytes": nbytes, "apply": apply, "n": n, **floor, **result}
            row["ratio_to_floor"] = ratio(row["push_to_all_applied_s"], row["floor_s"])
            row["block_vs_snapshot"] = ratio(row["trainer_block_s"], row["snapshot_copy_s"])
            rows.append(row)
    del sd, flat_src
    if args.adapters:
        from _adapter_rows import KINDS, measure

        for kind in KINDS:
            logger.info("%d MiB, N=%d: %s", size_mib, max(args.actors), kind)
            adapter_rows.append(
                measure(
                    kind,
                    size_mib,
                    max(args.actors),
                    tensors=args.tensors,
                    repeats=args.repeats,
                    timeout=args.timeout,
                )
            )


if __name__ == "__main__":
    sys.exit(main())

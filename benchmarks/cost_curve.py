"""The cost curve: push-to-all-applied time against model size and number of actors.

Reuses the fan-out scenario's measurement
(:func:`_fanout.measure_raysync`: a fresh hub and N
fresh ``@raysync.synced_model`` receivers per configuration, warm-up pushes,
then ``--repeats`` timed ones) over a grid of model sizes (``--sizes-mib``,
fp32 state dicts of 16 equal tensors) x receiver counts (``--actors``) x
apply modes, without the copy-floor actors, and reports per configuration
(medians):

``applied_s``
    ``hub.push(sd, wait=True)``: until every receiver applied the version.
``block_s``
    how long ``hub.push(sd)`` (``wait=False``) blocks the trainer.
``store_MiB/v``
    object-store bytes in use per kept version (one copy per version is the
    model's size whatever N).
``apply_s``
    the slowest receiver's own fetch + apply.

Configurations whose receivers would hold more than ``--max-copy-gib`` of
private copies (``apply="copy"``: N x size) are skipped. Writes a table
(stdout and ``--markdown``), the JSON (``--json``) and a PNG plot (``--png``):
applied time and trainer blocking time against N, one line per size and apply
mode.

Run::

    python benchmarks/cost_curve.py                                  # the grid in BENCHMARKS.md
    python benchmarks/cost_curve.py --sizes-mib 64 256 --actors 1 4 16 --apply view --repeats 3
    python benchmarks/cost_curve.py --plot-only                      # redraw the PNG from the JSON
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _harness as harness
from _fanout import SnapshotLogCapture, measure_raysync
from _floor import ObjectStoreGauge, prefault_object_store
from _harness import MIB, fmt

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("cost_curve")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    harness.add_options(p, sizes_mib=[64, 256, 1024], actors=[1, 2, 4, 8, 16])
    p.add_argument("--apply", nargs="+", choices=["copy", "view"], default=["view", "copy"])
    harness.add_options(p, repeats=3, warmup=2, tensors=16)
    p.add_argument("--keep", type=int, default=1, help="versions the hub keeps (default: 1)")
    harness.add_options(p, timeout=300.0)
    p.add_argument("--max-copy-gib", type=float, default=4.0, help="skip copy configs holding more than this")
    harness.add_options(p, object_store_mib=None)  # default: (keep + 1.5) x largest size
    harness.add_options(p, json=RESULTS / "cost_curve.json", png=RESULTS / "cost_curve.png")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from --json, measure nothing")
    return p.parse_args(argv)


def table(rows: list[dict[str, Any]]) -> str:
    head = "| size_MiB | apply | N | applied_s | block_s | apply_s | store_MiB/v | copies/v | ok |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['size_mib']} | {r['apply']} | {r['n']} | {fmt(r['push_to_all_applied_s'])} | "
            f"{fmt(r['trainer_block_s'])} | {fmt(r['receiver_apply_max_s'])} | "
            f"{fmt((r['store_bytes_per_version'] or 0) / MIB, '.0f')} | "
            f"{fmt(r['store_copies_per_version'], '.2f')} | {'yes' if r['verified'] else 'NO'} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    sizes = sorted({r["size_mib"] for r in rows})
    colors = dict(zip(sizes, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"], strict=False))
    for apply, style in (("copy", "-o"), ("view", "--s")):
        for size in sizes:
            sel = sorted(
                (r for r in rows if r["size_mib"] == size and r["apply"] == apply), key=lambda r: r["n"]
            )
            if not sel:
                continue
            ns = [r["n"] for r in sel]
            label = f"{size} MiB, {apply}"
            axes[0].plot(
                ns, [r["push_to_all_applied_s"] for r in sel], style, color=colors[size], label=label
            )
            axes[1].plot(ns, [r["trainer_block_s"] for r in sel], style, color=colors[size], label=label)
    axes[0].set_title("push to all applied (s)")
    axes[1].set_title("trainer blocked in push (s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("receiver actors N (one node, 2 cores)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    harness.save_figure(fig, path, dpi=80)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.plot_only:
        import json

        rows = json.loads(args.json.read_text())["rows"]
        plot(rows, args.png)
        print(table(rows))
        return 0
    harness.pyplot()  # fail now, not after the run, without matplotlib
    capture = SnapshotLogCapture()
    logging.getLogger("raysync.hub").addHandler(capture)
    max_bytes = max(args.sizes_mib) * MIB
    store = args.object_store_mib * MIB if args.object_store_mib else int((args.keep + 1.5) * max_bytes)
    rows: list[dict[str, Any]] = []
    t_start = time.time()
    argv_used = sys.argv[1:] if argv is None else list(argv)
    store = max(store, 256 * MIB)
    with harness.local_cluster(num_cpus=max(args.actors) + 2, object_store_bytes=store):
        gauge = ObjectStoreGauge()
        prefault_object_store(store)
        gauge.settle(at_most=MIB, timeout=30)
        for size in args.sizes_mib:
            sd = harness.make_state_dict(size * MIB, args.tensors)
            for apply in args.apply:
                for n in args.actors:
                    if apply == "copy" and n * size > args.max_copy_gib * 1024:
                        logger.info("skip %d MiB x %d copy (over --max-copy-gib)", size, n)
                        continue
                    logger.info("measuring %d MiB, apply=%s, N=%d", size, apply, n)
                    res = measure_raysync(
                        sd,
                        apply=apply,
                        n=n,
                        keep=args.keep,
                        warmup=args.warmup,
                        repeats=args.repeats,
                        timeout=args.timeout,
                        gauge=gauge,
                        capture=capture,
                    )
                    rows.append({"size_mib": size, "apply": apply, "n": n, **res})
                    meta = harness.run_meta("benchmarks/cost_curve.py", argv_used, started=t_start)
                    harness.write_json(args.json, {"meta": {**meta, "store": store}, "rows": rows}, indent=1)
            del sd
    text = table(rows)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    plot(rows, args.png)
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The push fan-out scenario's report: ratios, the table, the target checks and the PNG plot.

Pure functions of the rows :mod:`raysync.ops.bench.fanout` measures (or reads
back from its JSON), so a saved run can be re-reported or re-plotted without
Ray.

Example:
    >>> import json
    >>> rows = json.load(open("raysync-bench/push_fanout.json"))["rows"]  # doctest: +SKIP
    >>> print_checks(check_targets(rows))  # doctest: +SKIP
    >>> plot_fanout(rows, "push_fanout.png")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raysync.ops.bench.harness import MIB, BenchError, fmt, pyplot, ratio, save_figure

__all__ = [
    "TARGET_APPLIED_VS_FLOOR",
    "TARGET_BLOCK_FLAT",
    "TARGET_BLOCK_VS_SNAPSHOT",
    "TARGET_COPIES_PER_VERSION",
    "TARGET_VIEW_FLAT",
    "add_ratios",
    "check_targets",
    "plot_fanout",
    "plot_title",
    "print_checks",
    "print_table",
]

# Targets from /work/shared/ANCHORS.md ("Where raysync must land", CPU).
TARGET_APPLIED_VS_FLOOR = 1.3
TARGET_VIEW_FLAT = 1.5
TARGET_BLOCK_VS_SNAPSHOT = 1.3
TARGET_BLOCK_FLAT = 1.3  # "the same for N = 1 and N = 8": read as within the same 1.3x
TARGET_COPIES_PER_VERSION = 1.1  # one copy (allowing for Ray's per-object metadata)


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``applied_vs_n1`` and ``block_vs_n1`` (over the same size and apply at the smallest N).

    Sorts ``rows`` in place by size, apply mode and N, and returns it.

    Example:
        >>> rows = [{"size_mib": 16, "apply": "view", "n": n, "push_to_all_applied_s": t,
        ...          "trainer_block_s": 0.01} for n, t in ((2, 0.3), (1, 0.2))]
        >>> [r["applied_vs_n1"] for r in add_ratios(rows)]
        [1.0, 1.5]
    """
    for r in rows:
        base = min(
            (x for x in rows if (x["size_mib"], x["apply"]) == (r["size_mib"], r["apply"])),
            key=lambda x: x["n"],
        )
        r["applied_vs_n1"] = ratio(r["push_to_all_applied_s"], base["push_to_all_applied_s"])
        r["block_vs_n1"] = ratio(r["trainer_block_s"], base["trainer_block_s"])
    rows.sort(key=lambda r: (r["size_mib"], r["apply"], r["n"]))
    return rows


def print_table(rows: Sequence[Mapping[str, Any]]) -> None:
    """The fan-out table (one line per size, apply mode and N) and its legend, on stdout.

    Example:
        >>> print_table(rows)  # doctest: +SKIP
    """
    header = (
        f"{'size':>8} {'apply':>5} {'N':>2} | {'applied_s':>9} {'floor_s':>8} {'ratio':>6} "
        f"{'vs_N1':>6} | {'block_s':>8} {'put_s':>6} {'snap_s':>7} {'blk/snap':>8} "
        f"{'blk_vsN1':>8} | "
        f"{'store_MiB/v':>11} {'copies/v':>8} | {'recv_apply':>10} {'priv_MiB':>8} {'ok':>3}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        store = r["store_bytes_per_version"]
        private = r["receiver_private_rss_bytes"]
        print(
            f"{r['size_mib']:>4} MiB {r['apply']:>5} {r['n']:>2} | "
            f"{fmt(r['push_to_all_applied_s']):>9} {fmt(r['floor_s']):>8} "
            f"{fmt(r['ratio_to_floor'], '.2f'):>6} {fmt(r['applied_vs_n1'], '.2f'):>6} | "
            f"{fmt(r['trainer_block_s']):>8} {fmt(r['snapshot_in_push_s']):>6} "
            f"{fmt(r['snapshot_copy_s']):>7} "
            f"{fmt(r['block_vs_snapshot'], '.2f'):>8} {fmt(r['block_vs_n1'], '.2f'):>8} | "
            f"{fmt(None if store is None else store / MIB, '.1f'):>11} "
            f"{fmt(r['store_copies_per_version'], '.2f'):>8} | "
            f"{fmt(r['receiver_apply_max_s']):>10} "
            f"{fmt(None if private is None else private / MIB, '.0f'):>8} "
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


def check_targets(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One check per target and row (or row group): the measured value, the bound, met or not.

    Example:
        >>> [c["target"] for c in check_targets(rows)][:3]  # doctest: +SKIP
        ['push-to-all-applied / floor', 'trainer block / snapshot copy', 'object-store copies per version']
    """
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
            "object-store copies per version", where, r["store_copies_per_version"], TARGET_COPIES_PER_VERSION
        )
    for size, apply in sorted({(r["size_mib"], r["apply"]) for r in rows}):
        grp = sorted((r for r in rows if (r["size_mib"], r["apply"]) == (size, apply)), key=lambda r: r["n"])
        if len(grp) < 2:
            continue
        lo, hi = grp[0], grp[-1]
        where = f"{size} MiB {apply} N={hi['n']}/N={lo['n']}"
        if apply == "view":
            add("view: push-to-all-applied flat in N", where, hi["applied_vs_n1"], TARGET_VIEW_FLAT)
        add("trainer block flat in N", where, hi["block_vs_n1"], TARGET_BLOCK_FLAT)
    return checks


def print_checks(checks: Sequence[Mapping[str, Any]]) -> None:
    """The target checks, one line each (``met`` or ``MISS``), and how many were met.

    Example:
        >>> print_checks(check_targets(rows))  # doctest: +SKIP
          met   push-to-all-applied / floor      16 MiB view N=1            1.12 (<= 1.3)
          ...
    """
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


def plot_title(meta: Mapping[str, Any]) -> str:
    """A plot title from a result file's ``meta``: the machine's CPUs, Ray's version, the start.

    Example:
        >>> plot_title({"cpus": 2, "ray": "2.60.0"})
        'raysync push fan-out, 2 CPUs, Ray 2.60.0'
    """
    parts = ["raysync push fan-out"]
    if meta.get("cpus"):
        parts.append(f"{meta['cpus']} CPUs")
    if meta.get("ray"):
        parts.append(f"Ray {meta['ray']}")
    if meta.get("started"):
        parts.append(str(meta["started"]))
    return ", ".join(parts)


def plot_fanout(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], *, title: str = "") -> Path:
    """Plot push-to-all-applied time against the number of actors, with the copy floor.

    One panel per model size; one line per apply mode (``copy``, ``view``)
    and a dashed line for the floor measured in the same run. Needs
    ``matplotlib`` (``pip install "raysync[plot]"``).

    Args:
        rows: the ``rows`` of the scenario's JSON (each with ``size_mib``,
            ``apply``, ``n``, ``push_to_all_applied_s`` and ``floor_s``).
        path: the PNG to write (its folder is made if missing).
        title: a title over the panels.

    Returns:
        The path written.

    Raises:
        BenchError: no rows, or matplotlib is missing.

    Example:
        >>> rows = json.load(open("raysync-bench/push_fanout.json"))["rows"]  # doctest: +SKIP
        >>> plot_fanout(rows, "push_fanout.png")  # doctest: +SKIP
        PosixPath('push_fanout.png')
    """
    if not rows:
        raise BenchError("no benchmark rows to plot")
    plt = pyplot()
    sizes = sorted({int(r["size_mib"]) for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        mine = [r for r in rows if int(r["size_mib"]) == size]
        for apply in sorted({str(r["apply"]) for r in mine}):
            pts = sorted((r["n"], r["push_to_all_applied_s"]) for r in mine if r["apply"] == apply)
            pts = [(n, t) for n, t in pts if t is not None]
            if pts:
                ax.plot(
                    [n for n, _ in pts],
                    [t * 1e3 for _, t in pts],
                    marker="o",
                    label=f"raysync, apply={apply}",
                )
        floor = sorted({(r["n"], r["floor_s"]) for r in mine if r.get("floor_s") is not None})
        if floor:
            ax.plot(
                [n for n, _ in floor],
                [t * 1e3 for _, t in floor],
                linestyle="--",
                color="grey",
                marker="x",
                label="copy floor (snapshot + N copies)",
            )
        ax.set_title(f"{size} MiB model")
        ax.set_xlabel("receiver actors (N)")
        ax.set_ylabel("push to all applied (ms)")
        ax.set_xticks(sorted({int(r["n"]) for r in mine}))
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)

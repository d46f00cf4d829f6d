"""What ``raysync bench`` prints: one line per check beside its floor, then what each check means.

The checks themselves (their bounds, what they measure, their floors, what a miss means) are
here too, so the run and its report agree on them. Imports neither torch nor Ray.

Example:
    >>> from raysync.ops.bench_report import print_report
    >>> print_report({"meta": {}, "rows": []}, where="nowhere")  # doctest: +ELLIPSIS
    raysync bench on nowhere: ...
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = ["CHECKS", "KIB", "LARGE_MIB", "MIB", "print_report", "size_label"]

KIB, MIB = 2**10, 2**20
LARGE_MIB = 256
"""The smallest version the fan-out targets are set for (a push's fixed costs weigh less there)."""

CHECKS: dict[str, tuple[float, str, str, str]] = {
    "fan-out: all applied": (
        1.3,
        "hub.push(wait=True) until every actor applied the version",
        "ray.put of the same bytes + N plain actors ray.get it (and copy_ it in, for apply=copy)",
        "raysync's own costs (the hub's calls, a relay's hop, the acks: a few ms per push) add more than "
        f"30% to what Ray needs: expected below {LARGE_MIB} MiB and when the actors outnumber the free cores",
    ),
    "fan-out: trainer blocked": (
        1.3,
        "how long hub.push (wait=False) blocks the trainer",
        "a bare ray.put of the same bytes, beside each push",
        f"the trainer waits on more than its snapshot: expected below {LARGE_MIB} MiB, where the hub's "
        "answer (about a ms) outweighs the put, and noisy on a busy node",
    ),
    "small: all applied": (
        1.0,
        "hub.push(wait=True) of a small version until every actor applied it",
        "ray.put of the same bytes + N plain actors ray.get and copy_ it",
        "the hub's two calls per version (the publish, the wait's answer: about 1 ms of its CPU each) are "
        "not hidden: expected on a busy hub node, or where doorbells are off (RAYSYNC_DOORBELL_BYTES=0)",
    ),
    "small: trainer blocked": (
        2.0,
        "how long hub.push (wait=False) of a small version blocks the trainer",
        "a bare ray.put of the same bytes, beside each push",
        "a push's packing, bookkeeping and publish (about 1 ms) weigh more than the put on this node, "
        "or the hub answers slowly (a busy CPU) and pushes wait for its answers beyond 8 in flight",
    ),
}
"""Per check: its bound (a ratio to its floor), what it measures, its floor, what a miss means."""


MAX_RATIO_DIGITS = 6
"""The most decimals :func:`ratio_text` prints before it says ``>bound`` instead."""


def ms_text(seconds: float | None) -> str:
    """Seconds as milliseconds with two decimals; ``-`` for None.

    Example:
        >>> ms_text(0.0123456)
        '12.35 ms'
    """
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def ratio_text(ratio: float, bound: float) -> str:
    """``ratio`` with two decimals, or as many more as it takes to read on its side of ``bound``.

    A check is met when ``ratio <= bound``. Rounded to two decimals, 1.3012 would print as
    ``1.30`` beside the bound ``<= 1.3`` and read as met; it prints as ``1.301`` instead. A ratio
    above the bound by less than :data:`MAX_RATIO_DIGITS` decimals show prints as ``>1.3``.

    Example:
        >>> ratio_text(1.2345, 1.3), ratio_text(1.3012, 1.3), ratio_text(1.3 + 1e-9, 1.3)
        ('1.23', '1.301', '>1.3')
    """
    met = ratio <= bound
    for digits in range(2, MAX_RATIO_DIGITS + 1):
        text = f"{ratio:.{digits}f}"
        if (float(text) <= bound) == met:
            return text
    return f">{bound:g}"  # only a miss can get here: a met ratio rounded down stays met


def size_label(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def print_report(report: Mapping[str, Any], *, where: str = "", file: TextIO | None = None) -> None:
    """One line per check (met or MISS, value, floor, ratio, bound, ok), then what each means.

    Args:
        report: what :func:`run_check` returned (or its JSON, read back).
        where: the cluster, for the title (``"10.0.0.5:6379"``, ``"a local Ray of its own"``).
        file: where to write (default: standard output).

    Example:
        >>> print_report(json.load(open("raysync-bench/bench.json")), where="last run")  # doctest: +SKIP
    """
    out = file or sys.stdout
    meta, rows = report.get("meta", {}), list(report.get("rows", []))

    def say(text: str, indent: str = "", then: str | None = None) -> None:
        rest = indent if then is None else then
        print(textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=rest), file=out)

    cpus = meta.get("cpus")
    cluster = f"{meta.get('nodes')} node(s), {'-' if cpus is None else f'{cpus:g}'} CPUs"
    ray_version = meta.get("versions", {}).get("ray")
    print(f"raysync bench on {where or 'the cluster'}: {cluster}, Ray {ray_version}\n", file=out)
    check_w, where_w = (max([len(r[key]) for r in rows] + [5]) for key in ("check", "where"))
    head = f"{'check':<{check_w}}  {'where':<{where_w}} {'measured':>10} {'floor':>10} {'ratio':>6}  bound"
    print(f"        {head}   ok", file=out)
    for r in rows:
        ratio = "-" if r.get("ratio") is None else ratio_text(r["ratio"], r["bound"])
        ok = "-" if r.get("verified") is None else "yes" if r["verified"] else "NO"
        print(
            f"  {'met ' if r.get('met') else 'MISS'}  {r['check']:<{check_w}}  {r['where']:<{where_w}} "
            f"{ms_text(r.get('measured_s')):>10} {ms_text(r.get('floor_s')):>10} {ratio:>6}  "
            f"<= {r['bound']:<4} {ok}",
            file=out,
        )
    missed = [r for r in rows if not r.get("met")]
    print(f"  {len(rows) - len(missed)}/{len(rows)} met\n", file=out)
    say(
        f"Targets: the project's goals, set on its 2-core reference machine (this cluster: {cluster}). "
        "Each is a ratio to Ray's own floor measured in this same run on this cluster: compare the "
        "measured column with the floor column beside it. A MISS is information, not a failure: the "
        "exit code is 0 whenever every receiver ended on the version pushed (the ok column). Timings "
        "vary between runs (up to 1.5x on a busy machine): run again before reading much into one miss."
    )
    large = LARGE_MIB * MIB
    below = sorted({r["bytes"] for r in missed if r["check"].startswith("fan-out") and r["bytes"] < large})
    if below:
        say(
            f"Fan-out misses at {', '.join(size_label(b) for b in below)} are below the {LARGE_MIB} MiB the "
            "fan-out targets are set for, where a push's fixed costs (a few ms) outweigh the bytes"
            + ("." if any(r["bytes"] >= large for r in rows) else "; the full run measures 256 MiB."),
            indent="  ",
        )
    print("\nWhat each check measures, its floor (same run) and what a miss means:", file=out)
    for check in [c for c in CHECKS if any(r["check"] == c for r in rows)]:
        bound, measures, floor, miss = CHECKS[check]
        say(f"{check}: {measures}; floor: {floor}; bound: {bound}x the floor.", indent="  ", then="    ")
        say(f"A miss: {miss}.", indent="    ")

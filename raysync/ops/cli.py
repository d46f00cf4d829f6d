"""The ``raysync`` command: ``raysync status`` and ``raysync bench``.

``raysync status`` connects to a running Ray cluster, finds the hub (by
default ``raysync`` in Ray namespace ``raysync``, where every driver and job
puts it) and prints its models, versions, subscribers, lag and last errors as
tables (``--json`` for the raw ``hub.status()``).

``raysync bench`` checks a Ray cluster (``--address``, else ``RAY_ADDRESS``; with
neither, a local Ray of its own): push fan-out and small versions, each beside
Ray's own floor measured in the same run on that cluster (:mod:`raysync.ops.bench`),
with a progress bar; then one line per check (the value, its floor, their ratio
and the bound) and what each check measures and what a miss means.
``raysync bench --help`` lists every option, the full and the quick run, and the
exit code.

Installed as the console script ``raysync``; ``python -m raysync`` is the same.

Example:
    .. code-block:: bash

        raysync status                         # RAY_ADDRESS, or the local cluster
        raysync status --address 10.0.0.5:6379 --name my-hub --json
        raysync bench --quick                  # under a minute; raysync-bench/bench.json
        raysync bench --address 10.0.0.5:6379 --sizes-mib 256 --actors 8 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO, cast

from raysync._protocol import DEFAULT_HUB, DEFAULT_NAMESPACE
from raysync.ops import bench
from raysync.ops.bench_report import MIB
from raysync.ops.cluster_connect import ClusterUnreachable, connect, error_line

__all__ = ["main", "render_status"]


class CliError(Exception):
    """A failure the CLI reports as one line and a non-zero exit code."""


# ---------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``raysync`` command line; return its exit code.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 when the cluster or hub cannot be found (the message
        names them), when a ``bench`` receiver did not end on the version
        pushed or its check stopped half-way (the message says where), 2 for
        bad usage. ``bench``'s missed targets do not change it.
        ``status`` (and ``bench --address``) give up connecting after ``--timeout`` seconds;
        if it is then still connecting, the process exits with code 1 at once
        (:func:`os._exit`) instead of returning: Ray cannot stop a connection
        attempt half-way, and its exit hook would wait on it.

    Example:
        >>> from raysync.ops.cli import main
        >>> main(["status", "--json"])  # doctest: +SKIP
        0
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "status":
            return _status(args)
        return _bench(args)
    except (CliError, ClusterUnreachable) as err:
        print(error_line(args.command, err), file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raysync", description="Inspect a raysync hub, or check a Ray cluster with raysync."
    )
    parser.add_argument("--version", action="version", version=f"raysync {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{status,bench}")
    status = sub.add_parser(
        "status",
        help="models, versions, subscribers, lag and last errors of a running hub",
        description="Print a running hub's models, versions, subscribers, lag and last errors.",
    )
    status.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (default: $RAY_ADDRESS, else the cluster running on this machine)",
    )
    status.add_argument("--name", default=DEFAULT_HUB, help=f"hub actor name (default: {DEFAULT_HUB})")
    status.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help=f"hub's Ray namespace (default: {DEFAULT_NAMESPACE})"
    )
    status.add_argument("--json", action="store_true", help="print hub.status() as JSON")
    status.add_argument(
        "--all",
        action="store_true",
        help=f"one row per subscriber, however many (over {SUMMARY_ABOVE}: by node, naming those behind)",
    )
    status.add_argument(
        "--timeout",
        type=_seconds,
        default=30.0,
        help="seconds for the whole command: connecting to the cluster and the hub's answer (default: 30)",
    )
    bench.add_arguments(  # the module imports neither torch nor Ray: --help stays fast
        sub.add_parser(
            "bench", help="check a Ray cluster: push fan-out and small versions beside Ray's floor"
        )
    )
    return parser


def _version() -> str:
    """The installed raysync's version (its package metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raysync")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "(not installed)"


def _seconds(text: str) -> float:
    """``--timeout``'s type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


# ---------------------------------------------------------------------- status


def _status(args: argparse.Namespace) -> int:
    import ray

    deadline = time.monotonic() + args.timeout
    started = connect(args.address, timeout=args.timeout, deadline=deadline, command=args.command)
    try:
        try:
            handle = ray.get_actor(args.name, namespace=args.namespace)
        except ValueError:
            raise CliError(_no_hub_message(args.name, args.namespace)) from None
        try:
            left = max(deadline - time.monotonic(), 0.0)
            status: dict[str, Any] = cast(dict, ray.get(handle.status.remote(), timeout=left))
        except Exception as err:
            raise CliError(
                f"hub {args.name!r} in namespace {args.namespace!r} did not answer within "
                f"--timeout {args.timeout:g} s: {type(err).__name__}: {err}"
            ) from err
    finally:
        if started:
            ray.shutdown()
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True, default=str))
    else:
        render_status(status, namespace=args.namespace, every=args.all)
    return 0


def _no_hub_message(name: str, namespace: str) -> str:
    import ray

    others: list[str] = []
    with contextlib.suppress(Exception):
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor.get("namespace") == namespace:
                others.append(actor["name"])
    where = f"named actors there: {sorted(others)}" if others else "no named actors there"
    return (
        f"no raysync hub named {name!r} in namespace {namespace!r} on this cluster ({where}). "
        "A hub exists once a trainer called raysync.connect(); pass --name and --namespace for another"
    )


def render_status(
    status: Mapping[str, Any],
    *,
    namespace: str = DEFAULT_NAMESPACE,
    file: TextIO | None = None,
    every: bool = False,
) -> None:
    """Print ``hub.status()`` as tables: the hub, its models, its subscribers, their last errors.

    Over :data:`SUMMARY_ABOVE` subscribers (a fleet), they are counted by model and node, and
    only those behind the newest version, failing or not live are named (the first
    :data:`NAMED_AT_MOST`); ``every`` lists each one.

    Args:
        status: what ``HubClient.status()`` (or the hub actor's ``status``) returned.
        namespace: the hub's namespace, for the title.
        file: where to write (default: standard output).
        every: one row per subscriber, however many (``raysync status --all``).

    Example:
        >>> render_status(raysync.connect().status())  # doctest: +SKIP
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from raysync.ops.terminal_text import cell, printable  # every string from the hub: escaped text

    out = file or sys.stdout
    width = None if out.isatty() else max(160, shutil.get_terminal_size((160, 24)).columns)
    console = Console(file=out, width=width, highlight=False, soft_wrap=False)
    now = time.time()
    console.print(
        Text.assemble(
            (f"hub {status.get('hub')!r}", "bold"),
            f" (namespace {namespace!r}): up {_age(status.get('uptime_s'))}, keeps {status.get('keep')} "
            "version(s) per model"
            + (f", restored {status['restored_models']}" if status.get("restored_models") else ""),
        )
    )
    models = Table(title="models", title_justify="left")
    for col in ("model", "latest", "kept", "size", "buckets", "pushes", "pushed", "last push", "writer"):
        models.add_column(col, justify="right" if col not in ("model", "writer") else "left")
    for model_id, m in status.get("models", {}).items():
        writer = m.get("writer") or {}
        models.add_row(
            cell(model_id),
            _fmt(m.get("latest")),
            ",".join(str(v) for v in m.get("versions_kept", [])) or "-",
            _mib(m.get("bytes_per_version")),
            _fmt(m.get("buckets")),
            _fmt(m.get("pushes")),
            _mib(m.get("bytes_pushed")),
            f"{_age(m.get('last_push_age_s'))} ago" if m.get("last_push_age_s") is not None else "-",
            cell(_writer(writer)),
        )
    if not status.get("models"):
        models.add_row("(none yet)", *["-"] * 8)
    console.print(models)
    rows = list(status.get("subscribers", []))
    errors = [s for s in rows if row_error(s)]
    modified = [s for s in rows if s.get("modified_since") is not None]
    if len(rows) > SUMMARY_ABOVE and not every:
        console.print(_by_node(rows))
        odd = sorted(
            (s for s in rows if s.get("lag") or row_state(s) != "live" or row_error(s)),
            key=lambda s: -(s.get("lag") or 0),
        )
        if odd:
            named = odd[:NAMED_AT_MOST]
            more = f"; the first {len(named)}, most behind first" if len(odd) > len(named) else ""
            console.print(_subscriber_table(f"behind, failing or not live: {len(odd)}{more}", named, now))
        errors, modified = [s for s in odd[:NAMED_AT_MOST] if row_error(s)], modified[:NAMED_AT_MOST]
    else:
        console.print(_subscriber_table("subscribers", rows, now))
    if modified:
        console.print(Text("modified locally (* above)", style="bold"))
        for s in modified:
            console.print(
                f"  {printable(s.get('subscriber'))} ({printable(s.get('model_id'))}): its own code "
                f"changed version {s['modified_since']} in place since applying it (a module in training "
                "mode? call .eval() on rollout actors); the next version applied clears it",
                markup=False,
            )
    if errors:
        console.print(Text("last errors", style="bold"))
        for s in errors:
            who = f"{printable(s.get('subscriber'))} ({printable(s.get('model_id'))})"
            console.print(f"  {who}: {printable(row_error(s))}", markup=False)


SUMMARY_ABOVE = 50
"""Over this many subscribers, ``raysync status`` counts them by node (``--all``: one row each)."""
NAMED_AT_MOST = 20
"""The most subscribers behind, failing or not live that a summary names (most behind first)."""


def _subscriber_table(title: str, rows: list[Mapping[str, Any]], now: float) -> Any:
    """One row per subscriber: where it is, what it holds, how its applies went."""
    from rich.table import Table

    from raysync.ops.terminal_text import cell

    subs = Table(title=title, title_justify="left")
    for col in (
        "model",
        "subscriber",
        "actor",
        "node",
        "mode",
        "applied",
        "lag",
        "state",
        "apply",
        "applied at",
        "last error",
    ):
        subs.add_column(
            col,
            justify="right" if col in ("applied", "lag", "apply", "applied at") else "left",
            # ids are what a user greps the logs for: wrapped whole, never cut with an ellipsis
            overflow="fold" if col in ("model", "subscriber") else "ellipsis",
        )
    for s in rows:
        lag, state, error = s.get("lag"), row_state(s), row_error(s)
        applied_age = s.get("last_apply_age_s")
        if applied_age is None and s.get("last_apply_time") is not None:
            applied_age = now - s["last_apply_time"]
        subs.add_row(
            cell(s.get("model_id")),
            cell(s.get("subscriber")),
            cell(s.get("class_name") or "-"),
            cell(str(s.get("node_id") or "-")[:8]),
            cell(f"{s.get('mode')}/{s.get('apply') or 'copy'}"),
            _applied(s),
            cell(_fmt(lag), "yellow" if lag else ""),
            cell(state, "" if state == "live" else "red"),
            "-" if s.get("last_apply_s") is None else f"{s['last_apply_s'] * 1e3:.1f} ms",
            "-" if applied_age is None else f"{_age(applied_age)} ago",
            cell("-") if not error else cell(_short(error, 60), "red"),
        )
    if not rows:
        subs.add_row("-", "(none)", *["-"] * 9)
    return subs


def _by_node(rows: list[Mapping[str, Any]]) -> Any:
    """Subscribers counted by model and node: how many, at the newest version, behind, not live."""
    from rich.table import Table

    from raysync.ops.terminal_text import cell

    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for s in rows:
        groups.setdefault((str(s.get("model_id")), str(s.get("node_id") or "-")), []).append(s)
    table = Table(
        title=f"subscribers by node: {len(rows)} (raysync status --all: each)", title_justify="left"
    )
    for col in ("model", "node", "subscribers", "at newest", "behind", "not live", "failing", "most behind"):
        table.add_column(col, justify="left" if col in ("model", "node") else "right")
    for (model_id, node), members in sorted(groups.items()):
        lags = [s.get("lag") or 0 for s in members]
        behind = sum(1 for lag in lags if lag)
        not_live = sum(1 for s in members if row_state(s) != "live")
        failing = sum(1 for s in members if row_error(s))
        table.add_row(
            cell(model_id),
            cell(node[:8]),
            str(len(members)),
            str(len(members) - behind),
            cell(str(behind), "yellow" if behind else ""),
            cell(str(not_live), "red" if not_live else ""),
            cell(str(failing), "red" if failing else ""),
            str(max(lags)),
        )
    return table


# A subscriber whose model does not fit its model id's versions (a *misfit*: the hub keeps it
# registered but hands it no version) shows as state ``misfit``, with the reason (which tensors)
# where its last error goes.
def row_state(row: Mapping[str, Any]) -> str:
    """``misfit`` for a live misfit subscriber; else its state (``live``, ``unreachable``, ...).

    Example:
        >>> row_state({"state": "unreachable"})
        'unreachable'
    """
    state = str(row.get("state"))
    return "misfit" if row.get("misfit") and state == "live" else state


def row_error(row: Mapping[str, Any]) -> str | None:
    """Its last error; for a misfit, why its model does not fit (and that it is not handed versions).

    Example:
        >>> row_error({"last_error": None, "misfit": "shape mismatch w: pushed (4,), model (3,)"})
        'not handed versions, its model does not fit them: shape mismatch w: pushed (4,), model (3,)'
    """
    misfit = row.get("misfit")
    if misfit:
        return f"not handed versions, its model does not fit them: {misfit}"
    error = row.get("last_error")
    return None if not error else str(error)


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def _applied(row: Mapping[str, Any]) -> Any:
    """A subscriber's applied version; ``3*`` when its own code changed 3 in place since (modified)."""
    from rich.text import Text

    if row.get("modified_since") is None:
        return _fmt(row.get("applied"))
    return Text(f"{row.get('applied')}*", style="yellow")


def _mib(nbytes: Any) -> str:
    if nbytes is None:
        return "-"
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= MIB:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def _age(seconds: Any) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _writer(writer: Mapping[str, Any]) -> str:
    if not writer:
        return "-"
    who = f"actor {str(writer['actor_id'])[:8]}" if writer.get("actor_id") else f"job {writer.get('job_id')}"
    return f"{who} pid {writer.get('pid')}@{writer.get('host')}"


# ---------------------------------------------------------------------- bench


def _bench(args: argparse.Namespace) -> int:
    import ray
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    config = bench.config_from(args)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    address = args.address or os.environ.get("RAY_ADDRESS")
    with contextlib.ExitStack() as stack:
        if address:
            deadline = time.monotonic() + args.timeout
            if connect(address, timeout=args.timeout, deadline=deadline, command=args.command):
                stack.callback(ray.shutdown)
            where = address
        elif ray.is_initialized():  # called from a process connected already (a test, a notebook)
            where = "this process's Ray cluster"
        else:
            stack.enter_context(bench.local_ray(config))
            where = "a local Ray of its own"
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        progress = stack.enter_context(Progress(*columns, console=Console(stderr=True)))
        task = progress.add_task("starting", total=None)

        def step(description: str, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=description)

        try:
            report = bench.run_check(config, progress=step)
        except Exception as err:  # its hubs and actors are gone already: say where it stopped, and why
            stage = progress.tasks[0].description
            raise CliError(f"the check stopped at {stage!r}: {type(err).__name__}: {err}") from err
        progress.update(task, completed=progress.tasks[0].total, description="done")
    report["meta"]["address"] = address
    bench.print_report(report, where=where)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nJSON: {args.json}")
    return 0 if all(row["verified"] for row in report["rows"]) else 1

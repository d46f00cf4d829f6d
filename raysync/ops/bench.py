"""``raysync bench``: a compact check of a Ray cluster, each figure beside Ray's own floor.

On the cluster this process is connected to, with a fresh hub and N fresh actors per
configuration (spread over the nodes, asking for no CPU; all removed at the end, the hub's
records in the GCS too), it pushes versions of each ``sizes_mib`` (fan-out, per ``apply``
mode) and of each ``small_kib`` (small versions), and times how long until every actor
applied one and how long the push blocked the trainer, each beside Ray's own floor measured
in the same rounds: ``ray.put`` of the same bytes and N plain actors ``ray.get`` (and
``copy_``) it; a bare ``ray.put`` (see :data:`CHECKS`). The comparisons, memory, cost
curves, soak and plots are in a source checkout's ``benchmarks/``. Importing this module
loads neither torch nor Ray.

Example:
    >>> from raysync.ops import bench
    >>> config = bench.BenchConfig(**bench.QUICK)
    >>> with bench.local_ray(config):  # doctest: +SKIP
    ...     report = bench.run_check(config, progress=print)
    >>> bench.print_report(report, where="a local Ray")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import logging
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from raysync.ops.bench_report import CHECKS, KIB, LARGE_MIB, MIB, print_report
from raysync.ops.bench_report import size_label as _label

__all__ = ["CHECKS", "BenchConfig", "add_arguments", "config_from", "local_ray", "print_report", "run_check"]

logger = logging.getLogger(__name__)

FULL: dict[str, Any] = {"sizes_mib": (64, 256), "small_kib": (4, 256), "actors": (1, 4), "repeats": 5}
"""The full run (the default)."""
QUICK: dict[str, Any] = {"sizes_mib": (16,), "small_kib": (4,), "actors": (2,), "repeats": 3}
"""What ``--quick`` sets, unless given explicitly."""


DESCRIPTION = """\
Check a Ray cluster with raysync: push fan-out (a version to N actors, until all applied) and
small versions, each beside Ray's own floor measured in the same rounds on that cluster (ray.put
and N actors ray.get'ting it, one actor call at N=1; a bare ray.put for the trainer's block).
Fresh hubs and actors, spread over its nodes and asking for no CPU, all removed at the end. A
progress bar, then one line per check (the value, its floor, their ratio, the bound) and what a
miss means; every sample in --json. torchrl's schemes and the adapters beside raysync, memory,
copies per version, cost curves, the soak and plots: a source checkout's benchmarks/."""

EPILOG = f"""\
runs:
  full (the default)  --sizes-mib 64 256 --small-kib 4 256 --actors 1 4 --apply copy view
                      --repeats 5: about 3.5 minutes on 2 cores, up to about 7 GiB of memory
                      (256 MiB to 4 receivers, 4 floor actors beside them)
  --quick             --sizes-mib 16 --small-kib 4 --actors 2 --repeats 3: under a minute
  Options given explicitly win over --quick. With `ray start` on Ray 2.60: RAY_AUTH_MODE=token.

targets:
  The bounds are the project's goals on its 2-core reference machine (fan-out: {LARGE_MIB} MiB
  and up); elsewhere compare each value with its floor, measured beside it in the same run.

exit code:
  0 when every receiver ended on the last version pushed with its weights (the ok column),
  whether or not the targets were met; 1 when one did not, when the cluster could not be
  reached, or when the check stopped half-way (one line says where and why); 2 for bad usage.
"""


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What ``raysync bench`` measures (``ValueError`` if nothing, or nonsense); the full run's defaults.

    Example:
        >>> BenchConfig(**QUICK).sizes_mib, BenchConfig().actors
        ((16,), (1, 4))
    """

    sizes_mib: tuple[int, ...] = FULL["sizes_mib"]
    small_kib: tuple[int, ...] = FULL["small_kib"]
    actors: tuple[int, ...] = FULL["actors"]
    apply: tuple[str, ...] = ("copy", "view")
    repeats: int = FULL["repeats"]
    warmup: int = 3
    timeout: float = 120.0

    def __post_init__(self) -> None:
        counts = [*self.sizes_mib, *self.small_kib, *self.actors, self.repeats, self.warmup]
        if any(not isinstance(v, int) or v < 1 for v in counts) or not self.timeout > 0 or not self.actors:
            raise ValueError(f"sizes, actors, repeats, warmup: integers >= 1; timeout > 0; got {self}")
        if not self.apply or set(self.apply) - {"copy", "view"}:
            raise ValueError(f"apply modes are 'copy' and 'view', got {self.apply!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``raysync bench``'s options, with its description and epilog, on ``parser``.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_arguments(p)
        >>> p.parse_args(["--quick"]).quick
        True
    """
    parser.description, parser.epilog = DESCRIPTION, EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    where = "default: $RAY_ADDRESS, else a local Ray of its own; 'auto': the one started on this machine"
    parser.add_argument("--address", metavar="HOST:PORT", help=f"the Ray cluster to check ({where})")
    parser.add_argument("--quick", action="store_true", help="a short run: under a minute on 2 cores")
    for key, metavar, text in (
        ("sizes_mib", "MIB", "fan-out version sizes in MiB"),
        ("small_kib", "KIB", "small version sizes in KiB"),
        ("actors", "N", "receiver counts N"),
        ("repeats", "N", "timed rounds per figure, medians reported"),
    ):
        full, quick = (" ".join(map(str, v)) if isinstance(v, tuple) else v for v in (FULL[key], QUICK[key]))
        parser.add_argument(
            "--" + key.replace("_", "-"),
            type=_positive,
            nargs="+" if isinstance(FULL[key], tuple) else None,
            metavar=metavar,
            help=f"{text} (default: {full}; --quick: {quick})",
        )
    modes = ["copy", "view"]
    parser.add_argument(
        "--apply", nargs="+", choices=modes, default=modes, help="fan-out apply modes (default: copy view)"
    )
    parser.add_argument(
        "--warmup", type=_positive, default=3, metavar="N", help="untimed rounds first (default: 3)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="for any one wait, connecting to --address included (default: 120)",
    )
    out = Path("raysync-bench/bench.json")
    parser.add_argument(
        "--json", type=Path, default=out, metavar="PATH", help=f"where to write every sample (default: {out})"
    )
    parser.add_argument("--verbose", action="store_true", help="raysync's logs on standard error")


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` of parsed options: ``--quick``'s values where none was given.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_arguments(p)
        >>> config_from(p.parse_args(["--quick", "--actors", "3", "1"])).actors
        (1, 3)
    """
    values = dict(QUICK if args.quick else FULL)
    for key in values:
        given = getattr(args, key)
        if given is not None:
            values[key] = tuple(sorted(set(given))) if isinstance(given, list) else given
    apply = tuple(dict.fromkeys(args.apply))
    return BenchConfig(**values, apply=apply, warmup=args.warmup, timeout=args.timeout)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


# ---------------------------------------------------------------------- actors


class _Receiver:
    """A raysync receiver: ``self.policy`` holds fp32 parameters ``w00``, ``w01``, ... of these sizes."""

    def __init__(self, numels: list[int]) -> None:
        import torch

        self.policy = torch.nn.Module()
        for i, numel in enumerate(numels):
            self.policy.register_parameter(f"w{i:02d}", torch.nn.Parameter(torch.zeros(numel), False))

    def ready(self) -> int:
        return os.getpid()

    def probe(self) -> tuple[int | None, float]:
        """The version held and the marker, ``w00[0]``."""
        version: int | None = self.raysync_version()  # type: ignore[attr-defined]
        return version, float(self.policy.get_parameter("w00")[0])


class _FloorReceiver:
    """A plain actor with tensors of its own: Ray's floor of handing a put to an actor."""

    def __init__(self, numels: list[int]) -> None:
        import torch

        self.tensors = [torch.zeros(numel) for numel in numels]
        self.held: Any = None

    def ready(self) -> int:
        return os.getpid()

    def take(self, boxed: list[Any], copy: bool) -> float:
        """``ray.get`` the ref (zero-copy), then ``copy_`` it in or hold the views; the marker."""
        import ray
        import torch

        arrays = ray.get(boxed[0])
        if not copy:
            self.held = arrays
            return float(arrays[0][0])
        for dst, src in zip(self.tensors, arrays, strict=True):
            dst.copy_(torch.from_numpy(src))
        return float(self.tensors[0][0])


@contextlib.contextmanager
def _actors(cls: type, n: int, *args: Any, timeout: float) -> Iterator[list[Any]]:
    """N actors of ``cls`` spread over the nodes, asking for no CPU: up when yielded, killed after."""
    import ray

    remote: Any = ray.remote(num_cpus=0, scheduling_strategy="SPREAD")(cls)
    actors = [remote.remote(*args) for _ in range(n)]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=timeout)
        yield actors
    finally:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        # ray.kill returns before the actor is gone: a receiver still running would find its
        # killed hub again by name, and so start a new one
        deadline = time.monotonic() + 30.0
        for actor in actors:
            _until_dead(actor, "ready", deadline)


def _until_dead(actor: Any, method: str, deadline: float) -> bool:
    """Call a killed actor's ``method`` until Ray says it died (``True``), or until ``deadline``."""
    import ray

    while time.monotonic() < deadline:
        try:
            ray.get(getattr(actor, method).remote(), timeout=1.0)
            time.sleep(0.05)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            continue  # busy, or on its way out
        except Exception:
            return True  # dead
    return False


@contextlib.contextmanager
def _fresh_hub() -> Iterator[Any]:
    """A hub of its own (a unique name): killed after, and its records in the GCS deleted."""
    import ray

    import raysync
    from raysync.hub.persistence import forget_hub

    hub = raysync.connect(f"raysync-bench-{uuid.uuid4().hex[:8]}")
    try:
        yield hub
    finally:
        deadline = time.monotonic() + 30.0
        actor: Any = hub.actor
        while actor is not None:  # again if something called the hub after it died, which made a new one
            with contextlib.suppress(Exception):
                ray.kill(actor)  # its relays go with it
            _until_dead(actor, "status", deadline)  # dead before its records go (below)
            found: Any = None
            try:
                found = ray.get_actor(hub.name, namespace=hub.namespace)
            except ValueError:
                pass  # no actor of that name: gone
            actor = None if found == actor else found  # the killed one: Ray forgets its name soon
            if time.monotonic() > deadline:
                logger.warning("raysync bench: its hub %r is still there after 30 s", hub.name)
                break
        # Ray reports an actor dead before its process has exited: a record its last moments wrote
        # (a version's record goes 20 ms after the publish) is deleted until none came for 1 s
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 1.0 and time.monotonic() < deadline:
            time.sleep(0.2)
            with contextlib.suppress(Exception):
                if forget_hub(hub.name):
                    quiet_since = time.monotonic()


# ---------------------------------------------------------------------- measuring


def run_check(
    config: BenchConfig, *, progress: Callable[[str, int, int], None] | None = None
) -> dict[str, Any]:
    """Measure every check of ``config`` on the Ray cluster this process is connected to.

    Args:
        config: sizes, receiver counts, apply modes, repeats, timeout.
        progress: called as each step starts with its description, the steps done and all steps.

    Returns:
        ``{"meta": {...}, "rows": [...]}``: one row per check and configuration, with
        ``check``, ``where``, ``measured_s``, ``floor_s``, ``ratio``, ``bound``, ``met``,
        ``verified`` and the samples.

    Example:
        >>> with local_ray(BenchConfig(**QUICK)):  # doctest: +SKIP
        ...     report = run_check(BenchConfig(**QUICK), progress=print)
        >>> {r["check"] for r in report["rows"]} == set(CHECKS)  # doctest: +SKIP
        True
    """
    import ray
    import torch

    import raysync

    c = config
    total = (len(c.sizes_mib) * len(c.apply) + len(c.small_kib)) * len(c.actors)
    done = [0]

    def say(text: str) -> None:
        logger.info("%s", text)
        if progress is not None:
            progress(text, done[0], total)
        done[0] += 1

    started = time.time()
    rows: list[dict[str, Any]] = []
    for size_mib in c.sizes_mib:
        for n in c.actors:
            for apply in c.apply:
                say(f"fan-out {size_mib} MiB N={n} apply={apply}")
                rows += _delivery("fan-out", size_mib * MIB, n, apply, c)
    for kib in c.small_kib:
        for n in c.actors:
            say(f"small {kib} KiB N={n}")
            rows += _delivery("small", kib * KIB, n, "copy", c)
    for row in rows:
        row["ratio"] = row["measured_s"] / row["floor_s"] if row["floor_s"] else None
        row["bound"] = CHECKS[row["check"]][0]
        row["met"] = row["ratio"] is not None and row["ratio"] <= row["bound"]
    meta = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": time.time() - started,
        "nodes": sum(1 for node in ray.nodes() if node.get("Alive")),
        "cpus": ray.cluster_resources().get("CPU"),
        "versions": {"ray": ray.__version__, "torch": torch.__version__, "raysync": raysync.__version__},
        "config": dataclasses.asdict(c),
    }
    return {"meta": meta, "rows": rows}


def _weights(nbytes: int, tensors: int) -> dict[str, Any]:
    import torch

    numel = max(1, nbytes // 4 // tensors)
    return {f"w{i:02d}": torch.full((numel,), float(i)) for i in range(tensors)}


def _arrays(sd: Mapping[str, Any]) -> list[Any]:
    return [t.numpy() for t in sd.values()]


def _steady(hub: Any, n: int, sd: dict[str, Any], timeout: float) -> None:
    """Until the N receivers registered and each one's node is served as it will be from now on (by
    its relay, or by the hub ringing its own node's doorbells): pushes, for up to 10 s after that."""
    deadline = time.monotonic() + timeout
    while len(hub.status()["subscribers"]) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} receivers did not register with the hub within {timeout:g} s")
        time.sleep(0.05)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        hub.push(sd, wait=True, timeout=timeout)
        status = hub.status()
        here = status.get("here") or {}
        nodes = collections.Counter(s.get("node_id") for s in status["subscribers"])
        if all(
            node in status["relays"] or (node == here.get("node_id") and here.get("members", 0) >= count)
            for node, count in nodes.items()
        ):
            return


def _timed(fn: Callable[[], Any], into: list[float]) -> Any:
    """``fn()``, its seconds appended to ``into``."""
    t0 = time.perf_counter()
    result = fn()
    into.append(time.perf_counter() - t0)
    return result


def _floor_round(sd: dict[str, Any], actors: list[Any], copy: bool, timeout: float) -> list[float]:
    """Ray's floor: ``ray.put`` of the weights, then N actors ``ray.get`` it (and ``copy_`` it in)."""
    import ray

    ref = ray.put(_arrays(sd))
    return list(ray.get([a.take.remote([ref], copy) for a in actors], timeout=timeout))


def _delivery(kind: str, nbytes: int, n: int, apply: str, config: BenchConfig) -> list[dict[str, Any]]:
    """A version of ``nbytes`` to N fresh receivers, and the trainer's block, each round beside Ray's
    floors (interleaved: both see the same machine and object store)."""
    import ray

    import raysync

    gc.collect()  # the last configuration's client still holds its newest version, in a reference cycle
    sd = _weights(nbytes, 16 if kind == "fan-out" else 8)
    first, numels, timeout = sd["w00"], [t.numel() for t in sd.values()], config.timeout
    times: dict[str, list[float]] = {"applied": [], "floor": [], "blocked": [], "put": []}
    with _actors(_FloorReceiver, n, numels, timeout=timeout) as floor_actors, _fresh_hub() as hub:
        synced = raysync.synced_model("policy", hub=hub.name, apply=apply)(_Receiver)  # type: ignore[arg-type]
        with _actors(synced, n, numels, timeout=timeout) as actors:
            _steady(hub, n, sd, timeout)
            for i in range(config.warmup + config.repeats):
                into = times if i >= config.warmup else collections.defaultdict(list)
                first[0] = marker = -1.0 - i
                got = _timed(lambda: _floor_round(sd, floor_actors, apply == "copy", timeout), into["floor"])
                if got != [marker] * n:
                    raise RuntimeError(f"Ray's floor actors answered {got}, not the marker {marker}")
                first[0] = marker = float(i)
                _timed(lambda: hub.push(sd, wait=True, timeout=timeout), into["applied"])
                _timed(lambda: ray.put(_arrays(sd)), into["put"])  # the trainer's floor
                first[0] = marker = i + 0.5
                hub.wait(_timed(lambda: hub.push(sd), into["blocked"]), timeout=timeout)
            latest = hub.latest()
            held = ray.get([a.probe.remote() for a in actors], timeout=timeout)
            nodes = len({s.get("node_id") for s in hub.status()["subscribers"]})
    verified = all(version == latest and value == marker for version, value in held)
    if not verified:
        logger.error("receivers hold %s, expected version %s with marker %s", held, latest, marker)
    where = f"{_label(nbytes)} {apply} N={n}" + (f" on {nodes} nodes" if nodes > 1 else "")
    common = {"where": where, "bytes": nbytes, "n": n, "apply": apply, "nodes": nodes, "verified": verified}
    rows: list[dict[str, Any]] = [
        {"check": f"{kind}: all applied", **common, "samples_s": times["applied"]} | _floor(times["floor"]),
        {"check": f"{kind}: trainer blocked", **common, "samples_s": times["blocked"]} | _floor(times["put"]),
    ]
    return [row | {"measured_s": statistics.median(row["samples_s"])} for row in rows]


def _floor(samples: list[float]) -> dict[str, Any]:
    return {"floor_s": statistics.median(samples), "floor_samples_s": samples}


@contextlib.contextmanager
def local_ray(config: BenchConfig) -> Iterator[None]:
    """A Ray of the check's own on this machine, its store six of the largest versions; shut down on exit.

    Example:
        >>> with local_ray(BenchConfig(**QUICK)):  # doctest: +SKIP
        ...     report = run_check(BenchConfig(**QUICK))
    """
    import ray

    largest = max([s * MIB for s in config.sizes_mib] + [k * KIB for k in config.small_kib])
    ray.init(
        address="local",
        object_store_memory=max(512 * MIB, 6 * largest),
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()

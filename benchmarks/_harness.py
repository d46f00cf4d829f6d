"""The benchmarks' harness: models, a local cluster, timing, JSON/PNG output, options.

Every script in ``benchmarks/`` builds on these pieces instead of repeating them
(and on :mod:`_floor` for the copy floor, the object-store gauge and process
memory). The scripts import it as a sibling module (``import _harness as
harness``): Python puts a script's own folder first on its path, and Ray hands
that folder to its workers, so actors defined here load in them too.

models
    :class:`FlatModel` (an fp32 model of N bytes in K equal tensors),
    :func:`make_state_dict` (the trainer's weights, every page written),
    :class:`FlatModelFactory` (a picklable factory for receivers) and
    :func:`small_policy` (a tiny MLP).
clusters
    :func:`local_cluster`: a Ray cluster of the benchmark's own
    (``address="local"``, a sized object store, no dashboard), shut down on exit.
timing
    :func:`median`, :func:`ratio`, :func:`timed`, :func:`repeat` (warm-up, then
    timed samples), :func:`wait_until_quiet`, :func:`kill_all`, :func:`kill_relays`.
output
    :func:`run_meta` (machine, versions, checkout), :func:`write_json`,
    :func:`pyplot` (matplotlib, or a clear :class:`BenchError`), :func:`save_figure`.
options
    :func:`add_options` (the options every scenario shares, each with the
    scenario's default) and :func:`results_path`.

Example:
    >>> import _harness as harness
    >>> with harness.local_cluster(num_cpus=4, object_store_bytes=2**30):  # doctest: +SKIP
    ...     sd = harness.make_state_dict(16 * harness.MIB, 16)
    ...     samples = harness.repeat(lambda: hub.push(sd, wait=True), repeats=5, warmup=2)
    ...     print(harness.median(samples))
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
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = [
    "DEFAULT_RESULTS_DIR", "MIB", "BenchError", "FlatModel", "FlatModelFactory", "add_options", "fmt",
    "git_state", "kill_all", "kill_relays", "local_cluster", "make_state_dict", "median", "model_bytes",
    "pyplot", "ratio", "raysync_fingerprint", "repeat", "results_path", "run_meta", "save_figure",
    "small_policy", "tensor_numel", "timed", "wait_until_quiet", "write_json",
]  # fmt: skip

logger = logging.getLogger(__name__)

MIB = 2**20
DEFAULT_RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where results go unless ``--json`` says otherwise: ``benchmarks/results/`` (not committed)."""

T = TypeVar("T")


class BenchError(RuntimeError):
    """A benchmark cannot do what it was asked (a missing optional package, nothing to plot).

    Example:
        >>> try:
        ...     pyplot()
        ... except BenchError as err:  # doctest: +SKIP
        ...     print(err)
        plotting needs matplotlib: pip install "raysync[plot]"
    """


# ---------------------------------------------------------------------- models


def tensor_numel(total_bytes: int, num_tensors: int) -> int:
    """Elements per fp32 tensor so that ``num_tensors`` of them make ``total_bytes`` (at least 1).

    Example:
        >>> tensor_numel(16 * MIB, 16)
        262144
    """
    if num_tensors < 1:
        raise ValueError(f"num_tensors must be >= 1, got {num_tensors}")
    return max(1, total_bytes // 4 // num_tensors)


class FlatModel(torch.nn.Module):
    """A model that is only weights: ``num_tensors`` equal fp32 parameters of ``total_bytes`` in all.

    Args:
        total_bytes: the model's size (rounded down to whole fp32 elements per tensor).
        num_tensors: how many parameters.
        fill: the value every element starts at; None leaves them ``torch.empty``
            (not touched, so not resident until written: a receiver that only
            ever holds pushed weights pays no memory for its initial ones).
        name: the parameter names, formatted with ``i`` (``"w{i:02d}"``: ``w00``, ``w01``, ...).
        requires_grad: whether the parameters need gradients.

    Example:
        >>> m = FlatModel(4 * MIB, 4, fill=0.0)
        >>> [n for n, _ in m.named_parameters()], model_bytes(m) == 4 * MIB
        (['w00', 'w01', 'w02', 'w03'], True)
    """

    def __init__(
        self,
        total_bytes: int,
        num_tensors: int = 16,
        *,
        fill: float | None = None,
        name: str = "w{i:02d}",
        requires_grad: bool = False,
    ) -> None:
        super().__init__()
        numel = tensor_numel(total_bytes, num_tensors)
        for i in range(num_tensors):
            data = torch.empty(numel) if fill is None else torch.full((numel,), float(fill))
            self.register_parameter(name.format(i=i), torch.nn.Parameter(data, requires_grad=requires_grad))


@dataclass(frozen=True)
class FlatModelFactory:
    """A picklable factory of :class:`FlatModel` (for receivers that build their own model).

    Example:
        >>> factory = FlatModelFactory(MIB, 4, fill=0.0)
        >>> model_bytes(factory()) == MIB
        True
    """

    total_bytes: int
    num_tensors: int = 16
    fill: float | None = 0.0
    name: str = "w{i:02d}"

    def __call__(self) -> torch.nn.Module:
        return FlatModel(self.total_bytes, self.num_tensors, fill=self.fill, name=self.name)


def make_state_dict(
    total_bytes: int, num_tensors: int = 16, *, name: str = "w{i:02d}", random: bool = False
) -> dict[str, torch.Tensor]:
    """The trainer's weights: a plain fp32 state dict with every page written (resident).

    Tensor ``i`` is filled with ``float(i)``, or with ``torch.randn`` if ``random``.

    Example:
        >>> sd = make_state_dict(MIB, 4)
        >>> sorted(sd), float(sd["w03"][0])
        (['w00', 'w01', 'w02', 'w03'], 3.0)
    """
    numel = tensor_numel(total_bytes, num_tensors)
    return {
        name.format(i=i): torch.randn(numel) if random else torch.full((numel,), float(i))
        for i in range(num_tensors)
    }


def model_bytes(weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> int:
    """Bytes of a module's parameters or of a state dict's tensors.

    Example:
        >>> model_bytes(make_state_dict(MIB, 2)) == MIB
        True
    """
    tensors = weights.parameters() if isinstance(weights, torch.nn.Module) else weights.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def small_policy(seed: int = 0, *, hidden: int = 16) -> torch.nn.Module:
    """A tiny MLP (8 -> ``hidden`` -> 4), the same weights for the same seed.

    Example:
        >>> sum(p.numel() for p in small_policy().parameters())
        212
    """
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4))


# ---------------------------------------------------------------------- cluster


def join_gloo(rank: int, world: int, port: int, *, timeout_s: float = 120.0) -> None:
    """Join a gloo group of ``world`` ranks over TCP on this machine (``port``: rank 0's store),
    as a sharded trainer's ranks do before building their ``DTensor``\\ s.

    Example:
        >>> join_gloo(0, 2, 29500)  # doctest: +SKIP
    """
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


@contextlib.contextmanager
def local_cluster(
    *,
    num_cpus: int,
    object_store_bytes: int,
    log_to_driver: bool = False,
    logging_level: int = logging.WARNING,
    reuse: bool = False,
) -> Iterator[bool]:
    """A Ray cluster of the benchmark's own on this machine, shut down on exit.

    ``address="local"`` starts a new cluster even when another one runs on the
    machine or ``RAY_ADDRESS`` names one: a benchmark never measures (or
    disturbs) someone else's. No dashboard.

    Args:
        num_cpus: CPUs the cluster advertises (actors ask for them, not the machine).
        object_store_bytes: the object store's size (at least 80 MiB, Ray's minimum).
        log_to_driver: show the workers' logs.
        logging_level: Ray's own log level in this process.
        reuse: if this process is already connected to a cluster, use it and leave it
            running (a test's cluster, say) instead of failing.

    Yields:
        Whether this call started the cluster (and will shut it down).

    Example:
        >>> with local_cluster(num_cpus=4, object_store_bytes=512 * MIB) as started:  # doctest: +SKIP
        ...     run_scenario()
    """
    import ray

    if reuse and ray.is_initialized():
        yield False
        return
    ray.init(
        address="local",
        num_cpus=num_cpus,
        object_store_memory=max(int(object_store_bytes), 80 * MIB),
        include_dashboard=False,
        logging_level=logging_level,
        log_to_driver=log_to_driver,
    )
    try:
        yield True
    finally:
        ray.shutdown()


_NODES: list[str] = []  # the custom resources that name the nodes actors are spread over (none: one node)


def placed(i: int) -> dict[str, Any]:
    """Actor options that put a row's ``i``-th actor on its node, round robin over the nodes of
    :func:`simulated_nodes` (nothing on one node).

    Example:
        >>> placed(0)
        {}
    """
    return {"resources": {_NODES[i % len(_NODES)]: 1}} if _NODES else {}


@contextlib.contextmanager
def simulated_nodes(
    nodes: int, *, num_cpus: int, object_store_bytes: int, logging_level: int = logging.WARNING
) -> Iterator[list[str]]:
    """A private ``ray.cluster_utils.Cluster`` of ``nodes`` raylets on this machine (each its own
    object store; a version crosses between them as between machines), this process connected
    to it on the first (the head), and :func:`placed` spreading actors over them. Yields the
    node resources (``node0`` is the head).

    Example:
        >>> with simulated_nodes(2, num_cpus=10, object_store_bytes=512 * MIB) as names:  # doctest: +SKIP
        ...     actor = Receiver.options(**placed(1)).remote()   # on node1
    """
    import ray
    from ray.cluster_utils import Cluster

    # Cluster() records its address where any plain ray.init() on this machine would join it:
    # this process connects by explicit address, so keep it private.
    ray._private.utils.write_ray_address = lambda *_args, **_kwargs: None
    store = max(int(object_store_bytes), 80 * MIB)
    names = [f"node{i}" for i in range(nodes)]
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": num_cpus,
            "object_store_memory": store,
            "resources": {names[0]: 1000},
            "include_dashboard": False,
        },
    )
    try:
        for name in names[1:]:
            cluster.add_node(num_cpus=num_cpus, object_store_memory=store, resources={name: 1000}, wait=False)
        ray.init(address=cluster.address, logging_level=logging_level, log_to_driver=False)
        cluster.wait_for_nodes()
        _NODES[:] = names
        yield names
    finally:
        _NODES.clear()
        ray.shutdown()
        cluster.shutdown()


def kill_all(actors: Iterable[Any]) -> None:
    """``ray.kill`` every actor, ignoring the ones already gone.

    Example:
        >>> kill_all([])
    """
    import ray

    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)


def kill_relays(hub: Any, *, node_ids: Iterable[str] | None = None, restart: bool = True) -> int:
    """Kill the node relays of ``hub`` (a :class:`raysync.HubClient`); Ray restarts them by default.

    Relays not started (yet) are skipped; returns how many were killed.

    Example:
        >>> kill_relays(raysync.connect())  # doctest: +SKIP
        1
    """
    import ray

    from raysync._protocol import DEFAULT_NAMESPACE
    from raysync.hub.relay import relay_name

    nodes = list(node_ids) if node_ids is not None else [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    hub_id = hub.actor._actor_id.hex()
    killed = 0
    for node in nodes:
        try:
            relay = ray.get_actor(relay_name(hub.name, hub_id, node), namespace=DEFAULT_NAMESPACE)
            ray.kill(relay, no_restart=not restart)
        except Exception:  # not started, restarting, or gone with a restarting hub
            continue
        killed += 1
    return killed


# ---------------------------------------------------------------------- timing


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None if there are none.

    Example:
        >>> median([3.0, None, 1.0, 2.0]), median([None])
        (2.0, None)
    """
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0.

    Example:
        >>> ratio(3.0, 2.0), ratio(1.0, 0.0)
        (1.5, None)
    """
    return None if a is None or b is None or b == 0 else a / b


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Call ``fn``; return its result and the seconds it took (``time.perf_counter``).

    Example:
        >>> result, seconds = timed(lambda: sum(range(1000)))
        >>> result
        499500
    """
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def repeat(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> list[float]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed; return the timed seconds.

    Example:
        >>> samples = repeat(lambda: sum(range(1000)), repeats=5, warmup=2)
        >>> len(samples)
        5
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    for _ in range(warmup):
        fn()
    return [timed(fn)[1] for _ in range(repeats)]


def wait_until_quiet(busy_below: float = 50.0, timeout: float = 5.0) -> float:
    """Wait (bounded) until the machine's CPUs are mostly idle, e.g. after actors started.

    Returns the last CPU utilisation seen, in percent of all cores (a noise indicator).

    Example:
        >>> busy = wait_until_quiet(timeout=1.0)  # doctest: +SKIP
    """
    import psutil  # a dependency of ray[default]; also in ray/thirdparty_files inside actors

    deadline = time.monotonic() + timeout
    busy = float(psutil.cpu_percent(interval=0.2))
    while busy >= busy_below and time.monotonic() < deadline:
        busy = float(psutil.cpu_percent(interval=0.2))
    if busy >= busy_below:
        logger.info("CPUs still %.0f%% busy (other processes?): timings will be noisy", busy)
    return busy


# ---------------------------------------------------------------------- output


def fmt(value: float | None, spec: str = ".3f") -> str:
    """``format(value, spec)``, or ``-`` for None (a table cell).

    Example:
        >>> fmt(0.12345), fmt(None), fmt(2.5, ".1f")
        ('0.123', '-', '2.5')
    """
    return "-" if value is None else format(value, spec)


def git_state() -> dict[str, Any]:
    """The checkout raysync runs from, if it runs from one: HEAD and whether ``raysync/`` had changes.

    Both None for an installed wheel (no checkout around the package).

    Example:
        >>> sorted(git_state())
        ['commit', 'raysync_dirty']
    """
    import raysync

    root = Path(raysync.__file__).resolve().parent.parent
    out: dict[str, Any] = {"commit": None, "raysync_dirty": None}
    if not (root / ".git").exists() or not (root / "pyproject.toml").is_file():
        return out  # site-packages: a repository further up is not raysync's

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", *argv], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    with contextlib.suppress(Exception):
        out["commit"] = git("rev-parse", "HEAD")
        out["raysync_dirty"] = bool(git("status", "--porcelain", "--", "raysync"))
    return out


def raysync_fingerprint() -> str:
    """A hash of raysync's source files as they are on disk now.

    Actors import raysync from disk when they start, the driver once at start-up:
    if the source changes during a run, later configurations mix two versions.

    Example:
        >>> len(raysync_fingerprint())
        16
    """
    import raysync

    digest = hashlib.sha1()
    for path in sorted(Path(raysync.__file__).resolve().parent.rglob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def run_meta(
    scenario: str, argv: Sequence[str] | None = None, *, started: float | None = None, **extra: Any
) -> dict[str, Any]:
    """What a result file says about its run: scenario, options, machine, versions, checkout.

    Args:
        scenario: what ran (``"benchmarks/push_fanout.py"``, ``"benchmarks/soak.py"``).
        argv: its command line (default: ``sys.argv[1:]``).
        started: when it started (``time.time()``; default now); ``duration_s`` is measured from
            it (None without it).
        extra: more keys (the scenario's options, the object store's size, ...).

    Example:
        >>> meta = run_meta("doc", ["--quick"], cpus_used=2)
        >>> meta["scenario"], meta["argv"], meta["cpus_used"]
        ('doc', ['--quick'], 2)
    """
    import ray

    import raysync

    now = time.time()
    t_start = now if started is None else started
    meta: dict[str, Any] = {
        "scenario": scenario,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t_start)),
        "duration_s": None if started is None else now - started,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "raysync": raysync.__version__,
        "git": git_state(),
    }
    meta.update(extra)
    return meta


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, argparse.Namespace):
        return vars(value)  # its values come back here as needed
    return str(value)


def write_json(
    path: str | os.PathLike[str], payload: Mapping[str, Any] | Sequence[Any], *, indent: int = 2
) -> Path:
    """Write ``payload`` as JSON to ``path`` (its folder made if missing); paths and others as text.

    Example:
        >>> config = argparse.Namespace(json=Path("r.json"))
        >>> write_json(tmp / "r.json", {"rows": [], "config": config})  # doctest: +SKIP
        PosixPath('.../r.json')
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=indent, default=_jsonable))
    return out


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend.

    Raises:
        BenchError: matplotlib is not installed (the message says how to get it).

    Example:
        >>> plt = pyplot()  # doctest: +SKIP
        >>> fig, ax = plt.subplots()  # doctest: +SKIP
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise BenchError('plotting needs matplotlib: pip install "raysync[plot]" (or pass no --png)') from err
    return plt


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = 110) -> Path:
    """Save a matplotlib figure as PNG (its folder made if missing) and close it.

    Example:
        >>> fig, ax = pyplot().subplots()  # doctest: +SKIP
        >>> save_figure(fig, "plots/x.png")  # doctest: +SKIP
        PosixPath('plots/x.png')
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    pyplot().close(fig)
    return out


# ---------------------------------------------------------------------- options


def results_path(name: str, results_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a scenario writes ``name`` by default: ``results_dir``, else :data:`DEFAULT_RESULTS_DIR`.

    Example:
        >>> results_path("push_fanout.json", "/tmp/results")
        PosixPath('/tmp/results/push_fanout.json')
    """
    return Path(results_dir if results_dir is not None else DEFAULT_RESULTS_DIR) / name


_OPTIONS: dict[str, tuple[str, dict[str, Any], str]] = {
    "sizes_mib": ("--sizes-mib", {"type": int, "nargs": "+"}, "model sizes in MiB"),
    "actors": ("--actors", {"type": int, "nargs": "+"}, "receiver counts N"),
    "repeats": ("--repeats", {"type": int}, "timed repeats per configuration (medians)"),
    "warmup": ("--warmup", {"type": int}, "untimed repeats per configuration, first"),
    "tensors": ("--tensors", {"type": int}, "equal fp32 tensors per model"),
    "timeout": ("--timeout", {"type": float}, "seconds for any one wait"),
    "object_store_mib": ("--object-store-mib", {"type": int}, "object store size in MiB"),
    "json": ("--json", {"type": Path}, "where to write the results"),
    "png": ("--png", {"type": Path}, "where to write the plot"),
}


def add_options(
    parser: argparse.ArgumentParser,
    *,
    verbose: bool = False,
    helps: dict[str, str] | None = None,
    **defaults: Any,
) -> argparse.ArgumentParser:
    """Add the options benchmarks share, each one named in ``defaults``, with that default.

    Names: ``sizes_mib`` (``--sizes-mib``, model sizes), ``actors`` (receiver
    counts N), ``repeats`` (timed repeats, medians reported), ``warmup`` (untimed
    ones first), ``tensors`` (equal fp32 tensors per model), ``timeout`` (seconds
    for any one wait), ``object_store_mib``, ``json`` (results) and ``png``
    (plot); ``verbose=True`` adds ``--verbose``. A default of None means "the
    scenario decides" (say, after ``--quick``); ``helps`` replaces an option's help.

    Raises:
        TypeError: a name that is not one of these.

    Example:
        >>> p = add_options(argparse.ArgumentParser(), sizes_mib=[16, 64], repeats=3, json=Path("r.json"))
        >>> p.parse_args(["--sizes-mib", "8"]).sizes_mib, p.parse_args([]).repeats
        ([8], 3)
    """
    unknown = sorted(set(defaults) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"add_options() got unknown options {unknown}; known: {sorted(_OPTIONS)}")
    for name, default in defaults.items():
        flag, kwargs, text = _OPTIONS[name]
        text = (helps or {}).get(name) or _default(text, default)
        parser.add_argument(flag, default=default, help=text, **kwargs)
    if verbose:
        parser.add_argument("--verbose", action="store_true", help="debug logging, Ray worker logs shown")
    return parser


def _default(text: str, value: Any) -> str:
    if value is None:
        return text
    shown = " ".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
    return f"{text} (default: {shown})"

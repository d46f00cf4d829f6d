"""Soak: pushes, hub restarts, trainer restarts and subscriber kills together; nothing lost or torn.

A trainer **actor** pushes in a loop. Every version fills every tensor with
its own version number (the trainer fills ``hub.next_version()`` right before
each push and records the number the push stamped), so a subscriber's weights
are right exactly when every element of every tensor equals
``float(version)`` for the version it reports: each report says so, checked
bit for bit (``torch.equal`` against ``torch.full_like``). The model is
split into one bucket per tensor, so an apply that mixed two versions shows.

Subscriber kinds (``--kinds``, cycled over ``--subscribers``):

========== ============================================================================
copy       plain push actor, ``apply="copy"``
threaded   ``max_concurrency=2``
view       ``apply="view"``
prefetch   ``prefetch=True``
pool       ``max_concurrency=2``; its method hands the report to its own
           ``ThreadPoolExecutor``, which calls another public method of the same
           actor, and waits for it
long       ``max_concurrency=2``; a 0.5-2 s "rollout" runs in the background (it
           checks the weights at its start and end: no version may land under it)
           while the poller asks for reports
async      async actor (``async def`` methods)
pull       ``mode="pull"``; its method calls ``self.raysync_sync()`` first, then reports
pull-async async pull actor: ``await self.raysync_sync()``, then reports
========== ============================================================================

Faults, each at random times (exponential gaps with the given mean; 0 turns
it off): subscriber kills (``--kill-every``, ``ray.kill(actor,
no_restart=False)``: Ray restarts it, it registers again and catches up),
hub restarts (``--hub-restart-every``, the same on the detached hub; its
version counters live in Ray's GCS), relay kills (``--relay-kill-every``: the
hub's per-node relays, mid-delivery or not; Ray restarts them, the hub delivers
directly meanwhile) and trainer restarts
(``--trainer-restart-every``: the trainer actor restarts, ``max_restarts=-1``,
and goes on pushing the same model as the same writer).

Checks, every call bounded: each call to a subscriber must answer within
``--call-timeout`` (a rollout: that plus its length); one that does not is
**stuck** (a call interrupted because its actor died is expected and
re-asked). A report whose weights are not exactly its version is a
**mismatch**; one whose weights are not even one version (several values)
is also **torn**, and so is a version that changed under one read-locked
method (a rollout; the pool's method and the pool thread it waited on). A
version going backwards inside one process is a **regression**. After
``--seconds`` the faults stop, the hub is restarted once more
(``--no-final-hub-restart`` to skip), the trainer pushes a last version,
``hub.wait`` must not return before every push subscriber holds it
(**wait_early**), and every subscriber (pull ones after one more
``raysync_sync``) must end on it, whole (else **lost**; a subscriber Ray
reports dead for good despite ``max_restarts=-1`` is logged with where it
died, and is lost). The versions the
trainer got back must have no gaps (**skipped**, numbers not explained by a
push whose trainer was killed during it, or by a restarted trainer starting a
new block of numbers) and no **repeats**, and each must be
the number the trainer filled in (**stamp mismatches**). Every failure is
logged with the actor, the call and what it saw (``events`` in the JSON).

Printed: one row per subscriber kind (versions applied: each process samples
the version it holds every millisecond; kills, restarts seen, mismatches,
stuck calls, regressions, torn, maximum lag, final version), then versions
pushed, hub restarts, trainer restarts, lost. Exit
status 0 only when mismatches, stuck, torn, regressions, lost, skipped,
repeats, wait_early, push failures and call errors are all 0.

``--resources`` runs the other check instead: ``--pushes`` pushes (default 50)
of ``--size-mib`` (default 256) with ``keep=2`` and waits for every subscriber
each time, measuring object-store bytes (what ``ray memory --stats-only``
reports) and each subscriber's RSS and private memory (RSS minus shared
pages) over the run.

Run::

    python benchmarks/soak.py                       # 5 minutes, one subscriber of each kind, 8 MiB model
    python benchmarks/soak.py --seconds 60          # a short run
    python benchmarks/soak.py --kinds pool long     # only these kinds
    python benchmarks/soak.py --resources           # 50 pushes of 256 MiB, keep=2

Both write JSON to ``benchmarks/results/soak.json`` / ``soak_resources.json``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import os
import random
import re
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

import raysync

# The sibling helpers: on the path already when this runs as a script, not when the tests import
# it as `benchmarks.soak` (appended, so nothing of this folder shadows another module).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
import _harness as harness
from _floor import ObjectStoreGauge, process_memory
from _harness import MIB as MiB

logger = logging.getLogger("soak")
RESULTS = Path(__file__).resolve().parent / "results"
UNSET = -1.0  # what a subscriber's tensors hold before its first version
PUSH_KINDS = ("copy", "threaded", "view", "prefetch", "pool", "long", "async")
PULL_KINDS = ("pull", "pull-async")
KINDS = PUSH_KINDS + PULL_KINDS
_REPORT_METHOD = {"pool": "work", "pull": "work", "pull-async": "work"}  # others: "check"
_CONCURRENCY = {"threaded": 2, "pool": 2, "long": 2}  # async kinds: Ray's default for async actors
_ASYNC_KINDS = ("async", "pull-async")
_DEBUG_GROUP = "soak-debug"  # a thread of its own for stack dumps of a stuck actor
_DELIVERY_ERRORS = ("ActorDiedError", "ActorUnavailableError", "RayActorError")
_MAX_EVENTS = 500


class Filled(harness.FlatModel):
    """``tensors`` float32 parameters ``p0``, ``p1``, ... of equal size, all :data:`UNSET` at first."""

    def __init__(self, size_mib: float, tensors: int = 4) -> None:
        super().__init__(int(size_mib * MiB), tensors, fill=UNSET, name="p{i}", requires_grad=True)


def fill(model: torch.nn.Module, value: float) -> None:
    """Fill every parameter of ``model`` with ``value``."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def held_report(owner: Any, method: str) -> dict[str, Any]:
    """What a subscriber holds: its version and whether its weights are exactly that version.

    ``whole`` is True when every element of every tensor equals ``float(version)``
    (``UNSET`` before the first version), compared bit for bit with
    ``torch.equal`` against ``torch.full_like``. When not, ``values`` lists the
    distinct values of each tensor (at most 8 each), to say what it held instead.
    Runs inside the actor, inside one of its (read-locked) methods.
    """
    version = owner.raysync_version()
    expected = UNSET if version is None else float(version)
    params = [p.detach() for p in owner.policy.parameters()]
    whole = all(torch.equal(p, torch.full_like(p, expected)) for p in params)
    report: dict[str, Any] = {
        "method": method,
        "version": version,
        "whole": whole,
        "pid": os.getpid(),
        "applied": len(owner.applied),
        "time": time.time(),
    }
    if not whole:
        report["values"] = [torch.unique(p).tolist()[:8] for p in params]
    return report


def torn(report: dict[str, Any]) -> bool:
    """Whether a report's weights are anything but exactly the version it reports.

    Takes either a :func:`held_report` (``whole``) or a report listing every
    distinct value its tensors hold (``values``: one, if whole).
    """
    if "whole" in report:
        return not report["whole"]
    version, values = report["version"], report["values"]
    expected = UNSET if version is None else float(version)
    return bool(values != [expected])


def mixed(report: dict[str, Any]) -> bool:
    """Whether a :func:`held_report`'s weights are not even one version (several values)."""
    if report["whole"]:
        return False
    return len({v for values in report.get("values", []) for v in values}) > 1


def _stack_dump() -> list[str]:
    """The threads of this process that wait on a lock, a condition or a future: where they wait.

    One line per thread, outermost frame first, library frames of Python and Ray left out.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        frames = traceback.extract_stack(frame)
        if not frames or frames[-1].name not in ("wait", "acquire", "result", "_wait_for_tstate_lock"):
            continue
        shown = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in frames
            if "/site-packages/ray/" not in f.filename and "/lib/python3" not in f.filename
        ]
        out.append(f"thread {names.get(ident, ident)}: {' > '.join(shown)} > {frames[-1].name}")
    return out


def _where(error: str) -> str:
    """A Ray error's traceback in short: raysync's and the soak's frames, then the exception line."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', error)
    shown = [f"{Path(f).name}:{n} {fn}" for f, n, fn in frames if "/raysync/" in f or f.endswith("soak.py")]
    lines = [
        ln.strip() for ln in error.splitlines() if ln.strip() and not ln.strip().startswith(("^", "File"))
    ]
    last = next((ln for ln in reversed(lines) if "Error" in ln.split(":")[0]), lines[-1] if lines else "")
    return f"{' > '.join(shown)}: {last}"[:1500]


def _actor_state(actor: Any) -> dict[str, Any]:
    """The actor's row in Ray's GCS actor table (``State``: ALIVE, RESTARTING, ...; ``Pid``)."""
    from ray._private import state

    try:
        return dict(state.actors(actor_id=actor._actor_id.hex()))
    except Exception as err:  # unknown: judge the call as if alive
        return {"State": "ALIVE", "error": f"{type(err).__name__}: {err}"}


def subscriber_class(hub_name: str, kind: str, size_mib: float, tensors: int) -> Any:
    """A ``@synced_model`` actor class of one kind (see the module docstring for the kinds).

    Every kind reports through one method (:data:`_REPORT_METHOD`, ``check`` by
    default) with :func:`held_report`; plain push kinds also have ``memory()``
    (for ``--resources``), ``long`` has ``rollout(seconds)``, and every non-async
    kind has ``_stacks()`` (run it in the ``soak-debug`` concurrency group).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    opts: dict[str, Any] = {"hub": hub_name}
    if kind == "view":
        opts["apply"] = "view"
    if kind == "prefetch":
        opts["prefetch"] = True
    if kind in PULL_KINDS:
        opts["mode"] = "pull"

    def setup(self: Any) -> None:
        self.policy = Filled(size_mib, tensors)
        self.applied = set()
        threading.Thread(target=watch, args=(self,), daemon=True, name="soak-watch").start()

    def watch(self: Any) -> None:
        """Note every version this process holds (sampled every millisecond)."""
        while True:
            v = self.raysync_version()
            if v is not None:
                self.applied.add(v)
            time.sleep(0.001)

    cls: type
    if kind == "pool":

        class PoolSubscriber:
            """Its report runs on its own thread pool, through another public method."""

            def __init__(self) -> None:
                setup(self)
                self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="soak-pool")

            def work(self) -> dict[str, Any]:
                # A guarded method waiting on another guarded method of the same actor, run by a
                # thread the actor owns: the shape of a rollout worker's pool. It looks at the
                # weights itself first (a few ms, like a real step), then hands off.
                outer = held_report(self, "work")
                inner = dict(self.pool.submit(self.check).result())
                return inner | {"outer": outer}

            def check(self) -> dict[str, Any]:
                return held_report(self, "work->check")

            def _stacks(self) -> list[str]:
                return _stack_dump()

        cls = PoolSubscriber
    elif kind == "long":

        class LongSubscriber:
            """A long method (a rollout) runs while the poller asks for reports."""

            def __init__(self) -> None:
                setup(self)

            def check(self) -> dict[str, Any]:
                return held_report(self, "check")

            def rollout(self, seconds: float) -> dict[str, Any]:
                start = held_report(self, "rollout")
                time.sleep(seconds)  # under the read lock: no version may land meanwhile
                return {"start": start, "end": held_report(self, "rollout"), "seconds": seconds}

            def _stacks(self) -> list[str]:
                return _stack_dump()

        cls = LongSubscriber
    elif kind == "async":

        class AsyncSubscriber:
            """An async actor: its methods run on one event loop."""

            def __init__(self) -> None:
                setup(self)

            async def check(self) -> dict[str, Any]:
                return held_report(self, "check")

        cls = AsyncSubscriber
    elif kind == "pull":

        class PullSubscriber:
            """Takes the newest version at the start of each unit of work."""

            def __init__(self) -> None:
                setup(self)

            def work(self) -> dict[str, Any]:
                error = None
                try:
                    self.raysync_sync()  # type: ignore[attr-defined]
                except Exception as err:  # reported, and counted by the soak
                    error = f"{type(err).__name__}: {err}"[:400]
                return held_report(self, "work") | {"sync_error": error}

            def _stacks(self) -> list[str]:
                return _stack_dump()

        cls = PullSubscriber
    elif kind == "pull-async":

        class PullAsyncSubscriber:
            """An async actor that takes the newest version at the start of each unit of work."""

            def __init__(self) -> None:
                setup(self)

            async def work(self) -> dict[str, Any]:
                error = None
                try:
                    await self.raysync_sync()  # type: ignore[attr-defined]
                except Exception as err:  # reported, and counted by the soak
                    error = f"{type(err).__name__}: {err}"[:400]
                return held_report(self, "work") | {"sync_error": error}

        cls = PullAsyncSubscriber
    else:  # copy, threaded, view, prefetch

        class Subscriber:
            """A plain subscriber: one report method."""

            def __init__(self) -> None:
                setup(self)

            def check(self) -> dict[str, Any]:
                return held_report(self, "check")

            def memory(self) -> dict[str, int]:
                return process_memory()

            def _stacks(self) -> list[str]:
                return _stack_dump()

        cls = Subscriber
    cls.__name__ = cls.__qualname__ = f"{cls.__name__}_{kind.replace('-', '_')}"
    actor_opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0}
    if kind not in _ASYNC_KINDS:
        actor_opts["max_concurrency"] = _CONCURRENCY.get(kind, 1)
        actor_opts["concurrency_groups"] = {_DEBUG_GROUP: 1}
    return ray.remote(**actor_opts)(raysync.synced_model("policy", **opts)(cls))


# ---------------------------------------------------------------------- trainer


class Ledger:
    """What the trainer did, kept outside it (it is killed): intents, stamps, failures.

    The trainer records the value it is about to push (``intent``) before each
    push and the version the hub stamped (``stamped``) after, both waited for,
    so a push whose trainer died during it shows as an intent with no outcome.
    """

    def __init__(self) -> None:
        self.running = True
        self.intents: list[dict[str, Any]] = []
        self.stamps: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.starts: list[dict[str, Any]] = []
        self.loop_exits: list[dict[str, Any]] = []
        self.open: dict[int, dict[str, Any]] = {}  # pid -> its push in progress
        self.progress = time.time()

    def started(self, pid: int) -> None:
        self.starts.append({"pid": pid, "time": time.time()})
        self.progress = time.time()

    def begin(self, pid: int, stage: str) -> None:
        """A push starts (``connect`` or ``hub.latest()`` first): from here it is bounded."""
        self.open[pid] = {"pid": pid, "fill": None, "stage": stage, "time": time.time()}
        self.progress = time.time()

    def intent(self, pid: int, value: int) -> None:
        """The value this push fills in, about to go to ``hub.push``."""
        row = {"pid": pid, "fill": value, "time": time.time()}
        self.intents.append(row)
        self.open[pid] = {**row, "stage": "push", "time": self.open.get(pid, row)["time"]}
        self.progress = time.time()

    def stamped(self, pid: int, value: int, version: int, seconds: float) -> None:
        self.stamps.append(
            {"pid": pid, "fill": value, "version": version, "seconds": seconds, "time": time.time()}
        )
        self.open.pop(pid, None)
        self.progress = time.time()

    def failed(self, pid: int, value: int | None, stage: str, error: str) -> None:
        self.failures.append({"pid": pid, "fill": value, "stage": stage, "error": error, "time": time.time()})
        self.open.pop(pid, None)
        self.progress = time.time()

    def loop_exited(self, pid: int) -> None:
        self.loop_exits.append({"pid": pid, "time": time.time()})

    def stop(self) -> None:
        self.running = False

    def is_running(self) -> bool:
        return self.running

    def state(self) -> dict[str, Any]:
        """The newest version stamped, pushes in progress, the trainer's processes."""
        return {
            "latest": max((s["version"] for s in self.stamps), default=0),
            "stamps": len(self.stamps),
            "open": list(self.open.values()),
            "progress": self.progress,
            "pids": [s["pid"] for s in self.starts],
            "loop_exits": [e["pid"] for e in self.loop_exits],
        }

    def stamp_of(self, version: int) -> list[dict[str, Any]]:
        """Every push that got ``version`` back (one, normally)."""
        return [s for s in self.stamps if s["version"] == version]

    def records(self) -> dict[str, Any]:
        return {
            "intents": self.intents,
            "stamps": self.stamps,
            "failures": self.failures,
            "starts": self.starts,
            "open": list(self.open.values()),
        }


class Trainer:
    """Pushes in a loop from a thread it starts itself, so a restarted trainer goes on by itself.

    Each push fills the model with ``hub.next_version()`` (the number this
    writer stamps next) and records both in the ledger. A restarted process is
    the same writer (same actor id): no takeover; it stamps from a new block.
    """

    def __init__(self, hub_name: str, size_mib: float, tensors: int, interval: float, keep: int) -> None:
        self.hub_name = hub_name
        self.ledger = ray.get_actor(f"{hub_name}-ledger")
        self.interval = interval
        self.keep = keep
        self.pid = os.getpid()
        self.model = Filled(size_mib, tensors)
        self.bucket_bytes = max(1, sum(p.numel() * 4 for p in self.model.parameters()) // tensors)
        self.hub: raysync.HubClient | None = None
        self.lock = threading.Lock()  # one push at a time (the loop, push_once)
        ray.get(self.ledger.started.remote(self.pid))
        threading.Thread(target=self._loop, daemon=True, name="soak-trainer").start()

    def _push(self) -> int | None:
        """One push, recorded; None (and a recorded failure) if it raised."""
        stage, value = "connect" if self.hub is None else "latest", None
        try:
            ray.get(self.ledger.begin.remote(self.pid, stage))
            if self.hub is None:
                self.hub = raysync.connect(self.hub_name, keep=self.keep)
            stage = "latest"
            value = self.hub.next_version()  # the number this writer stamps next
            fill(self.model, float(value))
            ray.get(self.ledger.intent.remote(self.pid, value))
            stage = "push"
            t0 = time.monotonic()
            version = self.hub.push(self.model, bucket_bytes=self.bucket_bytes)
            ray.get(self.ledger.stamped.remote(self.pid, value, version, time.monotonic() - t0))
            return version
        except Exception as err:
            ray.get(self.ledger.failed.remote(self.pid, value, stage, f"{type(err).__name__}: {err}"[:600]))
            return None

    def _loop(self) -> None:
        while ray.get(self.ledger.is_running.remote()):
            with self.lock:
                ok = self._push() is not None
            time.sleep(self.interval if ok else 0.5)
        ray.get(self.ledger.loop_exited.remote(self.pid))

    def push_once(self) -> int | None:
        """One more push (after the loop stopped); the version, or None if it failed."""
        with self.lock:
            return self._push()


# ---------------------------------------------------------------------- soak state


@dataclass
class _Call:
    """One call the soak made and has not had an answer to yet."""

    sub: int  # subscriber index, or -1 for the trainer / hub
    method: str
    issued: float  # monotonic
    issued_wall: float
    bound: float  # seconds it may take
    newest: int  # the newest version stamped when it was asked
    stuck: bool = False
    alive_seen: float | None = None  # last seen restarting: its bound counts from then


@dataclass
class _Sub:
    """Everything the soak noted about one subscriber."""

    name: str
    kind: str
    actor: Any
    method: str
    pids: set[int] = field(default_factory=set)
    applied: dict[int, int] = field(default_factory=dict)  # pid -> distinct versions it held
    seen: set[int] = field(default_factory=set)
    last: dict[int, int] = field(default_factory=dict)  # pid -> newest version reported
    polls: int = 0
    interrupted: int = 0
    errors: int = 0
    mismatches: int = 0
    torn: int = 0
    regressions: int = 0
    stuck: int = 0
    sync_errors: int = 0
    max_lag: int = 0  # newest pushed minus the version held, over reports that held one
    empty: int = 0  # reports holding no version (restarted while the newest version's bytes were gone)
    kills: int = 0
    kill_walls: list[float] = field(default_factory=list)
    poll: Any = None  # the ref of its report call in flight
    rollout: Any = None  # the ref of its rollout in flight (long)
    next_ask: float = 0.0
    last_report: dict[str, Any] | None = None
    last_answer_wall: float = 0.0  # when the call it last answered was issued
    probe_after: float | None = None  # wait_early: judge the first answer to a call issued after this
    dead: bool = False  # Ray will not restart it (seen DEAD after a failed call)

    def restarts(self) -> int:
        return max(0, len(self.pids) - 1)


class _Soak:
    """One soak run: the actors, the fault schedule, the poller and the figures."""

    def __init__(
        self,
        *,
        seconds: float,
        kinds_used: list[str],
        size_mib: float,
        tensors: int,
        interval: float,
        poll_every: float,
        kill_every: float,
        hub_restart_every: float,
        trainer_restart_every: float,
        call_timeout: float,
        settle_timeout: float,
        final_hub_restart: bool,
        keep: int,
        seed: int | None,
        relay_kill_every: float = 0.0,
    ) -> None:
        self.seconds = seconds
        self.size_mib = size_mib
        self.poll_every = poll_every
        self.call_timeout = call_timeout
        self.restart_bound = max(120.0, 4 * call_timeout)  # how long Ray may take to restart a process
        self.faults: list[dict[str, Any]] = []  # every fault: when, what
        self.settle_timeout = settle_timeout
        self.final_hub_restart = final_hub_restart
        base = random.Random(seed)
        # One generator per fault kind: each schedule depends on the seed only.
        self.rng = {k: random.Random(base.random()) for k in ("kill", "hub", "trainer", "rollout", "relay")}
        self.every = {
            "kill": kill_every,
            "hub": hub_restart_every,
            "trainer": trainer_restart_every,
            "relay": relay_kill_every,
        }
        self.relay_kills = 0
        self.events: list[str] = []
        self.calls: dict[Any, _Call] = {}
        self.newest = 0
        self.hub_restarts = 0
        self.trainer_kills = 0
        self.trainer_kill_walls: list[float] = []
        self.trainer_stuck = 0
        self.hub_stuck = 0
        self.wait_early = 0
        self.call_errors = 0
        self.apply_errors: dict[str, str] = {}
        self.status_rows: dict[str, dict[str, Any]] = {}  # actor id -> newest hub status row
        self.status_ref: Any = None
        self.status_call: _Call | None = None
        self.polling = True
        self.rollouts = True
        self.flagged_open: set[tuple[int, float]] = set()
        self.flagged_stall = 0.0
        self.final: int | None = None  # the last version, once pushed
        self.wait_status: list[dict[str, Any]] = []  # hub.status() rows right after the last hub.wait
        self.ledger_state: dict[str, Any] = {
            "latest": 0,
            "stamps": 0,
            "open": [],
            "progress": time.time(),
            "pids": [],
            "loop_exits": [],
        }

        self.hub_name = f"soak-{uuid.uuid4().hex[:8]}"
        # Relay kills need a relay: on one node, the hub would serve its own node without one.
        settings = raysync.HubSettings(rings_own_node=False) if relay_kill_every else None
        self.hub = raysync.connect(self.hub_name, keep=keep, settings=settings)
        classes = {k: subscriber_class(self.hub_name, k, size_mib, tensors) for k in set(kinds_used)}
        self.subs = [
            _Sub(f"s{i}-{k}", k, classes[k].remote(), _REPORT_METHOD.get(k, "check"))
            for i, k in enumerate(kinds_used)
        ]
        ledger: Any = ray.remote(num_cpus=0)(Ledger)
        # Named, so that the trainer finds it after a restart (no handle among its arguments).
        self.ledger: Any = ledger.options(name=f"{self.hub_name}-ledger").remote()
        self.trainer: Any = None
        # Every subscriber registered before the first push (process start-up is slow on 2 cores).
        t0 = time.monotonic()
        try:
            ray.get(
                [getattr(s.actor, s.method).remote() for s in self.subs] + [self.ledger.state.remote()],
                timeout=self.restart_bound,
            )
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - t0
        trainer_cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(Trainer)
        self.trainer = trainer_cls.remote(self.hub_name, size_mib, tensors, interval, keep)

    # -------------------------------------------------------------- events
    def event(self, what: str, message: str) -> None:
        """A failure, with its evidence: logged now, kept for the JSON."""
        logger.error("%s: %s", what, message)
        if len(self.events) < _MAX_EVENTS:
            self.events.append(f"{what}: {message}")

    def row_of(self, sub: _Sub) -> dict[str, Any] | None:
        return self.status_rows.get(sub.actor._actor_id.hex())

    def wait_rows(self, sub: _Sub) -> str:
        """What the hub said right after ``hub.wait`` returned: how many subscribers, and this one's row."""
        rows = self.wait_status
        mine = [r for r in rows if r["actor_id"] == sub.actor._actor_id.hex()]
        row = {k: mine[0].get(k) for k in ("applied", "state", "pid", "last_error")} if mine else None
        return f"{len(rows)} of {len(self.subs)} subscribers registered, this one: {row}"

    def stacks_of(self, sub: _Sub) -> str:
        """The subscriber's threads, from a thread of their own (non-async kinds)."""
        if sub.kind in _ASYNC_KINDS:
            return "(async actor: no stack dump)"
        try:
            frames = ray.get(sub.actor._stacks.options(concurrency_group=_DEBUG_GROUP).remote(), timeout=10)
        except Exception as err:
            return f"(no stack dump: {type(err).__name__})"
        return "\n".join(frames) or "(no thread waits on a lock)"

    # -------------------------------------------------------------- calls
    def ask(self, i: int, method: str, *args: Any, bound: float | None = None) -> Any:
        sub = self.subs[i]
        ref = getattr(sub.actor, method).remote(*args)
        self.calls[ref] = _Call(
            i, method, time.monotonic(), time.time(), bound or self.call_timeout, self.newest
        )
        return ref

    def ask_due(self) -> None:
        now = time.monotonic()
        for i, sub in enumerate(self.subs):
            if sub.dead:
                continue
            if self.polling and sub.poll is None and now >= sub.next_ask:
                sub.poll = self.ask(i, sub.method)
            if sub.kind == "long" and self.rollouts and sub.rollout is None and now >= sub.next_ask:
                seconds = self.rng["rollout"].uniform(0.5, 2.0)
                sub.rollout = self.ask(i, "rollout", seconds, bound=self.call_timeout + seconds)

    def pump(self, timeout: float = 0.05) -> None:
        """Ask who is due, take every answer that came, flag calls past their bound."""
        self.refresh_ledger()
        self.ask_due()
        refs = list(self.calls)
        if self.status_ref is not None:
            refs.append(self.status_ref)
        if refs:
            ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        else:
            ready = []
            time.sleep(timeout)
        for ref in ready:
            if ref == self.status_ref:
                self.take_status()
            else:
                self.take(ref)
        self.flag_stuck()

    def take(self, ref: Any) -> None:
        call = self.calls.pop(ref)
        sub = self.subs[call.sub]
        if sub.poll == ref:
            sub.poll = None
        else:
            sub.rollout = None
        waited = time.monotonic() - call.issued
        try:
            value = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            sub.interrupted += 1  # killed (or restarting) while asked: expected, ask again
            sub.next_ask = time.monotonic() + 0.2
            if isinstance(err, ray.exceptions.ActorDiedError) and not sub.dead:
                actor_state = _actor_state(sub.actor)
                if actor_state.get("State") == "DEAD":  # Ray gave up on it: it will not come back
                    sub.dead = True
                    self.event(
                        "dead",
                        f"{sub.name}.{call.method}() found it dead for good although max_restarts=-1 "
                        f"(killed {len(sub.kill_walls)} times, last report: version "
                        f"{sub.last_report and sub.last_report['version']}): {_where(str(err))}",
                    )
            if call.stuck:
                logger.warning(
                    "%s.%s that was stuck ended after %.1f s: %s",
                    sub.name,
                    call.method,
                    waited,
                    type(err).__name__,
                )
            return
        except Exception as err:
            sub.errors += 1
            self.call_errors += 1
            self.event("call error", f"{sub.name}.{call.method}() raised: {type(err).__name__}: {err}"[:1500])
            sub.next_ask = time.monotonic() + self.poll_every
            return
        if call.stuck:
            logger.warning("%s.%s that was stuck answered after %.1f s", sub.name, call.method, waited)
        if call.method == "rollout":
            first, last, what = value["start"], value["end"], f"rollout({value['seconds']:.2f} s)"
        elif "outer" in value:  # pool: the method's own look, then its pool thread's
            first, last, what = value.pop("outer"), value, "work() and the pool thread it waited for"
        else:
            first, last, what = None, value, ""
        if first is not None:
            self.absorb(sub, call, first)
            if first["version"] != last["version"]:
                sub.torn += 1
                self.event(
                    "torn",
                    f"{sub.name}.{what} (pid {first['pid']}) saw version {first['version']} first and "
                    f"{last['version']} then: a version landed under a read-locked method",
                )
        self.absorb(sub, call, last)
        if call.method != "rollout":
            sub.next_ask = time.monotonic() + self.poll_every

    def absorb(self, sub: _Sub, call: _Call, report: dict[str, Any]) -> None:
        """Check one report: whole, forward, lag; note what it says."""
        sub.polls += 1
        version, pid = report["version"], report["pid"]
        sub.pids.add(pid)
        sub.applied[pid] = max(sub.applied.get(pid, 0), report["applied"])
        sub.last_report = report
        sub.last_answer_wall = max(sub.last_answer_wall, call.issued_wall)
        if version is not None:
            sub.seen.add(version)
        before = sub.last.get(pid, 0)
        if (version or 0) < before:
            sub.regressions += 1
            self.event(
                "regression",
                f"{sub.name}.{call.method}() (pid {pid}) reported version {version} after {before} in the "
                "same process",
            )
        sub.last[pid] = max(before, version or 0)
        if version is None:
            sub.empty += 1
        else:
            sub.max_lag = max(sub.max_lag, call.newest - version)
        if not report["whole"]:
            sub.mismatches += 1
            stamps = ray.get(self.ledger.stamp_of.remote(version)) if version is not None else []
            pushed = (
                "; ".join(f"trainer pid {s['pid']} filled {s['fill']}" for s in stamps) or "no stamp seen"
            )
            if mixed(report):
                sub.torn += 1
            self.event(
                "mismatch" + (" (torn)" if mixed(report) else ""),
                f"{sub.name}.{call.method}() (pid {pid}) reports version {version} but its tensors hold "
                f"{report['values']} (expected every element == {version}); version {version} was pushed by: "
                f"{pushed}; hub row: {self.row_of(sub)}",
            )
        if report.get("sync_error"):
            sub.sync_errors += 1
            logger.warning("%s raysync_sync raised: %s", sub.name, report["sync_error"])
            self.apply_errors.setdefault(f"{sub.name} sync", report["sync_error"][:300])
        if sub.probe_after is not None and call.issued_wall >= sub.probe_after:
            sub.probe_after = None
            if version != self.final:
                self.wait_early += 1
                self.event(
                    "wait_early",
                    f"hub.wait({self.final}) returned, then {sub.name}.{call.method}() (pid {pid}) still "
                    f"reported version {version}; hub.status() right after the wait: {self.wait_rows(sub)}",
                )

    def flag_stuck(self) -> None:
        now = time.monotonic()
        for call in self.calls.values():
            since = call.issued if call.alive_seen is None else call.alive_seen
            if call.stuck or now - since <= call.bound:
                continue
            sub = self.subs[call.sub]
            actor_state = _actor_state(sub.actor)
            if actor_state.get("State") != "ALIVE" and now - call.issued <= self.restart_bound:
                # Ray is (re)starting the process (a kill landed just as it was asked): that is
                # Ray's time, not raysync's; the bound starts again once the actor is alive.
                call.alive_seen = now
                continue
            call.stuck = True
            sub.stuck += 1
            killed = sum(1 for t in sub.kill_walls if t >= call.issued_wall)
            others = [c.method for c in self.calls.values() if c.sub == call.sub and c is not call]
            last = sub.last_report
            self.event(
                "stuck",
                f"{sub.name}.{call.method}() asked {now - call.issued:.1f} s ago (bound {call.bound:.1f} s) "
                f"has not answered; kills of it since: {killed}; its other calls in flight: {others}; "
                f"its last report: version {last and last['version']} from pid {last and last['pid']}; "
                f"hub row: {self.row_of(sub)}; threads:\n{self.stacks_of(sub)}",
            )
        if self.status_call is not None and not self.status_call.stuck:
            if now - self.status_call.issued > self.status_call.bound:
                self.status_call.stuck = True
                self.hub_stuck += 1
                self.event(
                    "stuck", f"hub.status() asked {now - self.status_call.issued:.1f} s ago has not answered"
                )

    # -------------------------------------------------------------- hub status, trainer
    def ask_status(self) -> None:
        if self.status_ref is None:
            self.status_ref = self.hub.actor.status.remote()
            self.status_call = _Call(
                -1, "status", time.monotonic(), time.time(), self.call_timeout, self.newest
            )

    def take_status(self) -> None:
        ref, self.status_ref, self.status_call = self.status_ref, None, None
        try:
            status = ray.get(ref)
        except ray.exceptions.RayError:
            return  # restarting: ask again later
        for row in status["subscribers"]:
            self.status_rows[str(row["actor_id"])] = {
                k: row.get(k) for k in ("applied", "lag", "state", "last_error", "pid")
            }
            err = row.get("last_error")
            if err and not err.startswith(_DELIVERY_ERRORS):
                self.apply_errors.setdefault(str(row["subscriber"]), err[:300])

    def refresh_ledger(self) -> None:
        state = ray.get(self.ledger.state.remote(), timeout=self.call_timeout)
        self.newest = max(self.newest, state["latest"])
        self.ledger_state = state

    def watch_trainer(self) -> None:
        """A push of the live trainer that takes longer than the bound, or no push at all, is stuck."""
        state, now = self.ledger_state, time.time()
        last_kill = max(self.trainer_kill_walls, default=0.0)
        for row in state["open"]:
            key = (row["pid"], row["time"])
            if row["time"] < last_kill or key in self.flagged_open:
                continue  # its trainer was killed during it: interrupted, not stuck
            if now - row["time"] > self.call_timeout:
                self.flagged_open.add(key)
                self.trainer_stuck += 1
                self.event(
                    "stuck",
                    f"trainer (pid {row['pid']}) push (fill {row['fill']}) started "
                    f"{now - row['time']:.1f} s ago is still in {row['stage']} "
                    f"(bound {self.call_timeout} s); newest stamped {state['latest']}",
                )
        since = max(state["progress"], last_kill)
        quiet = now - since
        if state["open"] or quiet <= self.call_timeout or self.flagged_stall >= since:
            return
        trainer = _actor_state(self.trainer)
        if trainer.get("State") != "ALIVE" and quiet <= self.restart_bound:
            return  # Ray is still restarting it: Ray's time, not raysync's
        self.flagged_stall = since
        self.trainer_stuck += 1
        self.event(
            "stuck",
            f"trainer: no push started for {quiet:.1f} s (bound {self.call_timeout} s); Ray says it is "
            f"{trainer.get('State')} (pid {trainer.get('Pid')}); its processes so far: {state['pids']}; "
            f"newest stamped {state['latest']}",
        )

    # -------------------------------------------------------------- faults
    def next_fault(self, kind: str, now: float) -> float:
        every = self.every[kind]
        return now + self.rng[kind].expovariate(1.0 / every) if every > 0 else float("inf")

    def restart_hub(self) -> None:
        ray.kill(self.hub.actor, no_restart=False)
        self.hub_restarts += 1
        self.faults.append({"time": time.time(), "kill": "hub"})

    def run(self) -> dict[str, Any]:
        # The clock starts once the trainer pushed (its process may take long to start).
        t0 = time.monotonic()
        if not self.pump_until(lambda: self.ledger_state["stamps"] > 0, self.restart_bound):
            self.trainer_stuck += 1
            self.event("stuck", f"trainer: no push within {self.restart_bound:.0f} s of its creation")
        self.startup_s += time.monotonic() - t0
        t_start = time.monotonic()
        deadline = t_start + self.seconds
        due = {k: self.next_fault(k, t_start) for k in self.every}
        next_status = t_start + 1.0
        while time.monotonic() < deadline:
            self.pump()
            self.watch_trainer()
            now = time.monotonic()
            if now >= due["kill"]:
                sub = self.subs[self.rng["kill"].randrange(len(self.subs))]
                ray.kill(sub.actor, no_restart=False)
                sub.kills += 1
                sub.kill_walls.append(time.time())
                self.faults.append({"time": time.time(), "kill": sub.name})
                due["kill"] = self.next_fault("kill", now)
            if now >= due["hub"]:
                self.restart_hub()
                due["hub"] = self.next_fault("hub", now)
            if now >= due["relay"]:
                killed = harness.kill_relays(self.hub)
                self.relay_kills += killed
                if killed:
                    self.faults.append({"time": time.time(), "kill": "relay"})
                due["relay"] = self.next_fault("relay", now)
            if now >= due["trainer"]:
                ray.kill(self.trainer, no_restart=False)
                self.trainer_kills += 1
                self.trainer_kill_walls.append(time.time())
                self.faults.append({"time": time.time(), "kill": "trainer"})
                due["trainer"] = self.next_fault("trainer", now)
            if now >= next_status:
                self.ask_status()
                next_status = now + 1.0
        pushing_s = time.monotonic() - t_start
        t_settle = time.monotonic()
        lost = self.settle()
        return self.figures(pushing_s, time.monotonic() - t_settle, lost)

    # -------------------------------------------------------------- the end
    def pump_until(self, done: Callable[[], bool], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not done():
            if time.monotonic() >= deadline:
                return False
            self.pump()
        return True

    def settle(self) -> list[str]:
        """Faults stop; a last hub restart and push; everyone must end on it, whole."""
        lost: list[str] = []
        self.rollouts = False
        ray.get(self.ledger.stop.remote())
        # The trainer loop notices at its next push; a trainer killed last whose new process
        # has not started yet gets as long as Ray may take to restart a process.
        self.refresh_ledger()
        restarting = len(self.ledger_state["pids"]) <= self.trainer_kills
        bound = self.restart_bound if restarting else self.call_timeout + 5
        if not self.pump_until(lambda: bool(self.ledger_state["loop_exits"]), bound):
            self.watch_trainer()
            self.event(
                "stuck",
                f"trainer: push loop did not stop within {bound:.0f} s: {self.ledger_state}",
            )
            self.trainer_stuck += 1
        # Every subscriber answers again (a restarted one has registered by then).
        t_quiet = time.time()
        self.pump_until(
            lambda: all(s.last_answer_wall >= t_quiet or self.is_stuck(s) for s in self.subs),
            self.settle_timeout,
        )
        if self.final_hub_restart:
            self.restart_hub()
        ref = self.trainer.push_once.remote()
        ready, _ = ray.wait([ref], timeout=self.call_timeout)
        if not ready:
            self.trainer_stuck += 1
            self.event("stuck", f"trainer.push_once() did not answer within {self.call_timeout} s")
            ready, _ = ray.wait([ref], timeout=self.settle_timeout)
        try:
            self.final = ray.get(ref, timeout=1) if ready else None
        except Exception as err:
            self.event("call error", f"trainer.push_once() raised {type(err).__name__}: {err}"[:1000])
            self.call_errors += 1
        self.refresh_ledger()
        if self.final is None:
            self.final = self.newest or None
            lost.append(f"the last push failed (see push failures); judging against version {self.final}")
        if self.final is None:
            return lost
        t_pushed = time.time()
        # Pull subscribers take it at their next unit of work.
        self.pump_until(
            lambda: all(
                s.last_answer_wall >= t_pushed or self.is_stuck(s) for s in self.subs if s.kind in PULL_KINDS
            ),
            self.settle_timeout,
        )
        t0 = time.monotonic()
        try:
            self.hub.wait(self.final, timeout=self.settle_timeout)
            waited = None
        except raysync.RaySyncError as err:
            waited = f"{type(err).__name__}: {err}"[:1500]
        wait_s = time.monotonic() - t0
        if waited is None:  # returned: every push subscriber must hold it now
            t_probe = time.time()
            self.wait_status = self.hub.status()["subscribers"]
            for s in self.subs:
                if s.kind in PUSH_KINDS and not self.is_stuck(s):
                    s.probe_after = t_probe
            self.pump_until(
                lambda: all(s.probe_after is None or self.is_stuck(s) for s in self.subs), self.settle_timeout
            )
        else:
            self.event("hub.wait", f"hub.wait({self.final}) after {wait_s:.1f} s: {waited}")
        t_final = time.time()

        def settled() -> bool:
            return all(
                self.is_stuck(s)
                or (
                    s.last_answer_wall >= t_final
                    and s.last_report is not None
                    and s.last_report["version"] == self.final
                )
                for s in self.subs
            )

        self.pump_until(settled, self.settle_timeout)
        self.polling = False
        for s in self.subs:
            r = s.last_report
            if r is None or r["version"] != self.final or not r["whole"] or s.last_answer_wall < t_final:
                stuck = self.is_stuck(s)
                why = "dead" if s.dead else "stuck" if stuck else "did not reach it"
                threads = "" if stuck else f"; threads:\n{self.stacks_of(s)}"  # (stuck, dead: logged already)
                lost.append(
                    f"{s.name} ended on version {r and r['version']} (whole: {r and r['whole']}), not "
                    f"{self.final} ({why} within {self.settle_timeout} s); hub row: {self.row_of(s)}{threads}"
                )
        self.status_ref = None
        deadline = time.monotonic() + 3 * 2.0 + 2.0  # a few subscriber heartbeats
        registered = -1
        while time.monotonic() < deadline:
            registered = len(self.hub.status()["subscribers"])
            if registered == len(self.subs):
                break
            time.sleep(0.5)
        if registered != len(self.subs):
            lost.append(f"{registered} of {len(self.subs)} subscribers registered with the hub at the end")
        for line in lost:
            self.event("lost", line)
        return lost

    def is_stuck(self, sub: _Sub) -> bool:
        """Whether a call to ``sub`` is past its bound (or ``sub`` is dead): waiting on it is pointless."""
        return sub.dead or any(c.stuck for c in self.calls.values() if self.subs[c.sub] is sub)

    def close(self) -> None:
        for actor in [*(s.actor for s in self.subs), self.trainer, self.ledger, self.hub.actor]:
            if actor is not None:
                ray.kill(actor)

    # -------------------------------------------------------------- figures
    def figures(self, pushing_s: float, settle_s: float, lost: list[str]) -> dict[str, Any]:
        records: dict[str, Any] = ray.get(self.ledger.records.remote())
        stamps: list[dict[str, Any]] = records["stamps"]
        versions = [s["version"] for s in stamps]
        counts: dict[int, int] = {}
        for v in versions:
            counts[v] = counts.get(v, 0) + 1
        repeats = sorted(v for v, n in counts.items() if n > 1)
        # A push whose trainer died during it may have been stamped without the trainer hearing.
        interrupted = {row["fill"] for row in records["open"] if row["fill"] is not None}
        # A restarted trainer (a new process) stamps from a new block, past every number granted
        # before: the numbers between one process's last stamp and the next process's first are
        # skipped by design, never reused.
        by_version = sorted(stamps, key=lambda s: s["version"])
        new_block = {
            v
            for a, b in itertools.pairwise(by_version)
            if a["pid"] != b["pid"]
            for v in range(a["version"] + 1, b["version"])
        }
        top = max(versions, default=0)
        skipped = sorted(set(range(1, top + 1)) - set(versions) - interrupted - new_block)
        stamp_mismatches = [s for s in stamps if s["version"] != s["fill"]]
        for s in stamp_mismatches:
            self.event(
                "mismatch", f"trainer (pid {s['pid']}) filled {s['fill']} and the hub stamped {s['version']}"
            )
        if skipped:
            self.event("skipped", f"version numbers never returned to a push: {skipped[:50]}")
        if repeats:
            self.event("repeats", f"version numbers returned to more than one push: {repeats[:50]}")
        failures = [f"pid {f['pid']} {f['stage']} of {f['fill']}: {f['error']}" for f in records["failures"]]
        for f in failures:
            self.event("push failure", f)
        subs: list[dict[str, Any]] = [
            {
                "name": s.name,
                "kind": s.kind,
                "versions_applied": sum(s.applied.values()),
                "versions_seen": len(s.seen),
                "processes": len(s.pids),
                "restarts": s.restarts(),
                "kills": s.kills,
                "polls": s.polls,
                "polls_interrupted": s.interrupted,
                "call_errors": s.errors,
                "mismatches": s.mismatches,
                "stuck": s.stuck,
                "regressions": s.regressions,
                "torn": s.torn,
                "sync_errors": s.sync_errors,
                "max_lag": s.max_lag,
                "polls_without_version": s.empty,
                "final": s.last_report["version"] if s.last_report else None,
            }
            for s in self.subs
        ]
        kinds = []
        for kind in dict.fromkeys(s.kind for s in self.subs):
            rows = [r for r in subs if r["kind"] == kind]
            finals = sorted({r["final"] for r in rows}, key=lambda v: -1 if v is None else v)
            kinds.append(
                {"kind": kind, "subscribers": len(rows), "mode": "pull" if kind in PULL_KINDS else "push"}
                | {
                    k: sum(r[k] for r in rows)
                    for k in (
                        "versions_applied",
                        "kills",
                        "restarts",
                        "mismatches",
                        "stuck",
                        "regressions",
                        "torn",
                        "sync_errors",
                        "call_errors",
                        "polls",
                        "polls_without_version",
                    )
                }
                | {
                    "max_lag": max(r["max_lag"] for r in rows),
                    "final": finals[0] if len(finals) == 1 else finals,
                }
            )
        trainer_pids = {s["pid"] for s in records["starts"]}
        mismatches = sum(s.mismatches for s in self.subs) + len(stamp_mismatches)
        stuck = sum(s.stuck for s in self.subs) + self.trainer_stuck + self.hub_stuck
        torn_total = sum(s.torn for s in self.subs)
        regressions = sum(s.regressions for s in self.subs)
        push_lags = [s.max_lag for s in self.subs if s.kind in PUSH_KINDS]
        pull_lags = [s.max_lag for s in self.subs if s.kind in PULL_KINDS]
        return {
            "seconds": round(pushing_s, 1),
            "settle_s": round(settle_s, 2),
            "size_mib": self.size_mib,
            "call_timeout": self.call_timeout,
            "versions_pushed": len(stamps),
            "last_version": self.final,
            "version_numbers_skipped": skipped,
            "repeats": repeats,
            "interrupted_pushes": sorted(interrupted),
            "stamp_mismatches": len(stamp_mismatches),
            "push_failures": failures,
            "apply_failures": sorted(f"{k}: {v}" for k, v in self.apply_errors.items()),
            "kills": sum(s.kills for s in self.subs),
            "kills_by_kind": {
                "subscriber": sum(s.kills for s in self.subs),
                "hub": self.hub_restarts,
                "trainer": self.trainer_kills,
                "relay": self.relay_kills,
            },
            "hub_restarts": self.hub_restarts,
            "trainer_restarts": self.trainer_kills,
            "trainer_processes": len(trainer_pids),
            "startup_s": round(self.startup_s, 1),
            "trainer_log": records,
            "faults": self.faults,
            "kinds": kinds,
            "subscribers": subs,
            "max_lag": max(push_lags, default=0),
            "max_lag_pull": max(pull_lags, default=0),
            "mismatches": mismatches,
            "stuck": stuck,
            "stuck_trainer": self.trainer_stuck,
            "stuck_hub": self.hub_stuck,
            "torn": torn_total,
            "regressions": regressions,
            "wait_early": self.wait_early,
            "call_errors": self.call_errors,
            "lost": lost,
            "events": self.events,
            "ok": not (
                mismatches
                or stuck
                or torn_total
                or regressions
                or lost
                or skipped
                or repeats
                or self.wait_early
                or failures
                or self.call_errors
            ),
        }


def run_soak(
    *,
    seconds: float = 300.0,
    subscribers: int | None = None,
    kinds: Sequence[str] = KINDS,
    size_mib: float = 8.0,
    tensors: int = 4,
    interval: float = 0.1,
    poll_every: float = 0.1,
    kill_every: float = 3.0,
    hub_restart_every: float = 30.0,
    trainer_restart_every: float = 30.0,
    relay_kill_every: float = 10.0,
    call_timeout: float = 30.0,
    settle_timeout: float = 120.0,
    final_hub_restart: bool = True,
    keep: int = 2,
    seed: int | None = None,
) -> dict[str, Any]:
    """Push for ``seconds`` under every fault; return the figures (``ok``: nothing failed).

    Args:
        seconds: how long the trainer pushes while faults are injected.
        subscribers: how many subscribers (``kinds`` cycled); default one per kind.
        kinds: subscriber kinds (:data:`KINDS`).
        size_mib, tensors: the model (one bucket per tensor).
        interval: seconds the trainer sleeps between pushes.
        poll_every: seconds between a subscriber's answer and the next question.
        kill_every, hub_restart_every, trainer_restart_every, relay_kill_every: mean
            seconds between faults of each kind (0: none).
        call_timeout: seconds any call may take before it counts as stuck.
        settle_timeout: seconds each step of the end may take.
        final_hub_restart: restart the hub right before the last push.
        keep: versions the hub keeps.
        seed: makes each fault schedule repeatable.

    Example:
        >>> r = run_soak(seconds=10, hub_restart_every=4, trainer_restart_every=4, seed=1)
        >>> r["ok"], r["versions_pushed"], r["kinds"][0]
    """
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown subscriber kinds {bad}; kinds are {KINDS}")
    n = len(kinds) if subscribers is None else subscribers
    soak = _Soak(
        seconds=seconds,
        kinds_used=[kinds[i % len(kinds)] for i in range(n)],
        size_mib=size_mib,
        tensors=tensors,
        interval=interval,
        poll_every=poll_every,
        kill_every=kill_every,
        hub_restart_every=hub_restart_every,
        trainer_restart_every=trainer_restart_every,
        relay_kill_every=relay_kill_every,
        call_timeout=call_timeout,
        settle_timeout=settle_timeout,
        final_hub_restart=final_hub_restart,
        keep=keep,
        seed=seed,
    )
    try:
        return soak.run()
    finally:
        soak.close()


def print_soak(r: dict[str, Any]) -> None:
    """The soak's table (one row per subscriber kind) and summary."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"soak: {r['seconds']} s of pushes ({r['size_mib']} MiB model), settled in {r['settle_s']} s"
    )
    for col in (
        "kind",
        "subs",
        "applied",
        "kills",
        "restarts",
        "mismatches",
        "stuck",
        "regress",
        "torn",
        "max lag",
        "no version",
        "final",
        "sync err",
    ):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for k in r["kinds"]:
        lag = f"{k['max_lag']}" + (" (pull)" if k["mode"] == "pull" else "")
        table.add_row(
            k["kind"],
            str(k["subscribers"]),
            str(k["versions_applied"]),
            str(k["kills"]),
            str(k["restarts"]),
            str(k["mismatches"]),
            str(k["stuck"]),
            str(k["regressions"]),
            str(k["torn"]),
            lag,
            str(k["polls_without_version"]),
            str(k["final"]),
            str(k["sync_errors"]),
        )
    console = Console(width=160)
    console.print(table)
    print(
        f"versions pushed: {r['versions_pushed']} (last {r['last_version']}), "
        f"hub restarts: {r['hub_restarts']}, "
        f"trainer restarts: {r['trainer_restarts']} ({r['trainer_processes']} trainer processes), "
        f"subscriber kills: {r['kills']}, relay kills: {r['kills_by_kind']['relay']}, lost: {len(r['lost'])}"
    )
    print(
        f"push side: skipped {len(r['version_numbers_skipped'])}, repeats {len(r['repeats'])}, "
        f"stamp mismatches {r['stamp_mismatches']}, push failures {len(r['push_failures'])}, "
        f"interrupted pushes {len(r['interrupted_pushes'])}, stuck trainer {r['stuck_trainer']}, "
        f"stuck hub {r['stuck_hub']}"
    )
    print(
        f"totals: mismatches {r['mismatches']}, stuck {r['stuck']}, torn {r['torn']}, "
        f"regressions {r['regressions']}, wait_early {r['wait_early']}, call errors {r['call_errors']}; "
        f"max lag {r['max_lag']} (push kinds), {r['max_lag_pull']} (pull kinds, at their unit of work)"
    )
    if r["apply_failures"]:
        print(f"apply/sync errors seen (not counted as failures): {len(r['apply_failures'])}")
        for line in r["apply_failures"][:5]:
            print(f"  {line.splitlines()[0][:200]}")
    for line in r["lost"]:
        print(f"lost: {line}")
    if r["events"]:
        print(f"failures ({len(r['events'])}; all in the JSON's events):")
        for line in r["events"][:12]:
            print("  " + line.replace("\n", "\n    ")[:3000])
    print("OK" if r["ok"] else "FAILED")


# ---------------------------------------------------------------------- resources


SLACK = MiB
"""What the store may hold beyond the versions once frees landed (Ray's own small objects, a few
KiB): a settle waits for that, not for an exact count it may never reach (10 s each)."""


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
    ``kinds``: ``copy``, ``threaded``, ``view`` or ``prefetch`` (the kinds with ``memory()``).
    """
    hub_name = f"soak-res-{uuid.uuid4().hex[:8]}"
    hub = raysync.connect(hub_name, keep=keep)
    gauge = ObjectStoreGauge()
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
    for value in range(1, pushes + 1):
        fill(model, float(value))
        hub.push(model, wait=True, timeout=timeout, bucket_bytes=size // tensors)
        store.append(gauge.used() - baseline)
        if value % every and value != pushes:
            continue
        # Ray frees released objects in batches (about once a second): once they
        # landed, the kept versions and at most one retiring.
        settled.append(gauge.settle(baseline + (keep + 1) * size + SLACK, poll=0.05) - baseline)
        memory.append(ray.get([a.memory.remote() for a in actors]))
    elapsed = time.monotonic() - t0
    finals = ray.get([a.check.remote() for a in actors])
    torn_count = sum(torn(r) or r["version"] != pushes for r in finals)
    end = gauge.settle(baseline + keep * size + SLACK, poll=0.05) - baseline
    for a in actors:
        ray.kill(a)
    ray.kill(hub.actor)
    # The trainer's client holds its newest version (to offer a restarted hub) until it goes; it
    # is in a reference cycle with its push pipeline, so only the collector frees it.
    del hub
    gc.collect()
    released = gauge.settle(baseline + size // 8, poll=0.05) - baseline
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
        "ok": torn_count == 0,
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
    p.add_argument("--seconds", type=float, default=300.0, help="how long to push under faults (soak)")
    p.add_argument(
        "--subscribers", type=int, default=None, help="soak: one per kind; resources: 2 (copy, view)"
    )
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=None, help="subscriber kinds, cycled")
    p.add_argument("--size-mib", type=float, default=None, help="model size (soak 8, resources 256)")
    p.add_argument("--tensors", type=int, default=4, help="tensors (and buckets) per version")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between pushes (soak)")
    p.add_argument("--poll-every", type=float, default=0.1, help="seconds between a subscriber's reports")
    p.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between subscriber kills")
    p.add_argument("--hub-restart-every", type=float, default=30.0, help="mean seconds between hub restarts")
    p.add_argument("--relay-kill-every", type=float, default=10.0, help="mean seconds between relay kills")
    p.add_argument(
        "--trainer-restart-every", type=float, default=30.0, help="mean seconds between trainer restarts"
    )
    p.add_argument("--call-timeout", type=float, default=30.0, help="seconds before a call counts as stuck")
    p.add_argument(
        "--settle-timeout", type=float, default=120.0, help="seconds each step of the end may take"
    )
    p.add_argument(
        "--no-final-hub-restart", action="store_true", help="do not restart the hub before the last push"
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resources", action="store_true", help="the keep=2 resource check instead")
    p.add_argument("--pushes", type=int, default=50, help="pushes (resources)")
    harness.add_options(p, object_store_mib=1536)  # if this script starts Ray
    harness.add_options(p, json=None)  # default: results/soak.json or results/soak_resources.json
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the soak (or ``--resources``), print the figures, write JSON; return the figures."""
    args = parse_args(argv)
    # A cluster of our own (never one another process started on the machine), unless this
    # process is already connected (a test's).
    with harness.local_cluster(num_cpus=4, object_store_bytes=args.object_store_mib * MiB, reuse=True):
        if args.resources:
            result = run_resources(
                size_mib=args.size_mib or 256.0,
                pushes=args.pushes,
                subscribers=args.subscribers or 2,
                kinds=args.kinds or ("copy", "view"),
                tensors=args.tensors,
            )
            print_resources(result)
            default_json = "soak_resources.json"
        else:
            result = run_soak(
                seconds=args.seconds,
                subscribers=args.subscribers,
                kinds=args.kinds or KINDS,
                size_mib=args.size_mib or 8.0,
                tensors=args.tensors,
                interval=args.interval,
                poll_every=args.poll_every,
                kill_every=args.kill_every,
                hub_restart_every=args.hub_restart_every,
                trainer_restart_every=args.trainer_restart_every,
                relay_kill_every=args.relay_kill_every,
                call_timeout=args.call_timeout,
                settle_timeout=args.settle_timeout,
                final_hub_restart=not args.no_final_hub_restart,
                seed=args.seed,
            )
            print_soak(result)
            default_json = "soak.json"
    harness.write_json(args.json or RESULTS / default_json, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(0 if main()["ok"] else 1)

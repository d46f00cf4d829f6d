"""Soak for sharded trainers: ranks killed mid-push, rival groups, pushes that time out; nothing torn.

A group of ``--world`` gloo ranks (Ray actors) holds a model as ``DTensor``\\ s (``Shard(0)`` and
``Shard(1)`` with uneven chunks, ``Replicate``, and a plain ``step`` buffer) and pushes it in a
loop, each rank calling ``hub.push(model)`` after a barrier (as a trainer's collectives keep its
ranks in step). Every push's weights derive from its step: element ``i`` of tensor ``k`` is
``step * 10**7 + k * 10**6 + i`` and the ``step`` buffer holds the step, so whoever holds a
version can tell whether each shard of it belongs to the same step. Each rank records
``(version, step)`` in a ledger actor once its push returned.

At a random moment (uniform within ``--kill-within`` s of the group's start) one random rank is
killed (``ray.kill``: its process dies wherever it is, mid-snapshot, mid-call to the hub or
between pushes), then, after a random pause in which the others go on into their next push,
the rest of the group; a new group (new processes) starts from a step never pushed before.
This repeats for ``--kills`` kills or ``--seconds`` seconds (or until ``--versions`` versions
were published); a last group then pushes without being killed.

With ``--rivals 1`` a second group pushes the same model at the same time as the writing one
(each group's steps are its own: a step tells which group pushed it): the writer lease refuses
every rank of it (``StaleWriterError``) until the writing group is killed; it then takes over
and a new rival starts. With ``--lag-p p`` each rank's push, with probability ``p`` and on its
own, is made with ``max_lag=1`` against a pull-mode subscriber that never syncs and a short
timeout: it raises ``SyncTimeoutError`` on that rank alone, and the hub drops that push of
every rank of the group (issue 41: such a push used to leave the ranks' counts apart, and
every version after it held shards of two steps).

Receivers: a ``@synced_model`` actor (polled every few ms; a method runs under its version
lock, so it reports a version whole) and a ``WeightsLoader`` under a ``Follower`` in an actor
of its own (every version handed to it is checked in the callback). Checks:

- **torn = 0**: every version a receiver holds is bit-equal to the weights of its step, and
  that step is the one the ledger says the version's number was pushed with;
- no receiver ever holds a number the hub abandoned (``hub.status()["abandoned"]``, read at
  every poll: the hub lists only the newest it abandoned);
- every number the hub granted was either published or abandoned (``unaccounted = 0``);
- no number was returned to two ranks for pushes of different steps (``numbering_errors = 0``);
- the last group pushes its 3 versions, and the last reaches both receivers.

    python benchmarks/sharded_soak.py --kills 20 --seconds 300
    python benchmarks/sharded_soak.py --rivals 1 --lag-p 0.05 --versions 1000 --kills 20 --seconds 900
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

import raysync

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
import _harness as harness

MODEL = "soak"
STEPS_PER_GROUP = 10_000  # group g pushes steps g * STEPS_PER_GROUP ..: a step tells its group
PUSHES_PER_GROUP = 10_000
_LAST_PUSH_TIMEOUT_S = 60.0  # the last group's pushes: their ranks live, so only load could time them out
# name -> (shape, placement): shard dims uneven over 2 and 4 ranks
TENSORS: dict[str, tuple[tuple[int, ...], int | None]] = {
    "rows": ((257, 512), 0),  # 1 MiB of float64, Shard(0), uneven
    "cols": ((6, 7), 1),  # Shard(1), uneven
    "rep": ((3, 3), None),  # Replicate
}


def full(key: str, step: int) -> torch.Tensor:
    """The whole tensor ``key`` as pushed at ``step``."""
    shape, _ = TENSORS[key]
    k = sorted(TENSORS).index(key)
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64) + (step * 10**7 + k * 10**6)).reshape(shape)


def check(state: dict[str, torch.Tensor]) -> tuple[int, bool]:
    """``(step, whether every tensor is bit-equal to that step's)`` of a receiver's weights."""
    step = int(state["step"])
    return step, all(torch.equal(state[k], full(k, step)) for k in TENSORS)


class Net(torch.nn.Module):
    """The model: every tensor of :data:`TENSORS` and a plain ``step`` buffer."""

    def __init__(self) -> None:
        super().__init__()
        for key, (shape, _) in TENSORS.items():
            self.register_parameter(key, torch.nn.Parameter(torch.full(shape, -1.0, dtype=torch.float64)))
        self.register_buffer("step", torch.tensor(-1, dtype=torch.int64))


@ray.remote(num_cpus=0)
class Ledger:
    """What each rank's push returned: ``(version, step, rank, group)``."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int]] = []
        self.noted: dict[str, int] = {}

    def record(self, version: int, step: int, rank: int, group: int) -> None:
        self.rows.append((version, step, rank, group))

    def entries(self) -> list[tuple[int, int, int, int]]:
        return list(self.rows)

    def note(self, what: str) -> None:
        """One push that did not return a number (refused, timed out, dropped)."""
        self.noted[what] = self.noted.get(what, 0) + 1

    def notes(self) -> dict[str, int]:
        return dict(self.noted)

    def count(self, group: int) -> int:
        """How many pushes of ``group``'s ranks returned a number."""
        return sum(1 for row in self.rows if row[3] == group)


@ray.remote(num_cpus=0, max_concurrency=2)  # stop() while run() runs
class Rank:
    """One rank of the trainer group ``group``."""

    def __init__(self, rank: int, world: int, port: int, hub: str, ledger: Any, group: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        self.rank, self.world, self.group, self.ledger = rank, world, group, ledger
        mesh = init_device_mesh("cpu", (world,))
        net = Net()
        for key, (_, dim) in TENSORS.items():
            place = [Replicate() if dim is None else Shard(dim)]
            setattr(net, key, torch.nn.Parameter(distribute_tensor(getattr(net, key).detach(), mesh, place)))
        self.net = net
        self.hub = raysync.connect(hub)
        self.stopping = False

    def ready(self) -> bool:
        return True

    def stop(self) -> None:
        """End :meth:`run` (every rank of the group at the same step: they agree before each push)."""
        self.stopping = True

    def _fill(self, step: int) -> None:
        with torch.no_grad():
            for key, (_, dim) in TENSORS.items():
                whole = full(key, step)
                mine = whole if dim is None else torch.chunk(whole, self.world, dim)[self.rank]
                local = getattr(self.net, key).to_local()
                assert local.shape == mine.shape, (key, local.shape, mine.shape)
                local.copy_(mine)
            self.net.step.fill_(step)

    def run(self, first_step: int, pushes: int, timeout: float, lag_p: float = 0.0, seed: int = 0) -> int:
        """Push steps ``first_step ..``; how many pushes it made (the ledger has what each did).

        A rank whose push raises goes on with the next step, as a trainer that logs the error
        would; each push is made after a barrier (a trainer's collectives keep its ranks in step).
        A :meth:`stop` ends the run it was sent to, not the next one; the run returns once the
        ledger holds what each of its pushes did.
        """
        import torch.distributed as dist

        self.stopping = False  # a stop() ended the run before this one
        rng = random.Random(seed * 1000 + self.group * 10 + self.rank)
        done, told = 0, None
        for i in range(pushes):
            step = first_step + i
            self._fill(step)
            stop = torch.tensor([1 if self.stopping else 0])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # the group's barrier, and whether any rank stops
            if int(stop):
                break
            lag = i > 0 and rng.random() < lag_p  # never the first push: it identifies the group
            opts: dict[str, Any] = {"max_lag": 1, "include_pull": True, "timeout": 0.05} if lag else {}
            done += 1
            try:
                version = self.hub.push(self.net, MODEL, **{"timeout": timeout, **opts})
            except raysync.StaleWriterError:
                told = self.ledger.note.remote("stale")  # a rival of the writing group: refused, tries again
                time.sleep(0.02)
                continue
            except raysync.SyncTimeoutError:
                told = self.ledger.note.remote("lagged" if lag else "timed_out")
                continue
            except raysync.InvalidWeightsError:
                told = self.ledger.note.remote("dropped")  # another rank's push of this step raised
                continue
            told = self.ledger.record.remote(version, step, self.rank, self.group)
        if told is not None:
            ray.get(told)  # an actor runs one caller's calls in order: the ledger has them all
        return done


@ray.remote(num_cpus=0)
class Evaluator:
    """A pull-mode subscriber that never syncs: a push with ``max_lag`` and ``include_pull`` waits for it."""

    def __init__(self, hub: str) -> None:
        @raysync.synced_model("net", model_id=MODEL, hub=hub, mode="pull")
        class Pulled:
            def __init__(self) -> None:
                self.net = Net()

        self.pulled = Pulled()

    def ready(self) -> bool:
        return True


def collector(hub: str) -> Any:
    """A ``@synced_model`` receiver of ``hub``: it reports the version it holds and whether its
    weights are right (a method runs under its version lock: it sees one version whole)."""

    @raysync.synced_model("net", model_id=MODEL, hub=hub)
    class Collector:
        def __init__(self) -> None:
            self.net = Net()

        def report(self) -> tuple[int | None, int, bool]:
            step, ok = check(dict(self.net.state_dict()))
            return self.raysync_version(), step, ok

    return ray.remote(num_cpus=0)(Collector).remote()


@ray.remote(num_cpus=0)
class LoaderChecker:
    """A ``WeightsLoader`` receiver: every version handed to it is checked in the callback."""

    def __init__(self, hub: str) -> None:
        self.seen: list[tuple[int, bool]] = []

        def load(pairs: Any) -> None:
            state = {k: t.clone() for k, t in pairs}
            self.seen.append(check(state))

        self.loader = raysync.WeightsLoader(load)
        self.follower = raysync.Follower(target=self.loader, model_id=MODEL, hub=hub).start()

    def report(self) -> tuple[list[tuple[int, bool]], int | None]:
        return list(self.seen), self.loader.version


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def soak(
    *,
    world: int = 2,
    kills: int = 3,
    seconds: float = 30.0,
    kill_within: float = 1.5,
    push_timeout: float = 5.0,
    seed: int = 0,
    hub_name: str = "sharded-soak",
    ahead: int = 1,
    rivals: int = 0,
    lag_p: float = 0.0,
    versions: int | None = None,
) -> dict[str, Any]:
    """Run the soak on the connected Ray cluster; the counts (see the module's docstring).

    ``ahead`` groups start before they are needed (each while the one before pushes);
    ``rivals`` of them push at the same time as the writing group. The soak ends after
    ``kills`` kills, ``seconds`` seconds, or once ``versions`` versions were published.

    Raises:
        AssertionError: a version was published torn, a receiver held an abandoned number,
            or the last version did not reach the receivers.
    """
    rng = random.Random(seed)
    hub = raysync.connect(hub_name)
    ledger = Ledger.remote()
    ahead = max(ahead, rivals)
    # Groups start ahead (new processes, gloo joined) while the one before pushes: a restart then
    # costs the soak no wait for processes to start
    spawned: list[list[Any]] = []
    running: dict[int, list[Any]] = {}  # group number -> its ranks' runs

    def spawn() -> None:
        port, number = _port(), len(spawned)
        spawned.append([Rank.remote(r, world, port, hub_name, ledger, number) for r in range(world)])

    def start(number: int, pushes: int, lag: float = lag_p, timeout: float = push_timeout) -> None:
        if number not in running:
            ray.get([r.ready.remote() for r in spawned[number]], timeout=300)
            first = number * STEPS_PER_GROUP  # each group's steps are its own
            runs = [r.run.remote(first, pushes, timeout, lag, seed) for r in spawned[number]]
            running[number] = runs

    for _ in range(ahead):
        spawn()
    receiver = collector(hub_name)
    checker = LoaderChecker.remote(hub_name)
    evaluator = Evaluator.remote(hub_name)
    held: list[tuple[int | None, int, bool]] = []

    abandoned: set[int] = set()  # numbers the hub says it abandoned (status()["abandoned"])

    def poll() -> None:
        held.append(ray.get(receiver.report.remote(), timeout=60))
        # the hub lists only the newest FAILURES_KEPT numbers it abandoned: read them as they come
        abandoned.update(hub.status()["abandoned"].get(MODEL, []))

    ray.get([receiver.report.remote(), checker.report.remote(), evaluator.ready.remote()], timeout=120)
    started, group_no, killed = time.monotonic(), 0, 0

    def settle(number: int) -> None:
        for run in running.pop(number, []):
            try:
                ray.get(run, timeout=60)
            except ray.exceptions.RayError:
                pass

    def published() -> int:
        return int(hub.status()["models"].get(MODEL, {}).get("pushes", 0))

    while True:
        last = (
            killed >= kills
            or time.monotonic() - started > seconds
            or (versions is not None and published() >= versions)
        )
        while len(spawned) <= group_no + (0 if last else ahead):
            spawn()
        group = spawned[group_no]
        if last:  # the last group pushes a few versions and is left alone (its rivals are killed)
            for number in [n for n in running if n != group_no]:
                harness.kill_all(spawned[number])
                settle(number)
            if group_no in running:  # a rival that took over: it stops once it pushed a few versions
                deadline = time.monotonic() + 120
                while ray.get(ledger.count.remote(group_no)) < 3 * world and time.monotonic() < deadline:
                    poll()
                ray.get([r.stop.remote() for r in group], timeout=60)
                settle(group_no)
            # The last versions: none times out (no rank of this group dies; only load could)
            start(group_no, 3, lag=0.0, timeout=max(push_timeout, _LAST_PUSH_TIMEOUT_S))
            last_pushes = min(ray.get(running.pop(group_no), timeout=300))
            break
        start(group_no, PUSHES_PER_GROUP)
        for number in range(group_no + 1, group_no + 1 + rivals):
            start(number, PUSHES_PER_GROUP)
        kill_at = time.monotonic() + rng.uniform(0.0, kill_within)
        while time.monotonic() < kill_at:
            poll()
        victim = rng.randrange(world)
        ray.kill(group[victim])
        killed += 1
        pause = time.monotonic() + rng.uniform(0.0, 0.3)  # the others go on into their next push
        while time.monotonic() < pause:
            poll()
        harness.kill_all(group)
        settle(group_no)
        # the rounds the groups before left open are settled by now (this group's first part, or
        # their deadline, abandoned them); the hub lists the numbers it abandoned lately
        abandoned |= set(hub.status()["abandoned"].get(MODEL, []))
        group_no += 1
    rows = ray.get(ledger.entries.remote(), timeout=60)
    counts = ray.get(ledger.notes.remote(), timeout=60)
    final = max(v for v, _, _, g in rows if g == group_no)  # its last pushes: no rank's timed out
    hub.wait(final, MODEL, timeout=120, subscribers=2)
    abandoned |= set(hub.status()["abandoned"].get(MODEL, []))
    poll()
    seen, loader_version = ray.get(checker.report.remote(), timeout=60)
    # what each number was pushed with: one step per number, whichever rank said so
    steps_of: dict[int, set[int]] = {}
    for version, s, _, _ in rows:
        steps_of.setdefault(version, set()).add(s)
    numbering = [v for v, s in steps_of.items() if len(s) > 1]
    held_versions = [(v, s, ok) for v, s, ok in held if v is not None]
    torn = [h for h in held_versions if not h[2] or steps_of.get(h[0], {h[1]}) != {h[1]}]
    torn += [(None, s, ok) for s, ok in seen if not ok]
    stale = [h for h in held_versions if h[0] in abandoned]
    result = {
        "world": world,
        "rivals": rivals,
        "lag_p": lag_p,
        "seconds": round(time.monotonic() - started, 1),
        "groups": group_no + 1,
        "kills": killed,
        "pushes": len(rows),
        "rounds": len(steps_of),
        "published": len(set(steps_of) - abandoned),
        "abandoned": len(set(steps_of) & abandoned),
        "abandoned_all": len(abandoned),
        # every number the hub granted (1 .. final, one block after another) was published or abandoned
        "unaccounted": final - published() - len(abandoned),
        "published_total": published(),
        "collector_reports": len(held_versions),
        "collector_versions": len({v for v, _, _ in held_versions}),
        "groups_held": len({s // STEPS_PER_GROUP for _, s, _ in held_versions}),
        "loader_versions": len(seen),
        "final": final,
        "last_pushes": last_pushes,
        "collector_final": held[-1][0],
        "loader_final": loader_version,
        "torn": len(torn),
        "numbering_errors": len(numbering),
        "abandoned_held": len(stale),
        **{f"pushes_{k}": n for k, n in sorted(counts.items())},
    }
    for group in spawned:
        harness.kill_all(group)
    harness.kill_all([receiver, checker, ledger, evaluator])
    ray.kill(hub.actor)
    assert not torn, f"versions published torn: {torn[:5]}"
    assert not numbering, f"one number pushed with several steps: {numbering[:5]}"
    assert not stale, f"a receiver held an abandoned number: {stale[:5]}"
    assert result["unaccounted"] == 0, result
    assert last_pushes == 3, f"the last group pushed {last_pushes} of its 3 last versions: {result}"
    assert result["collector_final"] == final and loader_version == final, result
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--kill-within", type=float, default=1.5, help="s after a group's start")
    parser.add_argument("--push-timeout", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rivals", type=int, default=0, help="groups pushing beside the writing one")
    parser.add_argument("--lag-p", type=float, default=0.0, help="chance a rank's push times out alone")
    parser.add_argument("--versions", type=int, default=None, help="stop once this many are published")
    args = parser.parse_args(argv)
    started = time.time()
    with harness.local_cluster(num_cpus=args.world * (2 + args.rivals) + 4, object_store_bytes=1024 * 2**20):
        result = soak(
            world=args.world,
            kills=args.kills,
            seconds=args.seconds,
            kill_within=args.kill_within,
            push_timeout=args.push_timeout,
            seed=args.seed,
            rivals=args.rivals,
            lag_p=args.lag_p,
            versions=args.versions,
        )
    print(", ".join(f"{k}={v}" for k, v in result.items()))
    harness.write_json(
        harness.results_path("sharded_soak.json"),
        {"meta": harness.run_meta("benchmarks/sharded_soak.py", argv, started=started), "result": result},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

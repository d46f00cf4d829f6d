"""Ray's own cost of handing one object ref to N actors on one node: the floor under by-call delivery.

A version that does not go by doorbell (over 8 MiB, or a NIXL one) reaches each
subscriber as an object ref, which the subscriber maps zero-copy (``apply="view"``)
or copies from. What that hand-over costs Ray alone, measured here without raysync,
two ways, each from a ``ray.put`` in the driver (the trainer, the ref's owner)
through one async middle actor (the relay) until every actor answered:

``call``
    the middle actor calls a method of each of the N actors with the ref inside
    its argument (what relays did before 25 November: it needs a handle of the
    subscriber's actor, and so its class, in the relay's process).
``poll``
    each actor keeps a call open at the middle actor (a long poll) and gets the
    ref inside its reply; its answer rides on its next poll (what relays do now:
    they hold no subscriber's handle; see ``raysync/hub/mailbox.py``).

Each actor ``ray.get``-s the ref (zero-copy) and keeps the array, as a view
subscriber does. ``--no-ref`` sends the same messages with no ref inside: the
difference is Ray's bookkeeping of a ref borrowed through a reply. Reported per
pattern and N: the median round (push to all answered) and the CPU time per round
of the actors, the middle actor and the driver (from ``/proc``).

Run::

    python benchmarks/ref_handoff.py --actors 1 8 --mib 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@ray.remote(num_cpus=0, max_concurrency=1000)
class Middle:
    """The relay's part: hands each round's ref to every actor, by call or by their polls."""

    def __init__(self, actors: list[Any], pattern: str) -> None:
        self.actors, self.pattern = actors, pattern
        self.current: Any = None
        self.events: dict[int, asyncio.Event] = {}
        self.done: asyncio.Future[None] | None = None
        self.answered = 0

    def pid(self) -> int:
        return os.getpid()

    async def deliver(self, announcement: tuple[int, list[Any]]) -> int:
        if self.pattern == "call":
            await asyncio.gather(*[a.take.remote(announcement) for a in self.actors])
            return announcement[0]
        self.current, self.answered = announcement, 0
        self.done = asyncio.get_running_loop().create_future()
        for event in self.events.values():
            event.set()
        await self.done
        return announcement[0]

    async def poll(self, me: int, answered: int | None) -> tuple[int, list[Any]]:
        if answered is not None:
            self.answered += 1
            if self.answered == len(self.actors) and self.done is not None and not self.done.done():
                self.done.set_result(None)
        event = self.events.setdefault(me, asyncio.Event())
        await event.wait()
        event.clear()
        return self.current


@ray.remote(num_cpus=0)
class Taker:
    """A subscriber's part: maps the ref and keeps it, by a call or from its polls."""

    def __init__(self) -> None:
        self.held: Any = None

    def pid(self) -> int:
        return os.getpid()

    def take(self, announcement: tuple[int, list[Any]]) -> int:
        refs = announcement[1]
        self.held = ray.get(refs) if refs[0] is not None else None
        return announcement[0]

    def start_polling(self, middle: Any, me: int) -> None:
        def loop() -> None:
            answered = None
            while True:
                announcement = ray.get(middle.poll.remote(me, answered))
                answered = self.take(announcement)

        threading.Thread(target=loop, daemon=True).start()


def measure(pattern: str, n: int, nbytes: int, rounds: int, with_ref: bool) -> dict[str, Any]:
    """One pattern at N actors: median round and CPU per round of each part."""
    takers = [Taker.remote() for _ in range(n)]
    middle = Middle.remote(takers, pattern)
    pids = {
        "actors": ray.get([t.pid.remote() for t in takers]),
        "middle": [ray.get(middle.pid.remote())],
        "driver": [os.getpid()],
    }
    if pattern == "poll":
        ray.get([t.start_polling.remote(middle, i) for i, t in enumerate(takers)])
        time.sleep(0.5)
    data = np.ones(nbytes, dtype=np.uint8)

    def round_s(i: int) -> float:
        ref = ray.put(data) if with_ref else None
        t0 = time.perf_counter()
        ray.get(middle.deliver.remote((i, [ref])))
        return time.perf_counter() - t0

    for i in range(5):
        round_s(i)
    before = {k: sum(_cpu_s(p) for p in v) for k, v in pids.items()}
    times = [round_s(i) for i in range(5, 5 + rounds)]
    after = {k: sum(_cpu_s(p) for p in v) for k, v in pids.items()}
    for actor in [*takers, middle]:
        ray.kill(actor)
    row: dict[str, Any] = {
        "pattern": pattern,
        "n": n,
        "ref": with_ref,
        "round_ms": statistics.median(times) * 1e3,
    }
    row.update({f"cpu_{k}_ms": (after[k] - before[k]) / rounds * 1e3 for k in pids})
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 8], help="N (default: 1 8)")
    parser.add_argument("--mib", type=int, default=1, help="the object's size in MiB (default: 1)")
    parser.add_argument("--rounds", type=int, default=100, help="timed rounds per row (default: 100)")
    parser.add_argument("--no-ref", action="store_true", help="also the same messages with no ref inside")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    ray.init(
        object_store_memory=max(1 << 30, 8 * args.mib << 20), include_dashboard=False, log_to_driver=False
    )
    rows = []
    for with_ref in [True, False] if args.no_ref else [True]:
        for n in args.actors:
            for pattern in ("call", "poll"):
                rows.append(measure(pattern, n, args.mib << 20, args.rounds, with_ref))
                r = rows[-1]
                ref = "yes" if with_ref else "no"
                cpu = f"actors {r['cpu_actors_ms']:5.2f}, middle {r['cpu_middle_ms']:5.2f}"
                print(
                    f"{pattern:4} N={n:<3} ref={ref:3} round {r['round_ms']:6.2f} ms | "
                    f"CPU ms per round: {cpu}, driver {r['cpu_driver_ms']:5.2f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

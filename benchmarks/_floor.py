"""The copy floor and the memory gauges: what no weight-sync path can beat, and what it holds.

The copy floor of a push to N actors on one node, measured in the same run as
raysync (same machine state): one ``dst.copy_(src)`` of the whole model in the
driver (the snapshot) plus N simultaneous ``dst.copy_(src)`` in N plain Ray
actors (the receivers), each into its own preallocated, pre-faulted buffer.
The source is by default one ``/dev/shm`` file mapped by every actor (like
the object store: one shared copy per node, read by all); ``source="private"``
gives each actor its own buffer instead (twice the memory). The N copies start
together at an agreed wall-clock instant (the actors share the node's clock)
and the simultaneous time is the last end minus the first start. As a
cross-check the driver's launch-to-done time minus the fan-out time of N
empty calls is recorded too.

The gauges: :class:`ObjectStoreGauge` (the object store's bytes in use, as
the raylet reports them), :func:`prefault_object_store` and
:func:`process_memory` (RSS and private memory of a receiver).

Example:
    >>> flat = torch.ones(64 * MIB, dtype=torch.uint8)
    >>> floor = measure_copy_floor(flat, n=4, repeats=3)  # doctest: +SKIP
    >>> floor["floor_s"] == floor["snapshot_copy_s"] + floor["recv_copy_wall_s"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from _harness import MIB, kill_all, median, wait_until_quiet

__all__ = [
    "FloorReceiver",
    "Mailbox",
    "ObjectStoreGauge",
    "measure_copy_floor",
    "measure_receiver_floor",
    "measure_snapshot_floor",
    "prefault_object_store",
    "process_memory",
    "shared_source",
    "timed_copy",
]

logger = logging.getLogger(__name__)


class FloorReceiver:
    """A plain actor for the floor: a preallocated destination, one source, one ``copy_``.

    Args:
        nbytes: the model's size.
        src_path: a file of ``nbytes`` to map as the source (see :func:`shared_source`),
            or None for a private source buffer.

    Example:
        >>> actor = ray.remote(num_cpus=1)(FloorReceiver).remote(MIB, None)  # doctest: +SKIP
        >>> ray.get(actor.copy.remote())  # doctest: +SKIP
        0.0001
    """

    def __init__(self, nbytes: int, src_path: str | None) -> None:
        self.dst = torch.empty(nbytes, dtype=torch.uint8)
        self.dst.fill_(0)  # fault every page in now, not during the timed copies
        self._map: np.memmap | None = None
        if src_path is None:
            self.src = torch.full((nbytes,), 1, dtype=torch.uint8)
        else:
            self._map = np.memmap(src_path, dtype=np.uint8, mode="r+", shape=(nbytes,))
            self.src = torch.from_numpy(self._map)
        self.dst.copy_(self.src)  # map the source's pages into this process

    def noop(self) -> None:
        """Nothing: the cost of a call."""
        return None

    def copy(self) -> float:
        """One timed ``copy_``; its seconds."""
        return timed_copy(self.dst, self.src)

    def copy_at(self, start_at: float) -> tuple[float, float]:
        """Wait until wall-clock ``start_at``, copy, return (start, end) wall-clock times."""
        while True:
            left = start_at - time.time()
            if left <= 0:
                break
            time.sleep(min(left, 0.001) if left < 0.005 else left - 0.004)
        t0 = time.time()
        self.dst.copy_(self.src)
        return t0, time.time()


class Mailbox:
    """A bare hub: each round's parts held until all are in, then handed to every call waiting for them.

    Run it as an async Ray actor (``ray.remote(num_cpus=0)(Mailbox).remote()``). Writers
    ``post`` their parts one way; receivers' ``wait`` calls (long polls, sent before the
    round starts) are answered once the round's ``parts`` are in. One message per part in and
    one reply per receiver: what any hub that publishes a version once every part is in costs,
    with no version checks, no layout, no lease.

    Example:
        >>> box = ray.remote(num_cpus=0)(Mailbox).remote()  # doctest: +SKIP
        >>> waiting = box.wait.remote(1)                     # doctest: +SKIP
        >>> box.post.remote(1, [ray.put(b"part")], 1)       # doctest: +SKIP
        >>> ray.get(ray.get(waiting))                        # doctest: +SKIP
        [b'part']
    """

    def __init__(self) -> None:
        self.parts: dict[int, list[Any]] = {}
        self.whole: dict[int, asyncio.Event] = {}
        self.waiting: dict[int, int] = {}

    def _event(self, round: int) -> asyncio.Event:
        for old in [r for r in self.whole if r < round - 1]:  # rounds two behind are done
            for table in (self.parts, self.whole, self.waiting):
                table.pop(old, None)
        return self.whole.setdefault(round, asyncio.Event())

    async def post(self, round: int, refs: list[Any], parts: int = 1) -> None:
        """A writer's part of ``round`` (its refs); the round is whole once ``parts`` are in."""
        got = self.parts.setdefault(round, [])
        got.extend(refs)
        if len(got) >= parts:
            self._event(round).set()

    async def wait(self, round: int) -> list[Any]:
        """Every part's refs of ``round``, once all are in."""
        event = self._event(round)
        self.waiting[round] = self.waiting.get(round, 0) + 1
        await event.wait()
        return list(self.parts[round])

    async def waiters(self, round: int) -> int:
        """How many calls wait for ``round`` (the caller starts the clock once all do)."""
        return self.waiting.get(round, 0)


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    """``dst.copy_(src)``; the seconds it took.

    Example:
        >>> timed_copy(torch.empty(4), torch.ones(4)) >= 0
        True
    """
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


@contextlib.contextmanager
def shared_source(nbytes: int) -> Iterator[str]:
    """A ``/dev/shm`` file of ``nbytes`` (all written) that floor actors map as their source.

    Removed on exit.

    Example:
        >>> with shared_source(MIB) as path:
        ...     os.path.getsize(path)
        1048576
    """
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(directory, f"raysync-bench-src-{uuid.uuid4().hex[:8]}")
    mm = np.memmap(path, dtype=np.uint8, mode="w+", shape=(nbytes,))
    mm[:] = 1
    mm.flush()
    del mm
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def measure_snapshot_floor(src: torch.Tensor, repeats: int) -> dict[str, Any]:
    """One whole-model ``dst.copy_(src)`` in the driver (the snapshot), into a pre-faulted dst.

    Returns ``snapshot_copy_s`` (the median) and ``snapshot_copy_samples``.

    Example:
        >>> measure_snapshot_floor(torch.ones(MIB, dtype=torch.uint8), 3)["snapshot_copy_s"] > 0
        True
    """
    dst = torch.empty_like(src)
    dst.fill_(0)
    timed_copy(dst, src)  # warm-up
    samples = [timed_copy(dst, src) for _ in range(repeats)]
    del dst
    return {"snapshot_copy_s": median(samples), "snapshot_copy_samples": samples}


def measure_receiver_floor(
    nbytes: int,
    n: int,
    repeats: int,
    source: str = "shared",
    timeout: float = 300.0,
    *,
    quiet_timeout: float = 5.0,
) -> dict[str, Any]:
    """N simultaneous memory-to-memory copies of ``nbytes`` in N plain Ray actors.

    Args:
        nbytes: bytes each actor copies.
        n: how many actors (one CPU each).
        repeats: timed rounds (medians reported).
        source: ``"shared"`` (one ``/dev/shm`` file mapped by all) or ``"private"``.
        timeout: seconds for any one round.
        quiet_timeout: seconds to wait for idle CPUs once the actors are up (0: do not wait).

    Returns:
        ``recv_copy_wall_s`` (last end minus first start), ``recv_copy_per_actor_s``,
        ``recv_copy_driver_s`` (launch to done minus the fan-out of empty calls),
        ``empty_call_fanout_s``, the samples, ``floor_source`` and
        ``floor_cpu_busy_before``.

    Example:
        >>> measure_receiver_floor(16 * MIB, 2, 3)["recv_copy_wall_s"]  # doctest: +SKIP
        0.004
    """
    import ray

    if source not in ("shared", "private"):
        raise ValueError(f"source must be 'shared' or 'private', got {source!r}")
    floor_cls: Any = ray.remote(num_cpus=1)(FloorReceiver)
    with contextlib.ExitStack() as stack:
        path = stack.enter_context(shared_source(nbytes)) if source == "shared" else None
        actors = [floor_cls.remote(nbytes, path) for _ in range(n)]
        stack.callback(kill_all, actors)
        ray.get([a.noop.remote() for a in actors], timeout=timeout)
        ray.get([a.copy.remote() for a in actors], timeout=timeout)  # warm-up, together
        cpu_busy = wait_until_quiet(timeout=quiet_timeout)
        lead = 0.05 + 0.01 * n  # time for every call to reach its actor before the start
        walls: list[float] = []
        per_actor: list[float] = []
        driver_walls: list[float] = []
        noop_walls: list[float] = []
        for _ in range(repeats):
            start_at = time.time() + lead
            spans = ray.get([a.copy_at.remote(start_at) for a in actors], timeout=timeout)
            walls.append(max(e for _, e in spans) - min(s for s, _ in spans))
            per_actor.append(statistics.mean(e - s for s, e in spans))
            t0 = time.perf_counter()
            ray.get([a.noop.remote() for a in actors], timeout=timeout)
            noop_walls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.get([a.copy.remote() for a in actors], timeout=timeout)
            driver_walls.append(time.perf_counter() - t0)
        noop = median(noop_walls) or 0.0
    return {
        "recv_copy_wall_s": median(walls),
        "recv_copy_wall_samples": walls,
        "recv_copy_per_actor_s": median(per_actor),
        "recv_copy_driver_s": max(0.0, (median(driver_walls) or 0.0) - noop),
        "empty_call_fanout_s": noop,
        "floor_source": source,
        "floor_cpu_busy_before": cpu_busy,
    }


def measure_copy_floor(
    flat_src: torch.Tensor,
    n: int,
    repeats: int,
    source: str = "shared",
    timeout: float = 300.0,
    *,
    quiet_timeout: float = 5.0,
) -> dict[str, Any]:
    """The whole floor for N receivers: snapshot plus receiver copies, and ``floor_s``, their sum.

    Args:
        flat_src: the model as one flat buffer (``torch.uint8`` of the model's bytes), written.
        n, repeats, source, timeout, quiet_timeout: see :func:`measure_receiver_floor`.

    Example:
        >>> floor = measure_copy_floor(torch.ones(16 * MIB, dtype=torch.uint8), 2, 3)  # doctest: +SKIP
        >>> sorted(k for k in floor if k.endswith("_s"))[:3]  # doctest: +SKIP
        ['empty_call_fanout_s', 'floor_s', 'recv_copy_driver_s']
    """
    floor = measure_snapshot_floor(flat_src, repeats)
    floor.update(
        measure_receiver_floor(flat_src.numel() * flat_src.element_size(), n, repeats, source, timeout)
    )
    floor["floor_s"] = floor["snapshot_copy_s"] + floor["recv_copy_wall_s"]
    return floor


def process_memory() -> dict[str, int]:
    """This process's memory: ``rss``, ``shared`` and ``private`` (RSS minus shared pages), in bytes.

    Call it inside an actor to see whether it holds its own copy of the weights.

    Example:
        >>> process_memory()["rss"] > 0
        True
    """
    import psutil  # a dependency of ray[default]; also in ray/thirdparty_files inside actors

    info = psutil.Process().memory_info()
    shared = int(getattr(info, "shared", 0))
    return {"rss": int(info.rss), "shared": shared, "private": int(info.rss) - shared}


# ---------------------------------------------------------------------- object store


class ObjectStoreGauge:
    """Bytes in use in the object store, as the raylet reports them (``ray memory --stats-only``).

    ``ray.available_resources()["object_store_memory"]`` does not move when objects
    are stored; this reads ``store_stats.object_store_bytes_used`` from the raylet.
    Needs a connected driver.

    Example:
        >>> gauge = ObjectStoreGauge()  # doctest: +SKIP
        >>> before = gauge.settle()  # doctest: +SKIP
        >>> hub.push(model)  # doctest: +SKIP
        >>> gauge.used() - before  # doctest: +SKIP
        16777216
    """

    def used(self) -> int:
        """Bytes in use now."""
        from raysync import _compat

        return _compat.object_store_bytes_used()

    def settle(self, at_most: int | None = None, timeout: float = 10.0, *, poll: float = 0.1) -> int:
        """Bytes in use once Ray's batched frees landed: until ``<= at_most``, or two equal reads.

        Gives up after ``timeout`` seconds and returns the last read.
        """
        deadline = time.monotonic() + timeout
        last = self.used()
        if at_most is not None and last <= at_most:
            return last
        while time.monotonic() < deadline:
            time.sleep(poll)
            now = self.used()
            if (at_most is not None and now <= at_most) or (at_most is None and now == last):
                return now
            last = now
        logger.info("object store did not settle within %.0f s (used %d bytes)", timeout, last)
        return last


def prefault_object_store(capacity: int, fraction: float = 0.9, chunk: int = 128 * MIB) -> float:
    """Fill the object store once and free it, so no timed ``ray.put`` pays first-touch faults.

    A fresh store's shared-memory pages are allocated (and zeroed) by the kernel
    the first time anything writes them, which makes the first few pushes of a
    run several times slower than the steady state a long-running trainer sees.
    Returns the seconds this took.

    Example:
        >>> prefault_object_store(2**30)  # doctest: +SKIP
        0.8
    """
    import ray

    t0 = time.perf_counter()
    block = np.ones(min(chunk, max(MIB, int(capacity * fraction))), dtype=np.uint8)
    held = [ray.put(block) for _ in range(int(capacity * fraction) // block.nbytes)]
    del held, block
    seconds = time.perf_counter() - t0
    logger.info("object store pre-faulted (%.1f GiB) in %.1f s", capacity * fraction / 2**30, seconds)
    return seconds


def put_bytes(tensors: Iterable[torch.Tensor]) -> Any:
    """``ray.put`` of the tensors' bytes (uint8 views, one copy: what a trainer's put costs)."""
    import ray

    return ray.put([t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors])


def typed(like: Iterable[tuple[str, torch.Tensor]], arrays: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of fetched byte ``arrays``, typed and shaped as ``like`` (no copy)."""
    return [
        (k, torch.from_numpy(a).view(t.dtype).reshape(t.shape))
        for (k, t), a in zip(like, arrays, strict=True)
    ]

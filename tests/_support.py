"""Helpers the tests share, in a module of their own (no pytest import).

Actor classes defined in a test file travel to their worker processes by value, but the
functions they call from here travel by reference: each worker imports this module. Kept
apart from ``conftest.py`` (fixtures, which imports pytest), a worker imports torch, Ray
and raysync only, about 0.15 s of CPU less for each of the suite's ~500 worker processes.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

import raysync

RING_ACK_S = 5.0
"""``HubSettings(ring_ack_s=)`` for tests that count how versions arrived (rung or called).

A live subscriber acks a small version in milliseconds, but on a loaded 2-core machine now
and then past the default 0.2 s, and is then called the Ray way as well: a count of calls
that says nothing about the doorbell. One hung for good (wedged by an attacker, say) still
is, 5 s later, and the count shows it."""

PATH_RING_ACK_S = 60.0
"""``HubSettings(ring_ack_s=)`` for tests that assert a version came by doorbell and by no Ray call:
the most the setting allows.

A live subscriber acks a ring in milliseconds, or, when the test holds it (methods running,
which the apply waits for), once the test lets it go: both far within this on any machine,
so no ring these tests count is followed by a call. One that never acks (what they exist to
catch) still fails them: ``hub.wait`` runs out first, or the count shows the call. Not for
tests whose subscribers may die once rung (their rings wait this long before the Ray call
finds them dead); a process killed before the push is no such case: its ring fails at once."""


CLIENT_MARGIN_S = 5.0
"""What a test allows past a bound a client call promises (``wait(timeout=T)`` raises by
``T + ANSWER_GRACE_S``): the client process's own scheduling on a loaded 2-core machine."""


def wait_for_condition(
    predicate: Callable[[], Any], *, timeout: float = 60.0, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``.

    The default bound leaves room for what a loaded 2-core machine stretches (an actor's start,
    imports included, took over 20 s there); it costs nothing unless the condition never comes.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s: {what or predicate} (last: {last!r})")


def kill_until_gone(actor: Any, *, no_restart: bool = True) -> int:
    """``ray.kill`` an actor and return once its process is gone (``ray.kill`` returns before).

    Returns the pid of that process.

    A process still dying can answer calls, rings and queries for a moment; a restartable
    actor (``no_restart=False``) gets a new process afterwards.
    """
    import psutil

    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    ray.kill(actor, no_restart=no_restart)
    wait_for_condition(lambda: not psutil.pid_exists(pid), what=f"process {pid} of the killed actor gone")
    return int(pid)


def mismatched_subscriber(hub_name: str) -> Any:
    """A live subscriber whose model fits none of the tests' pushes (a misfit: the hub hands it none)."""

    @raysync.synced_model("policy", hub=hub_name)
    class Mismatched:
        def __init__(self) -> None:
            self.policy = torch.nn.Linear(3, 3)

        def ready(self) -> bool:
            return True

    bad = ray.remote(num_cpus=0)(Mismatched).remote()
    ray.get(bad.ready.remote(), timeout=60)
    return bad


def small_policy(seed: int = 0, *, out: int = 4) -> torch.nn.Module:
    """A tiny policy with parameters of three dtypes' worth of buffers."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, out))
    return model


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-equal, key for key (compares raw bytes so NaNs and -0.0 count too)."""
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = a[key].detach().contiguous(), b[key].detach().contiguous()
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), key


def raysync_files_in_shm() -> set[str]:
    """Names in /dev/shm that raysync made or would make (other processes on the machine, such
    as the other pytest worker's torch or Ray, come and go there too)."""
    return (
        {n for n in os.listdir("/dev/shm") if n.startswith("raysync")} if os.path.isdir("/dev/shm") else set()
    )


def in_shared_memory(buckets: list[list[np.ndarray]]) -> tuple[mmap.mmap, list[list[np.ndarray]]]:
    """The buckets copied into one shared, writable mapping, as Ray's object store holds them.

    Returns the mapping (the "store": writable, as every Ray process maps the store) and the
    buckets' arrays over it: back to back, read-only for numpy, as ``ray.get`` returns them.
    """
    align = 64
    store = mmap.mmap(-1, sum(a.nbytes + align for b in buckets for a in b) + mmap.PAGESIZE)  # MAP_SHARED
    flat = np.frombuffer(store, dtype=np.uint8)
    out, at = [], 0
    for bucket in buckets:
        arrays = []
        for a in bucket:
            flat[at : at + a.nbytes] = a
            arrays.append(flat[at : at + a.nbytes])
            arrays[-1].flags.writeable = False
            at = (at + a.nbytes + align - 1) // align * align
        out.append(arrays)
    return store, out


def mapping_of(address: int) -> tuple[str, str, int]:
    """``(permissions, device, inode)`` of this process's mapping holding ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms, _offset, device, inode = line.split()[:5]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms, device, int(inode)
    raise AssertionError(f"{address:#x} is in no mapping of this process")


def doorbell_address(self: Any) -> str | None:
    """The address of the doorbell of the process it runs in, if it has one (``actor.__ray_call__``).

    Here rather than in a test module: a worker it runs in imports this light module, not the
    test module's imports (pytest, the other test modules it draws on: seconds of CPU each).
    """
    from raysync.transports import doorbell

    bell = doorbell.doorbell()
    return None if bell is None else bell.address

"""Shared fixtures: one small local Ray cluster per test session, one hub per test."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch

import raysync

# Ray starts its workers at nice 15: on a 2-core machine, the test process (nice 0) then
# starves every actor it waits for (importing torch in a new actor took 8 s instead of 2.5 s
# while a test pushed). Clusters the tests start (here, and ``ray start`` in system tests,
# which inherit the environment) run their workers at the tests' own priority.
os.environ.setdefault("RAY_worker_niceness", "0")

OBJECT_STORE_BYTES = 1536 * 2**20  # keep the suite inside a 2-core, 24 GiB machine


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the NIXL tests last: once a process has used NIXL, its agent's UCX progress thread
    keeps one core busy for the rest of that process's life (measured: 100% of a core while
    idle), so every test after them would run on one core fewer (about 3 minutes of the suite)."""
    items.sort(key=lambda item: "test_nixl.py" in str(item.fspath))  # stable: order kept otherwise


def wait_for_condition(
    predicate: Callable[[], Any], *, timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s: {what or predicate} (last: {last!r})")


@pytest.fixture(scope="session")
def ray_start_regular() -> Iterator[dict[str, Any]]:
    """A local Ray cluster shared by the session (4 logical CPUs, 1.5 GiB object store)."""
    if ray.is_initialized():
        ray.shutdown()
    info = ray.init(
        address="local",  # always a cluster of our own, never one another process started
        num_cpus=4,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        logging_level="warning",
        log_to_driver=False,
    )
    yield dict(info.address_info)
    ray.shutdown()


@pytest.fixture
def hub_name(ray_start_regular: dict[str, Any]) -> str:
    """A fresh hub name per test, so tests never see each other's versions."""
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def hub(hub_name: str) -> Iterator[raysync.HubClient]:
    client = raysync.connect(hub_name)
    yield client
    ray.kill(client.actor)


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
    """A live subscriber whose model fits none of the tests' pushes (the hub refuses them)."""

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

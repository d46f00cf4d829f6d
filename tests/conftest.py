"""Shared fixtures: one small local Ray cluster per test session, one hub per test."""

from __future__ import annotations

import multiprocessing
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import ray

import raysync
from raysync._protocol import DEFAULT_NAMESPACE
from raysync.hub.locate import get_hub_actor

# Ray starts its workers at nice 15: on a 2-core machine, the test process (nice 0) then
# starves every actor it waits for (importing torch in a new actor took 8 s instead of 2.5 s
# while a test pushed). Clusters the tests start (here, and ``ray start`` in system tests,
# which inherit the environment) run their workers at the tests' own priority.
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray's log monitor rescans the session's log directory every 0.1 s while it holds fewer than
# RAY_LOG_MONITOR_MANY_FILES_THRESHOLD files: with the suite's hundreds of worker logs, a busy
# loop on a 2-core machine (and nothing reads what it forwards: log_to_driver=False). With the
# threshold at 0 it rescans every LOG_NAME_UPDATE_INTERVAL_S.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")

OBJECT_STORE_BYTES = 1536 * 2**20  # keep the suite inside a 2-core, 24 GiB machine


# `make test` runs the suite on two pytest-xdist workers, a file at a time (`--dist loadfile
# --no-loadscope-reorder`): each worker takes the next file in this order. The files that cost
# the most go first, so the two workers end together (longest first); ordered by the seconds
# each file took in a suite run on the 2-core machine (two workers), most first. Files not
# named keep their order after these (none of them takes 15 s).
#
# The NIXL tests are among them, no longer last: a process that used NIXL keeps its agent's
# UCX progress thread polling for the rest of its life (a full core), but while they run
# `tests/_busy_threads.py` sets such threads to nice 19, so from then on they take only CPU
# that nothing else wants.
_HEAVIEST_FIRST = (
    "integration/test_reliability.py",
    "integration/test_reliability_cases.py",
    "integration/test_nixl.py",
    "integration/test_synced.py",
    "system/test_cli.py",
    "integration/test_sharded.py",
    "integration/test_torchrl_collectors_hub.py",
    "integration/test_relay.py",
    "integration/test_security.py",
    "integration/test_doorbell.py",
    "integration/test_fencing_restart.py",
    "integration/test_newcomer.py",
    "integration/test_torchrl_collectors_schemes.py",
    "system/test_job.py",
    "system/test_ray_shutdown.py",
    "integration/test_targets.py",
    "system/test_scale.py",
    "integration/test_async_controls.py",
    "integration/test_hub.py",
    "integration/test_local_changes.py",
)


def _order(item: pytest.Item) -> int:
    path = str(item.fspath)
    for rank, name in enumerate(_HEAVIEST_FIRST):
        if path.endswith(name):
            return rank
    return len(_HEAVIEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heaviest files first (see ``_HEAVIEST_FIRST``)."""
    items.sort(key=_order)  # stable: a file's tests keep their order


@pytest.fixture(scope="module")
def torchrl_workers_from_a_forkserver(ray_start_regular: dict[str, Any]) -> Iterator[None]:
    """torchrl's process collectors start their workers from a forkserver that has torchrl imported.

    torchrl honours a start method the user set (``mp.set_start_method``, as its docs say). With
    its default, spawn, every worker imports torch and torchrl afresh (about 3 s of CPU on the
    2-core machine); the torchrl files start dozens. The server keeps the environment it
    started with, for the rest of the pytest process: the session's Ray cluster is up before it
    starts (workers that follow a hub find the cluster and its token there), and a test whose
    workers read a variable it sets takes ``torchrl_workers_spawned``, torchrl's default.
    """
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_forkserver_preload(["torchrl.collectors", "raysync", "tests._torchrl_workers"])
    multiprocessing.set_start_method("forkserver", force=True)
    yield
    multiprocessing.set_start_method(before, force=True)


@pytest.fixture
def torchrl_workers_spawned() -> Iterator[None]:
    """torchrl's default start method, spawn, for one test (see ``torchrl_workers_from_a_forkserver``)."""
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)
    yield
    multiprocessing.set_start_method(before, force=True)


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


# A hub per test keeps tests apart, but its process takes a second or two of CPU to start on the
# 2-core machine (about 200 tests take one). So the ``hub`` fixture starts the hub of the test
# that comes next in the same file (same ``HUB_SETTINGS``) while this one runs, and that test
# finds it up: ``_started_ahead`` maps a test's node id to the name of the hub started for it.
# It is a hub like any other (a fresh name, no versions, no subscribers); one a test does not
# take (it failed to start, say) is stopped when its file ends.
_started_ahead: dict[str, str] = {}
_next_item: dict[str, pytest.Item | None] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Remember which test runs next (the ``hub`` fixture starts its hub ahead)."""
    _next_item[item.nodeid] = nextitem
    try:
        return (yield)
    finally:
        _next_item.pop(item.nodeid, None)


def _fresh_hub_name() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def _start_hub_for_next_test(item: pytest.Item) -> None:
    nextitem = _next_item.get(item.nodeid)
    if nextitem is None or "hub" not in getattr(nextitem, "fixturenames", ()):
        return
    if getattr(nextitem, "module", None) is not getattr(item, "module", None):
        return  # another file: other HUB_SETTINGS, and this file's end stops what it started
    name = _fresh_hub_name()
    get_hub_actor(name, settings=getattr(item.module, "HUB_SETTINGS", None))  # returns at once
    _started_ahead[nextitem.nodeid] = name


@pytest.fixture(scope="module", autouse=True)
def _stop_hubs_started_ahead() -> Iterator[None]:
    """Stop a hub started ahead for a test that never took it (it was deselected, say)."""
    yield
    for nodeid in list(_started_ahead):
        name = _started_ahead.pop(nodeid)
        if ray.is_initialized():
            try:
                ray.kill(ray.get_actor(name, namespace=DEFAULT_NAMESPACE))
            except ValueError:
                pass  # never created, or gone already


@pytest.fixture
def hub_name(request: pytest.FixtureRequest, ray_start_regular: dict[str, Any]) -> str:
    """A fresh hub name per test, so tests never see each other's versions.

    A test that takes the ``hub`` fixture gets the name of the hub started for it ahead,
    if the test before it started one.
    """
    if "hub" in request.fixturenames and request.node.nodeid in _started_ahead:
        return _started_ahead.pop(request.node.nodeid)
    return _fresh_hub_name()


@pytest.fixture
def hub(request: pytest.FixtureRequest, hub_name: str) -> Iterator[raysync.HubClient]:
    """A fresh hub, with the test module's ``HUB_SETTINGS`` if it has them."""
    client = raysync.connect(hub_name, settings=getattr(request.module, "HUB_SETTINGS", None))
    _start_hub_for_next_test(request.node)
    yield client
    ray.kill(client.actor)

"""Shared fixtures: one small local Ray cluster per test session, one hub per test."""

from __future__ import annotations

import logging
import multiprocessing
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import ray

import raysync
from raysync._protocol import DEFAULT_NAMESPACE
from raysync.client.locate import get_hub_actor

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
# 2-core machine (about 200 tests take one). So as each test starts, the hubs of the next tests of
# the same file that take the ``hub`` fixture (same ``HUB_SETTINGS``) are started, and those tests
# find them up: ``_started_ahead`` maps a test's node id to the name of the hub started for it.
# It is a hub like any other (a fresh name, no versions, no subscribers); one a test does not
# take (it was not run, say) is stopped when its file ends. With `--dist loadfile` a file's
# tests all run on one worker, in order. A file whose fixtures create the test's hub themselves,
# with settings of their own, sets ``HUBS_STARTED_AHEAD = False`` (a hub keeps the settings it
# was created with: a test that connects to one started ahead with other settings fails, below).
_started_ahead: dict[str, str] = {}
_given_out: set[str] = set()  # names of hubs started ahead that a test took


class _SettingsLost(logging.Handler):
    """Records ``connect()``'s warning that a hub started ahead keeps other settings than asked."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hubs: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "created with other settings" in str(record.msg) and record.args:
            name = record.args[0] if isinstance(record.args, tuple) else None
            if name in _given_out:
                self.hubs.append(str(name))


def _fresh_hub_name() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


HUBS_AHEAD = 2  # a file's short tests (a second each) would otherwise wait for the hub ahead


def _next_hub_tests(item: pytest.Item) -> list[pytest.Item]:
    """The next ``HUBS_AHEAD`` tests of ``item``'s file, after it, that take the ``hub`` fixture."""
    items = item.session.items
    try:
        at = items.index(item)
    except ValueError:
        return []
    found: list[pytest.Item] = []
    for later in items[at + 1 :]:
        if later.path != item.path or len(found) == HUBS_AHEAD:
            break
        if "hub" in getattr(later, "fixturenames", ()):
            found.append(later)
    return found


def _start_hub_ahead(item: pytest.Item) -> None:
    """Start the hubs of the next tests of this file that take ``hub``, those not started yet."""
    if not ray.is_initialized() or not getattr(item.module, "HUBS_STARTED_AHEAD", True):
        return
    for later in _next_hub_tests(item):
        if later.nodeid not in _started_ahead:
            name = _fresh_hub_name()
            get_hub_actor(name, settings=getattr(item.module, "HUB_SETTINGS", None))  # returns at once
            _started_ahead[later.nodeid] = name


@pytest.fixture(autouse=True)
def _hub_of_the_next_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """As a test starts, the hubs of the next tests that take one start too (see above)."""
    _start_hub_ahead(request.node)
    lost = _SettingsLost()
    logger = logging.getLogger("raysync.client.connect")
    logger.addHandler(lost)
    try:
        yield
    finally:
        logger.removeHandler(lost)
    assert not lost.hubs, (
        f"hub(s) {lost.hubs} were started ahead with the file's HUB_SETTINGS, but a fixture of this "
        "test connected to them with settings of its own: set HUBS_STARTED_AHEAD = False in the file"
    )


@pytest.fixture(scope="module", autouse=True)
def _stop_hubs_started_ahead() -> Iterator[None]:
    """Stop a hub started ahead for a test that never took it."""
    yield
    for nodeid in list(_started_ahead):
        name = _started_ahead.pop(nodeid)
        if ray.is_initialized():
            try:
                ray.kill(ray.get_actor(name, namespace=DEFAULT_NAMESPACE))
            except ValueError:
                pass  # gone already (its cluster was shut down and started again, say)


@pytest.fixture
def hub_name(request: pytest.FixtureRequest, ray_start_regular: dict[str, Any]) -> str:
    """A fresh hub name per test, so tests never see each other's versions.

    A test that takes the ``hub`` fixture gets the name of the hub started for it ahead,
    if the test before it started one.
    """
    if "hub" in request.fixturenames and request.node.nodeid in _started_ahead:
        name = _started_ahead.pop(request.node.nodeid)
        _given_out.add(name)
        return name
    return _fresh_hub_name()


@pytest.fixture
def hub(request: pytest.FixtureRequest, hub_name: str) -> Iterator[raysync.HubClient]:
    """A fresh hub, with the test module's ``HUB_SETTINGS`` if it has them."""
    client = raysync.connect(hub_name, settings=getattr(request.module, "HUB_SETTINGS", None))
    _start_hub_ahead(request.node)  # the session's Ray is up now, if this file's first test
    yield client
    ray.kill(client.actor)

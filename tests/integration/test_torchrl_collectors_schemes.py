"""raysync.schemes handed to torchrl 0.14's own collectors, as torchrl's docs wire a scheme.

Every policy is Linear(weight 0, bias b): each action equals b, so a batch
shows which weights its worker acted with. Skips without torchrl.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl")

from torchrl.collectors import AsyncCollector, Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.weight_update import WeightSyncScheme as TorchRLScheme

import raysync
from raysync import schemes
from tests._support import wait_for_condition
from tests._torchrl_workers import (
    FORWARDS_ENV,
    SLOW_ENV,
    actions,
    forward_in_progress,
    make_env,
    policy,
    wide_policy,
)

TIMEOUT = 60.0
PROCESS_COLLECTORS = [MultiSyncCollector, MultiAsyncCollector, AsyncCollector]
PROCESS_SCHEMES = [schemes.MultiProcessWeightSyncScheme, schemes.SharedMemWeightSyncScheme]


# torchrl's workers start from a forkserver with torchrl imported (tests/conftest.py), but for
# test_worker_that_falls_behind_makes_the_update_raise: its workers read an environment variable
# set during the test, which a forkserver started before would not pass on.
pytestmark = pytest.mark.usefixtures("torchrl_workers_from_a_forkserver")


def _collector(cls: type, scheme: Any, *, workers: int = 2, **kwargs: Any) -> Any:
    """A process collector: AsyncCollector has one worker, the Multi* ones ``workers`` (each a
    spawned process that imports torchrl: about 3 s of CPU)."""
    envs = make_env if cls is AsyncCollector else [make_env] * workers
    return cls(envs, frames_per_batch=8, total_frames=-1, weight_sync_schemes={"policy": scheme}, **kwargs)


def _set_bias(module: Any, value: float) -> None:
    with torch.no_grad():
        module.module.bias.fill_(value)


def _until(it: Iterator[Any], value: float, *, within: int, old: float | None = None) -> None:
    """Within ``within`` batches every batch acts with ``value``, and so do the next two.

    The batches read before hold ``old``, ``value`` or both (a batch collected while a
    worker applied the version changes from one to the other at one step).
    """
    seen = [actions(next(it)) for _ in range(within)]
    if old is not None:
        assert all(batch <= {old, value} for batch in seen), seen
    assert [actions(next(it)) for _ in range(2)] == [{value}, {value}], seen


# Each process collector with one of the schemes, each scheme with two collectors (and both
# schemes again below, with MultiSyncCollector): every pairing spawns its own torchrl worker
# processes (3-4 s of CPU each), and the scheme's side does not depend on which collector calls it.
PAIRS = [
    (MultiSyncCollector, schemes.MultiProcessWeightSyncScheme),
    (MultiAsyncCollector, schemes.SharedMemWeightSyncScheme),
    (AsyncCollector, schemes.MultiProcessWeightSyncScheme),
    (AsyncCollector, schemes.SharedMemWeightSyncScheme),
]


@pytest.mark.parametrize(("collector_cls", "scheme_cls"), PAIRS, ids=lambda c: c.__name__)
def test_process_schemes_with_process_collectors(collector_cls: type, scheme_cls: type) -> None:
    scheme = scheme_cls(timeout=TIMEOUT)
    assert isinstance(scheme, TorchRLScheme)
    trained = policy(1.0)
    collector = _collector(collector_cls, scheme, policy=trained)
    try:
        it = iter(collector)
        # the workers got a weightless (meta) policy: the first version made it usable
        assert actions(next(it)) == {1.0}
        # sync collectors act with the new weights from the next batch; async ones once the
        # batches collected before or during the update are read (at most two per worker)
        workers = 1 if collector_cls is AsyncCollector else 2
        bound = 0 if collector_cls is MultiSyncCollector else 2 * workers
        _set_bias(trained, 2.0)
        collector.update_policy_weights_()
        _until(it, 2.0, within=bound, old=1.0)
        collector.update_policy_weights_(policy(3.0))  # explicit weights
        _until(it, 3.0, within=bound, old=2.0)
    finally:
        collector.shutdown()


def test_process_scheme_with_policy_factory() -> None:
    # workers build their own policy; torchrl's policy= is then the source of the weights
    trained = policy(5.0)
    scheme = schemes.SharedMemWeightSyncScheme(timeout=TIMEOUT)
    collector = _collector(
        MultiSyncCollector, scheme, policy=trained, policy_factory=functools.partial(policy, 0.0)
    )
    try:
        it = iter(collector)
        _until(it, 5.0, within=1, old=0.0)  # the first version replaces the factory's weights
        collector.update_policy_weights_(policy(6.0))
        assert actions(next(it)) == {6.0}
    finally:
        collector.shutdown()


@pytest.mark.parametrize("scheme_cls", PROCESS_SCHEMES, ids=lambda c: c.__name__)
def test_distinct_policy_factories_keep_their_own_weights_until_sent_their_own(scheme_cls: type) -> None:
    # torchrl's per-worker weights: worker i builds its policy from its own factory
    scheme = scheme_cls(timeout=TIMEOUT)
    factories = [functools.partial(policy, float(i)) for i in range(2)]
    collector = MultiSyncCollector(
        [make_env] * 2,
        policy_factory=factories,
        frames_per_batch=8,
        total_frames=-1,
        cat_results="stack",
        weight_sync_schemes={"policy": scheme},
    )
    try:
        it = iter(collector)
        assert [actions(b) for b in next(it)] == [{0.0}, {1.0}]
        assert scheme.per_worker_weights  # detected, as torchrl's scheme does
        collector.update_policy_weights_({0: policy(10.0)})  # one worker's own weights
        assert [actions(b) for b in next(it)] == [{10.0}, {1.0}]
        collector.update_policy_weights_({0: policy(20.0), 1: policy(11.0)})  # each its own
        assert [actions(b) for b in next(it)] == [{20.0}, {11.0}]
    finally:
        collector.shutdown()


def test_no_weight_sync_scheme_is_a_no_op_with_every_collector() -> None:
    none = schemes.NoWeightSyncScheme()
    assert isinstance(none, TorchRLScheme)
    local = policy(1.0)
    collector = Collector(
        make_env, local, frames_per_batch=8, total_frames=-1, weight_sync_schemes={"policy": none}
    )
    try:
        it = iter(collector)
        assert actions(next(it)) == {1.0}
        collector.update_policy_weights_(policy(9.0))  # nothing to send: the collector acts in-process
        _set_bias(local, 2.0)
        assert actions(next(it)) == {2.0}
    finally:
        collector.shutdown()
    for cls in PROCESS_COLLECTORS:
        remote = _collector(
            cls, schemes.NoWeightSyncScheme(), workers=1, policy_factory=functools.partial(policy, 4.0)
        )
        try:
            it = iter(remote)
            assert actions(next(it)) == {4.0}
            remote.update_policy_weights_(policy(9.0))  # a no-op, as torchrl's
            _until(it, 4.0, within=2, old=4.0)
        finally:
            remote.shutdown()


def test_unsupported_pairings_say_what_to_use() -> None:
    with pytest.raises(ValueError, match="NoWeightSyncScheme there"):
        Collector(
            make_env,
            policy(1.0),
            frames_per_batch=8,
            total_frames=-1,
            weight_sync_schemes={"policy": schemes.MultiProcessWeightSyncScheme()},
        )
    # a worker's own error reaches the caller: NoWeightSync cannot fill the meta policy torchrl sends
    with pytest.raises(ValueError, match="cannot fill the weightless"):
        _collector(AsyncCollector, schemes.NoWeightSyncScheme(), policy=policy(1.0))


# ------------------------------------------------------------------ never silent


def test_workers_that_refuse_a_version_make_the_update_raise() -> None:
    scheme = schemes.MultiProcessWeightSyncScheme(timeout=TIMEOUT)
    trained = policy(1.0)
    collector = _collector(MultiSyncCollector, scheme, policy=trained)
    try:
        it = iter(collector)
        assert actions(next(it)) == {1.0}
        with pytest.raises(raysync.ApplyError, match=r"worker 0: .*worker 1: .*missing keys") as info:
            collector.update_policy_weights_(wide_policy(7.0))
        assert sorted(f["subscriber"] for f in info.value.failures) == [0, 1]
        assert actions(next(it)) == {1.0}  # whole or nothing: the previous version stays
        collector.update_policy_weights_(policy(2.0))
        assert actions(next(it)) == {2.0}
    finally:
        collector.shutdown()


def test_worker_whose_first_version_fails_is_reported_by_the_next_update() -> None:
    # the workers' own policies (policy_factory) do not fit the trained one
    scheme = schemes.MultiProcessWeightSyncScheme(timeout=TIMEOUT)
    collector = _collector(
        AsyncCollector, scheme, policy=policy(1.0), policy_factory=functools.partial(wide_policy, 0.0)
    )
    try:
        with pytest.raises(raysync.ApplyError, match=r"worker 0: .*WeightMismatchError"):
            collector.update_policy_weights_()
    finally:
        collector.shutdown()


def test_unreachable_worker_makes_the_update_raise_naming_it() -> None:
    scheme = schemes.SharedMemWeightSyncScheme(timeout=5.0)
    collector = _collector(MultiSyncCollector, scheme, policy=policy(1.0))
    try:
        assert actions(next(iter(collector))) == {1.0}
        collector.procs[1].kill()
        collector.procs[1].join(TIMEOUT)
        with pytest.raises((raysync.SyncTimeoutError, raysync.ApplyError), match="worker 1"):
            collector.update_policy_weights_(policy(2.0))
    finally:
        collector.shutdown()


def test_worker_that_falls_behind_makes_the_update_raise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, torchrl_workers_spawned: None
) -> None:
    # each forward of the workers' policy takes 3 s: an apply waits for the forward in progress
    monkeypatch.setenv(SLOW_ENV, "3")
    forwards = tmp_path / "forwards.log"
    monkeypatch.setenv(FORWARDS_ENV, str(forwards))
    scheme = schemes.MultiProcessWeightSyncScheme(timeout=0.5)
    collector = MultiAsyncCollector(
        [make_env],
        policy=policy(1.0, sleepy=True),
        frames_per_batch=1,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    try:
        it = iter(collector)
        next(it)
        # Updated while a forward runs with over 2 s left (between two forwards the worker
        # would apply at once): the 0.5 s timeout runs out first.
        wait_for_condition(
            lambda: forward_in_progress(str(forwards), started_within=1.0),
            timeout=30,
            interval=0.01,
            what="the worker inside a forward",
        )
        with pytest.raises(raysync.SyncTimeoutError, match="worker 0") as info:
            collector.update_policy_weights_(policy(2.0))
        assert [lag["subscriber"] for lag in info.value.laggards] == [0]
    finally:
        os.environ[SLOW_ENV] = "0"
        collector.shutdown()


# ------------------------------------------------------------------ Ray


def test_ray_schemes_with_ray_collector(ray_start_regular: dict[str, Any]) -> None:
    from torchrl.collectors.distributed import RayCollector

    trained = policy(1.0)
    scheme = schemes.RayWeightSyncScheme(timeout=TIMEOUT)
    collector = RayCollector(
        [make_env, make_env],
        policy=trained,
        frames_per_batch=8,
        total_frames=100_000,
        weight_sync_schemes={"policy": scheme},
        remote_configs={"num_cpus": 0},
    )
    try:
        collector.update_policy_weights_()  # torchrl's first sync, before iterating
        it = iter(collector)
        assert actions(next(it)) == {1.0}
        _set_bias(trained, 2.0)
        collector.update_policy_weights_()
        # the actors apply between two of their tasks; batches collected before drain first
        _until(it, 2.0, within=4, old=1.0)
        collector.update_policy_weights_(policy(3.0))  # explicit weights
        _until(it, 3.0, within=4, old=2.0)
        with pytest.raises(raysync.ApplyError, match="missing keys"):
            collector.update_policy_weights_(wide_policy(4.0))
        _until(it, 3.0, within=0)
    finally:
        collector.shutdown(shutdown_ray=False)
    none = RayCollector(
        [make_env],
        policy_factory=functools.partial(policy, 4.0),
        frames_per_batch=8,
        total_frames=100_000,
        weight_sync_schemes={"policy": schemes.NoWeightSyncScheme()},
        remote_configs={"num_cpus": 0},
    )
    try:
        it = iter(none)
        assert actions(next(it)) == {4.0}
        none.update_policy_weights_(policy(9.0))  # a no-op
        assert actions(next(it)) == {4.0}
    finally:
        none.shutdown(shutdown_ray=False)

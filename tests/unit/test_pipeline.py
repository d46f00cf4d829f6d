"""The receiver pipeline without Ray: one Applier, versions from buckets at hand (a doorbell's)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import raysync
from raysync.receivers.pipeline import Applier, Prepared
from raysync.receivers.target import ModuleTarget
from tests._support import assert_same_weights, small_policy
from tests.unit.test_targets import Engine, _version


def _prepare(applier: Applier, seed: int) -> Prepared:
    _, incoming = _version(seed)
    buckets = [incoming.buckets[b] for b in range(incoming.manifest.num_buckets)]
    step = applier.prepare(seed, incoming.manifest, [], at_hand=buckets, ids=list(incoming.ids))
    assert isinstance(step, Prepared), step
    return step


def test_an_applier_commits_under_its_guard_in_order_and_reports() -> None:
    policy, held = small_policy(0), []

    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        held.append("in")
        yield
        held.append("out")

    applier = Applier(ModuleTarget(policy), verify=False, timeout=None, label="test", guard=guard)
    second, third = _prepare(applier, 2), _prepare(applier, 3)
    assert held == []  # planning and fetching take no lock
    assert applier.commit(third).applied == 3 and held == ["in", "out"]
    assert applier.commit(second).applied == 3  # an older version after a newer one: nothing changes
    assert_same_weights(policy.state_dict(), small_policy(3).state_dict())
    skipped = applier.prepare(3, third.manifest, [], at_hand=[], ids=third.ids)
    assert not isinstance(skipped, Prepared) and skipped.skipped == 3


def test_a_commit_that_tears_the_target_leaves_the_applier_holding_nothing() -> None:
    engine = Engine()
    calls = {"n": 0}

    def load(weights: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("engine busy")
        engine.load_weights(weights)

    applier = Applier(raysync.WeightsLoader(load), verify=False, timeout=None, label="test")
    assert applier.commit(_prepare(applier, 1)).applied == 1
    report = applier.commit(_prepare(applier, 2))
    assert report.failed == 2 and report.applied is None and applier.version is None
    assert "engine busy" in report.error_text()
    assert applier.commit(_prepare(applier, 3)).applied == 3  # the next version goes in whole

"""One actor whose model does not fit its model id's versions is its own error, not the fleet's
(issue 48, item 1): pushes go on, the others receive every version, status says why."""

from __future__ import annotations

import functools
import io
import pathlib
from typing import Any

import pytest
import ray
import torch

import raysync
from raysync.ops import cli
from tests._support import assert_same_weights, small_policy, wait_for_condition
from tests.integration.test_synced import make_collector

MISFIT = "shape mismatch 2.weight: pushed (4, 16), model (3, 16)"


def _misfit_policy() -> torch.nn.Module:
    return small_policy(9, out=3)  # Linear(16, 3) where the fleet's last layer is Linear(16, 4)


def _policy_by_marker(marker: str) -> torch.nn.Module:
    """The wrong model until ``marker`` exists (an actor restarted with the right one)."""
    return small_policy(9) if pathlib.Path(marker).exists() else _misfit_policy()


def _row(hub: raysync.HubClient, actor: Any) -> dict[str, Any] | None:
    rows = [r for r in hub.status()["subscribers"] if r["actor_id"] == actor._actor_id.hex()]
    return rows[0] if rows else None


def test_a_misfit_actor_does_not_stop_the_fleets_pushes(hub: raysync.HubClient, hub_name: str) -> None:
    good = make_collector(hub_name).remote()
    ray.get(good.raysync_version.remote())
    assert hub.push(small_policy(1), wait=True, timeout=60) == 1
    bad = make_collector(hub_name, _misfit_policy).remote()  # the same model id, another model
    own = ray.get(bad.weights.remote())
    for expected in (2, 3, 4):
        src = small_policy(expected)
        assert hub.push(src, wait=True, timeout=60) == expected  # returns: the misfit is not waited for
        assert hub.latest() == expected
        assert ray.get(good.raysync_version.remote()) == expected
        assert_same_weights(ray.get(good.weights.remote()), src.state_dict())
    assert hub.push(small_policy(5), max_lag=1, timeout=60) == 5  # max_lag does not count it either
    assert ray.get(bad.raysync_version.remote()) is None
    assert_same_weights(ray.get(bad.weights.remote()), own)
    row = _row(hub, bad)
    assert row is not None and MISFIT in row["misfit"]
    out = io.StringIO()
    cli.render_status(hub.status(), file=out)  # what `raysync status` prints
    words = " ".join(out.getvalue().split())
    assert "misfit" in words and MISFIT in words
    # A wait that counts it (the two collectors created) can never end: it says so at once.
    with pytest.raises(raysync.WeightMismatchError, match=rf"{bad._actor_id.hex()}.*{MISFIT[:20]}"):
        hub.wait(5, timeout=60, subscribers=2)


def test_a_misfit_from_before_the_first_push_becomes_normal_when_restarted_with_the_right_model(
    hub: raysync.HubClient, hub_name: str, tmp_path: pathlib.Path
) -> None:
    marker = tmp_path / "right-model"
    good = make_collector(hub_name).remote()
    Restartable = make_collector(hub_name, functools.partial(_policy_by_marker, str(marker)))
    bad = Restartable.options(max_restarts=1).remote()
    ray.get([good.raysync_version.remote(), bad.raysync_version.remote()])
    v = hub.push(small_policy(1), wait=True, timeout=60)  # the first version fits one: it is published
    assert ray.get(good.raysync_version.remote()) == v and ray.get(bad.raysync_version.remote()) is None
    assert MISFIT in (_row(hub, bad) or {}).get("misfit", "")
    marker.touch()
    ray.kill(bad, no_restart=False)  # restarts (same actor, same subscription) with the right model
    wait_for_condition(
        lambda: (_row(hub, bad) or {"misfit": "?"})["misfit"] is None,
        timeout=60,
        what="the restarted actor registered with a model that fits",
    )
    src = small_policy(2)
    v = hub.push(src, wait=True, timeout=60)
    hub.wait(v, timeout=60, subscribers=2)  # counted and waited for again
    assert_same_weights(ray.get(bad.weights.remote()), src.state_dict())


def test_a_push_that_does_not_fit_the_established_layout_is_refused_without_subscribers(
    hub: raysync.HubClient,
) -> None:
    v = hub.push(small_policy(1))
    with pytest.raises(
        raysync.WeightMismatchError, match=r"shape mismatch 2\.weight.*no version was published"
    ):
        hub.push(small_policy(2, out=5))
    renamed = dict(small_policy(2).state_dict())
    renamed["extra"] = torch.ones(1)
    with pytest.raises(raysync.WeightMismatchError, match=r"unexpected keys \['extra'\]") as info:
        hub.push(renamed, wait=True, timeout=30)
    assert "an earlier push" not in str(info.value)
    assert hub.latest() == v
    partial = small_policy(3)
    newer = hub.push(partial, keys=["2.*"])  # a keys= push fits: the other keys as before
    assert newer > v and hub.latest() == newer  # (refused numbers are never handed out again)

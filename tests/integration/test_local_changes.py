"""Weights an actor's own code changes in place (issue 27, items 5 and 6).

A subscriber keeps saying which version it applied, and says (its actor, the hub's
status) when its own code changed those weights since: a BatchNorm left in training
mode, an optimizer step. The next version applied clears it and restores the weights.
An actor with several synced models must say which one it asks about.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import ray
import torch

import raysync
from tests._support import assert_same_weights, wait_for_condition


def bn_policy(seed: int = 0) -> torch.nn.Module:
    """A tiny policy with a BatchNorm (running statistics) between its layers."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )


class _Records(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def make_rollout(hub_name: str, *, eval_mode: bool = False, **opts: Any) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name, **opts)
    class Rollout:
        def __init__(self) -> None:
            self.logged: list[str] = []  # raysync's warnings in this actor (it registers after __init__)
            logging.getLogger("raysync").addHandler(_Records(self.logged))
            self.policy = bn_policy()
            if eval_mode:
                self.policy.eval()

        def act(self) -> tuple[int | None, int | None]:
            with torch.inference_mode():
                self.policy(torch.randn(5, 8))
            return self.raysync_version(), self.raysync_modified_since()

        def held(self) -> tuple[int | None, int | None]:
            return self.raysync_version(), self.raysync_modified_since()

        def weights(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.policy.state_dict().items()}

        def warnings(self) -> list[str]:
            return list(self.logged)

    return Rollout


def _row(hub: raysync.HubClient) -> dict[str, Any]:
    (row,) = hub.status()["subscribers"]
    return row


def test_a_batchnorm_in_training_mode_is_reported_as_modified_until_the_next_version(
    hub: raysync.HubClient, hub_name: str
) -> None:
    actor = make_rollout(hub_name).remote()
    assert ray.get(actor.held.remote(), timeout=60) == (None, None)
    # one bucket per tensor, and delta pushes: a version that leaves the BatchNorm's buckets as
    # they were must still undo what the actor's forward changed in them
    v1 = hub.push(bn_policy(1), wait=True, timeout=60, bucket_bytes=64, delta=True)
    assert ray.get(actor.held.remote()) == (v1, None)

    assert ray.get(actor.act.remote()) == (v1, v1)  # still says v1 applied, and "modified since v1"
    wait_for_condition(lambda: _row(hub)["modified_since"] == v1, what="the hub learns it by heartbeat")
    assert _row(hub)["applied"] == v1

    src = bn_policy(1)
    with torch.no_grad():
        src[3].weight.add_(1.0)  # only the last layer changes: the BatchNorm's buckets are re-used
    v2 = hub.push(src, wait=True, timeout=60, bucket_bytes=64, delta=True)
    assert ray.get(actor.held.remote()) == (v2, None)
    assert_same_weights(ray.get(actor.weights.remote()), src.state_dict())  # running stats restored
    assert _row(hub)["modified_since"] is None and _row(hub)["applied"] == v2

    ray.get([actor.act.remote() for _ in range(3)])
    warnings = ray.get(actor.warnings.remote())
    registration = [w for w in warnings if "is in training mode" in w]
    assert len(registration) == 1, warnings  # one warning at registration, not one per version
    assert "'1' (BatchNorm1d)" in registration[0] and "self.policy.eval()" in registration[0]
    assert "allow_train_mode=True" in registration[0]
    changed = [w for w in warnings if "were changed in place since version" in w]
    assert len(changed) == 1, warnings  # and the first change seen is logged once


def test_a_rollout_actor_in_eval_mode_is_neither_flagged_nor_warned(
    hub: raysync.HubClient, hub_name: str
) -> None:
    evaluator = make_rollout(hub_name, eval_mode=True).remote()
    ray.get(evaluator.held.remote(), timeout=60)
    v = hub.push(bn_policy(2), wait=True, timeout=60)
    assert ray.get([evaluator.act.remote() for _ in range(3)])[-1] == (v, None)
    # a subscriber that is flagged, in the same status: the hub has had the heartbeats
    flagged = make_rollout(hub_name).remote()
    ray.get(flagged.act.remote(), timeout=60)
    wait_for_condition(
        lambda: any(s["modified_since"] == v for s in hub.status()["subscribers"]), what="one flagged"
    )
    rows = {s["subscriber"].split(":")[0]: s for s in hub.status()["subscribers"]}
    own_id = ray.get(evaluator.__ray_call__.remote(lambda self: ray.get_runtime_context().get_actor_id()))
    assert rows[own_id]["modified_since"] is None and rows[own_id]["applied"] == v
    assert ray.get(evaluator.warnings.remote()) == []


def test_allow_train_mode_keeps_training_mode_without_warnings_but_still_reports(
    hub: raysync.HubClient, hub_name: str
) -> None:
    actor = make_rollout(hub_name, allow_train_mode=True).remote()
    ray.get(actor.held.remote(), timeout=60)
    v = hub.push(bn_policy(3), wait=True, timeout=60)
    assert ray.get(actor.act.remote()) == (v, v)
    wait_for_condition(lambda: _row(hub)["modified_since"] == v, what="reported by heartbeat")
    assert ray.get(actor.warnings.remote()) == []


def test_raysync_version_on_an_actor_with_two_models_needs_a_model_id(
    hub: raysync.HubClient, hub_name: str
) -> None:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("critic", model_id="critic", hub=hub_name)
    @raysync.synced_model("actor", model_id="actor", hub=hub_name)
    class ActorCritic:
        def __init__(self) -> None:
            self.actor = torch.nn.Linear(8, 4)
            self.critic = torch.nn.Linear(8, 1)

        def ready(self) -> bool:
            return True

    ac = ActorCritic.remote()
    ray.get(ac.ready.remote(), timeout=60)
    va = hub.push(torch.nn.Linear(8, 4), "actor", wait=True, timeout=60)
    for method in (ac.raysync_version, ac.raysync_modified_since):
        with pytest.raises(raysync.AmbiguousModelError) as info:
            ray.get(method.remote())
        err = info.value
        assert isinstance(err, ValueError) and isinstance(err, raysync.RaySyncError)
        assert "['actor', 'critic']" in str(err) and "model_id='actor'" in str(err)
    assert ray.get(ac.raysync_version.remote(model_id="actor")) == va
    assert ray.get(ac.raysync_version.remote(model_id="critic")) is None
    assert ray.get(ac.raysync_modified_since.remote(model_id="actor")) is None

"""torchrl's own Collector, synced through raysync's WeightHub (skips without torchrl)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import ray
import torch

import raysync

pytest.importorskip("torchrl")

from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.envs import PendulumEnv

from raysync.torchrl.integration import HubWeightSyncScheme
from tests.integration._torchrl_policies import Act


def _policy(seed: int) -> TensorDictModule:
    torch.manual_seed(seed)
    return TensorDictModule(Act(), in_keys=["th", "thdot"], out_keys=["action"])


def _acts(policy: TensorDictModule, batch: Any) -> torch.Tensor:
    with torch.no_grad():
        return policy(batch.select("th", "thdot").clone())["action"]


def test_torchrl_collector_acts_with_the_pushed_policy(ray_start_regular: dict[str, Any]) -> None:
    hub_name = f"test-{uuid.uuid4().hex[:8]}"
    hub = raysync.connect(hub_name)
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=60)
    policy = _policy(0)
    collector = Collector(
        PendulumEnv(),
        policy,
        frames_per_batch=16,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
        auto_register_policy_transforms=False,
    )
    try:
        assert scheme.initialized_on_sender  # torchrl initialised and connected our scheme
        batch = next(iter(collector))
        torch.testing.assert_close(batch["action"], _acts(_policy(0), batch))

        trained = _policy(1)
        collector.update_policy_weights_(trained)  # torchrl calls scheme.send(): one hub push
        assert hub.latest("policy") == 2  # version 1: the collector's own policy, pushed by init_on_sender
        batch = next(iter(collector))
        torch.testing.assert_close(batch["action"], _acts(trained, batch))
        assert not torch.allclose(batch["action"], _acts(_policy(0), batch))

        # A receiver-side scheme (e.g. in a worker) takes the newest version from the hub.
        other = _policy(2)
        receiver = HubWeightSyncScheme(hub=hub_name)
        receiver.init_on_receiver(model_id="policy", model=other)
        assert receiver.receive() is not None
        torch.testing.assert_close(other.module.lin.weight, trained.module.lin.weight)
        assert receiver.receive() is None  # nothing newer
    finally:
        collector.shutdown()
        ray.kill(hub.actor)

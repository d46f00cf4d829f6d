"""HubWeightSyncScheme carries what torchrl's own sync carries: non-persistent buffers too.

The policy's action is ``bias + shift``, ``shift`` a non-persistent buffer (not in its state
dict, in ``TensorDict.from_module``): a collector that acts with the trained weights and a
stale buffer shows it in every action.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch

import raysync

pytest.importorskip("torchrl")

from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.envs import PendulumEnv

from raysync.torchrl.integration import HubWeightSyncScheme
from tests.integration._torchrl_policies import shifted_policy

# torchrl's workers start from a forkserver with torchrl imported (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("torchrl_workers_from_a_forkserver")


def _actions(batch: Any) -> set[float]:
    return {round(float(a), 4) for a in batch["action"].flatten()}


def _acts(policy: TensorDictModule, batch: Any) -> torch.Tensor:
    """What ``policy`` does on the batch's observations."""
    with torch.no_grad():
        return policy(batch.select("th", "thdot").clone())["action"]


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = [t.contiguous().view(torch.uint8) for t in (a, b)]
    return a.shape == b.shape and torch.equal(*bits)


@contextlib.contextmanager
def _closing(collector: Any, hub_name: str) -> Iterator[Any]:
    try:
        yield collector
    finally:
        with contextlib.suppress(Exception):
            collector.shutdown()
        with contextlib.suppress(Exception):
            ray.kill(raysync.connect(hub_name).actor)


_FORMS: dict[str, Callable[[TensorDictModule], Any]] = {
    "module": lambda trained: trained,
    "TensorDict.from_module": lambda trained: TensorDict.from_module(trained),
    "TensorDictParams": lambda trained: TensorDict.from_module(trained, as_module=True),
    # keyed like the module the policy wraps (no "module." prefix)
    "inner module's TensorDict": lambda trained: TensorDict.from_module(trained.module),
}


@pytest.mark.parametrize("form", sorted(_FORMS))
def test_collector_acts_with_the_trained_non_persistent_buffer(hub_name: str, form: str) -> None:
    collector = Collector(
        PendulumEnv(),
        shifted_policy(0.5, shift=0.0),
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": HubWeightSyncScheme(hub=hub_name, timeout=60)},
    )
    with _closing(collector, hub_name) as c:
        batches = iter(c)
        assert _actions(next(batches)) == {0.5}
        trained = shifted_policy(0.25, shift=1.0)
        c.update_policy_weights_(_FORMS[form](trained))  # torchrl's own sync: 0.25 + 1.0
        batch = next(batches)
        assert _actions(batch) == {1.25}
        assert _bit_equal(batch["action"], _acts(trained, batch))


def test_a_state_dict_updates_the_parameters_and_keeps_the_policys_buffer(hub_name: str) -> None:
    policy = shifted_policy(0.5, shift=0.5)
    collector = Collector(
        PendulumEnv(),
        policy,
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": HubWeightSyncScheme(hub=hub_name, timeout=60)},
    )
    with _closing(collector, hub_name) as c:
        batches = iter(c)
        assert _actions(next(batches)) == {1.0}
        trained = shifted_policy(0.25, shift=1.0)
        c.update_policy_weights_(trained.state_dict())  # no "shift" in a state dict: the policy's stays
        assert _actions(next(batches)) == {0.75}
        # The hub's version carries the buffer too (the one the policy held).
        pulled = raysync.connect(hub_name).pull("policy").flatten_keys(".")
        assert float(pulled["module.shift"]) == 0.5


def test_multi_sync_workers_start_with_the_buffer_and_act_with_the_trained_one(hub_name: str) -> None:
    policy = shifted_policy(0.5, shift=0.75)
    collector = MultiSyncCollector(
        [PendulumEnv] * 2,
        policy,
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": HubWeightSyncScheme(hub=hub_name, timeout=60)},
    )
    with _closing(collector, hub_name) as c:
        batches = iter(c)
        # The workers got a weightless (meta) policy, buffer included: the hub's first version fills it.
        batch = next(batches)
        assert _actions(batch) == {1.25}
        assert _bit_equal(batch["action"], _acts(policy, batch))
        trained = shifted_policy(0.25, shift=-1.0)
        c.update_policy_weights_(TensorDict.from_module(trained))
        batch = next(batches)
        assert _actions(batch) == {-0.75}
        assert _bit_equal(batch["action"], _acts(trained, batch))


def test_state_dict_keys_only_when_asked(hub_name: str) -> None:
    """``non_persistent_buffers=False``: versions keep the state dict's keys (as @synced_model's)."""
    policy = shifted_policy(0.5, shift=0.5)
    scheme = HubWeightSyncScheme(hub=hub_name, timeout=60, non_persistent_buffers=False)
    collector = Collector(
        PendulumEnv(), policy, frames_per_batch=8, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    with _closing(collector, hub_name) as c:
        batches = iter(c)
        next(batches)
        c.update_policy_weights_(TensorDict.from_module(shifted_policy(0.25, shift=1.0)))
        assert _actions(next(batches)) == {0.75}  # the parameters, not the buffer
        pulled = raysync.connect(hub_name).pull("policy").flatten_keys(".")
        assert sorted(pulled.keys()) == sorted(policy.state_dict())

"""A small complex128 tensor reaches @synced_model actors and followers (issue 41, case 5).

A complex128 element takes 16 bytes, and torch views bytes as complex128 only at an offset
that is a multiple of 16: laid out at Ray's 8-byte alignment for tensors under 2 KiB, right
after a 4-byte tensor, every version failed to apply in every actor and follower while the
hub took the push and ``pull()`` read it.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

import raysync
from tests._support import assert_same_weights, wait_for_condition


class _Rotor(torch.nn.Module):
    """A 4-byte parameter, then a 48-byte complex128 one (sorted by key: ``a_scale``, ``b_phase``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a_scale = torch.nn.Parameter(torch.randn(1, generator=g))
        self.b_phase = torch.nn.Parameter(torch.randn(3, dtype=torch.complex128, generator=g))


def _holder(hub_name: str) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name)
    class Holder:
        def __init__(self) -> None:
            self.policy = _Rotor(0)

        def held(self) -> tuple[int | None, dict[str, torch.Tensor]]:
            """The version it reports and the weights it holds, read together."""
            return self.raysync_version(), {
                k: t.detach().clone() for k, t in self.policy.state_dict().items()
            }

    return Holder.remote()


def test_case41_5_a_small_complex128_tensor_applies_bit_exactly(
    hub: raysync.HubClient, hub_name: str
) -> None:
    holder = _holder(hub_name)
    ray.get(holder.held.remote(), timeout=60)  # registered
    follower_module = _Rotor(0)
    follower = raysync.follow(follower_module, "policy", hub=hub_name)
    try:
        pushed: dict[int, dict[str, torch.Tensor]] = {}
        for seed in (1, 2):
            src = _Rotor(seed)
            v = hub.push(src, wait=True, timeout=60)
            pushed[v] = {k: t.detach().clone() for k, t in src.state_dict().items()}
            version, weights = ray.get(holder.held.remote(), timeout=60)
            assert version == v
            assert_same_weights(weights, pushed[version])
            wait_for_condition(lambda v=v: follower.version == v, timeout=60, what="the follower applied it")
            assert_same_weights(follower_module.state_dict(), pushed[v])
            assert_same_weights(hub.pull(state_dict=True), pushed[v])
    finally:
        follower.stop()

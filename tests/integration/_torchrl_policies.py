"""Policies for torchrl collector tests, importable by torchrl's (spawned) worker processes.

Every action of :func:`constant_policy` equals its bias ``b`` (weight 0), so a batch
says which version of the weights a worker acted with.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict.nn import TensorDictModule


class Act(torch.nn.Module):
    """Pendulum's observation (``th``, ``thdot``) to a torque in [-2, 2]."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.stack([th, thdot], -1)).clamp(-2.0, 2.0)


class Moody(Act):
    """An :class:`Act` with extra state: ``"fail"`` makes its apply raise, ``"slow"`` sleep 6 s."""

    def __init__(self) -> None:
        super().__init__()
        self.mood = "ok"

    def get_extra_state(self) -> Any:
        return self.mood

    def set_extra_state(self, state: Any) -> None:
        if state == "fail":
            raise ValueError("this policy refuses the mood 'fail'")
        if state == "slow":
            time.sleep(6)
        self.mood = state


class Shifted(Act):
    """An :class:`Act` whose torque adds a non-persistent buffer ``shift`` (not in its state dict)."""

    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        self.register_buffer("shift", torch.full((1,), shift), persistent=False)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return (self.lin(torch.stack([th, thdot], -1)) + self.shift).clamp(-2.0, 2.0)


def set_bias(policy: TensorDictModule, b: float) -> TensorDictModule:
    with torch.no_grad():
        policy.module.lin.weight.zero_()
        policy.module.lin.bias.fill_(b)
    return policy


def constant_policy(b: float = 0.5) -> TensorDictModule:
    return set_bias(TensorDictModule(Act(), in_keys=["th", "thdot"], out_keys=["action"]), b)


def moody_policy(b: float = 0.5) -> TensorDictModule:
    return set_bias(TensorDictModule(Moody(), in_keys=["th", "thdot"], out_keys=["action"]), b)


def shifted_policy(b: float = 0.5, shift: float = 0.0) -> TensorDictModule:
    """Every action is ``b + shift``; ``shift`` is a non-persistent buffer."""
    return set_bias(TensorDictModule(Shifted(shift), in_keys=["th", "thdot"], out_keys=["action"]), b)

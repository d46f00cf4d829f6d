"""Envs and policies for tests/integration/test_torchrl_collectors_schemes.py.

Kept apart from the test module so torchrl's spawned collector workers import
only torch, torchrl and this file.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from tensordict.nn import TensorDictModule
from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

DIM = 7  # ContinuousActionVecMockEnv: 7 observations, 7 actions
SLOW_ENV = "RAYSYNC_TEST_SLOW_FORWARD"  # seconds each forward sleeps in SleepyLinear
FORWARDS_ENV = "RAYSYNC_TEST_FORWARDS"  # a file SleepyLinear logs its forwards' start and end times to


def make_env() -> ContinuousActionVecMockEnv:
    """torchrl's small test env."""
    return ContinuousActionVecMockEnv()


class SleepyLinear(torch.nn.Linear):
    """A Linear whose forward sleeps ``$RAYSYNC_TEST_SLOW_FORWARD`` seconds (a worker that falls behind)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log = os.environ.get(FORWARDS_ENV)
        _log_forward(log, "start")
        time.sleep(float(os.environ.get(SLOW_ENV, "0")))
        _log_forward(log, "end")
        return super().forward(x)


def _log_forward(path: str | None, what: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(f"{what} {time.time()}\n")


def forward_in_progress(path: str, *, started_within: float) -> bool:
    """Whether a SleepyLinear forward logged to ``path`` runs now, begun ``started_within`` s ago or less."""
    try:
        with open(path) as f:
            lines = f.read().split()
    except FileNotFoundError:
        return False
    try:
        return len(lines) >= 2 and lines[-2] == "start" and time.time() - float(lines[-1]) <= started_within
    except ValueError:  # a line being written
        return False


def policy(bias: float, *, sleepy: bool = False) -> TensorDictModule:
    """Weight 0, bias ``bias``: every action equals ``bias`` whatever the observation."""
    lin = (SleepyLinear if sleepy else torch.nn.Linear)(DIM, DIM)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.fill_(bias)
    return TensorDictModule(lin, in_keys=["observation"], out_keys=["action"])


def wide_policy(bias: float) -> TensorDictModule:
    """A policy whose weights do not fit :func:`policy`'s (one more hidden layer)."""
    net = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM))
    with torch.no_grad():
        for lin in net:
            lin.weight.zero_()
            lin.bias.fill_(bias)
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action"])


def actions(batch: Any) -> set[float]:
    """The distinct action values of a batch."""
    return {round(float(v), 4) for v in batch["action"].unique()}

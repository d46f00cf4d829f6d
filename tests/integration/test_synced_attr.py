"""A misspelt ``@synced_model(attr=...)``: what a user sees at the actor's first call (issue 48)."""

from __future__ import annotations

import pytest
import ray

import raysync
from tests._support import small_policy


def test_a_misspelt_attr_says_which_attribute_holds_the_module_at_the_first_call(hub_name: str) -> None:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("polcy", hub=hub_name)
    class Collector:
        def __init__(self) -> None:
            self.policy = small_policy()

        def act(self) -> int:
            return 1

    actor = Collector.remote()
    with pytest.raises(ray.exceptions.RayActorError) as raised:
        ray.get(actor.act.remote(), timeout=120)
    said = str(raised.value)
    lines = said.strip().splitlines()
    hint = "TypeError: @synced_model(attr='polcy'): self.polcy is missing; did you mean attr='policy'?"
    where = next((i for i, line in enumerate(lines) if line.strip().startswith(hint)), None)
    assert where is not None, said
    assert where < 8, f"the hint comes after {where} lines of traceback:\n{said}"  # not buried

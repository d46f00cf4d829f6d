"""A misspelt ``@synced_model`` attribute: the message names the attribute that holds the module (issue 48).

The decorated class is made here without Ray (its ``__init__`` checks the attribute before it
registers anywhere); tests/integration/test_synced_attr.py shows what a Ray actor's caller sees.
"""

from __future__ import annotations

import pytest
import torch

import raysync


def _collector(attr: str) -> type:
    @raysync.synced_model(attr, hub="no-hub-needed")
    class Collector:
        def __init__(self) -> None:
            self.policy = torch.nn.Linear(2, 2)
            self.critic = torch.nn.Linear(2, 1)
            self.steps = 0

    return Collector


def test_a_misspelt_attr_names_the_closest_module_attribute() -> None:
    with pytest.raises(TypeError) as raised:
        _collector("polcy")()
    said = str(raised.value)
    assert said.startswith("@synced_model(attr='polcy'): self.polcy is missing; did you mean attr='policy'?")
    assert "model_id= names the model" in said  # the first positional argument is the attribute


def test_an_attr_naming_no_module_lists_the_modules_there() -> None:
    with pytest.raises(TypeError) as raised:
        _collector("steps")()
    assert str(raised.value).startswith(
        "@synced_model(attr='steps'): self.steps holds a int object; "
        "the actor's modules: ['critic', 'policy']"
    )

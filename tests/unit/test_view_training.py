"""Training an ``apply="view"`` model raises ReadOnlyWeightsError with the cause, from any kind of method.

No Ray here: a synced class made outside an actor follows no hub, but its methods are guarded the
same way. Its parameters are made to take no gradients, as read-only views do.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

import raysync


def _frozen() -> torch.nn.Module:
    model = torch.nn.Linear(4, 2)
    model.requires_grad_(False)  # what apply="view" parameters are
    return model


def _train(model: torch.nn.Module) -> None:
    loss = model(torch.ones(1, 4)).sum()
    loss.backward()


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="raysync")  # "created outside a Ray actor"


def test_a_threaded_actors_method_says_the_weights_are_views() -> None:
    @raysync.synced_model("policy", apply="view")
    class Learner:
        def __init__(self) -> None:
            self.policy = _frozen()

        def step(self) -> None:
            _train(self.policy)

        def grad_of(self) -> None:
            torch.autograd.grad(self.policy(torch.ones(1, 4)).sum(), list(self.policy.parameters()))

    learner = Learner()
    for method in (learner.step, learner.grad_of):
        with pytest.raises(
            raysync.ReadOnlyWeightsError, match=r"self\.policy holds weights .*apply='copy'"
        ) as err:
            method()
        assert isinstance(err.value.__cause__, RuntimeError)  # torch's error, chained


def test_an_async_actors_methods_say_so_too() -> None:
    @raysync.synced_model("policy", apply="view")
    class AsyncLearner:
        def __init__(self) -> None:
            self.policy = _frozen()

        async def step(self) -> None:
            _train(self.policy)

        def sync_step(self) -> None:  # runs on the event loop of an async actor
            _train(self.policy)

    learner = AsyncLearner()
    with pytest.raises(raysync.ReadOnlyWeightsError, match="apply='view'"):
        asyncio.run(learner.step())
    with pytest.raises(raysync.ReadOnlyWeightsError, match="apply='view'"):
        learner.sync_step()


def test_copy_mode_and_other_errors_are_left_as_they_are() -> None:
    @raysync.synced_model("policy")  # apply="copy": a model this actor may train
    class Copier:
        def __init__(self) -> None:
            self.policy = _frozen()

        def step(self) -> None:
            _train(self.policy)

    with pytest.raises(RuntimeError, match="does not require grad") as err:
        Copier().step()
    assert not isinstance(err.value, raysync.ReadOnlyWeightsError)

    @raysync.synced_model("policy", apply="view")
    class Viewer:
        def __init__(self) -> None:
            self.policy = torch.nn.Linear(4, 2)

        def fails(self) -> None:
            raise RuntimeError("something else")

        def trains(self) -> float:  # weights that do take gradients (not views): nothing to explain
            _train(self.policy)
            return float(self.policy.weight.grad.abs().sum())

    viewer = Viewer()
    with pytest.raises(RuntimeError, match=r"^something else$"):
        viewer.fails()
    assert viewer.trains() > 0

"""``hub.pull(state_dict=True)`` gives the keys in the pushed module's own order (issue 48)."""

from __future__ import annotations

from collections import OrderedDict

import torch

import raysync
from tests._support import assert_same_weights


def _unsorted_model() -> torch.nn.Module:
    """A module whose state_dict order is not the sorted order of its keys."""
    return torch.nn.Sequential(
        OrderedDict(
            [
                ("encoder", torch.nn.Linear(4, 8)),
                ("norm", torch.nn.LayerNorm(8)),
                ("head", torch.nn.Linear(8, 2)),
                ("bias_table", torch.nn.Embedding(3, 2)),
            ]
        )
    )


def test_pull_state_dict_keeps_the_pushed_modules_key_order(hub: raysync.HubClient) -> None:
    model = _unsorted_model()
    expected = list(model.state_dict())
    assert expected != sorted(expected)
    hub.push(model, wait=True, timeout=60)
    pulled = hub.pull(state_dict=True)
    assert list(pulled) == expected
    assert_same_weights(pulled, model.state_dict())
    fresh = _unsorted_model()
    fresh.load_state_dict(pulled)
    assert_same_weights(fresh.state_dict(), model.state_dict())
    as_dict = {
        k: v.clone() for k, v in reversed(list(model.state_dict().items()))
    }  # a state dict's own order
    hub.push(as_dict, wait=True, timeout=60)
    assert list(hub.pull(state_dict=True)) == list(as_dict)

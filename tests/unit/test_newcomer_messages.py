"""Messages a new user reads first: no cluster for `raysync status`, weights that are not weights."""

from __future__ import annotations

import re
from typing import Any

import pytest
import ray
import torch

import raysync
from raysync.core.extract import extract_tensors
from raysync.ops import cli


def test_status_without_a_cluster_reads_as_one_clean_sentence(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ray's own message ends with a period; the line goes on without doubling it."""

    def no_cluster(**_: Any) -> None:
        raise ConnectionError(
            "Could not find any running Ray instance. Please specify the one to connect to by setting "
            "`--address` flag or `RAY_ADDRESS` environment variable."
        )

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    assert cli.main(["status", "--timeout", "20"]) == 1
    err = capsys.readouterr().err
    assert "no Ray cluster at 'auto'" in err and "environment variable. Check that a cluster" in err
    assert ".." not in err, err


class _Odd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {"w": self.w.detach(), "step": 7}


@pytest.mark.parametrize(
    "weights, says",
    [
        (torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), "from an object of type SGD:"),
        (3, "from an object of type int:"),
        ({"w": torch.ones(1), "n": 3}, "weight 'n' is of type int, not a tensor"),
        (_Odd(), "_Odd.state_dict()['step'] is of type int, not a tensor"),
    ],
)
def test_bad_weights_messages_read_as_english(weights: object, says: str) -> None:
    """Never "a SGD" or "a int": the type is named without an article to get wrong."""
    with pytest.raises(raysync.InvalidWeightsError) as info:
        extract_tensors(weights)  # type: ignore[arg-type]
    message = str(info.value)
    assert says in message, message
    assert not re.search(r"\ba [AEIOUaeiou]|\ba (SGD|int)\b", message), message

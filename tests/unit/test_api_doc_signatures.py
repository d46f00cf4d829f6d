"""docs/api.md's tables name every parameter of the constructors they document (issue 48: the
Targets table left out ``WeightsLoader(placement=)``)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import raysync

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


@pytest.mark.parametrize("name", ["WeightsLoader"])
def test_the_api_table_row_of_a_target_names_every_parameter(name: str) -> None:
    rows = [line for line in API.read_text().splitlines() if line.startswith(f"| `raysync.{name}(")]
    assert rows, f"docs/api.md has no table row for raysync.{name}(...)"
    documented = re.match(rf"\| `raysync\.{name}\(([^`]*)\)`", rows[0])
    assert documented is not None, rows[0]
    listed = {part.split("=")[0].strip(" *") for part in documented.group(1).split(",")} - {""}
    wanted = set(inspect.signature(getattr(raysync, name)).parameters)
    assert sorted(wanted - listed) == [], (
        f"docs/api.md's raysync.{name}(...) row omits {sorted(wanted - listed)}"
    )


def test_the_push_row_says_nan_weights_are_pushed_unless_check_finite() -> None:
    """NaN weights are accepted by default (the check reads every byte: measured, issue 48): said where
    push is documented."""
    (row,) = [line for line in API.read_text().splitlines() if line.startswith("| `hub.push(")]
    assert "check_finite=False" in row  # the default, in the signature
    assert "so NaN weights are pushed unless asked" in row

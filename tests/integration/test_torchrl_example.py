"""examples/torchrl_ppo.py, short: PPO through torchrl's MultiSyncCollector synced by the hub."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchrl")
pytest.importorskip("gymnasium")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_ppo_example_workers_act_with_the_version_on_their_batch(
    ray_start_regular: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    sys.path.insert(0, str(EXAMPLES))  # torchrl's spawned workers import the example's make_env too
    try:
        import torchrl_ppo
    finally:
        sys.path.remove(str(EXAMPLES))
    sys.path.append(str(EXAMPLES))
    rc = torchrl_ppo.main(["--frames", "4000", "--frames-per-batch", "1000", "--check", "--plot", ""])
    out = capsys.readouterr().out
    assert rc == 0, out
    # Every worker's slice of every batch was replayed with the weights of the version stamped on it.
    match = re.search(r"acted-with check: (\d+) worker batches replayed, (\d+) mismatches", out)
    assert match is not None, out
    assert (int(match[1]), int(match[2])) == (2 * 4, 0)
    assert len(re.findall(r"iteration +\d+ +frames", out)) == 4


def test_the_reward_curve_goes_where_the_readme_shows_it_not_into_the_working_directory() -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import torchrl_ppo
    finally:
        sys.path.remove(str(EXAMPLES))
    root = EXAMPLES.parent
    shown = re.search(r"!\[reward curve\]\(([^)]+)\)", (root / "README.md").read_text())
    assert shown is not None
    assert torchrl_ppo.DEFAULT_PLOT == root / shown[1]  # whatever directory `make` or a user runs it from

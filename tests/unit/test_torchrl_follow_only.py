"""A ``follow_only`` scheme whose writer has not pushed: one clear error, before any worker starts."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("torchrl")

from raysync.errors import SyncTimeoutError, UnknownModelError
from raysync.torchrl.integration import HubWeightSyncScheme

MARGIN_S = 5.0
"""What the wait may take past its timeout (a poll interval, a loaded machine)."""


class _EmptyHub:
    """A hub client on which nothing was pushed yet: ``latest`` says None (or names no such model)."""

    def __init__(self, unknown: bool) -> None:
        self.unknown = unknown
        self.asked = 0

    def latest(self, model_id: str) -> Any:
        self.asked += 1
        if self.unknown:
            raise UnknownModelError(f"no model {model_id!r} on this hub (models: [])")
        return None


class _MultiCollector:
    """What the scheme sees of a MultiSyncCollector when torchrl calls init_on_sender: its pipes made,
    its 2 worker processes not started yet."""

    def __init__(self) -> None:
        self.pipes: list[Any] = []
        self.num_workers = 2


@pytest.mark.parametrize("unknown", [False, True], ids=["latest-none", "unknown-model"])
def test_init_on_sender_of_a_follow_only_scheme_before_any_push_raises_within_its_timeout(
    unknown: bool,
) -> None:
    """torchrl calls init_on_sender before it starts any worker: a follow_only collector created
    before its writer's first push fails there, within its timeout, naming what to do."""
    scheme = HubWeightSyncScheme(hub="trainer-hub", timeout=1.0, follow_only=True)
    hub = _EmptyHub(unknown)
    scheme._client = hub
    t0 = time.monotonic()
    with pytest.raises(SyncTimeoutError) as raised:
        scheme.init_on_sender(model_id="policy", context=_MultiCollector())
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + MARGIN_S, f"took {elapsed:.1f} s"
    said = str(raised.value)
    assert "no version of 'policy' on hub 'trainer-hub' within 1 s" in said
    assert "follow_only=True" in said and "push a first version before creating the collector" in said
    assert hub.asked > 1  # it waited for one, asking again

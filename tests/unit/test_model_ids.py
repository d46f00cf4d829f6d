"""One line per hub and model id the hub has no version of, naming the models it holds (no Ray)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest

from raysync.client import model_ids
from raysync.client.model_ids import LATEST_NONE, note_absent


def _status(**latest: int | None) -> dict[str, Any]:
    return {"models": {m: {"latest": v, "versions_kept": [v] if v else []} for m, v in latest.items()}}


def test_a_typod_model_id_gets_one_warning_naming_the_models_with_a_version(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub, asked = f"hub-{uuid.uuid4().hex[:6]}", []

    def status() -> dict[str, Any]:
        asked.append(1)
        return _status(policy=3, critic=None)  # critic: a lease, no version

    with caplog.at_level(logging.INFO, logger=model_ids.__name__):
        assert note_absent(hub, "polcy", status, LATEST_NONE) == ["policy"]
        for _ in range(3):
            note_absent(hub, "polcy", status, LATEST_NONE)
    assert [r.getMessage() for r in caplog.records] == [
        f"no model 'polcy' on hub {hub!r} (models there: 'policy'); latest() is None until one is pushed"
    ]
    assert caplog.records[0].levelno == logging.WARNING
    assert len(asked) == 1  # once logged, the hub is not asked again


def test_an_empty_hub_is_early_not_a_typo_and_is_asked_again_after_a_while(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub, models = f"hub-{uuid.uuid4().hex[:6]}", _status()
    now = [100.0]
    monkeypatch.setattr(model_ids.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.INFO, logger=model_ids.__name__):
        assert note_absent(hub, "polcy", lambda: models, LATEST_NONE) == []  # nothing else there: no line
        models = _status(policy=1)
        assert note_absent(hub, "polcy", lambda: models, LATEST_NONE) is None  # asked a moment ago
        now[0] += model_ids.RECHECK_S
        assert note_absent(hub, "polcy", lambda: models, LATEST_NONE) == ["policy"]
        # A follower says so even on an empty hub, at INFO: it may start before its trainer.
        assert note_absent(hub, "late", _status, "following it until one is pushed", always=True) == []
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.WARNING, f"no model 'polcy' on hub {hub!r} (models there: 'policy'); {LATEST_NONE}"),
        (
            logging.INFO,
            f"no model 'late' on hub {hub!r} (models there: none); following it until one is pushed",
        ),
    ]


def test_a_hub_that_does_not_answer_never_fails_the_call() -> None:
    def status() -> dict[str, Any]:
        raise TimeoutError("no answer")

    assert note_absent(f"hub-{uuid.uuid4().hex[:6]}", "polcy", status, LATEST_NONE) is None

"""``raysync status`` prints what users named things as text: brackets are never rich markup."""

from __future__ import annotations

import io
from typing import Any

from raysync.ops import cli


def _status(model_ids: list[str], **sub: Any) -> dict[str, Any]:
    model = {
        "latest": 3,
        "versions_kept": [2, 3],
        "bytes_per_version": 1024,
        "buckets": 1,
        "pushes": 3,
        "bytes_pushed": 3072,
        "last_push_age_s": 2.0,
        "writer": {"actor_id": None, "job_id": "01000000", "pid": 42, "host": "[bold]node"},
    }
    row = {
        "subscriber": "actor0123456789abcdef0123456789abcdef:policy[/lora]",
        "model_id": model_ids[-1],
        "class_name": "Collector[red]",
        "node_id": "abcdef0123",
        "mode": "push",
        "apply": "copy",
        "applied": 3,
        "lag": 0,
        "state": "live",
        "last_apply_s": 0.001,
        "last_apply_time": None,
        "last_apply_age_s": 2.5,
        "last_error": "WeightMismatchError: key 'a[/b]' [missing]",
    } | sub
    return {
        "hub": "h[/x]",
        "keep": 2,
        "uptime_s": 5.0,
        "models": {m: model for m in model_ids},
        "subscribers": [row],
    }


def test_brackets_in_user_strings_are_printed_as_written() -> None:
    out = io.StringIO()
    cli.render_status(_status(["policy[lora]", "policy[/lora]", "policy"]), file=out)  # no MarkupError
    text = out.getvalue()
    assert "policy[lora]" in text and "policy[/lora]" in text  # two rows, not two "policy"
    assert "Collector[red]" in text and "[bold]node" in text and "h[/x]" in text
    assert "WeightMismatchError: key 'a[/b]' [missing]" in text


def _column(text: str, table: str, index: int) -> str:
    """The cells of one column of a rendered table, joined (a wrapped cell spans several lines)."""
    body = text.split(table, 1)[1]
    pieces = []
    for line in body.splitlines():
        cells = line.split("│")
        if len(cells) > index + 1:
            pieces.append(cells[index + 1].strip())
    return "".join(pieces)


def test_ids_are_never_cut_and_ages_come_from_the_hub() -> None:
    long_id = "actor" + "0123456789abcdef" * 6 + ":policy"
    out = io.StringIO()
    cli.render_status(_status(["policy"], subscriber=long_id, class_name="C" * 60), file=out)
    text = out.getvalue()
    assert long_id in _column(text, "subscribers", 1)  # wrapped if need be, never cut with an ellipsis
    assert "2.5 s ago" in _column(text, "subscribers", 9)  # the hub's own age, measured with the push's


def test_a_subscriber_modified_locally_is_marked_and_explained() -> None:
    out = io.StringIO()
    cli.render_status(_status(["policy"], modified_since=3, last_error=None), file=out)
    text = out.getvalue()
    assert "3*" in _column(text, "subscribers", 5)
    words = " ".join(text.split())  # however the terminal wrapped it
    assert "modified locally" in words and "changed version 3 in place" in words and ".eval()" in words
    plain = io.StringIO()
    cli.render_status(_status(["policy"], modified_since=None, last_error=None), file=plain)
    assert "3*" not in plain.getvalue() and "modified locally" not in plain.getvalue()

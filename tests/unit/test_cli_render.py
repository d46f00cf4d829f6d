"""``raysync status`` prints what users named things as text: brackets are never rich markup."""

from __future__ import annotations

import io
import re
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


def test_control_characters_in_hub_strings_are_printed_escaped() -> None:
    """Case 41.9: an ANSI escape or a newline in a model id (or any string from the hub) would
    repaint the terminal or forge a line; every one is printed escaped, as a Python literal."""
    evil = "policy\x1b[2J\x1b[31m\nv2"
    status = _status(
        [evil],
        subscriber="actor01:policy\x9b0m\x7f",  # C1 CSI and DEL
        class_name="C\x1b]0;t\x07",  # an OSC retitling the window
        node_id="\x1b[1Anode",
        last_error="ApplyError: bad\r\nRuntimeError: \x1b[8mhidden",
        modified_since=3,
    )
    status["models"][evil]["writer"] = {"actor_id": None, "job_id": "j\x1bob", "pid": 1, "host": "h\u202eost"}
    out = io.StringIO()
    cli.render_status(status, file=out)
    text = out.getvalue()
    raw = sorted({c for c in text if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F)})
    assert not raw and "\u202e" not in text, raw
    assert "policy\\x1b[2J\\x1b[31m\\nv2" in _column(text, "models", 0)  # one row, the id whole
    assert "policy\\x1b[2J\\x1b[31m\\nv2" in _column(text, "subscribers", 0)
    assert "actor01:policy\\x9b0m\\x7f" in _column(text, "subscribers", 1)
    assert "C\\x1b]0;t\\x07" in _column(text, "subscribers", 2)
    assert "\\x1b[1Anode" in _column(text, "subscribers", 3) and "j\\x1bob pid 1@h\\u202eost" in text
    words = " ".join(text.split())
    assert (
        "actor01:policy\\x9b0m\\x7f (policy\\x1b[2J\\x1b[31m\\nv2): its own code changed version 3" in words
    )
    assert "ApplyError: bad\\r\\nRuntimeError: \\x1b[8mhidden" in words  # the last errors, in full


def test_a_fleet_is_counted_by_node_and_only_those_behind_are_named() -> None:
    """1,000 subscribers on 4 nodes: a row per node with its counts, then the few behind, failing
    or not live by name, most behind first; ``--all`` (``every=True``) lists each one."""
    status = _status(["policy"], last_error=None)
    row = status["subscribers"][0]
    rows = [row | {"subscriber": f"sub-{i:04d}", "node_id": f"node{i % 4}aaaa"} for i in range(1000)]
    rows[7] |= {"lag": 2, "applied": 1}
    rows[8] |= {"lag": 5, "applied": None, "state": "unreachable"}
    rows[9] |= {"last_error": "ApplyError: disk full"}
    status["subscribers"] = rows
    out = io.StringIO()
    cli.render_status(status, file=out)
    text = out.getvalue()
    assert "subscribers by node: 1000" in text
    for node in range(4):
        assert f"node{node}aa" in text
    assert set(re.findall(r"sub-\d{4}", text)) == {"sub-0007", "sub-0008", "sub-0009"}  # and no other
    assert text.index("sub-0008") < text.index("sub-0007")  # most behind first
    assert "behind, failing or not live: 3" in text and "ApplyError: disk full" in text
    section = text.split("subscribers by node", 1)[1].split("behind, failing", 1)[0]
    counts = {}  # node: (subscribers, at newest, behind, not live, failing, most behind)
    for node in range(4):
        line = next(line for line in section.splitlines() if f"node{node}aa" in line)
        counts[node] = tuple(int(c) for c in line.split("│")[3:9])
    assert counts == {
        0: (250, 249, 1, 1, 0, 5),  # sub-0008: 5 behind, unreachable
        1: (250, 250, 0, 0, 1, 0),  # sub-0009: failing
        2: (250, 250, 0, 0, 0, 0),
        3: (250, 249, 1, 0, 0, 2),  # sub-0007: 2 behind
    }
    out = io.StringIO()
    cli.render_status(status, file=out, every=True)
    assert len(set(re.findall(r"sub-\d{4}", out.getvalue()))) == 1000  # every one, by name

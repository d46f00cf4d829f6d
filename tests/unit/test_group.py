"""A sharded group's identity as its rank 0 sends it (raysync/core/group.py): checked, never unpickled."""

from __future__ import annotations

import json

import pytest

from raysync.core.group import parse_group
from raysync.errors import InvalidWeightsError

_LEAD = {"session": "ab", "writer_id": "actor-1", "kind": "actor", "actor_id": "1", "job_id": "01", "pid": 7,
         "host": "h"}  # fmt: skip


def _raw(data: object, size: int | None = None) -> bytes:
    body = json.dumps(data).encode()
    return (len(body) if size is None else size).to_bytes(4, "little") + body + bytes(64)


def test_a_group_identity_reads_back_field_for_field() -> None:
    ident = parse_group(_raw({"token": "0" * 32, "lead": _LEAD}))
    assert ident.token == "0" * 32 and ident.lead == _LEAD


@pytest.mark.parametrize(
    "raw",
    [
        bytes(64),  # nothing sent
        _raw({"token": "0" * 32, "lead": _LEAD}, size=10**6),  # a length past the buffer
        _raw({"token": "xyz", "lead": _LEAD}),
        _raw({"token": "0" * 32, "lead": {**_LEAD, "extra": 1}}),
        _raw({"token": "0" * 32, "lead": {**_LEAD, "writer_id": ""}}),
        _raw(["not", "a", "dict"]),
        b"\x05\x00\x00\x00\xff\xfe\xfd\xfc\xfb",  # not UTF-8
    ],
)
def test_anything_else_is_refused(raw: bytes) -> None:
    with pytest.raises(InvalidWeightsError, match="group rank 0 sent no group identity"):
        parse_group(raw)

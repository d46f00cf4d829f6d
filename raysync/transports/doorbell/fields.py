"""The doorbell wire's building blocks: its limits, fixed records, and a bounded writer and reader.

Every record the doorbell sends or reads (:mod:`.wire`) is built from these; the reader checks
every length and count against its limit, so a record from outside Ray's authenticated calls
cannot make a process read past its end or allocate without bound.

Example:
    >>> out = Writer()
    >>> out.text("policy")
    >>> Reader(out.bytes()).text()
    'policy'
"""

from __future__ import annotations

import math
import struct
from typing import Any

__all__ = ["WIRE_VERSION", "Reader", "WireError", "Writer"]

WIRE_VERSION = 1
"""Bumped whenever a layout changes: a record of another version is refused, never guessed at."""

MAX_STR = 4096
MAX_SUBS = 2048
MAX_ENTRIES = 1 << 20
MAX_BUCKETS = 1 << 16
MAX_DIMS = 64
MAX_ERROR = 1000
NONE_I64 = -(1 << 63)

RING = struct.Struct("<4sHHQqQQQH")
ACK = struct.Struct("<4sHHQq")
SEG = struct.Struct("<4sHHq")
U8, U16, U32, U64, I64, F64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q", "<q", "<d"))


class WireError(ValueError):
    """A record that is not one of ours (wrong magic, version, length, field or MAC)."""


class Writer:
    """A record being written: fixed fields, bounded strings, optional numbers."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def put(self, s: struct.Struct, *values: Any) -> None:
        self.parts.append(s.pack(*values))

    def text(self, value: str, limit: int = MAX_STR) -> None:
        raw = value.encode("utf-8")
        if len(raw) > limit:
            raise WireError(f"a string of {len(raw)} bytes is over the wire's limit of {limit}")
        self.parts.append(U16.pack(len(raw)) + raw)

    def opt_int(self, value: int | None) -> None:
        self.parts.append(I64.pack(NONE_I64 if value is None else value))

    def opt_float(self, value: float | None) -> None:
        self.parts.append(F64.pack(math.nan if value is None else value))

    def bytes(self) -> bytes:
        return b"".join(self.parts)


class Reader:
    """A record being read: every field bounded, never past ``end``; :class:`WireError` otherwise."""

    def __init__(self, data: bytes | memoryview, end: int | None = None) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.end = len(self.data) if end is None else end

    def take(self, s: struct.Struct) -> tuple[Any, ...]:
        if self.pos + s.size > self.end:
            raise WireError("record ends early")
        values = s.unpack_from(self.data, self.pos)
        self.pos += s.size
        return values

    def one(self, s: struct.Struct) -> Any:
        return self.take(s)[0]

    def count(self, s: struct.Struct, limit: int, what: str) -> int:
        n = int(self.one(s))
        if n > limit:
            raise WireError(f"{n} {what}, over the limit of {limit}")
        return n

    def raw(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes, ``what`` (for the error) when they run past ``end``."""
        if self.pos + n > self.end:
            raise WireError(f"{what} past the record's end")
        raw = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return raw

    def text(self, limit: int = MAX_STR, *, nonempty: bool = False) -> str:
        n = self.one(U16)
        if n > limit:
            raise WireError("string over its limit")
        raw = self.raw(n, "string")
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise WireError("string is not UTF-8") from err
        if nonempty and not value:
            raise WireError("empty string where one is required")
        return value

    def u64s(self, n: int) -> list[int]:
        """``n`` unsigned 64-bit numbers in one read."""
        s = struct.Struct(f"<{n}Q")
        return list(self.take(s))

    def non_negative(self, s: struct.Struct) -> int:
        value = int(self.one(s))
        if value < 0:
            raise WireError(f"negative value {value} where none may be")
        return value

    def opt_int(self) -> int | None:
        value = int(self.one(I64))
        if value == NONE_I64:
            return None
        if value < 0:
            raise WireError(f"negative value {value} where none may be")
        return value

    def opt_float(self) -> float | None:
        value = float(self.one(F64))
        if math.isnan(value):
            return None
        if math.isinf(value) or value < 0:
            raise WireError(f"duration {value} is not a finite non-negative number")
        return value

    def done(self) -> None:
        if self.pos != self.end:
            raise WireError(f"{self.end - self.pos} unexpected bytes after the record")

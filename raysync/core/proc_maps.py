"""This process's memory mappings, looked up by address.

Through ``ioctl(PROCMAP_QUERY)`` on ``/proc/self/maps`` where the kernel has it (Linux
6.11+: ~10 us a look-up), else by reading the whole file once per :class:`Mappings`
(~1 ms in a Ray worker, whose ~500 mappings are mostly shared libraries). Off Linux
nothing is found.

Example:
    >>> import numpy as np
    >>> with Mappings() as maps:                                    # doctest: +SKIP
    ...     m = maps.holding(np.zeros(8).ctypes.data, 64)
    >>> m.writable, m.shared                                        # doctest: +SKIP
    (True, False)
"""

from __future__ import annotations

import ctypes
import errno
import os
from types import TracebackType
from typing import NamedTuple

__all__ = ["Mapping", "Mappings"]


class Mapping(NamedTuple):
    """One mapping: its addresses, whether it is writable here and shared, and what file it maps."""

    start: int
    end: int
    writable: bool
    shared: bool
    offset: int  # of ``start`` in the file
    file: tuple[int, int, int]  # (device major, device minor, inode)


class _Query(ctypes.Structure):
    """``struct procmap_query`` (include/uapi/linux/fs.h)."""

    _fields_ = [
        ("size", ctypes.c_uint64),
        ("query_flags", ctypes.c_uint64),
        ("query_addr", ctypes.c_uint64),
        ("vma_start", ctypes.c_uint64),
        ("vma_end", ctypes.c_uint64),
        ("vma_flags", ctypes.c_uint64),
        ("vma_page_size", ctypes.c_uint64),
        ("vma_offset", ctypes.c_uint64),
        ("inode", ctypes.c_uint64),
        ("dev_major", ctypes.c_uint32),
        ("dev_minor", ctypes.c_uint32),
        ("vma_name_size", ctypes.c_uint32),
        ("build_id_size", ctypes.c_uint32),
        ("vma_name_addr", ctypes.c_uint64),
        ("build_id_addr", ctypes.c_uint64),
    ]


_PROCMAP_QUERY = (3 << 30) | (ctypes.sizeof(_Query) << 16) | (ord("f") << 8) | 17  # _IOWR('f', 17, ...)
_VMA_WRITABLE, _VMA_SHARED = 0x2, 0x8
_query_works = [True]  # until a kernel says it has no PROCMAP_QUERY


class Mappings:
    """This process's mappings now: :meth:`holding` one address range, or :meth:`all` of them.

    A context manager (it holds ``/proc/self/maps`` open); the file's text is read only if
    the kernel cannot answer a query, or for :meth:`all`.
    """

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/self/maps", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._lines: list[str] | None = None
        self._starts: dict[int, int] = {}

    def __enter__(self) -> Mappings:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def holding(self, address: int, nbytes: int) -> Mapping | None:
        """The mapping holding all of ``[address, address + nbytes)``, if one does."""
        m = self._query(address) if self._fd is not None and _query_works[0] else self._from_text(address)
        return m if m is not None and address + nbytes <= m.end else None

    def all(self) -> list[Mapping]:
        """Every mapping, by address."""
        return [m for m in map(_parse, self._text()) if m is not None]

    def _query(self, address: int) -> Mapping | None:
        import fcntl  # here: only where /proc/self/maps opened (Linux)

        q = _Query(size=ctypes.sizeof(_Query), query_addr=address)
        try:
            fcntl.ioctl(self._fd, _PROCMAP_QUERY, q)  # type: ignore[arg-type]
        except OSError as err:
            if err.errno == errno.ENOENT:
                return None  # no mapping there
            _query_works[0] = False  # ENOTTY: a kernel before 6.11
            return self._from_text(address)
        flags = q.vma_flags
        file = (q.dev_major, q.dev_minor, q.inode)
        return Mapping(
            q.vma_start, q.vma_end, bool(flags & _VMA_WRITABLE), bool(flags & _VMA_SHARED), q.vma_offset, file
        )

    def _text(self) -> list[str]:
        if self._lines is None:
            self._lines = []
            if self._fd is not None:
                with os.fdopen(os.dup(self._fd)) as f:
                    f.seek(0)
                    self._lines = f.read().splitlines()
        return self._lines

    def _from_text(self, address: int) -> Mapping | None:
        lines = self._text()
        lo, hi = 0, len(lines)
        while lo < hi:  # the last line starting at or below address (lines are sorted)
            mid = (lo + hi) // 2
            if self._start(lines, mid) <= address:
                lo = mid + 1
            else:
                hi = mid
        return _parse(lines[lo - 1]) if lo else None

    def _start(self, lines: list[str], i: int) -> int:
        start = self._starts.get(i)
        if start is None:
            start = self._starts[i] = int(lines[i][: lines[i].index("-")], 16)
        return start


def _parse(line: str) -> Mapping | None:
    """A line of ``/proc/self/maps``: ``start-end perms offset major:minor inode [path]``."""
    parts = line.split(maxsplit=5)
    try:
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        major, minor = (int(v, 16) for v in parts[3].split(":"))
        perms = parts[1]
        return Mapping(lo, hi, "w" in perms, "s" in perms, int(parts[2], 16), (major, minor, int(parts[4])))
    except (IndexError, ValueError):
        return None

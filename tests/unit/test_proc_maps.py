"""This process's mappings by address: the kernel's query (Linux 6.11+) and /proc/self/maps agree."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from raysync.core import proc_maps
from raysync.core.proc_maps import Mappings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")


def _cases(tmp_path: Path) -> tuple[list[tuple[str, int, int, tuple[bool, bool]]], list[object]]:
    """(what, address, nbytes, (writable, shared)) of memory of three kinds, and what holds it."""
    shared = mmap.mmap(-1, 1 << 20)  # MAP_SHARED, as Ray's object store
    path = tmp_path / "segment"
    path.write_bytes(bytes(8192))
    with open(path, "rb") as f:
        read_only = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # as a doorbell's sealed segment
    # Private, writable memory of a mapping of its own: a file's copy-on-write pages. (Anonymous
    # private memory, numpy's, merges with the mappings beside it as other threads map theirs, so
    # its bounds could change between the two reads and the comparison would be a race.)
    backing = tmp_path / "private"
    backing.write_bytes(bytes(1 << 20))
    with open(backing, "r+b") as f:
        private = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    private[:4] = b"cow!"  # written: its own pages now, as malloc'd memory is
    return [
        ("shared", np.frombuffer(shared, np.uint8).ctypes.data + 4096, 1024, (True, True)),
        ("read-only", np.frombuffer(read_only, np.uint8).ctypes.data, 8192, (False, True)),
        ("private", np.frombuffer(private, np.uint8).ctypes.data, 1 << 20, (True, False)),
    ], [shared, read_only, private]


@pytest.mark.parametrize("query", [True, False], ids=["ioctl", "text"])
def test_each_kind_of_memory_is_found_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, query: bool
) -> None:
    if not query:
        monkeypatch.setattr(proc_maps, "_query_works", [False])
    cases, _held = _cases(tmp_path)
    with Mappings() as maps:
        text = {m.start: m for m in maps.all()}
        for what, address, nbytes, (writable, shared) in cases:
            m = maps.holding(address, nbytes)
            assert m is not None, what
            assert (m.writable, m.shared) == (writable, shared), what
            assert m.start <= address and address + nbytes <= m.end, what
            assert text[m.start] == m, what  # the same mapping, file and offset as the text says
            assert maps.holding(address, m.end - address + 1) is None, what  # runs past its end
        assert maps.holding(0, 1) is None  # nothing mapped at 0

"""Received bytes moved onto pages this process maps read-only: a write through any alias faults.

An ``apply="view"`` module's parameters look into memory other processes share (Ray's
object store). :class:`~raysync.core.readonly.ReadOnlyTensor` refuses torch's in-place
ops, but a tensor made over the same memory another way (``p.as_subclass(torch.Tensor)``,
``torch.from_dlpack(p)``, ``torch.frombuffer(p.numpy())``, ``p.untyped_storage()``, a raw
pointer) is an ordinary tensor that would write into every actor's weights and what
``hub.pull()`` returns. So the arrays a view is built on are first put on pages mapped
``PROT_READ`` here, and the processor refuses every write, whatever made it:

- memory this process maps read-only already (a doorbell's sealed segment): as it is.
- a shared mapping that is writable here (the object store's file): the same bytes through
  a second mapping of the same file pages, read-only (``mremap`` with an old size of 0 makes
  it, no copy). One per store mapping per process, kept while the store is mapped or a
  view uses it; its page tables are filled once, after the first view of 16 MiB or more,
  as the store's own mapping is (:mod:`raysync.core.prefault`), so a forward pass takes
  no page faults.
- anything else (this process's private memory: a sharded version's bucket assembled
  here, another data path's own buffers), or a shared mapping no second mapping can be
  made of (no Linux ``mremap``; huge pages): one copy into fresh pages, then made
  read-only (``mprotect``).

A write then stops the process with ``SIGSEGV``; Python's ``faulthandler`` (on in Ray's
workers) prints the traceback of the write to the worker's stderr, and Ray reports the
actor dead. Nothing else: the shared bytes stay as pushed.

Example:
    >>> buckets = read_only_buckets([ray.get(ref)])        # doctest: +SKIP
    >>> buckets[0][0].flags.writeable                       # doctest: +SKIP
    False
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from raysync.core.prefault import MADV_POPULATE_READ, MIN_VERSION_BYTES, cap_bytes
from raysync.core.proc_maps import Mapping, Mappings

__all__ = ["read_only_buckets"]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_ALIGN = 64  # of each array in a copy
_PROT_READ = 1
_MREMAP_MAYMOVE = 1
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclasses.dataclass
class _Alias:
    """A read-only second mapping of a shared file mapping's pages."""

    file: tuple[int, int, int]
    offset: int  # the file offset ``base`` maps
    length: int
    base: int
    users: weakref.WeakSet[_Pages]  # the arrays' owners over it
    populated: bool = False  # its page tables filled (once, see _populate)


class _Pages:
    """``nbytes`` read-only bytes at ``address``, for numpy; keeps what they mirror alive."""

    __slots__ = ("__array_interface__", "__weakref__", "sources")

    def __init__(self, address: int, nbytes: int, sources: list[np.ndarray]) -> None:
        self.__array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, True),  # read-only for numpy too
        }
        self.sources = sources  # the received arrays: Ray keeps their object while they live


_lock = threading.RLock()  # a collected _Pages may drop a WeakSet entry mid-call: re-entrant
_aliases: list[_Alias] = []
_no_alias: set[tuple[int, int, int]] = set()  # files mremap refused: copied instead (warned once each)


def read_only_buckets(buckets: Sequence[Sequence[np.ndarray]]) -> list[list[np.ndarray]]:
    """The buckets' arrays, same bytes, each over memory this process maps read-only.

    Arrays over a read-only mapping are returned as they are; arrays over a writable
    shared mapping become views of a read-only mapping of the same pages (no copy);
    the others are copied, one fresh read-only mapping per bucket (see the module's
    docstring). Every array returned is a non-writeable numpy array; what it is made
    from stays alive as long as it does.

    Args:
        buckets: per bucket, its uint8 arrays (what the data path fetched).

    Example:
        >>> [[a.tobytes()] for [a] in read_only_buckets([[np.arange(3, dtype=np.uint8)]])]
        [[b'\\x00\\x01\\x02']]
    """
    with _lock:
        used: dict[int, int] = {}  # id(alias) -> bytes viewed through it now
        with Mappings() as maps:
            _drop_unused(maps)
            out = [_bucket([np.asarray(a) for a in arrays], maps, used) for arrays in buckets]
        for alias in _aliases:
            if not alias.populated and used.get(id(alias), 0) >= MIN_VERSION_BYTES:
                _populate(alias)
        return out


def _bucket(arrays: list[np.ndarray], maps: Mappings, used: dict[int, int]) -> list[np.ndarray]:
    """One bucket's arrays on read-only pages: all at once when one mapping holds them (the usual)."""
    out: list[np.ndarray | None] = [_frozen(a) if a.nbytes == 0 else None for a in arrays]
    todo = [i for i, a in enumerate(arrays) if a.nbytes]
    spans = {i: (int(arrays[i].ctypes.data), arrays[i].nbytes) for i in todo if arrays[i].flags.c_contiguous}
    groups: list[tuple[list[int], Mapping | None]] = []
    if todo and len(spans) == len(todo):
        lo = min(at for at, _ in spans.values())
        m = maps.holding(lo, max(at + n for at, n in spans.values()) - lo)
        if m is not None:
            groups.append((todo, m))
    if not groups:  # not in one mapping (an assembled bucket's arrays): one by one
        groups = [([i], maps.holding(*spans[i]) if i in spans else None) for i in todo]
    copied = []
    for indices, m in groups:
        views = _in_place([arrays[i] for i in indices], [spans[i] for i in indices], m, used) if m else None
        if views is None:
            copied += indices
            continue
        for i, view in zip(indices, views, strict=True):
            out[i] = view
    if copied:
        for i, view in zip(copied, _copied([arrays[i] for i in copied]), strict=True):
            out[i] = view
    return [a for a in out if a is not None]


def _in_place(
    arrays: list[np.ndarray], spans: list[tuple[int, int]], m: Mapping, used: dict[int, int]
) -> list[np.ndarray] | None:
    """``arrays`` (non-empty, all in mapping ``m``) read-only without a copy, or None if they cannot be."""
    if not m.writable:
        return [_frozen(a) for a in arrays]  # no process can write them through this mapping
    alias = _alias_for(m) if m.shared else None
    if alias is None:
        return None
    shift = alias.base + (m.offset - alias.offset) - m.start  # from an address in m to the same byte in alias
    lo = min(at for at, _ in spans) + shift
    hi = max(at + n for at, n in spans) + shift
    used[id(alias)] = used.get(id(alias), 0) + hi - lo
    owner = _Pages(lo, hi - lo, arrays)
    alias.users.add(owner)
    flat = np.asarray(owner)
    return [flat[at + shift - lo : at + shift - lo + n] for at, n in spans]


def _frozen(arr: np.ndarray) -> np.ndarray:
    if not arr.flags.writeable:
        return arr
    view = arr.view()
    view.flags.writeable = False
    return view


def _copied(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """One fresh mapping holding a copy of each array, made read-only; views of it."""
    offsets, end = [], 0
    for arr in arrays:
        offsets.append(end)
        end = (end + arr.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    length = (end + _PAGE - 1) // _PAGE * _PAGE
    flat = np.frombuffer(mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE), dtype=np.uint8)
    for arr, at in zip(arrays, offsets, strict=True):
        flat[at : at + arr.nbytes] = np.asarray(arr).reshape(-1).view(np.uint8)
    libc = _libc()
    if libc is None or libc.mprotect(flat.ctypes.data, length, _PROT_READ) != 0:
        logger.warning("could not make a copy of received weights read-only: only numpy refuses writes")
    flat.flags.writeable = False
    return [flat[at : at + arr.nbytes] for arr, at in zip(arrays, offsets, strict=True)]


def _alias_for(m: Mapping) -> _Alias | None:
    """The read-only second mapping of ``m``'s pages (made now if need be), or None if none can be."""
    for alias in _aliases:
        if (
            alias.file == m.file
            and alias.offset <= m.offset
            and m.offset + (m.end - m.start) <= (alias.offset + alias.length)
        ):
            return alias
    libc = _libc()
    if libc is None or not sys.platform.startswith("linux") or m.file in _no_alias:
        return None
    length = m.end - m.start
    base = libc.mremap(m.start, 0, length, _MREMAP_MAYMOVE)  # old size 0: the same pages again
    if base in (None, _MAP_FAILED):
        _refused(m, f"mremap: {_errno()}")
        return None
    if libc.mprotect(base, length, _PROT_READ) != 0:
        reason = f"mprotect: {_errno()}"
        libc.munmap(base, length)
        _refused(m, reason)
        return None
    alias = _Alias(m.file, m.offset, length, base, weakref.WeakSet())
    _aliases.append(alias)
    logger.debug("a read-only mapping of %d MiB of shared weights at %#x", length >> 20, base)
    return alias


def _refused(m: Mapping, reason: str) -> None:
    _no_alias.add(m.file)
    logger.warning(
        "apply='view': cannot map shared weights read-only a second time (%s): each version "
        "is copied into read-only memory of this process instead",
        reason,
    )


def _populate(alias: _Alias) -> None:
    """Fill the alias's page tables once, up to the cap (as the store's own mapping: core/prefault.py)."""
    alias.populated = True
    length = min(alias.length, cap_bytes())
    libc = _libc()
    if length == 0 or libc is None:
        return  # reads fault the pages in instead
    t0 = time.perf_counter()
    if libc.madvise(alias.base, length, MADV_POPULATE_READ) != 0:  # a kernel before 5.14: faults instead
        logger.debug("madvise(MADV_POPULATE_READ) failed: %s", _errno())
        return
    logger.debug(
        "read-only view mapping: %.0f MiB populated in %.3f s", length / 2**20, time.perf_counter() - t0
    )


def _drop_unused(maps: Mappings) -> None:
    """Unmap aliases that no view uses and whose file this process no longer maps otherwise."""
    if all(alias.users for alias in _aliases):
        return
    ours = [(a.base, a.base + a.length) for a in _aliases]
    mapped = {m.file for m in maps.all() if not any(lo <= m.start < hi for lo, hi in ours)}
    libc = _libc()
    for alias in list(_aliases):
        if alias.file not in mapped and not alias.users and libc is not None:
            libc.munmap(alias.base, alias.length)
            _aliases.remove(alias)


@functools.cache
def _libc() -> Any:
    """The C library with the calls used here typed, or None (a platform without them)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        if sys.platform.startswith("linux"):
            libc.mremap.restype = ctypes.c_void_p
            libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def _errno() -> str:
    return os.strerror(ctypes.get_errno())

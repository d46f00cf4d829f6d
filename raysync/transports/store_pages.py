"""Map this node's Ray object store into the process's page tables once, instead of page by page.

Why: Ray's store is one shared-memory file that every worker maps. The first
time a process touches a page of it the kernel takes a fault (~1-3 us each,
write faults one 4 KiB page at a time). A pusher that writes a 64 MiB version
into a part of the store it never touched takes ~16,000 faults: measured here,
``ray.put`` of 64 MiB took 50-60 ms instead of 12 ms, and which part of the
store a version lands in changes from push to push. Readers pay the same on
their first reads.

What: once per process, after the first version of 16 MiB or more, one
``madvise(MADV_POPULATE_WRITE)`` (pusher) or ``MADV_POPULATE_READ`` (readers)
over the store's mapping (a store in ``/dev/shm`` only), capped at
:data:`~raysync.core.prefault.DEFAULT_CAP_BYTES` (environment variable ``RAYSYNC_PREFAULT_STORE_MIB``;
``0`` turns it off). That makes up to that much of the node's store resident,
as Ray's own ``preallocate_plasma_memory`` does, and costs each process
~2 MiB of page tables per GiB. Linux 5.14+; elsewhere it does nothing.

Example:
    >>> from raysync.transports.store_pages import populate_store_mapping
    >>> populate_store_mapping(write=True, version_bytes=2**30)  # doctest: +SKIP
    1073741824
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time

from raysync.core.prefault import (
    MADV_POPULATE_READ,
    MADV_POPULATE_WRITE,
    MIN_VERSION_BYTES,
    cap_bytes,
)

logger = logging.getLogger(__name__)

_done: set[bool] = set()  # the modes (write=True/False) already populated in this process
_lock = threading.Lock()


def store_mappings() -> list[tuple[int, int]]:
    """``(start, length)`` of this process's mappings of the object store file(s), largest first."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                # Only a store in shared memory: a store Ray put on disk (a small /dev/shm)
                # would turn a populate for write into gigabytes of writeback.
                if len(parts) < 6 or not parts[5].startswith("/dev/shm/plasma") or "s" not in parts[1]:
                    continue
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                found.append((lo, hi - lo))
    except OSError:
        return []
    return sorted(found, key=lambda m: -m[1])


def populate_store_mapping(write: bool, version_bytes: int) -> int:
    """Populate the store mapping once per process and mode; return the bytes populated (0: nothing).

    Call it after this process has read or written a version of
    ``version_bytes`` (the store is mapped lazily). Versions under
    :data:`MIN_VERSION_BYTES` do not trigger it: their faults cost less than
    the populate (~0.1 s per GiB for read, up to ~0.8 s per GiB for write the
    first time on a node). Never raises: a kernel without ``MADV_POPULATE_*``
    or a store that is not mapped yet just returns 0 (and is tried again next
    call in the second case).
    """
    if not sys.platform.startswith("linux") or write in _done or version_bytes < MIN_VERSION_BYTES:
        return 0
    with _lock:
        if write in _done:
            return 0
        cap = cap_bytes()
        if cap == 0:
            _done.add(write)
            return 0
        mappings = store_mappings()
        if not mappings:
            return 0  # not mapped yet: try again after the next object
        _done.add(write)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
        t0 = time.perf_counter()
        total = 0
        for start, length in mappings:
            length = min(length, cap - total)
            if length <= 0:
                break
            if libc.madvise(start, length, advice) != 0:
                err = ctypes.get_errno()
                logger.debug(
                    "madvise(MADV_POPULATE_%s) failed: %s", "WRITE" if write else "READ", os.strerror(err)
                )
                break
            total += length
        if total:
            logger.debug(
                "object store: %.0f MiB mapped for %s in %.3f s",
                total / 2**20,
                "write" if write else "read",
                time.perf_counter() - t0,
            )
        return total

"""How much of Ray's object store a process maps into its page tables ahead of its reads, and when.

One policy for both mappings of the store a process may have: the store's own
(:mod:`raysync.transports.store_pages`: pushers and readers) and an ``apply="view"``
actor's read-only second mapping of it (:mod:`raysync.core.readonly_pages`). Each is
populated once per process, after the first version of :data:`MIN_VERSION_BYTES` or more,
up to :func:`cap_bytes` (environment variable ``RAYSYNC_PREFAULT_STORE_MIB``; ``0``
turns it off).

Example:
    >>> cap_bytes() >= 0
    True
"""

from __future__ import annotations

import logging
import os

__all__ = ["DEFAULT_CAP_BYTES", "MADV_POPULATE_READ", "MADV_POPULATE_WRITE", "MIN_VERSION_BYTES", "cap_bytes"]

logger = logging.getLogger(__name__)

DEFAULT_CAP_BYTES = 4 * 2**30
MIN_VERSION_BYTES = 16 * 2**20  # smaller versions fault ~4,000 pages at most: not worth a populate
MADV_POPULATE_READ = 22  # Linux 5.14+
MADV_POPULATE_WRITE = 23


def cap_bytes() -> int:
    """The most bytes of the store to populate per mapping: ``RAYSYNC_PREFAULT_STORE_MIB`` or 4 GiB."""
    raw = os.environ.get("RAYSYNC_PREFAULT_STORE_MIB")
    if raw is None or raw.strip() == "":
        return DEFAULT_CAP_BYTES
    try:
        return max(0, int(raw)) * 2**20
    except ValueError:
        logger.warning("RAYSYNC_PREFAULT_STORE_MIB=%r is not an integer: using the default", raw)
        return DEFAULT_CAP_BYTES

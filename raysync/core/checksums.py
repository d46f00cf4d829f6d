"""CRC32s of buckets' bytes: what ``hub.push(..., checksum=True)`` adds and ``verify=True`` checks.

Torch-free (numpy and zlib), so the hub and relays can check and make them without loading
torch. :mod:`raysync.core.codec` re-exports both functions.

Example:
    >>> import numpy as np
    >>> bucket_checksums([[np.zeros(4, dtype=np.uint8)]])
    (558161692,)
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["bucket_checksums", "failed_checksums"]


def bucket_checksums(buckets: Sequence[Sequence[np.ndarray]]) -> tuple[int, ...]:
    """One CRC32 per bucket over its tensors' bytes (padding excluded).

    Example:
        >>> bucket_checksums([[np.ones(2, dtype=np.uint8)], []])
        (801444648, 0)
    """
    out = []
    for arrays in buckets:
        crc = 0
        for a in arrays:
            if a.nbytes:
                crc = zlib.crc32(a.data.cast("B"), crc)
        out.append(crc)
    return tuple(out)


def failed_checksums(expected: Sequence[int], buckets: Mapping[int, Sequence[np.ndarray]]) -> list[int]:
    """The indices, sorted, of the buckets whose bytes differ from ``expected[index]``.

    Example:
        >>> failed_checksums((0,), {0: [np.ones(2, dtype=np.uint8)]})
        [0]
    """
    order = sorted(buckets)
    got = bucket_checksums([buckets[i] for i in order])
    return [i for i, crc in zip(order, got, strict=True) if expected[i] != crc]

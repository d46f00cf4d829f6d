"""What is worked out once per layout and kept for its later versions: a small, bounded, thread-safe map.

A sharded version's merge at the hub (:func:`raysync.core.shards.merge`) and a receiver's plan
of each bucket's copies (:func:`raysync.core.assembly.bucket_plan`) depend only on the layout,
which stays the same from version to version; each keeps its work here, keyed by the layout's
own values (never by a digest alone, so a version laid out otherwise never gets another's).

Example:
    >>> plans = Kept(2)
    >>> plans.get(("a",), lambda: 1), plans.get(("a",), lambda: 2)
    (1, 1)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Kept"]

T = TypeVar("T")


class Kept(Generic[T]):
    """The values of the newest ``size`` keys; the oldest goes first when a new one comes."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._values: dict[Hashable, T] = {}  # oldest first
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The value kept for ``key``, or ``make()``'s, kept unless it raises."""
        with self._lock:
            value = self._values.get(key)
        if value is None:
            value = make()  # outside the lock: two threads may both make it, alike
            with self._lock:
                if len(self._values) >= self._size and key not in self._values:
                    del self._values[next(iter(self._values))]
                self._values[key] = value
        return value

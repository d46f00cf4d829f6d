"""What a push sends again and what it spares: ``keys=`` selection, ``delta=`` and sparse patches.

``delta=True`` re-uses the previous version's objects for buckets whose bytes are equal;
``delta="sparse"`` also puts, for a changed bucket where few elements changed, a patch
against the previous version's bucket (:mod:`raysync.core.sparse`), which receivers holding
that bucket fetch instead of the whole one.

Example:
    >>> reuse, sparse = delta_mode("sparse")
    >>> reuse, sparse
    (True, True)
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from raysync import _compat
from raysync._checks import require_ray
from raysync._protocol import bucket_ids
from raysync.core.checksums import bucket_checksums
from raysync.core.layout import Manifest, SparsePatch
from raysync.core.sparse import encode, patch_nbytes
from raysync.errors import InvalidWeightsError
from raysync.transports.base import Reuse

__all__ = ["DELTAS", "Delta", "SparseDelta", "delta_mode", "select_keys", "sparse_stats"]

Delta = bool | Literal["sparse"]
"""What ``hub.push(delta=...)`` takes."""

DELTAS = (False, True, "sparse")
"""The choices of ``delta=``."""


def delta_mode(delta: Any) -> tuple[bool, bool]:
    """``(re-use equal buckets, put patches)`` for a ``delta=`` value; ValueError naming the choices.

    Example:
        >>> delta_mode(True)
        (True, False)
    """
    if isinstance(delta, bool):
        return delta, False
    if delta == "sparse":
        return True, True
    raise ValueError(f"delta must be one of {DELTAS!r}, got {delta!r}")


class SparseDelta:
    """A :data:`~raysync.transports.base.Reuse` for ``delta="sparse"``: each bucket the wrapped one
    does not re-use (a ``keys=`` push's untouched buckets) is compared with the previous version's,
    element by element: equal, its object is re-used (as ``delta=True`` does); few elements
    changed, a patch against it is put besides the bucket.

    Args:
        reuse: the re-use of a ``keys=`` push's untouched buckets (compares no bytes).
        manifest: the new version's layout (the previous version's is the same).
        previous: the previous version's buckets (lists of uint8 arrays).
        previous_refs: their objects.
        base_version: the previous version's number.
    """

    def __init__(
        self,
        reuse: Reuse,
        manifest: Manifest,
        previous: Sequence[Any],
        previous_refs: Sequence[Any],
        base_version: int,
    ) -> None:
        self._reuse, self._manifest = reuse, manifest
        self._previous, self._refs, self._base = previous, previous_refs, base_version
        self._ids = bucket_ids(list(previous_refs))
        self.patches: list[SparsePatch] = []

    def __call__(self, b: int, bucket: list[Any]) -> Any:
        ref = self._reuse(b, bucket)
        if ref is not None:
            return ref
        base = self._ids[b]
        encoded = encode(self._manifest, b, bucket, self._previous[b])
        if encoded is not None and not encoded[1]:
            return self._refs[b]  # equal bit for bit
        if base is not None and encoded is not None:
            patch, changed = encoded
            require_ray("push")
            crc = bucket_checksums([bucket])[0]
            put = _compat.put_no_start(patch)
            self.patches.append(SparsePatch(b, self._base, base, put, patch_nbytes(patch), crc, changed))
        return None

    def attach(self, manifest: Manifest) -> Manifest:
        """``manifest`` carrying the patches put."""
        return dataclasses.replace(manifest, patches=tuple(self.patches)) if self.patches else manifest


def sparse_stats(delta: SparseDelta | None) -> dict[str, Any]:
    """What a sparse push's patches cost, for ``HubClient.last_push`` (``None``: no base, no patch)."""
    patches = delta.patches if delta is not None else []
    return {
        "buckets_sparse": len(patches),  # buckets that got a patch
        "bytes_patches": sum(p.nbytes for p in patches),  # the patches' bytes put
        "elements_changed": sum(p.changed for p in patches),  # in those buckets
    }


def select_keys(tensors: dict[str, Any], keys: Iterable[str] | Callable[[str], bool]) -> set[str]:
    """The keys a partial push sends: exact names, fnmatch patterns, or a predicate."""
    if callable(keys):
        chosen = {k for k in tensors if keys(k)}
        if not chosen:
            raise InvalidWeightsError("push(keys=<predicate>) selected no tensor")
        return chosen
    if isinstance(keys, str):
        keys = [keys]
    chosen = set()
    for pattern in keys:
        hits = {k for k in tensors if fnmatch.fnmatchcase(k, pattern)}
        if not hits:
            raise InvalidWeightsError(
                f"push(keys=...): {pattern!r} matches no tensor; keys look like {sorted(tensors)[:5]}"
            )
        chosen |= hits
    return chosen

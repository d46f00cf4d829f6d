"""A data path that lives only in the tests: it shows the transport interface is the only way in.

Its snapshot puts each bucket into the object store with every byte flipped (XOR 0x5A), so
a receiver that read the bytes any way but this class's :meth:`fetch` would hold garbage.
Every process that meets one of its versions imports it by name
(``"tests._loopback_transport:LoopbackTransport"``): pusher, subscribers, adapters.
The hub and relays never do (they do not import users' code), so they treat it with the
registry's careful default: no relay hop, no shared memory, one Ray call per receiver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch

from raysync.core.codec import bucket_checksums, pack
from raysync.core.layout import Manifest
from raysync.transports.base import Reuse, Snapshot
from raysync.transports.registry import TransportInfo

NAME = "tests._loopback_transport:LoopbackTransport"
_KEY = 0x5A

FETCHES: list[int] = []  # buckets fetched through this class, in this process


def _flip(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.bitwise_xor(np.asarray(a).reshape(-1).view(np.uint8), _KEY) for a in arrays]


class LoopbackTransport:
    """Both sides of the test data path."""

    name = NAME
    info = TransportInfo(NAME, partial=True, relayable=True, node_shared=False)

    def snapshot(
        self,
        model_id: str,
        tensors: Mapping[str, torch.Tensor],
        manifest: Manifest,
        *,
        checksum: bool = False,
        reuse: Reuse | None = None,
    ) -> Snapshot:
        buckets = pack(tensors, manifest)
        if checksum:
            manifest = manifest.with_checksums(bucket_checksums(buckets))
        manifest = manifest.with_transport(NAME)
        refs = [ray.put(_flip(bucket)) for bucket in buckets]
        return Snapshot(manifest, refs, sum(manifest.bucket_nbytes), len(refs))

    def close(self) -> None:
        """Nothing is kept between pushes here."""

    @staticmethod
    def fetch(
        manifest: Manifest, refs: Sequence[Any], needed: Sequence[int], *, timeout: float | None
    ) -> list[Any]:
        flipped = ray.get([refs[b] for b in needed], timeout=timeout)
        FETCHES.extend(needed)
        return [_flip(bucket) for bucket in flipped]

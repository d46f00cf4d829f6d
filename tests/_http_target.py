"""A new kind of receiver in one ``Target`` class: an engine updated through an HTTP endpoint.

The "request" is the body an HTTP update endpoint would take (name -> raw bytes); the
endpoint decodes it into its own tensors. Nothing else: push, pull, staleness bounds and
status come from the receiver pipeline (tests/integration/test_one_target.py shows it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from raysync.core.layout import Manifest, validate
from raysync.receivers.target import Incoming


class HttpEndpoint:
    """An engine whose weights change only through :meth:`post` (one request per version)."""

    def __init__(self, expected: dict[str, torch.Tensor]) -> None:
        self.weights = {k: torch.zeros_like(v) for k, v in expected.items()}
        self.schema = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in expected.items()}
        self.requests = 0

    def post(self, body: dict[str, bytes]) -> None:
        """The endpoint: every tensor of the body, or none (it decodes all before it swaps)."""
        decoded = {k: torch.frombuffer(bytearray(b), dtype=self.weights[k].dtype) for k, b in body.items()}
        self.weights.update({k: t.view(self.weights[k].shape) for k, t in decoded.items()})
        self.requests += 1

    # ------------------------------------------------------------------ Target
    def check(self, manifest: Manifest) -> None:
        validate(manifest, self.schema, who="the HTTP endpoint", partial=True, extra_state=False)

    def needed(self, manifest: Manifest, ids: Sequence[str | None]) -> list[int]:
        return list(range(manifest.num_buckets))  # each request carries a whole version

    def commit(self, incoming: Incoming) -> None:
        self.post({name: np.asarray(incoming.raw(name)).tobytes() for name in incoming.names()})

    def intact(self) -> bool:
        return True  # a request is taken whole or not at all

    def forget(self) -> None:
        """Nothing to forget: every request is a whole version."""

"""Helpers for tests/integration/test_targets.py, importable by actors and adapter workers.

``Engine`` stands in for an inference engine: parameters by name, filled only through
``load_weights(iterable of (name, tensor))``, as vLLM's are. ``FlakyTransport`` is the
object-store data path with a switch that makes the next fetches fail after the first
bucket arrived (``FAIL``), or hand back corrupted bytes (``CORRUPT``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import ray
import torch

import raysync
from raysync.transports.object_store import ObjectStoreTransport
from raysync.transports.registry import TransportInfo

FLAKY = "tests._targets:FlakyTransport"
SWITCH: dict[str, bool] = {"FAIL": False, "CORRUPT": False}
FETCHES: list[int] = []  # one entry per fetch in this process (its manifest's version count)


def policy_state(seed: int = 0, out: int = 4) -> dict[str, torch.Tensor]:
    """The state of ``tests._support.small_policy(seed)`` (same structure)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, out))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Engine:
    """Parameters by name; ``calls`` records the names each ``load_weights`` call got."""

    def __init__(self, seed: int = 1234) -> None:
        self.params = policy_state(seed)
        self.calls: list[list[str]] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        names = []
        for name, tensor in weights:
            self.params[name].copy_(tensor)
            names.append(name)
        self.calls.append(names)

    def loader(self) -> raysync.WeightsLoader:
        """A loader that takes exactly this engine's names, shapes and dtypes."""
        return raysync.WeightsLoader(self.load_weights, expected=self.params, name="engine")

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.params.items()}


def engine_loader() -> raysync.WeightsLoader:
    """An adapter worker's model: a fresh engine's loader."""
    return Engine().loader()


def record_engine(receiver: Any, out_dir: str, tag: str) -> None:
    """Adapter worker loop: apply versions as they come; save the engine's state after each one."""
    engine = receiver.model.load_weights.__self__
    while True:
        if receiver.receive(timeout=0.05):
            path = os.path.join(out_dir, f"{tag}-{os.getpid()}-{receiver.version_count}.pt")
            torch.save(engine.state(), path + ".tmp")
            os.replace(path + ".tmp", path)


class FlakyTransport(ObjectStoreTransport):
    """The object store, with switches (in the fetching process) to fail or corrupt fetches."""

    name = FLAKY
    info = TransportInfo(FLAKY, partial=True, relayable=True, node_shared=False)

    def snapshot(self, model_id: str, tensors: Any, manifest: Any, **kwargs: Any) -> Any:
        snap = super().snapshot(model_id, tensors, manifest, **kwargs)
        snap.manifest = snap.manifest.with_transport(FLAKY)
        return snap

    @staticmethod
    def fetch(
        manifest: Any, refs: Sequence[Any], needed: Sequence[int], *, timeout: float | None
    ) -> list[Any]:
        FETCHES.append(len(needed))
        buckets: list[Any] = []
        for b in needed:
            if SWITCH["FAIL"] and buckets:
                raise ConnectionError(f"bucket {b} did not arrive (test switch)")
            bucket = ray.get(refs[b], timeout=timeout)
            if SWITCH["CORRUPT"]:
                bucket = [np.bitwise_xor(np.asarray(a).view(np.uint8), 1) for a in bucket]
            buckets.append(bucket)
        return buckets

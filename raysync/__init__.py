"""raysync: keep the weights of many Ray actors in step with a trainer.

Example:
    >>> import ray, raysync, torch
    >>> ray.init()  # doctest: +SKIP
    >>> hub = raysync.connect()
    >>> @ray.remote
    ... @raysync.synced_model("policy")
    ... class Collector:
    ...     def __init__(self):
    ...         self.policy = torch.nn.Linear(4, 2)
    >>> collectors = [Collector.remote() for _ in range(4)]
    >>> hub.push(torch.nn.Linear(4, 2), wait=True, timeout=60)
    1
"""

from typing import TYPE_CHECKING, Any

from raysync.core.layout import Manifest, TensorEntry
from raysync.core.placement import TensorParallel
from raysync.errors import (
    AmbiguousModelError,
    ApplyError,
    ChecksumError,
    EngineNotReadyError,
    InvalidWeightsError,
    RayNotRunningError,
    RaySyncError,
    ReadOnlyWeightsError,
    StaleWriterError,
    SyncTimeoutError,
    UnknownModelError,
    WeightMismatchError,
)
from raysync.hub.settings import HubSettings

if TYPE_CHECKING:
    from raysync.client.connect import connect
    from raysync.client.hub_client import HubClient
    from raysync.core.lora import lora_adapter, peft_views
    from raysync.engines.vllm import VLLMEngine, follow_engine
    from raysync.receivers.follower import Follower, follow
    from raysync.receivers.loader import WeightsLoader
    from raysync.receivers.module_transform import RayModuleTransform
    from raysync.receivers.synced import synced_model
    from raysync.receivers.target import Incoming, ModuleTarget, Target

# Loaded on first use, so that a process that only hosts the hub (raysync.hub.actor)
# starts without importing torch: a hub restart then takes about a second, not four.
_LAZY = {
    "Follower": "raysync.receivers.follower",
    "follow": "raysync.receivers.follower",
    "follow_engine": "raysync.engines.vllm",
    "HubClient": "raysync.client.hub_client",
    "connect": "raysync.client.connect",
    "Incoming": "raysync.receivers.target",
    "lora_adapter": "raysync.core.lora",
    "peft_views": "raysync.core.lora",
    "ModuleTarget": "raysync.receivers.target",
    "RayModuleTransform": "raysync.receivers.module_transform",
    "synced_model": "raysync.receivers.synced",
    "Target": "raysync.receivers.target",
    "VLLMEngine": "raysync.engines.vllm",
    "WeightsLoader": "raysync.receivers.loader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'raysync' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "AmbiguousModelError",
    "ApplyError",
    "ChecksumError",
    "EngineNotReadyError",
    "Follower",
    "HubClient",
    "HubSettings",
    "Incoming",
    "InvalidWeightsError",
    "Manifest",
    "ModuleTarget",
    "RayModuleTransform",
    "RayNotRunningError",
    "RaySyncError",
    "ReadOnlyWeightsError",
    "StaleWriterError",
    "SyncTimeoutError",
    "Target",
    "TensorEntry",
    "TensorParallel",
    "UnknownModelError",
    "VLLMEngine",
    "WeightMismatchError",
    "WeightsLoader",
    "connect",
    "follow",
    "follow_engine",
    "lora_adapter",
    "peft_views",
    "synced_model",
]

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

from raysync.core.layout import Manifest, TensorEntry
from raysync.errors import (
    ApplyError,
    ChecksumError,
    InvalidWeightsError,
    RaySyncError,
    ReadOnlyWeightsError,
    StaleWriterError,
    SyncTimeoutError,
    UnknownModelError,
    WeightMismatchError,
)
from raysync.hub.client import HubClient, connect
from raysync.receivers.module_transform import RayModuleTransform
from raysync.receivers.synced import synced_model

__version__ = "0.1.0"

__all__ = [
    "ApplyError",
    "ChecksumError",
    "HubClient",
    "InvalidWeightsError",
    "Manifest",
    "RayModuleTransform",
    "RaySyncError",
    "ReadOnlyWeightsError",
    "StaleWriterError",
    "SyncTimeoutError",
    "TensorEntry",
    "UnknownModelError",
    "WeightMismatchError",
    "connect",
    "synced_model",
]

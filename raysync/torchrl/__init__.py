"""The torchrl-style API (torchrl's ``weight_update`` names and call shapes) and the torchrl integration.

One layer: the schemes, their senders, receivers and strategy, and
:class:`HubWeightSyncScheme` (a real torchrl ``WeightSyncScheme`` that delivers through
the hub) are built on the same codec, validation and whole-or-nothing apply as the
hub. torchrl itself is optional: nothing here imports it until it is used.

Example:
    >>> from raysync import torchrl as schemes
    >>> scheme = schemes.MultiProcessWeightSyncScheme(timeout=30)
    >>> scheme.init_on_sender(model_id="policy", pipes=[p0, p1])
"""

from typing import Any

from raysync.channels.base import TransportBackend
from raysync.channels.pipe import MPTransport
from raysync.torchrl.base import WeightSyncScheme
from raysync.torchrl.legacy import MultiProcessedRemoteWeightUpdate
from raysync.torchrl.module_transform import (
    RayModuleTransformReceiver,
    RayModuleTransformScheme,
    RayModuleTransformSender,
)
from raysync.torchrl.ray_transport import RayActorTransport, RayTransport
from raysync.torchrl.receiver import WeightReceiver
from raysync.torchrl.schemes import (
    DistributedWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    NoWeightSyncScheme,
    RayWeightSyncScheme,
    RPCWeightSyncScheme,
    SharedMemWeightSyncScheme,
)
from raysync.torchrl.sender import WeightSender
from raysync.torchrl.strategy import SharedMemTransport, WeightStrategy, resolve_model


def __getattr__(name: str) -> Any:
    # HubWeightSyncScheme subclasses torchrl's own WeightSyncScheme: torchrl (optional) is
    # imported only when it is asked for.
    if name == "HubWeightSyncScheme":
        from raysync.torchrl.integration import HubWeightSyncScheme

        return HubWeightSyncScheme
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DistributedWeightSyncScheme",
    "HubWeightSyncScheme",
    "MPTransport",
    "MultiProcessWeightSyncScheme",
    "MultiProcessedRemoteWeightUpdate",
    "NoWeightSyncScheme",
    "RPCWeightSyncScheme",
    "RayActorTransport",
    "RayModuleTransformReceiver",
    "RayModuleTransformScheme",
    "RayModuleTransformSender",
    "RayTransport",
    "RayWeightSyncScheme",
    "SharedMemTransport",
    "SharedMemWeightSyncScheme",
    "TransportBackend",
    "WeightReceiver",
    "WeightSender",
    "WeightStrategy",
    "WeightSyncScheme",
    "resolve_model",
]

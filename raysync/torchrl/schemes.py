"""The schemes: process, shared memory, none, Ray, RPC and torch.distributed."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.channels.pipe import MPTransport, SnapshotPool
from raysync.channels.shared_mem import SharedMemTransport
from raysync.core.layout import DEFAULT_BUCKET_BYTES
from raysync.torchrl.base import WeightSyncScheme, _endpoints, _NoOpTransport
from raysync.torchrl.sender import WeightSender
from raysync.torchrl.strategy import ExtractAs

if TYPE_CHECKING:
    from raysync.torchrl.ray_transport import RayTransport

__all__ = [
    "DistributedWeightSyncScheme",
    "MultiProcessWeightSyncScheme",
    "NoWeightSyncScheme",
    "RPCWeightSyncScheme",
    "RayWeightSyncScheme",
    "SharedMemWeightSyncScheme",
]


logger = logging.getLogger(__name__)


class MultiProcessWeightSyncScheme(WeightSyncScheme):
    """Workers in processes: pipes carry the signals, one shared-memory snapshot carries the bytes.

    Each version is copied once into a shared-memory snapshot (whatever the
    number of workers); each worker copies it out into its model and acks.

    Sender kwargs: ``pipes`` (one per worker). Worker kwargs: ``pipe``, ``model``.

    Example:
        >>> scheme = MultiProcessWeightSyncScheme(timeout=30)
        >>> scheme.init_on_sender(model_id="policy", pipes=[p0, p1])  # doctest: +SKIP
        >>> # each worker: scheme.init_on_receiver(model_id="policy", pipe=child, model=policy)
        >>> scheme.send(policy)  # doctest: +SKIP
    """

    backend = "process"
    transport_class: ClassVar[type[MPTransport]] = MPTransport

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> MPTransport:
        """An :class:`MPTransport` (or :class:`SharedMemTransport`) on ``pipe``."""
        pipe = kwargs.get("pipe", pipe_or_context)
        if pipe is None:
            raise ValueError(f"{type(self).__name__}.create_transport needs a pipe")
        return self.transport_class(pipe, timeout=self.timeout)

    def _sender_endpoints(self, context: Any, kwargs: dict[str, Any]) -> list[Any]:
        return _endpoints(context, kwargs, ("pipes",), type(self).__name__)

    def _worker_endpoint(self, context: Any, kwargs: dict[str, Any]) -> Any:
        pipe = kwargs.get("pipe") or getattr(context, "pipe", None)
        if pipe is None:
            raise ValueError(f"{type(self).__name__}.init_on_receiver needs pipe= (or a context with .pipe)")
        return pipe

    def _payload(self, sender: WeightSender, tensors: dict[str, torch.Tensor]) -> Any:
        if self._pool is None:
            self._pool = SnapshotPool()
        return self._pool.write(tensors)


class SharedMemWeightSyncScheme(MultiProcessWeightSyncScheme):
    """Workers point into a shared-memory snapshot; a version becomes visible only when sent.

    The sender copies each version once into a snapshot set no worker points
    at, then tells the workers; each re-points its parameters at the new set
    (no copy, same ``Parameter`` objects) and acks. Workers never see the
    trainer's live parameters (no half-finished optimizer step) nor a
    half-written version. Worker models are for inference: they share memory.

    Example:
        >>> scheme = SharedMemWeightSyncScheme()
        >>> scheme.init_on_sender(model_id="policy", pipes=[p0, p1])  # doctest: +SKIP
    """

    backend = "shared"
    transport_class = SharedMemTransport


class NoWeightSyncScheme(WeightSyncScheme):
    """Weight synchronisation switched off: sends do nothing, nothing is ever received.

    Example:
        >>> scheme = NoWeightSyncScheme()
        >>> scheme.init_on_sender(model_id="policy")
        >>> scheme.send({"w": torch.ones(1)})   # nothing happens
    """

    backend = "none"

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> _NoOpTransport:
        """A transport that moves nothing."""
        return _NoOpTransport()

    def send(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Do nothing."""

    def _worker_endpoint(self, context: Any, kwargs: dict[str, Any]) -> Any:
        return _NoOpTransport()


class RayWeightSyncScheme(WeightSyncScheme):
    """Ray actors as workers: each version goes into the object store once, whatever the number of actors.

    Direct mode (default): the sender ``ray.put``\\ s each bucket once and asks
    every chosen actor to apply ``(manifest, refs)``; each reads the buckets
    zero-copy from its node's store and applies them whole. Any actor works:
    the model is the receiver registered in it with ``init_on_receiver``, or
    the attribute ``model_path`` (default: the model id) of the actor.

    Hub mode (``hub="name"``): ``send`` is ``raysync.connect(hub).push(...,
    wait=True)``; the workers are ``@raysync.synced_model`` actors subscribed
    to that hub (``worker_ids`` cannot pick among them).

    Sender kwargs: ``remote_collectors`` (or ``actors``). Worker kwargs: ``model``.

    Example:
        >>> scheme = RayWeightSyncScheme(timeout=30)
        >>> scheme.init_on_sender(model_id="policy", remote_collectors=actors)
        >>> scheme.send(policy)                   # every actor holds it when this returns
    """

    backend = "ray"

    def __init__(
        self,
        strategy: ExtractAs = "tensordict",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        hub: str | None = None,
        namespace: str | None = None,
        model_path: str | None = None,
    ) -> None:
        super().__init__(strategy, timeout=timeout)
        self.hub = hub
        self.namespace = namespace
        self.model_path = model_path

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> RayTransport:
        """A :class:`RayTransport` for one actor."""
        from raysync.torchrl.ray_transport import RayTransport

        actor = kwargs.get("remote_collector", pipe_or_context)
        return RayTransport(actor, timeout=self.timeout, model_path=self.model_path)

    def _sender_endpoints(self, context: Any, kwargs: dict[str, Any]) -> list[Any]:
        if self.hub is not None:
            return []
        return _endpoints(context, kwargs, ("remote_collectors", "actors", "actor_refs"), type(self).__name__)

    def _payload(self, sender: WeightSender, tensors: dict[str, torch.Tensor]) -> Any:
        from raysync.torchrl.ray_transport import put_version

        return put_version(tensors)

    def _hub(self) -> Any:
        if self._hub_client is None:
            from raysync.hub.client import connect

            self._hub_client = connect(self.hub or "raysync", namespace=self.namespace)
        return self._hub_client

    def send(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Send a version and wait until the actors applied it (through the hub in hub mode)."""
        if self.hub is None:
            super().send(weights, worker_ids)
            return
        if worker_ids is not None:
            raise ValueError(
                "worker_ids cannot be used with hub=: every subscriber of the hub gets each version"
            )
        sender = self.get_sender()
        self._hub().push(sender._prepare(weights), sender.model_id, wait=True, timeout=self.timeout)

    def _connect_sender(self, weights: Any) -> None:
        if self.hub is not None or self.get_sender().transports:
            self.send(weights)


class RPCWeightSyncScheme(WeightSyncScheme):
    """Workers reached over ``torch.distributed.rpc``; bytes move with torch.distributed send/recv.

    Signals (manifest, acks) go over RPC; the bytes over a gloo (CPU) or nccl
    group, in the order that cannot deadlock. See
    :class:`raysync.channels.rpc.RPCTransport`.

    Sender kwargs: ``endpoints`` (one per worker: what ``RPCTransport`` takes,
    a dict of its keyword arguments or a tuple of its positional ones).
    Worker kwargs: ``endpoint`` and ``model``.

    Example:
        >>> scheme = RPCWeightSyncScheme(timeout=30)
        >>> scheme.init_on_sender(model_id="policy", endpoints=[{"worker_name": "w1", "peer_rank": 1}])
    """

    backend = "rpc"

    def __init__(
        self, strategy: ExtractAs = "tensordict", *, timeout: float = DEFAULT_TIMEOUT, **options: Any
    ):
        super().__init__(strategy, timeout=timeout)
        self.options = dict(options)

    def _transport_class(self) -> type:
        from raysync.channels.rpc import RPCTransport

        return RPCTransport

    def _payload(self, sender: WeightSender, tensors: dict[str, torch.Tensor]) -> Any:
        from raysync.channels._p2p import pack_version

        # Packed once per push; every worker's transport sends the same flat buckets.
        bucket_bytes = int(self.options.get("bucket_bytes", DEFAULT_BUCKET_BYTES))
        return pack_version(sender.model_id, tensors, bucket_bytes=bucket_bytes)

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> Any:
        """The transport for one worker, built from ``pipe_or_context`` (dict or tuple) and kwargs."""
        cls = self._transport_class()
        if hasattr(pipe_or_context, "receive_weights"):
            return pipe_or_context
        options = {**self.options, **kwargs}
        options.setdefault("timeout", self.timeout)
        if isinstance(pipe_or_context, Mapping):
            return cls(**{**options, **pipe_or_context})
        if isinstance(pipe_or_context, tuple):
            return cls(*pipe_or_context, **options)
        if pipe_or_context is None:
            return cls(**options)
        return cls(pipe_or_context, **options)

    def _sender_endpoints(self, context: Any, kwargs: dict[str, Any]) -> list[Any]:
        return _endpoints(context, kwargs, ("endpoints", "transports"), type(self).__name__)

    def _worker_endpoint(self, context: Any, kwargs: dict[str, Any]) -> Any:
        endpoint = kwargs.get("endpoint", kwargs.get("transport"))
        if endpoint is None and context is not None:
            endpoint = getattr(context, "endpoint", None)
        if endpoint is None:
            raise ValueError(f"{type(self).__name__}.init_on_receiver needs endpoint= (or transport=)")
        return endpoint if hasattr(endpoint, "receive_weights") else self.create_transport(endpoint)


class DistributedWeightSyncScheme(RPCWeightSyncScheme):
    """Workers in a torch.distributed group: a TCPStore for signals, send/recv for bytes.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        sync: kept for torchrl compatibility (sends always wait for acks; use
            ``send_async`` / ``wait_async`` not to).

    See :class:`raysync.channels.distributed.DistributedTransport`.

    Example:
        >>> scheme = DistributedWeightSyncScheme(backend="gloo", timeout=30)
        >>> scheme.init_on_sender(model_id="policy", endpoints=[{"store": store, "rank": 1}])
    """

    backend = "distributed"

    def __init__(
        self,
        backend: str = "gloo",
        sync: bool = True,
        *,
        strategy: ExtractAs = "tensordict",
        timeout: float = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> None:
        super().__init__(strategy, timeout=timeout, **options)
        self.dist_backend = backend
        self.sync = sync

    def _transport_class(self) -> type:
        from raysync.channels.distributed import DistributedTransport

        return DistributedTransport

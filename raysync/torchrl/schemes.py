"""The schemes: process, shared memory, none, Ray, RPC and torch.distributed."""

from __future__ import annotations

import multiprocessing
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.channels.pipe import MPTransport, SnapshotPool
from raysync.core.layout import DEFAULT_BUCKET_BYTES
from raysync.torchrl.base import WeightSyncScheme
from raysync.torchrl.collector_context import NoOpTransport, endpoints, is_weightless, policy_of
from raysync.torchrl.receiver import BackgroundReceiver
from raysync.torchrl.sender import WeightSender
from raysync.torchrl.strategy import ExtractAs, SharedMemTransport

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


class MultiProcessWeightSyncScheme(WeightSyncScheme):
    """Workers in processes: pipes carry the signals, one shared-memory snapshot carries the bytes.

    Each version is copied once into a shared-memory snapshot (whatever the
    number of workers); each worker copies it out into its model and acks.

    With torchrl's multi-process collectors (``MultiSyncCollector``,
    ``MultiAsyncCollector``, ``AsyncCollector``) pass it as
    ``weight_sync_schemes={"policy": scheme}``: the scheme makes one pipe per
    worker (never the collector's own), the workers' weightless policy gets
    the first version before it acts, and a thread in each worker applies each
    later version between two forward calls of the policy and acks it.
    ``collector.update_policy_weights_()`` returns once every worker applied
    it, or raises :class:`raysync.SyncTimeoutError` / :class:`raysync.ApplyError`
    naming the workers that did not.

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"``.
        sync: ``send`` waits for every worker's ack (default); ``False``: the
            next ``send`` waits for them (and reports failures) first.
        timeout: seconds a send waits for the acks.

    Sender kwargs: ``pipes`` (one per worker), or a torchrl collector as
    ``context``. Worker kwargs: ``pipe`` (or ``worker_idx`` with such a
    collector), ``model``.

    Example:
        >>> scheme = MultiProcessWeightSyncScheme(timeout=30)
        >>> collector = MultiSyncCollector([make_env] * 2, policy, frames_per_batch=64,
        ...                                total_frames=-1, weight_sync_schemes={"policy": scheme})
        >>> collector.update_policy_weights_()   # every worker acts with policy's weights from now on
    """

    backend = "process"
    transport_class: ClassVar[type[MPTransport]] = MPTransport

    def __init__(
        self,
        strategy: ExtractAs = "tensordict",
        sync: bool = True,
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(strategy, timeout=timeout, sync=sync)
        self._worker_ends: dict[int, Any] = {}  # pickled with the scheme: each worker takes its own
        self._own_channels = False
        self._in_background = False
        self.per_worker_weights = False  # set when the workers have distinct policy factories

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> MPTransport:
        """An :class:`MPTransport` (or :class:`SharedMemTransport`) on ``pipe``."""
        pipe = kwargs.get("pipe", pipe_or_context)
        if pipe is None:
            raise ValueError(f"{type(self).__name__}.create_transport needs a pipe")
        return self.transport_class(pipe, timeout=self.timeout)

    def _sender_endpoints(self, context: Any, kwargs: dict[str, Any]) -> list[Any]:
        name = type(self).__name__
        if kwargs.get("pipes") is not None:
            self._own_channels = False
            return list(kwargs["pipes"])
        if kwargs.get("remote_collectors") is not None:
            raise ValueError(
                f"{name} serves worker processes, not Ray actors: with RayCollector use "
                "raysync.schemes.RayWeightSyncScheme"
            )
        num_workers = kwargs.get("num_workers")
        for sized in ("params_map", "devices"):  # torchrl's other ways of naming the workers
            if num_workers is None and kwargs.get(sized):
                num_workers = len(kwargs[sized])
        if num_workers is None and context is not None:
            num_workers = getattr(context, "num_workers", None)
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(
                f"{name}.init_on_sender needs pipes= (one per worker) or a multi-process collector as "
                "context (torchrl's MultiSyncCollector, MultiAsyncCollector, AsyncCollector); a "
                "Collector runs its policy in its own process: use NoWeightSyncScheme there"
            )
        mp_context = kwargs.get("ctx") or multiprocessing.get_context()
        parents = []
        self._worker_ends = {}
        for idx in range(num_workers):
            parent, child = mp_context.Pipe()
            self._worker_ends[idx] = child
            parents.append(parent)
        self._own_channels = True
        return parents

    def _worker_endpoint(self, context: Any, kwargs: dict[str, Any]) -> Any:
        pipe = kwargs.get("pipe") or getattr(context, "pipe", None)
        self._in_background = False
        if pipe is None and self.worker_idx in self._worker_ends:
            self._in_background = True  # torchrl's workers never call receive(): a thread does
            return self._worker_ends[self.worker_idx]
        if pipe is None:
            raise ValueError(
                f"{type(self).__name__}.init_on_receiver needs pipe= (or a context with .pipe), or "
                f"worker_idx= of a scheme a torchrl collector initialised (worker_idx="
                f"{self.worker_idx!r}; this scheme has channels for workers {sorted(self._worker_ends)})"
            )
        return pipe

    def _payload(self, sender: WeightSender, tensors: dict[str, torch.Tensor]) -> Any:
        if self._pool is None:
            self._pool = SnapshotPool()
        return self._pool.write(tensors, sender._manifest(tensors))

    def _connect_sender(self, weights: Any) -> None:
        sender = self.get_sender()
        if not sender.transports:
            return
        if not self._own_channels:
            sender.send(weights)
            return
        # A torchrl collector: its workers are still starting. The first version goes now; the
        # next send waits for its acks (a worker that failed to start is reported by torchrl).
        if weights is None:
            context = self.context
            weights = self.prepare_weights(None, sender.model_id, self.weight_strategy, context)
            if weights is None:
                weights = sender._source_model
            if weights is None and context is not None and sender.model_id == "policy":
                if _distinct_factories(context):
                    # each worker built its own policy from its own factory (torchrl's per-worker
                    # weights): those are its first weights, later sends name the workers
                    self.per_worker_weights = True
                else:
                    weights = policy_of(context, from_factory=True)
        if weights is not None:
            sender.send_async(weights)
        for end in self._worker_ends.values():
            end.close()  # the workers hold theirs: a dead worker's pipe then reads as closed
        self._worker_ends = {}

    def _connect_receiver(self) -> None:
        receiver = self.get_receiver()
        if not self._in_background:
            super()._connect_receiver()
            return
        model = receiver.model
        if is_weightless(model):  # torchrl sent a meta policy: it needs a version before it acts
            super()._connect_receiver()
        receiver._install_guard()
        self._background = BackgroundReceiver(
            receiver, name=f"{receiver.model_id}-{self.worker_idx}", on_applied=self._after_apply
        )
        self._background.start()

    def _after_apply(self) -> None:
        # torchrl's leaf collector counts policy versions (track_policy_version) here.
        bump = getattr(self.context, "increment_version", None)
        if callable(bump):
            bump()


class SharedMemWeightSyncScheme(MultiProcessWeightSyncScheme):
    """Workers point into a shared-memory snapshot; a version becomes visible only when sent.

    The sender copies each version once into a snapshot set no worker points
    at, then tells the workers; each re-points its parameters at the new set
    (no copy, same ``Parameter`` objects) and acks. Workers never see the
    trainer's live parameters (no half-finished optimizer step) nor a
    half-written version. Worker models are for inference: they share memory.
    Used with torchrl's collectors as :class:`MultiProcessWeightSyncScheme` is.

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"``.
        sync: see :class:`MultiProcessWeightSyncScheme`.
        per_worker_weights: torchrl's flag, kept: ``send({worker_idx: weights})``
            gives each worker its own weights whatever its value.
        timeout: seconds a send waits for the acks.

    Example:
        >>> scheme = SharedMemWeightSyncScheme()
        >>> scheme.init_on_sender(model_id="policy", pipes=[p0, p1])  # doctest: +SKIP
    """

    backend = "shared"
    transport_class = SharedMemTransport

    def __init__(
        self,
        strategy: ExtractAs = "tensordict",
        sync: bool = True,
        per_worker_weights: bool = False,
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(strategy, sync, timeout=timeout)
        self.per_worker_weights = bool(per_worker_weights)


class RayWeightSyncScheme(WeightSyncScheme):
    """Ray actors as workers: each version goes into the object store once, whatever the number of actors.

    Direct mode (default): the sender ``ray.put``\\ s each bucket once and asks
    every chosen actor to apply ``(manifest, refs)``; each reads the buckets
    zero-copy from its node's store and applies them whole, between two of its
    tasks. Any actor works: the model is the receiver registered in it with
    ``init_on_receiver``, or the attribute ``model_path`` (default: the model
    id) of the actor. torchrl's ``RayCollector`` accepts it as its
    ``weight_sync_schemes={"policy": scheme}``.

    Hub mode (``hub="name"``): ``send`` is ``raysync.connect(hub).push(...,
    wait=True)``; the workers are ``@raysync.synced_model`` actors subscribed
    to that hub (``worker_ids`` cannot pick among them).

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"``.
        backend: torchrl's torch.distributed backend name, accepted and unused:
            the bytes go through Ray's object store.
        timeout: seconds a send waits for the actors.
        hub, namespace: hub mode (see above).
        model_path: the model's attribute path on the actors when none was registered.
        sync: see :class:`WeightSyncScheme`.

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
        backend: str = "gloo",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        hub: str | None = None,
        namespace: str | None = None,
        model_path: str | None = None,
        sync: bool = True,
    ) -> None:
        super().__init__(strategy, timeout=timeout, sync=sync)
        self._backend = backend
        self.hub = hub
        self.namespace = namespace
        self.model_path = model_path

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> RayTransport:
        """A :class:`RayTransport` for one actor."""
        from raysync.torchrl.ray_transport import RayTransport

        actor = kwargs.get("remote_actor", kwargs.get("remote_collector", pipe_or_context))
        return RayTransport(actor, timeout=self.timeout, model_path=self.model_path)

    def _sender_endpoints(self, context: Any, kwargs: dict[str, Any]) -> list[Any]:
        if self.hub is not None:
            return []
        return endpoints(context, kwargs, ("remote_collectors", "actors", "actor_refs"), type(self).__name__)

    def _payload(self, sender: WeightSender, tensors: dict[str, torch.Tensor]) -> Any:
        from raysync.torchrl.ray_transport import snapshot

        return snapshot(tensors, manifest=sender._manifest(tensors))

    def _hub(self) -> Any:
        if self._hub_client is None:
            from raysync.client.connect import connect

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
        if self.hub is not None:
            self.send(weights)
            return
        if not self.get_sender().transports:
            return
        if weights is None and self.model is None:
            return  # actors built their own policy (policy_factory): nothing to send yet, as torchrl
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
        return endpoints(context, kwargs, ("endpoints", "transports"), type(self).__name__)

    def _worker_endpoint(self, context: Any, kwargs: dict[str, Any]) -> Any:
        endpoint = kwargs.get("endpoint", kwargs.get("transport"))
        if endpoint is None and context is not None:
            endpoint = getattr(context, "endpoint", None)
        if endpoint is None:
            raise ValueError(f"{type(self).__name__}.init_on_receiver needs endpoint= (or transport=)")
        return endpoint  # the receiver makes the transport with create_transport if it is not one


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


class _NoOpSender(WeightSender):
    """The sender of :class:`NoWeightSyncScheme`: every send does nothing (the reference's no-op sender)."""

    # send() and update_weights() are send_async() then wait_async(): nothing either.
    def send_async(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Do nothing."""

    def wait_async(self, timeout: float | None = None) -> None:
        """Do nothing: no send is ever pending."""


class NoWeightSyncScheme(WeightSyncScheme):
    """Weight synchronisation switched off: sends do nothing, nothing is ever received.

    As torchrl's: with any collector, ``update_policy_weights_()`` does nothing.
    Its sender (``get_sender()``) does nothing either, as the reference's:
    ``send``, ``send_async``, ``wait_async`` and ``update_weights`` return at
    once, with or without weights or workers.
    A worker handed a weightless (meta) policy (a multi-process collector given
    ``policy=``) is refused with a clear error at start-up: pass ``policy_factory=``.

    Example:
        >>> scheme = NoWeightSyncScheme()
        >>> scheme.init_on_sender(model_id="policy")
        >>> scheme.send({"w": torch.ones(1)})   # nothing happens
        >>> scheme.get_sender().send()          # nor here
    """

    backend = "none"

    def create_sender(self) -> WeightSender:
        """A sender whose sends do nothing."""
        return _NoOpSender(self)

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> NoOpTransport:
        """A transport that moves nothing."""
        return NoOpTransport()

    def send(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Do nothing."""

    def _connect_sender(self, weights: Any) -> None:
        """Nothing to send."""

    def _worker_endpoint(self, context: Any, kwargs: dict[str, Any]) -> Any:
        return NoOpTransport()

    def _check_receiver_model(self, model: Any) -> None:
        if is_weightless(model):
            raise ValueError(
                "NoWeightSyncScheme cannot fill the weightless (meta) policy a multi-process collector "
                "sends its workers when given policy=: pass policy_factory= so that each worker builds "
                "its own policy, or use a scheme that syncs (MultiProcessWeightSyncScheme, "
                "SharedMemWeightSyncScheme)"
            )


def _distinct_factories(context: Any) -> bool:
    """Whether a collector's workers were given different ``policy_factory`` callables."""
    factories = getattr(context, "policy_factory", None)
    if not isinstance(factories, Sequence) or isinstance(factories, str) or len(factories) < 2:
        return False
    return any(f is not factories[0] for f in factories)

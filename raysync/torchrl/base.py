"""``WeightSyncScheme``: the base every torchrl-style scheme shares (torchrl 0.14's call shapes)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from raysync._checks import check_timeout
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.channels.pipe import SnapshotPool
from raysync.errors import (
    SyncTimeoutError,
)
from raysync.torchrl.receiver import _RECEIVERS, _RECEIVERS_LOCK, WeightReceiver
from raysync.torchrl.sender import WeightSender
from raysync.torchrl.strategy import ExtractAs, WeightStrategy, _strategy, resolve_model

if TYPE_CHECKING:
    pass

__all__ = ["WeightSyncScheme"]


class _NoOpTransport:
    """The transport of :class:`NoWeightSyncScheme`: accepts everything, moves nothing."""

    timeout = DEFAULT_TIMEOUT

    def send_weights(self, *args: Any) -> None:
        """Do nothing."""

    def send_weights_async(self, *args: Any) -> None:
        """Do nothing."""

    def wait_ack(self, timeout: float | None = None) -> None:
        """Do nothing."""

    def receive_weights(self, timeout: float | None = 1.0) -> tuple[str, dict[str, torch.Tensor]] | None:
        """Nothing ever arrives."""
        return None

    def send_ack(self, message: str = "updated") -> None:
        """Do nothing."""

    def check_connection(self) -> bool:
        """Always connected."""
        return True


class WeightSyncScheme:
    """How to synchronise ONE model across workers: configuration plus, once initialised, runtime state.

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"`` (see :class:`WeightStrategy`).
        timeout: seconds any wait of this scheme may take before raising
            :class:`raysync.SyncTimeoutError`.

    Pickling keeps the configuration (strategy, timeout, options) and drops
    the runtime state (sender, receiver, transports, snapshot pools), so a
    scheme can be handed to worker processes and actors.

    Example:
        >>> scheme = WeightSyncScheme.from_backend("process", timeout=30)
        >>> type(scheme).__name__
        'MultiProcessWeightSyncScheme'
    """

    backend: ClassVar[str] = ""
    _RUNTIME: ClassVar[tuple[str, ...]] = ("_sender", "_receiver", "_pool", "_context_ref", "_hub_client")

    def __init__(self, strategy: ExtractAs = "tensordict", *, timeout: float = DEFAULT_TIMEOUT) -> None:
        _strategy(strategy)  # validates the name
        check_timeout(timeout, allow_none=False, positive=True)
        self.strategy = strategy
        self.timeout = float(timeout)
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._pool: SnapshotPool | None = None
        self._context_ref: Any = None
        self._hub_client: Any = None
        self._model_id: str | None = None
        self._initialized_on_sender = False
        self._initialized_on_worker = False
        self._synchronized = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_backend(cls, backend: str, **kwargs: Any) -> WeightSyncScheme:
        """A scheme by deployment backend name (torchrl 0.14's names).

        Args:
            backend: ``"none"``, ``"shared"``, ``"process"``, ``"ray"``,
                ``"ray_module"``, ``"rpc"`` or ``"distributed"`` (aliases:
                ``"direct"``, ``"thread"``, ``"multiprocessing"``).
            **kwargs: passed to the scheme's constructor.

        Example:
            >>> WeightSyncScheme.from_backend("shared").backend
            'shared'
        """
        name = _BACKEND_ALIASES.get(backend, backend)
        registry = {c.backend: c for c in _all_subclasses(WeightSyncScheme) if c.backend}
        if name not in registry:
            choices = sorted(set(registry) | set(_BACKEND_ALIASES))
            raise ValueError(f"unknown weight-sync backend {backend!r}; expected one of {choices}")
        return registry[name](**kwargs)

    @property
    def weight_strategy(self) -> WeightStrategy:
        """The :class:`WeightStrategy` for ``strategy``."""
        return _strategy(self.strategy)

    @property
    def model_id(self) -> str | None:
        """The model this scheme synchronises (set by ``init_on_*``)."""
        return self._model_id

    @property
    def initialized_on_sender(self) -> bool:
        """Whether ``init_on_sender`` ran."""
        return self._initialized_on_sender

    @property
    def initialized_on_receiver(self) -> bool:
        """Whether ``init_on_receiver`` / ``init_on_worker`` ran."""
        return self._initialized_on_worker

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in self._RUNTIME:
            state[key] = None
        state["_initialized_on_sender"] = False
        state["_initialized_on_worker"] = False
        state["_synchronized"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------------ hooks
    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> Any:
        """The transport for one worker (``pipe_or_context``: a pipe, an actor, ...)."""
        raise NotImplementedError(f"{type(self).__name__} does not create transports")

    def create_sender(self) -> WeightSender:
        """A new sender for this scheme."""
        return WeightSender(self)

    def create_receiver(self) -> WeightReceiver:
        """A new receiver for this scheme."""
        return WeightReceiver(self)

    def _sender_endpoints(self, context: Any, kwargs: dict[str, Any]) -> list[Any]:
        return []

    def _worker_endpoint(self, context: Any, kwargs: dict[str, Any]) -> Any:
        return None

    def _payload(self, sender: WeightSender, tensors: dict[str, torch.Tensor]) -> Any:
        return tensors

    # ------------------------------------------------------------------ init
    def init_on_sender(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Set up the sender side (trainer / main process).

        Args:
            model_id: the model's id, also its path on ``context`` (``"env.transform[0]"``).
            context: an object (a collector) giving the endpoints (``pipes``,
                ``remote_collectors``, ...) and the model.
            **kwargs: instead of ``context``: the endpoints (see the scheme),
                ``model=`` (the source module, used when ``send()`` gets no weights).
        """
        sender = self.create_sender()
        sender._model_id = model_id
        if context is not None:
            sender._context_ref = weakref.ref(context)
            self._context_ref = sender._context_ref
        sender._source_model = kwargs.get("model") or kwargs.get("source_model")
        for idx, endpoint in enumerate(self._sender_endpoints(context, kwargs)):
            sender._register_worker(idx, endpoint)
        self._model_id = model_id
        self._sender = sender
        self._initialized_on_sender = True

    def init_on_worker(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Set up the worker side (the reference's name for :meth:`init_on_receiver`).

        Args:
            model_id: the model's id, also its path on ``context``.
            context: an object (the inner collector) giving ``pipe`` and the model.
            **kwargs: instead of ``context``: the endpoint (``pipe=`` ...) and ``model=``.
        """
        if self._initialized_on_sender:
            self.__setstate__(self.__getstate__())  # a scheme is one side or the other
        receiver = self.create_receiver()
        receiver._model_id = model_id
        if context is not None:
            receiver._context_ref = weakref.ref(context)
        model = kwargs.get("model")
        if model is None and context is not None and hasattr(context, "get_model"):
            model = context.get_model(model_id)
        receiver._register_model(model if model is not None else model_id)
        endpoint = self._worker_endpoint(context, kwargs)
        if endpoint is not None:
            receiver._register_worker_transport(endpoint)
        with _RECEIVERS_LOCK:
            _RECEIVERS[model_id] = receiver
        self._model_id = model_id
        self._receiver = receiver
        self._initialized_on_worker = True

    def init_on_receiver(self, *, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Set up the worker side (torchrl 0.14's name); see :meth:`init_on_worker`."""
        self.init_on_worker(model_id, context, **kwargs)

    def get_sender(self) -> WeightSender:
        """The sender (after :meth:`init_on_sender`)."""
        if self._sender is None:
            raise RuntimeError(f"call init_on_sender() before get_sender() on {type(self).__name__}")
        return self._sender

    def get_receiver(self) -> WeightReceiver:
        """The receiver (after :meth:`init_on_receiver`)."""
        if self._receiver is None:
            raise RuntimeError(f"call init_on_receiver() before get_receiver() on {type(self).__name__}")
        return self._receiver

    # ------------------------------------------------------------------ use
    def prepare_weights(
        self, weights: Any, model_id: str, strategy: WeightStrategy, context: Any = None
    ) -> Any:
        """What to send: ``weights`` as given, or the model ``model_id`` resolved on ``context``.

        A string is a model path on ``context``. Returns ``None`` when there is
        nothing to send (no weights, no context).

        Raises:
            UnknownModelError: ``model_id`` (or the string) names no model on ``context``.
        """
        if weights is None:
            if context is None:
                return None
            return resolve_model(context, model_id)
        if isinstance(weights, str):
            if context is None:
                raise ValueError(f"cannot resolve the model path {weights!r} without a context")
            return resolve_model(context, weights)
        return weights

    def send(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Send a version and wait for the workers (see :meth:`WeightSender.send`)."""
        self.get_sender().send(weights, worker_ids)

    def receive(self, timeout: float | None = 0.001) -> bool:
        """Worker: apply a version if one arrives (see :meth:`WeightReceiver.receive`)."""
        return self.get_receiver().receive(timeout)

    def apply_weights(self, weights: Any) -> None:
        """Worker: apply ``weights`` to the registered model, whole or not at all."""
        self.get_receiver().apply_weights(weights)

    def connect(self, *, worker_idx: int | None = None, weights: Any = None) -> None:
        """The first synchronisation, once the workers are up.

        On the sender: send the current weights to every worker and wait. On a
        worker: wait (up to ``timeout``) for that first version and apply it.

        Raises:
            SyncTimeoutError: the first version did not arrive in time.
        """
        if self._synchronized:
            raise RuntimeError("connect() was already called on this scheme")
        if self._sender is not None:
            self._connect_sender(weights)
        elif self._receiver is not None:
            if weights is not None:
                raise RuntimeError("weights are given to connect() on the sender, not on a worker")
            self._connect_receiver()
        else:
            raise RuntimeError("call init_on_sender() or init_on_receiver() before connect()")
        self._synchronized = True

    def _connect_sender(self, weights: Any) -> None:
        if self.get_sender().transports:
            self.send(weights)

    def _connect_receiver(self) -> None:
        receiver = self.get_receiver()
        if receiver.transport is None or isinstance(receiver.transport, _NoOpTransport):
            return
        if not receiver.receive(timeout=self.timeout):
            if receiver.last_error is not None:
                raise receiver.last_error
            raise SyncTimeoutError(f"no first version of {self._model_id!r} arrived within {self.timeout} s")

    def shutdown(self) -> None:
        """Drop the runtime state (transports, snapshots); the configuration stays. Safe to repeat."""
        if self._receiver is not None:
            with _RECEIVERS_LOCK:
                if _RECEIVERS.get(self._receiver.model_id) is self._receiver:
                    del _RECEIVERS[self._receiver.model_id]
        self.__setstate__(self.__getstate__())


_BACKEND_ALIASES = {"direct": "none", "thread": "shared", "multiprocessing": "process", "mp": "process"}


def _all_subclasses(cls: type[WeightSyncScheme]) -> Iterator[type[WeightSyncScheme]]:
    sub: type[WeightSyncScheme]
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def _endpoints(context: Any, kwargs: dict[str, Any], names: Sequence[str], what: str) -> list[Any]:
    for name in names:
        value = kwargs.get(name)
        if value is None and context is not None:
            value = getattr(context, name, None)
        if value is not None:
            return list(value)
    raise ValueError(f"{what} needs {' or '.join(names)}, as a keyword or an attribute of the context")

"""``WeightSyncScheme``: the base every torchrl-style scheme shares (torchrl 0.14's call shapes).

torchrl's collectors accept raysync's schemes as their own: torchrl's
``WeightSyncScheme`` is an ABC and its collectors check ``isinstance``, so
raysync's base class is registered with it (:func:`register_with_torchrl`).
torchrl stays optional: the registration happens when torchrl's module is
loaded, in whichever order the two are imported, and never imports torchrl.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from raysync._checks import check_timeout
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.channels.pipe import SnapshotPool
from raysync.errors import (
    SyncTimeoutError,
)
from raysync.torchrl.collector_context import (
    NoOpTransport,
    first_given,
    is_per_worker,
    maybe_resolve,
    policy_of,
    weak_ref,
)
from raysync.torchrl.receiver import _RECEIVERS, _RECEIVERS_LOCK, WeightReceiver
from raysync.torchrl.registration import register_with_torchrl, set_scheme_base
from raysync.torchrl.sender import WeightSender
from raysync.torchrl.strategy import ExtractAs, WeightStrategy, _strategy, resolve_model

__all__ = ["WeightSyncScheme", "register_with_torchrl"]


# ---------------------------------------------------------------------- no-op transport
class WeightSyncScheme:
    """How to synchronise ONE model across workers: configuration plus, once initialised, runtime state.

    Drop-in for torchrl 0.14's ``WeightSyncScheme``: torchrl's collectors
    accept raysync's schemes (``weight_sync_schemes={"policy": scheme}``) and
    find here what they read (``context``, ``model``, ``strategy_str``,
    ``synchronized_on_sender``, ``worker_idx``, ...).

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"`` (see :class:`WeightStrategy`).
        timeout: seconds any wait of this scheme may take before raising
            :class:`raysync.SyncTimeoutError`.
        sync: ``send`` waits until every worker applied the version (default);
            ``False``: it returns once sent, and the next ``send`` first waits
            for (and reports) the acks of the previous one.

    Pickling keeps the configuration (strategy, timeout, options, and the
    worker ends of channels a scheme made itself) and drops the runtime state
    (sender, receiver, transports, snapshot pools), so a scheme can be handed
    to worker processes and actors.

    Example:
        >>> scheme = WeightSyncScheme.from_backend("process", timeout=30)
        >>> type(scheme).__name__
        'MultiProcessWeightSyncScheme'
    """

    backend: ClassVar[str] = ""
    _RUNTIME: ClassVar[tuple[str, ...]] = (
        "_sender",
        "_receiver",
        "_pool",
        "_context_ref",
        "_hub_client",
        "_source_ref",
        "_background",
    )

    def __init__(
        self, strategy: ExtractAs = "tensordict", *, timeout: float = DEFAULT_TIMEOUT, sync: bool = True
    ) -> None:
        _strategy(strategy)  # validates the name
        check_timeout(timeout, allow_none=False, positive=True)
        self.strategy = strategy
        self.timeout = float(timeout)
        self.sync = bool(sync)
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._pool: SnapshotPool | None = None
        self._context_ref: Any = None
        self._hub_client: Any = None
        self._source_ref: Any = None
        self._background: Any = None
        self.model_id: str | None = None  # the model this scheme synchronises (set by init_on_*)
        self.worker_idx: int | None = None  # this worker's index (receiver side, set by init_on_receiver)
        self._initialized_on_sender = False
        self._initialized_on_worker = False
        self.synchronized_on_sender = False  # whether connect() ran on the sender
        self.synchronized_on_receiver = False  # whether connect() ran on the worker
        register_with_torchrl()

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
            raise ValueError(f"Unsupported weight-sync backend {backend!r}; expected one of {choices}")
        return registry[name](**kwargs)

    # ------------------------------------------------------------------ torchrl's attributes
    @property
    def weight_strategy(self) -> WeightStrategy:
        """The :class:`WeightStrategy` for ``strategy``."""
        return _strategy(self.strategy)

    @property
    def strategy_str(self) -> str:
        """The strategy's name (torchrl's attribute): ``"tensordict"`` or ``"state_dict"``."""
        return str(self.strategy)

    @property
    def context(self) -> Any:
        """The object models are resolved on (a collector), held weakly; ``None`` if gone or unset."""
        return self._context_ref() if self._context_ref is not None else None

    @context.setter
    def context(self, context: Any) -> None:
        self._context_ref = weakref.ref(context) if context is not None else None

    @property
    def model(self) -> Any:
        """The model: on a worker, the one versions are applied to; on the sender, the source.

        ``None`` where there is none (a sender with neither ``model=`` nor a context
        that has the model).
        """
        if self._receiver is not None:
            return self._receiver.model
        source = self._source_ref() if self._source_ref is not None else None
        if source is not None:
            return source
        context = self.context
        if context is None or self.model_id is None:
            return None
        return maybe_resolve(context, self.model_id)

    @model.setter
    def model(self, model: Any) -> None:
        if model is None:
            return
        if self._receiver is not None:
            self._receiver._register_model(model)
            return
        self._source_ref = weak_ref(model)
        if self._sender is not None:
            self._sender._source_model = model

    @property
    def weights(self) -> Any:
        """The model's current weights in the strategy's format (``None`` without a model)."""
        model = self.model
        return None if model is None else self.weight_strategy.extract_weights(model)

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
        state["synchronized_on_sender"] = False
        state["synchronized_on_receiver"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        register_with_torchrl()

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
    def init_on_sender(self, model_id: str | None = "policy", context: Any = None, **kwargs: Any) -> None:
        """Set up the sender side (trainer / main process).

        Args:
            model_id: the model's id, also its path on ``context`` (``"env.transform[0]"``).
            context: an object (a collector) giving the endpoints (``pipes``,
                ``remote_collectors``, ...) and the model.
            **kwargs: instead of ``context``: the endpoints (see the scheme),
                ``model=`` (the source module, used when ``send()`` gets no
                weights); torchrl's other keywords (``ctx``, ``num_workers``,
                ...) are read where the scheme uses them.
        """
        model_id = model_id or "policy"
        sender = self.create_sender()
        sender._model_id = model_id
        if context is not None:
            self._context_ref = weakref.ref(context)
        source = first_given(kwargs, ("model", "source_model", "weights"))
        params_map = kwargs.get("params_map")
        if source is None and params_map:  # torchrl's {worker_idx: weights}: the same weights each
            source = params_map[min(params_map)]
        sender._source_model = source
        if source is not None:
            self._source_ref = weak_ref(source)
        self.model_id = model_id
        self._sender = sender
        for idx, endpoint in enumerate(self._sender_endpoints(context, kwargs)):
            sender._register_worker(idx, endpoint)
        self._initialized_on_sender = True

    def init_on_worker(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Set up the worker side (the reference's name for :meth:`init_on_receiver`).

        Args:
            model_id: the model's id, also its path on ``context``.
            context: an object (the inner collector) giving ``pipe`` and the model.
            **kwargs: instead of ``context``: the endpoint (``pipe=`` ...),
                ``model=``, and ``worker_idx=`` (torchrl's collectors: this
                worker's end of the channels the scheme made on the sender).
        """
        if self._initialized_on_sender:
            self.__setstate__(self.__getstate__())  # a scheme is one side or the other
        model_id = model_id or "policy"
        receiver = self.create_receiver()
        receiver._model_id = model_id
        if context is not None:
            self._context_ref = weakref.ref(context)
        worker_idx = kwargs.get("worker_idx")
        if worker_idx is None and context is not None:
            worker_idx = getattr(context, "worker_idx", None)
        self.worker_idx = worker_idx
        model = kwargs.get("model")
        if model is None and context is not None:
            if hasattr(context, "get_model"):
                model = context.get_model(model_id)
            else:
                model = maybe_resolve(context, model_id)
        receiver._register_model(model if model is not None else model_id)
        self._check_receiver_model(model)
        endpoint = self._worker_endpoint(context, kwargs)
        if endpoint is not None:
            receiver._register_worker_transport(endpoint)
        with _RECEIVERS_LOCK:
            _RECEIVERS[model_id] = receiver
        self.model_id = model_id
        self._receiver = receiver
        self._initialized_on_worker = True

    def init_on_receiver(self, *, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Set up the worker side (torchrl 0.14's name); see :meth:`init_on_worker`."""
        self.init_on_worker(model_id, context, **kwargs)

    def _check_receiver_model(self, model: Any) -> None:
        """Refuse, at init, a model this scheme could never make usable (see NoWeightSyncScheme)."""

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
        nothing to send (no weights, no context, or a context without that model).

        Raises:
            UnknownModelError: the string names no model on ``context``.
        """
        if weights is None:
            if context is None:
                return None
            found = maybe_resolve(context, model_id)
            if found is None and model_id == "policy":
                found = policy_of(context)
            return found
        if isinstance(weights, str):
            if context is None:
                raise ValueError(f"cannot resolve the model path {weights!r} without a context")
            return resolve_model(context, weights)
        return weights

    def send(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Send a version and wait for the workers (see :meth:`WeightSender.send`).

        ``weights`` may also be ``{worker_idx: weights}`` (torchrl's per-worker
        weights): each worker gets its own. With ``sync=False`` this returns
        once sent; the next ``send`` waits for (and reports) these acks first.

        Raises:
            SyncTimeoutError: some workers did not apply it within ``timeout`` (named).
            ApplyError: some workers refused or failed to apply it (named, with their error).
        """
        sender = self.get_sender()
        if sender._pending is not None:
            sender.wait_async()  # the acks of the previous (async or initial) send
        if is_per_worker(weights):
            for idx, worker_weights in sorted(weights.items()):
                sender.send(worker_weights, idx)
            return
        if self.sync:
            sender.send(weights, worker_ids)
        else:
            sender.send_async(weights, worker_ids)

    def receive(self, timeout: float | None = 0.001) -> bool:
        """Worker: apply a version if one arrives (see :meth:`WeightReceiver.receive`)."""
        return self.get_receiver().receive(timeout)

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Worker: apply ``weights`` to the registered model, whole or not at all."""
        self.get_receiver().apply_weights(weights)

    def connect(self, *, worker_idx: int | None = None, weights: Any = None) -> None:
        """The first synchronisation, once the workers are up.

        On the sender: send the current weights to every worker and wait. On a
        worker: wait (up to ``timeout``) for that first version and apply it.

        Raises:
            SyncTimeoutError: the first version did not arrive in time.
        """
        if self.synchronized_on_sender or self.synchronized_on_receiver:
            raise RuntimeError("connect() was already called on this scheme")
        if self._sender is not None:
            if worker_idx is not None:
                raise RuntimeError("worker_idx is given to connect() on a worker, not on the sender")
            self._connect_sender(weights)
            self.synchronized_on_sender = True
        elif self._receiver is not None:
            if weights is not None:
                raise RuntimeError("weights are given to connect() on the sender, not on a worker")
            self._connect_receiver()
            self.synchronized_on_receiver = True
        else:
            raise RuntimeError("call init_on_sender() or init_on_receiver() before connect()")

    def _connect_sender(self, weights: Any) -> None:
        if self.get_sender().transports:
            self.get_sender().send(weights)

    def _connect_receiver(self) -> None:
        receiver = self.get_receiver()
        if receiver.transport is None or isinstance(receiver.transport, NoOpTransport):
            return
        if not receiver.receive(timeout=self.timeout):
            if receiver.last_error is not None:
                raise receiver.last_error
            raise SyncTimeoutError(f"no first version of {self.model_id!r} arrived within {self.timeout} s")

    def shutdown(self) -> None:
        """Drop the runtime state (transports, snapshots); the configuration stays. Safe to repeat."""
        if self._background is not None:
            self._background.stop()
        if self._receiver is not None:
            self._receiver._release_guard()
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


set_scheme_base(WeightSyncScheme)  # what register_with_torchrl registers with torchrl's ABC

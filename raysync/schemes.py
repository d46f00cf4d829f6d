"""The torchrl-style API: weight-sync schemes, senders, receivers and transports.

torchrl users write ``weight_sync_schemes={"policy": scheme}``; this module
keeps those names and call shapes (torchrl's ``weight_update`` reference and
torchrl 0.14) and builds them on raysync's core: packing, validation and the
whole-or-nothing apply come from :mod:`raysync.weights`, the Ray schemes put
each version into the object store once (or route through the WeightHub), and
every wait has a timeout.

One scheme synchronises ONE model. Lifecycle::

    trainer:  scheme.init_on_sender(model_id="policy", pipes=[...])   # or context=collector
              scheme.connect()                                         # first sync
              scheme.send(model)                                       # or get_sender().send(...)
    worker:   scheme.init_on_receiver(model_id="policy", pipe=p, model=m)
              scheme.connect()                                         # wait for the first version
              scheme.receive(timeout=0.1)                              # in the worker loop

Schemes pickle with their configuration only (no pipes, transports, senders).

Example:
    >>> from raysync import schemes
    >>> scheme = schemes.MultiProcessWeightSyncScheme(timeout=30)
    >>> scheme.init_on_sender(model_id="policy", pipes=[parent_end])  # doctest: +SKIP
    >>> scheme.send(model)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch

from raysync._checks import check_timeout
from raysync.errors import (
    ApplyError,
    RaySyncError,
    SyncTimeoutError,
    UnknownModelError,
    WeightMismatchError,
)
from raysync.transports.base import DEFAULT_TIMEOUT, TransportBackend
from raysync.transports.pipe import MPTransport, SnapshotPool, tensors_from_buckets
from raysync.transports.shared_mem import SharedMemTransport
from raysync.weights import (
    BoundModel,
    Manifest,
    extract_tensors,
    module_schema,
    pack,
    plan_layout,
    schema_of,
    to_tensordict,
    validate,
)

if TYPE_CHECKING:
    from raysync.transports.object_store import RayActorTransport, RayTransport

__all__ = [
    "DistributedWeightSyncScheme",
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

logger = logging.getLogger(__name__)

ExtractAs = Literal["tensordict", "state_dict"]


def __getattr__(name: str) -> Any:
    # The Ray transports import ray's object-store helpers: load them on first use.
    if name in ("RayTransport", "RayActorTransport"):
        from raysync.transports import object_store

        return getattr(object_store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- model paths

_PART = re.compile(r"^([^\[\]]+)((?:\[[^\]]+\])*)$")


def resolve_model(context: Any, path: str) -> Any:
    """The object at ``path`` on ``context``: ``"policy"``, ``"env.value_net"``, ``"env.transform[0]"``.

    Subscripts may be integers or quoted strings (``"models['actor']"``).

    Raises:
        UnknownModelError: a part of the path does not exist (the message names it).

    Example:
        >>> class C: pass
        >>> c = C(); c.env = C(); c.env.transform = [torch.nn.Linear(2, 2)]
        >>> type(resolve_model(c, "env.transform[0]")).__name__
        'Linear'
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"a model path must be a non-empty string, got {path!r}")
    obj = context
    done: list[str] = []
    for part in path.split("."):
        match = _PART.match(part)
        if match is None:
            raise ValueError(f"cannot parse {part!r} in model path {path!r}")
        name, subscripts = match.groups()
        getter = getattr(obj, "get_model", None) if not done and name != "policy" else None
        try:
            obj = getattr(obj, name)
        except AttributeError:
            if callable(getter):
                try:
                    obj = getter(name)
                except Exception as err:
                    raise UnknownModelError(f"no model {path!r}: {err}") from err
            else:
                where = ".".join(done) or type(context).__name__
                raise UnknownModelError(
                    f"no model {path!r}: {where} has no attribute {name!r}; pass model= or a path "
                    "such as 'policy' or 'env.transform[0]'"
                ) from None
        done.append(name)
        for raw in re.findall(r"\[([^\]]+)\]", subscripts):
            key: Any = raw[1:-1] if raw[:1] in "'\"" else int(raw)
            try:
                obj = obj[key]
            except (KeyError, IndexError, TypeError) as err:
                raise UnknownModelError(f"no model {path!r}: {'.'.join(done)}[{raw}] fails ({err})") from err
    return obj


# --------------------------------------------------------------------------- strategy


class WeightStrategy:
    """How weights are extracted on the sender and applied on a worker.

    Args:
        extract_as: ``"tensordict"`` (a nested ``TensorDict``) or
            ``"state_dict"`` (a flat ``{dotted_key: tensor}`` in sorted key order).

    Applying always validates first (keys, shapes, dtypes; every problem at
    once, :class:`raysync.WeightMismatchError`) and then copies: a version is
    applied whole or not at all.

    Example:
        >>> s = WeightStrategy(extract_as="state_dict")
        >>> list(s.extract_weights(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """

    def __init__(self, extract_as: ExtractAs = "tensordict") -> None:
        if extract_as not in ("tensordict", "state_dict"):
            raise ValueError(f"extract_as must be 'tensordict' or 'state_dict', got {extract_as!r}")
        self.extract_as = extract_as

    def __repr__(self) -> str:
        return f"WeightStrategy(extract_as={self.extract_as!r})"

    def extract_weights(self, source: Any) -> Any:
        """The weights of ``source`` (module, TensorDict or state dict) in this strategy's format."""
        tensors = extract_tensors(source)
        return to_tensordict(tensors) if self.extract_as == "tensordict" else tensors

    def apply_weights(self, destination: Any, weights: Any, inplace: bool = True) -> None:
        """Apply ``weights`` to ``destination`` (module, TensorDict or state dict), whole or not at all.

        Raises:
            WeightMismatchError: keys, shapes or dtypes differ (nothing was changed).
        """
        if weights is None:
            return
        _target_for(destination).apply(extract_tensors(weights))


class _Target:
    """A model to apply versions to: validate, then one copy per bucket (cached binding)."""

    def __init__(self, destination: Any) -> None:
        self.ref = destination
        self._bound: BoundModel | None = None

    @property
    def is_module(self) -> bool:
        return isinstance(self.ref, torch.nn.Module)

    def schema(self) -> dict[str, tuple[tuple[int, ...], str]]:
        if self.is_module:
            return module_schema(self.ref)
        return schema_of(extract_tensors(self.ref))

    def _binding(self, manifest: Manifest) -> BoundModel:
        if self._bound is None or self._bound.layout_hash != manifest.layout_hash:
            self._bound = BoundModel(self.ref, manifest)
        return self._bound

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> None:
        manifest = plan_layout(tensors)
        validate(manifest, self.schema())
        if self.is_module:
            self._binding(manifest).apply(pack(tensors, manifest))
            return
        dest = extract_tensors(self.ref)
        with torch.no_grad():
            for key, value in tensors.items():
                dest[key].copy_(value)

    def apply_packed(
        self, manifest: Manifest, buckets: Sequence[Sequence[np.ndarray]], ids: Sequence[str | None] | None
    ) -> None:
        validate(manifest, self.schema())
        if self.is_module:
            self._binding(manifest).apply(buckets, ids)
            return
        self.apply({k: v.clone() for k, v in _unpack(manifest, buckets).items()})

    def copy_from(self, manifest: Manifest, flat: list[torch.Tensor]) -> None:
        """Copy a version straight out of flat buckets (e.g. a shared snapshot): one copy per bucket."""
        validate(manifest, self.schema())
        if not self.is_module:
            self.apply(tensors_from_buckets(manifest, flat))
            return
        buckets = [
            [flat[b][e.offset : e.offset + e.nbytes].numpy() for e in manifest.bucket_entries(b)]
            for b in range(manifest.num_buckets)
        ]
        self._binding(manifest).apply(buckets)

    def adopt(self, manifest: Manifest, flat: list[torch.Tensor]) -> None:
        validate(manifest, self.schema())
        if not self.is_module:
            self.apply(tensors_from_buckets(manifest, flat))
            return
        self._binding(manifest).adopt(flat)


def _unpack(manifest: Manifest, buckets: Sequence[Sequence[np.ndarray]]) -> dict[str, torch.Tensor]:
    from raysync.weights import unpack

    return unpack(manifest, buckets)


_TARGETS: weakref.WeakKeyDictionary[Any, _Target] = weakref.WeakKeyDictionary()


def _target_for(destination: Any) -> _Target:
    if isinstance(destination, torch.nn.Module):
        target = _TARGETS.get(destination)
        if target is None:
            target = _TARGETS[destination] = _Target(destination)
        return target
    return _Target(destination)


def _strategy(name: str) -> WeightStrategy:
    return WeightStrategy(extract_as=name)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- sender


def _worker_list(worker_ids: int | Sequence[int] | None) -> list[int] | None:
    if worker_ids is None:
        return None
    if isinstance(worker_ids, int):
        return [worker_ids]
    return [int(w) for w in worker_ids]


class WeightSender:
    """Sends the weights of ONE model to workers (all of them or some).

    Made by a scheme's ``init_on_sender``; get it with ``scheme.get_sender()``.
    Each version is packed once, whatever the number of workers (one
    shared-memory snapshot, or one ``ray.put``).

    Example:
        >>> sender = scheme.get_sender()
        >>> sender.send(model)                     # every worker, waits for all acks
        >>> sender.send(model, worker_ids=[0, 2])  # some workers
        >>> sender.send_async(model); ...; sender.wait_async(timeout=30)
    """

    def __init__(self, scheme: WeightSyncScheme) -> None:
        self._scheme = scheme
        self._transports: dict[int, Any] = {}
        self._model_id = "policy"
        self._context_ref: Any = None
        self._source_model: Any = None
        self._pending: list[tuple[int, Any]] | None = None
        self._errors: list[tuple[int, BaseException]] = []

    @property
    def model_id(self) -> str:
        """The model this sender sends."""
        return self._model_id

    @property
    def transports(self) -> dict[int, Any]:
        """``{worker_idx: transport}``."""
        return dict(self._transports)

    def _register_worker(self, worker_idx: int, pipe_or_context: Any) -> None:
        if worker_idx not in self._transports:
            transport = self._scheme.create_transport(pipe_or_context)
            self._transports[worker_idx] = transport

    def _select(self, worker_ids: int | Sequence[int] | None) -> list[tuple[int, Any]]:
        wanted = _worker_list(worker_ids)
        if wanted is None:
            return sorted(self._transports.items())
        unknown = [w for w in wanted if w not in self._transports]
        if unknown:
            raise ValueError(f"worker(s) {unknown} not registered; known workers: {sorted(self._transports)}")
        return [(w, self._transports[w]) for w in wanted]

    def _prepare(self, weights: Any) -> dict[str, torch.Tensor]:
        context = self._context_ref() if self._context_ref is not None else None
        prepared = self._scheme.prepare_weights(
            weights, self._model_id, self._scheme.weight_strategy, context
        )
        if prepared is None and self._source_model is not None:
            prepared = self._source_model
        if prepared is None:
            raise UnknownModelError(
                f"no weights to send for model {self._model_id!r}: pass weights=, or init_on_sender("
                f"model=...), or a context that has {self._model_id!r}"
            )
        return extract_tensors(prepared)

    def send(
        self,
        weights: Any = None,
        worker_ids: int | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Send a version and wait until the chosen workers applied it.

        Args:
            weights: a module, TensorDict or state dict; ``None`` takes the
                model from the context (or the ``model=`` given to ``init_on_sender``).
            worker_ids: ``None`` (all), one index, or a list.
            timeout: seconds to wait for each worker (default: the scheme's).

        Raises:
            SyncTimeoutError: some workers did not ack in time (named).
            ApplyError: some workers refused the version (they keep their previous one).
        """
        self.send_async(weights, worker_ids)
        self.wait_async(timeout=timeout)

    def send_async(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Start sending a version; call :meth:`wait_async` before the next send."""
        if self._pending is not None:
            raise RuntimeError("a send_async() is still pending: call wait_async() first")
        tensors = self._prepare(weights)
        chosen = self._select(worker_ids)
        if not chosen:
            raise RuntimeError(f"no workers registered for model {self._model_id!r}")
        payload = self._scheme._payload(self, tensors)
        started: list[tuple[int, Any]] = []
        self._errors = []
        for idx, transport in chosen:
            try:
                transport.send_weights_async(self._model_id, payload)
                started.append((idx, transport))
            except RaySyncError as err:
                self._errors.append((idx, err))
        self._pending = started

    def wait_async(self, timeout: float | None = None) -> None:
        """Wait for every worker of the pending send; report all failures at once."""
        if self._pending is None:
            raise RuntimeError("no send_async() is pending")
        pending, self._pending = self._pending, None
        errors, self._errors = self._errors, []
        limit = timeout if timeout is not None else self._scheme.timeout
        for idx, transport in pending:
            try:
                transport.wait_ack(limit)
            except RaySyncError as err:
                errors.append((idx, err))
        if not errors:
            return
        text = "; ".join(f"worker {i}: {e}" for i, e in errors)
        if all(isinstance(e, SyncTimeoutError) for _, e in errors):
            raise SyncTimeoutError(
                f"{len(errors)} worker(s) of model {self._model_id!r} did not ack: {text}",
                laggards=[{"subscriber": i, "applied": None, "error": None} for i, _ in errors],
            )
        raise ApplyError(
            f"{len(errors)} worker(s) of model {self._model_id!r} failed (they keep their previous "
            f"weights): {text}",
            failures=[{"subscriber": i, "error": str(e)} for i, e in errors],
        )

    def update_weights(self, weights: Any) -> None:
        """Send to ALL workers (the reference's legacy name for :meth:`send`)."""
        self.send(weights)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a WeightSender holds live transports: pickle its scheme instead")


# --------------------------------------------------------------------------- receiver

_RECEIVERS: dict[str, WeightReceiver] = {}
_RECEIVERS_LOCK = threading.Lock()


def receiver_for(model_id: str, instance: Any = None, path: str | None = None) -> WeightReceiver:
    """The receiver of ``model_id`` registered in this process, else one for ``path`` on ``instance``.

    Used inside Ray actors by :func:`raysync.transports.object_store.apply_in_actor`.

    Raises:
        UnknownModelError: no receiver is registered and the path does not resolve.
    """
    with _RECEIVERS_LOCK:
        found = _RECEIVERS.get(model_id)
    if found is not None and path is None:
        return found
    if instance is None:
        raise UnknownModelError(
            f"unknown model_id {model_id!r}: this process registered receivers for {sorted(_RECEIVERS)}"
        )
    cache = instance.__dict__.setdefault("_raysync_scheme_receivers", {})
    key = (model_id, path)
    if key not in cache:
        model = resolve_model(instance, path or model_id)
        receiver = WeightReceiver(NoWeightSyncScheme())
        receiver._model_id = model_id
        receiver._register_model(model)
        cache[key] = receiver
    receiver_found: WeightReceiver = cache[key]
    return receiver_found


class WeightReceiver:
    """Receives and applies the weights of ONE model in ONE worker.

    Made by a scheme's ``init_on_receiver`` / ``init_on_worker``. A version is
    validated against the model first and applied whole or not at all; a
    refused version is acked as an error (the sender raises
    :class:`raysync.ApplyError`) and the model keeps its previous weights.
    Versions addressed to another model registered in this process go to that
    model's receiver; an unknown ``model_id`` is refused with a clear error.

    Example:
        >>> receiver = scheme.get_receiver()
        >>> while running:
        ...     receiver.receive(timeout=0.01)   # applies a version if one arrived
    """

    def __init__(self, scheme: WeightSyncScheme) -> None:
        self._scheme = scheme
        self._transport: Any = None
        self._model_ref: Any = None
        self._context_ref: Any = None
        self._model_id = "policy"
        self._target: _Target | None = None
        self.last_error: BaseException | None = None
        self.version_count = 0

    @property
    def transport(self) -> Any:
        """This worker's transport (or ``None`` where the sender calls in, e.g. Ray)."""
        return self._transport

    @property
    def model_id(self) -> str:
        """The model this receiver updates."""
        return self._model_id

    def _register_model(self, model_ref: Any) -> None:
        self._model_ref = model_ref
        self._target = None

    def _register_worker_transport(self, pipe_or_transport: Any) -> None:
        if hasattr(pipe_or_transport, "receive_weights"):
            self._transport = pipe_or_transport
        else:
            self._transport = self._scheme.create_transport(pipe_or_transport)

    @property
    def model(self) -> Any:
        """The model versions are applied to (resolved from the context on first use)."""
        if isinstance(self._model_ref, str):
            context = self._context_ref() if self._context_ref is not None else None
            if context is None:
                raise UnknownModelError(
                    f"cannot find model {self._model_ref!r}: no model= was given and the context is gone"
                )
            return resolve_model(context, self._model_ref)
        if self._model_ref is None:
            raise UnknownModelError(f"no model registered for {self._model_id!r}: pass model=")
        return self._model_ref

    def _get_target(self) -> _Target:
        model = self.model
        if self._target is None or self._target.ref is not model:
            self._target = _target_for(model)
        return self._target

    def _route(self, model_id: str) -> WeightReceiver:
        if model_id == self._model_id:
            return self
        with _RECEIVERS_LOCK:
            other = _RECEIVERS.get(model_id)
        if other is None:
            raise UnknownModelError(
                f"unknown model_id {model_id!r}: this worker has receivers for "
                f"{sorted(set(_RECEIVERS) | {self._model_id})}"
            )
        return other

    def receive(self, timeout: float | None = 0.001) -> bool:
        """Apply a version if one arrives within ``timeout`` seconds.

        Returns:
            True if a version was applied; False if none came, or if it was
            refused (then ``last_error`` says why and the sender got an error ack).
        """
        if self._transport is None:
            return False
        if hasattr(self._transport, "receive_snapshot"):
            # Whole versions in flat buckets: point into them (kept) or copy out of them once.
            snapshot = self._transport.receive_snapshot(timeout=timeout)
            if snapshot is None:
                return False
            model_id, manifest, flat = snapshot
            if getattr(self._transport, "keeps_snapshot", False):
                return self._finish(lambda: self._route(model_id)._get_target().adopt(manifest, flat))
            return self._finish(lambda: self._route(model_id)._get_target().copy_from(manifest, flat))
        result = self._transport.receive_weights(timeout=timeout)
        if result is None:
            return False
        model_id, tensors = result
        return self._finish(lambda: self._route(model_id)._get_target().apply(tensors))

    def _finish(self, apply: Any) -> bool:
        try:
            apply()
        except (RaySyncError, ValueError, TypeError, KeyError, RuntimeError) as err:
            self.last_error = err
            logger.warning("refused a version of %r: %s", self._model_id, err)
            self._transport.send_ack(f"error: {type(err).__name__}: {err}")
            return False
        self.last_error = None
        self.version_count += 1
        self._transport.send_ack("updated")
        return True

    def apply_weights(self, weights: Any) -> None:
        """Apply ``weights`` (module, TensorDict, state dict) to the model, whole or not at all.

        Raises:
            WeightMismatchError: they do not fit the model (nothing changed).
        """
        self._get_target().apply(extract_tensors(weights))
        self.version_count += 1

    def apply_packed(
        self,
        model_id: str,
        manifest: Manifest,
        buckets: Sequence[Sequence[np.ndarray]],
        *,
        ids: Sequence[str | None] | None = None,
    ) -> None:
        """Apply a packed version (object-store buckets) whole; used inside Ray actors."""
        receiver = self._route(model_id)
        receiver._get_target().apply_packed(manifest, buckets, ids)
        receiver.version_count += 1

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a WeightReceiver holds a live transport and model: pickle its scheme instead")


# --------------------------------------------------------------------------- schemes


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
        from raysync.transports.object_store import RayTransport

        actor = kwargs.get("remote_collector", pipe_or_context)
        return RayTransport(actor, timeout=self.timeout, model_path=self.model_path)

    def _sender_endpoints(self, context: Any, kwargs: dict[str, Any]) -> list[Any]:
        if self.hub is not None:
            return []
        return _endpoints(context, kwargs, ("remote_collectors", "actors", "actor_refs"), type(self).__name__)

    def _payload(self, sender: WeightSender, tensors: dict[str, torch.Tensor]) -> Any:
        from raysync.transports.object_store import put_version

        return put_version(tensors)

    def _hub(self) -> Any:
        if self._hub_client is None:
            from raysync.hub import connect

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


class RayModuleTransformSender(WeightSender):
    """Sends to modules hosted in Ray actors (:class:`raysync.RayModuleTransform`).

    A transform that follows a hub gets each version through that hub (one
    push, however many transforms); a bare actor handle is updated directly
    through the object store (one ``ray.put``).

    Example:
        >>> sender = scheme.get_sender()
        >>> sender.update_weights(module)
    """

    def __init__(self, scheme: WeightSyncScheme) -> None:
        super().__init__(scheme)
        self._modules: list[Any] = []

    def _register_worker(self, worker_idx: int, pipe_or_context: Any) -> None:
        from raysync.synced import RayModuleTransform

        if isinstance(pipe_or_context, RayModuleTransform):
            self._modules.append(pipe_or_context)
        else:
            super()._register_worker(worker_idx, pipe_or_context)

    def _resolve_context_modules(self) -> None:
        from raysync.synced import RayModuleTransform

        context = self._context_ref() if self._context_ref is not None else None
        if context is None or self._modules or self._transports:
            return
        found = resolve_model(context, self._model_id)
        if isinstance(found, RayModuleTransform):
            self._modules.append(found)
        else:
            super()._register_worker(0, getattr(found, "_actor", found))

    def send(
        self,
        weights: Any = None,
        worker_ids: int | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Send a version to every hosted module and wait until each applied it."""
        self._resolve_context_modules()
        limit = timeout if timeout is not None else self._scheme.timeout
        if self._modules:
            from raysync.hub import connect

            tensors = self._prepare(weights)
            groups: dict[tuple[str, str | None, str], list[Any]] = {}
            for module in self._modules:
                groups.setdefault((module.hub, module.namespace, module.model_id), []).append(module)
            for hub, namespace, model_id in groups:
                connect(hub, namespace=namespace).push(tensors, model_id, wait=True, timeout=limit)
            if not self._transports:
                return
        super().send(weights, worker_ids, timeout=limit)

    def _prepare(self, weights: Any) -> dict[str, torch.Tensor]:
        if weights is None and self._source_model is None:
            raise UnknownModelError(
                f"no weights to send for {self._model_id!r}: a RayModuleTransformSender needs weights="
            )
        return super()._prepare(weights)


class RayModuleTransformReceiver(WeightReceiver):
    """Applies versions to the module inside its Ray actor (whole or not at all).

    Example:
        >>> receiver = scheme.get_receiver()      # inside the actor
        >>> receiver.apply_weights(state_dict)
    """


class RayModuleTransformScheme(RayWeightSyncScheme):
    """Weight sync for modules hosted in Ray actors (:class:`raysync.RayModuleTransform`).

    Sender kwargs: ``transforms`` (``RayModuleTransform`` objects, delivered
    through their hub) or ``actor_refs`` / ``actors`` (updated directly); with
    a context, ``model_id`` is the transform's path on it (``"env.transform[0]"``).

    Example:
        >>> t = raysync.RayModuleTransform(make_module, model_id="policy", hub="h")
        >>> scheme = RayModuleTransformScheme()
        >>> scheme.init_on_sender(model_id="policy", transforms=[t])
        >>> scheme.send(trained)                 # t now runs the trained weights
    """

    backend = "ray_module"

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> RayActorTransport:
        """A :class:`RayActorTransport` for one hosting actor."""
        from raysync.transports.object_store import RayActorTransport

        actor = kwargs.get("actor_ref", pipe_or_context)
        actor = getattr(actor, "_actor", getattr(actor, "actor", actor))
        return RayActorTransport(
            actor, self.strategy, timeout=self.timeout, model_path=self.model_path or "module"
        )

    def create_sender(self) -> RayModuleTransformSender:
        """A :class:`RayModuleTransformSender`."""
        return RayModuleTransformSender(self)

    def create_receiver(self) -> RayModuleTransformReceiver:
        """A :class:`RayModuleTransformReceiver`."""
        return RayModuleTransformReceiver(self)

    def _sender_endpoints(self, context: Any, kwargs: dict[str, Any]) -> list[Any]:
        for name in ("transforms", "actor_refs", "actors", "remote_collectors"):
            if kwargs.get(name) is not None:
                return list(kwargs[name])
        return []  # resolved lazily from the context's model path

    def send(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Send a version to the hosted modules and wait until they applied it."""
        self.get_sender().send(weights, worker_ids)

    def _connect_sender(self, weights: Any) -> None:
        if weights is not None or self.get_sender()._source_model is not None:
            self.send(weights)


class RPCWeightSyncScheme(WeightSyncScheme):
    """Workers reached over ``torch.distributed.rpc``; bytes move with torch.distributed send/recv.

    Signals (manifest, acks) go over RPC; the bytes over a gloo (CPU) or nccl
    group, in the order that cannot deadlock. See
    :class:`raysync.transports.rpc.RPCTransport`.

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
        from raysync.transports.rpc import RPCTransport

        return RPCTransport

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

    See :class:`raysync.transports.distributed.DistributedTransport`.

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
        from raysync.transports.distributed import DistributedTransport

        return DistributedTransport


# The class attribute ``backend`` names the scheme for from_backend; the instance's torch backend
# of DistributedWeightSyncScheme is ``dist_backend``.


# --------------------------------------------------------------------------- legacy updater


class MultiProcessedRemoteWeightUpdate:
    """Copies the server's weights into per-device (or per-process) policy weights, whole or not at all.

    Args:
        get_server_weights: returns the newest weights (module, TensorDict or
            state dict); ``None`` means weights are always passed to :meth:`push_weights`.
        policy_weights: ``{worker_id (e.g. a torch.device): weights}``, the
            TensorDicts (or state dicts) the workers' policies read from.

    Example:
        >>> updater = MultiProcessedRemoteWeightUpdate(lambda: trainer_policy, {"cpu": worker_td})
        >>> updater.push_weights()               # every worker id
        >>> updater.push_weights(worker_ids=["cpu"])
    """

    def __init__(self, get_server_weights: Any, policy_weights: Mapping[Any, Any]) -> None:
        if get_server_weights is not None and not callable(get_server_weights):
            raise TypeError("get_server_weights must be callable or None")
        self.get_server_weights = get_server_weights
        self.policy_weights = dict(policy_weights)
        self.collector: Any = None

    def register_collector(self, collector: Any) -> None:
        """Attach the collector this updater serves (once)."""
        if self.collector is not None:
            raise RuntimeError("a collector is already registered with this updater")
        self.collector = collector

    def all_worker_ids(self) -> list[Any]:
        """The ids (devices or processes) whose weights this updater keeps in step."""
        return list(self.policy_weights)

    def _get_server_weights(self) -> Any:
        if self.get_server_weights is None:
            return None
        return self.get_server_weights()

    def _maybe_map_weights(self, server_weights: Any) -> Any:
        return server_weights

    def _sync_weights_with_worker(self, worker_id: Any, server_weights: Any) -> None:
        if worker_id not in self.policy_weights:
            raise KeyError(f"unknown worker id {worker_id!r}; known: {self.all_worker_ids()}")
        _Target(self.policy_weights[worker_id]).apply(extract_tensors(server_weights))

    def push_weights(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Copy ``weights`` (default: the server's) into the chosen workers' weights.

        Every worker's weights are validated before any is written.

        Raises:
            WeightMismatchError: the weights do not fit some worker (nothing was written).
        """
        weights = self._maybe_map_weights(weights if weights is not None else self._get_server_weights())
        if weights is None:
            raise ValueError("no weights: pass weights= or give get_server_weights")
        ids = (
            self.all_worker_ids()
            if worker_ids is None
            else (list(worker_ids) if isinstance(worker_ids, (list, tuple)) else [worker_ids])
        )
        tensors = extract_tensors(weights)
        manifest = plan_layout(tensors)
        for worker_id in ids:
            if worker_id not in self.policy_weights:
                raise KeyError(f"unknown worker id {worker_id!r}; known: {self.all_worker_ids()}")
            validate(manifest, _Target(self.policy_weights[worker_id]).schema())
        for worker_id in ids:
            self._sync_weights_with_worker(worker_id, tensors)

    __call__ = push_weights


_ = WeightMismatchError  # re-raised from raysync.weights.validate by the appliers above

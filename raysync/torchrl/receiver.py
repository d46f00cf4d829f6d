"""``WeightReceiver``: takes a version from its transport and applies it whole, or refuses it."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raysync._protocol import ApplyReport
from raysync.core.layout import Manifest
from raysync.errors import (
    RaySyncError,
    UnknownModelError,
)
from raysync.receivers.follower import forward_lock
from raysync.receivers.pipeline import Applier
from raysync.torchrl.strategy import (
    applier_for,
    apply_tensors,
    raise_failed,
    resolve_model,
    split_extra_state,
)

if TYPE_CHECKING:
    from raysync.torchrl.base import WeightSyncScheme

__all__ = ["BackgroundReceiver", "WeightReceiver", "receiver_for"]

logger = logging.getLogger(__name__)


_RECEIVERS: dict[str, WeightReceiver] = {}


_RECEIVERS_LOCK = threading.Lock()


def receiver_for(model_id: str, instance: Any = None, path: str | None = None) -> WeightReceiver:
    """The receiver of ``model_id`` registered in this process, else one for ``path`` on ``instance``.

    Used inside Ray actors by :func:`raysync.torchrl.ray_transport.apply_in_actor`.

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
        receiver = WeightReceiver(None)  # fed by the sender's Ray calls: no transport of its own
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

    def __init__(self, scheme: WeightSyncScheme | None) -> None:
        self._scheme = scheme
        self._transport: Any = None
        self._model_ref: Any = None
        self._model_id = "policy"
        self._applier: tuple[Any, Applier] | None = None  # (the model, its pipeline)
        self._guard: threading.RLock | None = None  # the model's forward lock, once installed
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
        guarded = self._guard is not None
        self._release_guard()
        self._model_ref = model_ref
        self._applier = None
        if guarded:
            self._install_guard()

    def _install_guard(self) -> None:
        """Applies wait for the model's running forward (and forwards for a running apply).

        Used where a background thread applies versions while the worker acts: a
        forward then never sees part of one version and part of the next. The lock is the
        module's one forward lock, the one a :class:`raysync.Follower` applies under.
        """
        if self._guard is None and isinstance(self._model_ref, torch.nn.Module):
            self._guard = forward_lock(self._model_ref)

    def _release_guard(self) -> None:
        self._guard = None  # the module keeps its hooks: its forward takes a lock no apply holds

    def _register_worker_transport(self, pipe_or_transport: Any) -> None:
        if hasattr(pipe_or_transport, "receive_weights"):
            self._transport = pipe_or_transport
        elif self._scheme is None:
            raise TypeError(f"{pipe_or_transport!r} is not a transport; no scheme here to make one")
        else:
            self._transport = self._scheme.create_transport(pipe_or_transport)

    @property
    def model(self) -> Any:
        """The model versions are applied to (resolved from the context on first use)."""
        if isinstance(self._model_ref, str):
            context = self._scheme.context if self._scheme is not None else None
            if context is None:
                raise UnknownModelError(
                    f"cannot find model {self._model_ref!r}: no model= was given and the context is gone"
                )
            return resolve_model(context, self._model_ref)
        if self._model_ref is None:
            raise UnknownModelError(f"no model registered for {self._model_id!r}: pass model=")
        return self._model_ref

    def _get_applier(self) -> Applier:
        model = self.model
        if self._applier is None or self._applier[0] is not model:
            self._applier = (model, applier_for(model))
        return self._applier[1]

    def _route(self, model_id: str) -> WeightReceiver:
        return self if model_id == self._model_id else receiver_for(model_id)

    def _locked(self) -> Any:
        """The model's forward guard, held while a version goes in (nothing without one)."""
        return self._guard if self._guard is not None else contextlib.nullcontext()

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
            adopt = bool(getattr(self._transport, "keeps_snapshot", False))
            return self._finish(
                lambda: raise_failed(
                    self._route(model_id)._get_applier().from_flat(manifest, flat, adopt=adopt)
                )
            )
        result = self._transport.receive_weights(timeout=timeout)
        if result is None:
            return False
        model_id, tensors = result
        return self._finish(lambda: apply_tensors(self._route(model_id)._get_applier(), tensors))

    def _finish(self, apply: Any) -> bool:
        try:
            with self._locked():
                apply()
        except Exception as err:  # every failure is acked: the sender raises it, naming this worker
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
        tensors, extra = split_extra_state(weights)
        applier = self._get_applier()
        with self._locked():
            apply_tensors(applier, tensors, extra_state=extra)
        self.version_count += 1

    def apply_refs(self, model_id: str, manifest: Manifest, refs: Sequence[Any]) -> None:
        """Apply a version in the object store whole, through raysync's apply path (inside Ray actors).

        The target checks the manifest first, then only the buckets it lacks are
        fetched (through the version's data path) and committed whole.

        Raises:
            WeightMismatchError: the version does not fit the model (nothing fetched).
        """
        receiver = self._route(model_id)
        applier = receiver._get_applier()
        step = applier.prepare(applier.next_version, manifest, list(refs))
        raise_failed(step if isinstance(step, ApplyReport) else applier.commit(step, guard=receiver._locked))
        receiver.version_count += 1

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a WeightReceiver holds a live transport and model: pickle its scheme instead")


class BackgroundReceiver:
    """A daemon thread that applies each version as it arrives (torchrl's workers never call receive()).

    After each applied version it calls ``on_applied()`` (e.g. the worker collector's
    ``increment_version``). It stops on :meth:`stop`, or when the sender's end closes.

    Example:
        >>> bg = BackgroundReceiver(scheme.get_receiver(), name="policy-0")
        >>> bg.start(); ...; bg.stop()
    """

    def __init__(self, receiver: WeightReceiver, *, name: str, on_applied: Any = None) -> None:
        self._receiver = receiver
        self._on_applied = on_applied
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"raysync-receiver-{name}", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (waits up to ``timeout`` seconds for it)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                applied = self._receiver.receive(timeout=0.1)
            except RaySyncError as err:  # the sender's end closed: the collector is gone
                logger.debug("weight receiver of %r stops: %s", self._receiver.model_id, err)
                return
            except Exception:  # never let the thread die silently: log, and keep serving
                logger.exception("weight receiver of %r failed", self._receiver.model_id)
                continue
            if applied and self._on_applied is not None:
                try:
                    self._on_applied()
                except Exception:
                    logger.exception("after applying a version of %r", self._receiver.model_id)

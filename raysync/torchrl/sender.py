"""``WeightSender``: packs a version once and sends it through each worker's transport."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raysync.core.layout import Manifest, plan_layout
from raysync.errors import (
    ApplyError,
    RaySyncError,
    SyncTimeoutError,
    UnknownModelError,
)
from raysync.torchrl.strategy import split_extra_state

if TYPE_CHECKING:
    from raysync.torchrl.base import WeightSyncScheme

__all__ = ["WeightSender"]


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
        self._source_model: Any = None
        self._pending: list[tuple[int, Any]] | None = None
        self._errors: list[tuple[int, BaseException]] = []
        self._extra_state: dict[str, Any] = {}

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
            self._transports[worker_idx] = self._scheme.create_transport(pipe_or_context)

    def _select(self, worker_ids: int | Sequence[int] | None) -> list[tuple[int, Any]]:
        if worker_ids is None:
            return sorted(self._transports.items())
        wanted = [worker_ids] if isinstance(worker_ids, int) else [int(w) for w in worker_ids]
        unknown = [w for w in wanted if w not in self._transports]
        if unknown:
            raise ValueError(f"worker(s) {unknown} not registered; known workers: {sorted(self._transports)}")
        return [(w, self._transports[w]) for w in wanted]

    def _prepare(self, weights: Any) -> dict[str, torch.Tensor]:
        scheme = self._scheme
        prepared = scheme.prepare_weights(weights, self._model_id, scheme.weight_strategy, scheme.context)
        if prepared is None and self._source_model is not None:
            prepared = self._source_model
        if prepared is None:
            raise UnknownModelError(
                f"no weights to send for model {self._model_id!r}: pass weights=, or init_on_sender("
                f"model=...), or a context that has {self._model_id!r}"
            )
        tensors, self._extra_state = split_extra_state(prepared)
        return tensors

    def _manifest(self, tensors: dict[str, torch.Tensor]) -> Manifest:
        """The layout of ``tensors``, carrying the extra state of the weights last prepared."""
        return plan_layout(tensors).with_extra_state(self._extra_state)

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

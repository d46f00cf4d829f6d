"""torchrl's collectors, synced through raysync's WeightHub.

:class:`HubWeightSyncScheme` is a real ``torchrl.weight_update.WeightSyncScheme``
(torchrl 0.14), so torchrl's own collectors accept it in
``weight_sync_schemes={"policy": scheme}`` (and ``weight_recv_schemes``).
Every version goes through the hub: ``send`` is one ``hub.push`` (one copy in
Ray's object store, whatever the number of subscribers; ``@raysync.synced_model``
actors apply it as it arrives) and the collector's own policy, or any receiver
of the scheme, takes it from the hub (``hub.pull``), validated and applied
whole by :mod:`raysync.core`.

Needs torchrl (the ``torchrl`` extra) and a connected Ray.

Example:
    >>> from torchrl.collectors import Collector
    >>> from raysync.torchrl.integration import HubWeightSyncScheme
    >>> collector = Collector(env, policy, frames_per_batch=64, total_frames=-1,
    ...                       weight_sync_schemes={"policy": HubWeightSyncScheme(hub="raysync")})
    >>> collector.update_policy_weights_(trained_policy)   # through the hub; the collector acts with it
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme as _TorchRLScheme

from raysync._checks import check_timeout
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.core.extract import extract_tensors
from raysync.errors import SyncTimeoutError
from raysync.torchrl.strategy import _target_for, resolve_model

__all__ = ["HubWeightSyncScheme"]

logger = logging.getLogger(__name__)


class HubWeightSyncScheme(_TorchRLScheme):  # type: ignore[misc]
    """A torchrl weight-sync scheme that delivers through a raysync WeightHub.

    Args:
        hub: the hub's name (see :func:`raysync.connect`).
        namespace: the hub's Ray namespace (``None``: raysync's own).
        timeout: seconds ``send`` waits for the hub's subscribers to apply a version.
        strategy: ``"tensordict"`` or ``"state_dict"`` (torchrl's meaning).
        apply_locally: on the sender, also apply each version to the context's
            model (the collector's own policy) from the hub.

    Sender side (``init_on_sender``, called by the collector): ``send(weights)``
    pushes to the hub, waits for every subscriber, then applies the version to
    the collector's model. Receiver side (``init_on_receiver``):
    ``receive()`` applies the hub's newest version if it is newer than the one
    held, whole or not at all.

    Example:
        >>> scheme = HubWeightSyncScheme(hub="raysync", timeout=30)
        >>> collector = Collector(env, policy, frames_per_batch=8, total_frames=-1,
        ...                       weight_sync_schemes={"policy": scheme})
        >>> collector.update_policy_weights_(trained)
    """

    def __init__(
        self,
        hub: str = "raysync",
        *,
        namespace: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        strategy: str = "tensordict",
        apply_locally: bool = True,
    ) -> None:
        super().__init__(strategy=strategy)
        check_timeout(timeout, allow_none=False, positive=True)
        self.hub = hub
        self.namespace = namespace
        self.timeout = float(timeout)
        self.apply_locally = apply_locally
        self._applied: int | None = None
        self._client: Any = None
        self._explicit_model: Any = None

    # ------------------------------------------------------------------ plumbing
    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        state["_client"] = None
        state["_explicit_model"] = None
        state["_applied"] = None
        return state

    @property
    def client(self) -> Any:
        """The :class:`raysync.HubClient` (connected on first use)."""
        if self._client is None:
            from raysync.hub.client import connect

            self._client = connect(self.hub, namespace=self.namespace)
        return self._client

    def create_transport(self, **kwargs: Any) -> Any:
        """No per-worker transport: the hub is the transport."""
        return None

    def _init_on_sender_impl(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        self._model_id = model_id
        self.context = context
        self._explicit_model = kwargs.get("model")

    def _init_on_receiver_impl(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        self._model_id = model_id
        self.context = context
        self._explicit_model = kwargs.get("model")
        self._worker_idx = kwargs.get("worker_idx")

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any | None = None
    ) -> None:
        if weights is not None:
            self.send(weights)

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        self.receive()

    def _local_model(self) -> Any:
        if self._explicit_model is not None:
            return self._explicit_model
        context = self.context
        if context is None or self._model_id is None:
            return None
        return resolve_model(context, self._model_id)

    # ------------------------------------------------------------------ use
    def send(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Push a version through the hub and wait until its subscribers (and the collector) hold it.

        Raises:
            SyncTimeoutError / ApplyError: from :meth:`raysync.HubClient.wait`.
        """
        if worker_ids is not None:
            raise ValueError("HubWeightSyncScheme delivers to every subscriber of the hub: drop worker_ids")
        model_id = self._model_id or "policy"
        source = weights if weights is not None else self._local_model()
        if source is None:
            raise ValueError(f"no weights to send for {model_id!r}")
        if isinstance(source, weakref.ref):
            source = source()
        tensors = extract_tensors(source)
        version = self.client.push(tensors, model_id, wait=True, timeout=self.timeout)
        if self.apply_locally:
            local = self._local_model()
            if local is not None and local is not source:
                self._apply_from_hub(local, version)
        self._applied = version

    def _apply_from_hub(self, model: Any, version: int) -> Any:
        model_id = self._model_id or "policy"
        pulled = self.client.pull(model_id, version)
        tensors = {".".join(k) if isinstance(k, tuple) else k: v for k, v in extract_tensors(pulled).items()}
        target_keys = set(extract_tensors(model))
        if set(tensors) != target_keys:
            # A wrapper (e.g. a TensorDictModule around the trained module) adds a prefix: match by suffix.
            tensors = _match_prefix(tensors, target_keys)
        _target_for(model).apply(tensors)
        self._applied = version
        return pulled

    def receive(self, timeout: float | None = None) -> Any:
        """Apply the hub's newest version if newer than the one held; return it (or ``None``)."""
        model_id = self._model_id or "policy"
        latest = self.client.latest(model_id)
        if latest is None or (self._applied is not None and latest <= self._applied):
            return None
        model = self._local_model()
        if model is None:
            raise SyncTimeoutError(f"no model to apply {model_id!r} to: pass model= or a context")
        return self._apply_from_hub(model, latest)

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Apply ``weights`` to the registered model, whole or not at all."""
        model = self._local_model()
        _target_for(model).apply(extract_tensors(weights))


def _match_prefix(tensors: dict[str, torch.Tensor], target_keys: set[str]) -> dict[str, torch.Tensor]:
    for key in target_keys:
        for src in tensors:
            if key.endswith("." + src):
                prefix = key[: -len(src)]
                mapped = {prefix + k: v for k, v in tensors.items()}
                if set(mapped) == target_keys:
                    return mapped
            if src.endswith("." + key):
                prefix = src[: -len(key)]
                mapped = {k.removeprefix(prefix): v for k, v in tensors.items()}
                if set(mapped) == target_keys:
                    return mapped
    return tensors  # validation will name what does not match

"""Weights for a ``RayModuleTransform``: its scheme, sender and receiver."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raysync.errors import (
    UnknownModelError,
)
from raysync.torchrl.base import WeightSyncScheme
from raysync.torchrl.collector_context import first_given
from raysync.torchrl.receiver import WeightReceiver
from raysync.torchrl.schemes import RayWeightSyncScheme
from raysync.torchrl.sender import WeightSender
from raysync.torchrl.strategy import resolve_model

if TYPE_CHECKING:
    from raysync.torchrl.ray_transport import RayActorTransport

__all__ = ["RayModuleTransformReceiver", "RayModuleTransformScheme", "RayModuleTransformSender"]


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
        from raysync.receivers.module_transform import RayModuleTransform

        if isinstance(pipe_or_context, RayModuleTransform):
            self._modules.append(pipe_or_context)
        else:
            super()._register_worker(worker_idx, pipe_or_context)

    def _resolve_context_modules(self) -> None:
        context = self._scheme.context
        if context is None or self._modules or self._transports:
            return
        self._register_worker(0, resolve_model(context, self._model_id))

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
            from raysync.client.connect import connect

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
    _RUNTIME = (*RayWeightSyncScheme._RUNTIME, "_ray_transform")

    def _set_transform(self, ray_transform: Any) -> None:
        """Remember the transform this scheme updates (torchrl's ``RayModuleTransform`` calls this)."""
        self._ray_transform = ray_transform

    def init_on_worker(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Worker side, in the transform's actor: the model is ``context.module`` unless ``model=``."""
        if kwargs.get("model") is None and context is not None and hasattr(context, "module"):
            kwargs["model"] = context.module
        super().init_on_worker(model_id, context, **kwargs)

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> RayActorTransport:
        """A :class:`RayActorTransport` for one hosting actor."""
        from raysync.torchrl.ray_transport import RayActorTransport

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
        given = first_given(kwargs, ("transforms", "actor_refs", "actors", "remote_collectors"))
        if given is not None:
            return list(given)
        transform = kwargs.get("ray_transform") or getattr(self, "_ray_transform", None)
        if transform is not None:
            return [transform]
        return []  # resolved lazily from the context's model path

    def send(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Send a version to the hosted modules and wait until they applied it."""
        self.get_sender().send(weights, worker_ids)

    def _connect_sender(self, weights: Any) -> None:
        transform = getattr(self, "_ray_transform", None)
        actor = getattr(transform, "_actor", None)
        if actor is not None and hasattr(actor, "_init_weight_sync_scheme"):
            # torchrl's transform actor sets up the receiver side itself, as with torchrl's scheme.
            import ray

            ray.get(
                actor._init_weight_sync_scheme.remote(scheme=self, model_id=self.model_id),
                timeout=self.timeout,
            )
        if weights is not None or self.get_sender()._source_model is not None:
            self.send(weights)

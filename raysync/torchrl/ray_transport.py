"""Ray's object store as the data path of :mod:`raysync.schemes`: one ``ray.put`` per version.

Lifecycle of one version (which side runs what):

- **sender** (:func:`snapshot`, called once per version by a
  ``WeightSender`` whatever the number of workers): the object-store data path's
  snapshot (:class:`~raysync.transports.object_store.ObjectStoreTransport`, as a
  hub push takes): the weights packed into buckets, each ``ray.put`` once.
- **sender** (:class:`RayTransport` / :class:`RayActorTransport`, one per
  actor): ask the actor to apply ``(model_id, manifest, refs)``; the refs
  travel nested, so only the tiny call goes to each actor. ``wait_ack`` waits
  for the reply with a timeout.
- **actor** (:func:`apply_in_actor`, run through Ray's ``__ray_call__``, so any
  actor works, no method to add): raysync's apply path
  (:mod:`raysync.receivers.pipeline`): check the version against the actor's
  target, fetch the buckets it lacks (zero-copy on the same node) and commit the
  version whole (a module through :class:`raysync.core.bound.BoundModel`, or a
  :class:`raysync.WeightsLoader` there). The model is the receiver that
  ``scheme.init_on_receiver(model_id=..., model=...)`` registered in that
  actor, else the attribute path (``"policy"``, ``"env.transform[0]"``) on the
  actor instance.

Example:
    >>> version = snapshot(model)                  # once
    >>> for t in transports:                       # one small call per actor
    ...     t.send_weights_async("policy", version)
    >>> for t in transports:
    ...     t.wait_ack(timeout=30)
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import ray
import torch

from raysync._checks import check_timeout
from raysync.channels.base import DEFAULT_TIMEOUT, ack_error, split_send_args
from raysync.core.extract import extract_tensors
from raysync.core.layout import Manifest, plan_layout
from raysync.errors import ApplyError, RaySyncError, SyncTimeoutError
from raysync.transports.base import Snapshot
from raysync.transports.object_store import ObjectStoreTransport
from raysync.transports.registry import check_transport
from raysync.transports.registry import info as transport_info

__all__ = ["RayActorTransport", "RayTransport", "apply_in_actor", "snapshot"]

logger = logging.getLogger(__name__)


def snapshot(weights: Any, *, manifest: Manifest | None = None) -> Snapshot:
    """A version of ``weights`` (module, TensorDict or state dict) in the object store, put once.

    The object-store data path's own snapshot (what a hub push takes): the weights packed into
    buckets, each ``ray.put`` once, with ``manifest`` (default: planned here).

    Raises:
        RayNotRunningError: Ray is not running in this process (no cluster is started).

    Example:
        >>> version = snapshot(torch.nn.Linear(4, 2))  # doctest: +SKIP
        >>> len(version.refs)
        1
    """
    tensors = extract_tensors(weights)
    return _object_store().snapshot("", tensors, manifest or plan_layout(tensors))


@functools.cache
def _object_store() -> ObjectStoreTransport:
    return ObjectStoreTransport()


def apply_in_actor(
    instance: Any, model_id: str, path: str | None, manifest: Manifest, wrapped: list[list[ray.ObjectRef]]
) -> str:
    """Actor side: fetch a version's buckets and apply it whole to the actor's model.

    Runs inside the actor (via ``__ray_call__``). Returns ``"updated"``, or
    ``"error: <why>"`` when the version is refused (the model keeps its weights).
    """
    from raysync.torchrl.receiver import receiver_for

    try:
        receiver = receiver_for(model_id, instance, path)
        receiver.apply_refs(model_id, manifest, wrapped[0])  # checked, then only the buckets it lacks
    except Exception as err:
        # Reported as the ack, not raised: an exception leaving a __ray_call__ can take the
        # actor down with it (a torchrl collector's actor, say) instead of reaching the sender.
        logger.warning("refused a version of %r: %s", model_id, err)
        return f"error: {type(err).__name__}: {err}"
    return "updated"


class RayTransport:
    """Updates ONE Ray actor (a collector, an inference worker) from the object store.

    Args:
        remote_collector: the actor handle.
        tensor_transport: accepted for torchrl compatibility; only
            ``"object_store"`` here (``raysync.connect(transport="nixl")`` for NIXL).
        timeout: default seconds :meth:`wait_ack` waits.
        model_path: where the model lives on the actor when no receiver was
            registered there (default: the model id, e.g. ``"policy"``).

    Example:
        >>> t = RayTransport(remote_collector=actor, timeout=30)
        >>> t.send_weights("policy", model)   # applied in the actor when it returns
    """

    def __init__(
        self,
        remote_collector: Any = None,
        tensor_transport: str = "object_store",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        model_path: str | None = None,
    ) -> None:
        check_transport(tensor_transport)
        if not transport_info(tensor_transport).object_store or not transport_info(tensor_transport).pushable:
            raise ValueError(
                f"tensor_transport={tensor_transport!r} is not supported by the schemes layer; use "
                "'object_store', or raysync.connect(transport='nixl') and @synced_model receivers"
            )
        check_timeout(timeout, allow_none=False, positive=True)
        self._actor = remote_collector
        self.timeout = float(timeout)
        self.model_path = model_path
        self._pending: Any = None
        self._pending_refs: list[ray.ObjectRef] = []

    @property
    def actor(self) -> Any:
        """The actor this transport updates."""
        return self._actor

    def set_actor(self, actor_ref: Any) -> None:
        """Point the transport at another actor."""
        self._actor = actor_ref

    def send_weights(self, *args: Any) -> None:
        """Send ``weights`` or ``(model_id, weights)`` and wait until the actor applied them."""
        self.send_weights_async(*args)
        self.wait_ack()

    def send_weights_async(self, *args: Any) -> None:
        """Start the update (``weights`` may be a version already in the store: a ``Snapshot``)."""
        if self._actor is None:
            raise RaySyncError("RayTransport has no actor: pass remote_collector= or call set_actor()")
        model_id, weights = split_send_args(args)
        version = weights if isinstance(weights, Snapshot) else snapshot(weights)
        # Nested refs are not resolved by Ray on the call: the actor fetches them itself.
        self._pending = self._actor.__ray_call__.remote(
            apply_in_actor, model_id, self.model_path, version.manifest, [version.refs]
        )
        self._pending_refs = version.refs  # keep the version alive until the actor replied

    def wait_ack(self, timeout: float | None = None) -> None:
        """Wait for the actor to apply the last version.

        Raises:
            SyncTimeoutError: no reply within ``timeout`` (default ``self.timeout``).
            ApplyError: the actor refused or failed to apply it (its model is unchanged).
        """
        if self._pending is None:
            raise RuntimeError("no send to wait for: call send_weights_async() first")
        limit = self.timeout if timeout is None else timeout
        pending, self._pending = self._pending, None
        try:
            reply = ray.get(pending, timeout=limit)
        except ray.exceptions.GetTimeoutError as err:
            raise SyncTimeoutError(
                f"actor {self._actor} did not apply the weights within {limit} s",
                laggards=[{"subscriber": str(self._actor), "applied": None, "error": None}],
            ) from err
        except ray.exceptions.RayError as err:
            cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
            detail = f"{type(cause).__name__}: {cause}"
            raise ApplyError(
                f"actor {self._actor} failed to apply the weights (it keeps its previous ones): {detail}",
                failures=[{"subscriber": str(self._actor), "error": detail}],
            ) from err
        finally:
            self._pending_refs = []
        ack_error(reply, worker=f"actor {self._actor}")

    def receive_weights(self, timeout: float | None = 1.0) -> tuple[str, dict[str, torch.Tensor]] | None:
        """Actors receive through calls made by the sender: always ``None`` here."""
        return None

    def send_ack(self, message: str = "updated") -> None:
        """The actor's reply is the ack: nothing to send."""

    def check_connection(self) -> bool:
        """Whether Ray is up and an actor is set."""
        return ray.is_initialized() and self._actor is not None


class RayActorTransport(RayTransport):
    """Updates a model hosted in a Ray actor (its ``module`` attribute by default).

    Args:
        actor_ref: the actor handle.
        update_method: ``"tensordict"`` or ``"state_dict"`` (kept for torchrl
            compatibility; both apply the same packed version).
        tensor_transport: ``"object_store"``.
        timeout: default seconds :meth:`wait_ack` waits.
        model_path: the attribute that holds the model on the actor (``"module"``).

    Example:
        >>> t = RayActorTransport(actor_ref=host_actor)
        >>> t.send_weights("policy", model)
    """

    def __init__(
        self,
        actor_ref: Any = None,
        update_method: str = "tensordict",
        tensor_transport: str = "object_store",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        model_path: str | None = "module",
    ) -> None:
        if update_method not in ("tensordict", "state_dict"):
            raise ValueError(f"update_method must be 'tensordict' or 'state_dict', got {update_method!r}")
        super().__init__(actor_ref, tensor_transport, timeout=timeout, model_path=model_path)
        self.update_method = update_method

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

import contextlib
import logging
import os
import time
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import ray
import torch
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme as _TorchRLScheme

from raysync._checks import check_timeout
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.core.extract import (
    _module_tensors,
    non_persistent_buffers,
    to_tensordict,
)
from raysync.errors import RaySyncError, SyncTimeoutError, UnknownModelError
from raysync.receivers.follower import Follower
from raysync.torchrl.collector_context import expected_workers, key_renaming
from raysync.torchrl.strategy import applier_for, apply_tensors, resolve_model, split_extra_state

__all__ = ["HubWeightSyncScheme"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05
"""How often a following scheme asks the hub for the model's newest version while none is there."""


class HubWeightSyncScheme(_TorchRLScheme):  # type: ignore[misc]
    """A torchrl weight-sync scheme that delivers through a raysync WeightHub.

    Hand it to any torchrl 0.14 collector as torchrl's docs hand a scheme
    (``weight_sync_schemes={"policy": scheme}``, with ``policy`` or ``policy_factory``):
    ``Collector``, ``AsyncCollector``, ``MultiSyncCollector``, ``MultiAsyncCollector``
    and ``torchrl.collectors.distributed.RayCollector``.

    Args:
        hub: the hub's name (see :func:`raysync.connect`).
        namespace: the hub's Ray namespace (``None``: raysync's own).
        timeout: seconds ``send`` waits for every worker to apply a version (and a
            worker with a weightless policy waits for its first version).
        strategy: ``"tensordict"`` or ``"state_dict"`` (torchrl's meaning).
        apply_locally: on the sender, also apply each version to the collector's own
            policy when it was sent from other weights.
        non_persistent_buffers: carry the policy's non-persistent buffers
            (``register_buffer(..., persistent=False)``) with its parameters and
            buffers, as torchrl's own sync does (the keys of ``TensorDict.from_module``),
            so workers act with them and a weightless worker gets them before its first
            batch. ``False``: the state dict's keys only (for a model that
            ``@raysync.synced_model`` actors, which hold state dict keys, follow too).
        follow_only: the weights come from another writer (a sharded trainer whose every
            rank pushes, a trainer actor): this process never pushes, nor the collector's policy
            first; workers start from the hub's newest version (none within ``timeout``: the
            collector raises SyncTimeoutError before any worker starts), and
            ``update_policy_weights_()`` returns once every worker, and the collector's
            own policy, hold the hub's newest version. Weights other than the
            collector's own policy's are refused.

    ``send`` takes the forms torchrl's docs pass: an ``nn.Module``,
    ``TensorDict.from_module(module)`` (or ``as_module=True``: a ``TensorDictParams``),
    a state dict, keyed like the collector's policy or like the module it wraps.
    A state dict leaves non-persistent buffers out: they keep the collector's
    policy's values.

    Sender side (the collector's process): ``init_on_sender`` pushes the collector's
    policy as the first version (so workers that got a weightless, meta-device copy of
    it start from its weights); ``send(weights)`` is one ``hub.push`` that returns once
    every worker of this collector holds the version, else raises
    :class:`~raysync.SyncTimeoutError` or :class:`~raysync.ApplyError` naming the
    workers. Worker side (torchrl's worker processes, which join the Ray cluster of the
    sender by themselves, and RayCollector's actors): a :class:`raysync.Follower`
    registers with the hub (``raysync status`` lists it as ``torchrl worker <i>``),
    applies the newest version, then follows in a background thread, applying each
    version whole between two forward calls of the policy, and acknowledging it.

    When a worker acts with a version: sync collectors (``Collector``,
    ``MultiSyncCollector``, sync ``RayCollector``) from their next batch on; async
    ones (``AsyncCollector``, ``MultiAsyncCollector``, async ``RayCollector``) may
    deliver the batch each worker was collecting during the update (at most one per
    worker) before batches of the new version.

    Example:
        >>> scheme = HubWeightSyncScheme(hub="raysync", timeout=30)
        >>> collector = MultiSyncCollector([make_env] * 4, policy, frames_per_batch=64,
        ...                                total_frames=-1, weight_sync_schemes={"policy": scheme})
        >>> collector.update_policy_weights_()   # every worker acts with the policy's weights now
    """

    def __init__(
        self,
        hub: str = "raysync",
        *,
        namespace: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        strategy: str = "tensordict",
        apply_locally: bool = True,
        non_persistent_buffers: bool = True,
        follow_only: bool = False,
    ) -> None:
        super().__init__(strategy=strategy)
        check_timeout(timeout, allow_none=False, positive=True)
        self.hub = hub
        self.namespace = namespace
        self.timeout = float(timeout)
        self.apply_locally = apply_locally
        self.non_persistent_buffers = bool(non_persistent_buffers)
        self.follow_only = bool(follow_only)
        self._uid = uuid.uuid4().hex[:8]  # names this scheme's workers on the hub
        self._ray_address: str | None = None  # the sender's cluster, for workers to join
        self._expected = 0  # workers the sender waits for (0: none, a single-process collector)
        self._applied: int | None = None
        self._client: Any = None
        self._follower: Follower | None = None

    # ------------------------------------------------------------------ plumbing
    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        state["_client"] = None
        state["_applied"] = None
        state["_follower"] = None
        return state

    @property
    def client(self) -> Any:
        """The :class:`raysync.HubClient` (connected on first use)."""
        if self._client is None:
            from raysync.client.connect import connect

            self._client = connect(self.hub, namespace=self.namespace)
        return self._client

    @property
    def version(self) -> int | None:
        """The newest hub version this scheme sent (sender) or applied (worker); ``None``: none yet."""
        return self._applied

    @property
    def follower(self) -> Follower | None:
        """On a worker: the :class:`raysync.Follower` that keeps its policy in step."""
        return self._follower

    def create_transport(self, **kwargs: Any) -> Any:
        """No per-worker transport: the hub is the transport."""
        return None

    def _init(self, model_id: str, context: Any, kwargs: dict[str, Any]) -> None:
        """What both sides' init takes: the model id, the collector (context), ``model=``."""
        self._model_id = model_id
        self.context = context
        if kwargs.get("model") is not None:
            self.model = kwargs["model"]

    def _init_on_sender_impl(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        self._init(model_id, context, kwargs)
        _ = self.client  # connects Ray (and the hub) in this process
        self._expected = expected_workers(context, kwargs)
        if self.follow_only and self._expected:  # workers start from the newest: before any starts,
            self._first_version()  # one error
        self._ray_address = ray.get_runtime_context().gcs_address
        local = self._local_model()
        own = self._own(local) if isinstance(local, torch.nn.Module) else {}
        if own and not _weightless(own) and not self.follow_only:
            # The first version: workers get weightless (meta) copies of the policy.
            self._applied = self.client.push(self._payload(local), model_id)

    def _init_on_receiver_impl(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        self._init(model_id, context, kwargs)
        if kwargs.get("worker_idx") is not None:
            self._worker_idx = kwargs["worker_idx"]
        _join_cluster(self._ray_address)

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any | None = None
    ) -> None:
        if weights is not None:
            self.send(weights)

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        if worker_idx is not None:
            self._worker_idx = worker_idx
        if self._follower is not None:
            return
        if self._ray_address is None:  # a receiver made by hand (not by a collector): pull on receive()
            self.receive()
            return
        idx = self._worker_idx
        who = (
            f"worker{idx}"
            if idx is not None
            else (ray.get_runtime_context().get_actor_id() or f"pid{os.getpid()}")
        )
        self._follower = Follower(
            self._local_model,
            self._model_id or "policy",
            hub=self.hub,
            namespace=self.namespace,
            sub_id=f"{_SUB_PREFIX}{self._uid}-{who}:{self._model_id or 'policy'}",
            label=f"torchrl {who.replace('worker', 'worker ')}",
            timeout=self.timeout,
            on_apply=self._on_apply,
            non_persistent=self.non_persistent_buffers,
        ).start()

    def _on_apply(self, version: int) -> None:
        self._applied = version
        self._stamp(self.context, version)

    @staticmethod
    def _stamp(context: Any, version: int | None) -> None:
        """Tell the worker's collector the hub version it acts with (``track_policy_version``)."""
        setter = getattr(context, "_set_received_policy_version", None)
        if setter is not None and version is not None:
            setter(version)

    def _set_context(self, context: Any) -> None:
        _TorchRLScheme.context.fset(self, context)
        # torchrl hands a worker's collector over after the first version was applied: stamp it now.
        follower = getattr(self, "_follower", None)
        if context is not None and follower is not None:
            self._stamp(context, follower.version)

    context = property(_TorchRLScheme.context.fget, _set_context)

    def _local_model(self) -> Any:
        if self._model_ref is not None:
            model = self._model_ref()
            if model is not None:
                return model
        context = self.context
        if context is None or self._model_id is None:
            return None
        try:
            return resolve_model(context, self._model_id)
        except Exception:
            return None

    def _own(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The tensors a version of ``module`` carries (meta ones included, not detached)."""
        return _module_tensors(module, keep_vars=True, non_persistent=self.non_persistent_buffers)

    def _payload(self, source: Any) -> dict[str, Any]:
        """What to push: the tensors of ``source`` and its extra state, as one flat dict.

        Keyed like the collector's policy (a wrapper's prefix added or dropped); a state
        dict's missing non-persistent buffers come from the collector's policy.
        """
        tensors, extra = self._fitted(source)
        return {**tensors, **extra}

    def _fitted(self, source: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``source``'s tensors by dotted key and extra state by state dict key (any weights form),
        keyed like the collector's policy."""
        if isinstance(source, weakref.ref):
            source = source()
        tensors, extra = split_extra_state(source, non_persistent=self.non_persistent_buffers)
        local = self._local_model()
        if isinstance(local, torch.nn.Module) and local is not source:
            tensors, extra = self._fit(tensors, extra, local)
        return tensors, extra

    def _fit(
        self, tensors: dict[str, torch.Tensor], extra: dict[str, Any], model: torch.nn.Module
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``tensors`` and ``extra`` keyed like ``model``, with its non-persistent buffers
        where they are carried and the weights lack them (a state dict); as they are when
        no renaming fits (validation then names what differs)."""
        own = _module_tensors(model, keep_vars=True, non_persistent=True)
        buffers = set(non_persistent_buffers(model))
        rename = key_renaming(set(tensors), [set(own), set(own) - buffers])
        if rename is None:
            return tensors, extra
        tensors = {rename(k): v for k, v in tensors.items()}
        extra = {rename(k): v for k, v in extra.items()}
        if not self.non_persistent_buffers:
            return {k: v for k, v in tensors.items() if k not in buffers}, extra
        lacking = buffers - set(tensors)
        if lacking and not any(own[k].is_meta for k in lacking):
            tensors.update({k: own[k].detach() for k in lacking})
        return tensors, extra

    # ------------------------------------------------------------------ use
    def send(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Push a version through the hub; return once every worker (and the collector) holds it.

        Raises:
            SyncTimeoutError: a worker did not apply it within ``timeout`` (or is gone).
            ApplyError: a worker failed to apply it (its error in the message).
        """
        if worker_ids is not None:
            raise ValueError("HubWeightSyncScheme delivers to every subscriber of the hub: drop worker_ids")
        model_id = self._model_id or "policy"
        if self.follow_only:
            self._catch_up(weights, model_id)
            return
        source = weights if weights is not None else self._local_model()
        if source is None:
            raise ValueError(
                f"no weights to send for {model_id!r}: pass weights, or give the collector a policy"
            )
        payload = self._payload(source)
        t0 = time.monotonic()
        version = self.client.push(payload, model_id, wait=True, timeout=self.timeout)
        self._check_workers(version, t0 + self.timeout)
        if self.apply_locally:
            local = self._local_model()
            if isinstance(local, torch.nn.Module) and not _same_storage(self._own(local), payload):
                self._apply_from_hub(local, version)
        self._applied = version

    def _catch_up(self, weights: Any, model_id: str) -> None:
        """``send`` of a scheme that only follows: every worker and the local policy take the newest.

        The collector's own weights (what ``RayCollector`` hands over for a bare
        ``update_policy_weights_()``) are not pushed; other weights are refused.
        """
        local = self._local_model()
        own = self._own(local) if isinstance(local, torch.nn.Module) else {}
        if weights is not None and not (weights is local or _same_storage(own, self._payload(weights))):
            raise ValueError(
                f"this HubWeightSyncScheme follows {model_id!r} (follow_only=True): its writer pushes "
                "the weights; call update_policy_weights_() without weights to catch up with it"
            )
        deadline = time.monotonic() + self.timeout
        latest = self._first_version()
        self._check_workers(latest, deadline, joining=True)
        if self.apply_locally and own and not _weightless(own):
            if self._applied is None or self._applied < latest:
                self._apply_from_hub(local, latest)
        self._applied = latest

    def _first_version(self) -> int:
        """The model's newest version on the hub, waiting up to ``timeout`` for a first one.

        Raises:
            SyncTimeoutError: nothing was pushed for the model within ``timeout``.
        """
        model_id = self._model_id or "policy"
        deadline = time.monotonic() + self.timeout
        said = False
        while True:
            try:
                latest: int | None = self.client.latest(model_id)
            except UnknownModelError:  # a hub that names the models it has: none of this one yet
                latest = None
            if latest is not None:
                return latest
            if time.monotonic() >= deadline:
                raise SyncTimeoutError(
                    f"no version of {model_id!r} on hub {self.hub!r} within {self.timeout:g} s: this "
                    "HubWeightSyncScheme follows it (follow_only=True) and its writer has not pushed yet; "
                    "push a first version before creating the collector, or give the scheme a longer timeout="
                )
            if not said:
                logger.info(
                    "waiting up to %g s for the first version of %r on hub %r",
                    self.timeout,
                    model_id,
                    self.hub,
                )
                said = True
            time.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0.0)))

    def _check_workers(self, version: int, deadline: float, joining: bool = False) -> None:
        """Every worker of this collector holds ``version``: none is missing from the hub.

        ``joining``: workers not yet subscribed are waited for (nothing was pushed to them).
        """
        if not self._expected:
            return
        prefix = f"{_SUB_PREFIX}{self._uid}-"
        while True:
            rows = [
                r
                for r in self.client.status()["subscribers"]
                if r["subscriber"].startswith(prefix) and r["model_id"] == (self._model_id or "policy")
            ]
            holding = [r for r in rows if r["state"] != "dead" and (r["applied"] or 0) >= version]
            if len(holding) >= self._expected:
                return
            # The push waited for every subscribed worker: one missing from the hub is gone
            # (dead, dropped); only a subscribed one still behind (re-registering) is waited for.
            if (len(holding) == len(rows) and not joining) or time.monotonic() >= deadline:
                behind = ", ".join(
                    f"{r['class_name']} (pid {r['pid']}, holds {r['applied']}, {r['state']}"
                    + (f", {r['last_error']}" if r["last_error"] else "")
                    + ")"
                    for r in rows
                    if r not in holding
                )
                raise SyncTimeoutError(
                    f"{len(holding)} of the collector's {self._expected} workers hold version {version} of "
                    f"{self._model_id!r}; "
                    + (f"behind: {behind}; " if behind else "")
                    + f"{self._expected - len(rows)} not subscribed to hub {self.hub!r} (dead, never joined)"
                )
            time.sleep(0.05)

    def _apply_from_hub(self, model: Any, version: int) -> Any:
        model_id = self._model_id or "policy"
        pulled = self.client.pull(model_id, version, state_dict=True)
        tensors, _ = self._fit(pulled, {}, model)
        apply_tensors(applier_for(model, non_persistent=self.non_persistent_buffers), tensors)
        self._applied = version
        return to_tensordict(pulled)  # nested, as torchrl's weights are

    def receive(self, timeout: float | None = None) -> Any:
        """Apply the hub's newest version if newer than the one held; return it (or ``None``).

        On a worker that follows the hub, wait (up to ``timeout``) until its follower
        holds the newest version instead.
        """
        model_id = self._model_id or "policy"
        latest = self.client.latest(model_id)
        if latest is None or (self._applied is not None and latest <= self._applied):
            return None
        if self._follower is not None:
            self._follower.wait_for(latest, self.timeout if timeout is None else timeout)
            return None
        model = self._local_model()
        if model is None:
            raise SyncTimeoutError(f"no model to apply {model_id!r} to: pass model= or a context")
        return self._apply_from_hub(model, latest)

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Apply ``weights`` (any form :meth:`send` takes) to the registered model, whole or not at all."""
        tensors, extra = self._fitted(weights)
        applier = applier_for(self._local_model(), non_persistent=self.non_persistent_buffers)
        apply_tensors(applier, tensors, extra_state=extra)

    def shutdown(self) -> None:
        """Stop following the hub (a worker), then torchrl's own clean-up."""
        follower, self._follower = getattr(self, "_follower", None), None
        if follower is not None:
            with contextlib.suppress(Exception):
                follower.stop(timeout=2.0)
        super().shutdown()


_SUB_PREFIX = "torchrl-"


def _weightless(tensors: Mapping[str, torch.Tensor]) -> bool:
    return any(t.device.type == "meta" for t in tensors.values())


def _same_storage(own: Mapping[str, torch.Tensor], payload: Mapping[str, Any]) -> bool:
    """Whether the payload's tensors are the model's own (sending its weights: nothing to apply back)."""
    tensors = [t for t in payload.values() if isinstance(t, torch.Tensor)]
    ptrs = {t.data_ptr() for t in own.values()}
    return bool(tensors) and all(t.data_ptr() in ptrs for t in tensors)


def _join_cluster(address: str | None) -> None:
    """Connect this process (a torchrl worker) to the sender's Ray cluster, if not connected."""
    if ray.is_initialized():
        return
    if address is None:
        raise RaySyncError(
            "HubWeightSyncScheme: this process is not connected to Ray and the scheme does not know the "
            "cluster (it was not initialised on a sender): call ray.init(address=...) here first"
        )
    ray.init(address=address, log_to_driver=False, ignore_reinit_error=True)

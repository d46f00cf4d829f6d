"""``MultiProcessedRemoteWeightUpdate``: torchrl's older updater, on the schemes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raysync.core.extract import extract_tensors
from raysync.core.layout import plan_layout
from raysync.receivers.pipeline import Applier
from raysync.torchrl.strategy import applier_for, apply_tensors

__all__ = ["MultiProcessedRemoteWeightUpdate"]


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

    def _applier(self, worker_id: Any) -> Applier:
        if worker_id not in self.policy_weights:
            raise KeyError(f"unknown worker id {worker_id!r}; known: {self.all_worker_ids()}")
        return applier_for(self.policy_weights[worker_id])

    def _sync_weights_with_worker(self, worker_id: Any, server_weights: Any) -> None:
        apply_tensors(self._applier(worker_id), extract_tensors(server_weights))

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
            self._applier(worker_id).target.check(manifest)
        for worker_id in ids:
            self._sync_weights_with_worker(worker_id, tensors)

    __call__ = push_weights

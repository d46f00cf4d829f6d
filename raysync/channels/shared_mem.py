"""Shared-memory snapshots that workers point into: a new version becomes visible only when sent.

Like :mod:`raysync.channels.pipe` (pipes for signals, a shared-memory
snapshot for bytes, written once for all workers), but the worker does not
copy: on receiving a version it re-points its parameters and buffers at the
snapshot set (the ``Parameter`` objects stay the same) and acks. The sender
writes each version into a set that no worker points at, so workers never see
the trainer's live parameters, nor a version half-written: they see version
*k* from the moment they receive it until they receive the next.

Which side runs what: the sender writes the snapshot (``SnapshotPool.write``)
and calls ``send_weights_async`` / ``wait_ack``; the worker calls
``receive_snapshot`` (zero copy; what :class:`raysync.schemes.WeightReceiver`
uses) or ``receive_weights`` (a private copy, the protocol's call) and
``send_ack``. Worker models must not be written in place: they share memory.

torchrl 0.14's call shapes work too: ``SharedMemTransport()`` (no pipe),
``register_weights(params_map, init_queues)``,
``setup_connection_and_weights_on_sender()`` /
``setup_connection_and_weights_on_receiver(worker_idx=i)`` and
``send_weights(weights)``, which writes the registered shared buffers in place
(as torchrl's does), after checking the weights against every buffer.

Example:
    >>> scheme = raysync.schemes.SharedMemWeightSyncScheme()
    >>> scheme.init_on_sender(model_id="policy", pipes=[parent_end])  # doctest: +SKIP
    >>> t = SharedMemTransport()                                         # torchrl's shapes
    >>> t.register_weights({0: shared_td}, {0: queue})                   # doctest: +SKIP
    >>> t.send_weights(TensorDict.from_module(policy))                   # doctest: +SKIP
"""

from __future__ import annotations

import queue as queue_module
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.channels.pipe import MPTransport
from raysync.core.extract import extract_tensors, non_persistent_buffers
from raysync.core.layout import plan_layout, schema_of, validate
from raysync.errors import SyncTimeoutError

__all__ = ["SharedMemTransport"]


class SharedMemTransport(MPTransport):
    """One worker's pipe; the worker's model points into the shared snapshot it was sent.

    Args:
        pipe_connection: this side's end of a ``multiprocessing.Pipe``; ``None``
            (torchrl 0.14's ``SharedMemTransport()``): no pipe, the workers read
            shared buffers registered with :meth:`register_weights`.
        timeout: default seconds :meth:`wait_ack` (and, without a pipe,
            :meth:`setup_connection_and_weights_on_receiver`) waits.

    With torchrl's call shapes (no pipe) the transport is one for all workers:
    :meth:`register_weights` takes ``{worker_idx: shared weights}`` and
    ``{worker_idx: queue}``; :meth:`setup_connection_and_weights_on_sender` hands
    each worker its shared weights through its queue, and the worker takes them
    with :meth:`setup_connection_and_weights_on_receiver`; :meth:`send_weights`
    writes new weights into the shared buffers, in place (every buffer is checked
    first: keys, shapes, dtypes; a mismatch changes none); a worker then copies
    them into its model with ``receive_weights(weights=shared, model=model)``.
    Such a transport pickles (with its queues and shared buffers), as torchrl's.

    Example:
        >>> t = SharedMemTransport(parent_end, timeout=30)  # doctest: +SKIP
        >>> t.send_weights("policy", model)  # doctest: +SKIP
        >>> shared = SharedMemTransport()  # torchrl 0.14's shapes
        >>> shared.register_weights({0: td, 1: td}, {0: q0, 1: q1})  # doctest: +SKIP
        >>> shared.setup_connection_and_weights_on_sender()  # doctest: +SKIP
        >>> shared.send_weights(TensorDict.from_module(policy))  # doctest: +SKIP
    """

    keeps_snapshot = True

    def __init__(self, pipe_connection: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(pipe_connection, timeout)
        self._params_map: dict[int, Any] | None = None
        self._weight_queues: dict[int, Any] | None = None
        self._unique_weights: list[Any] | None = None
        self._worker_to_weights_idx: dict[int, int] = {}
        self._per_worker = False

    def __getstate__(self) -> dict[str, Any]:
        if self.pipe is not None:
            return super().__getstate__()  # raises: a live pipe does not pickle
        return self.__dict__.copy()

    # ------------------------------------------------------------------ torchrl 0.14's shapes
    @property
    def unique_weights(self) -> list[Any]:
        """The distinct shared weights registered (one per worker with ``per_worker=True``).

        Raises:
            RuntimeError: :meth:`register_weights` was not called.
        """
        if self._unique_weights is None:
            raise RuntimeError("no weights registered: call register_weights(params_map, init_queues) first")
        return list(self._unique_weights)

    def register_weights(
        self, params_map: Mapping[int, Any], init_queues: Mapping[int, Any], per_worker: bool = False
    ) -> None:
        """Register each worker's shared weights and the queue that hands them over (torchrl's shape).

        Args:
            params_map: ``{worker_idx: weights}`` (a ``TensorDict`` in shared memory, as
                torchrl's schemes make; a state dict works too). Workers given the same
                object share it, and :meth:`send_weights` writes it once.
            init_queues: ``{worker_idx: multiprocessing queue}``, one per worker.
            per_worker: each worker's weights are its own (distinct policy factories):
                :meth:`send_weights` may then take ``{worker_idx: weights}``.

        Raises:
            ValueError: a key is not an int, or a worker has weights but no queue.
        """
        if not all(isinstance(k, int) for k in params_map):
            raise ValueError(f"params_map must be keyed by worker index (int), got keys {list(params_map)}")
        lacking = sorted(set(params_map) - set(init_queues))
        if lacking:
            raise ValueError(f"init_queues has no queue for worker(s) {lacking}")
        self._params_map = dict(params_map)
        self._weight_queues = dict(init_queues)
        self._per_worker = bool(per_worker)
        self._unique_weights = []
        self._worker_to_weights_idx = {}
        for worker_idx, weights in sorted(self._params_map.items()):
            known = [i for i, w in enumerate(self._unique_weights) if w is weights]
            if known and not self._per_worker:
                self._worker_to_weights_idx[worker_idx] = known[0]
                continue
            self._worker_to_weights_idx[worker_idx] = len(self._unique_weights)
            self._unique_weights.append(weights)

    def setup_connection_and_weights_on_sender(self) -> None:
        """Hand each registered worker its shared weights through its queue (torchrl's shape).

        Raises:
            RuntimeError: :meth:`register_weights` was not called.
        """
        if self._weight_queues is None or self._params_map is None:
            raise RuntimeError("no weights registered: call register_weights(params_map, init_queues) first")
        for worker_idx, init_queue in sorted(self._weight_queues.items()):
            if worker_idx in self._params_map:
                init_queue.put(self._params_map[worker_idx])

    def setup_connection_and_weights_on_receiver(
        self,
        *,
        worker_idx: int | None = None,
        weights: Any = None,
        model: Any = None,
        strategy: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """Worker: take this worker's shared weights from its queue and return them (torchrl's shape).

        ``weights``, ``model`` and ``strategy`` are accepted and unused, as torchrl's;
        apply the shared weights with :meth:`receive_weights`. A transport with a pipe
        has nothing to set up: returns ``None``.

        Raises:
            RuntimeError: no queue is registered for ``worker_idx``.
            SyncTimeoutError: nothing arrived within ``timeout`` (default: the transport's).
        """
        if self.pipe is not None and self._weight_queues is None:
            return None
        if self._weight_queues is None or worker_idx not in self._weight_queues:
            raise RuntimeError(
                f"no queue for worker {worker_idx!r}: register_weights() on the sender registered "
                f"workers {sorted(self._weight_queues or {})}"
            )
        limit = self.timeout if timeout is None else timeout
        try:
            return self._weight_queues[worker_idx].get(timeout=limit)
        except queue_module.Empty:
            raise SyncTimeoutError(
                f"worker {worker_idx} got no shared weights within {limit} s: did the sender call "
                "setup_connection_and_weights_on_sender()?"
            ) from None

    def send_weights(self, *args: Any, worker_ids: int | Sequence[int] | None = None) -> None:
        """Send a version: ``(weights)`` or ``(model_id, weights)``.

        With a pipe: snapshot it, signal the worker and wait for its ack (see
        :class:`~raysync.channels.pipe.MPTransport`). With registered weights (torchrl's
        shape, also ``send_weights(weights, worker_ids)``): write ``weights`` into the
        shared buffers in place, every buffer (or those of ``worker_ids`` with
        ``per_worker``); ``{worker_idx: weights}`` gives each worker its own
        (``per_worker`` only). Weights may be a ``TensorDict``, a state dict (nested or
        dotted keys) or an ``nn.Module``.

        Raises:
            WeightMismatchError: the weights do not fit a buffer (keys, shapes, dtypes):
                no buffer was written.
            ValueError: per-worker weights without ``per_worker``, or an unknown worker.
        """
        if self._unique_weights is None:
            if self.pipe is None:
                raise RuntimeError(
                    "SharedMemTransport() has no pipe and no registered weights: call "
                    "register_weights(params_map, init_queues) first, or give it a pipe"
                )
            super().send_weights(*args)
            return
        if len(args) == 2 and isinstance(args[0], str):
            weights = args[1]
        elif len(args) == 2:
            weights, worker_ids = args
        elif len(args) == 1:
            weights = args[0]
        else:
            raise TypeError(
                f"send_weights takes (weights[, worker_ids]) or (model_id, weights), got {len(args)}"
            )
        self._write_shared(self._targets(weights, worker_ids))

    def send_weights_async(self, *args: Any) -> None:
        """Start sending; with registered weights (no ack to wait for) the write is done on return."""
        if self._unique_weights is None:
            super().send_weights_async(*args)
            return
        self.send_weights(*args)

    def wait_ack(self, timeout: float | None = None) -> None:
        """Wait for the ack of the last send (with a pipe; registered weights have none to wait for)."""
        if self.pipe is None:
            return
        super().wait_ack(timeout)

    def receive_weights(
        self,
        timeout: float | None = 1.0,
        *,
        weights: Any = None,
        model: Any = None,
        strategy: Any = None,
    ) -> Any:
        """Worker: the next version (with a pipe), or apply shared ``weights`` to ``model`` (torchrl's shape).

        With a pipe and no keyword: ``(model_id, tensors)`` in private memory, or
        ``None`` after ``timeout`` (see :class:`~raysync.channels.pipe.MPTransport`).
        Given ``weights`` and ``model``: copy the weights into the model, whole or
        not at all, with ``strategy`` (default: :meth:`default_strategy`), and
        return ``weights``; ``None`` when either is missing.

        Raises:
            WeightMismatchError: the weights do not fit the model (it is left as it was).
        """
        if weights is None and model is None and strategy is None and self.pipe is not None:
            return super().receive_weights(timeout)
        if weights is None or model is None:
            return None
        if strategy is None:
            strategy = self.default_strategy()
        strategy.apply_weights(model, weights)
        return weights

    def default_strategy(self) -> Any:
        """What applies shared weights when no ``strategy=`` is given: the torchrl layer's
        ``raysync.torchrl.SharedMemTransport`` gives its ``WeightStrategy`` (this layer has none)."""
        raise TypeError("pass strategy= (a WeightStrategy), or use raysync.torchrl.SharedMemTransport")

    def send_ack(self, message: str = "updated") -> None:
        """Worker: acknowledge the last version (with a pipe; without one there is no ack)."""
        if self.pipe is not None:
            super().send_ack(message)

    def check_connection(self) -> bool:
        """Whether the pipe is open (always true without a pipe)."""
        return self.pipe is None or super().check_connection()

    # ------------------------------------------------------------------ internals
    def _targets(self, weights: Any, worker_ids: int | Sequence[int] | None) -> list[tuple[Any, Any]]:
        """``(shared buffer, weights)`` pairs to write."""
        assert self._unique_weights is not None
        if isinstance(weights, dict) and len(weights) > 0 and all(isinstance(k, int) for k in weights):
            if not self._per_worker:
                raise ValueError(
                    "per-worker weights ({worker_idx: weights}) need register_weights(..., per_worker=True): "
                    "workers share one buffer otherwise"
                )
            return [(self._buffer_of(idx), w) for idx, w in sorted(weights.items())]
        if worker_ids is not None and self._per_worker:
            ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
            return [(self._buffer_of(idx), weights) for idx in ids]
        return [(buffer, weights) for buffer in self._unique_weights]

    def _buffer_of(self, worker_idx: int) -> Any:
        assert self._unique_weights is not None
        if worker_idx not in self._worker_to_weights_idx:
            raise ValueError(
                f"worker {worker_idx} not registered; registered: {sorted(self._worker_to_weights_idx)}"
            )
        return self._unique_weights[self._worker_to_weights_idx[worker_idx]]

    def _write_shared(self, pairs: list[tuple[Any, Any]]) -> None:
        """Check every pair, then copy each: whole or nothing."""
        plans = []
        for buffer, weights in pairs:
            dst = extract_tensors(buffer)
            src = _flat(weights, dst)
            validate(plan_layout(src), schema_of(dst))
            plans.append((dst, src))
        on_cuda = False
        with torch.no_grad():
            for dst, src in plans:
                for key, target in dst.items():
                    target.copy_(src[key], non_blocking=True)
                    on_cuda = on_cuda or target.is_cuda
        if on_cuda:
            torch.cuda.synchronize()


def _flat(weights: Any, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` by dotted key; a module's non-persistent buffers where ``like`` has them."""
    if isinstance(weights, torch.nn.Module):
        buffers = set(non_persistent_buffers(weights))
        tensors = extract_tensors(weights, non_persistent=True)
        return {k: v for k, v in tensors.items() if k not in buffers or k in like}
    return extract_tensors(weights)

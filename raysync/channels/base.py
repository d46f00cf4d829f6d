"""The transport protocol of :mod:`raysync.schemes`: one object per receiver (worker).

A transport moves one version of one model from a sender to ONE worker and
carries the worker's acknowledgement back. Packing (``extract_tensors`` ->
``plan_layout`` -> bucket bytes) comes from :mod:`raysync.core`; validation
against the worker's model and the whole-or-nothing apply happen in
:class:`raysync.schemes.WeightReceiver`, never in a transport.

Lifecycle (which side runs each method):

- **sender**: ``send_weights(weights)`` or ``send_weights(model_id, weights)``
  (= ``send_weights_async`` + ``wait_ack``); ``send_weights_async(...)``
  returns once the transfer has started; ``wait_ack(timeout)`` waits for the
  worker's ack, raising :class:`raysync.SyncTimeoutError` after ``timeout``
  (default: the transport's ``timeout`` attribute, 60 s) and
  :class:`raysync.ApplyError` if the worker acked with ``"error: ..."``;
  ``check_connection()``.
- **worker**: ``receive_weights(timeout)`` returns ``(model_id, tensors)``
  once a whole version has arrived (``tensors`` a flat, sorted
  ``{dotted_key: tensor}`` in private memory), or ``None`` after ``timeout``;
  it always consumes a whole version's bytes, even one the worker will refuse,
  so a mismatch never leaves the sender blocked. ``send_ack(message)``
  acknowledges the last version (``"error: <text>"`` for a failed apply).

The manifest (:class:`raysync.core.layout.Manifest`, small and picklable) is sent
before the bytes so the worker can allocate exactly the buckets.

Example:
    >>> from raysync.channels.base import TransportBackend
    >>> isinstance(transport, TransportBackend)  # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from raysync.errors import ApplyError

__all__ = [
    "DEFAULT_TIMEOUT",
    "TransportBackend",
    "ack_error",
    "split_send_args",
]

DEFAULT_TIMEOUT = 60.0
"""Seconds a transport waits for an ack (or a peer) unless told otherwise."""


@runtime_checkable
class TransportBackend(Protocol):
    """What :mod:`raysync.schemes` needs from a transport (one per worker).

    Attributes:
        timeout: default seconds for :meth:`wait_ack`.

    Example:
        >>> transport.send_weights("policy", model)  # doctest: +SKIP
        >>> # on the worker:
        >>> model_id, tensors = transport.receive_weights(timeout=5.0)  # doctest: +SKIP
        >>> transport.send_ack("updated")  # doctest: +SKIP
    """

    timeout: float

    def send_weights(self, *args: Any) -> None:
        """Sender: send ``weights`` or ``(model_id, weights)`` and wait for the worker's ack."""
        ...

    def send_weights_async(self, *args: Any) -> None:
        """Sender: start sending ``weights`` or ``(model_id, weights)``; do not wait."""
        ...

    def wait_ack(self, timeout: float | None = None) -> None:
        """Sender: wait for the ack of the last send (``SyncTimeoutError`` / ``ApplyError``)."""
        ...

    def check_connection(self) -> bool:
        """Either side: whether the peer is reachable."""
        ...

    def receive_weights(self, timeout: float | None = 1.0) -> tuple[str, dict[str, torch.Tensor]] | None:
        """Worker: a whole version as ``(model_id, {key: tensor})``, or ``None`` after ``timeout``."""
        ...

    def send_ack(self, message: str = "updated") -> None:
        """Worker: acknowledge the last version (``"error: <text>"`` for a failed apply)."""
        ...


def split_send_args(args: tuple[Any, ...], default_model_id: str = "policy") -> tuple[str, Any]:
    """Read both call shapes of ``send_weights``: ``(weights)`` and ``(model_id, weights)``.

    Example:
        >>> split_send_args(("policy", {"w": torch.ones(1)}))[0]
        'policy'
        >>> split_send_args(({"w": torch.ones(1)},), "value")[0]
        'value'
    """
    if len(args) == 1:
        return default_model_id, args[0]
    if len(args) == 2 and isinstance(args[0], str):
        return args[0], args[1]
    raise TypeError(
        f"send_weights takes (weights) or (model_id: str, weights), got {len(args)} argument(s) "
        f"of types {[type(a).__name__ for a in args]}"
    )


def ack_error(message: Any, *, worker: str = "worker") -> None:
    """Raise :class:`raysync.ApplyError` if an ack message reports a failure.

    Example:
        >>> ack_error("updated")
        >>> ack_error("error: shape mismatch")
        Traceback (most recent call last):
        ...
        raysync.errors.ApplyError: worker failed to apply the weights: shape mismatch
    """
    text = str(message)
    if text.startswith("error"):
        detail = text.partition(":")[2].strip() or text
        raise ApplyError(
            f"{worker} failed to apply the weights: {detail}",
            failures=[{"subscriber": worker, "error": detail}],
        )

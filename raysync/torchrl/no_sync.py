"""``NoWeightSyncScheme``: weight synchronisation switched off, with torchrl 0.14's call shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raysync.torchrl.base import WeightSyncScheme
from raysync.torchrl.collector_context import NoOpTransport, is_weightless
from raysync.torchrl.sender import WeightSender

__all__ = ["NoWeightSyncScheme"]


class _NoOpSender(WeightSender):
    """The sender of :class:`NoWeightSyncScheme`: every send does nothing (the reference's no-op sender)."""

    # send() and update_weights() are send_async() then wait_async(): nothing either.
    def send_async(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Do nothing."""

    def wait_async(self, timeout: float | None = None) -> None:
        """Do nothing: no send is ever pending."""


class NoWeightSyncScheme(WeightSyncScheme):
    """Weight synchronisation switched off: sends do nothing, nothing is ever received.

    As torchrl's: with any collector, ``update_policy_weights_()`` does nothing.
    Its sender (``get_sender()``) does nothing either, as the reference's:
    ``send``, ``send_async``, ``wait_async`` and ``update_weights`` return at
    once, with or without weights or workers.
    A worker handed a weightless (meta) policy (a multi-process collector given
    ``policy=``) is refused with a clear error at start-up: pass ``policy_factory=``.

    Example:
        >>> scheme = NoWeightSyncScheme()
        >>> scheme.init_on_sender(model_id="policy")
        >>> scheme.send({"w": torch.ones(1)})   # nothing happens
        >>> scheme.get_sender().send()          # nor here
    """

    backend = "none"

    def create_sender(self) -> WeightSender:
        """A sender whose sends do nothing."""
        return _NoOpSender(self)

    def create_transport(self, pipe_or_context: Any = None, **kwargs: Any) -> NoOpTransport:
        """A transport that moves nothing."""
        return NoOpTransport()

    def send(self, weights: Any = None, worker_ids: int | Sequence[int] | None = None) -> None:
        """Do nothing."""

    def _connect_sender(self, weights: Any) -> None:
        """Nothing to send."""

    def _worker_endpoint(self, context: Any, kwargs: dict[str, Any]) -> Any:
        return NoOpTransport()

    def _check_receiver_model(self, model: Any) -> None:
        if is_weightless(model):
            raise ValueError(
                "NoWeightSyncScheme cannot fill the weightless (meta) policy a multi-process collector "
                "sends its workers when given policy=: pass policy_factory= so that each worker builds "
                "its own policy, or use a scheme that syncs (MultiProcessWeightSyncScheme, "
                "SharedMemWeightSyncScheme)"
            )

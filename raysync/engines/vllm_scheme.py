"""torchrl 0.14's ``VLLMWeightSyncScheme``, by name and call shape, built on the hub.

torchrl's scheme broadcasts weights over NCCL from a trainer (rank 0) to vLLM workers,
after a collective handshake (``init_all_workers_group``) that both sides must enter
together. Here the same calls go through a raysync hub: the sender's ``update_weights``
is ``hub.push`` (and, by default, a wait until every replica holds the version), each
receiver is a :func:`~raysync.engines.vllm.start_following` engine, and
``init_all_workers_group`` is no rendezvous: it connects to the hub (sender) or starts
following it (receiver), in any order. The NCCL arguments (``master_address``,
``master_port``, ``device``) are accepted and unused; ``gpus_per_replica`` is kept as
torchrl's; ``num_replicas`` is how many engines ``update_weights`` waits for.

Example:
    >>> scheme = VLLMWeightSyncScheme(num_replicas=1, model_id="policy")  # doctest: +SKIP
    >>> sender = scheme.create_sender(); sender.register_model(policy)   # trainer
    >>> receiver = scheme.create_receiver(llm)                            # beside the engine
    >>> receiver.init_all_workers_group(get_model_metadata(policy))
    >>> sender.init_all_workers_group(get_model_metadata(policy))
    >>> sender.update_weights()                                           # every engine holds it
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch

from raysync import _protocol as proto
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.engines.vllm import VLLMEngine, start_following

__all__ = ["VLLMWeightReceiver", "VLLMWeightSender", "VLLMWeightSyncScheme", "get_model_metadata"]


class VLLMWeightSyncScheme:
    """Weight sync for vLLM engines with torchrl's names, through a raysync hub.

    Args:
        master_address, master_port, device: torchrl's NCCL settings; unused (the hub and
            Ray's object store move the bytes).
        gpus_per_replica: kept as torchrl's (each replica is one engine to raysync).
        num_replicas: the engines ``update_weights`` waits for (``wait=True``).
        strategy: ``"tensordict"`` or ``"state_dict"`` (what is pushed is the model's state
            dict either way: its names are what vLLM's loader maps).
        model_id, hub, namespace: the model on the hub, and which hub.
        timeout: seconds ``update_weights`` waits for the replicas.
        wait: ``update_weights`` returns once every replica holds the version (torchrl's
            NCCL broadcast returns once the workers received it).
        rollback: receivers keep their previous version if a load fails part-way.

    Example:
        >>> scheme = VLLMWeightSyncScheme(num_replicas=2, model_id="policy", timeout=60)
        >>> scheme.create_sender().update_weights(policy)  # doctest: +SKIP
    """

    def __init__(
        self,
        master_address: str | None = None,
        master_port: int | None = None,
        gpus_per_replica: int = 1,
        num_replicas: int = 1,
        strategy: Literal["tensordict", "state_dict"] = "tensordict",
        device: torch.device | str | int = 0,
        *,
        model_id: str = "policy",
        hub: str = proto.DEFAULT_HUB,
        namespace: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        wait: bool = True,
        rollback: bool = False,
    ) -> None:
        if strategy not in ("tensordict", "state_dict"):
            raise ValueError(f"strategy must be 'tensordict' or 'state_dict', got {strategy!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.master_address = master_address if master_address is not None else "localhost"
        self.master_port = master_port
        self.gpus_per_replica = gpus_per_replica
        self.num_replicas = num_replicas
        self.strategy_name = strategy
        self.device = device
        self.model_id = model_id
        self.hub = hub
        self.namespace = namespace
        self.timeout = float(timeout)
        self.wait = wait
        self.rollback = rollback

    def create_transport(self, **kwargs: Any) -> None:
        """No transport object: the hub and the object store are the transport (torchrl's signature)."""
        return None

    def create_sender(self) -> VLLMWeightSender:
        """The trainer's side."""
        return VLLMWeightSender(self)

    def create_receiver(self, vllm_engine: Any) -> VLLMWeightReceiver:
        """An engine's side: ``vllm_engine``, a ``vllm.LLM`` with the ``raysync`` transfer backend."""
        return VLLMWeightReceiver(self, vllm_engine)


class VLLMWeightSender:
    """The trainer's side: ``update_weights`` pushes to the hub.

    Example:
        >>> sender = scheme.create_sender()
        >>> sender.register_model(policy)
        >>> sender.init_all_workers_group(get_model_metadata(policy))  # doctest: +SKIP
        >>> sender.update_weights()                                    # doctest: +SKIP
    """

    def __init__(self, scheme: VLLMWeightSyncScheme) -> None:
        self._scheme = scheme
        self._model_ref: Callable[[], Any] | None = None
        self._hub: Any = None
        self._collectors: list[Any] = []
        self.version: int | None = None

    def register_collector(self, collector: Any) -> None:
        """``collector.increment_version()`` is called after each :meth:`update_weights`."""
        self._collectors.append(collector)

    def register_model(self, model: Any) -> None:
        """The model whose weights :meth:`update_weights` pushes when given none (held weakly)."""
        self._model_ref = weakref.ref(model)

    def init_all_workers_group(
        self, model_metadata: dict[str, tuple[torch.dtype, torch.Size]] | None = None, vllm_engine: Any = None
    ) -> None:
        """Connect to the hub (no rendezvous: receivers may start before or after)."""
        import raysync

        s = self._scheme
        self._hub = raysync.connect(s.hub, namespace=s.namespace)

    def update_weights(self, weights: Any | None = None) -> int:
        """Push ``weights`` (a module, TensorDict or state dict; default: the registered model).

        Returns the version; with the scheme's ``wait``, once ``num_replicas`` engines hold it.

        Raises:
            SyncTimeoutError, ApplyError: a replica did not apply it (naming it).
        """
        if self._hub is None:
            self.init_all_workers_group()
        if weights is None:
            model = self._model_ref() if self._model_ref is not None else None
            if model is None:
                raise RuntimeError("no weights given and no model registered (or it was freed)")
            weights = model
        if hasattr(weights, "state_dict") and isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        s = self._scheme
        version = int(self._hub.push(weights, model_id=s.model_id))
        if s.wait:
            self._hub.wait(version, model_id=s.model_id, timeout=s.timeout, subscribers=s.num_replicas)
        self.version = version
        for collector in self._collectors:
            collector.increment_version()
        return version


class VLLMWeightReceiver:
    """An engine's side: it follows the hub once :meth:`init_all_workers_group` is called.

    Example:
        >>> receiver = scheme.create_receiver(llm)
        >>> receiver.init_all_workers_group(get_model_metadata(policy))  # doctest: +SKIP
        >>> receiver.engine.generate(prompts, params).version            # doctest: +SKIP
        4
    """

    def __init__(self, scheme: VLLMWeightSyncScheme, vllm_engine: Any) -> None:
        self._scheme = scheme
        self._vllm_engine = vllm_engine
        self.engine: VLLMEngine | None = None

    def init_all_workers_group(
        self, model_metadata: dict[str, tuple[torch.dtype, torch.Size]] | None = None
    ) -> None:
        """Start following the hub (its newest version, if any, goes in before this returns).

        The sender's side may come later (no rendezvous): with no version yet this returns at
        once and the engine takes the first one pushed.
        """
        if self.engine is None:
            s = self._scheme
            self.engine = start_following(
                VLLMEngine(self._vllm_engine, rollback=s.rollback, name="vLLM engine"),
                s.model_id,
                hub=s.hub,
                namespace=s.namespace,
                timeout=s.timeout,
            )

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """A no-op, as torchrl's: versions go in as the hub delivers them."""

    def poll_and_apply(self, timeout: float = 0.1) -> bool:
        """False, as torchrl's: updates are pushed, not polled."""
        return False

    def shutdown(self) -> None:
        """Stop following the hub."""
        if self.engine is not None:
            self.engine.stop()


def get_model_metadata(model: Any) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """``{name: (dtype, shape)}`` of a model's state dict (torchrl's helper, same keys as pushed)."""
    state = model.state_dict() if hasattr(model, "state_dict") else dict(model)
    return {k: (v.dtype, v.shape) for k, v in state.items()}

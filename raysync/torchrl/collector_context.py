"""What a torchrl-style scheme finds in torchrl's collector context: its policy, its endpoints.

torchrl hands a scheme the collector (its *context*) and keyword arguments; these helpers find
the policy (or torchrl's fallbacks for it), the pipes or workers to send to, and stand in for a
transport where a scheme needs none.

Example:
    >>> endpoints(None, {"pipes": [1, 2]}, ("pipes",), "a process scheme")
    [1, 2]
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.torchrl.strategy import resolve_model

__all__ = [
    "NoOpTransport",
    "endpoints",
    "expected_workers",
    "first_given",
    "is_per_worker",
    "is_weightless",
    "key_renaming",
    "maybe_resolve",
    "policy_of",
    "weak_ref",
]


class NoOpTransport:
    """The transport of :class:`NoWeightSyncScheme`: accepts everything, moves nothing."""

    timeout = DEFAULT_TIMEOUT

    def send_weights(self, *args: Any) -> None:
        """Do nothing."""

    def send_weights_async(self, *args: Any) -> None:
        """Do nothing."""

    def wait_ack(self, timeout: float | None = None) -> None:
        """Do nothing."""

    def receive_weights(self, timeout: float | None = 1.0, **kwargs: Any) -> Any:
        """Nothing ever arrives."""
        return None

    def send_ack(self, message: str = "updated") -> None:
        """Do nothing."""

    def check_connection(self) -> bool:
        """Always connected."""
        return True

    def setup_connection_and_weights_on_sender(self) -> None:
        """Do nothing."""

    def setup_connection_and_weights_on_receiver(self, **kwargs: Any) -> None:
        """Do nothing."""


def weak_ref(obj: Any) -> Any:
    """A weak reference where the object allows one, else a strong one behind the same call."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def first_given(kwargs: dict[str, Any], names: Sequence[str]) -> Any:
    for name in names:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def maybe_resolve(context: Any, path: str) -> Any:
    try:
        return resolve_model(context, path)
    except (KeyError, ValueError):
        return None


def policy_of(context: Any, *, from_factory: bool = False) -> Any:
    """torchrl's fallbacks for a collector's policy: its fallback policy; or (for the first
    version only) a policy made by its first ``policy_factory``."""
    fallback = getattr(context, "_fallback_policy", None)
    if isinstance(fallback, torch.nn.Module):
        return fallback
    factories = getattr(context, "policy_factory", None)
    if from_factory and isinstance(factories, Sequence) and factories and callable(factories[0]):
        made = factories[0]()
        return made if isinstance(made, torch.nn.Module) else None
    return None


def is_per_worker(weights: Any) -> bool:
    return isinstance(weights, dict) and bool(weights) and all(isinstance(k, int) for k in weights)


def endpoints(context: Any, kwargs: dict[str, Any], names: Sequence[str], what: str) -> list[Any]:
    for name in names:
        value = kwargs.get(name)
        if value is None and context is not None:
            value = getattr(context, name, None)
        if value is not None:
            return list(value)
    raise ValueError(f"{what} needs {' or '.join(names)}, as a keyword or an attribute of the context")


def expected_workers(context: Any, kwargs: dict[str, Any]) -> int:
    """How many workers a collector runs in other processes or actors (0: it acts in this process)."""
    remote = kwargs.get("remote_collectors")
    if remote is not None:
        return len(remote)
    if context is not None and (hasattr(context, "procs") or hasattr(context, "pipes")):
        return int(getattr(context, "num_workers", 0) or 0)
    return 0


def is_weightless(model: Any) -> bool:
    """Whether ``model`` is a module with weights on the meta device (torchrl's stateless policy)."""
    if not isinstance(model, torch.nn.Module):
        return False
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def key_renaming(keys: set[str], targets: Sequence[set[str]]) -> Callable[[str], str] | None:
    """How to rename ``keys`` into one of ``targets``: a wrapper's prefix added or dropped
    (a TensorDictModule around the trained module); ``None`` when none fits."""
    for target in targets:
        if keys == target:
            return _same
    if not keys:
        return None
    probe = min(keys)  # any renaming that fits maps this key onto a target key
    for target in targets:
        for key in sorted(target):
            if key.endswith("." + probe):
                prefix = key[: -len(probe)]
                if {prefix + k for k in keys} == target:
                    return functools.partial(_add_prefix, prefix)
            if probe.endswith("." + key):
                prefix = probe[: -len(key)]
                if all(k.startswith(prefix) for k in keys) and {k[len(prefix) :] for k in keys} == target:
                    return functools.partial(_drop_prefix, prefix)
    return None


def _same(key: str) -> str:
    return key


def _add_prefix(prefix: str, key: str) -> str:
    return prefix + key


def _drop_prefix(prefix: str, key: str) -> str:
    return key.removeprefix(prefix)

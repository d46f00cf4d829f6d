"""``RayModuleTransform``: a module hosted in its own synced actor, called like the module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import torch

from raysync._protocol import DEFAULT_HUB
from raysync.receivers.subscription import ApplyKind
from raysync.receivers.synced import synced_model

__all__ = ["RayModuleTransform"]


class _ModuleHost:
    """The actor behind a RayModuleTransform: holds the module and runs it."""

    def __init__(self, module_factory: Callable[[], torch.nn.Module]) -> None:
        self.module = module_factory()
        if not isinstance(self.module, torch.nn.Module):
            raise TypeError(f"module_factory must return an nn.Module, returned {type(self.module).__name__}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.module(*args, **kwargs)


class RayModuleTransform:
    """A module hosted in its own Ray actor, kept in step with the hub; call it like the module.

    Args:
        module_factory: builds the module inside the actor (a class or a function).
        model_id: which model on the hub it follows.
        hub: the hub's name.
        num_cpus, num_gpus: the actor's resources.
        placement_group, bundle_index: place the actor in a bundle of a placement group.
        apply: ``"copy"`` or ``"view"`` (see :func:`synced_model`).

    Example:
        >>> t = raysync.RayModuleTransform(lambda: torch.nn.Linear(4, 2), model_id="policy")
        >>> hub.push(trained_linear, wait=True, timeout=30)
        >>> t(torch.ones(1, 4))     # runs in the actor with the pushed weights
    """

    def __init__(
        self,
        module_factory: Callable[[], torch.nn.Module],
        *,
        model_id: str = "policy",
        hub: str = DEFAULT_HUB,
        namespace: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        placement_group: Any = None,
        bundle_index: int | None = None,
        apply: ApplyKind = "copy",
    ) -> None:
        if not callable(module_factory):
            raise TypeError(f"module_factory must be callable, got {type(module_factory).__name__}")
        host = synced_model("module", model_id=model_id, hub=hub, namespace=namespace, apply=apply)(
            _ModuleHost
        )
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=-1 if bundle_index is None else bundle_index,
            )
        self.model_id = model_id
        self.hub = hub
        self.namespace = namespace
        self.actor: Any = ray.remote(host).options(**options).remote(module_factory)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module in its actor on the given input; return the output."""
        return ray.get(self.actor.forward.remote(*args, **kwargs))

    def raysync_version(self) -> int | None:
        """The version the hosted module holds."""
        result: int | None = ray.get(self.actor.raysync_version.remote(self.model_id))
        return result

    def shutdown(self) -> None:
        """Kill the hosting actor."""
        ray.kill(self.actor)

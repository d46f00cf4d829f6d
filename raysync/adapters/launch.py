"""Starting adapters: one per placement-group bundle (or node), of a kind."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import ray

from raysync._protocol import DEFAULT_HUB
from raysync.adapters.base import KINDS, Kind, _Adapter
from raysync.adapters.distributed import DistributedAdapter
from raysync.adapters.pipe import PipeAdapter
from raysync.adapters.placement import _choose_bundles, placement_group_of
from raysync.adapters.rpc import RPCAdapter
from raysync.channels.base import DEFAULT_TIMEOUT

__all__ = ["for_placement_group", "start"]


_CLASSES: dict[str, type[_Adapter]] = {
    "pipe": PipeAdapter,
    "distributed": DistributedAdapter,
    "rpc": RPCAdapter,
}


def start(
    kind: Kind,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    model_factory: Callable[[], Any],
    num_receivers: int = 2,
    model_id: str = "policy",
    hub: str = DEFAULT_HUB,
    namespace: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    placement_group: Any = None,
    bundle_index: int | None = None,
    num_cpus: float = 0.5,
    name: str | None = None,
    start_method: str = "fork",
) -> Any:
    """Create one adapter actor (optionally in a bundle of a placement group); return its handle.

    Args:
        kind: ``"pipe"`` (:class:`PipeAdapter`), ``"distributed"``
            (:class:`DistributedAdapter`) or ``"rpc"`` (:class:`RPCAdapter`).
        fn: each worker's loop, ``fn(receiver, *args)``.
        args: more arguments for ``fn``.
        model_factory: builds each worker's model.
        num_receivers: worker processes behind this adapter.
        model_id, hub, namespace: what to follow.
        timeout: seconds any wait of the adapter may take.
        placement_group, bundle_index: where to place the actor.
        num_cpus: the actor's CPUs (its workers are its own processes, not Ray's).
        name: for logs and ``hub.status()``.
        start_method: how the adapter starts its workers (``"fork"``: at once,
            no imports; ``"spawn"``: fresh interpreters, slower).

    Example:
        >>> a = raysync.adapters.start("pipe", worker_loop, model_factory=make_policy, hub="h")
    """
    if kind not in _CLASSES:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    options: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 8}
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=-1 if bundle_index is None else int(bundle_index),
        )
    actor_cls = ray.remote(_CLASSES[kind])
    return actor_cls.options(**options).remote(  # type: ignore[attr-defined]
        fn,
        tuple(args),
        model_factory=model_factory,
        num_receivers=num_receivers,
        model_id=model_id,
        hub=hub,
        namespace=namespace,
        timeout=timeout,
        name=name,
        start_method=start_method,
    )


def for_placement_group(
    pg: Any,
    kind: Kind,
    *,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    model_factory: Callable[[], Any],
    bundles: Sequence[int] | None = None,
    per: Literal["bundle", "node"] = "bundle",
    num_receivers: int = 2,
    model_id: str = "policy",
    hub: str = DEFAULT_HUB,
    namespace: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    num_cpus: float = 0.5,
    ready_timeout: float | None = 120.0,
    start_method: str = "fork",
) -> list[Any]:
    """One adapter per bundle (or per node) of a placement group; returns their handles.

    Args:
        pg: a ``PlacementGroup``, an actor handle (its placement group is
            used), or ``None`` (the caller's own placement group).
        kind: ``"pipe"``, ``"distributed"`` or ``"rpc"``.
        fn, args, model_factory, num_receivers, model_id, hub, namespace,
            timeout, num_cpus, start_method: as :func:`start`, for every adapter.
        bundles: which bundle indices (default: all).
        per: ``"bundle"`` (one adapter per bundle) or ``"node"`` (one per node,
            in the first chosen bundle on it).
        ready_timeout: wait this long for the group and the adapters to be up
            (``None``: return at once).

    Example:
        >>> pg = ray.util.placement_group([{"CPU": 1}] * 2)
        >>> handles = raysync.adapters.for_placement_group(
        ...     pg, "distributed", fn=worker_loop, model_factory=make_policy, hub="h"
        ... )  # doctest: +SKIP
    """
    if kind not in _CLASSES:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if per not in ("bundle", "node"):
        raise ValueError(f"per must be 'bundle' or 'node', got {per!r}")
    group = placement_group_of(pg)
    if ready_timeout is not None:
        ray.get(group.ready(), timeout=ready_timeout)
    chosen = _choose_bundles(group, bundles, per)
    handles = [
        start(
            kind,
            fn,
            args,
            model_factory=model_factory,
            num_receivers=num_receivers,
            model_id=model_id,
            hub=hub,
            namespace=namespace,
            timeout=timeout,
            placement_group=group,
            bundle_index=b,
            num_cpus=num_cpus,
            name=f"{kind}-bundle-{b}",
            start_method=start_method,
        )
        for b in chosen
    ]
    if ready_timeout is not None:
        ray.get([h._raysync_ping.remote() for h in handles], timeout=ready_timeout)
    return handles

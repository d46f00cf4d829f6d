"""Where adapters run: the placement group and bundle of an actor, read inside it."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import ray

from raysync import _compat

__all__ = ["placement_group_of", "placement_of"]

logger = logging.getLogger(__name__)


_BUNDLE_RESOURCE = re.compile(r"_group_(\d+)_([0-9a-f]+)$")


def _bundle_of(resources: Any, pg_id: str | None) -> int | None:
    for name in resources:
        match = _BUNDLE_RESOURCE.search(name)
        if match and (pg_id is None or match.group(2) == pg_id):
            return int(match.group(1))
    return None


def placement_of() -> dict[str, Any]:
    """Where the calling process runs: node id, placement group id, bundle index, pid.

    Read inside the process itself (an adapter actor calls it in ``__init__``):
    the node and placement group from the runtime context, the bundle index
    from the bundle resources the GCS assigned to this actor
    (``CPU_group_<index>_<pg id>``); ``None`` where unknown (outside a
    placement group, or placed with ``bundle_index=-1``).

    Example:
        >>> raysync.adapters.placement_of()["node_id"]  # doctest: +SKIP
        'a1b2...'
    """
    ctx = ray.get_runtime_context()
    pg_id = ctx.get_placement_group_id()
    bundle: int | None = None
    actor_id = ctx.get_actor_id()
    if pg_id is not None and actor_id is not None:
        try:
            record = _compat.actor_placement(actor_id)
            bundle = None if record is None else _bundle_of(record[1], pg_id)
        except Exception as err:  # private GCS API: never fail the adapter over it
            logger.debug("could not read the bundle index: %s", err)
    return {
        "node_id": ctx.get_node_id(),
        "placement_group_id": pg_id,
        "bundle_index": bundle,
        "pid": os.getpid(),
    }


def placement_group_of(target: Any = None) -> Any:
    """A placement group: ``target`` itself, the one an actor handle runs in, or the caller's own.

    Raises:
        ValueError: the actor (or the caller, for ``None``) runs in no placement group.

    Example:
        >>> pg = raysync.adapters.placement_group_of(engine_actor)  # doctest: +SKIP
    """
    from ray.util.placement_group import PlacementGroup, get_current_placement_group

    if target is None:
        pg = get_current_placement_group()
        if pg is None:
            raise ValueError("no placement group given and the caller does not run in one")
        return pg
    if isinstance(target, PlacementGroup):
        return target
    actor_id = getattr(target, "_actor_id", None)
    if actor_id is None:
        raise TypeError(f"expected a PlacementGroup or an actor handle, got {type(target).__name__}")
    record = _compat.actor_placement(actor_id.hex())
    pg_id = b"" if record is None else record[0]
    if not pg_id or set(pg_id) == {0xFF}:
        raise ValueError(f"actor {actor_id.hex()} does not run in a placement group")
    return _compat.placement_group(pg_id)


def _choose_bundles(group: Any, bundles: Sequence[int] | None, per: str) -> list[int]:
    """The bundle indices to put adapters in: the chosen ones, or the first on each node."""
    count = len(group.bundle_specs)
    chosen = list(range(count)) if bundles is None else [int(b) for b in bundles]
    bad = [b for b in chosen if not 0 <= b < count]
    if bad:
        raise ValueError(f"bundle indices {bad} out of range: the placement group has {count} bundle(s)")
    if per == "node":
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(group).get("bundles_to_node_id", {})
        seen: set[Any] = set()
        picked = []
        for b in chosen:
            node = nodes.get(b)
            if node not in seen:
                seen.add(node)
                picked.append(b)
        chosen = picked
    return chosen

"""Subscribers' actor handles in the hub and the relays, without their actors' classes.

Ray builds every actor handle a process receives from the actor's class: the first
handle of a class makes the receiving process load it from the GCS, which imports
the module that defines it and everything that module imports (the user's code,
torch, torchrl). The hub and the relays receive the handle of every subscriber
that registers, yet only ever call the methods raysync gave it (``raysync_ping``,
``raysync_notify``, ...). Measured on the test suite's subscribers (2 cores):
a hub that loaded their class took 1.8 s of CPU and imported torch and the tests'
own modules; one that does not, 0.6 s and neither.

:func:`class_free_handles` makes this process build such handles from the method
names the GCS keeps beside the class (the fallback Ray itself uses when a class
fails to import), never unpickling the class: no user module's import-time code
runs in the hub, none has to be importable there (Ray would log an import
failure for a subscriber whose job ships its own ``working_dir``), and the hub
stays small.

A stand-in's methods cannot run here (they are never meant to: the real actor
runs them). Where Ray's internals are not as expected the process keeps Ray's
way, with a debug log.

Example:
    >>> class_free_handles()   # in the hub's or a relay's constructor
    True
"""

from __future__ import annotations

import json
import logging
import pickle
from typing import Any

__all__ = ["class_free_handles"]

logger = logging.getLogger(__name__)

_MARK = "_raysync_class_free"


def class_free_handles() -> bool:
    """Build the actor handles this process receives from method names, not classes.

    Returns whether it is in effect (also when an earlier call put it there).
    """
    try:
        import ray._private.worker as ray_worker
        from ray._private.function_manager import make_function_table_key
        from ray._private.ray_constants import KV_NAMESPACE_FUNCTION_TABLE
    except ImportError as err:  # another Ray: its own way
        logger.debug("actor handles load their classes (%s)", err)
        return False
    worker: Any = ray_worker.global_worker
    manager = getattr(worker, "function_actor_manager", None)
    load = getattr(manager, "_load_actor_class_from_gcs", None)
    if manager is None or load is None:
        logger.debug("actor handles load their classes (no function manager here)")
        return False
    if getattr(load, _MARK, False):
        return True

    def stand_in_for(job_id: Any, descriptor: Any) -> type:
        try:
            key = make_function_table_key(b"ActorClass", job_id, descriptor.function_id.binary())
            raw = worker.gcs_client.internal_kv_get(key, KV_NAMESPACE_FUNCTION_TABLE)
            record = pickle.loads(raw)  # Ray's own record: the class inside stays pickled
            names = json.loads(_text(record["actor_method_names"]))
            return _stand_in(_text(record["class_name"]), names, _text(record["module"]))
        except Exception as err:  # anything unexpected: Ray's own way
            logger.debug("loading actor class %s the usual way: %s", descriptor, err)
            return load(job_id, descriptor)  # type: ignore[no-any-return]

    setattr(stand_in_for, _MARK, True)
    manager._load_actor_class_from_gcs = stand_in_for
    return True


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _stand_in(class_name: str, method_names: list[str], module: str) -> type:
    """A class with the actor's method names whose methods only say they run elsewhere."""

    def elsewhere(self: Any, *args: Any, **kwargs: Any) -> Any:  # any call shape is the actor's business
        raise RuntimeError(f"{module}.{class_name}'s methods run in its actor, not in this process")

    namespace: dict[str, Any] = {name: elsewhere for name in method_names}
    namespace["__module__"] = module
    namespace["__doc__"] = f"Stand-in for actor class {class_name}: its handles' method names, no code."
    return type(class_name, (), namespace)

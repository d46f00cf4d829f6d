"""Every private use raysync makes of another library, each with why no public API serves.

One place, so that a new release of torch (or Ray) that changes one of them is
found here, by name. Each use is checked against the installed version when this
module is imported (a version compare, nothing more: torch is not imported for
it), and ``tests/unit/test_compat.py`` probes each one's behaviour on the
installed version and fails naming the use that changed.

Uses:

``torch.Tensor._version``
    The tensor's version counter: an integer that every in-place operation on
    the tensor (or on a view sharing its storage through autograd's view
    tracking) increments, and that nothing else changes. raysync reads it right
    after each apply and again on demand to tell, exactly and in O(#tensors)
    integer reads, whether user code changed a synced module's weights in place
    since (``raysync_modified_since()``). No public API gives it: hashing or
    comparing the bytes costs a pass over the weights, and a forward hook tells
    that a forward ran, not whether it wrote anything, and sees no write made
    outside ``forward`` (optimizer steps, ``copy_``).

``torch._C.DisableTorchFunctionSubclass`` (:func:`plain_tensors`)
    Reads of read-only weights (``ReadOnlyTensor``, a ``__torch_function__``
    subclass) and of bound modules' tensors without going through the
    subclass's ``__torch_function__``: the read-only guard's own calls and a
    pointer compare per tensor would otherwise run the guard on themselves.
    ``torch.overrides`` has no public way to turn subclass dispatch off.

``torch._ops.OpOverloadPacket`` (:data:`OP_OVERLOAD_PACKET`)
    The type of ``torch.ops.aten.add_`` and its kin, whose schemas say which
    arguments an ATen op writes: the read-only guard refuses those writes.
    Public torch gives the schema (``_schema``), not the packet's type.

Ray (checked with :data:`RAY_CHECKED`):

``ray.experimental.internal_kv._internal_kv_*`` (:func:`kv_put` and its kin)
    The GCS key-value store: where the hub keeps what outlives its process
    (version counters, leases, subscriptions). Ray has no public key-value API;
    a detached actor's memory dies with its process.

``ray._private.state.actors`` / ``jobs`` (:func:`actor_state`, :func:`job_alive`)
    Whether an actor or a job (a driver) is alive, asked of the GCS, from the hub:
    the public ``ray.util.state`` needs the dashboard's API server, which clusters
    may run without (the tests do), and ``ray.get_actor`` finds named actors only.

``ray._private.state`` actor table, ``gcs_pb2``, ``ray._raylet.PlacementGroupID``
    (:func:`actor_placement`, :func:`placement_group`). Which placement group (and
    bundles) another actor runs in, and that group as a ``PlacementGroup``:
    ``ray.util.get_current_placement_group`` answers only for the caller itself.

``ray._config.metrics_report_interval_ms`` (:func:`metrics_report_interval_s`)
    How often Ray exports metrics, so that an idle hub sets its gauges again in
    time; no public API says it.

``RuntimeContext.worker.mode`` (:func:`in_worker`)
    Whether the process is a Ray worker, not a driver (a task's lease names its job): the public
    ``get_task_id()`` logs a warning on every call from a driver.

``ray.get``/``ray.put``/``ray.get_runtime_context``/``ray.get_actor``/``ActorMethod._remote`` without
    Ray's auto-init (:func:`get_no_start`, :func:`put_no_start`, :func:`runtime_context_no_start`,
    :func:`get_actor_no_start`, :func:`call_no_start`): the functions under Ray's ``wrap_auto_init``
    (their ``__wrapped__``). A client call racing ``ray.shutdown()`` from another thread can pass a
    ``ray.is_initialized()`` check just before the shutdown ends; the public call would then start
    a new local Ray of its own (auto-init). Without it, the call raises Ray's "not started" error,
    which raysync turns into :class:`~raysync.errors.RayNotRunningError`. Ray's only public switch
    is ``RAY_ENABLE_AUTO_CONNECT=0``, read once at import and process-wide: the user's choice.

``ray._private.worker._connect_or_shutdown_lock`` (:func:`shutdown_lock`)
    The lock ``ray.init()`` and ``ray.shutdown()`` hold while they run. A raysync thread (a
    follower's long poll, the heartbeat) holds it around each of its calls into Ray, so that a
    ``ray.shutdown()`` from another thread waits for the call to end instead of tearing the core
    worker down under it: a call into a core worker that is shutting down ends the whole process
    ("The core worker has already been shutdown ... The process will exit"). Ray has no public
    way to hold a shutdown off, nor a hook run before one.

``ray._private.internal_api.get_memory_info_reply`` (:func:`object_store_bytes_used`)
    Bytes in use in the node's object store, for benchmarks that count copies
    per version: ``ray.available_resources`` rounds the store to whole objects'
    worth and lags.

Example:
    >>> import torch
    >>> from raysync import _compat
    >>> t = torch.zeros(3)
    >>> before = _compat.tensor_version(t)
    >>> _ = t.add_(1)
    >>> _compat.tensor_version(t) > before
    True
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

__all__ = [
    "OP_OVERLOAD_PACKET",
    "RAY_CHECKED",
    "RAY_USES",
    "TORCH_CHECKED",
    "TORCH_VERSION_COUNTER",
    "actor_placement",
    "actor_state",
    "call_no_start",
    "check_versions",
    "get_actor_no_start",
    "get_no_start",
    "job_alive",
    "kv_delete",
    "kv_get",
    "kv_list",
    "kv_put",
    "metrics_report_interval_s",
    "object_store_bytes_used",
    "placement_group",
    "plain_tensors",
    "put_no_start",
    "in_worker",
    "runtime_context_no_start",
    "shutdown_lock",
    "tensor_version",
    "version_counters",
]

logger = logging.getLogger(__name__)

TORCH_VERSION_COUNTER = "torch.Tensor._version"
"""The name of the private torch attribute :func:`tensor_version` reads."""

TORCH_CHECKED = ((2, 4), (2, 13))
"""The torch releases (major, minor), first and last, whose private uses were checked."""

RAY_CHECKED = ((2, 56), (2, 60))
"""The Ray releases (major, minor), first and last, whose private uses were checked."""

RAY_USES = (
    "ray.experimental.internal_kv._internal_kv_*",
    "ray._private.state.actors / jobs",
    "ray._private.state actor table, gcs_pb2.ActorTableData, ray._raylet.PlacementGroupID",
    "ray._config.metrics_report_interval_ms",
    "ray.runtime_context.RuntimeContext.worker.mode",
    "ray._private.internal_api.get_memory_info_reply",
    "ray.get / put / get_runtime_context / get_actor / ActorMethod._remote .__wrapped__ (no auto-init)",
    "ray._private.worker._connect_or_shutdown_lock",
)
"""Every private use of Ray, by name (see the module docstring for why each)."""


def plain_tensors() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is off (``torch._C``, private).

    Example:
        >>> with plain_tensors():
        ...     ptr = weight.data_ptr()   # no read-only guard runs for it
    """
    import torch

    # Why private: torch.overrides offers no public switch for subclass dispatch.
    return torch._C.DisableTorchFunctionSubclass()


class _Lazy:
    """:data:`OP_OVERLOAD_PACKET` without importing torch when this module is imported."""

    def __instancecheck__(self, obj: Any) -> bool:
        import torch

        # Why private: the type of torch.ops.aten.<op> is only in torch._ops.
        return isinstance(obj, torch._ops.OpOverloadPacket)


OP_OVERLOAD_PACKET: Any = _Lazy()
"""``torch._ops.OpOverloadPacket``, for ``isinstance`` (torch loaded on first use)."""


# ---------------------------------------------------------------------------- Ray
def _internal_kv() -> Any:
    from ray.experimental import internal_kv

    return internal_kv


def kv_put(key: bytes, value: bytes, *, namespace: str) -> Any:
    """Write a key of Ray's GCS key-value store (private: Ray has no public one)."""
    return _internal_kv()._internal_kv_put(key, value, namespace=namespace)


def kv_get(key: bytes, *, namespace: str) -> bytes | None:
    """Read a key of Ray's GCS key-value store (``None``: absent)."""
    value: bytes | None = _internal_kv()._internal_kv_get(key, namespace=namespace)
    return value


def kv_list(prefix: bytes, *, namespace: str) -> list[bytes]:
    """The keys of Ray's GCS key-value store that start with ``prefix``."""
    return list(_internal_kv()._internal_kv_list(prefix, namespace=namespace))


def kv_delete(key: bytes, *, namespace: str) -> Any:
    """Delete a key of Ray's GCS key-value store."""
    return _internal_kv()._internal_kv_del(key, namespace=namespace)


def actor_state(actor_id: str) -> str | None:
    """The GCS's state of an actor (``"ALIVE"``, ``"RESTARTING"``, ``"DEAD"``, ...; ``None``: unknown).

    Example:
        >>> actor_state(ray.get_runtime_context().get_actor_id())  # doctest: +SKIP
        'ALIVE'
    """
    from ray._private import state

    # Why private: ray.util.state needs the dashboard's API server, which may not run.
    record = state.actors(actor_id=actor_id)
    return None if not record else record.get("State")


def job_alive(job_id: str) -> bool:
    """Whether the GCS lists the job (a driver) as running (``False``: dead or unknown)."""
    from ray._private import state

    # Why private: as actor_state.
    for job in state.jobs():
        if job.get("JobID") == job_id:
            return not job.get("IsDead", False)
    return False


def actor_placement(actor_id: str) -> tuple[bytes, list[str]] | None:
    """Another actor's placement group id and the names of the resources it holds (``None``: unknown)."""
    import ray
    from ray._private import state
    from ray.core.generated import gcs_pb2

    # Why private: ray.util.get_current_placement_group answers for the caller only.
    raw = state.state._connect_and_get_accessor().get_actor_info(ray.ActorID.from_hex(actor_id))
    if raw is None:
        return None
    record = gcs_pb2.ActorTableData.FromString(raw)  # type: ignore[attr-defined]
    return bytes(record.placement_group_id), list(record.required_resources)


def placement_group(pg_id: bytes) -> Any:
    """The ``PlacementGroup`` of an id read from the GCS (see :func:`actor_placement`)."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    # Why private: PlacementGroup takes a PlacementGroupID, which only ray._raylet makes.
    return PlacementGroup(PlacementGroupID(pg_id))


def in_worker(ctx: Any) -> bool:
    """Whether this process is a Ray worker (it runs tasks or an actor), not a driver.

    ``RuntimeContext.worker.mode`` (private): ``get_task_id()`` would log a warning on every
    push from a driver.
    """
    import ray

    return getattr(getattr(ctx, "worker", None), "mode", None) == ray.WORKER_MODE


def _without_auto_init(fn: Any, what: str) -> Any:
    """The function under Ray's auto-init wrapper (``wrap_auto_init`` sets ``__wrapped__``)."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        raise RuntimeError(
            f"{what} has no __wrapped__: Ray changed its auto-init wrapper (see raysync/_compat.py)"
        )
    return inner


def get_no_start(refs: Any, *, timeout: float | None = None) -> Any:
    """``ray.get`` that never starts a Ray of its own (raises Ray's "not started" error instead)."""
    import ray

    return _without_auto_init(ray.get, "ray.get")(refs, timeout=timeout)


def get_actor_no_start(name: str, namespace: str) -> Any:
    """``ray.get_actor`` that never starts a Ray of its own (raises Ray's "not started" error instead)."""
    import ray

    return _without_auto_init(ray.get_actor, "ray.get_actor")(name, namespace=namespace)


def runtime_context_no_start() -> Any:
    """``ray.get_runtime_context()`` that never starts a Ray of its own (its getters raise instead)."""
    import ray

    return _without_auto_init(ray.get_runtime_context, "ray.get_runtime_context")()


def put_no_start(value: Any) -> Any:
    """``ray.put`` that never starts a Ray of its own (raises Ray's "not started" error instead)."""
    import ray

    return _without_auto_init(ray.put, "ray.put")(value)


def call_no_start(method: Any, *args: Any, **options: Any) -> Any:
    """``method.options(**options).remote(*args)`` for an actor method, never starting a Ray of its own.

    Example:
        >>> ref = call_no_start(hub.publish_stamped, publication, max_task_retries=3)  # doctest: +SKIP
    """
    from ray.actor import ActorMethod

    if not isinstance(method, ActorMethod):
        raise TypeError(f"call_no_start takes an actor method, got {type(method).__name__}")
    import ray
    from ray.exceptions import RaySystemError

    remote = _without_auto_init(ActorMethod._remote, "ray.actor.ActorMethod._remote")
    try:
        return remote(method, args=args, kwargs={}, **options)
    except AttributeError as err:  # after ray.shutdown(): the worker has no core worker any more
        if ray.is_initialized():
            raise
        raise RaySystemError("Ray has not been started yet (ray.shutdown() was called).") from err


def shutdown_lock() -> Any:
    """The lock ``ray.init()`` and ``ray.shutdown()`` of this process hold (an ``RLock``; private).

    Held, it keeps a ``ray.shutdown()`` in another thread waiting (see the module docstring).

    Example:
        >>> with shutdown_lock():  # doctest: +SKIP
        ...     ref = call_no_start(hub.heartbeat, ids)   # no ray.shutdown() runs meanwhile
    """
    from ray._private import worker

    return worker._connect_or_shutdown_lock


def metrics_report_interval_s() -> float:
    """How often Ray exports metrics, in seconds (``ray._config``, private)."""
    import ray

    return float(ray._config.metrics_report_interval_ms()) / 1000.0


def object_store_bytes_used() -> int:
    """Bytes in use in this node's object store (``ray._private.internal_api``, private)."""
    import ray
    from ray._private import internal_api

    state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
    return int(internal_api.get_memory_info_reply(state).store_stats.object_store_bytes_used)


def tensor_version(tensor: Any) -> int:
    """The version counter of ``tensor`` (``torch.Tensor._version``, private).

    Every in-place operation on the tensor increments it (``add_``, ``copy_``,
    ``torch._foreach_*_``, indexed assignment, ``+=``), under ``no_grad`` and
    ``inference_mode`` too; out-of-place operations and reads do not. Views
    made by slicing share their base's counter; a ``Parameter`` re-pointed
    with ``param.data = other`` keeps its own. Writes through ``tensor.data``
    (a new counter) or through raw memory (numpy views, ``data_ptr``) are not
    counted.

    Args:
        tensor: a ``torch.Tensor``.

    Returns:
        The counter's current value (it only grows).

    Example:
        >>> t = torch.zeros(2)
        >>> tensor_version(t.add_(1)) - tensor_version(torch.zeros(2))
        1
    """
    # Why private: no public torch API exposes the counter (see the module docstring).
    return int(tensor._version)


def version_counters(tensors: Sequence[Any]) -> list[int]:
    """:func:`tensor_version` of each of ``tensors``, in one pass (about 40 ns a tensor).

    Call it with torch functions of tensor subclasses disabled
    (``torch._C.DisableTorchFunctionSubclass``) where ``tensors`` may hold some:
    reading the counter goes through ``__torch_function__`` otherwise.

    Example:
        >>> version_counters([torch.zeros(1).add_(1), torch.zeros(1)])
        [1, 0]
    """
    # Why private: no public torch API exposes the counter (see the module docstring).
    return [t._version for t in tensors]


def _installed(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is not None and hasattr(module, "__version__"):
        return str(module.__version__)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _outside(found: str | None, checked: tuple[tuple[int, int], tuple[int, int]]) -> str | None:
    """The versions ``checked`` (``"2.4 to 2.13"``) when ``found`` is a release outside them, else None."""
    match = re.match(r"(\d+)\.(\d+)", found or "")
    if match is None or checked[0] <= (int(match.group(1)), int(match.group(2))) <= checked[1]:
        return None
    first, last = (".".join(map(str, r)) for r in checked)
    return f"{first} to {last}"


def check_versions(torch_version: str | None = None, ray_version: str | None = None) -> list[str]:
    """The private uses whose library's installed version is outside the versions checked.

    Logs a warning for each (once per call); run at import with the installed
    versions (a version compare: neither torch nor Ray is imported for it).

    Args:
        torch_version: the torch version to check (default: the installed one).
        ray_version: the Ray version to check (default: the installed one).

    Returns:
        One line per use outside its checked versions (empty: all checked).

    Example:
        >>> check_versions("2.13.0+cpu", "2.60.0")
        []
    """
    lines = []
    found = torch_version if torch_version is not None else _installed("torch")
    checked = _outside(found, TORCH_CHECKED)
    if checked:
        lines.append(
            f"raysync reads {TORCH_VERSION_COUNTER} (to tell weights changed in place since an apply), "
            f"checked with torch {checked}; torch {found} is installed: if it changed, "
            "tests/unit/test_compat.py fails naming it"
        )
    found_ray = ray_version if ray_version is not None else _installed("ray")
    checked = _outside(found_ray, RAY_CHECKED)
    if checked:
        lines.append(
            f"raysync uses private parts of Ray ({'; '.join(RAY_USES)}), checked with Ray {checked}; "
            f"Ray {found_ray} is installed: if one changed, tests/unit/test_compat.py and "
            "tests/integration/test_compat_ray.py fail naming it"
        )
    for line in lines:
        logger.warning("%s", line)
    return lines


check_versions()

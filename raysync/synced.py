"""The receivers: ``@synced_model`` actors and ``RayModuleTransform``.

``@synced_model("policy")`` on an actor class (under ``@ray.remote``) makes
every instance a subscriber of the hub: after ``__init__`` it registers and
applies the newest version; in push mode the hub then delivers each new
version as an actor call, so it is applied *between* the actor's method calls.

Consistency: each user method runs under the read side of a reader-writer
lock and an apply takes the write side, so a reader on a threaded
(``max_concurrency > 1``) or async actor never sees two versions mixed. The
bytes are fetched before the lock is taken; under it there is only one
``copy_`` per bucket (``apply="copy"``) or a pointer swap (``apply="view"``).

Example:
    >>> @ray.remote
    ... @raysync.synced_model("policy")
    ... class Collector:
    ...     def __init__(self):
    ...         self.policy = torch.nn.Linear(4, 2)
    ...     def act(self, x):
    ...         return self.policy(x), self.raysync_version()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import ray
import torch
from ray.exceptions import ActorDiedError, GetTimeoutError, ObjectLostError

from raysync._checks import check_timeout
from raysync._locks import AsyncRWLock, RWLock
from raysync._store_pages import populate_store_mapping
from raysync.errors import RaySyncError, SyncTimeoutError
from raysync.hub import DEFAULT_HUB, DEFAULT_NAMESPACE, call_hub, call_hub_async, get_hub_actor
from raysync.transports.nixl import receive_into
from raysync.weights import BoundModel, Manifest, module_schema, require_checksums, validate, verify_checksums

__all__ = ["RayModuleTransform", "synced_model"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Mode = Literal["push", "pull"]
ApplyKind = Literal["copy", "view"]

_HEARTBEAT_S = 2.0  # how often a subscriber checks in with the hub
_HUB_QUERY_S = 10.0  # raysync_sync() without a timeout waits this long for the hub (it may be restarting)

_RAYSYNC_METHODS = {"raysync_version", "raysync_sync", "_raysync_notify", "_raysync_ping"}


@dataclass(frozen=True)
class SyncSpec:
    """One ``@synced_model`` on a class: which attribute, which model, how."""

    attr: str
    model_id: str
    hub: str
    namespace: str | None
    mode: Mode
    apply: ApplyKind
    verify: bool
    fetch_timeout: float
    prefetch: bool = False


def synced_model(
    attr: str = "policy",
    *,
    model_id: str = "policy",
    hub: str = DEFAULT_HUB,
    namespace: str | None = None,
    mode: Mode = "push",
    apply: ApplyKind = "copy",
    verify: bool = False,
    fetch_timeout: float = 300.0,
    prefetch: bool = False,
) -> Callable[[type[T]], type[T]]:
    """Keep the ``nn.Module`` in ``self.<attr>`` of an actor in step with the hub.

    Put it under ``@ray.remote``. Several ``@synced_model`` on one class sync
    several models (one per ``model_id``).

    Args:
        attr: the attribute that holds the module, set in ``__init__``.
        model_id: which model on the hub to follow.
        hub: the hub's name (see :func:`raysync.connect`).
        namespace: the hub's namespace (``None``: raysync's own).
        mode: ``"push"`` applies each version as it arrives, between method
            calls; ``"pull"`` stays on a version until the actor calls
            ``self.raysync_sync()``.
        apply: ``"copy"`` copies each version into the module's own memory
            (one ``copy_`` per bucket). ``"view"`` makes the parameters
            read-only views of the object-store buffers: no copy, one copy per
            node shared by every actor there, in-place writes raise
            :class:`raysync.ReadOnlyWeightsError`. For inference only.
        verify: check per-bucket checksums (pushed with ``checksum=True``).
        fetch_timeout: seconds to wait for a version's bytes before giving up.
        prefetch: fetch each new version in a background thread, into a second
            set of buffers, while the actor works; at the next safe point (the
            start of a method call, or the hub's delivery) applying is a
            pointer swap. Costs a second copy of the weights; ``apply="copy"``
            and non-async actors only.

    The class gains ``raysync_version(model_id=None) -> int | None`` (callable
    remotely) and ``raysync_sync(timeout=None, model_id=None) -> bool``
    (``async`` on async actors).

    Example:
        >>> @ray.remote
        ... @raysync.synced_model("policy", mode="pull")
        ... class Collector:
        ...     def __init__(self):
        ...         self.policy = make_policy()
        ...     def rollout(self):
        ...         self.raysync_sync()          # take the newest version now
        ...         return run_episode(self.policy), self.raysync_version()
    """
    if not isinstance(attr, str) or not attr.isidentifier():
        raise ValueError(f"attr must name the attribute that holds the module, got {attr!r}")
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    if mode not in ("push", "pull"):
        raise ValueError(f"mode must be 'push' or 'pull', got {mode!r}")
    if apply not in ("copy", "view"):
        raise ValueError(f"apply must be 'copy' or 'view', got {apply!r}")
    check_timeout(fetch_timeout, "fetch_timeout", allow_none=False, positive=True)
    if prefetch and apply != "copy":
        raise ValueError("prefetch=True needs apply='copy' (with apply='view' there is nothing to copy)")
    spec = SyncSpec(
        attr, model_id, hub, namespace, mode, apply, bool(verify), float(fetch_timeout), bool(prefetch)
    )

    def decorate(cls: type[T]) -> type[T]:
        if not isinstance(cls, type):
            raise TypeError(
                f"@synced_model decorates a class, got {type(cls).__name__}; if that is a Ray "
                "actor class, put @ray.remote above @raysync.synced_model(...)"
            )
        return _synced_class(cls, spec)

    return decorate


# ---------------------------------------------------------------------- class building


def _synced_class(cls: type[T], spec: SyncSpec) -> type[T]:
    specs: tuple[SyncSpec, ...] = getattr(cls, "__raysync_specs__", ())
    if specs:  # another @synced_model on an already synced class (or a subclass of one)
        if any(s.model_id == spec.model_id for s in specs):
            raise ValueError(f"{cls.__name__} already syncs model_id {spec.model_id!r}")
        cls.__raysync_specs__ = (*specs, spec)  # type: ignore[attr-defined]
        return cls
    namespace: dict[str, Any] = {
        "__raysync_specs__": (spec,),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "__init_subclass__": _init_subclass,
        "raysync_version": _raysync_version,
        "_raysync_ping": _raysync_ping,
    }
    synced = type(cls.__name__, (cls,), namespace)
    inherited: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):  # every class but object, the nearest one winning
        inherited.update(vars(klass))
    _prepare(synced, own=inherited, init=cls.__init__)
    return synced


def _init_subclass(sub: type, **kwargs: Any) -> None:
    """Subclasses of a synced class are synced too: their own methods get the same guard."""
    hook_owner: type = next(
        k
        for k in sub.__mro__[1:]
        if getattr(vars(k).get("__init_subclass__"), "__func__", None) is _init_subclass
    )
    super(hook_owner, sub).__init_subclass__(**kwargs)  # type: ignore[arg-type]
    _prepare(sub, own=dict(vars(sub)), init=sub.__dict__.get("__init__"))


def _prepare(cls: type, *, own: Any, init: Any) -> None:
    """Guard the methods ``cls`` defines, choose the async or sync receive path, wrap ``__init__``."""
    is_async = _is_async_class(cls)
    cls.__raysync_async__ = is_async  # type: ignore[attr-defined]
    cls._raysync_notify = _raysync_notify_async if is_async else _raysync_notify  # type: ignore[attr-defined]
    cls.raysync_sync = _raysync_sync_async_actor if is_async else _raysync_sync  # type: ignore[attr-defined]
    for name, fn in _user_methods(own):
        setattr(cls, name, _guarded(fn, is_async))
    if init is not None:
        cls.__init__ = _attaching_init(init)  # type: ignore[misc]


def _attaching_init(init: Callable[..., None]) -> Callable[..., None]:
    """Run ``__init__``; once the outermost one returns, register with the hub."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        depth = self.__dict__.get("_raysync_init_depth", 0)
        self.__dict__["_raysync_init_depth"] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            self.__dict__["_raysync_init_depth"] = depth
        if depth == 0:
            cls = type(self)
            _ActorSync.attach(self, cls.__raysync_specs__, cls.__raysync_async__)

    return __init__


def _is_async_class(cls: type) -> bool:
    return any(
        inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
        for _, fn in inspect.getmembers(cls, inspect.isfunction)
    )


def _user_methods(own: Any) -> Iterator[tuple[str, Callable[..., Any]]]:
    """The public methods (and ``__call__``) among a class's own attributes."""
    for name, value in list(own.items()):
        if name in _RAYSYNC_METHODS or (name.startswith("_") and name != "__call__"):
            continue
        if getattr(value, "__raysync_guarded__", False):
            continue
        if inspect.isfunction(value) and not (
            inspect.isgeneratorfunction(value) or inspect.isasyncgenfunction(value)
        ):
            yield name, value


def _guarded(fn: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
    """Run a user method under the read side of the actor's version lock."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            sync = _ActorSync.of(self)
            if sync is None:
                return await fn(self, *args, **kwargs)
            sync.loop = asyncio.get_running_loop()
            async with sync.async_lock.read():
                return await fn(self, *args, **kwargs)

        async_method.__raysync_guarded__ = True  # type: ignore[attr-defined]
        return async_method
    if is_async:
        # Sync methods of an async actor run on its event loop: nothing interleaves with them.
        return fn

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        sync = _ActorSync.of(self)
        if sync is None:
            return fn(self, *args, **kwargs)
        with sync.lock.read():
            return fn(self, *args, **kwargs)

    method.__raysync_guarded__ = True  # type: ignore[attr-defined]
    return method


# ---------------------------------------------------------------------- methods added to the class


def _raysync_version(self: Any, model_id: str | None = None) -> int | None:
    """The version of ``model_id`` this actor holds (``None`` before the first).

    ``None`` also after user code re-pointed the module's parameters (for example
    ``load_state_dict(..., assign=True)``, ``.double()``): the module then holds
    no version of the hub's, and in push mode the newest one is applied again.
    """
    sync = _ActorSync.of(self)
    if sync is None:
        return None
    sub = sync.subscription(model_id)
    sub.check_binding()
    return sub.version


def _ids(refs: list[ray.ObjectRef]) -> list[str | None]:
    """A bucket's identity is the object it came from: same object, same bytes."""
    return [r.hex() for r in refs]


def _raysync_ping(self: Any) -> bool:
    return True


def _raysync_notify(
    self: Any, model_id: str, version: int, manifest: Manifest, refs: list[ray.ObjectRef]
) -> dict[str, Any]:
    sync = _ActorSync.of(self)
    assert sync is not None, "notified before registration"
    return sync.subscription(model_id).receive(version, manifest, refs, defer=True)


async def _raysync_notify_async(
    self: Any, model_id: str, version: int, manifest: Manifest, refs: list[ray.ObjectRef]
) -> dict[str, Any]:
    sync = _ActorSync.of(self)
    assert sync is not None, "notified before registration"
    return await sync.subscription(model_id).receive_async(version, manifest, refs)


def _raysync_sync(self: Any, timeout: float | None = None, model_id: str | None = None) -> bool:
    """Apply the newest version of the model(s) if newer than the one held.

    A cheap check (one small call to the hub) when already current.

    Args:
        timeout: seconds for the whole sync (asking the hub and fetching);
            ``None``: 10 s for the hub to answer (it may be restarting), the
            subscription's ``fetch_timeout`` for the fetch.
        model_id: sync only this model (default: every model the actor syncs).

    Returns:
        True if a newer version was applied.

    Raises:
        SyncTimeoutError: ``timeout`` passed first (the previous version stays).
        RaySyncError: the newest version could not be applied (the previous one stays).

    Example:
        >>> def rollout(self):
        ...     self.raysync_sync(timeout=10)    # the newest version for this episode
    """
    check_timeout(timeout)
    sync = _ActorSync.of(self)
    if sync is None:
        return False
    subs = [sync.subscription(model_id)] if model_id else list(sync.subs.values())
    return any([sub.sync_newest(timeout) for sub in subs])


async def _raysync_sync_coroutine(self: Any, timeout: float | None, model_id: str | None) -> bool:
    check_timeout(timeout)
    sync = _ActorSync.of(self)
    if sync is None:
        return False
    subs = [sync.subscription(model_id)] if model_id else list(sync.subs.values())
    results = [await sub.sync_newest_async(timeout) for sub in subs]
    return any(results)


def _raysync_sync_async_actor(self: Any, timeout: float | None = None, model_id: str | None = None) -> Any:
    """``raysync_sync`` on an async actor: ``await self.raysync_sync()`` in an async method.

    Called from a plain (non-async) method, or remotely, it syncs right away and
    returns the bool: the fetch blocks the event loop like any plain method does,
    and if async methods are suspended mid-call the apply waits for them to
    return (it cannot change weights under them), so it returns False then.
    """
    if _called_from_coroutine(sys._getframe(1)):
        return _raysync_sync_coroutine(self, timeout, model_id)
    check_timeout(timeout)
    sync = _ActorSync.of(self)
    if sync is None:
        return False
    subs = [sync.subscription(model_id)] if model_id else list(sync.subs.values())
    return any([sub.sync_newest_on_loop(timeout) for sub in subs])


def _called_from_coroutine(frame: Any) -> bool:
    """Whether the nearest caller outside Ray is an ``async def`` (user code that will await).

    Ray wraps actor methods (tracing's ``_resume_span``, its sync-to-async wrapper);
    a remote call has no user frame at all, only Ray's and asyncio's.
    """
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("ray."):
        frame = frame.f_back
    return frame is not None and bool(frame.f_code.co_flags & inspect.CO_COROUTINE)


# ---------------------------------------------------------------------- per-actor state


class _ActorSync:
    """Everything raysync keeps inside one actor instance."""

    _ATTR = "_raysync_actor_sync"

    def __init__(self, owner: Any, is_async: bool) -> None:
        self.owner = owner
        self.is_async = is_async
        self.lock = RWLock()
        self.async_lock = AsyncRWLock()
        self.loop: asyncio.AbstractEventLoop | None = None  # an async actor's event loop, once seen
        self.subs: dict[str, _Subscription] = {}

    @classmethod
    def of(cls, owner: Any) -> _ActorSync | None:
        return owner.__dict__.get(cls._ATTR)

    @classmethod
    def attach(cls, owner: Any, specs: tuple[SyncSpec, ...], is_async: bool) -> None:
        sync = cls(owner, is_async)
        owner.__dict__[cls._ATTR] = sync
        for spec in specs:
            if spec.prefetch and is_async:
                raise ValueError(
                    f"{type(owner).__name__}: prefetch=True is not supported on async actors yet; "
                    "drop it (async actors already fetch without blocking their event loop)"
                )
            sync.subs[spec.model_id] = _Subscription(sync, spec)
        ctx = ray.get_runtime_context() if ray.is_initialized() else None
        if ctx is None or ctx.get_actor_id() is None:
            logger.warning(
                "%s was created outside a Ray actor: it will not follow the hub for %s at any "
                "version (create it with %s.remote(...) under @ray.remote)",
                type(owner).__name__,
                sorted(sync.subs),
                type(owner).__name__,
            )
            return
        for sub in sync.subs.values():
            sub.register(ctx)
        thread = threading.Thread(target=sync._heartbeat_loop, args=(ctx,), name="raysync-heartbeat")
        thread.daemon = True
        thread.start()

    def _heartbeat_loop(self, ctx: Any) -> None:
        """Check in with the hub; register again if it restarted or dropped this actor."""
        while True:
            time.sleep(_HEARTBEAT_S)
            for sub in list(self.subs.values()):
                try:
                    known = ray.get(sub.hub.heartbeat.remote(sub.sub_id), timeout=_HEARTBEAT_S * 5)
                except ActorDiedError:  # killed for good: follow a new hub of that name, if any
                    try:
                        sub.hub = ray.get_actor(
                            sub.spec.hub, namespace=sub.spec.namespace or DEFAULT_NAMESPACE
                        )
                    except ValueError:
                        continue
                    known = False
                except Exception:  # restarting or busy: try again next beat
                    continue
                if known:
                    continue
                try:
                    logger.warning(
                        "%s: hub %r does not know this subscriber (restarted?); registering again at "
                        "version %s of %r",
                        sub.sub_id,
                        sub.spec.hub,
                        sub.version,
                        sub.spec.model_id,
                    )
                    sub.register(ctx)
                except Exception as err:
                    logger.warning(
                        "%s could not register again for %r (at version %s): %s",
                        sub.sub_id,
                        sub.spec.model_id,
                        sub.version,
                        err,
                    )

    def subscription(self, model_id: str | None) -> _Subscription:
        if model_id is None:
            return next(iter(self.subs.values()))
        try:
            return self.subs[model_id]
        except KeyError:
            raise RaySyncError(
                f"this actor does not sync model_id {model_id!r}; it syncs {sorted(self.subs)}"
            ) from None


_Fetched = tuple[int, Manifest, list[ray.ObjectRef], dict[int, Any], list[int], float]
"""A fetched version waiting for its apply: version, manifest, refs, buckets, their indices, start time."""


class _Subscription:
    """One (actor, model_id): the version held, the binding of the module to a layout."""

    def __init__(self, sync: _ActorSync, spec: SyncSpec) -> None:
        self.sync = sync
        self.spec = spec
        self.version: int | None = None
        self.bound: BoundModel | None = None
        self.sub_id = ""
        self.hub: Any = None
        # Guards the spare buffer set (prefetch staging, NIXL receives).
        self._stage_lock = threading.Lock()
        self._staged: tuple[int, list[str | None], int] | None = None
        self._prefetching = False
        # Held while the binding or the version changes, and while they are checked: an
        # apply and a check from another thread (heartbeat, raysync_version) never interleave.
        self._binding_lock = threading.Lock()
        self._deferred: asyncio.Task[None] | None = None  # an apply waiting for async methods to return
        # Threaded actors: a delivered version whose apply waits for running methods (see receive).
        self._defer_lock = threading.Lock()
        self._pending: _Fetched | None = None
        self._applier: threading.Thread | None = None

    # -------------------------------------------------------------- registration
    def module(self) -> torch.nn.Module:
        module = getattr(self.sync.owner, self.spec.attr, None)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"@synced_model({self.spec.attr!r}) needs self.{self.spec.attr} to be an "
                f"nn.Module once __init__ returns, found {type(module).__name__}"
            )
        return module

    def register(self, ctx: Any) -> None:
        module = self.module()
        actor_id = ctx.get_actor_id()
        self.sub_id = f"{actor_id}:{self.spec.model_id}"
        info = {
            "actor_id": actor_id,
            "class_name": type(self.sync.owner).__name__,
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "mode": self.spec.mode,
            "apply": self.spec.apply,
            "attr": self.spec.attr,
            "applied": self.version,
        }
        # While the hub restarts, wait for it: a subscriber restarted meanwhile must not fail __init__.
        newest = call_hub(
            self._hub_handle, "register", self.spec.model_id, self.sub_id, ctx.current_actor, info,
            module_schema(module),
        )
        if newest is not None:
            reply = self.receive(newest["version"], newest["manifest"], newest["refs"])
            self.hub.report.remote(self.sub_id, reply)
        if self.spec.prefetch and not self._prefetching:
            self.start_prefetch()

    def _hub_handle(self, fresh: bool) -> Any:
        """The hub's handle; looked up by name again after a restart (or a re-creation)."""
        if fresh or self.hub is None:
            self.hub = get_hub_actor(self.spec.hub, self.spec.namespace)
        return self.hub

    # -------------------------------------------------------------- apply
    def _bound_for(self, manifest: Manifest) -> BoundModel | None:
        bound = self.bound
        if bound is None or bound.module is not self.module() or bound.layout_hash != manifest.layout_hash:
            return None
        return bound

    def check_binding(self) -> bool:
        """Whether the module still holds the version last applied; forget it if not.

        User code can re-point parameters (``load_state_dict(sd, assign=True)``,
        ``module.double()``, ``module.to(...)``, replacing a submodule); applies
        would then go into buffers the module no longer uses. When that happened,
        the subscription holds no version (``raysync_version()`` is ``None``), the
        next apply binds the module afresh, and in push mode the hub is asked to
        deliver the newest version again.
        """
        with self._binding_lock:
            bound = self.bound
            module = getattr(self.sync.owner, self.spec.attr, None)
            if bound is None or (bound.module is module and bound.intact()):
                return True
            held, self.bound, self.version = self.version, None, None
            self._staged = None
        logger.warning(
            "%s: the parameters of self.%s were re-pointed by user code (load_state_dict(assign=True), "
            ".to(), .double(), a replaced submodule, ...): it no longer holds version %s of %r; %s",
            self.sub_id,
            self.spec.attr,
            held,
            self.spec.model_id,
            "the newest is applied again" if self.spec.mode == "push" else "raysync_sync() applies it",
        )
        if self.hub is not None and held is not None:
            why = f"parameters re-pointed by user code: version {held} no longer held"
            self.hub.report.remote(self.sub_id, {"applied": None, "reset": True, "error": why})
        return False

    def _plan(self, version: int, manifest: Manifest, refs: list[ray.ObjectRef]) -> list[int] | None:
        """Validate before fetching; the buckets to fetch, or None if the version is not newer."""
        self.check_binding()
        if self.version is not None and version <= self.version:
            return None
        bound = self._bound_for(manifest)
        if bound is None:
            validate(manifest, module_schema(self.module()))
            return list(range(manifest.num_buckets))
        return bound.needed(_ids(refs))

    def _fetch(
        self, manifest: Manifest, refs: list[ray.ObjectRef], needed: list[int], timeout: float | None = None
    ) -> dict[int, Any]:
        timeout = self.spec.fetch_timeout if timeout is None else timeout
        arrays = ray.get([refs[b] for b in needed], timeout=timeout)
        return self._fetched(manifest, needed, arrays)

    def _fetched(self, manifest: Manifest, needed: list[int], arrays: list[Any]) -> dict[int, Any]:
        """The fetched buckets by index, checked (``verify=True``); what every fetch path ends with."""
        # once per process: later reads take no page faults
        populate_store_mapping(False, sum(manifest.bucket_nbytes[b] for b in needed))
        fetched = dict(zip(needed, arrays, strict=True))
        if self.spec.verify:
            verify_checksums(manifest, fetched)
        return fetched

    def _commit(
        self, version: int, manifest: Manifest, refs: list[ray.ObjectRef], fetched: dict[int, Any]
    ) -> float:
        """Apply fetched buckets; return the pause (seconds readers waited). Caller holds the write lock."""
        t0 = time.perf_counter()
        with self._binding_lock:
            if self.version is not None and version <= self.version:
                return 0.0  # a newer one got in first
            bound = self._bound_for(manifest)
            if bound is not None and not bound.intact():  # re-pointed since the fetch was planned
                bound, self.bound, self.version = None, None, None
            if bound is None:
                bound = BoundModel(self.module(), manifest, view=self.spec.apply == "view")
                self.bound = bound
            ids = _ids(refs)
            missing = [b for b in bound.needed(ids) if b not in fetched]
            if missing:
                raise RaySyncError(f"bucket(s) {missing} changed while version {version} was fetched; retry")
            bound.apply(fetched, ids, extra_state=manifest.extra_state)
            self.version = version
        return time.perf_counter() - t0

    def _reply(
        self,
        version: int,
        t0: float,
        error: BaseException | None,
        pause: float = 0.0,
        fetched: int = 0,
        fetched_bytes: int = 0,
    ) -> dict[str, Any]:
        elapsed = time.perf_counter() - t0
        if error is None:
            logger.debug(
                "%s applied %r version %d in %.4f s (pause %.4f s)",
                self.sub_id,
                self.spec.model_id,
                version,
                elapsed,
                pause,
            )
            return {
                "applied": self.version,
                "apply_s": elapsed,
                "pause_s": pause,
                "buckets_fetched": fetched,
                "bytes_fetched": fetched_bytes,
            }
        logger.warning(
            "%s failed to apply %r version %d, keeps version %s: %s",
            self.sub_id,
            self.spec.model_id,
            version,
            self.version,
            error,
        )
        reply: dict[str, Any] = {
            "applied": self.version,
            "failed": version,
            "error": f"{type(error).__name__}: {str(error)[:1000]}",
        }
        if isinstance(error, TimeoutError):
            reply["timed_out"] = True
        if isinstance(error, ObjectLostError):
            reply["lost"] = version  # its bytes are gone (the pusher died): the hub stops offering it
        return reply

    def receive(
        self,
        version: int,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        *,
        fetch_timeout: float | None = None,
        defer: bool = False,
    ) -> dict[str, Any]:
        """Fetch, validate and apply a version (threads and plain actors).

        With ``defer`` (the hub's delivery), a threaded actor whose methods do not
        end within the lock's priority window gets the apply done by a raysync
        thread once they end (reported to the hub then), so the delivery call does
        not hold one of the actor's concurrency slots meanwhile.
        """
        t0 = time.perf_counter()
        if manifest.transport == "nixl":
            return self._receive_nixl(version, manifest, refs, t0)
        try:
            if self.spec.prefetch:
                swapped = self.swap_if_staged(version)
                if swapped is not None:
                    return swapped
            needed = self._plan(version, manifest, refs)
            if needed is None:
                return {"applied": self.version, "skipped": version}
            fetched = self._fetch(manifest, refs, needed, fetch_timeout)
            lock = self.sync.lock
            if defer and not self.sync.is_async and not lock.held():
                if not lock.try_write():
                    self._defer((version, manifest, refs, fetched, needed, t0))
                    return {"applied": self.version, "deferred": version}
                try:
                    pause = self._commit(version, manifest, refs, fetched)
                finally:
                    lock.release_write()
            else:
                with self._write_lock():
                    pause = self._commit(version, manifest, refs, fetched)
            del fetched
        except Exception as err:
            return self._reply(version, t0, err)
        return self._reply(
            version, t0, None, pause, len(needed), sum(manifest.bucket_nbytes[b] for b in needed)
        )

    def _defer(self, item: _Fetched) -> None:
        """Hand an apply to the applier thread (the newest deferred version wins)."""
        with self._defer_lock:
            if self._pending is None or item[0] > self._pending[0]:
                self._pending = item
            if self._applier is None:
                self._applier = threading.Thread(
                    target=self._apply_deferred, name=f"raysync-apply-{self.spec.model_id}", daemon=True
                )
                self._applier.start()

    def _apply_deferred(self) -> None:
        while True:
            with self._defer_lock:
                item, self._pending = self._pending, None
                if item is None:
                    self._applier = None
                    return
            version, manifest, refs, fetched, needed, t0 = item
            try:
                with self.sync.lock.write():
                    pause = self._commit(version, manifest, refs, fetched)
                reply = self._reply(version, t0, None, pause, len(needed), _nbytes(manifest, needed))
            except Exception as err:
                reply = self._reply(version, t0, err)
            del item, fetched
            self.hub.report.remote(self.sub_id, reply)

    async def receive_async(
        self,
        version: int,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        *,
        fetch_timeout: float | None = None,
    ) -> dict[str, Any]:
        """Same as :meth:`receive` for async actors: waits without blocking the event loop."""
        t0 = time.perf_counter()
        self.sync.loop = asyncio.get_running_loop()
        if manifest.transport == "nixl":
            return await asyncio.to_thread(self._receive_nixl, version, manifest, refs, t0)
        try:
            needed = self._plan(version, manifest, refs)
            if needed is None:
                return {"applied": self.version, "skipped": version}
            arrays = await asyncio.wait_for(
                asyncio.gather(*[refs[b] for b in needed]),
                self.spec.fetch_timeout if fetch_timeout is None else fetch_timeout,
            )
            fetched = self._fetched(manifest, needed, arrays)
            async with self.sync.async_lock.write():
                pause = self._commit(version, manifest, refs, fetched)
            del fetched, arrays
        except Exception as err:
            return self._reply(version, t0, err)
        return self._reply(
            version, t0, None, pause, len(needed), sum(manifest.bucket_nbytes[b] for b in needed)
        )

    def _receive_nixl(
        self, version: int, manifest: Manifest, refs: list[ray.ObjectRef], t0: float
    ) -> dict[str, Any]:
        """NIXL: receive into the spare buffer set, then swap it in under the write lock."""
        try:
            if self.spec.apply != "copy":
                raise RaySyncError(
                    f"{self.sub_id}: apply={self.spec.apply!r} needs the object store; this version came "
                    "over NIXL (push with transport='object_store' or use apply='copy')"
                )
            self.check_binding()
            if self.spec.verify:
                require_checksums(manifest)  # NIXL versions carry none: refused, not taken unchecked
            with self._stage_lock:
                if self.version is not None and version <= self.version:
                    return {"applied": self.version, "skipped": version}
                bound = self._bound_for(manifest)
                if bound is None:
                    validate(manifest, module_schema(self.module()))
                    with self._write_lock(), self._binding_lock:
                        bound = self.bound = BoundModel(self.module(), manifest)
                ids = _ids(refs)
                nbytes = receive_into(
                    bound, refs, ids, timeout=self.spec.fetch_timeout, extra_state=manifest.extra_state
                )
                with self._write_lock(), self._binding_lock:
                    t1 = time.perf_counter()
                    if self.bound is bound and (self.version is None or version > self.version):
                        bound.swap()  # re-points every parameter: whole whatever they pointed at
                        self.version = version
                    pause = time.perf_counter() - t1
        except Exception as err:
            return self._reply(version, t0, err)
        return self._reply(version, t0, None, pause, 0, nbytes)

    @contextlib.contextmanager
    def _write_lock(self) -> Iterator[None]:
        """The actor's write lock, from a worker thread of a threaded or an async actor."""
        if not self.sync.is_async:
            with self.sync.lock.write():
                yield
            return
        # Async actors: their user methods hold the asyncio lock; take it on the loop.
        loop = self.sync.loop
        if loop is None:  # still in __init__: no method has run on the loop yet
            yield
            return
        entered = threading.Event()
        release = threading.Event()

        async def hold() -> None:
            async with self.sync.async_lock.write():
                entered.set()
                await asyncio.to_thread(release.wait)

        future = asyncio.run_coroutine_threadsafe(hold(), loop)
        entered.wait()
        try:
            yield
        finally:
            release.set()
            future.result()

    # -------------------------------------------------------------- prefetch
    def start_prefetch(self) -> None:
        self._prefetching = True
        thread = threading.Thread(target=self._prefetch_loop, name=f"raysync-prefetch-{self.spec.model_id}")
        thread.daemon = True
        thread.start()

    def _prefetch_loop(self) -> None:
        """Background: wait for a newer version, copy its changed buckets into the spare buffers."""
        known = self.version or 0
        while True:
            try:
                info = ray.get(self.hub.wait_newer.remote(self.spec.model_id, known, 30.0), timeout=90)
            except Exception as err:  # hub restarting or unreachable: try again shortly
                logger.debug(
                    "%s prefetch of %r after version %d: %s", self.sub_id, self.spec.model_id, known, err
                )
                time.sleep(1.0)
                continue
            if not info or "error" in info:
                continue
            version, manifest, refs = info["version"], info["manifest"], info["refs"]
            known = max(known, version)
            if manifest.transport != "object_store":
                continue  # NIXL versions are received straight into the spare set anyway
            try:
                with self._stage_lock:
                    bound = self._bound_for(manifest)
                    if bound is None or (self.version is not None and version <= self.version):
                        continue  # first version or a new layout: the normal path binds it
                    ids = _ids(refs)
                    needed = bound.needed(ids, staging=True)
                    fetched = self._fetch(manifest, refs, needed)
                    bound.stage(fetched, ids, extra_state=manifest.extra_state)
                    self._staged = (version, ids, sum(manifest.bucket_nbytes[b] for b in needed))
                    del fetched
                    if self.spec.mode == "push":
                        # The write lock is granted between method calls: that is the safe point.
                        reply = self._swap_staged()
                        if reply is not None:
                            self.hub.report.remote(self.sub_id, reply)
            except Exception as err:
                logger.warning(
                    "%s could not prefetch %r version %d: %s", self.sub_id, self.spec.model_id, version, err
                )

    def _swap_staged(self) -> dict[str, Any] | None:
        """Make the staged version current by re-pointing (no copy). Caller holds the stage lock."""
        staged, bound = self._staged, self.bound
        if staged is None or bound is None or (self.version is not None and staged[0] <= self.version):
            return None
        with self._write_lock(), self._binding_lock:
            if self.bound is not bound or not bound.intact():
                self._staged = None  # re-pointed by user code: the normal path binds afresh
                return None
            t0 = time.perf_counter()
            bound.swap()
            self.version = staged[0]
            pause = time.perf_counter() - t0
        self._staged = None
        return {
            "applied": self.version,
            "apply_s": pause,
            "pause_s": pause,
            "prefetched": True,
            "bytes_fetched": staged[2],
        }

    def swap_if_staged(self, version: int) -> dict[str, Any] | None:
        """Before fetching ``version`` the slow way: take it from the prefetcher if it has it.

        Returns a reply if this subscriber now holds ``version`` (or newer), else None.
        """
        # Inside a user method (raysync_sync) the prefetcher may be waiting for our read to
        # end: never block on it from there.
        if not self._stage_lock.acquire(blocking=not self.sync.lock.held()):
            return None
        try:
            reply = self._swap_staged()
        finally:
            self._stage_lock.release()
        if self.version is not None and self.version >= version:
            return reply or {"applied": self.version, "skipped": version}
        return None

    # -------------------------------------------------------------- pull mode
    def _newer(self, timeout: float | None) -> dict[str, Any] | None:
        bound = _HUB_QUERY_S if timeout is None else timeout
        try:
            info: dict[str, Any] | None = call_hub(
                self._hub_handle, "get", self.spec.model_id, None, self.version or 0, timeout=bound
            )
        except GetTimeoutError:
            raise self._hub_timeout(timeout) from None
        if info is not None and "error" in info:
            return None  # nothing pushed yet
        return info

    def _hub_timeout(self, timeout: float | None) -> SyncTimeoutError:
        why = (
            f"the hub did not answer within {_HUB_QUERY_S:.0f} s (restarting?)"
            if timeout is None
            else f"raysync_sync(timeout={timeout}) ran out asking the hub"
        )
        return SyncTimeoutError(
            f"{self.sub_id}: {why} for the newest version of {self.spec.model_id!r}; it keeps version "
            f"{self.version}"
        )

    def _synced(self, version: int, reply: dict[str, Any]) -> bool:
        """Report a raysync_sync apply to the hub; raise if it failed; whether it applied a newer one."""
        self.hub.report.remote(self.sub_id, reply)
        if reply.get("error"):
            error = SyncTimeoutError if reply.get("timed_out") else RaySyncError
            raise error(f"raysync_sync could not apply version {version}: {reply['error']}")
        return "skipped" not in reply

    def sync_newest(self, timeout: float | None) -> bool:
        if self.hub is None:
            return False
        deadline = _deadline(timeout)
        info = self._newer(timeout)
        if info is None:
            return False
        reply = self.receive(info["version"], info["manifest"], info["refs"], fetch_timeout=_left(deadline))
        return self._synced(info["version"], reply)

    async def sync_newest_async(self, timeout: float | None) -> bool:
        if self.hub is None:
            return False
        deadline = _deadline(timeout)
        try:
            info = await call_hub_async(
                self._hub_handle,
                "get",
                self.spec.model_id,
                None,
                self.version or 0,
                timeout=_HUB_QUERY_S if timeout is None else timeout,
            )
        except asyncio.TimeoutError:
            raise self._hub_timeout(timeout) from None
        if info is None or "error" in info:
            return False
        reply = await self.receive_async(
            info["version"], info["manifest"], info["refs"], fetch_timeout=_left(deadline)
        )
        return self._synced(info["version"], reply)

    def sync_newest_on_loop(self, timeout: float | None) -> bool:
        """``raysync_sync`` from a plain method of an async actor (on its event loop, or a thread)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a thread of the actor: the apply takes the write lock through the loop
            return self.sync_newest(timeout)
        if self.hub is None:
            return False
        self.sync.loop = loop
        deadline = _deadline(timeout)
        info = self._newer(timeout)
        if info is None:
            return False
        version, manifest, refs = info["version"], info["manifest"], info["refs"]
        t0 = time.perf_counter()
        try:
            if manifest.transport != "object_store":
                raise RaySyncError(
                    "a NIXL version cannot be applied from a plain method of an async actor: call "
                    "`await self.raysync_sync()` from an async method"
                )
            needed = self._plan(version, manifest, refs)
            if needed is None:
                return self._synced(version, {"applied": self.version, "skipped": version})
            fetched = self._fetch(manifest, refs, needed, _left(deadline))
            lock = self.sync.async_lock
            if not lock.try_write():
                # Async methods are suspended mid-call: the apply waits for them on the loop.
                self._deferred = loop.create_task(
                    self._commit_when_free(version, manifest, refs, fetched, needed, t0)
                )
                return False
            try:
                pause = self._commit(version, manifest, refs, fetched)
            finally:
                lock.release_write()
            reply = self._reply(version, t0, None, pause, len(needed), _nbytes(manifest, needed))
        except RaySyncError:
            raise
        except Exception as err:
            reply = self._reply(version, t0, err)
        return self._synced(version, reply)

    async def _commit_when_free(
        self,
        version: int,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        fetched: dict[int, Any],
        needed: list[int],
        t0: float,
    ) -> None:
        try:
            async with self.sync.async_lock.write():
                pause = self._commit(version, manifest, refs, fetched)
            reply = self._reply(version, t0, None, pause, len(needed), _nbytes(manifest, needed))
        except Exception as err:
            reply = self._reply(version, t0, err)
        self.hub.report.remote(self.sub_id, reply)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _nbytes(manifest: Manifest, buckets: list[int]) -> int:
    return sum(manifest.bucket_nbytes[b] for b in buckets)


# ---------------------------------------------------------------------- RayModuleTransform


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

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
import contextvars
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import ray
import torch
from ray.exceptions import ActorDiedError

from raysync._store_pages import populate_store_mapping
from raysync.errors import RaySyncError
from raysync.hub import DEFAULT_HUB, DEFAULT_NAMESPACE, get_hub_actor
from raysync.transports.nixl import receive_into
from raysync.weights import BoundModel, Manifest, module_schema, require_checksums, validate, verify_checksums

__all__ = ["RayModuleTransform", "synced_model"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Mode = Literal["push", "pull"]
ApplyKind = Literal["copy", "view"]

_HEARTBEAT_S = 2.0  # how often a subscriber checks in with the hub

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
    if fetch_timeout <= 0:
        raise ValueError(f"fetch_timeout must be positive seconds, got {fetch_timeout!r}")
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
    cls.raysync_sync = _raysync_sync_async if is_async else _raysync_sync  # type: ignore[attr-defined]
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
    """The version of ``model_id`` this actor holds (``None`` before the first)."""
    sync = _ActorSync.of(self)
    if sync is None:
        return None
    return sync.subscription(model_id).version


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
    return sync.subscription(model_id).receive(version, manifest, refs)


async def _raysync_notify_async(
    self: Any, model_id: str, version: int, manifest: Manifest, refs: list[ray.ObjectRef]
) -> dict[str, Any]:
    sync = _ActorSync.of(self)
    assert sync is not None, "notified before registration"
    return await sync.subscription(model_id).receive_async(version, manifest, refs)


def _raysync_sync(self: Any, timeout: float | None = None, model_id: str | None = None) -> bool:
    """Apply the newest version of the model(s) if newer than the one held.

    A cheap check (one small call to the hub) when already current.

    Returns:
        True if a newer version was applied.

    Raises:
        RaySyncError: the newest version could not be applied (the previous one stays).
    """
    sync = _ActorSync.of(self)
    if sync is None:
        return False
    subs = [sync.subscription(model_id)] if model_id else list(sync.subs.values())
    return any([sub.sync_newest(timeout) for sub in subs])


async def _raysync_sync_async(self: Any, timeout: float | None = None, model_id: str | None = None) -> bool:
    """Async form of ``raysync_sync`` for async actors: ``await self.raysync_sync()``."""
    sync = _ActorSync.of(self)
    if sync is None:
        return False
    subs = [sync.subscription(model_id)] if model_id else list(sync.subs.values())
    results = [await sub.sync_newest_async(timeout) for sub in subs]
    return any(results)


# ---------------------------------------------------------------------- per-actor state


class _ActorSync:
    """Everything raysync keeps inside one actor instance."""

    _ATTR = "_raysync_actor_sync"

    def __init__(self, owner: Any, is_async: bool) -> None:
        self.owner = owner
        self.is_async = is_async
        self.lock = _RWLock()
        self.async_lock = _AsyncRWLock()
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
        self.hub = get_hub_actor(self.spec.hub, self.spec.namespace)
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
        newest = ray.get(
            self.hub.register.remote(
                self.spec.model_id, self.sub_id, ctx.current_actor, info, module_schema(module)
            )
        )
        if newest is not None:
            reply = self.receive(newest["version"], newest["manifest"], newest["refs"])
            self.hub.report.remote(self.sub_id, reply)
        if self.spec.prefetch and not self._prefetching:
            self.start_prefetch()

    # -------------------------------------------------------------- apply
    def _bound_for(self, manifest: Manifest) -> BoundModel | None:
        bound = self.bound
        if bound is None or bound.module is not self.module() or bound.layout_hash != manifest.layout_hash:
            return None
        return bound

    def _plan(self, version: int, manifest: Manifest, refs: list[ray.ObjectRef]) -> list[int] | None:
        """Validate before fetching; the buckets to fetch, or None if the version is not newer."""
        if self.version is not None and version <= self.version:
            return None
        bound = self._bound_for(manifest)
        if bound is None:
            validate(manifest, module_schema(self.module()))
            return list(range(manifest.num_buckets))
        return bound.needed(_ids(refs))

    def _fetch(self, manifest: Manifest, refs: list[ray.ObjectRef], needed: list[int]) -> dict[int, Any]:
        arrays = ray.get([refs[b] for b in needed], timeout=self.spec.fetch_timeout)
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
        if self.version is not None and version <= self.version:
            return 0.0  # a newer one got in first
        bound = self._bound_for(manifest)
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
        return {
            "applied": self.version,
            "failed": version,
            "error": f"{type(error).__name__}: {str(error)[:1000]}",
        }

    def receive(self, version: int, manifest: Manifest, refs: list[ray.ObjectRef]) -> dict[str, Any]:
        """Fetch, validate and apply a version (threads and plain actors)."""
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
            fetched = self._fetch(manifest, refs, needed)
            with self._write_lock():
                pause = self._commit(version, manifest, refs, fetched)
            del fetched
        except Exception as err:
            return self._reply(version, t0, err)
        return self._reply(
            version, t0, None, pause, len(needed), sum(manifest.bucket_nbytes[b] for b in needed)
        )

    async def receive_async(
        self, version: int, manifest: Manifest, refs: list[ray.ObjectRef]
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
                asyncio.gather(*[refs[b] for b in needed]), self.spec.fetch_timeout
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
            if self.spec.verify:
                require_checksums(manifest)  # NIXL versions carry none: refused, not taken unchecked
            with self._stage_lock:
                if self.version is not None and version <= self.version:
                    return {"applied": self.version, "skipped": version}
                bound = self._bound_for(manifest)
                if bound is None:
                    validate(manifest, module_schema(self.module()))
                    with self._write_lock():
                        bound = self.bound = BoundModel(self.module(), manifest)
                ids = _ids(refs)
                nbytes = receive_into(
                    bound, refs, ids, timeout=self.spec.fetch_timeout, extra_state=manifest.extra_state
                )
                with self._write_lock():
                    t1 = time.perf_counter()
                    if self.version is None or version > self.version:
                        bound.swap()
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
        with self._write_lock():
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
        info: dict[str, Any] | None = ray.get(
            self.hub.get.remote(self.spec.model_id, None, self.version or 0), timeout=timeout
        )
        if info is not None and "error" in info:
            return None  # nothing pushed yet
        return info

    def sync_newest(self, timeout: float | None) -> bool:
        if self.hub is None:
            return False
        info = self._newer(timeout)
        if info is None:
            return False
        reply = self.receive(info["version"], info["manifest"], info["refs"])
        self.hub.report.remote(self.sub_id, reply)
        if reply.get("error"):
            raise RaySyncError(f"raysync_sync could not apply version {info['version']}: {reply['error']}")
        return "skipped" not in reply

    async def sync_newest_async(self, timeout: float | None) -> bool:
        if self.hub is None:
            return False
        info = await asyncio.wait_for(
            self.hub.get.remote(self.spec.model_id, None, self.version or 0), timeout
        )
        if info is None or "error" in info:
            return False
        reply = await self.receive_async(info["version"], info["manifest"], info["refs"])
        self.hub.report.remote(self.sub_id, reply)
        if reply.get("error"):
            raise RaySyncError(f"raysync_sync could not apply version {info['version']}: {reply['error']}")
        return "skipped" not in reply


# ---------------------------------------------------------------------- locks


class _RWLock:
    """Readers (user methods) share; a writer (an apply) excludes them. Writers go first.

    A thread that holds read and asks to write (``raysync_sync`` called from a
    user method) steps out of its read while it writes, so it cannot deadlock
    with itself or with another thread doing the same.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0
        self._local = threading.local()

    def _depth(self) -> int:
        return int(getattr(self._local, "depth", 0))

    def held(self) -> bool:
        """Whether this thread is inside a guarded method already."""
        return self._depth() > 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        depth = self._depth()
        if depth == 0:
            with self._cond:
                while self._writer or self._waiting:
                    self._cond.wait()
                self._readers += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._readers -= 1
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        own = self._depth() > 0
        with self._cond:
            if own:
                self._readers -= 1
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
                if own:
                    while self._writer or self._waiting:
                        self._cond.wait()
                    self._readers += 1


_async_depth: contextvars.ContextVar[int] = contextvars.ContextVar("raysync_async_depth", default=0)


class _AsyncRWLock:
    """The asyncio twin of :class:`_RWLock` for async actors (one event loop)."""

    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._waiting = 0
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        depth = _async_depth.get()
        cond = self._condition()
        if depth == 0:
            async with cond:
                await cond.wait_for(lambda: not (self._writer or self._waiting))
                self._readers += 1
        token = _async_depth.set(depth + 1)
        try:
            yield
        finally:
            _async_depth.reset(token)
            if depth == 0:
                async with cond:
                    self._readers -= 1
                    cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        own = _async_depth.get() > 0
        cond = self._condition()
        async with cond:
            if own:
                self._readers -= 1
            self._waiting += 1
            try:
                await cond.wait_for(lambda: not (self._writer or self._readers))
            finally:
                self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with cond:
                self._writer = False
                cond.notify_all()
                if own:
                    await cond.wait_for(lambda: not (self._writer or self._waiting))
                    self._readers += 1


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

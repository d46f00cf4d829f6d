"""``@synced_model``: an actor class whose instances follow the hub.

``@synced_model("policy")`` on an actor class (under ``@ray.remote``) makes every
instance a subscriber of the hub: after ``__init__`` it registers and applies the
newest version; in push mode the hub then delivers each new version as an actor
call, applied *between* the actor's method calls.

Consistency: each user method runs under the read side of the actor's version lock
(:mod:`raysync.receivers.locks`) and an apply takes the write side, so a reader on a
threaded or async actor never sees two versions mixed.

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
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import ray

from raysync._checks import check_timeout
from raysync._protocol import DEFAULT_HUB, Announcement, ApplyReport
from raysync.core.placement import TensorParallel
from raysync.core.readonly import view_training_error
from raysync.errors import AmbiguousModelError, RaySyncError
from raysync.receivers.locks import AsyncRWLock, RWLock
from raysync.receivers.subscription import ApplyKind, Mode, SyncSpec, _Subscription, missing_attr

__all__ = ["synced_model"]


logger = logging.getLogger(__name__)


T = TypeVar("T")


_RAYSYNC_METHODS = {
    "raysync_version",
    "raysync_modified_since",
    "raysync_sync",
    "_raysync_notify",
    "_raysync_ping",
}


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
    allow_train_mode: bool = False,
    placement: TensorParallel | None = None,
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
        allow_train_mode: keep the module in training mode knowingly. Without
            it, a module registered in training mode with running statistics
            (BatchNorm, InstanceNorm with ``track_running_stats``) gets one
            warning saying to call ``.eval()`` on rollout actors, and the first
            change its code makes to the weights in place is logged. Either way
            such a change is reported (``raysync_modified_since()``).
        placement: the module holds only its own parts of the tensors, e.g.
            ``raysync.TensorParallel(1, 2, {"*.q_proj.weight": 0})`` for rank 1 of a
            2-way tensor-parallel actor: it fetches the buckets holding its parts (a
            sharded trainer's ranks' or one writer's) and copies only its parts, whatever
            the trainer's layout. NIXL versions of one writer (whole buffers) are refused,
            naming the tensors. ``apply="copy"`` without ``prefetch`` only.

    The class gains ``raysync_version(model_id=None) -> int | None`` and
    ``raysync_modified_since(model_id=None) -> int | None`` (callable remotely),
    and ``raysync_sync(timeout=None, model_id=None) -> bool`` (``async`` on
    async actors). On a class with several synced models, ``raysync_version``
    and ``raysync_modified_since`` need ``model_id``
    (:class:`raysync.AmbiguousModelError` without it).

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
    if placement is not None:
        if not isinstance(placement, TensorParallel):
            raise TypeError(f"placement must be a raysync.TensorParallel, got {type(placement).__name__}")
        if apply != "copy" or prefetch:
            raise ValueError(
                "placement= copies the module's own parts of each version: apply='copy' without prefetch"
            )
    spec = SyncSpec(
        attr,
        model_id,
        hub,
        namespace,
        mode,
        apply,
        bool(verify),
        float(fetch_timeout),
        bool(prefetch),
        bool(allow_train_mode),
        placement,
    )

    def decorate(cls: type[T]) -> type[T]:
        if not isinstance(cls, type):
            raise TypeError(
                f"@synced_model decorates a class, got {type(cls).__name__}; if that is a Ray "
                "actor class, put @ray.remote above @raysync.synced_model(...)"
            )
        return _synced_class(cls, spec)

    return decorate


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
        "raysync_modified_since": _raysync_modified_since,
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
        setattr(cls, name, _guarded(fn))
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
            if (missing := missing_attr(self, [s.attr for s in cls.__raysync_specs__])) is not None:
                raise TypeError(missing)  # here: the actor's creation error shows one frame
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


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a user method under the read side of the actor's version lock (see ``explained``)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            sync = _ActorSync.of(self)
            if sync is None:
                return await fn(self, *args, **kwargs)
            sync.loop = asyncio.get_running_loop()
            with sync.explained():
                async with sync.async_lock.read():
                    return await fn(self, *args, **kwargs)

        async_method.__raysync_guarded__ = True  # type: ignore[attr-defined]
        return async_method

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        sync = _ActorSync.of(self)
        if sync is None:
            return fn(self, *args, **kwargs)
        # A sync method of an async actor runs on its event loop: nothing interleaves with it.
        with sync.explained(), contextlib.nullcontext() if sync.is_async else sync.lock.read():
            return fn(self, *args, **kwargs)

    method.__raysync_guarded__ = True  # type: ignore[attr-defined]
    return method


def _raysync_version(self: Any, model_id: str | None = None) -> int | None:
    """The version of ``model_id`` this actor holds (``None`` before the first).

    ``None`` also after user code re-pointed the module's parameters (for example
    ``load_state_dict(..., assign=True)``, ``.double()``): the module then holds
    no version of the hub's, and in push mode the newest one is applied again.
    If the actor's own code changed the weights in place since the apply (a
    BatchNorm in training mode, an optimizer step), it still says the version
    applied, and ``raysync_modified_since()`` says it was changed since.

    Raises:
        AmbiguousModelError: no ``model_id`` on an actor that syncs several models.
    """
    sub = _checked(self, model_id, "raysync_version")
    return None if sub is None else sub.version


def _raysync_modified_since(self: Any, model_id: str | None = None) -> int | None:
    """The version held, if this actor's own code changed its weights in place since it was applied.

    ``None``: the module holds the version ``raysync_version()`` names exactly (or
    holds none). Otherwise the module is "modified locally since" that version: a
    module in training mode updated running statistics (BatchNorm's forward), an
    optimizer step or another in-place write changed a parameter or buffer. The
    next version applied clears it. Detection is exact for in-place writes through
    the module's tensors and costs one integer read per tensor; writes through
    ``tensor.data`` or raw memory (numpy views) are not seen. The hub learns of it
    within a heartbeat (2 s): ``status()`` shows ``modified_since`` per subscriber.

    Args:
        model_id: the model (needed on an actor that syncs several).

    Raises:
        AmbiguousModelError: no ``model_id`` on an actor that syncs several models.

    Example:
        >>> def rollout(self):
        ...     out = self.policy(obs)   # a BatchNorm left in training mode changes the weights
        ...     return out, self.raysync_version(), self.raysync_modified_since()   # (out, 3, 3)
    """
    sub = _checked(self, model_id, "raysync_modified_since")
    return None if sub is None else sub.modified_since()


def _checked(self: Any, model_id: str | None, method: str) -> _Subscription | None:
    """The subscription ``method`` asks of (None outside an actor), its binding checked."""
    sync = _ActorSync.of(self)
    if sync is None:
        return None
    sub = sync.subscription(model_id, method)
    sub.check_binding()
    return sub


def _raysync_ping(self: Any) -> bool:
    return True


def _raysync_notify(self: Any, announcement: Announcement) -> ApplyReport:
    """The hub hands this actor a version (push mode): apply it between method calls."""
    sync = _ActorSync.of(self)
    assert sync is not None, "notified before registration"
    a = announcement
    return sync.subscription(a.model_id).receive(a.version, a.manifest, list(a.refs), defer=True)


async def _raysync_notify_async(self: Any, announcement: Announcement) -> ApplyReport:
    sync = _ActorSync.of(self)
    assert sync is not None, "notified before registration"
    a = announcement
    return await sync.subscription(a.model_id).receive_async(a.version, a.manifest, list(a.refs))


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
    return any([sub.sync_newest(timeout) for sub in _to_sync(self, timeout, model_id)])


def _to_sync(self: Any, timeout: float | None, model_id: str | None) -> list[_Subscription]:
    """The subscriptions ``raysync_sync`` syncs (``timeout`` checked; none outside an actor)."""
    check_timeout(timeout)
    sync = _ActorSync.of(self)
    if sync is None:
        return []
    return [sync.subscription(model_id)] if model_id else list(sync.subs.values())


async def _raysync_sync_coroutine(self: Any, timeout: float | None, model_id: str | None) -> bool:
    results = [await sub.sync_newest_async(timeout) for sub in _to_sync(self, timeout, model_id)]
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
    return any([sub.sync_newest(timeout, on_loop=True) for sub in _to_sync(self, timeout, model_id)])


def _called_from_coroutine(frame: Any) -> bool:
    """Whether the nearest caller outside Ray is an ``async def`` (user code that will await).

    Ray wraps actor methods (tracing's ``_resume_span``, its sync-to-async wrapper);
    a remote call has no user frame at all, only Ray's and asyncio's.
    """
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("ray."):
        frame = frame.f_back
    return frame is not None and bool(frame.f_code.co_flags & inspect.CO_COROUTINE)


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
            sub.join(ctx)  # registers (waiting while the hub restarts), applies the newest

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """Torch's bare error for training ``apply="view"`` weights, raised as what it is."""
        try:
            yield
        except RuntimeError as err:
            views = [sub.spec.attr for sub in self.subs.values() if sub.spec.apply == "view"]
            clear = view_training_error(err, views)
            if clear is None:
                raise
            raise clear from err

    def subscription(self, model_id: str | None, method: str = "raysync_version") -> _Subscription:
        if model_id is None:
            if len(self.subs) > 1:
                models = sorted(self.subs)
                raise AmbiguousModelError(
                    f"{type(self.owner).__name__} syncs {len(models)} models ({models}): say which, "
                    f"e.g. self.{method}(model_id={models[0]!r})",
                    models=models,
                )
            return next(iter(self.subs.values()))
        try:
            return self.subs[model_id]
        except KeyError:
            raise RaySyncError(
                f"this actor does not sync model_id {model_id!r}; it syncs {sorted(self.subs)}"
            ) from None

"""One subscription of one actor to one model: how its versions reach its pipeline.

Its :class:`~raysync.receivers.pipeline.Applier` plans, fetches with no lock, verifies
and commits under the actor's write lock into the subscription's target: the module in
``self.<attr>`` (one ``copy_`` per changed bucket with ``apply="copy"``, a pointer swap
for ``"view"``, prefetched or NIXL versions), or a :class:`~raysync.receivers.target.Target`
held there (e.g. a :class:`~raysync.WeightsLoader`). A failed apply leaves the previous
version and is reported. An ``attr`` that holds neither is refused naming the attributes
that could be meant (:func:`missing_module_message`).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import ray
import torch

from raysync._protocol import Announcement, ApplyReport, Registration, Ring, SubscriberInfo
from raysync.core.bound import BoundModel
from raysync.core.extract import module_schema
from raysync.core.layout import Manifest
from raysync.core.placement import TensorParallel
from raysync.errors import RaySyncError, UnknownModelError
from raysync.receivers.local_changes import LocalChanges
from raysync.receivers.membership import membership
from raysync.receivers.pipeline import Applier, Prepared, skipped
from raysync.receivers.pull import PullSync
from raysync.receivers.target import ModuleTarget, Target, is_target
from raysync.transports.doorbell import Segment, doorbell

if TYPE_CHECKING:
    from raysync.receivers.synced import _ActorSync

__all__ = ["ApplyKind", "Mode", "SyncSpec", "missing_attr", "missing_module_message"]

logger = logging.getLogger(__name__)


Mode = Literal["push", "pull"]
ApplyKind = Literal["copy", "view"]


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
    allow_train_mode: bool = False
    placement: TensorParallel | None = None


class _Subscription(PullSync, LocalChanges):
    """One (actor, model_id): the version held, the binding of the module to a layout."""

    def __init__(self, sync: _ActorSync, spec: SyncSpec) -> None:
        self.sync = sync
        self.spec = spec
        self.sub_id = ""
        self._info: SubscriberInfo | None = None
        self.applier = Applier(
            self._resolve_target,
            verify=spec.verify,
            timeout=spec.fetch_timeout,
            label=f"self.{spec.attr} ({spec.model_id!r})",
            guard=self._write_lock,
        )
        self._prefetching = False
        self._offered: Announcement | None = None  # the newest version delivered for the prefetcher
        self._offer_cv = threading.Condition()
        self._deferred: asyncio.Task[None] | None = None  # an apply waiting for async methods to return
        # Threaded actors: a delivered version whose apply waits for running methods (see receive).
        self._defer_lock = threading.Lock()
        self._pending: Prepared | None = None
        self._applier: threading.Thread | None = None

    @property
    def version(self) -> int | None:
        """The version held (the pipeline's)."""
        return self.applier.version

    # -------------------------------------------------------------- registration
    def module(self) -> torch.nn.Module:
        module = getattr(self.sync.owner, self.spec.attr, None)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(missing_module_message(self.sync.owner, self.spec.attr))
        return module

    @property
    def bound(self) -> BoundModel | None:
        """The module's binding (``None`` for targets that are not modules, or before the first apply)."""
        target = self.applier.resolved
        return target.bound if isinstance(target, ModuleTarget) else None

    def _resolve_target(self) -> Target:
        held = getattr(self.sync.owner, self.spec.attr, None)
        if is_target(held):
            assert isinstance(held, Target)
            if self.spec.apply != "copy" or self.spec.prefetch or self.spec.placement:
                raise ValueError(
                    f"@synced_model({self.spec.attr!r}): self.{self.spec.attr} is a "
                    f"{type(held).__name__}, which takes versions through its own commit: "
                    "apply='view', prefetch=True and placement= are for modules; drop them"
                )
            return held
        self.module()  # raises, naming the attribute, if it holds neither
        return ModuleTarget(
            lambda: getattr(self.sync.owner, self.spec.attr, None),
            view=self.spec.apply == "view",
            label=f"self.{self.spec.attr}",
            placement=self.spec.placement,
        )

    # -------------------------------------------------------------- membership (a Member)
    @property
    def hub_name(self) -> str:
        return self.spec.hub

    @property
    def hub_namespace(self) -> str | None:
        return self.spec.namespace

    def join(self, ctx: Any) -> None:
        """Register with the hub (waiting while it restarts) and apply its newest version."""
        actor_id = ctx.get_actor_id()
        self.sub_id = f"{actor_id}:{self.spec.model_id}"
        self.applier.label = f"{self.sub_id} ({self.spec.model_id!r})"
        if isinstance(self.applier.target, ModuleTarget):
            self.warn_train_mode(type(self.sync.owner).__name__, self.module())
        self._info = SubscriberInfo(
            mode=self.spec.mode,
            apply=self.spec.apply,
            actor_id=actor_id,
            class_name=type(self.sync.owner).__name__,
            node_id=ctx.get_node_id(),
            pid=os.getpid(),
            attr=self.spec.attr,
            doorbell=self._doorbell(),
        )
        membership().serve(self, self.sync.owner)
        membership().join(self)
        if self.spec.prefetch and not self._prefetching:
            self.start_prefetch()

    def _doorbell(self) -> str | None:
        """Where the node's relay rings this subscription (small versions), if it can be rung.

        Push subscriptions on plain and threaded actors: the doorbell's thread applies
        under the actor's write lock. A view then looks into the sealed segment itself
        (read-only, as it would into the object store; the mapping lives as long as the
        view); a module holding parts copies them out of it. Async actors (their plain
        methods run unguarded on the event loop) and prefetching subscriptions are called.
        """
        spec = self.spec
        if self.sync.is_async or spec.mode != "push" or spec.prefetch:
            return None
        bell = doorbell()
        return None if bell is None else bell.register(self.sub_id, self.ring)

    def ring(self, ring: Ring, segment: Segment | None) -> ApplyReport:
        """The node's relay rang: apply the version it wrote into shared memory (the doorbell's thread).

        ``segment`` is None when a newer ring for this subscription came with it (or
        the segment is gone): nothing to do, a newer version is on its way.
        """
        if segment is None:
            return skipped(self.version, ring.version)
        self.check_binding()
        return self.applier.finish(
            self.applier.prepare(
                segment.version, segment.manifest, [], at_hand=segment.buckets, ids=segment.ids
            )
        )

    def registration(self) -> Registration:
        assert self._info is not None
        self._told_modified = None  # a hub that (re-)registers it knows nothing of local changes
        # the hub checks pushes against a whole module's schema; others check each version themselves
        whole = isinstance(self.applier.target, ModuleTarget) and self.spec.placement is None
        schema = module_schema(self.module()) if whole else None
        bell = doorbell() if self._info.doorbell else None
        return Registration(
            self.sub_id,
            self.spec.model_id,
            True,  # its process answers the hub's calls (receivers/poller.py)
            self._info,
            schema,
            self.version,
            doorbell_key=bell.key if bell is not None else None,
        )

    def start_from(self, newest: Announcement | None) -> None:
        if newest is not None:
            self.report(self.receive(newest.version, newest.manifest, list(newest.refs)))

    def report(self, report: ApplyReport) -> None:
        membership().report(self, report)

    # -------------------------------------------------------------- apply
    def check_binding(self) -> bool:
        """Whether the module still holds the version last applied; forget it if not.

        User code can re-point parameters (``load_state_dict(sd, assign=True)``,
        ``module.double()``, ``module.to(...)``, replacing a submodule); applies
        would then go into buffers the module no longer uses. When that happened,
        the subscription holds no version (``raysync_version()`` is ``None``), the
        next apply binds the module afresh, and in push mode the hub is asked to
        deliver the newest version again.
        """
        forgot, held = self.applier.forget_if_torn()
        if not forgot:
            return True
        logger.warning(
            "%s: the parameters of self.%s were re-pointed by user code (load_state_dict(assign=True), "
            ".to(), .double(), a replaced submodule, ...): it no longer holds version %s of %r; %s",
            self.sub_id,
            self.spec.attr,
            held,
            self.spec.model_id,
            "the newest is applied again" if self.spec.mode == "push" else "raysync_sync() applies it",
        )
        if self._info is not None and held is not None:
            why = RaySyncError(f"parameters re-pointed by user code: version {held} no longer held")
            self.report(ApplyReport(reset=True, error=why))
        return False

    def receive(
        self,
        version: int,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        *,
        fetch_timeout: float | None = None,
        defer: bool = False,
    ) -> ApplyReport:
        """Fetch, validate and apply a version (threads and plain actors).

        With ``defer`` (the hub's delivery), a threaded actor whose methods do not
        end within the lock's priority window gets the apply done by a raysync
        thread once they end (reported to the hub then), so the delivery call does
        not hold one of the actor's concurrency slots meanwhile.
        """
        self.check_binding()
        if self.spec.prefetch:
            swapped = self.swap_if_staged(version)
            if swapped is not None:
                return swapped
            if defer and self._prefetching and self.applier.stages(manifest):
                # The prefetcher stages it and swaps it in between method calls (and reports
                # then): the hub's call must not fetch it a second time meanwhile.
                with self._offer_cv:
                    if self._offered is None or version > self._offered.version:
                        self._offered = Announcement(self.spec.model_id, version, manifest, tuple(refs))
                    self._offer_cv.notify_all()
                return ApplyReport(applied=self.version, deferred=version)
        step = self.applier.prepare(version, manifest, refs, timeout=fetch_timeout)
        if isinstance(step, ApplyReport):
            return step
        lock = self.sync.lock
        if not defer or self.sync.is_async or lock.held():
            return self.applier.commit(step)
        if not lock.try_write():
            self._defer(step)
            return ApplyReport(applied=self.version, deferred=version)
        try:
            return self.applier.commit(step, guard=contextlib.nullcontext)
        finally:
            lock.release_write()

    def _defer(self, step: Prepared) -> None:
        """Hand an apply to the applier thread (the newest deferred version wins)."""
        with self._defer_lock:
            if self._pending is None or step.version > self._pending.version:
                self._pending = step
            if self._applier is None:
                self._applier = threading.Thread(
                    target=self._apply_deferred, name=f"raysync-apply-{self.spec.model_id}", daemon=True
                )
                self._applier.start()

    def _apply_deferred(self) -> None:
        while True:
            with self._defer_lock:
                step, self._pending = self._pending, None
                if step is None:
                    self._applier = None
                    return
            self.report(self.applier.commit(step, guard=self.sync.lock.write))

    async def receive_async(
        self,
        version: int,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        *,
        fetch_timeout: float | None = None,
    ) -> ApplyReport:
        """Same as :meth:`receive` for async actors: waits without blocking the event loop."""
        self.sync.loop = asyncio.get_running_loop()
        self.check_binding()
        return await self.applier.apply_async(
            version, manifest, refs, guard=self.sync.async_lock.write, timeout=fetch_timeout
        )

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

    def _next_to_prefetch(self, known: int) -> Announcement | None:
        """A version newer than ``known`` to stage, within 30 s (``None``: none came). In push mode
        the node's delivery hands it over (:meth:`receive`), as it hands every version to every
        receiver; a pull subscription asks the hub (pull is how it learns of versions)."""
        if self.spec.mode == "push":
            with self._offer_cv:
                self._offer_cv.wait_for(
                    lambda: self._offered is not None and self._offered.version > known, timeout=30.0
                )
                offered, self._offered = self._offered, None
            return offered if offered is not None and offered.version > known else None
        return membership().calls(self, timeout=90).wait_newer(self.spec.model_id, known, 30.0)

    def _prefetch_loop(self) -> None:
        """Background: wait for a newer version, copy its changed buckets into the spare buffers."""
        known = self.version or 0
        while True:
            try:
                info = self._next_to_prefetch(known)
            except UnknownModelError:  # a restarted hub that kept nothing yet
                time.sleep(1.0)
                continue
            except Exception as err:  # hub restarting or unreachable: try again shortly
                logger.debug(
                    "%s prefetch of %r after version %d: %s", self.sub_id, self.spec.model_id, known, err
                )
                time.sleep(1.0)
                continue
            if info is None:
                continue
            known = max(known, info.version)
            try:
                with self.applier.stage_lock:
                    staged = self.applier.stage(info.version, info.manifest, list(info.refs))
                    if staged and self.spec.mode == "push":
                        # The write lock is granted between method calls: that is the safe point.
                        reply = self.applier.swap_staged()
                        if reply is not None:
                            self.report(reply)
            except Exception as err:
                logger.warning(
                    "%s could not prefetch %r version %d: %s",
                    self.sub_id,
                    self.spec.model_id,
                    info.version,
                    err,
                )

    def swap_if_staged(self, version: int) -> ApplyReport | None:
        """Before fetching ``version`` the slow way: take it from the prefetcher if it has it.

        Returns a reply if this subscriber now holds ``version`` (or newer), else None.
        """
        # Inside a user method (raysync_sync) the prefetcher may be waiting for our read to
        # end: never block on it from there.
        if not self.applier.stage_lock.acquire(blocking=not self.sync.lock.held()):
            return None
        try:
            reply = self.applier.swap_staged()
        finally:
            self.applier.stage_lock.release()
        if self.version is not None and self.version >= version:
            return reply or skipped(self.version, version)
        return None


def missing_module_message(owner: Any, attr: str) -> str:
    """Why ``owner.<attr>`` cannot be synced, naming the attributes that could, closest first.

    Example:
        >>> class Actor:
        ...     def __init__(self):
        ...         self.policy = torch.nn.Linear(2, 2)
        >>> missing_module_message(Actor(), "polcy")[:78]
        "@synced_model(attr='polcy'): self.polcy is missing; did you mean attr='policy'"
    """
    held = getattr(owner, attr, None)
    candidates = sorted(
        name
        for name, value in vars(owner).items()
        if not name.startswith("_raysync") and (isinstance(value, torch.nn.Module) or is_target(value))
    )
    close = difflib.get_close_matches(attr, candidates, n=1, cutoff=0.5)
    found = "is missing" if not hasattr(owner, attr) else f"holds a {type(held).__name__} object"
    hint = (
        f"; did you mean attr={close[0]!r}?"
        if close
        else f"; the actor's modules: {candidates}"
        if candidates
        else "; the actor holds no nn.Module attribute"
    )
    return (
        f"@synced_model(attr={attr!r}): self.{attr} {found}{hint} It must hold the nn.Module (or a "
        f"raysync Target such as a WeightsLoader) once __init__ returns; the first positional argument "
        "of @synced_model is that attribute's name (model_id= names the model)"
    )


def missing_attr(owner: Any, attrs: Iterable[str]) -> str | None:
    """The :func:`missing_module_message` of the first of ``attrs`` holding no module or target, or None.

    The actor's ``__init__`` raises it as a ``TypeError`` itself, before anything registers,
    so that the actor's creation error is this message after one frame of traceback.
    """
    for attr in attrs:
        held = getattr(owner, attr, None)
        if not isinstance(held, torch.nn.Module) and not is_target(held):
            return missing_module_message(owner, attr)
    return None

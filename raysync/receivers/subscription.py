"""One subscription of one actor to one model: the version held, how it is applied.

The steps are :mod:`raysync.receivers.apply`'s (plan, fetch with no lock, verify,
commit under the actor's write lock) into the subscription's target: the module in
``self.<attr>`` (one ``copy_`` per changed bucket with ``apply="copy"``, a pointer swap
for ``"view"``, prefetched or NIXL versions), or a :class:`~raysync.receivers.target.Target`
held there (e.g. a :class:`~raysync.WeightsLoader`). A failed apply leaves the previous
version and is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import ray
import torch

from raysync import _protocol as proto
from raysync._protocol import Announcement, ApplyReport, Registration, Ring, SubscriberInfo, bucket_ids
from raysync.core.bound import BoundModel
from raysync.core.codec import require_checksums
from raysync.core.extract import module_schema
from raysync.core.layout import Manifest
from raysync.core.shards import TensorParallel
from raysync.errors import RaySyncError, UnknownModelError
from raysync.receivers import apply
from raysync.receivers.attr_hint import missing_module_message
from raysync.receivers.local_changes import LocalChanges
from raysync.receivers.membership import membership
from raysync.receivers.pull import PullSync
from raysync.receivers.target import ModuleTarget, Target, is_target
from raysync.transports.doorbell import Segment, doorbell
from raysync.transports.registry import info as transport_info
from raysync.transports.registry import transport_class

if TYPE_CHECKING:
    from raysync.receivers.synced import _ActorSync

__all__ = ["ApplyKind", "Mode", "SyncSpec"]

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


_Fetched = tuple[int, Manifest, list[ray.ObjectRef], dict[int, Any], list[int], float]
"""A fetched version waiting for its apply: version, manifest, refs, buckets, their indices, start time."""


class _Subscription(PullSync, LocalChanges):
    """One (actor, model_id): the version held, the binding of the module to a layout."""

    def __init__(self, sync: _ActorSync, spec: SyncSpec) -> None:
        self.sync = sync
        self.spec = spec
        self.version: int | None = None
        self.target: Target | None = None  # the module's ModuleTarget, or the Target in self.<attr>
        self.sub_id = ""
        self._info: SubscriberInfo | None = None
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
            raise TypeError(missing_module_message(self.sync.owner, self.spec.attr))
        return module

    @property
    def bound(self) -> BoundModel | None:
        """The module's binding (``None`` for targets that are not modules, or before the first apply)."""
        return self.target.bound if isinstance(self.target, ModuleTarget) else None

    def _target(self) -> Target:
        if self.target is None:
            held = getattr(self.sync.owner, self.spec.attr, None)
            if is_target(held):
                assert isinstance(held, Target)
                if self.spec.apply != "copy" or self.spec.prefetch or self.spec.placement:
                    raise ValueError(
                        f"@synced_model({self.spec.attr!r}): self.{self.spec.attr} is a "
                        f"{type(held).__name__}, which takes versions through its own commit: "
                        "apply='view', prefetch=True and placement= are for modules; drop them"
                    )
                self.target = held
            else:
                self.module()  # raises, naming the attribute, if it holds neither
                self.target = ModuleTarget(
                    lambda: getattr(self.sync.owner, self.spec.attr, None),
                    view=self.spec.apply == "view",
                    label=f"self.{self.spec.attr}",
                    placement=self.spec.placement,
                )
        assert self.target is not None
        return self.target

    def _module_target(self, why: str) -> ModuleTarget:
        target = self._target()
        if not isinstance(target, ModuleTarget):
            raise RaySyncError(f"{self.sub_id}: {why} needs self.{self.spec.attr} to be an nn.Module")
        return target

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
        if isinstance(self._target(), ModuleTarget):
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
        t0 = time.perf_counter()
        if segment is None:
            return self._skipped(ring.version)
        version, manifest = segment.version, segment.manifest
        try:
            needed = self._plan(version, manifest, segment.ids)
            if needed is None:
                return self._skipped(version)
            target, verify = self._target(), self.spec.verify
            fetched = apply.at_hand(target, manifest, segment.buckets, needed, verify=verify)
            with self._write_lock():
                pause = self._commit(version, manifest, segment.ids, fetched)
            del fetched
        except Exception as err:
            return self._reply(version, t0, err)
        return self._reply(version, t0, None, pause, len(needed), apply.nbytes(manifest, needed, self.target))

    def registration(self) -> Registration:
        assert self._info is not None
        self._told_modified = None  # a hub that (re-)registers it knows nothing of local changes
        # the hub checks pushes against a whole module's schema; others check each version themselves
        whole = isinstance(self._target(), ModuleTarget) and self.spec.placement is None
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
        with self._binding_lock:
            target = self.target
            if target is None or target.intact():
                return True
            held, self.version = self.version, None
            target.forget()
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
        if self._info is not None and held is not None:
            why = RaySyncError(f"parameters re-pointed by user code: version {held} no longer held")
            self.report(ApplyReport(reset=True, error=why))
        return False

    def _plan(self, version: int, manifest: Manifest, ids: list[str | None]) -> list[int] | None:
        """Validate before fetching; the buckets to fetch, or None if the version is not newer."""
        self.check_binding()
        return apply.plan(self._target(), version, manifest, ids, self.version)

    def _fetch(
        self, manifest: Manifest, refs: list[ray.ObjectRef], needed: list[int], timeout: float | None = None
    ) -> dict[int, Any]:
        timeout = self.spec.fetch_timeout if timeout is None else timeout
        return apply.fetch(
            manifest, refs, needed, timeout=timeout, verify=self.spec.verify, target=self._target()
        )

    def _commit(
        self, version: int, manifest: Manifest, ids: list[str | None], fetched: dict[int, Any]
    ) -> float:
        """Apply fetched buckets; return the pause (seconds readers waited). Caller holds the write lock."""
        t0 = time.perf_counter()
        with self._binding_lock:
            if self.version is not None and version <= self.version:
                return 0.0  # a newer one got in first
            target = self._target()
            if not target.intact():  # re-pointed since the fetch was planned
                self.version = None
                target.forget()
            try:
                apply.commit(target, version, manifest, ids, fetched)
            except BaseException:
                if not target.intact():  # a commit that failed part-way: it holds nothing known
                    self.version = None
                    target.forget()
                raise
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
    ) -> ApplyReport:
        elapsed = time.perf_counter() - t0
        if error is None:
            logger.debug(
                "%s applied %r version %d in %.4f s (pause %.4f s)",
                *(self.sub_id, self.spec.model_id, version, elapsed, pause),
            )
            return ApplyReport(
                applied=self.version,
                apply_s=elapsed,
                pause_s=pause,
                buckets_fetched=fetched,
                bytes_fetched=fetched_bytes,
            )
        logger.warning(
            "%s failed to apply %r version %d, keeps version %s: %s",
            self.sub_id,
            self.spec.model_id,
            version,
            self.version,
            error,
        )
        return apply.failed(version, self.version, error)

    def _skipped(self, version: int) -> ApplyReport:
        return apply.skipped(self.version, version)

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
        t0 = time.perf_counter()
        if transport_info(manifest.transport).in_place:
            return self._receive_in_place(version, manifest, refs, t0)
        try:
            if self.spec.prefetch:
                swapped = self.swap_if_staged(version)
                if swapped is not None:
                    return swapped
                if defer and self._prefetching and self._stages(manifest):
                    # The prefetcher stages it and swaps it in between method calls (and reports
                    # then): the hub's call must not fetch it a second time meanwhile.
                    return ApplyReport(applied=self.version, deferred=version)
            needed = self._plan(version, manifest, bucket_ids(refs))
            if needed is None:
                return self._skipped(version)
            fetched = self._fetch(manifest, refs, needed, fetch_timeout)
            lock = self.sync.lock
            if defer and not self.sync.is_async and not lock.held():
                if not lock.try_write():
                    self._defer((version, manifest, refs, fetched, needed, t0))
                    return ApplyReport(applied=self.version, deferred=version)
                try:
                    pause = self._commit(version, manifest, bucket_ids(refs), fetched)
                finally:
                    lock.release_write()
            else:
                with self._write_lock():
                    pause = self._commit(version, manifest, bucket_ids(refs), fetched)
            del fetched
        except Exception as err:
            return self._reply(version, t0, err)
        return self._reply(version, t0, None, pause, len(needed), apply.nbytes(manifest, needed, self.target))

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
                    pause = self._commit(version, manifest, bucket_ids(refs), fetched)
                fetched_bytes = apply.nbytes(manifest, needed, self.target)
                reply = self._reply(version, t0, None, pause, len(needed), fetched_bytes)
            except Exception as err:
                reply = self._reply(version, t0, err)
            del item, fetched
            self.report(reply)

    async def receive_async(
        self,
        version: int,
        manifest: Manifest,
        refs: list[ray.ObjectRef],
        *,
        fetch_timeout: float | None = None,
    ) -> ApplyReport:
        """Same as :meth:`receive` for async actors: waits without blocking the event loop."""
        t0 = time.perf_counter()
        self.sync.loop = asyncio.get_running_loop()
        if transport_info(manifest.transport).in_place:
            return await asyncio.to_thread(self._receive_in_place, version, manifest, refs, t0)
        try:
            needed = self._plan(version, manifest, bucket_ids(refs))
            if needed is None:
                return self._skipped(version)
            timeout = self.spec.fetch_timeout if fetch_timeout is None else fetch_timeout
            verify = self.spec.verify
            fetched = await apply.fetch_async(
                manifest, refs, needed, timeout=timeout, verify=verify, target=self._target()
            )
            async with self.sync.async_lock.write():
                pause = self._commit(version, manifest, bucket_ids(refs), fetched)
            del fetched
        except Exception as err:
            return self._reply(version, t0, err)
        return self._reply(version, t0, None, pause, len(needed), apply.nbytes(manifest, needed, self.target))

    def _receive_in_place(
        self, version: int, manifest: Manifest, refs: list[ray.ObjectRef], t0: float
    ) -> ApplyReport:
        """A path that receives in place (NIXL): into the spare buffer set, then swapped in under
        the write lock."""
        try:
            if self.spec.apply != "copy":
                raise RaySyncError(
                    f"{self.sub_id}: apply={self.spec.apply!r} needs the object store; this version came "
                    f"over {manifest.transport!r} (push with transport='object_store' or use apply='copy')"
                )
            target = self._module_target(f"a version that came over {manifest.transport!r}")
            self.check_binding()
            if self.spec.verify:
                require_checksums(manifest)  # such versions carry none: refused, not taken unchecked
            with self._stage_lock:
                if self.version is not None and version <= self.version:
                    return self._skipped(version)
                bound = target.binding(manifest)
                if bound is None:
                    target.check(manifest)
                    with self._write_lock(), self._binding_lock:
                        bound = target.bind(manifest)
                ids = bucket_ids(refs)
                nbytes = transport_class(manifest.transport).receive_into(
                    bound, refs, ids, timeout=self.spec.fetch_timeout, extra_state=manifest.extra_state
                )
                with self._write_lock(), self._binding_lock:
                    t1 = time.perf_counter()
                    if target.bound is bound and (self.version is None or version > self.version):
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
                info = membership().call(self, proto.WAIT_NEWER, self.spec.model_id, known, 30.0, timeout=90)
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
            version, manifest, refs = info.version, info.manifest, list(info.refs)
            known = max(known, version)
            if transport_info(manifest.transport).in_place:
                continue  # received straight into the spare set anyway
            try:
                with self._stage_lock:
                    target = self.target
                    bound = target.binding(manifest) if isinstance(target, ModuleTarget) else None
                    if bound is None or (self.version is not None and version <= self.version):
                        continue  # first version or a new layout: the normal path binds it
                    ids = bucket_ids(refs)
                    needed = bound.needed(ids, staging=True)
                    fetched = self._fetch(manifest, refs, needed)
                    bound.stage(fetched, ids, extra_state=manifest.extra_state)
                    self._staged = (version, ids, sum(manifest.bucket_nbytes[b] for b in needed))
                    del fetched
                    if self.spec.mode == "push":
                        # The write lock is granted between method calls: that is the safe point.
                        reply = self._swap_staged()
                        if reply is not None:
                            self.report(reply)
            except Exception as err:
                logger.warning(
                    "%s could not prefetch %r version %d: %s", self.sub_id, self.spec.model_id, version, err
                )

    def _swap_staged(self) -> ApplyReport | None:
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
        return ApplyReport(
            applied=self.version, apply_s=pause, pause_s=pause, prefetched=True, bytes_fetched=staged[2]
        )

    def _stages(self, manifest: Manifest) -> bool:
        """Whether the prefetcher takes this version (a layout it is bound to; not the first)."""
        target = self.target
        return isinstance(target, ModuleTarget) and target.binding(manifest) is not None

    def swap_if_staged(self, version: int) -> ApplyReport | None:
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
            return reply or self._skipped(version)
        return None

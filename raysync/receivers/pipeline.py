"""One receiver's pipeline: :class:`Applier` owns the target, the version held and its guard.

Every receiver applies versions through one: ``@synced_model`` subscriptions (push, pull,
doorbell, async, deferred; ``RayModuleTransform`` hosts are one), :class:`~raysync.Follower`
and what it feeds (a :class:`~raysync.WeightsLoader`, a vLLM engine), adapters (their
receivers are one target), torchrl's receivers and strategy. The steps, in one order:
:meth:`Applier.prepare` plans (:func:`plan`: not newer than the version held, skip; else the
target checks the manifest, so a misfit is refused naming the tensor before any byte is
fetched, and says which buckets it lacks), fetches those (or takes them from buckets at
hand: a doorbell segment) through the version's data path (:mod:`raysync.transports.fetch`,
which a trainer's ``pull`` takes bytes through too) and verifies; :meth:`Applier.commit` has
the target take it whole (:func:`commit`) under the receiver's guard and reports
(:func:`failed`, :func:`skipped` for a version not applied). Receivers whose commit must wait (a
threaded actor's running methods, an async actor's loop) hand on the :class:`Prepared`
version. A version over a data path that receives in place (NIXL) and a prefetcher's
staged copy are swapped into the module's spare buffer set here, never by a receiver.

Example:
    >>> applier = Applier(ModuleTarget(policy), verify=False, timeout=30, label="evaluator")
    >>> applier.apply(ann.version, ann.manifest, list(ann.refs)).applied  # doctest: +SKIP
    4
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ObjectLostError

from raysync._protocol import ApplyReport, bucket_ids
from raysync.core.codec import require_checksums
from raysync.core.layout import Manifest
from raysync.errors import ApplyError, RaySyncError
from raysync.receivers.target import Incoming, ModuleTarget, Target
from raysync.transports import fetch
from raysync.transports.fetch import Verify, view
from raysync.transports.registry import info as transport_info
from raysync.transports.registry import transport_class

__all__ = ["Applier", "Prepared", "commit", "failed", "plan", "portable", "skipped"]

logger = logging.getLogger(__name__)

Guard = Callable[[], AbstractContextManager[Any]]


@dataclass
class Prepared:
    """A version fetched and verified, waiting for its commit (:meth:`Applier.commit`)."""

    version: int
    manifest: Manifest
    ids: list[str | None]
    fetched: dict[int, Any]
    needed: list[int]
    t0: float


class Applier:
    """A receiver's pipeline: its target, the version it holds, its guard, verification and timeout.

    Args:
        target: the target, or a callable returning it (asked once, at first use).
        verify: checksums to check (:data:`~raysync.transports.fetch.Verify`).
        timeout: seconds a fetch may take (a call may pass its own).
        label: who this is, in logs.
        guard: entered around every commit (the receiver's write lock: readers wait for the
            commit, never for a fetch).
    """

    def __init__(
        self,
        target: Target | Callable[[], Target],
        *,
        verify: Verify,
        timeout: float | None,
        label: str,
        guard: Guard = contextlib.nullcontext,
    ) -> None:
        self._resolve: Callable[[], Target] | None = None
        self._target: Target | None = None
        if isinstance(target, Target):
            self._target = target
        else:
            self._resolve = target
        self.verify, self.timeout, self.label, self.guard = verify, timeout, label, guard
        self._version: int | None = None
        self.held = threading.Condition()  # notified whenever the version held changes
        # Held while the binding or the version changes and while they are checked: a commit and a
        # check from another thread (heartbeat, raysync_version) never interleave.
        self.lock = threading.Lock()
        self.stage_lock = threading.Lock()  # the spare buffer set (prefetch staging, in-place receives)
        self._staged: tuple[int, int] | None = None  # (version, bytes) staged by the prefetcher

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int | None:
        """The version the target holds whole (``None``: none)."""
        return self._version

    @version.setter
    def version(self, version: int | None) -> None:
        with self.held:
            self._version = version
            self.held.notify_all()

    @property
    def next_version(self) -> int:
        """The number of the next version, for receivers that count their own (torchrl's schemes)."""
        return (self._version or 0) + 1

    @property
    def target(self) -> Target:
        """The target (resolved at first use)."""
        if self._target is None:
            assert self._resolve is not None
            self._target = self._resolve()
        return self._target

    @property
    def resolved(self) -> Target | None:
        """The target if it was resolved yet, else None (nothing is asked)."""
        return self._target

    def forget_if_torn(self) -> tuple[bool, int | None]:
        """If user code or a torn load undid what the target held, hold nothing.

        Returns:
            ``(forgot, held)``: whether it forgot, and the version it held before.
        """
        with self.lock:
            target = self._target
            if target is None or target.intact():
                return False, self._version
            held, self.version = self._version, None
            target.forget()
            self._staged = None
        return True, held

    # ------------------------------------------------------------------ the steps
    def prepare(
        self,
        version: int,
        manifest: Manifest,
        refs: list[Any],
        *,
        timeout: float | None = None,
        at_hand: list[Any] | None = None,
        ids: list[str | None] | None = None,
        on_loop: bool = False,
    ) -> Prepared | ApplyReport:
        """Plan, fetch and verify ``version``: what :meth:`commit` takes, or the report if it ends here.

        ``at_hand``: the version's whole buckets, already here (a doorbell segment; ``ids``
        then names them). A version over a data path that receives in place is received,
        swapped in and reported here (:meth:`receive_in_place`), or, with ``on_loop`` (called on
        an async actor's event loop, whose lock that swap cannot take from here), refused.
        """
        t0 = time.perf_counter()
        if at_hand is None and transport_info(manifest.transport).in_place:
            if not on_loop:
                return self.receive_in_place(version, manifest, refs, t0)
            why = (
                f"a version that came over {manifest.transport!r} (received in place) cannot be applied "
                "from a plain method of an async actor: call `await self.raysync_sync()` from an async method"
            )
            return self.report(version, t0, RaySyncError(why))
        ids = bucket_ids(refs) if ids is None else ids
        try:
            needed = self._plan(version, manifest, ids)
            if needed is None:
                return skipped(self.version, version)
            if at_hand is not None:
                fetched = fetch.at_hand(self.target, manifest, at_hand, needed, verify=self.verify)
            else:
                timeout = self.timeout if timeout is None else timeout
                fetched = fetch.fetch(
                    manifest, refs, needed, timeout=timeout, verify=self.verify, target=self.target
                )
        except Exception as err:
            return self.report(version, t0, err)
        return Prepared(version, manifest, ids, fetched, needed, t0)

    async def prepare_async(
        self, version: int, manifest: Manifest, refs: list[Any], *, timeout: float | None = None
    ) -> Prepared | ApplyReport:
        """:meth:`prepare` on an event loop: the fetch waits without blocking it."""
        t0 = time.perf_counter()
        if transport_info(manifest.transport).in_place:
            return await asyncio.to_thread(self.receive_in_place, version, manifest, refs, t0)
        ids = bucket_ids(refs)
        try:
            needed = self._plan(version, manifest, ids)
            if needed is None:
                return skipped(self.version, version)
            timeout = self.timeout if timeout is None else timeout
            fetched = await fetch.fetch_async(
                manifest, refs, needed, timeout=timeout, verify=self.verify, target=self.target
            )
        except Exception as err:
            return self.report(version, t0, err)
        return Prepared(version, manifest, ids, fetched, needed, t0)

    def _plan(self, version: int, manifest: Manifest, ids: list[str | None]) -> list[int] | None:
        self.forget_if_torn()
        return plan(self.target, version, manifest, ids, self.version)

    def commit(self, prepared: Prepared, *, guard: Guard | None = None) -> ApplyReport:
        """The target takes ``prepared`` whole under ``guard`` (default: the receiver's); the report."""
        size = fetch.nbytes(prepared.manifest, prepared.needed, self._target, prepared.fetched)
        try:
            with (guard or self.guard)():
                pause = self._commit(prepared)
        except Exception as err:
            return self.report(prepared.version, prepared.t0, err)
        finally:
            prepared.fetched = {}
        return self.report(prepared.version, prepared.t0, None, pause, len(prepared.needed), size)

    def _commit(self, prepared: Prepared) -> float:
        t0 = time.perf_counter()
        with self.lock:
            if self._version is not None and prepared.version <= self._version:
                return 0.0  # a newer one got in first
            target = self.target
            if not target.intact():  # re-pointed since the fetch was planned
                self.version = None
                target.forget()
            try:
                commit(target, prepared.version, prepared.manifest, prepared.ids, prepared.fetched)
            except BaseException:
                if not target.intact():  # a commit that failed part-way: it holds nothing known
                    self.version = None
                    target.forget()
                raise
            self.version = prepared.version
        return time.perf_counter() - t0

    def finish(self, step: Prepared | ApplyReport) -> ApplyReport:
        """:meth:`commit` a prepared version under the receiver's guard; a report passes through."""
        return step if isinstance(step, ApplyReport) else self.commit(step)

    def take(
        self,
        manifest: Manifest,
        buckets: list[Any],
        *,
        ids: list[str | None] | None = None,
        version: int | None = None,
    ) -> ApplyReport:
        """A version whose whole buckets are here (sent over a channel, packed locally): checked, committed.

        ``version`` defaults to the next after the one held (receivers fed by torchrl's
        schemes count their own).
        """
        version = self.next_version if version is None else version
        ids = [None] * manifest.num_buckets if ids is None else ids
        return self.finish(self.prepare(version, manifest, [], at_hand=buckets, ids=ids))

    def from_flat(
        self, manifest: Manifest, flat: list[Any], *, adopt: bool, version: int | None = None
    ) -> ApplyReport:
        """A version in flat buckets (a shared snapshot): copied out of them, one ``copy_`` per
        bucket for a bound module; or, with ``adopt`` (the transport keeps them), a module's
        tensors point into them (no copy). Other targets and view modules always copy.
        """
        version = self.next_version if version is None else version
        target = self.target
        if not adopt or not isinstance(target, ModuleTarget) or target.view:
            buckets = [
                [flat[b][e.offset : e.offset + e.nbytes].numpy() for e in manifest.bucket_entries(b)]
                for b in range(manifest.num_buckets)
            ]
            return self.take(manifest, buckets, version=version)
        t0 = time.perf_counter()
        try:
            target.check(manifest)
            with self.guard(), self.lock:
                t1 = time.perf_counter()
                binding = target.binding(manifest) or target.bind(manifest)
                binding.adopt(flat, extra_state=manifest.extra_state)
                self.version = version
                pause = time.perf_counter() - t1
        except Exception as err:
            return self.report(version, t0, err)
        return self.report(version, t0, None, pause, manifest.num_buckets, 0)

    def apply(
        self, version: int, manifest: Manifest, refs: list[Any], *, timeout: float | None = None
    ) -> ApplyReport:
        """Plan, fetch, verify and commit ``version``; the report (failures reported, never raised)."""
        return self.finish(self.prepare(version, manifest, refs, timeout=timeout))

    async def apply_async(
        self,
        version: int,
        manifest: Manifest,
        refs: list[Any],
        *,
        guard: Callable[[], AbstractAsyncContextManager[Any]],
        timeout: float | None = None,
    ) -> ApplyReport:
        """:meth:`apply` on an event loop; ``guard`` an async context manager factory (the loop's lock)."""
        step = await self.prepare_async(version, manifest, refs, timeout=timeout)
        return step if isinstance(step, ApplyReport) else await self.commit_async(step, guard)

    async def commit_async(
        self, step: Prepared, guard: Callable[[], AbstractAsyncContextManager[Any]]
    ) -> ApplyReport:
        """:meth:`commit` on an event loop, under ``guard`` (an async context manager factory)."""
        try:
            async with guard():
                return self.commit(step, guard=contextlib.nullcontext)
        except Exception as err:
            return self.report(step.version, step.t0, err)

    def report(
        self,
        version: int,
        t0: float,
        error: BaseException | None,
        pause: float = 0.0,
        fetched: int = 0,
        fetched_bytes: int = 0,
    ) -> ApplyReport:
        """The report of ``version``: applied (the version held now), or failed (``error``)."""
        elapsed = time.perf_counter() - t0
        if error is None:
            logger.debug(
                "%s applied version %d in %.4f s (pause %.4f s)", self.label, version, elapsed, pause
            )
            return ApplyReport(
                applied=self.version,
                apply_s=elapsed,
                pause_s=pause,
                buckets_fetched=fetched,
                bytes_fetched=fetched_bytes,
            )
        logger.warning(
            "%s could not apply version %d, keeps version %s: %s", self.label, version, self.version, error
        )
        return failed(version, self.version, error)

    # ------------------------------------------------------------------ in place, staged
    def _spare_set(self, transport: str) -> ModuleTarget:
        target = self.target
        if isinstance(target, ModuleTarget) and target.view:
            raise RaySyncError(
                f"{self.label}: apply='view' needs the object store; this version came over {transport!r} "
                "(push with transport='object_store' or use apply='copy')"
            )
        if not isinstance(target, ModuleTarget):
            raise RaySyncError(
                f"{self.label}: a version that came over {transport!r} is received in place into a "
                "module's spare buffer set: it needs an nn.Module (push with transport='object_store')"
            )
        return target

    def receive_in_place(self, version: int, manifest: Manifest, refs: list[Any], t0: float) -> ApplyReport:
        """A path that receives in place (NIXL): into the spare buffer set, swapped in under the guard."""
        try:
            target = self._spare_set(manifest.transport)
            self.forget_if_torn()
            if self.verify:
                require_checksums(manifest)  # such versions carry none: refused, not taken unchecked
            with self.stage_lock:
                if self._version is not None and version <= self._version:
                    return skipped(self._version, version)
                bound = target.binding(manifest)
                if bound is None:
                    target.check(manifest)
                    with self.guard(), self.lock:
                        bound = target.bind(manifest)
                nbytes = transport_class(manifest.transport).receive_into(
                    bound, refs, bucket_ids(refs), timeout=self.timeout, extra_state=manifest.extra_state
                )
                with self.guard(), self.lock:
                    t1 = time.perf_counter()
                    if target.bound is bound and (self._version is None or version > self._version):
                        bound.swap()  # re-points every parameter: whole whatever they pointed at
                        self.version = version
                    pause = time.perf_counter() - t1
        except Exception as err:
            return self.report(version, t0, err)
        return self.report(version, t0, None, pause, 0, nbytes)

    def stages(self, manifest: Manifest) -> bool:
        """Whether a prefetcher can stage this version (a layout the module is bound to; not in place)."""
        target = self._target
        if transport_info(manifest.transport).in_place:
            return False  # received straight into the spare set anyway
        return isinstance(target, ModuleTarget) and target.binding(manifest) is not None

    def stage(self, version: int, manifest: Manifest, refs: list[Any]) -> bool:
        """Fetch ``version``'s changed buckets into the spare buffer set (caller holds the stage lock).

        Returns:
            Whether it staged it (not for a first version, a new layout, or one held already).
        """
        target = self._target
        bound = target.binding(manifest) if isinstance(target, ModuleTarget) else None
        if (
            bound is None
            or not self.stages(manifest)
            or (self._version is not None and version <= self._version)
        ):
            return False  # first version or a new layout: the normal path binds it
        ids = bucket_ids(refs)
        needed = bound.needed(ids, staging=True)
        fetched = fetch.fetch(manifest, refs, needed, timeout=self.timeout, verify=self.verify, target=target)
        bound.stage(fetched, ids, extra_state=manifest.extra_state)
        self._staged = (version, fetch.nbytes(manifest, needed, target, fetched))
        return True

    def swap_staged(self) -> ApplyReport | None:
        """Make the staged version current by re-pointing (no copy). Caller holds the stage lock."""
        staged, target = self._staged, self._target
        bound = target.bound if isinstance(target, ModuleTarget) else None
        if staged is None or bound is None or (self._version is not None and staged[0] <= self._version):
            return None
        assert isinstance(target, ModuleTarget)
        t0 = time.perf_counter()
        with self.guard(), self.lock:
            if target.bound is not bound or not bound.intact():
                self._staged = None  # re-pointed by user code: the normal path binds afresh
                return None
            t1 = time.perf_counter()
            bound.swap()
            self.version = staged[0]
            pause = time.perf_counter() - t1
        self._staged = None
        return ApplyReport(
            applied=self.version,
            apply_s=time.perf_counter() - t0,
            pause_s=pause,
            prefetched=True,
            bytes_fetched=staged[1],
        )


def plan(
    target: Target, version: int, manifest: Manifest, ids: Sequence[str | None], held: int | None
) -> list[int] | None:
    """The buckets to fetch for ``version``, or None if it is not newer than ``held``.

    Raises:
        WeightMismatchError: the version does not fit the target (nothing fetched).
    """
    if held is not None and version <= held:
        return None
    manifest = view(target, manifest)
    target.check(manifest)
    return target.needed(manifest, ids)


def commit(
    target: Target, version: int, manifest: Manifest, ids: Sequence[str | None], fetched: Any
) -> float:
    """Hand the version to the target, whole; the seconds it took."""
    t0 = time.perf_counter()
    target.commit(Incoming(version, view(target, manifest), list(ids), fetched))
    return time.perf_counter() - t0


def failed(version: int, held: int | None, error: BaseException) -> ApplyReport:
    """The report of a version not applied: the receiver keeps ``held``."""
    return ApplyReport(
        applied=held,
        failed=version,
        error=portable(error),
        timed_out=isinstance(error, TimeoutError),
        # its bytes are gone (the pusher died): the hub stops offering it
        lost=version if isinstance(error, ObjectLostError) else None,
    )


def skipped(held: int | None, version: int) -> ApplyReport:
    """The report of a version not newer than the one held."""
    return ApplyReport(applied=held, skipped=version)


def portable(error: BaseException) -> BaseException:
    """The error itself if it pickles across Ray (raysync's do), else an ApplyError that says what it was."""
    if isinstance(error, RaySyncError):
        return error
    return ApplyError(f"{type(error).__name__}: {str(error)[:1000]}")

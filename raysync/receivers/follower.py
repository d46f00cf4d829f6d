"""A module or target that follows a model on the hub from any process: no decorated actor needed.

torchrl's worker processes, a Ray actor the user does not want to decorate, an
evaluation script: a :class:`Follower` registers with the hub (it shows in
``raysync status``, a push waits for it, the hub drops it when its process dies),
and hears of each version as every receiver does: from its node's delivery (the
relay, or the hub on its own node), through its process's poll
(:mod:`raysync.receivers.poller`). It applies each one whole into its module (one
``copy_`` per changed bucket, between two forward calls of the module, never during
one) or into another target (``target=raysync.WeightsLoader(engine.load_weights)``),
and the answer to the delivery's call acknowledges it.

A follower may start before any version of its model (before its trainer): it then holds
nothing and says so in one log line per hub and model id, naming the models the hub holds
(a warning when it holds others: a typo'd id is then seen at once). A receiver whose docs
promise the newest version on return (``follow_engine``) waits for a first one with
:func:`wait_for_first`.

Example:
    >>> import ray, torch, raysync
    >>> ray.init(address="auto")  # doctest: +SKIP
    >>> policy = torch.nn.Linear(4, 2)
    >>> follower = raysync.follow(policy, "policy", hub="raysync")  # doctest: +SKIP
    >>> follower.version  # the hub's newest, already applied  # doctest: +SKIP
    3
    >>> follower.stop()  # doctest: +SKIP
    >>> loader = raysync.WeightsLoader(engine.load_weights)  # doctest: +SKIP
    >>> raysync.follow(target=loader, model_id="policy")  # fed (name, tensor) pairs  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import ray
import torch

from raysync import _protocol as proto
from raysync._checks import wait_timeout
from raysync._protocol import Announcement, ApplyReport, Registration, SubscriberInfo
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.client import background
from raysync.client.hub_calls import calls_to
from raysync.client.model_ids import describe_models, models_there, note_absent
from raysync.core.extract import module_schema
from raysync.core.placement import TensorParallel
from raysync.errors import RayNotRunningError, RaySyncError, SyncTimeoutError
from raysync.receivers.membership import membership
from raysync.receivers.pipeline import Applier
from raysync.receivers.target import ModuleTarget, Target, is_target, weightless

__all__ = ["Follower", "follow", "wait_for_first"]

logger = logging.getLogger(__name__)

FOLLOWING = "following it until one is pushed"
"""What a follower of a model id with no version does meanwhile, as its line says."""
_RETRY_S = (0.05, 5.0)  # a version that failed to apply is tried again after this (doubling) back-off
_SUB_IDS: dict[str, int] = {}  # default sub ids handed out in this process: how many per stem
_SUB_IDS_LOCK = threading.Lock()
_GUARDED: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_GUARD_LOCK = threading.Lock()


def _default_sub_id(stem: str) -> str:
    """``stem`` for this process's first Follower of a model, ``stem#2`` for its second, and so on:
    two Followers of one model in one process are two subscriptions, never one replacing the other."""
    with _SUB_IDS_LOCK:
        n = _SUB_IDS[stem] = _SUB_IDS.get(stem, 0) + 1
    return stem if n == 1 else f"{stem}#{n}"


def forward_lock(module: torch.nn.Module) -> threading.RLock:
    """The lock held during every forward call of ``module`` (installed on first use).

    A follower applies a version under it, so a forward call sees one version whole:
    the one before the apply or the one after it.
    """
    with _GUARD_LOCK:
        lock = _GUARDED.get(module)
        if lock is None:
            lock = _GUARDED[module] = threading.RLock()
            _install_hooks(module, lock)
        return lock


def _install_hooks(module: torch.nn.Module, lock: threading.RLock) -> None:
    # Closures, not bound methods: a deep copy of the module (torchrl copies policies
    # onto their device) keeps the hooks and shares the lock instead of failing on it.
    def acquire(_module: Any, _args: Any) -> None:
        lock.acquire()

    def release(_module: Any, _args: Any, _output: Any) -> None:
        lock.release()

    module.register_forward_pre_hook(acquire)
    module.register_forward_hook(release, always_call=True)


class Follower:
    """Follow ``model_id`` on a hub from any process connected to Ray.

    Args:
        module: the module to keep in step, or a callable returning it (called at
            each apply: the module may be replaced, e.g. copied onto a device), or a
            :class:`~raysync.receivers.target.Target` (the same as ``target=``).
        model_id: the model on the hub.
        hub: the hub's name; namespace: its namespace (``None``: raysync's).
        sub_id: this subscription's id (unique per hub and model; default: from the
            Ray actor or job, the process id and the model, ``#2`` on for a process's second
            and later Followers of one model).
        label: who this is in ``raysync status`` and in errors (e.g. ``"torchrl worker 2"``).
        timeout: seconds :meth:`start` waits for a first version when the module is
            weightless (meta tensors), and that a fetch may take.
        on_apply: called with the version after each apply (in the follower's thread).
        non_persistent: versions also carry the module's non-persistent buffers
            (the keys of ``TensorDict.from_module``, as torchrl's own sync carries
            them): the follower registers, checks and applies those keys too.
        target: instead of ``module``, what to apply versions into: a
            :class:`~raysync.WeightsLoader` (an engine's ``load_weights``) or any
            :class:`~raysync.receivers.target.Target`. Its versions are checked by the
            target itself (the hub does not check pushes against it).
        placement: ``module`` holds only its own parts of the tensors
            (:class:`~raysync.TensorParallel`): of every version, a sharded trainer's or one
            writer's, it takes only its parts (see :class:`~raysync.receivers.target.ModuleTarget`).

    A version that fails to apply (wrong shape, a ``set_extra_state`` that raises)
    leaves the module as it was and is reported: ``hub.wait``/``push(wait=True)``
    raise :class:`~raysync.ApplyError` naming this follower.

    ``ray.shutdown()`` ends the following: it waits for an apply under way (its fetch takes
    ``timeout`` at most), then the thread stops quietly (:mod:`raysync.client.background`).

    Example:
        >>> follower = Follower(policy, "policy", label="evaluator")  # doctest: +SKIP
        >>> follower.start()  # doctest: +SKIP
        >>> with follower.paused():  # no apply while the block runs  # doctest: +SKIP
        ...     evaluate(policy)
        >>> Follower(target=raysync.WeightsLoader(engine.load_weights)).start()  # doctest: +SKIP
    """

    def __init__(
        self,
        module: torch.nn.Module | Callable[[], torch.nn.Module | None] | Target | None = None,
        model_id: str = "policy",
        *,
        hub: str = proto.DEFAULT_HUB,
        namespace: str | None = None,
        sub_id: str | None = None,
        label: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        on_apply: Callable[[int], None] | None = None,
        non_persistent: bool = False,
        target: Target | None = None,
        placement: TensorParallel | None = None,
    ) -> None:
        if not ray.is_initialized():
            raise RaySyncError("a Follower needs a connected Ray: call ray.init(address=...) first")
        if is_target(module):
            module, target = None, target or module  # type: ignore[assignment]
        if (module is None) == (target is None):
            raise TypeError("a Follower takes a module (or a callable returning one) or target=, exactly one")
        if placement is not None and target is not None:
            raise TypeError("placement= is for a module; give a WeightsLoader its own placement= instead")
        self.label = label or f"follower pid {os.getpid()}"
        self.non_persistent = bool(non_persistent)
        self._module: Callable[[], torch.nn.Module | None] = lambda: None
        if target is not None:
            if not is_target(target):
                raise TypeError(
                    f"target must be a raysync Target (e.g. WeightsLoader), got {type(target).__name__}"
                )
            self.target: Target = target
        else:  # the module target checks what `module` is
            mod = cast("torch.nn.Module | Callable[[], torch.nn.Module | None]", module)
            own = ModuleTarget(mod, non_persistent=self.non_persistent, label=self.label, placement=placement)
            self.target, self._module = own, own._get
        ctx = ray.get_runtime_context()
        actor_id = ctx.get_actor_id()
        job_id = ctx.get_job_id()
        self.model_id = model_id
        self.hub_name = hub  # the hub's name and namespace (a Member's)
        self.hub_namespace = namespace
        self.sub_id = sub_id or _default_sub_id(f"{actor_id or 'job-' + job_id}/pid{os.getpid()}:{model_id}")
        self.timeout = float(timeout)
        self.on_apply = on_apply
        self.last_error: BaseException | None = None
        self._info = SubscriberInfo(
            mode="follow",
            apply="copy",
            actor_id=actor_id,
            class_name=self.label,
            node_id=ctx.get_node_id(),
            pid=os.getpid(),
            job_id=job_id,
        )
        self._apply_lock = threading.Lock()  # one apply at a time (poll thread, re-registration)
        self._pause = threading.RLock()  # held by paused(): no apply meanwhile
        self._stop = threading.Event()
        self._started = False
        self._retry: tuple[int, float, threading.Timer] | None = None  # (version, back-off, timer)
        self.applier = Applier(
            self.target,
            verify="if_present",
            timeout=self.timeout,
            label=f"{self.label} ({model_id!r})",
            guard=self._guard,
        )

    @property
    def version(self) -> int | None:
        """The version its target holds whole (``None``: none yet)."""
        return self.applier.version

    # ------------------------------------------------------------------ Member (see membership)
    def registration(self) -> Registration:
        # a whole module's schema, which the hub checks pushes against; other targets (and modules
        # holding parts: placement=) check each version themselves
        module = None if getattr(self.target, "placement", None) else self._module()
        schema = module_schema(module, non_persistent=self.non_persistent) if module is not None else None
        return Registration(self.sub_id, self.model_id, True, self._info, schema, self.version)

    def start_from(self, newest: Announcement | None) -> None:
        """Apply the version the hub hands a (re-)registration, and say so."""
        if newest is not None:
            self._take(newest)

    # ------------------------------------------------------------------ use
    def start(self) -> Follower:
        """Register, apply the hub's newest version, and take each version the hub delivers.

        If the hub has no version of ``model_id`` yet (a follower may start before its
        trainer), it returns at once holding none (:attr:`version` is ``None``), logs one
        line naming the models the hub holds (a warning if it holds others: a typo'd id?),
        and applies the first version pushed. A weightless module (meta tensors, as torchrl
        sends policies to its workers) waits up to ``timeout`` for a first version instead.

        Raises:
            SyncTimeoutError: the module is weightless and no version came in time.
            ApplyError: the first version did not fit the module (from the hub's check).
        """
        if self._started:
            return self
        self._started = True
        membership().serve(self, self, alone=True)  # before joining: the hub may deliver at once
        membership().join(self)
        if self.version is None:  # one line naming the models there
            note_absent(self.hub_name, self.model_id, self._status, FOLLOWING, always=True)
        module = self._module()
        if self.version is None and module is not None and weightless(module, non_persistent=True):
            deadline = time.monotonic() + self.timeout
            with self.applier.held:  # the hub delivers the first version pushed
                while self.version is None and self.last_error is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SyncTimeoutError(
                            f"{self.label}: its module has no weights (meta tensors) and hub "
                            f"{self.hub_name!r} had no version of {self.model_id!r} within "
                            f"{self.timeout:.0f} s"
                        )
                    self.applier.held.wait(min(left, 1.0))  # a failure does not notify: look again
            if self.version is None:
                raise RaySyncError(f"{self.label}: first version failed to apply: {self.last_error}")
        return self

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Block until this follower holds ``version`` or newer; return the version held.

        Args:
            version: a version ``push()`` returned.
            timeout: seconds (``None``: 300 s, ``WAIT_TIMEOUT_S``; ``float("inf")``: no bound).

        Raises:
            SyncTimeoutError: not within ``timeout`` seconds.
        """
        timeout = wait_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.applier.held:
            while self.version is None or self.version < version:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SyncTimeoutError(
                        f"{self.label} holds version {self.version}, not {version}, after {timeout} s"
                    )
                self.applier.held.wait(left)
            return self.version

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No version is applied while the block runs (it waits until the block ends)."""
        with self._pause:
            yield

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop following and leave the hub (an apply under way finishes first)."""
        self._stop.set()
        with self._apply_lock:
            if self._retry is not None:
                self._retry[2].cancel()
                self._retry = None
        membership().leave(self, timeout=timeout)
        membership().unserve(self)

    # ------------------------------------------------------------------ internals
    def _status(self) -> dict[str, Any]:
        return calls_to(membership().hub(self).handle, timeout=5.0).status()

    def _raysync_notify(self, announcement: Announcement) -> ApplyReport:
        """Its node's delivery hands it a version (:data:`~raysync._protocol.NOTIFY`): apply it;
        the report is the call's answer. A version that failed is tried again after a back-off."""
        if self._stop.is_set():
            return ApplyReport(applied=self.version, skipped=announcement.version)
        return self._apply(announcement)

    def _take(self, ann: Announcement) -> ApplyReport:
        """Apply ``ann`` and tell the hub (what it hands a registration, and retries)."""
        report = self._apply(ann)
        membership().report(self, report)
        return report

    def _retry_later(self, ann: Announcement) -> None:
        """``ann`` failed to apply: try it again after a doubling back-off (0.05 s ... 5 s) until it
        goes in or a newer version does (held under the apply lock)."""
        backoff = _RETRY_S[0]
        if self._retry is not None:
            self._retry[2].cancel()
            if self._retry[0] == ann.version:
                backoff = min(self._retry[1] * 2, _RETRY_S[1])
        timer = threading.Timer(backoff, self._try_again, (ann,))
        timer.daemon = True
        self._retry = (ann.version, backoff, timer)
        timer.start()

    def _try_again(self, ann: Announcement) -> None:
        if self._stop.is_set() or (self.version or 0) >= ann.version or not ray.is_initialized():
            return
        try:
            self._take(ann)
        except RayNotRunningError:  # ray.shutdown(): nothing left to follow
            logger.debug("%s: Ray was shut down; the follower stops", self.label)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Held while a version goes in: no ``paused()`` block runs, no forward call of the module.

        Taken inside :meth:`_apply`'s hold on ``ray.shutdown()``, letting one in while it waits
        (the thread calling it may be in a ``paused()`` block).
        """
        module = self._module()
        forward = forward_lock(module) if module is not None else contextlib.nullcontext()
        with background.taking("apply a version", self._pause, forward):
            yield

    def _apply(self, ann: Announcement) -> ApplyReport:
        with self._apply_lock:
            with background.held("apply a version"):  # a ray.shutdown() waits for the apply
                report = self.applier.apply(ann.version, ann.manifest, list(ann.refs))
            if report.failed is not None:
                self.last_error = report.error
                if not self._stop.is_set():
                    self._retry_later(ann)
                return report
            if report.skipped is not None:
                return report
            self.last_error = None
            if self._retry is not None and self._retry[0] <= ann.version:
                self._retry[2].cancel()
                self._retry = None
        if self.on_apply is not None:
            try:
                self.on_apply(ann.version)
            except Exception as err:
                logger.warning("%s: on_apply(%d) raised %s", self.label, ann.version, err)
        return report


def follow(
    module: torch.nn.Module | Callable[[], torch.nn.Module | None] | Target | None = None,
    model_id: str = "policy",
    *,
    hub: str = proto.DEFAULT_HUB,
    namespace: str | None = None,
    label: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    non_persistent: bool = False,
    target: Target | None = None,
    placement: TensorParallel | None = None,
) -> Follower:
    """Keep ``module`` (or ``target``) in step with ``model_id`` on the hub, from this process (started).

    See :class:`Follower`.

    Example:
        >>> follower = raysync.follow(policy, "policy", label="evaluator")  # doctest: +SKIP
        >>> follower.version  # doctest: +SKIP
        7
        >>> raysync.follow(target=raysync.WeightsLoader(engine.load_weights))  # doctest: +SKIP
    """
    return Follower(
        module,
        model_id,
        hub=hub,
        namespace=namespace,
        label=label,
        timeout=timeout,
        non_persistent=non_persistent,
        target=target,
        placement=placement,
    ).start()


def wait_for_first(follower: Follower, timeout: float) -> int:
    """Block until ``follower`` holds a version (the hub's newest); return it.

    Raises:
        SyncTimeoutError: none within ``timeout`` seconds; the message names the model id and
            the models the hub holds (and why a version that came failed to apply, if one did).

    Example:
        >>> wait_for_first(raysync.Follower(target=loader, model_id="policy").start(), 60)  # doctest: +SKIP
        3
    """
    try:
        return follower.wait_for(1, timeout=timeout)
    except SyncTimeoutError:
        pass
    try:
        there = describe_models(models_there(follower._status()))
    except Exception as err:  # the hub did not answer: say so instead of the models
        there = f"not listed: {err}"
    failed = f"; a version came but failed to apply: {follower.last_error}" if follower.last_error else ""
    raise SyncTimeoutError(
        f"{follower.label}: hub {follower.hub_name!r} had no version of model {follower.model_id!r} "
        f"within {timeout:g} s (models there: {there}){failed}. Push one first "
        f"(hub.push(model, model_id={follower.model_id!r})), check the model id, or raise timeout="
    )

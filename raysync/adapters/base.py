"""An adapter: one hub subscriber that fans each version out to local receivers."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray

from raysync._checks import check_timeout
from raysync._protocol import (
    DEFAULT_HUB,
    Announcement,
    ApplyReport,
    Registration,
    SubscriberInfo,
)
from raysync.adapters._workers import _receiver_main
from raysync.adapters.placement import placement_of
from raysync.channels.base import DEFAULT_TIMEOUT
from raysync.core.layout import Manifest
from raysync.errors import ApplyError, RaySyncError, SyncTimeoutError
from raysync.receivers.membership import membership
from raysync.receivers.pipeline import Applier
from raysync.receivers.target import Incoming

__all__ = ["KINDS", "Kind"]


logger = logging.getLogger(__name__)


Kind = Literal["pipe", "distributed", "rpc"]


KINDS: tuple[str, ...] = ("pipe", "distributed", "rpc")
"""The adapter kinds :func:`start` and :func:`for_placement_group` build."""


@dataclass
class _Receiver:
    """One receiver behind an adapter, as the adapter sees it."""

    index: int
    name: str
    process: Any
    transport: Any
    applied: int | None = None
    error: str | None = None
    state: str = "live"  # "live" or "dead" (dropped)

    def row(self) -> dict[str, Any]:
        return {
            "receiver": self.name,
            "pid": self.process.pid,
            "applied": self.applied,
            "error": self.error,
            "state": self.state,
        }


class _FanOut:
    """An adapter's receivers as its pipeline's target: the fan-out to them is the commit.

    Each receiver checks the version against its own model, so the check here is only that
    some receiver is left to take it (before any byte is fetched), and every bucket is
    fetched (each receiver holds a whole copy).
    """

    def __init__(self, adapter: _Adapter) -> None:
        self.adapter = adapter

    def check(self, manifest: Manifest) -> None:
        if not any(r.state == "live" for r in self.adapter._receivers):
            raise RaySyncError(f"{self.adapter.name} has no live receivers left")

    def needed(self, manifest: Manifest, ids: Sequence[str | None]) -> list[int]:
        return list(range(manifest.num_buckets))

    def commit(self, incoming: Incoming) -> None:
        self.adapter._commit(incoming)

    def intact(self) -> bool:
        return True

    def forget(self) -> None:
        pass


class _Adapter:
    """What every adapter does: subscribe once, fetch once per version, fan out, report."""

    kind = ""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        *,
        model_factory: Callable[[], Any],
        num_receivers: int = 2,
        model_id: str = "policy",
        hub: str = DEFAULT_HUB,
        namespace: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        name: str | None = None,
        start_method: str = "fork",
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be a callable fn(receiver, *args), got {type(fn).__name__}")
        if not callable(model_factory):
            raise TypeError(f"model_factory must be callable, got {type(model_factory).__name__}")
        if not isinstance(num_receivers, int) or num_receivers < 1:
            raise ValueError(f"num_receivers must be an integer >= 1, got {num_receivers!r}")
        check_timeout(timeout, allow_none=False, positive=True)
        self.model_id = model_id
        self.timeout = float(timeout)
        self.name = name or f"{self.kind}-adapter-{os.getpid()}"
        self.hub_name = hub  # the hub protocol's names (a Member)
        self.hub_namespace = namespace
        self._lock = threading.Lock()  # one version at a time
        self._applier = Applier(_FanOut(self), verify="if_present", timeout=self.timeout, label=self.name)
        self._model_id = model_id
        self._problem: ApplyError | None = None  # of the version being delivered: receivers dropped
        self._fetches = 0
        self._bytes_fetched = 0
        self._receivers: list[_Receiver] = []
        self._placement = placement_of()
        self._mp: Any = multiprocessing.get_context(start_method)
        self._work = (fn, tuple(args), model_factory)
        self._start_receivers(num_receivers)
        self.sub_id = ""
        self._in_hub = False
        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is not None:
            self.sub_id = f"{ctx.get_actor_id()}:{self.model_id}"
            self._info = SubscriberInfo(
                mode="push",
                apply=f"adapter/{self.kind}",
                actor_id=ctx.get_actor_id(),
                class_name=type(self).__name__,
                node_id=self._placement["node_id"],
                pid=os.getpid(),
                placement=dict(self._placement),
            )
            membership().serve(self, self)  # this actor answers the hub's calls (its poller)
            membership().join(self)  # registers, applies the newest, keeps it known
            self._in_hub = True

    # -------------------------------------------------------------- hub protocol (a Member)
    def registration(self) -> Registration:
        return Registration(self.sub_id, self.model_id, True, self._info, None, self._applied())

    def start_from(self, newest: Announcement | None) -> None:
        if newest is not None:
            membership().report(self, self._raysync_notify(newest))

    def _raysync_ping(self) -> bool:
        return True

    def _raysync_notify(self, announcement: Announcement) -> ApplyReport:
        """The hub delivers a version: fetch it once, hand it to every receiver, reply with their acks.

        raysync's apply path (:class:`~raysync.receivers.pipeline.Applier`): through the version's
        data path (one that receives in place is refused), checksums verified where the pusher added
        them; the fan-out to the receivers is the commit."""
        a = announcement
        with self._lock:
            self._reap()
            self._model_id, self._problem = a.model_id, None
            report = self._applier.apply(a.version, a.manifest, list(a.refs))
            error = report.error or self._problem  # a dropped receiver is reported; the others got it
            return dataclasses.replace(
                report, applied=self._applied(), error=error, receivers=tuple(self.receivers())
            )

    def _commit(self, incoming: Incoming) -> None:
        """The fan-out: every live receiver gets the version; it is in once all of them applied it."""
        live = [r for r in self._receivers if r.state == "live"]
        manifest, version = incoming.manifest, incoming.version
        buckets = [incoming.buckets[b] for b in range(manifest.num_buckets)]
        self._fetches += 1
        self._bytes_fetched += sum(manifest.bucket_nbytes)
        self._fan_out(self._model_id, version, manifest, buckets, live)
        del buckets
        dropped = [r for r in live if r.state == "dead"]
        failed = [r for r in live if r.state == "live" and r.applied != version]
        problems = [f"{r.name}: {r.error}" for r in (*failed, *dropped)]
        if failed or not any(r.state == "live" for r in live):
            raise ApplyError("; ".join(problems)[:2000] or f"{self.name} has no live receivers left")
        self._problem = ApplyError("; ".join(problems)[:2000]) if problems else None

    def _applied(self) -> int | None:
        """The version every live receiver holds (the oldest of theirs)."""
        versions = [r.applied for r in self._receivers if r.state == "live"]
        if not versions or any(v is None for v in versions):
            return None
        return min(v for v in versions if v is not None)

    def _reap(self) -> None:
        for r in self._receivers:
            if r.state == "live" and not r.process.is_alive():
                self._drop(r, f"receiver process exited (exit code {r.process.exitcode})")

    def _drop(self, r: _Receiver, why: str, *, level: int = logging.WARNING) -> None:
        r.state = "dead"
        r.error = why
        logger.log(level, "%s dropped receiver %s: %s", self.name, r.name, why)
        if r.process.is_alive():
            r.process.terminate()
        r.process.join(timeout=1.0)

    def _check(self, r: _Receiver, version: int, err: BaseException | None) -> None:
        """Record one receiver's outcome for ``version``."""
        if err is None:
            r.applied, r.error = version, None
        elif not r.process.is_alive() or (
            isinstance(err, RaySyncError)
            and not isinstance(err, ApplyError)
            and not isinstance(err, SyncTimeoutError)
        ):
            r.process.join(timeout=1.0)
            self._drop(r, f"receiver process died (exit code {r.process.exitcode}): {err}")
        else:
            r.error = f"{type(err).__name__}: {str(err)[:500]}"

    def _send_all(self, model_id: str, version: int, payload: Any, live: list[_Receiver]) -> None:
        """Start the send to every live receiver, then wait for each one's ack (one deadline for all)."""
        started: list[_Receiver] = []
        for r in live:
            try:
                r.transport.send_weights_async(model_id, payload)
                started.append(r)
            except Exception as err:
                self._failed(
                    r, version, err if isinstance(err, RaySyncError) else RaySyncError(str(err)), sent=False
                )
        self._collect_acks(version, started, time.monotonic() + self.timeout)

    def _collect_acks(
        self, version: int, receivers: list[_Receiver], deadline: float, grace: float = 0.0
    ) -> None:
        """Wait for each receiver's ack of ``version`` (one deadline for all, each wait ``grace`` s
        longer) and record it."""
        for r in receivers:
            try:
                r.transport.wait_ack(max(deadline - time.monotonic(), 0.01) + grace)
            except RaySyncError as err:
                self._failed(r, version, err, sent=True)
                continue
            self._check(r, version, None)

    def _failed(self, r: _Receiver, version: int, err: RaySyncError, *, sent: bool) -> None:
        """A receiver's send (``sent=False``) or ack (``sent=True``) failed."""
        self._check(r, version, err)

    def _start_receivers(self, count: int) -> None:
        """Start ``count`` receivers (with :meth:`_add_receiver`)."""
        raise NotImplementedError

    def _add_receiver(self, index: int, name: str, connect: Callable[[float], Any], transport: Any) -> None:
        """Start one receiver process (it connects with ``connect``, see ``_workers``, then runs ``fn``)
        and keep it, with the transport that reaches it."""
        fn, args, model_factory = self._work
        process = self._mp.Process(
            target=_receiver_main,
            args=(connect, fn, args, model_factory, self.model_id, self.timeout, os.getpid(), name),
            name=name,
            daemon=True,
        )
        process.start()
        self._receivers.append(_Receiver(index, name, process, transport))

    def _fan_out(
        self, model_id: str, version: int, manifest: Manifest, buckets: list[Any], live: list[_Receiver]
    ) -> None:
        raise NotImplementedError

    # -------------------------------------------------------------- public methods
    def placement(self) -> dict[str, Any]:
        """Where this adapter runs (node id, placement group id, bundle index), read inside it."""
        return dict(self._placement)

    def receivers(self) -> list[dict[str, Any]]:
        """One row per receiver: name, pid, applied version, last error, state (live / dead)."""
        return [r.row() for r in self._receivers]

    def stats(self) -> dict[str, Any]:
        """Versions fetched from the object store by this adapter (``fetches``, ``bytes_fetched``)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "version": self._applier.version,
            "fetches": self._fetches,
            "bytes_fetched": self._bytes_fetched,
            "receivers": len([r for r in self._receivers if r.state == "live"]),
        }

    def shutdown(self) -> None:
        """Stop the receivers and leave the hub."""
        if self._in_hub:
            membership().leave(self)
        for r in self._receivers:
            if r.state == "live":
                self._drop(r, "adapter shut down", level=logging.INFO)

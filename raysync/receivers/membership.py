"""Joining the hub, staying known to it, telling it what was applied: written once.

``@synced_model`` subscriptions, ``RayModuleTransform`` hosts and adapters are all
:class:`Member`\\ s of one :class:`Membership` per process: it registers them (waiting
for the hub while it restarts), checks in for all of them with one heartbeat call per
hub every :data:`~raysync._protocol.HEARTBEAT_S` seconds, registers again the ones a
restarted hub does not know, and sends their reports. Its calls into Ray hold a
``ray.shutdown()`` off while they run (:mod:`raysync.client.background`); after one, the
heartbeat ends and the process's members are forgotten (a new ``ray.init()`` starts afresh).

Example:
    >>> membership().join(member)        # registers; member.start_from(newest) applies it
    >>> membership().report(member, ApplyReport(applied=3))
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import ray

from raysync import _compat
from raysync import _protocol as proto
from raysync._protocol import DEFAULT_NAMESPACE, Announcement, ApplyReport, Registration
from raysync.client import background
from raysync.client.hub_calls import HubCalls, calls_to
from raysync.client.locate import get_hub_actor
from raysync.errors import RayNotRunningError
from raysync.receivers import poller

__all__ = ["Member", "Membership", "membership"]

logger = logging.getLogger(__name__)


class Member(Protocol):
    """Something that subscribes to a hub (a subscription, an adapter).

    A member may also define ``heartbeat_report() -> ApplyReport | None``: asked at
    each heartbeat, what it returns is reported to the hub (``@synced_model``
    subscriptions tell that their weights were changed in place, once per change).
    """

    @property
    def sub_id(self) -> str: ...

    @property
    def hub_name(self) -> str: ...

    @property
    def hub_namespace(self) -> str | None: ...

    def registration(self) -> Registration:
        """What to tell the hub when (re-)joining: who it is and the version it holds."""
        ...

    def start_from(self, newest: Announcement | None) -> None:
        """Apply the version the hub answered a registration with (and report it)."""
        ...


LOOKUP_S = 1.0
"""The longest a lookup of a hub by name holds its caller up (and so a ``ray.shutdown()`` waiting
for the caller's call into Ray); the lookup goes on in its own thread and a later call takes its
answer. Ray never answers a lookup while its GCS is gone (the cluster shut down): a lookup made
under Ray's init/shutdown lock would then keep the process from ever exiting."""


class _Lookup:
    """``ray.get_actor(name)`` in a daemon thread of its own, never holding Ray's shutdown lock."""

    def __init__(self, name: str, namespace: str) -> None:
        self.done = threading.Event()
        self.handle: Any = None  # None: no actor by that name (yet)
        self.error: BaseException | None = None
        args = (name, namespace)
        threading.Thread(target=self._run, args=args, name=f"raysync-find-hub {name}", daemon=True).start()

    def _run(self, name: str, namespace: str) -> None:
        try:
            self.handle = _compat.get_actor_no_start(name, namespace)
        except ValueError:
            pass
        except BaseException as err:  # Ray not running here, the GCS unreachable: the caller's to raise
            self.error = err
        finally:
            self.done.set()


class _Hub:
    """One hub as this process sees it: its handle, looked up again after it was re-created."""

    def __init__(self, name: str, namespace: str | None) -> None:
        self.name = name
        self.namespace = namespace or DEFAULT_NAMESPACE
        self._handle: Any = None
        self._lock = threading.Lock()
        self._lookup: _Lookup | None = None  # one lookup by name at a time

    def handle(self, fresh: bool = False) -> Any:
        """The hub's handle: made (or found) on first use; after it died, found again by name only.

        A subscriber never re-creates a hub that was killed for good: the next client
        call does, and the subscriber then finds it. A lookup Ray has not answered within
        :data:`LOOKUP_S` leaves the old handle in use meanwhile (as one that finds no hub does).
        """
        if self._handle is None:
            self._handle = get_hub_actor(self.name, self.namespace)
        elif fresh:
            with self._lock:
                lookup = self._lookup = self._lookup or _Lookup(self.name, self.namespace)
            if not lookup.done.wait(LOOKUP_S):
                logger.debug(
                    "hub %r: no answer to its lookup by name yet; the old handle meanwhile", self.name
                )
                return self._handle
            with self._lock:
                if self._lookup is lookup:
                    self._lookup = None
            if lookup.error is not None:
                raise lookup.error
            if lookup.handle is not None:
                self._handle = lookup.handle
        return self._handle


class Membership:
    """This process's members, by hub; one heartbeat thread for all of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hubs: dict[tuple[str, str | None], _Hub] = {}
        self._members: dict[str, Member] = {}
        self._thread: threading.Thread | None = None
        self._session: tuple[str, str] | None = None  # the Ray they belong to (poller.ray_session())

    def hub(self, member: Member) -> _Hub:
        key = (member.hub_name, member.hub_namespace)
        with self._lock:
            if key not in self._hubs:
                self._hubs[key] = _Hub(*key)
            return self._hubs[key]

    def calls(self, member: Member, *, timeout: float | None = None, thread: bool = False) -> HubCalls:
        """``member``'s hub's methods, each waiting while it restarts (see
        :func:`~raysync.client.locate.call_hub`); ``thread``: from a raysync thread
        (:mod:`raysync.client.background`)."""
        return calls_to(
            self.hub(member).handle, timeout=timeout, stopped=background.never if thread else None
        )

    def serve(self, member: Member, owner: Any, *, alone: bool = False) -> None:
        """Answer the calls ``member``'s hub (and its node's relay) queue for this process with
        ``owner``'s methods: the actor's (once per hub and process), or, ``alone``, those for
        ``member``'s subscription only (a Follower; see :func:`raysync.receivers.poller.serve`)."""
        poller.serve(self.hub(member), owner, sub_id=member.sub_id if alone else None)

    def unserve(self, member: Member) -> None:
        """``member``, served ``alone``, left: its calls are answered here no more."""
        poller.unserve(self.hub(member), member.sub_id)

    def join(self, member: Member) -> None:
        """Register ``member`` and start it from the newest version; keep it known from now on."""
        session = poller.ray_session()
        with self._lock:
            if session != self._session:  # a new ray.init(): what was known went with the old Ray
                self._members.clear()
                self._hubs.clear()
                self._session, self._thread = session, None
            self._members[member.sub_id] = member
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._heartbeat_loop, args=(session,), name="raysync-heartbeat", daemon=True
                )
                self._thread.start()
        newest = self.calls(member).register(member.registration())
        member.start_from(newest)

    def leave(self, member: Member, *, timeout: float = 10.0) -> None:
        """Forget ``member`` and tell its hub. Safe from any thread, even while another runs
        ``ray.shutdown()``: the call holds the shutdown off (:mod:`raysync.client.background`), and
        once Ray is gone there is no hub to tell."""
        with self._lock:
            self._members.pop(member.sub_id, None)
        try:
            self.calls(member, timeout=timeout, thread=True).unregister(member.sub_id)
        except Exception as err:  # hub restarting or gone, or Ray shut down: it drops the subscriber anyway
            logger.debug("%s could not unregister: %s", member.sub_id, err)

    def report(self, member: Member, report: ApplyReport) -> None:
        """Tell the hub what ``member`` applied on its own (fire and forget; not after ``ray.shutdown()``)."""
        try:
            with background.held("report to the hub"):
                self.calls(member).post_report(member.sub_id, report)
        except RayNotRunningError:
            logger.debug("%s: Ray was shut down; report not sent", member.sub_id)

    def _heartbeat_loop(self, session: tuple[str, str]) -> None:
        """Check in with every hub; register again the members it does not know (it restarted).

        Ends once Ray is shut down here, forgetting every member (they belonged to that Ray),
        or when this process connected to another Ray meanwhile (``join`` started a new one).
        """
        try:
            while True:
                time.sleep(proto.HEARTBEAT_S)
                with background.held("check in with the hub"):
                    if poller.ray_session() != session:
                        raise RayNotRunningError("ray.shutdown(), then another ray.init()")
                with self._lock:
                    by_hub: dict[tuple[str, str | None], list[Member]] = {}
                    for m in self._members.values():
                        by_hub.setdefault((m.hub_name, m.hub_namespace), []).append(m)
                for members in by_hub.values():
                    self._beat(members)
        except RayNotRunningError:
            logger.debug("Ray was shut down: the heartbeat stops")
            with self._lock:
                if self._thread is threading.current_thread():
                    self._members.clear()
                    self._hubs.clear()
                    self._session, self._thread = None, None

    def _beat(self, members: list[Member]) -> None:
        hub = self.hub(members[0])
        try:
            with background.held("check in with the hub"):
                ref = calls_to(hub.handle).post_heartbeat([m.sub_id for m in members])
            unknown = set(background.get(ref, timeout=proto.HEARTBEAT_S * 5))
        except ray.exceptions.ActorDiedError:  # killed for good: follow a new hub of that name, if any
            with background.held("find the hub"):
                before = hub.handle()
                if hub.handle(fresh=True) is before:
                    return
            unknown = {m.sub_id for m in members}
        except RayNotRunningError:
            raise
        except Exception:  # restarting or busy: try again next beat
            return
        for member in members:
            if member.sub_id not in unknown:
                continue
            logger.warning(
                "%s: hub %r does not know this subscriber (restarted?); registering again",
                member.sub_id,
                hub.name,
            )
            try:
                member.start_from(self.calls(member, thread=True).register(member.registration()))
            except RayNotRunningError:
                raise
            except Exception as err:
                logger.warning("%s could not register again: %s", member.sub_id, err)
        for member in members:
            tell = getattr(member, "heartbeat_report", None)
            try:
                report = tell() if tell is not None else None
                if report is not None:
                    self.report(member, report)
            except Exception as err:  # never let one member stop the heartbeat
                logger.warning("%s could not tell the hub of local changes: %s", member.sub_id, err)


_MEMBERSHIP: Membership | None = None
_MEMBERSHIP_LOCK = threading.Lock()


def membership() -> Membership:
    """This process's :class:`Membership` (made on first use)."""
    global _MEMBERSHIP
    with _MEMBERSHIP_LOCK:
        if _MEMBERSHIP is None:
            _MEMBERSHIP = Membership()
        return _MEMBERSHIP

"""A client's writer side: stamping its versions from the lease, publishing them, reading the hub's answers.

:class:`~raysync.HubClient` pushes through one :class:`Writer`; queries (``latest``, ``status``,
``wait``) only ask it to settle first: the hub's answers to this client's publishes that did not
wait are read (and what the hub refused raises on the next push).

Example:
    >>> writer = Writer("raysync", "raysync", takeover=False, calls=lambda: calls)  # doctest: +SKIP
    >>> writer.next_version("policy")                                                # doctest: +SKIP
    4
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from raysync._protocol import BLOCK, Publication
from raysync.client import deadline
from raysync.client.identity import writer_identity
from raysync.client.push import PushPipeline
from raysync.client.writer_lease import LeaseMoved, Publishes, WriterLease, lease_of
from raysync.errors import RaySyncError, StaleWriterError, UnknownModelError
from raysync.hub.state import Version

if TYPE_CHECKING:
    from raysync.client.hub_calls import HubCalls
    from raysync.hub.state.rounds import PartTaken

__all__ = ["Writer", "alive"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Writer:
    """What one client writes: its push pipeline, its publishes in flight, the leases it holds.

    Args:
        name, namespace: the hub's.
        takeover: take the model's writer lease from a live writer (``connect(takeover=...)``).
        calls: the hub's methods, as this client calls them (within its deadlines).
    """

    def __init__(self, name: str, namespace: str, *, takeover: bool, calls: Callable[[], HubCalls]) -> None:
        self.name, self.namespace, self.takeover = name, namespace, takeover
        self._calls = calls
        self.last_push: dict[str, Any] = {}
        self.publishes, self.moved = Publishes(), LeaseMoved(name)
        # The pipeline calls back through a weak reference: no cycle, so the version it keeps
        # leaves the object store as soon as the client is dropped (not at the next GC).
        me = weakref.ref(self)
        self.pipeline = PushPipeline(
            lambda *args: alive(me).publish(*args),
            previous=lambda model_id: alive(me).hub_newest(model_id),
            lost=lambda model_id, version: alive(me)._calls().lost(model_id, version),
            contribute=lambda *args: alive(me).contribute(*args),
            post=lambda *args: alive(me).post_contribute(*args),
            give_up=lambda *args: alive(me)._calls().post_give_up(*args),
        )

    def lease(self, model_id: str) -> WriterLease:
        return lease_of(self.name, self.namespace, model_id)

    def pusher(self) -> dict[str, Any]:
        """Who pushes, as the hub records it: this process and what its last push did."""
        return {**writer_identity(), **self.last_push}

    def publish(self, model_id: str, manifest: Any, refs: list[Any]) -> int:
        """Stamp the version from this process's block and publish it; wait only for a new layout.

        A layout the hub has not accepted from this writer yet (first push, new structure, after a refusal
        or a lease taken back: :class:`.LeaseMoved`) waits for the answer; others read it on the next call.
        """
        pusher, calls = self.pusher(), self._calls()
        lease = self.lease(model_id)
        with lease.lock:
            self.moved.take_back_if_moved(model_id, lease)
            version, epoch = lease.take(
                lambda: calls.acquire(model_id, pusher, self.takeover, BLOCK),
                lambda: calls.post_acquire(model_id, pusher, self.takeover, BLOCK),
            )
            if lease.confirmed == manifest.layout_hash:
                pub = Publication(model_id, manifest, tuple(refs), pusher, version, epoch)
                # Submitted here, before the push returns (a thread of its own would save the
                # trainer ~0.5 ms, but then a process the trainer told about the version could
                # ask the hub before the publish was even sent).
                self.publishes.add(model_id, version, epoch, calls.post_publish_stamped(pub))
                return version
            try:
                calls.publish(model_id, manifest, refs, pusher, self.takeover, version, epoch)
            except StaleWriterError:
                lease.lose()
                raise
            lease.confirmed = manifest.layout_hash
            self.publishes.sent(model_id, version, epoch)
        return version

    def contribute(self, model_id: str, part: Any, refs: list[Any], pusher: Any, *args: Any) -> PartTaken:
        """A rank's part of a sharded push (hub/sharded.py; ``args``: timeout, settle, previous)."""
        return self._calls().contribute(model_id, part, refs, pusher, self.takeover, *args)

    def post_contribute(
        self,
        model_id: str,
        part: Any,
        refs: list[Any],
        pusher: Any,
        timeout: float,
        previous: Any,
        stamp: int,
    ) -> Any:
        """A rank's part it numbered ``stamp`` itself, sent without waiting; the answer's ref (read
        by :class:`~raysync.client.posted.PostedParts`)."""
        calls = self._calls()
        return calls.post_contribute(
            model_id, part, refs, pusher, self.takeover, timeout, False, previous, stamp
        )

    def next_version(self, model_id: str) -> int:
        """The number this writer's next push of ``model_id`` gets (see :meth:`.HubClient.next_version`)."""
        self.settle(model_id, wait=False)
        with (lease := self.lease(model_id)).lock:
            self.moved.check_now(model_id, lease)
            return lease.peek(lambda: self._calls().acquire(model_id, self.pusher(), self.takeover, BLOCK))

    def settle(self, model_id: str, *, wait: bool, raise_refused: bool = True) -> None:
        """Read the hub's answers to this client's publishes of ``model_id`` (see :meth:`.HubClient.push`).

        Offers the newest version again if a hub restart swallowed its publish, and
        raises (with ``raise_refused``) what the hub refused since the last time.
        """
        if wait:  # a sharded rank's posted parts reached the hub (a push reads them itself)
            self.pipeline.posted.read(model_id, wait=True, timeout=deadline.left(60.0))
        lease = self.lease(model_id)
        swallowed = self.publishes.settle(model_id, lease, wait=wait, timeout=deadline.left(60.0))
        mine = self.pipeline.last.get(model_id)
        sent = self.publishes.epochs.get(model_id)
        if swallowed is not None and mine is not None and sent is not None and sent[0] == mine.version:
            logger.info("a hub restart swallowed version %d of %r: offering it again", swallowed, model_id)
            try:
                self._calls().publish(
                    model_id, mine.manifest, mine.refs, mine.pusher, self.takeover, mine.version, sent[1]
                )
            except RaySyncError as err:
                self.publishes.keep_refusal(model_id, self.lease(model_id), mine.version, sent[1], err)
        if raise_refused:
            self.publishes.raise_refused(model_id)

    def settle_all(self) -> None:
        """Before a query: this client's publishes have reached the hub (refusals are kept for later)."""
        for model_id in sorted(set(self.publishes.models()) | set(self.pipeline.posted.models())):
            self.settle(model_id, wait=True, raise_refused=False)

    def hub_newest(self, model_id: str) -> Version | None:
        try:
            info = self._calls().get(model_id)
        except UnknownModelError:
            return None
        return None if info is None else Version(info.version, info.manifest, list(info.refs), 0.0, {})


def alive(ref: weakref.ReferenceType[_T]) -> _T:
    """What a weak reference held back from a cycle (a client, its writer) refers to; it must live."""
    referent = ref()
    assert referent is not None, "a client's writer or push pipeline outlived what it belongs to"
    return referent

"""The hub's methods as typed calls: one method here per hub method a trainer or a receiver calls.

Every call to the hub from outside it goes through :class:`HubCalls`, so what each hub method
takes and answers is written once, in types mypy checks at every call site, and
``tests/unit/test_hub_calls.py`` checks each of these against the hub actor's own method of the
same name (its parameters, in order). A call here waits for the answer (through hub restarts,
within the caller's deadline); ``post_*`` sends without waiting and returns the reply's
``ObjectRef`` (Ray keeps one caller's calls in order).

Example:
    >>> calls = calls_to(lambda fresh: ray.get_actor("raysync", namespace="raysync"))  # doctest: +SKIP
    >>> calls.latest("policy")                                                        # doctest: +SKIP
    3
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raysync import _compat
from raysync import _protocol as proto
from raysync.client.locate import call_hub

if TYPE_CHECKING:
    from ray import ObjectRef

    from raysync._protocol import Announcement, ApplyReport, Grant, Publication, Registration, WaitResult
    from raysync.client.push import Offer
    from raysync.core.layout import Manifest
    from raysync.core.shards import ShardPart
    from raysync.hub.settings import HubSettings
    from raysync.hub.state.rounds import PartTaken

__all__ = ["HubCalls", "calls_to"]

Caller = Callable[..., Any]  # (method name, *args) -> the hub's answer (or, to post, its ObjectRef)


class HubCalls:
    """The hub's methods, typed; ``call`` waits for an answer, ``post`` only sends.

    Args:
        call: ``call(method, *args)`` returns the hub's answer (it retries through hub restarts
            and raises what the hub raised).
        post: ``post(method, *args)`` sends without waiting and returns the reply's ``ObjectRef``
            (``None``: this side never posts).
    """

    def __init__(self, call: Caller, post: Caller | None = None) -> None:
        self._call, self._send = call, post

    def _post(self, method: str, *args: Any) -> ObjectRef:
        if self._send is None:
            raise TypeError(f"these hub calls only wait for answers: {method} cannot be posted")
        return self._send(method, *args)

    # -- writers ----------------------------------------------------------------
    def configure(self, keep: int | None = None) -> dict[str, Any]:
        return self._call("configure", keep)

    def acquire(self, model_id: str, pusher: dict[str, Any], takeover: bool, count: int) -> Grant:
        return self._call(proto.ACQUIRE, model_id, pusher, takeover, count)

    def post_acquire(self, model_id: str, pusher: dict[str, Any], takeover: bool, count: int) -> ObjectRef:
        return self._post(proto.ACQUIRE, model_id, pusher, takeover, count)

    def publish(
        self,
        model_id: str,
        manifest: Manifest,
        refs: list[Any],
        pusher: dict[str, Any],
        takeover: bool = False,
        version: int | None = None,
        epoch: int | None = None,
    ) -> int:
        return self._call(proto.PUBLISH, model_id, manifest, refs, pusher, takeover, version, epoch)

    def post_publish_stamped(self, pub: Publication) -> ObjectRef:
        return self._post(proto.PUBLISH_STAMPED, pub)

    def contribute(
        self,
        model_id: str,
        part: ShardPart,
        refs: list[Any],
        pusher: dict[str, Any],
        takeover: bool = False,
        timeout: float = 60.0,
        settle: bool = True,
        previous: int | None = None,
        stamp: int | None = None,
    ) -> PartTaken:
        return self._call(
            proto.CONTRIBUTE, model_id, part, refs, pusher, takeover, timeout, settle, previous, stamp
        )

    def post_contribute(
        self,
        model_id: str,
        part: ShardPart,
        refs: list[Any],
        pusher: dict[str, Any],
        takeover: bool,
        timeout: float,
        settle: bool,
        previous: int | None,
        stamp: int,
    ) -> ObjectRef:
        """A rank's part numbered ``stamp`` by the rank itself, sent without waiting for the answer."""
        args = (model_id, part, refs, pusher, takeover, timeout, settle, previous, stamp)
        return self._post(proto.CONTRIBUTE, *args)

    def post_give_up(self, model_id: str, token: str, round: int, rank: int, why: str) -> ObjectRef:
        return self._post(proto.GIVE_UP, model_id, token, round, rank, why)

    def restore(
        self, model_id: str, version: int, manifest: Manifest, refs: list[Any], pusher: dict[str, Any]
    ) -> bool:
        return self._call("restore", model_id, version, manifest, refs, pusher)

    def restore_part(
        self, model_id: str, version: int, part: ShardPart, refs: list[Any], pusher: dict[str, Any]
    ) -> bool:
        return self._call("restore_part", model_id, version, part, refs, pusher)

    def offer(self, offer: Offer, pusher: dict[str, Any]) -> bool:
        """Offer a version a hub restart lost again (:meth:`restore` or :meth:`restore_part`)."""
        model_id, version, payload, refs = offer.args
        if offer.part:
            return self.restore_part(model_id, version, payload, refs, pusher)
        return self.restore(model_id, version, payload, refs, pusher)

    def lost(self, model_id: str, version: int) -> None:
        self._call("lost", model_id, version)

    # -- anyone ------------------------------------------------------------------
    def settings(self) -> HubSettings:
        return self._call("settings")

    def latest(self, model_id: str) -> int | None:
        return self._call("latest", model_id)

    def get(
        self, model_id: str, version: int | None = None, newer_than: int | None = None
    ) -> Announcement | None:
        return self._call(proto.GET, model_id, version, newer_than)

    def wait(
        self,
        model_id: str,
        version: int,
        timeout: float | None,
        include_pull: bool = False,
        report_missing: bool = False,
        subscribers: int = 0,
    ) -> WaitResult:
        return self._call("wait", model_id, version, timeout, include_pull, report_missing, subscribers)

    def post_wait(
        self,
        model_id: str,
        version: int,
        timeout: float | None,
        include_pull: bool = False,
        report_missing: bool = False,
        subscribers: int = 0,
    ) -> ObjectRef:
        return self._post("wait", model_id, version, timeout, include_pull, report_missing, subscribers)

    def status(self) -> dict[str, Any]:
        return self._call("status")

    # -- receivers ---------------------------------------------------------------
    def register(self, reg: Registration) -> Announcement | None:
        return self._call(proto.REGISTER, reg)

    def unregister(self, sub_id: str) -> None:
        self._call(proto.UNREGISTER, sub_id)

    def post_report(self, sub_id: str, report: ApplyReport) -> ObjectRef:
        return self._post(proto.REPORT, sub_id, report)

    def post_heartbeat(self, sub_ids: list[str]) -> ObjectRef:
        return self._post(proto.HEARTBEAT, sub_ids)

    def wait_newer(self, model_id: str, version: int, timeout: float) -> Announcement | None:
        return self._call(proto.WAIT_NEWER, model_id, version, timeout)


def calls_to(
    handle: Callable[..., Any], *, timeout: float | None = None, stopped: Callable[[], bool] | None = None
) -> HubCalls:
    """The hub's methods through :func:`~raysync.client.locate.call_hub` (``handle(fresh)`` finds the
    hub; ``timeout`` and ``stopped`` as there); posts go to the handle as it is."""

    def post(method: str, *args: Any) -> Any:
        return _compat.call_no_start(getattr(handle(False), method), *args)

    return HubCalls(
        lambda method, *args: call_hub(handle, method, *args, timeout=timeout, stopped=stopped), post
    )

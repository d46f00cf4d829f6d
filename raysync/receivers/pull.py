"""Pull mode: ``raysync_sync()`` takes the newest version when the actor asks.

From a plain method (threads), an async method (the event loop), or a plain method
of an async actor (on the loop: the apply waits for suspended async methods). Its
``timeout`` bounds asking the hub and the fetch (``SyncTimeoutError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from ray.exceptions import GetTimeoutError

from raysync import _protocol as proto
from raysync._protocol import Announcement, ApplyReport
from raysync.client.locate import call_hub_async
from raysync.errors import RaySyncError, SyncTimeoutError, UnknownModelError
from raysync.receivers.membership import membership

if TYPE_CHECKING:
    from raysync.receivers.membership import Member
    from raysync.receivers.pipeline import Applier, Prepared
    from raysync.receivers.subscription import SyncSpec
    from raysync.receivers.synced import _ActorSync

__all__ = ["PullSync", "deadline_of", "left_of"]

_HUB_QUERY_S = 10.0  # raysync_sync() without a timeout waits this long for the hub (it may be restarting)


class PullSync:
    """The pull-mode half of a subscription (mixed into it)."""

    if TYPE_CHECKING:
        spec: SyncSpec
        sync: _ActorSync
        sub_id: str

        @property
        def version(self) -> int | None: ...

        _info: Any
        _deferred: asyncio.Task[None] | None

        applier: Applier

        # Provided by the subscription (see raysync.receivers.subscription).
        receive: Callable[..., ApplyReport]
        receive_async: Callable[..., Awaitable[ApplyReport]]
        report: Callable[[ApplyReport], None]
        check_binding: Callable[[], bool]

    def _member(self) -> Member:
        return cast("Member", self)  # the subscription this is mixed into is one

    def _newer(self, timeout: float | None) -> Announcement | None:
        bound = _HUB_QUERY_S if timeout is None else timeout
        try:
            info = (
                membership()
                .calls(self._member(), timeout=bound)
                .get(self.spec.model_id, None, self.version or 0)
            )
        except GetTimeoutError:
            raise self._hub_timeout(timeout) from None
        except UnknownModelError:
            return None  # nothing pushed yet (or kept since a hub restart)
        return info

    def _hub_timeout(self, timeout: float | None) -> SyncTimeoutError:
        why = (
            f"the hub did not answer within {_HUB_QUERY_S:.0f} s (restarting?)"
            if timeout is None
            else f"raysync_sync(timeout={timeout}) ran out asking the hub"
        )
        return SyncTimeoutError(
            f"{self.sub_id}: {why} for the newest version of {self.spec.model_id!r}; it keeps version "
            f"{self.version}"
        )

    def _synced(self, version: int, reply: ApplyReport) -> bool:
        """Report a raysync_sync apply to the hub; raise if it failed; whether it applied a newer one."""
        self.report(reply)
        if reply.error is not None:
            error = SyncTimeoutError if reply.timed_out else RaySyncError
            raise error(f"raysync_sync could not apply version {version}: {reply.error_text()}")
        return reply.skipped is None and reply.deferred is None

    def sync_newest(self, timeout: float | None, *, on_loop: bool = False) -> bool:
        """``raysync_sync`` from a plain method; ``on_loop``: of an async actor (on its event loop,
        or a thread of it, whose apply takes the write lock through the loop)."""
        try:
            loop = asyncio.get_running_loop() if on_loop else None
        except RuntimeError:
            loop = None
        if self._info is None:
            return False
        if loop is not None:
            self.sync.loop = loop
        deadline = deadline_of(timeout)
        info = self._newer(timeout)
        if info is None:
            return False
        refs = list(info.refs)
        if loop is None:
            reply: ApplyReport | None = self.receive(
                info.version, info.manifest, refs, fetch_timeout=left_of(deadline)
            )
        else:
            reply = self._receive_on_loop(info.version, info.manifest, refs, left_of(deadline), loop)
        return reply is not None and self._synced(info.version, reply)

    async def sync_newest_async(self, timeout: float | None) -> bool:
        if self._info is None:
            return False
        deadline = deadline_of(timeout)
        try:
            info = await call_hub_async(
                membership().hub(self._member()).handle,
                proto.GET,
                self.spec.model_id,
                None,
                self.version or 0,
                timeout=_HUB_QUERY_S if timeout is None else timeout,
            )
        except asyncio.TimeoutError:
            raise self._hub_timeout(timeout) from None
        except UnknownModelError:
            return False
        if info is None:
            return False
        reply = await self.receive_async(
            info.version, info.manifest, list(info.refs), fetch_timeout=left_of(deadline)
        )
        return self._synced(info.version, reply)

    def _receive_on_loop(
        self, version: int, manifest: Any, refs: list[Any], timeout: float | None, loop: Any
    ) -> ApplyReport | None:
        """Apply on an async actor's event loop; None: the commit waits for suspended async methods."""
        self.check_binding()
        step = self.applier.prepare(version, manifest, refs, timeout=timeout, on_loop=True)
        if isinstance(step, ApplyReport):
            return step
        lock = self.sync.async_lock
        if not lock.try_write():
            # Async methods are suspended mid-call: the apply waits for them on the loop.
            self._deferred = loop.create_task(self._commit_when_free(step))
            return None
        try:
            return self.applier.commit(step, guard=contextlib.nullcontext)
        finally:
            lock.release_write()

    async def _commit_when_free(self, step: Prepared) -> None:
        self.report(await self.applier.commit_async(step, self.sync.async_lock.write))


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def left_of(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())

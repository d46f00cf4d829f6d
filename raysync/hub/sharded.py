"""The hub's side of sharded writers: gather every rank's part, publish one version (a part of the actor).

Each rank of a sharded trainer calls :meth:`ShardedPublish.contribute` with its own part
(its pieces' refs and layout). The call waits until every rank's part of that push is in;
the last one merges them (:func:`raysync.core.shards.merge`) and publishes one version,
stamped by the hub, whose number every rank's call returns. The group is the model's
writer: the lease is taken in group rank 0's name (its process), so another live group
is refused (``StaleWriterError``) and a restarted one takes over from a dead one. A push
some rank never completes (it died, or timed out) is dropped: nothing is published,
readers stay on the previous version, and the other ranks' calls raise.

Example:
    >>> v = ray.get(hub.contribute.remote("policy", part, refs, pusher, False, 60.0))   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from raysync.core.shards import ShardPart, merge
from raysync.errors import InvalidWeightsError, RaySyncError, SyncTimeoutError
from raysync.hub.state.groups import Round, Rounds

__all__ = ["ShardedPublish"]

logger = logging.getLogger(__name__)

_PUBLISHING_S = 60.0  # a rank whose wait ends while the merged version is published waits this much more


class ShardedPublish:
    """Sharded pushes (a part of :class:`~raysync.hub.actor.WeightHub`)."""

    _rounds: Rounds
    _round_done: dict[int, tuple[Round, asyncio.Future[int]]]

    publish: Callable[..., Awaitable[int]]  # the actor's

    def _future(self, rnd: Round) -> asyncio.Future[int]:
        held = self._round_done.get(id(rnd))
        if held is None:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: no "never retrieved"
            held = self._round_done[id(rnd)] = (rnd, fut)
        return held[1]

    def _settle_round(
        self, rnd: Round, version: int | None = None, error: BaseException | None = None
    ) -> None:
        held = self._round_done.pop(id(rnd), None)
        if held is None or held[1].done():
            return
        if error is not None:
            held[1].set_exception(error)
        else:
            assert version is not None
            held[1].set_result(version)

    async def contribute(
        self,
        model_id: str,
        part: ShardPart,
        refs: list[Any],
        pusher: dict[str, Any],
        takeover: bool = False,
        timeout: float = 60.0,
    ) -> int:
        """One rank's part of a sharded push; the version once every rank's part is in and published.

        Raises:
            SyncTimeoutError: not every rank's part came within ``timeout`` seconds (the push is
                dropped: nothing is published).
            InvalidWeightsError: the ranks disagree on the tensors or their layout, a shard is
                missing or duplicated (naming the tensor), or this push was dropped because a
                rank moved on to another.
            WeightMismatchError, StaleWriterError: as for any publish (all ranks get it).
        """
        rnd, dropped = self._rounds.add(model_id, part, list(refs), {**pusher, "takeover": takeover})
        if dropped is not None:
            self._settle_round(
                dropped,
                error=InvalidWeightsError(
                    f"push {dropped.round} of {model_id!r} ({dropped.world} ranks) was dropped unpublished: "
                    f"rank {part.rank} pushed {part.round} ({part.world} ranks) before ranks "
                    f"{dropped.missing()} pushed theirs"
                ),
            )
            logger.warning(
                "hub: sharded push %d of %r dropped: ranks %s never pushed",
                dropped.round,
                model_id,
                dropped.missing(),
            )
        fut = self._future(rnd)
        if rnd.complete():
            await self._publish_round(rnd)
            return await fut
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            if not self._rounds.drop(rnd):  # closed meanwhile: being published
                return await asyncio.wait_for(asyncio.shield(fut), _PUBLISHING_S)
            error = SyncTimeoutError(
                f"sharded push {rnd.round} of {model_id!r}: ranks {rnd.missing()} of {rnd.world} did not "
                f"push their shards within {timeout} s (died or stalled); nothing was published and "
                "readers keep the previous version"
            )
            self._settle_round(rnd, error=error)
            raise error from None

    async def _publish_round(self, rnd: Round) -> None:
        parts = [(rnd.parts[r][0], rnd.parts[r][1]) for r in sorted(rnd.parts)]
        lead = dict(rnd.parts[0][2])
        takeover = bool(lead.pop("takeover", False))
        try:
            manifest, refs = merge(parts)
            lead.update(ranks=rnd.world, sharded=True)
            version = await self.publish(rnd.model_id, manifest, list(refs), lead, takeover)
        except RaySyncError as err:
            self._settle_round(rnd, error=err)
            return
        except Exception as err:  # never leave the ranks waiting
            self._settle_round(rnd, error=InvalidWeightsError(f"{type(err).__name__}: {err}"))
            return
        self._settle_round(rnd, version)

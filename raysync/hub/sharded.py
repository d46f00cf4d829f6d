"""The hub's side of sharded writers: record each rank's part, publish one version (the actor holds one).

Each rank of a sharded trainer sends :meth:`ShardedPublish.contribute` its own part (its
pieces' refs and layout). The first part of a push opens a *round* numbered from the group's
block (written to the GCS before any number of it is handed out); the answer tells every rank
how its next pushes are numbered (:class:`~raysync.hub.state.rounds.Ahead`), so it stamps them
and posts their parts without waiting. When the last part is in, the hub merges the parts
(:func:`raysync.core.shards.merge`) and publishes the version under that number, in round order.

The group is the model's writer: the lease is held in group rank 0's name (its process),
checked for every rank's part in that name (each rank learns its group's rank 0 and a token
of the group at its first push over a process group: :mod:`raysync.core.group`) and again
at publish, so every rank of another live group is refused (``StaleWriterError``), a
restarted one takes over from a dead one, and the parts of two groups are never merged.

A round that never completes is abandoned (:mod:`raysync.hub.state.rounds`): when ``timeout``
seconds pass after its first part (a rank died or stalled), when another group takes over,
when the group runs too far ahead of it, or when a rank's push of it raised before its part
was sent (the rank's client says so: :meth:`ShardedPublish.give_up`; every push is counted
from its start, so the ranks' counts stay in step whatever raised). Its number is never
published: readers stay on the previous version, later rounds get higher numbers,
``hub.status()["abandoned"]`` lists it, and ``hub.wait`` of the number (until a newer version
is published) raises why. A rank's next push is told why (a warning in that process), and
its part is taken as usual. A round lost in a hub restart (some ranks' parts went to the hub
before it) is abandoned as soon as the hub sees it cannot complete, quietly: the group goes on.

A version published before a hub restart that lost it is kept again once every rank offered
its part of it (:meth:`ShardedPublish.restore_part`, what a rank's ``hub.wait`` does when the
hub answers that it lacks the version), as one writer's wait offers its version again.

Example:
    >>> v = ray.get(hub.contribute.remote("policy", part, refs, pusher, settle=False))   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from raysync.core.shards import ShardPart, merge
from raysync.errors import InvalidWeightsError, RaySyncError, StaleWriterError, SyncTimeoutError
from raysync.hub.mailbox import quiet
from raysync.hub.numbering import RoundNumbers
from raysync.hub.persistence import HubStore
from raysync.hub.state import HubState
from raysync.hub.state.leases import who
from raysync.hub.state.rounds import PartTaken, Round, Rounds

__all__ = ["ShardedPublish"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Held:
    """What the hub holds for one unsettled round: its outcome, its grant's write, its deadline."""

    outcome: asyncio.Future[int]
    saved: asyncio.Future[None]
    timer: asyncio.TimerHandle | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class ShardedPublish:
    """Sharded pushes: each rank's part recorded, one version published per round.

    :class:`~raysync.hub.actor.WeightHub` holds one and answers ``contribute``, ``give_up`` and
    ``restore_part`` with it.

    Args:
        state, store: the hub's state and its GCS records.
        publish: the hub's ``publish`` (a round's merged version is published as any other).
        restore: the hub's ``restore`` (a lost version offered again by every rank is kept again).
        check_writer: ``check_writer(model_id, lead, takeover)`` raises ``StaleWriterError`` unless
            the group's rank 0 may write ``model_id``.
    """

    def __init__(
        self,
        state: HubState,
        store: HubStore,
        *,
        publish: Callable[..., Awaitable[int]],
        restore: Callable[..., Awaitable[bool]],
        check_writer: Callable[[str, dict[str, Any], bool], Awaitable[None]],
    ) -> None:
        self._state, self._store = state, store
        self._latest = state.versions.latest  # the version readers keep of a model (None: none yet)
        self._publish, self._restore, self._check_writer = publish, restore, check_writer
        self._rounds = Rounds()
        self._round_held: dict[int, _Held] = {}
        self._round_lock: dict[str, asyncio.Lock] = {}
        self._block_saved: dict[str, asyncio.Future[None]] = {}  # the write of each model's block of numbers
        self._offered: dict[tuple[str, int], dict[int, tuple[ShardPart, list[Any], dict[str, Any]]]] = {}
        self._numbers = RoundNumbers(state, self._rounds)
        self._rank_locks: dict[tuple[str, str, int], asyncio.Lock] = {}  # (model, group token, rank)

    async def contribute(
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
        """Record one rank's part of a sharded push; the version number granted to its round.

        Returns once the part is recorded (``settle=False``) or once the round is published
        (``settle=True``). ``previous``: the number this rank's last push returned without
        settling; if that round failed since, the answer says why (the part is taken all the same).
        ``stamp``: the number the rank gave the push itself, from the :class:`Ahead` of an earlier
        answer (it posted the part without waiting for this answer); a part whose stamp is not its
        round's number is refused and its round abandoned.

        Raises:
            SyncTimeoutError: with ``settle``, not every rank's part came within ``timeout``
                seconds (nothing is published).
            InvalidWeightsError: a rank's second part for one push, a part of a push the group
                moved past or that another rank gave up; with ``settle``: the ranks disagree on
                the tensors or their layout, a shard is missing or duplicated (naming the tensor),
                or the group moved on before every rank pushed.
            StaleWriterError: the part's group is not the model's writer (another live writer
                holds the lease, checked for every rank in its group rank 0's name), or another
                group replaced it.
            WeightMismatchError: as for any publish.
            InvalidWeightsError: ``stamp`` is not the number of the part's round.
        """
        # One rank's parts are taken in the order it sent them: parts it posts without waiting
        # reach this async actor as concurrent calls, and Ray starts them in that order.
        key = (model_id, part.group, part.rank)
        lock = self._rank_locks.setdefault(key, asyncio.Lock())
        async with lock:
            try:
                rnd, held, earlier = await self._take(
                    model_id, part, refs, pusher, takeover, timeout, previous, stamp
                )
            except RaySyncError as err:
                if stamp is not None:
                    self._numbers.refused(model_id, stamp, err)
                raise
        if len(self._rank_locks) > 1024:  # ranks of groups long gone
            for old in [k for k, v in self._rank_locks.items() if not v.locked() and k != key][:512]:
                del self._rank_locks[old]
        assert rnd.version is not None
        ahead = self._numbers.ahead(model_id, part.group, rnd)
        if not settle:
            return PartTaken(rnd.version, earlier, ahead)
        return PartTaken(await asyncio.shield(held.outcome), earlier, ahead)

    async def _take(
        self,
        model_id: str,
        part: ShardPart,
        refs: list[Any],
        pusher: dict[str, Any],
        takeover: bool,
        timeout: float,
        previous: int | None,
        stamp: int | None,
    ) -> tuple[Round, _Held, str | None]:
        """Check and record one rank's part; ``(its round, what the hub holds of it, earlier)``."""
        lead = _lead_of(pusher, part)
        try:
            await self._check_writer(model_id, lead, takeover)
        except StaleWriterError as err:
            if part.rank == 0:
                raise
            raise StaleWriterError(
                f"rank {part.rank} of a sharded group whose rank 0 is {who(lead)}: {err}"
            ) from None
        earlier = None
        if previous is not None:
            failure = self._rounds.refusal(model_id, previous)
            earlier = None if failure is None else str(failure)
            self._lost_in_restart(model_id, part, previous)
        pusher = {**pusher, "takeover": takeover}
        rnd, dropped = self._rounds.add(model_id, part, list(refs), pusher)
        self._abandon(dropped, f"another group of {part.world} ranks (restarted, or taking over) pushed")
        held = self._round_held.get(id(rnd))
        if held is None:
            loop = asyncio.get_running_loop()
            number, persist = self._numbers.open(model_id, rnd, stamp)
            self._rounds.granted(rnd, number)
            saved = self._block_saved.get(model_id)
            failed = saved is not None and saved.done() and (saved.cancelled() or saved.exception())
            if persist or saved is None or failed:  # a new block: written before any number is handed out
                write = self._store.save_model(model_id, self._state.models[model_id])
                saved = self._block_saved[model_id] = asyncio.wrap_future(write)
            outcome: asyncio.Future[int] = quiet(loop.create_future())
            held = self._round_held[id(rnd)] = _Held(outcome, saved)
            held.timer = loop.call_later(timeout, self._expire, rnd, timeout)
        await asyncio.shield(held.saved)  # no rank gets a number before it is written
        assert rnd.version is not None
        if stamp is not None and stamp != rnd.version:
            self._refuse_stamp(rnd, part, stamp)
        if rnd.lost:  # a part of a push whose other parts went to the hub before its restart
            self._abandon([rnd], "")
        elif rnd.complete() and not held.tasks:
            if held.timer is not None:
                held.timer.cancel()
            task = asyncio.get_running_loop().create_task(self._publish_round(rnd))
            held.tasks.add(task)
        return rnd, held, earlier

    def _refuse_stamp(self, rnd: Round, part: ShardPart, stamp: int) -> None:
        """A rank numbered its part ``stamp``, but its round is ``rnd.version``: abandon the round."""
        error = InvalidWeightsError(
            f"rank {part.rank} numbered its part of push {rnd.round} of {rnd.model_id!r} version {stamp}, "
            f"but the hub numbered that push {rnd.version} (it restarted, or other numbers were issued "
            f"meanwhile): the push is abandoned unpublished, readers keep version "
            f"{self._latest(rnd.model_id)}; the group's next push is numbered afresh"
        )
        logger.warning("hub: %s", error)
        self._rounds.refuse_stamp(rnd, part.group, stamp, error)
        self._numbers.given(rnd.model_id, stamp)
        self._settle_round(rnd, error=error)
        raise error

    def give_up(self, model_id: str, token: str, round: int, rank: int, why: str) -> None:
        """Rank ``rank``'s push ``round`` raised before its part was recorded: abandon that push.

        Sent without waiting by the rank's client (:meth:`raysync.HubClient.push`). The round
        is abandoned at once if it is open (the other ranks' parts are let go, a wait for its
        number raises why); the parts of it that come later are refused. Every rank's push is
        numbered from the start of the call, so the ranks' counts stay in step.
        """
        if not (isinstance(token, str) and isinstance(round, int) and isinstance(rank, int)):
            return
        why = str(why)[:500]
        rnd = self._rounds.give_up(model_id, token, round, rank, why)
        if rnd is None:
            logger.info("hub: rank %d gave up push %d of %r: %s", rank, round, model_id, why)
            self._numbers.skip(model_id, token, round, rank, why)
            return
        error = InvalidWeightsError(
            f"version {rnd.version} of {rnd.model_id!r} (push {rnd.round}, {rnd.world} ranks) was abandoned "
            f"unpublished: rank {rank}'s push of it raised {why}; readers keep version "
            f"{self._latest(rnd.model_id)}"
        )
        logger.warning("hub: %s", error)
        self._settle_round(rnd, error=error)

    async def restore_part(
        self, model_id: str, version: int, part: ShardPart, refs: list[Any], pusher: dict[str, Any]
    ) -> bool:
        """A rank offers its part of a version a hub restart lost; whether the hub keeps the version.

        The version is kept again (as a single writer's :meth:`restore` keeps one) once every
        rank of its group offered its part: the parts are merged and checked as at its push,
        under rank 0's name (the group's lease). Until then the parts are held (those of an
        older version are dropped); ``False`` says the version is not kept yet.
        """
        model = self._state.models.get(model_id)
        if model is not None and version in model.versions:
            return True
        self._forget_offers(model_id, before=version)  # a newer version is offered: not the older ones
        parts = self._offered.setdefault((model_id, version), {})
        if any(p.world != part.world or p.group != part.group for p, _, _ in parts.values()):
            parts.clear()  # another group offers it: the other group's parts are not wanted
        parts[part.rank] = (part, list(refs), pusher)
        if len(parts) < part.world:
            logger.info(
                "hub: rank %d offered its part of lost version %d of %r again; waiting for ranks %s",
                part.rank,
                version,
                model_id,
                sorted(set(range(part.world)) - set(parts)),
            )
            return False
        del self._offered[(model_id, version)]
        try:
            manifest, merged = merge([(p, r) for p, r, _ in parts.values()])
        except RaySyncError as err:
            logger.warning(
                "hub: lost version %d of %r, offered again, does not merge: %s", version, model_id, err
            )
            return False
        lead = {**parts[0][2], "ranks": part.world, "sharded": True}  # merge checked rank 0 is in
        kept = await self._restore(model_id, version, manifest, list(merged), lead)
        if kept:  # published before the restart after all: not lost
            self._rounds.forget_failure(model_id, version)
        return kept

    def _forget_offers(self, model_id: str, *, before: int) -> None:
        """Drop the parts offered again of ``model_id``'s lost versions older than ``before``."""
        for key in [k for k in self._offered if k[0] == model_id and k[1] < before]:
            del self._offered[key]

    async def round_published(self, model_id: str, version: int, timeout: float | None) -> float | None:
        """Until the sharded round granted ``version`` is published; what is left of ``timeout``.

        Returns at once for a number no unsettled round holds, and for an abandoned one once
        a newer version is published (a wait for it then waits for that one, as a wait for a
        refused single-writer number does).

        Raises:
            SyncTimeoutError: the round is still missing ranks' parts after ``timeout`` seconds.
            RaySyncError: why the round was abandoned or refused (while no newer version is).
        """
        failure = self._rounds.failure(model_id, version)
        if failure is not None:
            if version < (self._latest(model_id) or 0):
                return timeout
            raise failure
        rnd = self._rounds.pending(model_id, version)
        held = None if rnd is None else self._round_held.get(id(rnd))
        if rnd is None or held is None:
            return timeout
        t0 = time.monotonic()
        # asyncio.wait, not wait_for: the round's own SyncTimeoutError is a TimeoutError too.
        await asyncio.wait([held.outcome], timeout=timeout)
        if held.outcome.done():
            held.outcome.result()  # raises why the round was abandoned
        else:
            raise SyncTimeoutError(
                f"version {version} of {model_id!r} is not published yet: ranks {rnd.missing()} of "
                f"{rnd.world} have not pushed their shards of it (push {rnd.round}) within {timeout} s"
            )
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))

    def abandoned(self) -> dict[str, list[int]]:
        """The numbers of the rounds abandoned or refused lately, per model (for ``status()``)."""
        return {model_id: sorted(failed) for model_id, failed in self._rounds.failed.items()}

    def _abandon(self, rounds: list[Round], why: str) -> None:
        for rnd in rounds:
            which = f"version {rnd.version} of {rnd.model_id!r} (push {rnd.round}, {rnd.world} ranks) was "
            if rnd.lost:  # quietly: the group goes on
                error = InvalidWeightsError(
                    f"{which}lost unpublished: the hub restarted while the ranks pushed it (ranks "
                    f"{rnd.missing()} sent their shards to the hub before the restart); readers keep version "
                    f"{self._latest(rnd.model_id)} and the group's next push publishes as usual"
                )
            else:
                error = InvalidWeightsError(
                    f"{which}abandoned unpublished: ranks {rnd.missing()} had not pushed their shards "
                    f"when {why} (the group restarted or moved on); readers keep version "
                    f"{self._latest(rnd.model_id)}"
                )
            self._settle_round(rnd, error=error)
            logger.log(logging.INFO if rnd.lost else logging.WARNING, "hub: %s", error)

    def _lost_in_restart(self, model_id: str, part: ShardPart, previous: int) -> None:
        """The rank's first part this hub sees says its previous push was numbered ``previous``, a
        number this hub never saw: that push's part went to the hub before a restart, or is a
        retry still on its way (refused when it comes, after this one). Its round can never
        complete here, so the number is abandoned now, quietly, as a lost round's."""
        if not self._rounds.first_part(model_id, part) or previous <= (self._latest(model_id) or 0):
            return
        if self._rounds.pending(model_id, previous) is not None or self._rounds.failure(model_id, previous):
            return
        error = InvalidWeightsError(
            f"version {previous} of {model_id!r} was lost unpublished: the hub restarted while the ranks "
            f"pushed it (rank {part.rank}'s part of it went to the hub before the restart); readers keep "
            f"version {self._latest(model_id)} and the group's next push publishes as usual"
        )
        self._rounds.fail_number(model_id, previous, error, lost=True)
        logger.info("hub: %s", error)

    def _expire(self, rnd: Round, timeout: float) -> None:
        if not self._rounds.drop(rnd):  # complete (being published) or settled already
            return
        error = SyncTimeoutError(
            f"version {rnd.version} of {rnd.model_id!r} (push {rnd.round}): ranks {rnd.missing()} of "
            f"{rnd.world} did not push their shards within {timeout} s (died or stalled); nothing was "
            f"published and readers keep version {self._latest(rnd.model_id)}"
        )
        logger.warning("hub: %s", error)
        self._settle_round(rnd, error=error)

    def _settle_round(
        self, rnd: Round, version: int | None = None, error: BaseException | None = None
    ) -> None:
        self._rounds.settle(rnd, error)
        held = self._round_held.pop(id(rnd), None)
        if held is None or held.outcome.done():
            return
        if held.timer is not None:
            held.timer.cancel()
        if error is not None:
            held.outcome.set_exception(error)
        else:
            assert version is not None
            held.outcome.set_result(version)

    async def _publish_round(self, rnd: Round) -> None:
        parts = [(rnd.parts[r][0], rnd.parts[r][1]) for r in sorted(rnd.parts)]
        lead = dict(rnd.parts[0][2])
        takeover = bool(lead.pop("takeover", False))
        lock = self._round_lock.setdefault(rnd.model_id, asyncio.Lock())
        async with lock:  # in round order (rounds complete in order: each rank pushes in order)
            try:
                manifest, refs = merge(parts)
                lead.update(ranks=rnd.world, sharded=True)
                version = await self._publish(
                    rnd.model_id, manifest, list(refs), lead, takeover, reserved=rnd.version
                )
            except RaySyncError as err:
                self._settle_round(rnd, error=err)
                return
            except Exception as err:  # never leave the ranks waiting
                self._settle_round(rnd, error=InvalidWeightsError(f"{type(err).__name__}: {err}"))
                return
        self._forget_offers(rnd.model_id, before=version + 1)  # offered again: a newer one is out
        self._settle_round(rnd, version)


def _lead_of(pusher: dict[str, Any], part: ShardPart) -> dict[str, Any]:
    """The identity of the part's group rank 0 (its lease's name), as the rank's client sent it.

    Raises:
        InvalidWeightsError: a part that names no group (a client that does not identify it).
    """
    lead = pusher.get("lead")
    if not isinstance(lead, dict) or not isinstance(lead.get("writer_id"), str) or not part.group:
        raise InvalidWeightsError(
            f"rank {part.rank}'s part names no group (its client is older than the hub's): upgrade raysync"
        )
    return lead

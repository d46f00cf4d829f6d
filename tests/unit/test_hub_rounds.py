"""The hub's rounds of a sharded push: numbers granted per round, early returns, abandoned rounds.

The first tests drive :class:`~raysync.hub.state.rounds.Rounds` (plain Python); the others drive
the hub's :class:`~raysync.hub.sharded.ShardedPublish` on an event loop with the hub's real state
(:class:`~raysync.hub.state.HubState`) and no Ray: what a rank's ``contribute`` returns and when,
and what ``hub.wait`` of a number says when its round is published or abandoned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from raysync.core.layout import Manifest, plan_specs
from raysync.core.shards import ShardPart
from raysync.errors import InvalidWeightsError, RaySyncError, StaleWriterError, SyncTimeoutError
from raysync.hub.sharded import ShardedPublish
from raysync.hub.state import HubState
from raysync.hub.state.rounds import MAX_OPEN, PartTaken, Rounds

T = TypeVar("T")


def _part(rank: int, world: int = 2, round: int = 1, group: str = "a") -> ShardPart:
    return ShardPart(round, rank, world, (), plan_specs([]), (), group=f"token-{group}")


def _who(rank: int, group: str = "a") -> dict[str, Any]:
    lead = {"session": f"{group}0", "writer_id": f"actor-{group}0"}
    return {"session": f"{group}{rank}", "writer_id": f"actor-{group}{rank}", "lead": lead}


def test_a_round_closes_when_every_rank_is_in() -> None:
    rounds = Rounds()
    first, dropped = rounds.add("policy", _part(1), [], _who(1))
    assert dropped == [] and not first.complete() and first.missing() == [0]
    second, _ = rounds.add("policy", _part(0), [], _who(0))
    assert second is first and first.complete() and rounds.open_rounds("policy") == []
    assert not rounds.drop(first)  # closed: being published, not droppable


def test_a_fast_rank_may_push_again_before_a_slow_one_pushed() -> None:
    rounds = Rounds()
    r3, _ = rounds.add("policy", _part(0, round=3), [], _who(0))
    r4, dropped = rounds.add("policy", _part(0, round=4), [], _who(0))  # rank 0's push returned
    assert dropped == [] and rounds.open_rounds("policy") == [r3, r4]
    assert rounds.add("policy", _part(1, round=3), [], _who(1))[0] is r3 and r3.complete()
    assert rounds.add("policy", _part(1, round=4), [], _who(1))[0] is r4 and r4.complete()
    # the group runs more than MAX_OPEN pushes ahead of its slowest rank: the oldest is abandoned
    opened = [rounds.add("policy", _part(0, round=5 + i), [], _who(0))[0] for i in range(MAX_OPEN)]
    newest, dropped = rounds.add("policy", _part(0, round=5 + MAX_OPEN), [], _who(0))
    assert dropped == [opened[0]] and rounds.open_rounds("policy") == [*opened[1:], newest]
    # the slow rank's part of the abandoned push is refused, the others are not disturbed
    with pytest.raises(InvalidWeightsError, match="came after the group moved on"):
        rounds.add("policy", _part(1, round=5), [], _who(1))
    assert rounds.add("policy", _part(1, round=6), [], _who(1))[0] is opened[1]


def test_a_restarted_or_resized_group_abandons_what_the_old_one_left_open() -> None:
    rounds = Rounds()
    old, _ = rounds.add("policy", _part(0, round=3), [], _who(0))
    new, dropped = rounds.add("policy", _part(0, round=1, group="b"), [], _who(0, "b"))  # a new group
    assert dropped == [old] and new is not old and new.missing() == [1]
    _, dropped = rounds.add("policy", _part(0, world=4, round=1, group="c"), [], _who(0, "c"))  # 4 ranks
    assert dropped == [new]


def test_parts_of_two_groups_never_make_one_round_and_a_replaced_group_is_refused() -> None:
    """A restarted group's rank 1 pushing before its rank 0 never completes the old group's round, and
    the old group's late parts are refused (the lease let the new group's part through: it replaced
    the old one)."""
    rounds = Rounds()
    old, _ = rounds.add("policy", _part(0), [], _who(0))
    new, dropped = rounds.add("policy", _part(1, group="b"), [], _who(1, "b"))
    assert dropped == [old] and new is not old and new.missing() == [0]
    with pytest.raises(StaleWriterError, match="another group replaced"):
        rounds.add("policy", _part(1), [], _who(1))  # the old group's rank 1, late
    assert rounds.add("policy", _part(0, group="b"), [], _who(0, "b"))[0] is new and new.complete()
    # one group's rank from two processes, or saying another size: refused, nothing changes
    nxt, _ = rounds.add("policy", _part(0, round=2, group="b"), [], _who(0, "b"))
    with pytest.raises(InvalidWeightsError, match="two processes push as rank 1"):
        rounds.add("policy", _part(1, round=2, group="b"), [], {**_who(1, "b"), "session": "x"})
    with pytest.raises(InvalidWeightsError, match="says the group has 3 ranks"):
        rounds.add("policy", _part(1, world=3, round=2, group="b"), [], _who(1, "b"))
    assert nxt.missing() == [1]


def test_a_push_a_rank_gave_up_is_never_completed_by_the_other_ranks() -> None:
    """Issue 41, case 1: rank 0's push raised before its part went (a max_lag timeout); rank 1's part
    of that push must never be matched with rank 0's part of the next push."""
    rounds = Rounds()
    for rank in (0, 1):
        rounds.add("policy", _part(rank, round=1), [], _who(rank))
    assert rounds.give_up("policy", "token-a", 2, 0, "SyncTimeoutError: max_lag") is None  # nothing open
    with pytest.raises(InvalidWeightsError, match=r"push 2 of 'policy' was abandoned: rank 0's push of it"):
        rounds.add("policy", _part(1, round=2), [], _who(1))
    three = [rounds.add("policy", _part(rank, round=3), [], _who(rank))[0] for rank in (0, 1)]
    assert three[0] is three[1] and three[0].complete()
    # rank 1's part went first: the open round is handed back to be abandoned
    rnd, _ = rounds.add("policy", _part(1, round=4), [], _who(1))
    assert rounds.give_up("policy", "token-a", 4, 0, "SyncTimeoutError") is rnd
    assert rounds.open_rounds("policy") == []
    assert rounds.add("policy", _part(0, round=5), [], _who(0))[0].round == 5
    # a give-up of a rank whose part is in (what raised came after it) changes nothing
    assert rounds.give_up("policy", "token-a", 5, 0, "SyncTimeoutError: wait") is None
    assert [r.round for r in rounds.open_rounds("policy")] == [5]
    # another group's give-up touches nothing of this one
    assert rounds.give_up("policy", "token-b", 5, 1, "RuntimeError") is None
    assert [r.round for r in rounds.open_rounds("policy")] == [5]


def test_rounds_split_by_a_hub_restart_are_lost_whichever_rank_comes_first() -> None:
    """A restarted hub's fresh rounds: the ranks' parts of push 2 went one to the hub before it."""
    rounds = Rounds()  # rank 0's part of push 2 went to the hub before the restart; rank 1's comes here
    split, _ = rounds.add("policy", _part(1, round=2), [], _who(1))
    nxt, dropped = rounds.add("policy", _part(0, round=3), [], _who(0))  # rank 0's first part here
    assert dropped == [split] and split.lost and rounds.open_rounds("policy") == [nxt]
    assert rounds.add("policy", _part(1, round=3), [], _who(1))[0] is nxt and nxt.complete()
    rounds = Rounds()  # rank 0 comes first this time: rank 1's part of push 2 can never complete
    nxt, _ = rounds.add("policy", _part(0, round=3), [], _who(0))
    split, dropped = rounds.add("policy", _part(1, round=2), [], _who(1))
    assert split.lost and split is not nxt and dropped == [] and rounds.open_rounds("policy") == [nxt]
    assert rounds.add("policy", _part(1, round=3), [], _who(1))[0] is nxt and nxt.complete()


def test_bad_ranks_are_refused() -> None:
    rounds = Rounds()
    rounds.add("policy", _part(0), [], _who(0))
    with pytest.raises(InvalidWeightsError, match="rank 0 pushed its shard of 'policy' twice"):
        rounds.add("policy", _part(0), [], _who(0))
    with pytest.raises(InvalidWeightsError, match="ranks run from 0 to world - 1"):
        rounds.add("policy", _part(2), [], _who(2))
    (rnd,) = rounds.open_rounds("policy")
    assert rounds.drop(rnd) and rounds.open_rounds("policy") == []


def test_an_abandoned_number_is_remembered_with_why() -> None:
    rounds = Rounds()
    rnd, _ = rounds.add("policy", _part(0), [], _who(0))
    rounds.granted(rnd, 7)
    assert rounds.pending("policy", 7) is rnd and rounds.failure("policy", 7) is None
    why = SyncTimeoutError("ranks [1] did not push")
    rounds.settle(rnd, why)
    assert rounds.pending("policy", 7) is None and rounds.failure("policy", 7) is why
    assert rounds.open_rounds("policy") == []


def test_a_reserved_number_is_published_under_that_number_or_skipped() -> None:
    state = HubState("hub", keep=2)
    state.versions.stamp("policy", _manifest(), [], {})
    abandoned, persist = state.versions.reserve("policy", 3)  # a block of 3: written once
    published, again = state.versions.reserve("policy", 3)
    assert (abandoned, published, persist, again) == (2, 3, True, False)
    assert state.versions.latest("policy") == 1  # granted, not published
    state.versions.stamp("policy", _manifest(), [], {}, published)
    assert state.versions.latest("policy") == 3 and sorted(state.models["policy"].versions) == [1, 3]
    assert state.versions.reserve("policy", 3) == (4, False)  # an abandoned number is never granted again
    assert state.versions.reserve("policy", 3) == (5, True)  # the block is spent: a new one
    state.versions.stamp("policy", _manifest(), [], {})  # another number issued: the block ends
    assert state.versions.reserve("policy", 3) == (9, True) and state.versions.latest("policy") == 8


# ------------------------------------------------------------------ the hub's side, no Ray


def _manifest() -> Manifest:
    return plan_specs([])


class _Store:
    def save_model(self, model_id: str, model: Any) -> concurrent.futures.Future[None]:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done

    def save_model_soon(self, model_id: str, model: Any) -> None:
        pass


class _Hub(ShardedPublish):
    """The hub's sharded side over its real state; publishing stamps, as the actor's does."""

    def __init__(self, refuse: frozenset[str] = frozenset(), state: HubState | None = None) -> None:
        super().__init__(
            state or HubState("hub", keep=4),
            _Store(),  # type: ignore[arg-type]
            publish=self.publish,
            restore=lambda *args: self.restore(*args),
            check_writer=self._check_writer,
        )
        self.refuse = refuse
        self.checked: list[str] = []

    async def publish(self, model_id: str, manifest: Any, refs: Any, pusher: Any, *_: Any, **kw: Any) -> int:
        return self._state.versions.stamp(model_id, manifest, refs, pusher, kw["reserved"]).version

    async def restore(self, model_id: str, version: int, manifest: Any, refs: Any, pusher: Any) -> bool:
        raise AssertionError("only a restarted hub is offered versions again")

    async def _check_writer(self, model_id: str, pusher: dict[str, Any], takeover: bool) -> None:
        self.checked.append(pusher["session"])  # every rank's part is checked in its rank 0's name
        if pusher["session"] in self.refuse:
            raise StaleWriterError(f"model {model_id!r} is written by another group")

    async def push(self, rank: int, round: int = 1, group: str = "a", **kw: Any) -> int:
        return (await self.taken(rank, round, group, **kw)).version

    async def taken(self, rank: int, round: int = 1, group: str = "a", **kw: Any) -> PartTaken:
        kw.setdefault("settle", False)
        part = _part(rank, round=round, group=group)
        return await self.contribute("policy", part, [], _who(rank, group), **kw)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_rank_gets_its_number_before_the_other_ranks_push() -> None:
    async def main() -> None:
        hub = _Hub()
        v = await hub.push(0)  # returns with rank 1's part not in: nothing published yet
        assert v == 1 and hub._state.versions.latest("policy") is None
        waiter = asyncio.ensure_future(hub.round_published("policy", v, 10.0))
        settled = asyncio.ensure_future(hub.push(0, round=2, settle=True))  # waits for publish
        await asyncio.sleep(0.05)
        assert not waiter.done() and not settled.done()
        assert await hub.push(1) == v  # one number for every rank of the round
        await waiter
        assert hub._state.versions.latest("policy") == v
        assert await hub.push(1, round=2) == 2 and await settled == 2
        assert hub._state.versions.latest("policy") == 2

    _run(main())


def test_a_round_a_rank_never_completes_is_abandoned_and_its_number_says_why() -> None:
    async def main() -> None:
        hub = _Hub()
        assert await hub.push(0) == 1 and await hub.push(1) == 1
        await hub.round_published("policy", 1, 10.0)
        v = await hub.push(0, round=2, timeout=0.2)  # rank 1 dies: never pushes push 2
        with pytest.raises(SyncTimeoutError, match=r"version 2 of 'policy' is not published yet"):
            await hub.round_published("policy", v, 0.05)
        with pytest.raises(SyncTimeoutError, match=r"ranks \[1\] of 2 did not push.*readers keep version 1"):
            await hub.round_published("policy", v, 10.0)
        assert hub._state.versions.latest("policy") == 1  # nothing published with a shard missing
        # the rank that got the number is told on its next push, whose part is taken all the same
        taken = await hub.taken(0, round=3, previous=v)
        assert taken.version == 3 and taken.earlier is not None and "version 2 of 'policy'" in taken.earlier
        # the restarted group pushes: what the dead group left open is abandoned, a new number published
        assert await hub.push(0, group="b") == 4 and await hub.push(1, group="b") == 4
        await hub.round_published("policy", 4, 10.0)
        assert hub._state.versions.latest("policy") == 4 and sorted(hub._state.models["policy"].versions) == [
            1,
            4,
        ]
        assert hub.abandoned() == {"policy": [2, 3]}
        # a newer version is out: a wait for the abandoned number waits for it, as for any older one
        assert await hub.round_published("policy", v, 10.0) == 10.0

    _run(main())


def test_a_restarted_group_never_completes_the_dead_group_s_round() -> None:
    async def main() -> None:
        hub = _Hub()
        old = await hub.push(0)  # the old group's rank 0; its rank 1 dies before pushing
        new = await hub.push(1, group="b")  # the new group's rank 1 comes first
        assert new != old and hub._rounds.pending("policy", new) is not None
        with pytest.raises(InvalidWeightsError, match=r"version 1 of 'policy'.*abandoned unpublished"):
            await hub.round_published("policy", old, 1.0)
        assert await hub.push(0, group="b") == new
        await hub.round_published("policy", new, 10.0)
        assert hub._state.versions.latest("policy") == new

    _run(main())


def test_a_refused_group_publishes_nothing() -> None:
    async def main() -> None:
        hub = _Hub(refuse=frozenset({"b0"}))
        with pytest.raises(StaleWriterError):
            await hub.push(0, group="b")  # rank 0 is refused before its part is recorded
        assert hub._rounds.open_rounds("policy") == [] and hub._state.versions.latest("policy") is None

    _run(main())


def test_every_rank_of_a_group_that_is_not_the_writer_is_refused() -> None:
    """Issue 41, case 2: only rank 0's part was checked against the lease; another live group's rank 1
    was taken, replaced the hub's record of the writing group, and was published with its rank 0."""

    async def main() -> None:
        hub = _Hub(refuse=frozenset({"b0"}))  # group a holds the lease and lives
        assert await hub.push(0) == 1 and await hub.push(1) == 1
        await hub.round_published("policy", 1, 10.0)
        assert await hub.push(0, round=2) == 2  # group a's push 2: rank 0's part is in
        for rank in (1, 0):  # group b, rank 1 first
            with pytest.raises(StaleWriterError, match=f"rank {rank}" if rank else "another group"):
                await hub.push(rank, group="b")
        assert hub.checked.count("b0") == 2  # each of b's ranks checked in b's rank 0's name
        assert await hub.push(1, round=2) == 2  # group a's round is untouched and completes
        await hub.round_published("policy", 2, 10.0)
        assert hub._state.versions.latest("policy") == 2 and hub.abandoned() == {}
        assert hub._rounds.groups["policy"].token == "token-a"

    _run(main())


def test_a_give_up_abandons_the_open_push_and_the_next_push_of_every_rank_is_whole() -> None:
    async def main() -> None:
        hub = _Hub()
        assert await hub.push(0) == 1 and await hub.push(1) == 1
        await hub.round_published("policy", 1, 10.0)
        v = await hub.push(1, round=2)  # rank 1's part of push 2 is in; rank 0's push 2 raised
        hub.give_up("policy", "token-a", 2, 0, "SyncTimeoutError: max_lag=1 not reached within 2 s")
        with pytest.raises(InvalidWeightsError, match=r"rank 0's push of it raised SyncTimeoutError"):
            await hub.round_published("policy", v, 10.0)
        taken = await hub.taken(1, round=3, previous=v)  # told, not refused: no cascade of refusals
        assert "rank 0's push of it raised" in (taken.earlier or "")
        assert await hub.push(0, round=3) == taken.version
        await hub.round_published("policy", taken.version, 10.0)
        assert hub._state.versions.latest("policy") == taken.version

    _run(main())


@pytest.mark.parametrize("first", [0, 1, "late"], ids=["rank0-first", "rank1-first", "rank0-late"])
def test_a_hub_restart_mid_push_loses_that_push_and_the_group_goes_on(first: int | str) -> None:
    async def main() -> None:
        hub = _Hub()
        assert await hub.push(0) == 1 and await hub.push(1) == 1
        await hub.round_published("policy", 1, 10.0)
        v2 = await hub.push(0, round=2)  # rank 0's part of push 2 is recorded; then the hub restarts
        restarted = _Hub(state=hub._state)  # what it restores from the GCS: the numbers and the newest
        got: dict[int, int] = {}

        async def rank1_push2() -> None:
            # rank 1's part of the same push: never completes ("late": rank 0's next part comes after
            # the round's deadline)
            got[1] = await restarted.push(1, round=2, timeout=0.05 if first == "late" else 60.0)
            if first == "late":
                await asyncio.sleep(0.2)

        async def rank0_push3() -> None:
            got[0] = await restarted.push(0, round=3, previous=v2)  # an unknown number: no refusal

        for step in (rank0_push3, rank1_push2) if first == 0 else (rank1_push2, rank0_push3):
            await step()
        lost = got[1]
        why = "did not push their shards" if first == "late" else "lost unpublished: the hub restarted"
        with pytest.raises(RaySyncError, match=rf"version {lost} .*{why}"):
            await restarted.round_published("policy", lost, 10.0)
        assert restarted._rounds.pending("policy", lost) is None  # abandoned at once, not on a timeout
        # and so is v2 (never given out twice), which rank 0's part of push 3 told this hub of
        assert lost != v2
        with pytest.raises(RaySyncError, match=rf"version {v2} .*lost unpublished: the hub restarted"):
            await restarted.round_published("policy", v2, 10.0)
        # rank 1's next push is not refused for the lost one: push 3 completes and is published
        assert await restarted.push(1, round=3, previous=lost) == got[0]
        await restarted.round_published("policy", got[0], 10.0)
        # rank 0's push 2, numbered v2 by the hub before its restart, is listed too: rank 0's next part
        # said so (every number handed out is published or abandoned)
        assert restarted._state.versions.latest("policy") == got[0]
        assert restarted.abandoned() == {"policy": sorted({v2, lost})}

    _run(main())


class _Restarted(_Hub):
    """A hub after a restart: it knows the numbers it issued, not the versions' bytes."""

    async def restore(self, model_id: str, version: int, manifest: Any, refs: Any, pusher: Any) -> bool:
        return self._state.versions.offer_again(model_id, version, manifest, refs, pusher)


def test_a_lost_version_is_kept_again_once_every_rank_offered_its_part() -> None:
    async def main() -> None:
        hub = _Restarted()
        assert await hub.push(0) == 1 and await hub.push(1) == 1
        await asyncio.sleep(0)  # the round's publish
        assert hub._state.versions.latest("policy") == 1
        hub._state.models["policy"].versions.clear()  # the restart lost its bytes
        assert not await hub.restore_part("policy", 1, _part(0), [], _who(0))  # rank 1's part missing
        assert not hub._state.models["policy"].versions
        # a part from a group of another size replaces the parts held: they make no version together
        assert not await hub.restore_part("policy", 1, _part(1, world=3), [], _who(1))
        assert not hub._state.models["policy"].versions and list(hub._offered["policy", 1]) == [1]
        assert not await hub.restore_part("policy", 1, _part(1), [], _who(1))
        assert await hub.restore_part("policy", 1, _part(0), [], _who(0))
        assert sorted(hub._state.models["policy"].versions) == [1]
        assert await hub.restore_part("policy", 1, _part(1), [], _who(1))  # kept already: yes at once
        # a number the hub never issued is not taken
        assert not await hub.restore_part("policy", 10**6, _part(0), [], _who(0))
        assert not await hub.restore_part("policy", 10**6, _part(1), [], _who(1))
        assert sorted(hub._state.models["policy"].versions) == [1]

    _run(main())


def test_a_group_numbers_its_pushes_from_its_block_and_posts_them_without_waiting() -> None:
    """The hub tells every rank of a round how the group's next pushes are numbered (``Ahead``): the
    ranks number those pushes themselves and post their parts without waiting for an answer."""

    async def main() -> None:
        hub = _Hub()
        first = await hub.taken(0)
        assert first.version == 1 and first.ahead is not None
        assert (await hub.taken(1)).ahead == first.ahead  # every rank of the round is told the same
        await hub.round_published("policy", 1, 10.0)
        ahead = first.ahead
        for push in (2, 3):  # parts in either rank order, each stamped by its rank
            n = ahead.number(push)
            assert n == push and await hub.push(1, round=push, stamp=n) == n
            assert await hub.push(0, round=push, stamp=n) == n
            await hub.round_published("policy", n, 10.0)
            assert hub._state.versions.latest("policy") == n
        # push 4 raised on both ranks before their parts went: its number is never used, and push 5
        # keeps the number its ranks gave it
        for rank in (0, 1):
            hub.give_up("policy", "token-a", 4, rank, "RuntimeError: the step failed")
        with pytest.raises(InvalidWeightsError, match=r"version 4 .*rank 0's push of it raised RuntimeError"):
            await hub.round_published("policy", 4, 10.0)  # a rank that posted a part of it was told 4
        n5 = ahead.number(5)
        assert n5 == 5 and await hub.push(0, round=5, stamp=n5) == n5
        assert await hub.push(1, round=5, stamp=n5) == n5
        await hub.round_published("policy", n5, 10.0)
        assert hub._state.versions.latest("policy") == 5
        # a part numbered otherwise than its push is refused: the push is abandoned on every rank,
        # a wait for either number says why, readers keep version 5
        wrong = ahead.number(6) + 1  # type: ignore[operator]
        with pytest.raises(
            InvalidWeightsError, match=rf"rank 0 numbered its part of push 6 .* version {wrong}"
        ):
            await hub.push(0, round=6, stamp=wrong)
        with pytest.raises(InvalidWeightsError, match="push 6 of 'policy' was abandoned"):
            await hub.push(1, round=6, stamp=ahead.number(6))
        for number in (wrong, ahead.number(6)):
            with pytest.raises(InvalidWeightsError, match="numbered its part of push 6"):
                await hub.round_published("policy", number, 10.0)  # type: ignore[arg-type]
        assert hub._state.versions.latest("policy") == 5
        # the ranks ask again (no stamp): push 7 is published under a number no push had
        seven = await hub.taken(0, round=7)
        assert await hub.push(1, round=7) == seven.version > wrong
        await hub.round_published("policy", seven.version, 10.0)
        assert hub._state.versions.latest("policy") == seven.version

    _run(main())


def test_a_restarted_hub_takes_the_numbers_a_group_stamped_from_its_block() -> None:
    """A hub restart forgets the group's block but not the numbers it wrote down: parts stamped from
    the block are published under their numbers, and no number is ever given out twice."""

    async def main() -> None:
        hub = _Hub()
        first = await hub.taken(0)
        assert await hub.push(1) == first.version == 1 and first.ahead is not None
        await hub.round_published("policy", 1, 10.0)
        restarted = _Hub(state=hub._state)  # what it restores from the GCS: the numbers and the newest
        restarted._state.versions.round_blocks.clear()  # in memory only: gone with the process
        n = first.ahead.number(2)
        assert (
            await restarted.push(0, round=2, stamp=n) == n and await restarted.push(1, round=2, stamp=n) == n
        )
        await restarted.round_published("policy", n, 10.0)
        assert restarted._state.versions.latest("policy") == n == 2
        # an unstamped push after it gets the next number, never one given out already
        nxt = await restarted.taken(0, round=3)
        assert await restarted.push(1, round=3) == nxt.version == 3
        # a stamp the hub never reserved (beyond the block) is refused
        beyond = restarted._state.models["policy"].reserved + 1
        with pytest.raises(InvalidWeightsError, match="numbered its part of push 4"):
            await restarted.push(0, round=4, stamp=beyond)

    _run(main())


@pytest.mark.parametrize("retry", ["never", "after-push-3"])
def test_a_stamped_part_lost_in_a_hub_restart_is_listed_abandoned_before_the_next_push_publishes(
    retry: str,
) -> None:
    """Both ranks stamp push 2 from their block; rank 0's part reaches the hub that then restarts, and
    rank 1's never reaches the new one (or its retry comes after rank 1's push 3). The ranks' parts
    of push 3 name push 2's number as their previous one: the restarted hub abandons it (a wait
    for it says why, status lists it) and publishes push 3."""

    async def main() -> None:
        hub = _Hub()
        first = await hub.taken(0)
        assert await hub.push(1) == first.version == 1 and first.ahead is not None
        await hub.round_published("policy", 1, 10.0)
        v2, v3 = first.ahead.number(2), first.ahead.number(3)
        assert await hub.push(0, round=2, stamp=v2) == v2
        restarted = _Hub(state=hub._state)  # what it restores from the GCS: the numbers and the newest
        restarted._state.versions.round_blocks.clear()  # in memory only: gone with the process
        assert await restarted.push(0, round=3, stamp=v3, previous=v2) == v3
        with pytest.raises(RaySyncError, match=rf"version {v2} .*lost unpublished: the hub restarted"):
            await restarted.round_published("policy", v2, 10.0)
        assert await restarted.push(1, round=3, stamp=v3, previous=v2) == v3  # not refused for v2
        await restarted.round_published("policy", v3, 10.0)
        assert restarted._state.versions.latest("policy") == v3 and restarted.abandoned() == {"policy": [v2]}
        if retry == "after-push-3":  # refused as out of order; nothing else changes
            with pytest.raises(InvalidWeightsError, match="sent push 2 after push 3"):
                await restarted.push(1, round=2, stamp=v2)
            assert restarted._state.versions.latest("policy") == v3 and restarted.abandoned() == {
                "policy": [v2]
            }

    _run(main())


def test_numbers_of_pushes_that_never_reached_the_hub_are_abandoned_not_left_open() -> None:
    """The ranks of a group that died numbered pushes whose parts and give-ups were lost with them:
    once a later push of the group is numbered, the numbers between are abandoned (a wait for one
    says why, status lists it), and a group that takes over numbers its pushes after them."""

    async def main() -> None:
        hub = _Hub()
        first = await hub.taken(0)
        assert await hub.push(1) == 1 and first.ahead is not None
        await hub.round_published("policy", 1, 10.0)
        ahead = first.ahead
        # pushes 2 and 3 never reached the hub; rank 1's part of push 4 does
        n4 = ahead.number(4)
        assert n4 == 4 and await hub.push(1, round=4, stamp=n4) == n4
        for skipped in (2, 3):
            with pytest.raises(InvalidWeightsError, match=rf"version {skipped} .*no part of its push"):
                await hub.round_published("policy", skipped, 10.0)
        assert hub.abandoned()["policy"] == [2, 3]
        # push 6 is given up by both ranks, push 5 never came: 5 is abandoned with it
        for rank in (0, 1):
            hub.give_up("policy", "token-a", 6, rank, "RuntimeError: the step failed")
        assert hub.abandoned()["policy"] == [2, 3, 5, 6]
        # another group takes over (push 4 is abandoned): its first push follows every number given out
        other = await hub.taken(0, group="b", takeover=True)
        assert other.version == 7 and hub.abandoned()["policy"] == [2, 3, 4, 5, 6]

    _run(main())


def test_a_refused_stamp_abandons_the_numbers_before_it_that_never_came() -> None:
    """A group lost the lease while its ranks pushed ahead: a refused part's stamp is never given to
    another push, nor are the numbers before it of pushes whose parts never came."""

    async def main() -> None:
        hub = _Hub()
        first = await hub.taken(0)
        assert await hub.push(1) == 1 and first.ahead is not None
        await hub.round_published("policy", 1, 10.0)
        hub.refuse = frozenset({"a0"})  # another group holds the lease now
        n3 = first.ahead.number(3)
        with pytest.raises(StaleWriterError):
            await hub.push(1, round=3, stamp=n3)  # push 2's parts never came
        assert hub.abandoned()["policy"] == [2, 3]
        for number in (2, 3):
            with pytest.raises((InvalidWeightsError, StaleWriterError)):
                await hub.round_published("policy", number, 10.0)
        assert (await hub.taken(0, group="b", takeover=True)).version == 4

    _run(main())

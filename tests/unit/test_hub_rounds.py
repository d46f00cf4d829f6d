"""The hub's rounds of a sharded push, as plain Python: complete, dropped, refused."""

from __future__ import annotations

import pytest

from raysync.core.layout import plan_specs
from raysync.core.shards import ShardPart
from raysync.errors import InvalidWeightsError
from raysync.hub.state.groups import Rounds


def _part(rank: int, world: int = 2, round: int = 1) -> ShardPart:
    return ShardPart(round, rank, world, (), plan_specs([]), ())


def test_a_round_closes_when_every_rank_is_in() -> None:
    rounds = Rounds()
    first, dropped = rounds.add("policy", _part(1), [], {})
    assert dropped is None and not first.complete() and first.missing() == [0]
    second, _ = rounds.add("policy", _part(0), [], {"writer_id": "a"})
    assert second is first and first.complete() and "policy" not in rounds.open
    assert not rounds.drop(first)  # closed: being published, not droppable


def test_a_part_of_another_push_drops_the_open_one_unpublished() -> None:
    rounds = Rounds()
    old, _ = rounds.add("policy", _part(0, round=3), [], {})
    new, dropped = rounds.add("policy", _part(1, round=4), [], {})
    assert dropped is old and new is not old and new.missing() == [0]
    _, dropped = rounds.add("policy", _part(0, world=4, round=4), [], {})  # the group changed size
    assert dropped is new


def test_bad_ranks_are_refused() -> None:
    rounds = Rounds()
    rounds.add("policy", _part(0), [], {})
    with pytest.raises(InvalidWeightsError, match="rank 0 pushed its shard of 'policy' twice"):
        rounds.add("policy", _part(0), [], {})
    with pytest.raises(InvalidWeightsError, match="ranks run from 0 to world - 1"):
        rounds.add("policy", _part(2), [], {})
    rnd = rounds.open["policy"]
    assert rounds.drop(rnd) and "policy" not in rounds.open

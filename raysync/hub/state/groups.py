"""Sharded writers: the ranks' parts of the version being pushed, until every rank's is in.

A sharded trainer's ranks each send the hub a :class:`~raysync.core.shards.ShardPart`
for each push. The hub holds one open *round* per model: the parts of one push (same
``round`` number, same ``world``). A round closes when every rank's part is in (the
hub then merges and publishes it, once, as one version), or is dropped, unpublished:
when a wait for it times out (a rank died or never pushed), or when a part of another
round arrives (the group restarted or moved on without it). Plain Python, no Ray.

Example:
    >>> rounds = Rounds()
    >>> opened, dropped = rounds.add("policy", part0, refs0, pusher0)
    >>> opened.complete()
    False
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from raysync.core.shards import ShardPart
from raysync.errors import InvalidWeightsError

__all__ = ["Round", "Rounds"]


@dataclass
class Round:
    """The parts of one sharded push of one model, as they arrive.

    Attributes:
        model_id: the model.
        round: the ranks' push number.
        world: how many ranks' parts it needs.
        parts: ``rank -> (part, refs, pusher)``.
        opened: when its first part arrived (``time.time()``).
    """

    model_id: str
    round: int
    world: int
    parts: dict[int, tuple[ShardPart, list[Any], dict[str, Any]]] = field(default_factory=dict)
    opened: float = field(default_factory=time.time)

    def complete(self) -> bool:
        """Whether every rank's part is in."""
        return len(self.parts) == self.world

    def missing(self) -> list[int]:
        """The ranks whose parts are not in."""
        return sorted(set(range(self.world)) - set(self.parts))


class Rounds:
    """The open round of each model (at most one)."""

    def __init__(self) -> None:
        self.open: dict[str, Round] = {}

    def add(
        self, model_id: str, part: ShardPart, refs: list[Any], pusher: dict[str, Any]
    ) -> tuple[Round, Round | None]:
        """Add one rank's part; ``(its round, a round it dropped unpublished or None)``.

        A complete round is closed here (no longer open): its caller publishes it.

        Raises:
            InvalidWeightsError: a rank outside ``0 .. world - 1``, or a rank's second part
                for the open round (nothing changes).
        """
        if not isinstance(part.world, int) or part.world < 1 or not 0 <= part.rank < part.world:
            raise InvalidWeightsError(
                f"a sharded push of {model_id!r} came from rank {part.rank} of {part.world}: ranks run "
                "from 0 to world - 1"
            )
        dropped = None
        current = self.open.get(model_id)
        if current is not None and (current.round != part.round or current.world != part.world):
            dropped = self.open.pop(model_id)
            current = None
        if current is None:
            current = self.open[model_id] = Round(model_id, part.round, part.world)
        if part.rank in current.parts:
            raise InvalidWeightsError(
                f"rank {part.rank} pushed its shard of {model_id!r} twice for push {part.round}; "
                f"ranks {current.missing()} have not pushed theirs"
            )
        current.parts[part.rank] = (part, refs, pusher)
        if current.complete():
            del self.open[model_id]
        return current, dropped

    def drop(self, rnd: Round) -> bool:
        """Drop ``rnd`` unpublished if it is still open; whether it was."""
        if self.open.get(rnd.model_id) is rnd:
            del self.open[rnd.model_id]
            return True
        return False

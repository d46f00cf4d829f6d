"""Sharded writers: the ranks' parts of the versions being pushed, until every rank's is in.

A sharded trainer's ranks each send the hub a :class:`~raysync.core.shards.ShardPart`
for each push. The parts of one push (same ``round`` number, same ``world``) make a
*round*; the hub grants each round one version number when it opens (every rank's push
returns that number as soon as its own part is recorded) and publishes the round, once,
when every rank's part is in.

A round that never completes is *abandoned*: its number is never published, readers stay
on the previous version, and a wait for the number raises why (:meth:`Rounds.failure`).
A round is abandoned when its deadline passes (a rank died or stalled), when the group
restarts or changes size (a part comes from another process for a rank, or another
``world``), or when the group runs more than :data:`MAX_OPEN` rounds ahead of it.
A round the hub could not publish (the ranks disagree, the lost lease) fails the same way.

A round is *lost* when the hub restarted while its ranks pushed it: each rank's parts
arrive in push order, so a rank whose first part this hub saw is of push N sent its
parts of earlier pushes to the hub before the restart, and they are gone with it. The
open rounds before N that lack that rank's part, and the parts of those pushes that
other ranks send later, can never complete. They are abandoned at once and quietly (and
such a round abandoned on its deadline before the hub could tell counts as lost too): a
wait for their numbers says why, but the ranks' next pushes are not refused for them
(:meth:`Rounds.refusal`), so the group goes on as if the hub had not restarted.

Several rounds of one model may be open at once: a rank whose push returned may push
again before a slower rank pushed its part of the previous round. Plain Python, no Ray.

Example:
    >>> rounds = Rounds()
    >>> opened, dropped = rounds.add("policy", part0, refs0, pusher0)
    >>> opened.complete(), dropped
    (False, [])
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from raysync.core.shards import ShardPart
from raysync.errors import InvalidWeightsError

__all__ = ["MAX_OPEN", "Round", "Rounds"]

MAX_OPEN = 4
"""Open rounds per model: a group whose fastest rank runs further ahead abandons the oldest."""

_FAILURES_KEPT = 64  # abandoned or refused rounds remembered per model (for waits on their numbers)


@dataclass(eq=False)
class Round:
    """The parts of one sharded push of one model, as they arrive.

    Attributes:
        model_id: the model.
        round: the ranks' push number.
        world: how many ranks' parts it needs.
        parts: ``rank -> (part, refs, pusher)``.
        opened: when its first part arrived (``time.time()``).
        version: the number granted to it (``None`` until the hub grants one).
    """

    model_id: str
    round: int
    world: int
    parts: dict[int, tuple[ShardPart, list[Any], dict[str, Any]]] = field(default_factory=dict)
    opened: float = field(default_factory=time.time)
    version: int | None = None
    lost: bool = False  # lost in a hub restart: abandoned quietly

    def complete(self) -> bool:
        """Whether every rank's part is in."""
        return len(self.parts) == self.world

    def missing(self) -> list[int]:
        """The ranks whose parts are not in."""
        return sorted(set(range(self.world)) - set(self.parts))


@dataclass
class _Group:
    """What the hub knows of the group writing one model: its size, each rank's process, its rounds."""

    world: int
    sessions: dict[int, Any] = field(default_factory=dict)  # rank -> its process (writer identity)
    open: dict[int, Round] = field(default_factory=dict)  # round number -> round, oldest first
    first: dict[int, int] = field(default_factory=dict)  # rank -> the push of its first part seen here


class Rounds:
    """The open rounds of each model, the rounds granted a number and not settled, and failures."""

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}
        self.unsettled: dict[tuple[str, int], Round] = {}  # (model, version) -> open or publishing
        self.failed: dict[str, OrderedDict[int, BaseException]] = {}
        self.lost: set[tuple[str, int]] = set()  # (model, version) of failed rounds lost in a restart
        self._failed_parts: dict[tuple[str, int], tuple[int, frozenset[int]]] = {}  # -> (push, ranks in)

    def open_rounds(self, model_id: str) -> list[Round]:
        """The model's open rounds, oldest first."""
        group = self.groups.get(model_id)
        return [] if group is None else list(group.open.values())

    def newcomer(self, model_id: str, part: ShardPart, pusher: dict[str, Any]) -> list[dict[str, Any]]:
        """The pushers to check alive before :meth:`add` takes ``part``: those of the open rounds'
        parts when ``part``'s rank has not pushed in this group before.

        A rank first seen while rounds are open may be of a restarted group whose rank pushes
        before the new rank 0 (whose process would tell the groups apart): if a process that
        pushed to the open rounds is dead, they are the old group's (:meth:`restart`), and
        must never be completed with the new group's parts.
        """
        group = self.groups.get(model_id)
        if group is None or part.rank in group.sessions or not group.open:
            return []
        seen: dict[Any, dict[str, Any]] = {}
        for rnd in group.open.values():
            for _, _, other in rnd.parts.values():
                seen.setdefault(other.get("session"), other)
        return list(seen.values())

    def restart(self, model_id: str) -> list[Round]:
        """Forget the group writing ``model_id`` (it died); the open rounds it abandoned."""
        group = self.groups.pop(model_id, None)
        return [] if group is None else list(group.open.values())

    def add(
        self, model_id: str, part: ShardPart, refs: list[Any], pusher: dict[str, Any]
    ) -> tuple[Round, list[Round]]:
        """Add one rank's part; ``(its round, the rounds it abandoned)``.

        The caller grants a new round (``version is None``) its number and settles the
        abandoned ones (:meth:`settle`). A complete round is closed here (no longer open):
        its caller publishes it. A part of a round lost in a hub restart comes back in a
        round that is not open, marked ``lost`` (the caller grants and settles it).

        Raises:
            InvalidWeightsError: a rank outside ``0 .. world - 1``, a rank's second part
                for one round, or a part of a round this group already moved past
                (nothing changes).
        """
        if not isinstance(part.world, int) or part.world < 1 or not 0 <= part.rank < part.world:
            raise InvalidWeightsError(
                f"a sharded push of {model_id!r} came from rank {part.rank} of {part.world}: ranks run "
                "from 0 to world - 1"
            )
        session = pusher.get("session")
        group = self.groups.get(model_id)
        dropped: list[Round] = []
        known = None if group is None else group.sessions.get(part.rank, session)
        if group is None or group.world != part.world or known != session:
            # Another group (restarted, or resized): what the old one left open is abandoned.
            if group is not None:
                dropped = list(group.open.values())
            group = self.groups[model_id] = _Group(part.world)
        if part.rank not in group.first:  # its parts of earlier pushes went to a hub before a restart
            group.first[part.rank] = part.round
            for n, rnd in list(group.open.items()):
                if n < part.round and part.rank not in rnd.parts:
                    rnd.lost = True
                    dropped.append(group.open.pop(n))
            for (failed_model, version), (n, ranks) in self._failed_parts.items():  # expired meanwhile
                if failed_model == model_id and n < part.round and part.rank not in ranks:
                    self.lost.add((model_id, version))
        current = group.open.get(part.round)
        if current is None and any(n > part.round for r, n in group.first.items() if r != part.rank):
            group.sessions[part.rank] = session
            current = Round(model_id, part.round, part.world, lost=True)  # a rank's part went before
            current.parts[part.rank] = (part, refs, pusher)
            return current, dropped
        if current is None:
            newest = max(group.open, default=None)
            if newest is not None and part.round < newest:
                raise InvalidWeightsError(
                    f"rank {part.rank}'s part of push {part.round} of {model_id!r} came after the group "
                    f"moved on to push {newest}: push {part.round} was abandoned, nothing of it is "
                    "published; push again"
                )
            current = group.open[part.round] = Round(model_id, part.round, part.world)
            while len(group.open) > MAX_OPEN:
                dropped.append(group.open.pop(next(iter(group.open))))
        if part.rank in current.parts:
            raise InvalidWeightsError(
                f"rank {part.rank} pushed its shard of {model_id!r} twice for push {part.round}; "
                f"ranks {current.missing()} have not pushed theirs"
            )
        group.sessions[part.rank] = session
        current.parts[part.rank] = (part, refs, pusher)
        if current.complete():
            del group.open[current.round]
        return current, dropped

    def granted(self, rnd: Round, version: int) -> None:
        """``rnd`` has number ``version`` (every rank's push returns it); unsettled until :meth:`settle`."""
        rnd.version = version
        self.unsettled[(rnd.model_id, version)] = rnd

    def drop(self, rnd: Round) -> bool:
        """Close ``rnd`` unpublished if it is still open; whether it was."""
        group = self.groups.get(rnd.model_id)
        if group is not None and group.open.get(rnd.round) is rnd:
            del group.open[rnd.round]
            return True
        return False

    def settle(self, rnd: Round, error: BaseException | None = None) -> None:
        """``rnd`` was published (``error`` None), or abandoned or refused for ``error``."""
        self.drop(rnd)
        if rnd.version is None:
            return
        self.unsettled.pop((rnd.model_id, rnd.version), None)
        if error is not None:
            failed = self.failed.setdefault(rnd.model_id, OrderedDict())
            failed[rnd.version] = error
            self._failed_parts[(rnd.model_id, rnd.version)] = (rnd.round, frozenset(rnd.parts))
            if rnd.lost:
                self.lost.add((rnd.model_id, rnd.version))
            while len(failed) > _FAILURES_KEPT:
                key = (rnd.model_id, failed.popitem(last=False)[0])
                self.lost.discard(key)
                self._failed_parts.pop(key, None)

    def pending(self, model_id: str, version: int) -> Round | None:
        """The round granted ``version``, while it is open or being published."""
        return self.unsettled.get((model_id, version))

    def failure(self, model_id: str, version: int) -> BaseException | None:
        """Why the round granted ``version`` was never published (``None``: it was not abandoned)."""
        failed = self.failed.get(model_id)
        return None if failed is None else failed.get(version)

    def refusal(self, model_id: str, version: int) -> BaseException | None:
        """What a rank's next push raises for its push granted ``version``: why that round failed,
        unless it was lost in a hub restart (the group goes on)."""
        return None if (model_id, version) in self.lost else self.failure(model_id, version)

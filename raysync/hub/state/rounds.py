"""Sharded writers: the ranks' parts of the versions being pushed, until every rank's is in.

A sharded trainer's ranks each send the hub a :class:`~raysync.core.shards.ShardPart`
for each push. The parts of one push (same ``round`` number, same ``world``) make a
*round*; the hub grants each round one version number when it opens, from the group's
block (:class:`Ahead`: every rank of a round is told how the next pushes are numbered, so
it numbers them itself and posts their parts without waiting), and publishes the round,
once, when every rank's part is in.

A round that never completes is *abandoned*: its number is never published, readers stay
on the previous version, and a wait for the number raises why (:meth:`Rounds.failure`).
A round is abandoned when its deadline passes (a rank died or stalled), when another group
(restarted, resized, or one that took the lease over) pushes, when the group runs more than
:data:`MAX_OPEN` rounds ahead of it, or when a rank's push of it raised before its part went
(:meth:`Rounds.give_up`). A round the hub could not publish (the ranks disagree, the lost
lease) fails the same way.

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

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from raysync.core.shards import ShardPart
from raysync.errors import InvalidWeightsError, StaleWriterError

__all__ = ["FAILURES_KEPT", "MAX_OPEN", "Ahead", "PartTaken", "Round", "Rounds"]

MAX_OPEN = 4
"""Open rounds per model: a group whose fastest rank runs further ahead abandons the oldest."""

FAILURES_KEPT = 256
"""Abandoned or refused numbers remembered per model (for waits on them, and status)."""


@dataclass(eq=False)
class Round:
    """The parts of one sharded push of one model, as they arrive.

    Attributes:
        model_id: the model.
        round: the ranks' push number.
        world: how many ranks' parts it needs.
        parts: ``rank -> (part, refs, pusher)``.
        version: the number granted to it (``None`` until the hub grants one).
    """

    model_id: str
    round: int
    world: int
    parts: dict[int, tuple[ShardPart, list[Any], dict[str, Any]]] = field(default_factory=dict)
    version: int | None = None
    lost: bool = False  # lost in a hub restart: abandoned quietly

    def complete(self) -> bool:
        """Whether every rank's part is in."""
        return len(self.parts) == self.world

    def missing(self) -> list[int]:
        """The ranks whose parts are not in."""
        return sorted(set(range(self.world)) - set(self.parts))


@dataclass(frozen=True)
class PartTaken:
    """The hub's answer to a rank's part: the number its round was granted, and an earlier failure.

    Attributes:
        version: the number granted to the part's round (every rank of the round gets it).
        earlier: why the round of this rank's previous push, which returned before it was
            published, was abandoned since (``None``: it was not). Told, not raised: the
            rank's part of this push is taken all the same.
        ahead: how the group's next pushes are numbered (``None``: the rank asks again).
    """

    version: int
    earlier: str | None = None
    ahead: Ahead | None = None


@dataclass(frozen=True)
class Ahead:
    """The numbers a group's next pushes take, told to every rank of one round alike.

    Push ``round`` has ``version``; each later push ``round + k`` has ``version + k``, up to
    ``last`` (the end of the block written to the GCS). A rank stamps its parts of those pushes
    itself and posts them without waiting (:meth:`raysync.hub.sharded.ShardedPublish.contribute`
    with ``stamp``), as a single writer stamps its versions from its lease's block.

    Example:
        >>> Ahead(round=3, version=10, last=109).number(5)
        12
    """

    round: int
    version: int
    last: int

    def number(self, round: int) -> int | None:
        """The number of push ``round`` (``None``: not in the block; ask the hub)."""
        if round <= self.round:
            return None
        number = self.version + (round - self.round)
        return number if number <= self.last else None


@dataclass
class WriterGroup:
    """What the hub knows of the group writing one model: its token, size, processes and rounds."""

    token: str  # made by its rank 0 for this process group (raysync.core.group): parts of one group
    world: int
    sessions: dict[int, Any] = field(default_factory=dict)  # rank -> its process (writer identity)
    open: dict[int, Round] = field(default_factory=dict)  # round number -> round, oldest first
    first: dict[int, int] = field(default_factory=dict)  # rank -> the push of its first part seen here
    newest: dict[int, int] = field(default_factory=dict)  # rank -> the push of its newest part seen here
    ahead: Ahead | None = None  # how its pushes are numbered from the newest round granted a number


_RETIRED_KEPT = 16  # tokens of groups another group replaced, per model (their late parts are refused)
_GIVEN_UP_KEPT = 256  # pushes a rank gave up before its part was sent (the others' parts are refused)


class Rounds:
    """The open rounds of each model, the rounds granted a number and not settled, and failures.

    Parts are matched by their group's token and their push number: parts of two groups (two
    trainers, or one trainer before and after its process group was made again) are never in
    one round. Whether a group may write at all is the writer lease's to say (checked for every
    rank's part in its group rank 0's name before :meth:`add`): a part of a group other than
    the one on record has passed it, so that group replaced the one on record.
    """

    def __init__(self) -> None:
        self.groups: dict[str, WriterGroup] = {}
        self.unsettled: dict[tuple[str, int], Round] = {}  # (model, version) -> open or publishing
        self.failed: dict[str, OrderedDict[int, BaseException]] = {}
        self.lost: set[tuple[str, int]] = set()  # (model, version) of failed rounds lost in a restart
        self._failed_parts: dict[tuple[str, int], tuple[int, frozenset[int]]] = {}  # -> (push, ranks in)
        self._retired: dict[str, OrderedDict[str, None]] = {}
        self._given_up: OrderedDict[tuple[str, str, int], str] = OrderedDict()  # (model, token, push) -> why

    def open_rounds(self, model_id: str) -> list[Round]:
        """The model's open rounds, oldest first."""
        group = self.groups.get(model_id)
        return [] if group is None else list(group.open.values())

    def give_up(self, model_id: str, token: str, round: int, rank: int, why: str) -> Round | None:
        """Rank ``rank``'s push ``round`` raised before its part reached the hub: nothing of it is
        published. The round if it is open (the caller abandons it); else the parts of it that
        come later are refused (:meth:`add`). A round being published, or settled, stays as it is.
        """
        group = self.groups.get(model_id)
        rnd = None if group is None or group.token != token else group.open.get(round)
        if rnd is not None:
            if rank in rnd.parts:  # its part is in: what raised came after it
                return None
            del group.open[round]  # type: ignore[union-attr]
            return rnd
        self._refuse_push(model_id, token, round, f"rank {rank}'s push of it raised {why}")
        return None

    def _refuse_push(self, model_id: str, token: str, round: int, why: str) -> None:
        """The parts of push ``round`` of group ``token`` that come from now on are refused for ``why``."""
        self._given_up.setdefault((model_id, token, round), why)
        while len(self._given_up) > _GIVEN_UP_KEPT:
            self._given_up.popitem(last=False)

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
                for one round, a part of a round this group already moved past or that a rank
                gave up, a rank of one group that says another size, or two processes as one
                rank (nothing changes).
            StaleWriterError: a part of a group another group replaced.
        """
        if not isinstance(part.world, int) or part.world < 1 or not 0 <= part.rank < part.world:
            raise InvalidWeightsError(
                f"a sharded push of {model_id!r} came from rank {part.rank} of {part.world}: ranks run "
                "from 0 to world - 1"
            )
        token = part.group
        if token in self._retired.get(model_id, ()):
            raise StaleWriterError(
                f"rank {part.rank}'s part of push {part.round} of {model_id!r} comes from a group that "
                "another group replaced (restarted, or took the writer lease over): nothing of it is "
                "published"
            )
        why = self._given_up.get((model_id, token, part.round))
        if why is not None:
            raise InvalidWeightsError(
                f"push {part.round} of {model_id!r} was abandoned: {why}; rank {part.rank}'s part of it "
                "is not taken and nothing of it is published (the group goes on with its next push)"
            )
        session = pusher.get("session")
        group = self.groups.get(model_id)
        dropped: list[Round] = []
        if group is None or group.token != token:
            # Another group that may write (the lease says so): what the one on record left open is
            # abandoned, and its late parts are refused.
            if group is not None:
                dropped = list(group.open.values())
                retired = self._retired.setdefault(model_id, OrderedDict())
                retired[group.token] = None
                while len(retired) > _RETIRED_KEPT:
                    retired.popitem(last=False)
            group = self.groups[model_id] = WriterGroup(token, part.world)
        if group.world != part.world:
            raise InvalidWeightsError(
                f"rank {part.rank} of a sharded group of {model_id!r} says the group has {part.world} "
                f"ranks; its other ranks said {group.world}"
            )
        known = group.sessions.get(part.rank)
        if known is not None and known != session:
            raise InvalidWeightsError(
                f"two processes push as rank {part.rank} of one sharded group of {model_id!r}: a rank "
                "restarted alone cannot rejoin its group's pushes; restart the whole group"
            )
        if part.rank not in group.first:  # its parts of earlier pushes went to a hub before a restart
            group.first[part.rank] = part.round
            for n, rnd in list(group.open.items()):
                if n < part.round and part.rank not in rnd.parts:
                    rnd.lost = True
                    dropped.append(group.open.pop(n))
            for (failed_model, version), (n, ranks) in self._failed_parts.items():  # expired meanwhile
                if failed_model == model_id and n < part.round and part.rank not in ranks:
                    self.lost.add((model_id, version))
        newest_before = group.newest.get(part.rank, 0)
        if part.round == newest_before:
            raise InvalidWeightsError(
                f"rank {part.rank} pushed its shard of {model_id!r} twice for push {part.round}"
            )
        if part.round < newest_before:
            raise InvalidWeightsError(
                f"rank {part.rank} of a sharded group of {model_id!r} sent push {part.round} after push "
                f"{newest_before}: each rank's pushes are numbered in order"
            )
        group.newest[part.rank] = part.round
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
                    f"published; push again. The ranks' push counts: {_counts(group)} (each rank of a "
                    "group calls push once per step: ranks whose counts drift apart never meet)"
                )
            current = group.open[part.round] = Round(model_id, part.round, part.world)
            while len(group.open) > MAX_OPEN:
                dropped.append(group.open.pop(next(iter(group.open))))
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
            self.failed.setdefault(rnd.model_id, OrderedDict())[rnd.version] = error
            self._failed_parts[(rnd.model_id, rnd.version)] = (rnd.round, frozenset(rnd.parts))
            self._fail(rnd.model_id, rnd.version, error, rnd.lost)

    def refuse_stamp(self, rnd: Round, token: str, stamp: int, error: BaseException) -> None:
        """A rank numbered its part of ``rnd`` ``stamp``, not the round's number: the push is closed
        (its other parts are refused as a given-up push's are) and a wait for ``stamp`` says why."""
        self.drop(rnd)
        self._refuse_push(rnd.model_id, token, rnd.round, str(error))
        self.fail_number(rnd.model_id, stamp, error)

    def fail_number(self, model_id: str, number: int, error: BaseException, *, lost: bool = False) -> None:
        """A number a rank gave its push that no round will publish: a wait for it says why
        (``lost``: in a hub restart; the ranks' next pushes are not refused for it)."""
        if (model_id, number) not in self.unsettled:  # else a round holds it: its own outcome says
            self._fail(model_id, number, error, lost)

    def _fail(self, model_id: str, number: int, error: BaseException, lost: bool) -> None:
        """Remember why ``number`` is never published (the first why; ``lost``: in a hub restart)."""
        failed = self.failed.setdefault(model_id, OrderedDict())
        failed.setdefault(number, error)
        if lost:
            self.lost.add((model_id, number))
        while len(failed) > FAILURES_KEPT:
            key = (model_id, failed.popitem(last=False)[0])
            self.lost.discard(key)
            self._failed_parts.pop(key, None)

    def forget_failure(self, model_id: str, version: int) -> None:
        """``version`` was kept after all (offered again after a restart): not abandoned."""
        failed = self.failed.get(model_id)
        if failed is not None:
            failed.pop(version, None)
        self.lost.discard((model_id, version))
        self._failed_parts.pop((model_id, version), None)

    def first_part(self, model_id: str, part: ShardPart) -> bool:
        """Whether ``part`` is the first of its rank of its group that this hub sees."""
        group = self.groups.get(model_id)
        return group is None or group.token != part.group or part.rank not in group.first

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


def _counts(group: WriterGroup) -> str:
    return ", ".join(f"rank {r} at push {n}" for r, n in sorted(group.newest.items()))

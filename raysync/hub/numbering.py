"""How the hub numbers sharded rounds: from the group's block, as its ranks number their pushes.

The first part of a push opens a round (:mod:`raysync.hub.state.rounds`), and the round takes a
number here: the one the group's block gives its push (the :class:`Ahead` every rank of an
earlier round was told, so the ranks stamp their parts themselves and post them without
waiting), else a number a rank stamped that a restarted hub reserved and never gave out, else
the next of the model's round block. Two rules hold whatever happens to the ranks:

- **No number is given out twice.** A number a rank's push returned (it stamped it) is never
  another push's, even when its part is refused or its push given up.
- **Every number is published or abandoned.** Pushes that never reached the hub (their parts
  and give-ups lost with the ranks that sent them) leave no gap: once a later number is given
  out, theirs are abandoned and a wait for one says why.

Plain Python, no Ray: :class:`~raysync.hub.sharded.ShardedPublish` holds one.

Example:
    >>> numbers = RoundNumbers(state, rounds)             # doctest: +SKIP
    >>> numbers.open("policy", rnd, stamp=None)          # doctest: +SKIP
    (1, True)
"""

from __future__ import annotations

from raysync.errors import InvalidWeightsError
from raysync.hub.state import HubState
from raysync.hub.state.rounds import FAILURES_KEPT, Ahead, Round, Rounds

__all__ = ["RoundNumbers"]


class RoundNumbers:
    """The numbers of the sharded rounds of every model, given out by one hub process."""

    def __init__(self, state: HubState, rounds: Rounds) -> None:
        self._state, self._rounds = state, rounds
        self._granted: dict[str, int] = {}  # the newest number given out, per model, since it started

    def open(self, model_id: str, rnd: Round, stamp: int | None) -> tuple[int, bool]:
        """The number of a round opening; ``(number, whether to write the block first)``.

        From the group's block, as its ranks number their pushes (:class:`Ahead`); else the
        number a rank stamped, where this hub does not know the block (it restarted) and the
        number is one it reserved and never gave out; else the next of the model's round block
        (a new block once it is used up or another number was issued).

        Raises:
            InvalidWeightsError: the round's push was numbered and abandoned before (a late part).
        """
        if rnd.lost:  # never published: the number its ranks gave it, for a wait to say why
            if stamp is not None:
                return stamp, False
            number, persist = self._state.versions.reserve(model_id)
            self.given(model_id, number)
            return number, persist
        group = self._rounds.groups[model_id]
        ahead = group.ahead
        if ahead is not None and rnd.round <= ahead.round:  # opened before, and abandoned since
            self._rounds.drop(rnd)
            raise InvalidWeightsError(
                f"rank {min(rnd.parts)}'s part of push {rnd.round} of {model_id!r} came after that push "
                "was abandoned: nothing of it is published (the group goes on with its next push)"
            )
        model = self._state.models.get(model_id)
        reserved = model.reserved if model is not None else 0
        floor = self._floor(model_id)
        planned = ahead.number(rnd.round) if ahead is not None and ahead.last == reserved else None
        if planned is not None and planned > floor:
            number, persist = planned, False
            self._pass_over(model_id, floor, planned)
        elif stamp is not None and floor < stamp <= reserved:
            number, persist = stamp, False
        else:
            number, persist = self._state.versions.reserve(model_id)
            if number <= floor:  # numbers ranks stamped that the hub refused: never given out
                self._state.versions.continue_block(model_id, floor)
                number, persist = self._state.versions.reserve(model_id)
        self._state.versions.continue_block(model_id, number)
        group.ahead = Ahead(rnd.round, number, self._state.models[model_id].reserved)
        self.given(model_id, number)
        return number, persist

    def ahead(self, model_id: str, token: str, rnd: Round) -> Ahead | None:
        """How the group's pushes after ``rnd`` are numbered (the same for every rank of ``rnd``)."""
        group = self._rounds.groups.get(model_id)
        ahead = None if group is None or group.token != token else group.ahead
        if ahead is None or rnd.version is None or rnd.lost:
            return None
        if ahead.version - rnd.version != ahead.round - rnd.round:
            return None  # numbered from another block: the rank asks again
        return Ahead(rnd.round, rnd.version, ahead.last)

    def given(self, model_id: str, number: int) -> None:
        """``number`` was given out (to a round, or by a rank to its push): never again."""
        self._granted[model_id] = max(self._granted.get(model_id, 0), number)

    def refused(self, model_id: str, stamp: int, error: BaseException) -> None:
        """A part a rank numbered ``stamp`` was refused (``error``): a wait for ``stamp`` says why,
        and so does one for each number before it whose push never came, where this hub gave
        out the numbers since it started (a restarted one may not know what was published)."""
        if stamp <= (self._state.versions.latest(model_id) or 0):
            return
        self._rounds.fail_number(model_id, stamp, error)
        if model_id in self._granted:
            self._pass_over(model_id, self._floor(model_id), stamp)
        self.given(model_id, stamp)

    def skip(self, model_id: str, token: str, round: int, rank: int, why: str) -> None:
        """A push given up before any part of it came: the number the group's block gives it is
        never published (the ranks that posted a part of it were told it; a wait for it says why)."""
        group, model = self._rounds.groups.get(model_id), self._state.models.get(model_id)
        if group is None or group.token != token or model is None or group.ahead is None:
            return
        number = group.ahead.number(round) if group.ahead.last == model.reserved else None
        floor = self._floor(model_id)
        if number is None or number <= floor:
            return
        self._pass_over(model_id, floor, number)
        error = f"rank {rank}'s push of it raised {why}; readers keep version {model.latest}"
        self._rounds.fail_number(
            model_id,
            number,
            InvalidWeightsError(f"version {number} of {model_id!r} (push {round}) was abandoned: {error}"),
        )
        self.given(model_id, number)

    def _floor(self, model_id: str) -> int:
        """The newest number given out for ``model_id``: published, or given out since it started."""
        return max(self._state.versions.latest(model_id) or 0, self._granted.get(model_id, 0))

    def _pass_over(self, model_id: str, floor: int, number: int) -> None:
        """The group's block numbers a push ``number`` while the newest number given out is ``floor``:
        the pushes between were numbered by the ranks and never reached the hub (their parts and
        give-ups were lost with the ranks that sent them), so no round takes their numbers."""
        latest = self._state.versions.latest(model_id)
        for skipped in range(max(floor + 1, number - FAILURES_KEPT), number):
            self._rounds.fail_number(
                model_id,
                skipped,
                InvalidWeightsError(
                    f"version {skipped} of {model_id!r} was abandoned unpublished: no part of its push "
                    f"reached the hub (its ranks died or gave it up); readers keep version {latest}"
                ),
            )

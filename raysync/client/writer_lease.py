"""A writer's side of the writer lease: the version numbers it stamps and the publishes in flight.

A push returns once its snapshot is in the object store: the writer stamps the version
itself, from a block of numbers the hub granted with the lease (:class:`WriterLease`,
one per process, hub and model, shared by every client of the process), and sends the
publish without waiting for the reply (:class:`Publishes`). The replies are read on the
next push (as far as they arrived), on ``wait`` and before any query of the same
client, so what the hub refused
(the lease passed to another writer, weights that do not fit a subscriber) surfaces
there, and a publish a hub restart swallowed is offered again.

Why no number is ever issued twice: the hub writes the end of a block to the GCS before
granting it and never grants or stamps a number at or below it again, so numbers are
unique across hub restarts; a restarted trainer (a new process, even of the same actor)
takes a new block; and the lease's fencing epoch changes whenever the lease passes to
another writer, so the old writer's later publishes are refused, never interleaved.

A job's driver and tasks share one lease, each process under an epoch of its own: a push
of one reads the lease's epoch from the GCS before stamping (:class:`LeaseMoved`) and
takes the lease back if another process took it since, so it never hands out a number
from a block whose epoch is over (a number that would never be published).

Example:
    >>> lease = lease_of("raysync", "raysync", "policy")
    >>> with lease.lock:                                   # doctest: +SKIP
    ...     version, epoch = lease.take(acquire, ask_ahead)
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayTaskError

from raysync import _compat
from raysync._checks import require_ray
from raysync._protocol import BLOCK, Grant
from raysync.client import deadline
from raysync.client.identity import writer_identity
from raysync.errors import RaySyncError, StaleWriterError
from raysync.hub.persistence import lease_epoch

__all__ = ["LeaseMoved", "Publishes", "Refusal", "WriterLease", "lease_of"]

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 8
"""Unanswered publishes a push leaves behind it: a push reads the answers that arrived and
waits only for those beyond the newest this many (pushes back to back then never wait for a
round trip each; the bound is back-pressure on a hub that falls behind)."""

_RESTARTING = (ActorDiedError, ActorUnavailableError)


@dataclass(eq=False)
class WriterLease:
    """One process's lease on one model: the numbers it may stamp and the layout the hub accepted.

    Attributes:
        epoch: the lease's fencing epoch (``None``: not held; the next push asks for it).
        next: the next number to stamp.
        last: the last number of the current block.
        upcoming: the next block, asked for when half of this one is used.
        confirmed: the layout the hub accepted (no subscriber refused it): pushes of
            another layout wait for the hub's answer, so a mismatch raises on the push.
    """

    epoch: int | None = None
    next: int = 1
    last: int = 0
    upcoming: Any = None
    confirmed: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, acquire: Callable[[], Grant], ask_ahead: Callable[[], Any]) -> tuple[int, int]:
        """The next version number and the epoch to stamp it with (hold :attr:`lock`).

        ``acquire()`` asks the hub for the lease and a block and waits; ``ask_ahead()``
        asks without waiting (an ``ObjectRef`` of a :class:`Grant`).

        Raises:
            StaleWriterError: another live writer holds the lease.
        """
        version = self.peek(acquire)
        self.next += 1
        if self.upcoming is None and self.last - version == BLOCK // 2:
            self.upcoming = ask_ahead()
        assert self.epoch is not None
        return version, self.epoch

    def peek(self, acquire: Callable[[], Grant]) -> int:
        """The number :meth:`take` gives next, without taking it (hold :attr:`lock`)."""
        if self.epoch is None or self.next > self.last:
            self._adopt(self._upcoming() or acquire())
        return self.next

    def lose(self) -> None:
        """The hub refused the lease: the next push asks for it again."""
        self.epoch, self.upcoming, self.confirmed = None, None, None

    def _upcoming(self) -> Grant | None:
        ref, self.upcoming = self.upcoming, None
        if ref is None or self.epoch is None:
            return None
        require_ray("push")
        try:
            left = deadline.left(60.0)  # the push's (raysync.client.deadline): then acquire() says so
            grant: Grant = _compat.get_no_start(ref, timeout=60.0 if left is None else min(60.0, left))
            return grant
        except RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, StaleWriterError):
                self.lose()
                raise cause from None
            raise
        except (*_RESTARTING, GetTimeoutError):
            return None  # the hub restarted: ask again, waiting

    def _adopt(self, grant: Grant) -> None:
        if grant.epoch != self.epoch:
            self.confirmed = None
        self.epoch, self.next, self.last = grant.epoch, grant.first, grant.last


_leases: dict[tuple[str, str, str], WriterLease] = {}
_leases_lock = threading.Lock()


def lease_of(hub: str, namespace: str, model_id: str) -> WriterLease:
    """This process's lease on ``model_id`` of hub ``hub`` (every client of the process shares it)."""
    key = (hub, namespace, model_id)
    with _leases_lock:
        lease = _leases.get(key)
        if lease is None:
            lease = _leases[key] = WriterLease()
        return lease


@dataclass(frozen=True)
class Refusal:
    """A publish the hub refused: which version, and the hub's error."""

    version: int
    error: BaseException

    def raise_it(self, model_id: str, waited: int | None = None) -> None:
        """Raise the hub's error, its message saying which push it was about (``waited``: the
        version the raising call waits for, such as ``push(wait=True)``'s own)."""
        err = self.error
        if isinstance(err, RaySyncError) and err.args and isinstance(err.args[0], str):
            which = (
                "the version this call waits for: it was not published"
                if self.version == waited
                else "an earlier push that returned before the hub answered"
            )
            err.args = (
                f"the hub refused version {self.version} of {model_id!r} ({which}): {err.args[0]}",
                *err.args[1:],
            )
        raise err


@dataclass
class _InFlight:
    version: int
    epoch: int
    ref: Any
    answer: concurrent.futures.Future[Any] | None = None  # the reply, as Ray delivers it


def wait_answers(
    answers: list[concurrent.futures.Future[Any]], timeout: float | None, *, every: bool
) -> None:
    """Wait for replies Ray completes (``every``: all of them; else all but the newest :data:`MAX_IN_FLIGHT`);
    raise if Ray is shut down meanwhile (they never would)."""
    if not every:
        answers = answers[:-MAX_IN_FLIGHT]
    deadline = None if timeout is None else time.monotonic() + timeout
    while answers:
        left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
        if left <= 0:
            return
        answers = list(concurrent.futures.wait(answers, left).not_done)
        if answers:
            require_ray("read the hub's answers")


class Publishes:
    """One client's publishes whose replies it has not read yet, per model.

    Each reply is watched by a future that Ray completes when it arrives, so reading the
    replies that came costs no call into Ray (a push reads them on the trainer's thread).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # clients may be shared by threads
        self._in_flight: dict[str, list[_InFlight]] = {}
        self._refused: dict[str, Refusal] = {}
        self.epochs: dict[str, tuple[int, int]] = {}  # model -> (newest version sent, its epoch)

    def add(self, model_id: str, version: int, epoch: int, ref: Any) -> None:
        p = _InFlight(version, epoch, ref, ref.future())
        with self._lock:
            self._in_flight.setdefault(model_id, []).append(p)
            self.sent(model_id, version, epoch)

    def sent(self, model_id: str, version: int, epoch: int) -> None:
        """Remember the epoch of the newest version sent (to offer it again after a hub restart)."""
        if version >= self.epochs.get(model_id, (0, 0))[0]:
            self.epochs[model_id] = (version, epoch)

    def models(self) -> list[str]:
        with self._lock:
            return sorted(set(self._in_flight) | set(self._refused))

    def unanswered(self, model_id: str) -> bool:
        """Whether publishes of ``model_id`` wait for their answer (read them before querying)."""
        with self._lock:
            return bool(self._in_flight.get(model_id))

    def settle(
        self, model_id: str, lease: WriterLease, *, wait: bool, timeout: float | None = 60.0
    ) -> int | None:
        """Read the replies that arrived (all of them with ``wait``); keep what the hub refused.

        Returns the newest version a hub restart swallowed (``None``: none), for the
        caller to offer again. Without ``wait``, waits only for the answers to all but the
        newest :data:`MAX_IN_FLIGHT` publishes.
        """
        with self._lock:
            in_flight = list(self._in_flight.get(model_id, ()))
        if not in_flight:
            return None
        # A live hub answers a publish in about a millisecond: the timeout is a guard.
        wait_answers([p.answer for p in in_flight if p.answer is not None], timeout, every=wait)
        swallowed = None
        read = []
        for p in in_flight:
            if p.answer is None or not p.answer.done():
                continue
            read.append(p)
            error = p.answer.exception()
            if isinstance(error, RayTaskError):
                cause = getattr(error, "cause", None)
                self._refuse(model_id, lease, p, cause if isinstance(cause, RaySyncError) else error)
            elif isinstance(error, _RESTARTING):
                swallowed = max(swallowed or 0, p.version)
            elif error is not None:
                self._refuse(model_id, lease, p, error)
        if read:
            with self._lock:
                left = [p for p in self._in_flight.get(model_id, ()) if p not in read]
                if left:
                    self._in_flight[model_id] = left
                else:
                    self._in_flight.pop(model_id, None)
        return swallowed

    def keep_refusal(
        self, model_id: str, lease: WriterLease, version: int, epoch: int, error: BaseException
    ) -> None:
        """Keep a refusal the caller got itself (a publish offered again)."""
        self._refuse(model_id, lease, _InFlight(version, epoch, None), error)

    def _refuse(self, model_id: str, lease: WriterLease, p: _InFlight, error: BaseException) -> None:
        """Keep a refusal (the first one not yet raised); a lost lease is asked for again."""
        logger.warning("the hub refused version %d of %r: %s", p.version, model_id, error)
        with lease.lock:
            if isinstance(error, StaleWriterError) and lease.epoch == p.epoch:
                lease.lose()
            lease.confirmed = None  # the next push waits for the hub's answer
        self._refused.setdefault(model_id, Refusal(p.version, error))

    def raise_refused(self, model_id: str, waited: int | None = None) -> None:
        """Raise (once) what the hub refused of ``model_id`` since the last time (``waited``: the
        version the asking call waits for, see :meth:`Refusal.raise_it`)."""
        refusal = self._refused.pop(model_id, None)
        if refusal is not None:
            refusal.raise_it(model_id, waited)


_JOB_KINDS = ("driver", "tasks")  # writers whose processes share one lease


class LeaseMoved:
    """Whether another process took this process's writer lease since it was granted.

    A job's driver and its tasks are one writer (:mod:`raysync.client.identity`), each process
    stamping from a block of its own under an epoch of its own: a task that pushes takes the
    lease (a new epoch), and the driver's later publishes under the old epoch are refused. A
    push returns before the hub answers its publish, so the driver's next push would hand out
    a number that is never published (refused, and said so only on the push after). A push of
    a job's process therefore reads the lease's epoch from the hub's record in the GCS (asked
    in a thread when the push starts, read just before stamping; about a millisecond, never
    queued behind the hub's work): the hub writes a grant's epoch there before it replies, so
    after another process's push returned this one reads its epoch. A newer epoch than this
    process's means the lease moved: the push asks for it again as a process's first push does
    (a new epoch and a block above every number granted). Fencing is unchanged: every change
    of hands is a grant that moves the epoch on, so the other process's later publishes are
    refused, never interleaved; a live writer outside the job (a takeover) is refused at that
    grant, at once. An actor is one process (a restarted one starts afresh): its pushes skip this.

    Example:
        >>> moved = LeaseMoved("raysync")
        >>> moved.ask("policy", lease)                    # doctest: +SKIP
        >>> with lease.lock:                              # doctest: +SKIP
        ...     moved.take_back_if_moved("policy", lease)
    """

    def __init__(self, hub: str) -> None:
        self._hub = hub
        self._lock = threading.Lock()
        self._asked: dict[str, concurrent.futures.Future[int | None]] = {}  # model -> its epoch, read

    def ask(self, model_id: str, lease: WriterLease) -> None:
        """Read the lease's epoch in a thread, if this process may be one of several of its
        writer (a job's driver or task) and holds the lease."""
        if lease.epoch is None or writer_identity()["kind"] not in _JOB_KINDS:
            return
        future = _reader().submit(lease_epoch, self._hub, model_id)
        with self._lock:
            self._asked[model_id] = future

    def check_now(self, model_id: str, lease: WriterLease) -> None:
        """Ask and read the answer at once (hold ``lease.lock``): for a number asked in advance."""
        self.ask(model_id, lease)
        self.take_back_if_moved(model_id, lease)

    def take_back_if_moved(self, model_id: str, lease: WriterLease) -> None:
        """Read the epoch (hold ``lease.lock``); if another process took the lease since this one
        got it, drop it so that this push asks for it again (a new epoch and block)."""
        with self._lock:
            future = self._asked.pop(model_id, None)
        if future is None or lease.epoch is None:
            return
        left = deadline.left(60.0)
        try:
            epoch = future.result(timeout=60.0 if left is None else max(0.0, min(60.0, left)))
        except Exception as err:  # the GCS slow or gone: the publish's own answer still says what it refused
            logger.debug("could not read the writer lease of %r: %s", model_id, err)
            return
        if epoch is not None and epoch > lease.epoch:
            logger.info(
                "another process took the writer lease of %r (epoch %d; this process held %d): "
                "taking it back (the next number follows every number granted)",
                model_id,
                epoch,
                lease.epoch,
            )
            lease.lose()


_readers: concurrent.futures.ThreadPoolExecutor | None = None


def _reader() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that read leases' epochs (started on first use)."""
    global _readers
    with _leases_lock:
        if _readers is None:
            _readers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="raysync-lease")
        return _readers

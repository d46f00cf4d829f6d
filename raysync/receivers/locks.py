"""The version locks of a synced actor: user methods read, an apply writes.

A reader (a user method) never sees two versions mixed: an apply waits until
no method runs. Two things a plain writer-preferring lock gets wrong in real
actors, and these locks do not:

* **Nested calls.** A method that hands work to a thread pool (or a task)
  which calls another public method of the same actor, and waits for it. A
  lock that holds new readers back while a writer waits deadlocks there: the
  outer call waits for the inner one, the inner one for the writer, the
  writer for the outer call.
* **Stalls.** With one long method running, a waiting writer would hold back
  every other method until the long one ends.

So a waiting writer holds new readers back for at most ``priority_s`` (50 ms);
if the running methods have not ended by then, it lets new calls in until
every call that was running when it stepped aside has ended, then asks again.
New calls wait at most ``priority_s`` per version; an apply waits for the calls
that run when it arrives (it cannot tear them), and is not starved by a
stream of new ones.

A thread (or task) that holds the read side and asks to write (``raysync_sync``
from inside a method) steps out of its read while it writes.

Example:
    >>> lock = RWLock()
    >>> with lock.read():
    ...     pass                 # a user method
    >>> with lock.write():
    ...     pass                 # an apply
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import AsyncIterator, Iterator

__all__ = ["AsyncRWLock", "RWLock", "WRITER_PRIORITY_S"]

WRITER_PRIORITY_S = 0.05
"""How long a waiting apply holds new method calls back before it lets them in again."""


class _Readers:
    """Readers by the epoch they entered in: a writer that stepped aside waits only for older ones."""

    def __init__(self) -> None:
        self.epoch = 0
        self.count: dict[int, int] = {}
        self.writer = False
        self.gates = 0  # writers currently holding new readers back
        self.waiting = 0  # writers waiting, holding readers back or not

    def enter(self) -> int:
        self.count[self.epoch] = self.count.get(self.epoch, 0) + 1
        return self.epoch

    def leave(self, epoch: int) -> None:
        left = self.count[epoch] - 1
        if left:
            self.count[epoch] = left
        else:
            del self.count[epoch]

    def admits(self) -> bool:
        return not (self.writer or self.gates)

    def free(self) -> bool:
        return not (self.writer or self.count)

    def step_aside(self) -> int:
        """Start a new epoch; return it (the writer then waits for readers before it)."""
        self.epoch += 1
        return self.epoch

    def older_than(self, epoch: int) -> bool:
        return self.writer or any(e < epoch for e in self.count)


class RWLock:
    """Reader-writer lock for threaded and plain actors (see the module docstring)."""

    def __init__(self, priority_s: float = WRITER_PRIORITY_S) -> None:
        self._cond = threading.Condition()
        self._state = _Readers()
        self._priority_s = priority_s
        self._local = threading.local()

    def _depth(self) -> int:
        return int(getattr(self._local, "depth", 0))

    def held(self) -> bool:
        """Whether this thread is inside a guarded method already."""
        return self._depth() > 0

    def readers(self) -> int:
        """Methods running now (for tests and status)."""
        with self._cond:
            return sum(self._state.count.values())

    def writers_waiting(self) -> int:
        """Applies waiting for the running methods to end."""
        with self._cond:
            return self._state.waiting

    def _enter(self) -> None:
        while not self._state.admits():
            self._cond.wait()
        self._local.epoch = self._state.enter()

    def _leave(self) -> None:
        self._state.leave(self._local.epoch)
        self._cond.notify_all()

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        depth = self._depth()
        if depth == 0:
            with self._cond:
                self._enter()
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._leave()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        own = self._depth() > 0
        with self._cond:
            if own:
                self._leave()
            self._acquire(patient=True)
        try:
            yield
        finally:
            self.release_write(own)

    def try_write(self) -> bool:
        """Take the write side if the running methods end within ``priority_s``; else give up.

        Not from inside a guarded method (use :meth:`write` there). Release with
        :meth:`release_write`.
        """
        with self._cond:
            return self._acquire(patient=False)

    def release_write(self, own: bool = False) -> None:
        with self._cond:
            self._state.writer = False
            self._cond.notify_all()
            if own:
                self._enter()

    def _acquire(self, *, patient: bool) -> bool:
        state = self._state
        state.waiting += 1
        try:
            while True:
                state.gates += 1
                deadline = time.monotonic() + self._priority_s
                try:
                    while not state.free():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                    else:
                        state.writer = True
                        return True
                finally:
                    state.gates -= 1
                # The running calls did not end in time: one may wait for a call held back.
                self._cond.notify_all()
                if not patient:
                    return False
                epoch = state.step_aside()
                while state.older_than(epoch):
                    self._cond.wait()
        finally:
            state.waiting -= 1


_async_held: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar(
    "raysync_async_held", default=(0, 0)
)


class AsyncRWLock:
    """The asyncio twin of :class:`RWLock` for async actors (one event loop).

    Re-entry is by context: tasks a method starts inherit its read.
    """

    def __init__(self, priority_s: float = WRITER_PRIORITY_S) -> None:
        self._state = _Readers()
        self._priority_s = priority_s
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def try_write(self) -> bool:
        """Take the write side now if nothing reads or writes (no waiting); see :meth:`release_write`."""
        if not self._state.free():
            return False
        self._state.writer = True
        return True

    def release_write(self) -> None:
        """Release what :meth:`try_write` took (from the event loop's thread)."""
        self._state.writer = False
        cond = self._condition()

        async def wake() -> None:
            async with cond:
                cond.notify_all()

        asyncio.get_running_loop().create_task(wake())

    async def _enter(self, cond: asyncio.Condition) -> int:
        await cond.wait_for(self._state.admits)
        return self._state.enter()

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        depth, epoch = _async_held.get()
        cond = self._condition()
        if depth == 0:
            async with cond:
                epoch = await self._enter(cond)
        token = _async_held.set((depth + 1, epoch))
        try:
            yield
        finally:
            epoch = _async_held.get()[1]  # a write from inside the method re-entered in a new epoch
            _async_held.reset(token)
            if depth == 0:
                async with cond:
                    self._state.leave(epoch)
                    cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        depth, epoch = _async_held.get()
        cond = self._condition()
        async with cond:
            if depth:
                self._state.leave(epoch)
                cond.notify_all()
            await self._acquire(cond)
        try:
            yield
        finally:
            async with cond:
                self._state.writer = False
                cond.notify_all()
                if depth:
                    _async_held.set((depth, await self._enter(cond)))

    async def _acquire(self, cond: asyncio.Condition) -> None:
        state = self._state
        while True:
            state.gates += 1
            try:
                await asyncio.wait_for(cond.wait_for(state.free), self._priority_s)
            except asyncio.TimeoutError:
                pass
            else:
                state.writer = True
                return
            finally:
                state.gates -= 1
            cond.notify_all()
            epoch = state.step_aside()

            def drained(epoch: int = epoch) -> bool:
                return not state.older_than(epoch)

            await cond.wait_for(drained)

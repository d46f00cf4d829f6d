"""A writer's publishes, submitted to Ray from one thread per process, in order.

Submitting an actor call whose argument holds ``ObjectRef``\\ s costs Ray about
half a millisecond of the caller's time (more than a small version's ``ray.put``).
A push hands its publish to this process's sender thread and returns: the
trainer is blocked by its snapshot, not by Ray's submission. Everything else a
client asks the hub first waits for what is queued here (:meth:`Sender.flush`),
so the hub still sees one writer's calls in the order they were made.

At interpreter exit what is queued is sent; a submission that fails (Ray shut
down first) is logged and reported to the push's client, so it raises on that
client's next push or ``wait``, never silently.

Example:
    >>> sender().send(lambda: handle.publish_stamped.remote(publication), on_error=print)
    >>> sender().flush()        # before any other call to the hub
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["Sender", "sender"]

logger = logging.getLogger(__name__)

_Job = tuple[Callable[[], None], Callable[[BaseException], None]]


class Sender:
    """One thread that runs submissions in the order they were queued."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name="raysync-sender", daemon=True)
        self._thread.start()

    def send(self, submit: Callable[[], None], *, on_error: Callable[[BaseException], None]) -> None:
        """Run ``submit()`` on the sender thread after everything queued before it."""
        with self._cond:
            self._pending += 1
        self._queue.put((submit, on_error))

    def flush(self) -> None:
        """Return once everything queued so far was submitted (or failed)."""
        if threading.current_thread() is self._thread:
            return  # a submission calling back into a client: it is the one running
        with self._cond:
            while self._pending:
                self._cond.wait()

    def _loop(self) -> None:
        while True:
            submit, on_error = self._queue.get()
            try:
                submit()
            except BaseException as err:  # never lose one silently
                logger.error("raysync could not send a publish to the hub: %s", err)
                try:
                    on_error(err)
                except Exception:
                    logger.exception("raysync: reporting a failed publish failed")
            finally:
                # Let go of the job (its client and the version's refs) before waiting again:
                # a dropped client's version then leaves the object store at once.
                del submit, on_error
                with self._cond:
                    self._pending -= 1
                    if not self._pending:
                        self._cond.notify_all()


_SENDER: tuple[int, Sender] | None = None
_LOCK = threading.Lock()


def sender() -> Sender:
    """This process's :class:`Sender` (made on first use; a forked child makes its own)."""
    global _SENDER
    with _LOCK:
        if _SENDER is None or _SENDER[0] != os.getpid():
            if _SENDER is None:
                # Registered now, after ray.init (a push needs Ray): exit hooks run last-in
                # first-out, so what is queued is sent before Ray's own hook shuts it down.
                atexit.register(_flush_at_exit)
            _SENDER = (os.getpid(), Sender())
        return _SENDER[1]


def _flush_at_exit() -> None:
    current = _SENDER
    if current is not None and current[0] == os.getpid():
        current[1].flush()


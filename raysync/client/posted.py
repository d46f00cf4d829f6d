"""A sharded rank's parts it numbered itself and posted without waiting: the hub's answers, read later.

A rank numbers its pushes from its group's block (the hub's
:class:`~raysync.hub.state.rounds.Ahead`) and posts each part without waiting
(:meth:`raysync.client.push.PushPipeline.push`). The answers are read by the rank's next push
(and by every query, which waits for them first), as a single writer's stamped publishes' are:

- a part the hub took: nothing to do (an earlier push of the rank that was abandoned since is
  told, as a warning);
- a part of a push the hub did not take (it was abandoned, or numbered otherwise): told, as a
  warning, and the rank's next push asks the hub for its number again; a wait for that number
  raises why (the hub remembers it);
- a part refused because the group no longer writes the model (``StaleWriterError``): kept and
  raised by the rank's next push, as a blocking part's would have been.

Example:
    >>> posted = PostedParts()
    >>> posted.add("policy", 7, ref)                 # doctest: +SKIP
    >>> posted.read("policy", wait=True)             # doctest: +SKIP
    True
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from raysync.client.writer_lease import wait_answers
from raysync.errors import StaleWriterError

__all__ = ["PostedParts"]

logger = logging.getLogger(__name__)


class PostedParts:
    """One rank's posted parts whose answers it has not read, per model."""

    def __init__(self) -> None:
        self._unread: dict[str, list[tuple[int, concurrent.futures.Future[Any]]]] = {}
        self._stale: dict[str, StaleWriterError] = {}

    def add(self, model_id: str, version: int, ref: Any) -> None:
        """Watch the answer to the part posted for ``version`` (Ray completes the future)."""
        self._unread.setdefault(model_id, []).append((version, ref.future()))

    def read(self, model_id: str, *, wait: bool, timeout: float | None = 60.0) -> bool:
        """Read the answers that arrived (all with ``wait``; else waits only for those beyond the
        newest :data:`~raysync.client.writer_lease.MAX_IN_FLIGHT`); whether every part read was taken."""
        unread = self._unread.get(model_id, [])
        wait_answers([f for _, f in unread], timeout, every=wait)
        taken = True
        left = []
        for version, answer in unread:
            if not answer.done():
                left.append((version, answer))
                continue
            error = answer.exception()
            if error is None:
                earlier = getattr(answer.result(), "earlier", None)
                if earlier is not None:
                    logger.warning("an earlier push of %r was not published: %s", model_id, earlier)
                continue
            if isinstance(error, (ActorDiedError, ActorUnavailableError)):
                continue  # the hub restarted: it numbers the rank's next parts as they come
            cause = error.cause if isinstance(error, RayTaskError) else error
            taken = False
            logger.warning(
                "version %d of %r (a push that returned before the hub answered) was not published: %s",
                version,
                model_id,
                cause,
            )
            if isinstance(cause, StaleWriterError):
                self._stale.setdefault(model_id, cause)
        if left:
            self._unread[model_id] = left
        else:
            self._unread.pop(model_id, None)
        return taken

    def raise_stale(self, model_id: str) -> None:
        """Raise (once) the ``StaleWriterError`` of a part refused because the group no longer
        writes ``model_id``."""
        stale = self._stale.pop(model_id, None)
        if stale is not None:
            raise stale

    def models(self) -> list[str]:
        """The models with answers not read yet."""
        return sorted(self._unread)

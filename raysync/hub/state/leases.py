"""One writer per model: the writer lease, its fencing epoch, and who holds it."""

from __future__ import annotations

import logging
import time
from typing import Any

from raysync.errors import StaleWriterError
from raysync.hub.state.records import Model, Tables

__all__ = ["Leases", "lease_record", "who"]

logger = logging.getLogger(__name__)


class Leases:
    """Who may publish a model: the first writer, until it dies or another takes over."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables

    def writer_to_check(self, model_id: str, pusher: dict[str, Any], takeover: bool) -> dict[str, Any] | None:
        """One writer per model: None if ``pusher`` may publish; else the lease holder whose
        liveness decides (see :meth:`refuse_writer` and :meth:`hand_over`)."""
        model = self.tables.models.setdefault(model_id, Model())
        me, current = pusher.get("writer_id"), model.writer
        if me is None or current is None or current.get("writer_id") == me:
            if me is not None and current is None:
                model.writer = lease_record(pusher)
                model.epoch += 1
            return None
        if takeover:
            logger.warning(
                "hub %r: %s took over model %r (at version %d) from %s",
                self.tables.name,
                who(pusher),
                model_id,
                model.latest,
                who(current),
            )
            _pass_lease(model, pusher)
            return None
        return current

    def refuse_writer(
        self, model_id: str, current: dict[str, Any], pusher: dict[str, Any]
    ) -> StaleWriterError:
        return StaleWriterError(
            f"model {model_id!r} is written by {who(current)}; this process ({who(pusher)}) may not "
            "push to it. Stop the other trainer, push under another model_id, or take over with "
            "raysync.connect(..., takeover=True)"
        )

    def hand_over(self, model_id: str, current: dict[str, Any], pusher: dict[str, Any]) -> None:
        """The lease holder is gone: ``pusher`` takes the lease."""
        model = self.tables.models[model_id]
        logger.info(
            "hub %r: writer %s of %r is gone; %s takes over at version %d",
            self.tables.name,
            who(current),
            model_id,
            who(pusher),
            model.latest,
        )
        _pass_lease(model, pusher)


def _pass_lease(model: Model, pusher: dict[str, Any]) -> None:
    """The lease passes to ``pusher``: a new epoch, and its first version establishes the layout afresh."""
    model.writer = lease_record(pusher)
    model.epoch += 1
    model.layout = None


def lease_record(pusher: dict[str, Any]) -> dict[str, Any]:
    keys = ("writer_id", "kind", "actor_id", "job_id", "pid", "host")
    return {k: pusher.get(k) for k in keys} | {"since": time.time()}


def who(writer: dict[str, Any]) -> str:
    """A writer as a person reads it: an actor, the tasks of a job, or a job's driver."""
    kind = writer.get("kind") or ("actor" if writer.get("actor_id") else "driver")
    where = f"pid {writer.get('pid')} on {writer.get('host')}"
    if kind == "actor":
        return f"actor {writer['actor_id']} ({where})"
    if kind == "tasks":
        return f"tasks of job {writer.get('job_id')} (last push from {where})"
    return f"driver of job {writer.get('job_id')} ({where})"

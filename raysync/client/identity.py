"""Who is pushing: the identity a writer's lease names (an actor, or a job's driver and tasks)."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import ray

from raysync import _compat

__all__ = ["writer_identity"]


def writer_identity() -> dict[str, Any]:
    """Who is pushing: an actor, or a job (its driver and its tasks share one lease).

    Task workers are pooled and outlive their tasks, so a lease held by one would
    outlive the task and name an idle process; a job's tasks and driver are one writer.
    """
    pid = os.getpid()
    cached = _identity.get(pid)
    if cached is None:
        _identity.clear()
        cached = _identity[pid] = _look_up()
    return dict(cached)


_identity: dict[int, dict[str, Any]] = {}  # per process (a forked child looks itself up again)


def _look_up() -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    actor_id = ctx.get_actor_id()
    job_id = ctx.get_job_id()
    is_task = _compat.in_worker(ctx)
    kind = "actor" if actor_id else ("tasks" if is_task else "driver")
    return {
        "session": uuid.uuid4().hex,  # this process: a writer's processes get epochs of their own
        "writer_id": actor_id or f"job:{job_id}",
        "kind": kind,
        "actor_id": actor_id,
        "job_id": job_id,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }

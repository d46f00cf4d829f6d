"""The hub's and relays' CPU priority (raysync/hub/priority.py), each case in a process of its own."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import pytest

from raysync.hub.priority import control_plane_priority, freeze_startup_objects
from raysync.hub.settings import HubSettings


def _in_fork(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a forked process (its niceness changes stay there); its result."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=lambda: out.put(fn(*args)))
    proc.start()
    result = out.get(timeout=30)
    proc.join(timeout=30)
    return result


def _started_at(start_nice: int, env: str | None) -> tuple[int | None, int]:
    """What control_plane_priority reports in a process Ray started at ``start_nice``, with the
    hub's settings read from ``RAYSYNC_HUB_NICE=env`` (unset: ``None``), and what it has."""
    os.nice(start_nice - os.getpriority(os.PRIO_PROCESS, 0))  # as Ray starts its workers
    environ = {} if env is None else {"RAYSYNC_HUB_NICE": env}
    settings = HubSettings().resolved(environ)
    return control_plane_priority(settings.nice), os.getpriority(os.PRIO_PROCESS, 0)


def _run(start_nice: int, env: str | None) -> tuple[int | None, int]:
    return tuple(_in_fork(_started_at, start_nice, env))  # type: ignore[return-value]


def _lowers_niceness() -> bool:
    os.nice(1)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)
    except OSError:
        return False
    return True


def _may_raise_priority() -> bool:
    """Whether this machine lets a process lower its niceness (root or CAP_SYS_NICE)."""
    return bool(_in_fork(_lowers_niceness))


@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) != 0, reason="the tests themselves run niced")
def test_rays_niceness_is_kept_unless_asked_and_raised_only_where_allowed() -> None:
    assert _run(15, None) == (15, 15)  # the default: Ray's
    reported, actual = _run(15, "0")
    assert reported == actual
    assert actual == (0 if _may_raise_priority() else 15)  # never an error where it is not allowed


def test_the_environment_picks_the_niceness_or_keeps_rays() -> None:
    assert _run(15, "ray") == (15, 15)
    assert _run(15, "18") == (18, 18)  # raising the niceness is always allowed
    assert _run(15, "not a number") == (15, 15)  # a warning, no error


def _frozen() -> tuple[int, int, int]:
    """In a fresh process: objects tracked before, what freeze_startup_objects keeps out, and
    objects a full collection still scans after it."""
    import gc

    before = len(gc.get_objects())
    kept_out = freeze_startup_objects()
    return before, kept_out, len(gc.get_objects())


def test_start_up_objects_are_kept_out_of_full_collections() -> None:
    before, kept_out, after = _in_fork(_frozen)
    assert kept_out >= before > 1_000  # raysync's, torch's and pytest's imports
    assert after < 100  # what a full collection scans now: only what came after

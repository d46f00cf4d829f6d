"""The hub's and relays' CPU priority (raysync/hub/priority.py), each case in a process of its own."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from raysync.hub.priority import control_plane_priority


def _in_child(start_nice: int, env: str | None, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    os.nice(start_nice - os.getpriority(os.PRIO_PROCESS, 0))  # as Ray starts its workers
    if env is None:
        os.environ.pop("RAYSYNC_HUB_NICE", None)
    else:
        os.environ["RAYSYNC_HUB_NICE"] = env
    out.put((control_plane_priority(), os.getpriority(os.PRIO_PROCESS, 0)))


def _run(start_nice: int, env: str | None) -> tuple[int | None, int]:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_in_child, args=(start_nice, env, out))
    proc.start()
    result = out.get(timeout=30)
    proc.join(timeout=30)
    return result


def _may_raise_priority() -> bool:
    """Whether this machine lets a process lower its niceness (root or CAP_SYS_NICE)."""
    ctx = multiprocessing.get_context("fork")

    def probe(out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
        os.nice(1)
        try:
            os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)
            out.put(True)
        except OSError:
            out.put(False)

    out = ctx.Queue()
    proc = ctx.Process(target=probe, args=(out,))
    proc.start()
    allowed = bool(out.get(timeout=30))
    proc.join(timeout=30)
    return allowed


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

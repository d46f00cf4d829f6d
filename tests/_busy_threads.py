"""Lower the priority of the busy-polling NIXL progress threads of this test process and its children.

Every process that uses Ray's NIXL tensor transport gets a NIXL agent whose UCX
progress thread polls without pause (``nixl_agent`` sets ``pthrDelay = 0``; Ray
creates the agent with its defaults): one full core per process, for that
process's life. On the 2-core CI machine a NIXL test's trainer and two
subscribers leave nothing for the rest of the test, which then runs several
times slower. Nothing is patched: a watcher thread finds those threads (in a
process that mapped a NIXL library, a thread that used nearly all of the last
interval, never a main thread) and sets their nice value to 19 (``setpriority`` on the thread id),
so they yield most of the CPU to the processes the tests wait for.

Example:
    >>> with lowered_busy_nixl_threads():
    ...     run_nixl_test()
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_HZ = os.sysconf("SC_CLK_TCK")
_NICE = 19  # CFS weight 15 against 1024: under 2% of a core when others want it
_BUSY = 0.8  # share of the interval a thread must have run to count as busy


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def _uses_nixl(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("nixl" in line for line in f)
    except OSError:
        return False


def _cpu_ticks(pid: int, tid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def lowered_busy_nixl_threads(interval: float = 0.5) -> Iterator[list[int]]:
    """While inside, renice (19) every busy thread of a NIXL-using process in this process tree.

    Yields the list of thread ids lowered so far (for a check).
    """
    stop = threading.Event()
    lowered: list[int] = []
    last: dict[tuple[int, str], int] = {}
    nixl: dict[int, bool] = {}

    def watch() -> None:
        while not stop.wait(interval):
            for pid in _descendants(os.getpid()):
                if pid not in nixl or not nixl[pid]:
                    nixl[pid] = _uses_nixl(pid)
                if not nixl[pid]:
                    continue
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in tids:
                    if int(tid) == pid:  # a process's main thread (the tests' own work) is left alone
                        continue
                    ticks = _cpu_ticks(pid, tid)
                    if ticks is None or int(tid) in lowered:
                        continue
                    before = last.get((pid, tid))
                    last[(pid, tid)] = ticks
                    if before is not None and ticks - before >= _BUSY * interval * _HZ:
                        with contextlib.suppress(OSError):
                            os.setpriority(os.PRIO_PROCESS, int(tid), _NICE)
                            lowered.append(int(tid))

    watcher = threading.Thread(target=watch, name="lower-busy-nixl-threads", daemon=True)
    watcher.start()
    try:
        yield lowered
    finally:
        stop.set()
        watcher.join(timeout=5)

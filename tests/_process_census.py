"""What each test costs in processes: an opt-in pytest plugin (``-p tests._process_census``).

The suite's time on the 2-core machine goes mostly into starting processes: each Ray actor is a
process of its own that imports Ray and, for a subscriber, torch (2-3 s of CPU each here). This
plugin counts, per test, the processes started under this pytest process (its Ray cluster's
raylet's workers, torchrl's worker processes, ``ray start`` heads of system tests) and the CPU
seconds every process under this pytest process used while the test ran, itself included. At the
end it writes ``process-census-<worker>.json`` in the current directory and prints the tests that
started the most processes, so the next test to make cheaper is found by measurement:

    python -m pytest -p tests._process_census -n 2 --dist loadfile tests

Linux only (it reads ``/proc``); it changes nothing a test does.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

_HZ = os.sysconf("SC_CLK_TCK")
_SAMPLE_S = 0.2


def _children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc/*/stat`` (parent pid is its fourth field)."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of its children that it waited for."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / _HZ
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass
class _Census:
    """Processes under this pytest process seen so far, and each one's CPU when last seen."""

    root: int = field(default_factory=os.getpid)
    cpu: dict[int, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: int = 0  # processes first seen since the current test began
    used: float = 0.0  # CPU seconds since the current test began (an exited process: to its last sample)

    def sample(self) -> None:
        kids = _children()
        below: list[int] = []
        todo = list(kids.get(self.root, []))
        while todo:
            pid = todo.pop()
            below.append(pid)
            todo.extend(kids.get(pid, []))
        with self.lock:
            for pid in [self.root, *below]:
                now = _cpu_s(pid)
                if pid not in self.cpu:
                    if pid != self.root:
                        self.started += 1
                    self.cpu[pid] = 0.0 if pid != self.root else now
                self.used += max(0.0, now - self.cpu[pid])
                self.cpu[pid] = now

    def take(self) -> tuple[int, float]:
        """Processes started and CPU used since the last ``take``."""
        self.sample()
        with self.lock:
            taken = (self.started, self.used)
            self.started, self.used = 0, 0.0
        return taken


class _Plugin:
    def __init__(self) -> None:
        self.census = _Census()
        self.by_test: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-census", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self.census.sample()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> object:
        self.census.take()  # what ran between tests is nobody's
        yield
        started, used = self.census.take()
        self.by_test[item.nodeid] = {"processes": started, "cpu_s": round(used, 2)}

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._stop.set()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(f"process-census-{worker}.json").write_text(json.dumps(self.by_test, indent=1))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        _summary(terminalreporter, self.by_test)


class _Merger:
    """On the xdist controller: the workers' files, summed up once they ended."""

    def __init__(self) -> None:
        self.since = time.time()

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        by_test: dict[str, dict[str, float]] = {}
        for path in Path().glob("process-census-gw*.json"):
            if path.stat().st_mtime >= self.since:
                by_test.update(json.loads(path.read_text()))
        _summary(terminalreporter, by_test)


def _summary(terminalreporter: pytest.TerminalReporter, by_test: dict[str, dict[str, float]]) -> None:
    total = sum(row["processes"] for row in by_test.values())
    cpu = sum(row["cpu_s"] for row in by_test.values())
    terminalreporter.section(f"processes started: {int(total)} in {len(by_test)} tests, {cpu:.0f} cpu-s")
    for nodeid, row in sorted(by_test.items(), key=lambda kv: -kv[1]["processes"])[:25]:
        line = f"{int(row['processes']):4d} processes {row['cpu_s']:8.1f} cpu-s  {nodeid}"
        terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Merger(), "process-census-merger")  # the xdist controller
    else:
        config.pluginmanager.register(_Plugin(), "process-census-recorder")

"""End to end on a real head: `ray start --head`, `ray job submit` the quick start, then read what it left.

One head for the module (its own ports, temp dir and process group, so the session
cluster and anyone else's Ray on the machine are untouched): the quick start runs as
a job with token authentication, and the tests read its logs, the metrics the head
exports for Prometheus, and `raysync status` from another process.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks._ports import free_ports
from tests._support import wait_for_condition

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS, COLLECTORS = 20, 2
# `python -m ray.scripts.scripts` is the `ray` command, run by this interpreter (a copied
# virtualenv's `ray` script may point at another one).
RAY = [sys.executable, "-m", "ray.scripts.scripts"]

# The first test's setup starts a head (up to _HEAD_TRIES starts of up to 180 s each, when a loaded
# machine runs out of Ray's fixed 30 s for its raylet) and runs the quick start as a job: more than
# pytest's 300 s per test on a busy 2-core machine (seen: the head's second start was cut off). A
# hang is still bounded, by each wait's own timeout and by this.
pytestmark = pytest.mark.timeout(900)


@dataclass
class Head:
    gcs_address: str
    dashboard_url: str
    metrics_url: str
    env: dict[str, str]  # what a client needs: this venv first on PATH, token authentication
    proc: subprocess.Popen[bytes]  # `ray start --block`: it ends, and ends the head, if any part exits
    temp_dir: str

    def stopped(self) -> str | None:
        """Why the head is gone (`ray start`'s exit and log), or None while it runs."""
        if self.proc.poll() is None:
            return None
        log = Path(self.temp_dir) / "ray-start.log"
        return f"ray start exited {self.proc.returncode}: {log.read_text()[-3000:] if log.exists() else ''}"


@dataclass
class Job:
    head: Head
    submission_id: str
    status: str
    logs: str
    exported: dict[str, float]  # the raysync series the head exported while the job ran (see _Scraper)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).read()
        return True
    except urllib.error.HTTPError:
        return True  # up (the dashboard may want a token)
    except Exception:
        return False


_PORT_NAMES = (
    "port",
    "dashboard-port",
    "ray-client-server-port",
    "metrics-export-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "node-manager-port",
    "object-manager-port",
    "runtime-env-agent-port",
)
# `ray start` gives its raylet a fixed 30 s to register with the GCS; on a loaded 2-core
# machine (another test worker's cluster beside this one) that can run out. Such a start is
# tried again, on fresh ports; so is one that lost a port to another process between our pick
# and its bind (seen beside a busy core: "Address already in use" from the dashboard's server).
_STARTUP_TIMED_OUT = "timed out during startup"
_TRIED_AGAIN = (_STARTUP_TIMED_OUT, "Address already in use")
_RUNTIME_STARTED = "Ray runtime started."  # what `ray start` prints once its node is up


@dataclass
class _Started:
    proc: subprocess.Popen[bytes]
    temp_dir: str
    ports: dict[str, int]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Only what we started: SIGTERM makes `ray start --block` stop its own processes; then
    anything left in its process group (ours alone) is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _try_start(head_env: dict[str, str]) -> _Started | str:
    """One `ray start --head --block`: the head once its metrics and dashboard answer, or the
    log of a start that exited."""
    ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
    temp_dir = tempfile.mkdtemp(prefix="rsjob-", dir="/tmp")  # short: Ray's socket paths must fit
    cmd = [
        *RAY,
        "start",
        "--head",
        "--block",
        *(arg for name, port in ports.items() for arg in (f"--{name}", str(port))),
        "--dashboard-host",
        "127.0.0.1",
        "--num-cpus",
        "2",
        "--object-store-memory",
        str(500 * 2**20),
        "--temp-dir",
        temp_dir,
        "--disable-usage-stats",
    ]
    log_path = Path(temp_dir) / "ray-start.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=head_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    metrics_url = f"http://127.0.0.1:{ports['metrics-export-port']}/metrics"
    dashboard_url = f"http://127.0.0.1:{ports['dashboard-port']}"

    def up() -> bool:
        if proc.poll() is not None:
            return True
        # `ray start` says it started only once its raylet registered: the dashboard and the
        # metrics export answer earlier, and a start that then timed out waiting for the raylet
        # exits (seen here: the head "stopped before the job accepted").
        started = _RUNTIME_STARTED in log_path.read_text(errors="replace")
        return started and _answers(metrics_url) and _answers(f"{dashboard_url}/api/version")

    running = False
    try:
        wait_for_condition(up, timeout=180, interval=0.5, what="head, dashboard and its agent up")
        running = proc.poll() is None
        if running:
            return _Started(proc, temp_dir, ports)
        return f"ray start exited {proc.returncode}: {log_path.read_text()[-3000:]}{_head_logs(temp_dir)}"
    finally:
        if not running:  # exited, or never came up: nothing of it stays
            _stop(proc)
            shutil.rmtree(temp_dir, ignore_errors=True)


def _head_logs(temp_dir: str) -> str:
    """The last lines its raylet and GCS wrote, and what else of Ray runs here: why a start failed."""
    logs = Path(temp_dir) / "session_latest" / "logs"
    said = [
        f"\n--- {name}: {(logs / name).read_text(errors='replace')[-1500:]}"
        for name in ("raylet.out", "gcs_server.out")
        if (logs / name).exists()
    ]
    ps = subprocess.run(["ps", "-eo", "pid,pcpu,etimes,args"], capture_output=True, text=True, check=False)
    rays = [line[:160] for line in ps.stdout.splitlines() if "ray::" in line or "raylet" in line]
    return "".join(said) + "\n--- Ray processes on this machine:\n" + "\n".join(rays)


_HEAD_TRIES = 3  # a loaded 2-core machine ran out of Ray's 30 s twice in a row (three full runs here)


def _start_head(head_env: dict[str, str]) -> _Started:
    """A head, tried again (up to ``_HEAD_TRIES`` starts) while a start timed out waiting for its
    raylet or lost a port."""
    failed: list[str] = []
    started = _try_start(head_env)
    for _ in range(_HEAD_TRIES - 1):
        if not (isinstance(started, str) and any(why in started for why in _TRIED_AGAIN)):
            break
        failed.append(started)
        started = _try_start(head_env)
    if isinstance(started, str):
        raise AssertionError("\n\n=== the next start ===\n".join([*failed, started]))
    return started


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """A head of our own: `ray start --head --block` in a new process group, stopped by SIGTERM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    head_env = env | {
        "RAY_metrics_report_interval_ms": "1000",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # stop at once on SIGTERM
        "PYTHONUNBUFFERED": "1",  # `ray start`'s "started" line reaches its log at once
    }
    started = _start_head(head_env)
    try:
        address_file = Path(started.temp_dir) / "ray_current_cluster"
        port = started.ports["port"]
        gcs = address_file.read_text().strip() if address_file.exists() else f"127.0.0.1:{port}"
        yield Head(
            gcs,
            f"http://127.0.0.1:{started.ports['dashboard-port']}",
            f"http://127.0.0.1:{started.ports['metrics-export-port']}/metrics",
            env | {"RAY_AUTH_MODE": "token"},
            started.proc,
            started.temp_dir,
        )
    finally:
        _stop(started.proc)
        shutil.rmtree(started.temp_dir, ignore_errors=True)


def _python(head: Head, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """This venv's python with ``args``, as a client of the head (its env: PATH, token auth)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=head.env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _ray(head: Head, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return _python(head, *RAY[1:], *args, timeout=timeout)


def _said(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def _job_command(
    head: Head,
    *args: str,
    done: Callable[[subprocess.CompletedProcess[str]], bool],
    what: str,
    timeout: float,
    each_timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """`ray job ARGS` until ``done(its result)``, at most ``timeout`` s; fails at once if the head stopped.

    The job server answers through the dashboard and the head node's agent (Ray's job submission
    REST API: the dashboard hands each call to its job module's process, which calls the agent over
    HTTP). On a loaded machine either can fail to answer for a while though the head is running (a
    submission is refused with "No available agent" until the agent has registered; a module whose
    health check failed is restarted, and calls meanwhile are refused). A refused client asks
    again, as a user would: the tests assert the job's outcome, not the luck of one call.
    """
    results: list[subprocess.CompletedProcess[str]] = []

    def answered() -> bool:
        why = head.stopped()
        if why:
            raise AssertionError(f"the head stopped before {what}: {why}")
        try:
            results.append(_ray(head, "job", *args, timeout=each_timeout))
        except subprocess.TimeoutExpired as late:  # e.g. a follow that hangs: what it said so far
            said = [
                x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                for x in (late.stdout, late.stderr)
            ]
            results.append(subprocess.CompletedProcess(late.cmd, -9, *said))
        return done(results[-1])

    try:
        wait_for_condition(answered, timeout=timeout, interval=2.0, what=what)
    except AssertionError as err:
        last = f"exit {results[-1].returncode}: {_said(results[-1])[-3000:]}" if results else None
        raise AssertionError(f"{err}; the last answer: {last}") from None
    return results[-1]


class _Scraper:
    """The head's metrics export scraped every second, in a thread, as a Prometheus server would.

    A series exported only while what it measures lives (a subscriber's lag: until the hub drops
    the subscriber, some seconds after its job ended; then Ray drops the series) is held here as it
    was last seen, however long the tests take to read it.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.exported: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            # the head's agent busy (no answer, or half of one): the next scrape tries again
            with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                self.exported.update(_scrape(self.url))
            self._stop.wait(1.0)


@pytest.fixture(scope="module")
def job(head: Head) -> Job:
    """examples/quickstart.py, submitted as the README says, waited for until it ends."""
    submission_id = f"raysync-test-{uuid.uuid4().hex[:8]}"
    where = ("--address", head.dashboard_url)
    submit = ["submit", *where, "--submission-id", submission_id, "--working-dir", "."]
    submit += [
        "--",
        "python",
        "examples/quickstart.py",
        "--steps",
        str(STEPS),
        "--collectors",
        str(COLLECTORS),
    ]
    with _Scraper(head.metrics_url) as scraper:
        status, logs = _run_job(head, submission_id, submit)
    return Job(head, submission_id, status, logs, dict(scraper.exported))


def _run_job(head: Head, submission_id: str, submit: list[str]) -> tuple[str, str]:
    """`ray job submit` as the README says; the job's final status and its logs, once it ended."""
    where = ("--address", head.dashboard_url)
    # Without --no-wait, `ray job submit` follows the job until it ends and prints its final status.
    # Submitted again only while refused before the job was taken (a job taken already is refused
    # as "already exists").
    submitted = _job_command(
        head,
        *submit,
        done=lambda r: "submitted successfully" in _said(r) or "already exists" in _said(r),
        what="the job accepted",
        timeout=300,
        each_timeout=240,
    )
    ended = re.compile(rf"Job '{submission_id}' (succeeded|failed|was stopped)")
    status = _said(submitted)
    if not ended.search(status):  # the follow broke off (its log stream through the dashboard)
        status = _said(
            _job_command(
                head,
                "status",
                *where,
                submission_id,
                done=lambda r: bool(ended.search(_said(r))),
                what="the job's end",
                timeout=240,
            )
        )
    # The logs, read afterwards as a user would.
    logs = _job_command(
        head,
        "logs",
        *where,
        submission_id,
        done=lambda r: r.returncode == 0,
        what="the job's logs",
        timeout=120,
    )
    return status, logs.stdout


def test_quickstart_job_succeeds_and_every_collector_ends_on_the_last_version(job: Job) -> None:
    # The CLI reports JobStatus.SUCCEEDED as "Job '<id>' succeeded" (FAILED: "... failed").
    assert f"Job '{job.submission_id}' succeeded" in job.status, job.status[-2000:] + job.logs[-3000:]
    assert f"trained {STEPS} steps and pushed {STEPS} versions" in job.logs
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+-?[\d.]+\s+-?[\d.]+\s*$", job.logs, re.M)
    assert len(rows) == COLLECTORS, job.logs[-3000:]
    for _collector, rollouts, seen, _max_lag, final in rows:
        assert int(final) == STEPS  # applied versions: every collector ends on the newest
        assert int(rollouts) >= 1 and int(seen) >= 1
    assert "all collectors hold the newest version" in job.logs


def _scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {"name{label=value,...}": value}, raysync series only."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "raysync" in sample.name:
                labels = {
                    k: v for k, v in sample.labels.items() if k in ("model_id", "state", "transport", "le")
                }
                key = sample.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _series(scraped: dict[str, float], name: str, **labels: str) -> float | None:
    want = [f"{k}={v}" for k, v in labels.items()]
    hits = [
        v for key, v in scraped.items() if key.split("{")[0].endswith(name) and all(w in key for w in want)
    ]
    return sum(hits) if hits else None


def test_metrics_reach_the_heads_prometheus_export(job: Job) -> None:
    seen: dict[str, float] = {}

    def complete() -> dict[str, float] | None:
        try:
            m = _scrape(job.head.metrics_url)
        except (OSError, http.client.HTTPException, ValueError) as err:  # the agent busy: asked again
            seen["scrape failed: " + repr(err)] = 0.0
            return None
        seen.clear()
        seen.update({k: v for k, v in m.items() if "_bucket" not in k})
        published = _series(m, "raysync_pushes_total", model_id="policy")
        latest = _series(m, "raysync_latest_version", model_id="policy")
        return m if published == STEPS and latest == STEPS else None

    try:
        m = wait_for_condition(
            complete, timeout=60, interval=1.0, what="raysync series in the metrics export"
        )
    except AssertionError as err:
        raise AssertionError(f"{err}; raysync series seen: {seen}") from None
    # What a Prometheus server scraping the head would hold: the series exported while the job
    # ran (a subscriber's go some seconds after its job ended), and these.
    m = job.exported | m
    # (The trainer's own series, push timings and bytes, are exported by its process while it
    # lives: the quickstart's driver may exit before a report interval passed, so they are
    # shown by a trainer that waits for them, below.)
    assert (_series(m, "raysync_apply_duration_seconds_count", model_id="policy") or 0) >= COLLECTORS
    # exported (the job has ended by now, so its collectors may be dropped already: live 0)
    assert _series(m, "raysync_subscribers", model_id="policy", state="live") is not None
    assert _series(m, "raysync_subscriber_lag", model_id="policy") is not None


_TIMED_TRAINER = """
import json, sys, time, urllib.request
import ray, torch, raysync
from prometheus_client.parser import text_string_to_metric_families

address, url, pushes = sys.argv[1], sys.argv[2], int(sys.argv[3])
ray.init(address=address, log_to_driver=False)
hub = raysync.connect("timing-check")
model = torch.nn.Linear(64, 64)
for _ in range(pushes):
    hub.push(model, "timed")
seen = {}
deadline = time.monotonic() + 90
while time.monotonic() < deadline:  # this process exports its series while it lives: wait for them
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        time.sleep(1)
        continue
    seen = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_id") == "timed" and "raysync_push" in sample.name:
                name = sample.name[sample.name.index("raysync_push") :]  # Ray may prefix it
                seen[name] = seen.get(name, 0.0) + sample.value
    if seen.get("raysync_push_duration_seconds_count") == pushes:
        print("SEEN", json.dumps(seen))
        sys.exit(0)
    time.sleep(1)
print("NOT SEEN", seen)
sys.exit(1)
"""


def test_a_trainers_push_timings_and_bytes_reach_the_heads_export(job: Job) -> None:
    """A trainer's pushes are timed and counted in its own process's series, which reach the
    head's Prometheus export while it runs (it waits until they did, within 90 s)."""
    pushes = 3
    result = _python(
        job.head, "-c", _TIMED_TRAINER, job.head.gcs_address, job.head.metrics_url, str(pushes), timeout=240
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    seen = json.loads(result.stdout.split("SEEN", 1)[1].strip())
    assert seen["raysync_push_duration_seconds_count"] == pushes
    assert seen["raysync_push_duration_seconds_sum"] > 0
    assert seen["raysync_push_bytes_total"] >= pushes * 64 * 65 * 4  # the Linear's weight and bias, each push


def test_status_command_reads_the_jobs_hub_from_another_process(job: Job) -> None:
    # --timeout: connecting as a driver on a loaded machine may take more than the default 30 s
    result = _python(
        job.head,
        "-m",
        "raysync",
        "status",
        "--address",
        job.head.gcs_address,
        "--json",
        "--timeout",
        "120",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    status = json.loads(result.stdout)
    assert status["hub"] == "raysync"  # the default hub, found in raysync's namespace
    assert status["models"]["policy"]["latest"] == STEPS
    assert status["models"]["policy"]["pushes"] == STEPS


def test_status_without_the_token_fails_at_once_with_the_token_hint_first(head: Head) -> None:
    """The head authenticates by token (Ray 2.60's `ray start`); a client without RAY_AUTH_MODE=token
    is refused at each attempt, and `raysync status` says so rather than waiting out --timeout."""
    env = {k: v for k, v in head.env.items() if not k.startswith("RAY_AUTH")}
    result = subprocess.run(
        [sys.executable, "-m", "raysync", "status", "--address", head.gcs_address, "--timeout", "120"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    (message,) = result.stderr.strip().splitlines()
    assert message.startswith(
        f"raysync status: error: the Ray cluster at {head.gcs_address!r} refused this client's "
        "authentication: set RAY_AUTH_MODE=token"
    ), message
    assert "slow cluster" not in message  # not a timeout

"""The raysync command: `status` against a hub in the session cluster; `bench` for real (tiny) on
the session cluster, and from a directory outside the checkout on a local Ray of its own."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

import raysync
from benchmarks._ports import free_port
from raysync import _compat
from raysync.ops import bench, cli
from tests._support import small_policy, wait_for_condition


def _follower(hub_name: str, mode: str) -> Any:
    @ray.remote(num_cpus=0)
    @raysync.synced_model("policy", hub=hub_name, mode=mode)  # type: ignore[arg-type]
    class Follower:
        def __init__(self) -> None:
            self.policy = small_policy()

    return Follower.remote()


def test_status_shows_models_versions_subscribers_and_lag(
    hub: raysync.HubClient, hub_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    eager, lazy = _follower(hub_name, "push"), _follower(hub_name, "pull")
    wait_for_condition(lambda: len(hub.status()["subscribers"]) == 2, what="both followers registered")
    for seed in range(3):
        hub.push(small_policy(seed))
    wait_for_condition(
        lambda: any(s["applied"] == 3 for s in hub.status()["subscribers"]), what="eager follower on v3"
    )

    assert cli.main(["status", "--name", hub_name, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["hub"] == hub_name
    assert status["models"]["policy"]["latest"] == 3
    assert status["models"]["policy"]["versions_kept"] == [2, 3]
    rows = {s["mode"]: s for s in status["subscribers"]}
    assert (rows["push"]["applied"], rows["push"]["lag"]) == (3, 0)
    assert (rows["pull"]["applied"], rows["pull"]["lag"]) == (None, 3)  # pull mode waits to be asked

    assert cli.main(["status", "--name", hub_name]) == 0
    table = capsys.readouterr().out
    assert f"hub '{hub_name}'" in table
    for header in ("model", "latest", "kept", "subscriber", "applied", "lag", "state", "last error"):
        assert header in table
    policy_row = next(
        line for line in table.splitlines() if line.strip("│ ").startswith("policy") and "2,3" in line
    )
    assert " 3 " in policy_row  # latest version
    for sub in status["subscribers"]:
        line = next(line for line in table.splitlines() if sub["subscriber"] in line)
        cells = [c.strip() for c in line.split("│")]
        assert cells[cells.index(sub["mode"] + "/copy") + 2] == str(sub["lag"])
    ray.kill(eager)
    ray.kill(lazy)


def test_status_names_the_missing_hub_and_namespace(
    ray_start_regular: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", "--name", "no-such-hub", "--namespace", "elsewhere"]) == 1
    err = capsys.readouterr().err
    assert "no raysync hub named 'no-such-hub' in namespace 'elsewhere'" in err


@pytest.fixture
def not_ray() -> Iterator[str]:
    """The address of a TCP server that accepts connections and never answers: no Ray GCS."""
    server = socket.socket()
    server.bind(("0.0.0.0", 0))  # every interface: Ray dials this machine's IP, not 127.0.0.1
    server.listen(16)
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


# `python -m raysync ARGS` (raysync/__main__.py is `sys.exit(main())`), but first writing down the
# moment the command starts: after the interpreter's start and the imports the command makes before
# its --timeout begins (Ray, rich). Those are not the command's to bound, and on a loaded 2-core
# machine they alone can take many seconds.
_TIMED_RAYSYNC = (
    "import sys, time, ray, rich.console, rich.progress\n"
    "from raysync.ops.cli import main\n"
    "with open(sys.argv[1], 'w') as started:\n"
    "    started.write(repr(time.clock_gettime(time.CLOCK_MONOTONIC)))\n"
    "sys.exit(main(sys.argv[2:]))\n"
)
AFTER_TIMEOUT_S = 8.0
"""How long a command may take past its ``--timeout`` (documented: it bounds the whole command,
connecting included) to print its message and exit. Without that bound Ray tries for minutes."""


def _raysync(*args: str, limit: float, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the raysync command as a user would; return its result and the seconds from the moment the
    command started (see ``_TIMED_RAYSYNC``) until its process ended."""
    stamp = tmp_path / "started"
    done = subprocess.run(
        [sys.executable, "-c", _TIMED_RAYSYNC, str(stamp), *args],
        capture_output=True,
        text=True,
        timeout=limit + 120,
    )
    ended = time.clock_gettime(time.CLOCK_MONOTONIC)  # one clock for every process of this machine
    assert stamp.exists(), done.stderr[-3000:]
    return done, ended - float(stamp.read_text())


def test_status_without_a_cluster_says_so(
    not_ray: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_cluster(**_: Any) -> None:
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    assert cli.main(["status", "--address", not_ray]) == 1
    err = capsys.readouterr().err
    assert f"no Ray cluster at {not_ray!r}" in err and "ray start --head" in err
    assert "Could not find any running Ray instance" in err


def test_case10_status_unreachable_address_honours_timeout(tmp_path: Path) -> None:
    """A closed port: exit 1 at once with one message naming the address and what to check."""
    address = f"127.0.0.1:{free_port()}"
    done, elapsed = _raysync("status", "--address", address, "--timeout", "5", limit=5, tmp_path=tmp_path)
    assert done.returncode == 1, done.stderr
    assert elapsed < 5 + AFTER_TIMEOUT_S, f"took {elapsed:.1f} s"
    (message,) = done.stderr.strip().splitlines()
    assert f"no Ray cluster at {address!r}" in message and "cannot open a TCP connection" in message
    for hint in ("ray start --head", "RAY_ADDRESS", "RAY_AUTH_MODE=token"):
        assert hint in message
    assert done.stdout == ""


def test_case10_status_address_that_is_not_ray_honours_timeout(not_ray: str, tmp_path: Path) -> None:
    """A port that accepts TCP but is no GCS: ray.init would retry for minutes; --timeout ends it."""
    done, elapsed = _raysync("status", "--address", not_ray, "--timeout", "3", limit=3, tmp_path=tmp_path)
    assert done.returncode == 1, done.stderr
    assert elapsed < 3 + AFTER_TIMEOUT_S, f"took {elapsed:.1f} s"
    (message,) = done.stderr.strip().splitlines()  # none of Ray's per-attempt GCS warnings
    assert (
        f"no Ray cluster at {not_ray!r}" in message
        and "accepts connections, but no Ray GCS answered within --timeout 3 s" in message
    )
    for hint in ("ray start --head", "RAY_ADDRESS", "RAY_AUTH_MODE=token"):
        assert hint in message
    assert done.stdout == ""


def test_case10_status_address_that_does_not_answer_honours_timeout(tmp_path: Path) -> None:
    """A non-routable address: SYNs go unanswered (or, behind some proxies, TCP opens and no GCS answers)."""
    address = "10.255.255.1:6379"
    done, elapsed = _raysync("status", "--address", address, "--timeout", "3", limit=3, tmp_path=tmp_path)
    assert done.returncode == 1, done.stderr
    assert elapsed < 3 + AFTER_TIMEOUT_S, f"took {elapsed:.1f} s"
    (message,) = done.stderr.strip().splitlines()
    assert f"no Ray cluster at {address!r}" in message
    for hint in ("ray start --head", "RAY_ADDRESS", "RAY_AUTH_MODE=token"):
        assert hint in message


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "soon"])
def test_case10_status_rejects_a_timeout_that_is_not_a_positive_number(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["status", "--timeout", timeout])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--timeout" in err and repr(timeout) in err and "seconds" in err


def test_status_table_shows_last_errors_and_unhealthy_states() -> None:
    status = {
        "hub": "h",
        "keep": 2,
        "uptime_s": 75.0,
        "restored_models": [],
        "models": {
            "policy": {
                "latest": 7,
                "versions_kept": [6, 7],
                "bytes_per_version": 3 * 2**20,
                "buckets": 1,
                "pushes": 7,
                "bytes_pushed": 21 * 2**20,
                "last_push_age_s": 2.0,
                "writer": {"actor_id": None, "job_id": "01000000", "pid": 42, "host": "node-a"},
            }
        },
        "subscribers": [
            {
                "subscriber": "Collector-1/policy",
                "model_id": "policy",
                "class_name": "Collector",
                "node_id": "abcdef0123",
                "mode": "push",
                "apply": "copy",
                "applied": 5,
                "lag": 2,
                "state": "unreachable",
                "last_apply_s": 0.0031,
                "last_apply_time": None,
                "last_error": "WeightMismatchError: 'fc.weight' has shape (4, 8), expected (4, 16)",
            }
        ],
    }
    out = io.StringIO()
    cli.render_status(status, file=out)
    text = out.getvalue()
    assert "unreachable" in text and "3.1 ms" in text and "3.00 MiB" in text and "21.00 MiB" in text
    assert "last errors" in text
    assert (
        "Collector-1/policy (policy): WeightMismatchError: 'fc.weight' has shape (4, 8), expected (4, 16)"
        in text
    )


def test_bench_checks_the_cluster_it_runs_in_and_leaves_nothing_behind(
    ray_start_regular: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`raysync bench` from a process connected to a cluster checks that cluster; afterwards neither a
    hub, nor an actor, nor a record of its hubs in the GCS is left there."""
    results = tmp_path / "bench.json"
    # copies to two actors here; views to one in the run from outside the checkout below
    argv = ["bench", "--sizes-mib", "1", "--small-kib", "4", "--actors", "2", "--apply", "copy"]
    assert cli.main([*argv, "--repeats", "2", "--warmup", "1", "--json", str(results)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("raysync bench on this process's Ray cluster: 1 node(s), 4 CPUs")
    lines = [line for line in out.splitlines() if line.startswith(("  met ", "  MISS"))]
    wheres = ["1 MiB copy N=2", "4 KiB copy N=2"]
    assert len(lines) == 4, out  # all applied and trainer blocked, for each
    for where in wheres:
        assert sum(where in line and line.endswith(" yes") for line in lines) == 2, out  # both checks, held
    assert f"/{len(lines)} met" in out and f"JSON: {results}" in out
    report = json.loads(results.read_text())
    assert {row["check"] for row in report["rows"]} == set(bench.CHECKS)
    for row in report["rows"]:
        assert len(row["samples_s"]) == len(row["floor_samples_s"]) == 2, row
        assert row["measured_s"] > 0 and row["floor_s"] > 0 and row["verified"] is True, row

    def left() -> list[str]:
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        stored = _compat.kv_list(b"raysync-bench-", namespace="raysync")
        return [n for n in named if n.startswith("raysync-bench-")] + [k.decode() for k in stored]

    # Ray forgets a killed actor's name a moment after it is gone: slower on a loaded machine.
    remaining: list[str] = []

    def nothing_left() -> bool:
        remaining[:] = left()
        return not remaining

    try:
        wait_for_condition(
            nothing_left, timeout=90, interval=0.1, what="raysync bench's hubs and records gone"
        )
    except AssertionError:
        raise AssertionError(f"raysync bench left a hub, relay or record behind: {remaining}") from None


def test_bench_that_fails_half_way_says_where_in_one_line(
    ray_start_regular: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def stuck(*args: Any) -> list[dict[str, Any]]:
        raise TimeoutError("2 receivers did not register with the hub within 120 s")

    monkeypatch.setattr(bench, "_delivery", stuck)
    assert cli.main(["bench", "--quick", "--json", str(tmp_path / "b.json")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and not (tmp_path / "b.json").exists()
    (message,) = [line for line in captured.err.splitlines() if line.startswith("raysync bench: error:")]
    assert message == (
        "raysync bench: error: the check stopped at 'fan-out 16 MiB N=2 apply=copy': "
        "TimeoutError: 2 receivers did not register with the hub within 120 s"
    )


# Ray gives a new node's raylet a fixed 30 s to register with the GCS; on a loaded 2-core machine
# that can run out before the bench began.
_STARTUP_TIMED_OUT = "timed out during startup"


def test_bench_runs_from_the_package_without_the_checkout(tmp_path: Path) -> None:
    """`python -m raysync bench` runs the check installed with raysync, on a local Ray of its own.

    A real run, tiny (1 MiB to one view receiver and 4 KiB to one, two timed rounds), in a working
    directory with no benchmarks/ and nothing of the checkout on the path but the raysync package
    itself (the one under test, linked into a folder of its own).
    """
    site = tmp_path / "site"
    site.mkdir()
    (site / "raysync").symlink_to(Path(raysync.__file__).resolve().parent)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(site)}
    work = tmp_path / "work"
    work.mkdir()
    probe = (  # is the checkout, or a push_fanout.py in some `benchmarks` package, importable there?
        "import importlib.util as u, pathlib, sys, raysync; b = u.find_spec('benchmarks'); "
        "print(sorted({str(pathlib.Path(p or '.').resolve()) for p in sys.path}), "
        "u.find_spec('push_fanout'), [p for p in (b.submodule_search_locations if b else []) "
        "if (pathlib.Path(p) / 'push_fanout.py').exists()], raysync.__file__)"
    )
    found = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True)
    checkout = Path(raysync.__file__).resolve().parent.parent
    assert f"'{checkout}'" not in found.stdout and " None [] " in found.stdout, found
    assert found.stdout.strip().endswith(str(site / "raysync" / "__init__.py")), found

    argv = [sys.executable, "-m", "raysync", "bench", "--quick", "--sizes-mib", "1", "--actors", "1"]
    argv += ["--apply", "view", "--repeats", "2", "--warmup", "1"]
    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    if done.returncode != 0 and _STARTUP_TIMED_OUT in done.stderr:  # its Ray never started: again, once
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, tail
    report = json.loads((work / "raysync-bench" / "bench.json").read_text())
    assert [(r["check"], r["where"], r["verified"]) for r in report["rows"]] == [
        ("fan-out: all applied", "1 MiB view N=1", True),
        ("fan-out: trainer blocked", "1 MiB view N=1", True),
        ("small: all applied", "4 KiB copy N=1", True),
        ("small: trainer blocked", "4 KiB copy N=1", True),
    ], tail
    assert all(len(r["samples_s"]) == 2 for r in report["rows"])  # --repeats 2
    said = " ".join(done.stdout.split())
    assert said.startswith("raysync bench on a local Ray of its own: 1 node(s)"), tail
    assert "measured floor ratio bound ok" in said and said.count("A miss: ") == 4, tail
    assert "/4 met" in said and "JSON: raysync-bench/bench.json" in said, tail
    assert "ANCHORS" not in done.stdout and ".md" not in done.stdout, tail


def test_bench_unreachable_address_says_so(tmp_path: Path) -> None:
    """`raysync bench --address` at a closed port: exit 1 at once, naming the address, before any check."""
    address = f"127.0.0.1:{free_port()}"
    argv = ("bench", "--quick", "--address", address, "--timeout", "5")
    done, elapsed = _raysync(*argv, limit=5, tmp_path=tmp_path)
    assert done.returncode == 1, done.stderr
    assert elapsed < 5 + AFTER_TIMEOUT_S, f"took {elapsed:.1f} s"
    (message,) = done.stderr.strip().splitlines()
    assert message.startswith("raysync bench: error: ") and f"no Ray cluster at {address!r}" in message
    assert done.stdout == ""


def test_installed_as_the_raysync_console_script() -> None:
    from importlib.metadata import entry_points

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "raysync"]
    assert script.load() is cli.main

"""The raysync command: `status` against a hub in the session cluster, `bench` with a stand-in script."""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import ray

import raysync
from raysync import cli

from .conftest import small_policy, wait_for_condition


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


def test_status_without_a_cluster_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_cluster(**_: Any) -> None:
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    assert cli.main(["status", "--address", "10.9.9.9:6379"]) == 1
    err = capsys.readouterr().err
    assert "no Ray cluster at '10.9.9.9:6379'" in err and "ray start --head" in err


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


def _fake_rows() -> list[dict[str, Any]]:
    rows = []
    for size in (16, 64):
        for apply, factor in (("copy", 1.2), ("view", 0.6)):
            for n in (1, 2, 4):
                floor = 0.002 * size / 16 * (1 + n / 2)
                rows.append(
                    {
                        "size_mib": size,
                        "apply": apply,
                        "n": n,
                        "floor_s": floor,
                        "push_to_all_applied_s": floor * factor,
                    }
                )
    return rows


def test_plot_fanout_writes_a_png(tmp_path: Path) -> None:
    path = cli.plot_fanout(_fake_rows(), tmp_path / "plots" / "fanout.png", title="fake")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bench_runs_the_script_with_progress_table_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`raysync bench` drives whatever benchmark script it is given the way it drives push_fanout.py."""
    script = tmp_path / "fake_fanout.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import argparse, json, logging
            from pathlib import Path
            logger = logging.getLogger("push_fanout")
            ROWS = {_fake_rows()!r}

            def parse_args(argv):
                p = argparse.ArgumentParser()
                p.add_argument("--quick", action="store_true")
                p.add_argument("--json", type=Path, default=Path({str(tmp_path / "r.json")!r}))
                a = p.parse_args(argv)
                a.sizes_mib, a.actors = ([16], [1, 2]) if a.quick else ([16, 64], [1, 2, 4])
                a.apply = ["copy", "view"]
                return a

            def main(argv):
                a = parse_args(argv)
                rows = [r for r in ROWS if r["size_mib"] in a.sizes_mib and r["n"] in a.actors]
                for size in a.sizes_mib:
                    for n in a.actors:
                        logger.info("%d MiB, N=%d: floor", size, n)
                        for apply in a.apply:
                            logger.info("%d MiB, N=%d, apply=%s: raysync", size, n, apply)
                print("size apply N | applied_s floor_s")
                a.json.write_text(json.dumps({{"meta": {{"cpus": 2}}, "rows": rows}}))
                return 0
            """
        )
    )
    plot = tmp_path / "quick.png"
    assert cli.main(["bench", "--quick", "--script", str(script), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "size apply N | applied_s floor_s" in out and f"plot: {plot}" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["bench", "--script", str(tmp_path / "missing.py")]) == 1
    assert "benchmark script not found" in capsys.readouterr().err


def test_installed_as_the_raysync_console_script() -> None:
    from importlib.metadata import entry_points

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "raysync"]
    assert script.load() is cli.main

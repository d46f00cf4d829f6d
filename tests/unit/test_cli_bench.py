"""What ``raysync bench`` tells a user, without Ray: its --help, and its target checks for fake rows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import raysync
from raysync.ops import cli
from raysync.ops.bench import fanout, fanout_report, scheme_rows

MIB = 2**20
SCENARIO_OPTIONS = {
    "--sizes-mib", "--actors", "--apply", "--repeats", "--warmup", "--tensors", "--keep", "--timeout",
    "--quiet-timeout", "--floor-source", "--object-store-mib", "--no-prefault", "--schemes",
    "--schemes-only", "--adapters", "--json", "--verbose", "--quick", "--plot",
}  # fmt: skip


def _bench_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes


def test_bench_help_lists_every_option_with_the_defaults_of_both_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _bench_help(capsys)
    missing = sorted(flag for flag in SCENARIO_OPTIONS if flag not in text)
    assert not missing, f"raysync bench --help does not list {missing}"
    options = {flag for action in fanout.build_parser()._actions for flag in action.option_strings}
    assert options <= SCENARIO_OPTIONS | {"-h", "--help"}, "a new option: add it to SCENARIO_OPTIONS"
    for flag, key in (("--sizes-mib", "sizes_mib"), ("--actors", "actors"), ("--repeats", "repeats")):
        full = fanout.FULL[key]
        quick = fanout.QUICK[key]
        shown = " ".join(map(str, full)) if isinstance(full, list) else str(full)
        quick_shown = " ".join(map(str, quick)) if isinstance(quick, list) else str(quick)
        assert f"{flag} {shown}" in text, f"the full run's {flag} is not in --help"
        assert f"{flag} {quick_shown}" in text, f"--quick's {flag} is not in --help"
    assert "default: raysync-bench/push_fanout.json" in text.replace("raysync- bench", "raysync-bench")
    assert "about 5 minutes on 2 cores" in text and "under a minute" in text  # how long each run takes
    assert "exit code: 0 when every receiver ended on the last version pushed" in text
    assert "whether or not the targets were met" in text


def test_bench_help_stays_out_of_the_status_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`raysync --help` names bench in one line; building its options is left to `raysync bench --help`."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "raysync bench --help: every option" in " ".join(capsys.readouterr().out.split())


def _rows() -> list[dict[str, Any]]:
    """A --quick run as the issue saw it: 16 MiB, N = 1 2, ratios of 5.63 against <= 1.3."""
    rows = []
    for apply in ("copy", "view"):
        for n in (1, 2):
            floor = 0.002 * (1 + n)
            rows.append(
                {
                    "size_mib": 16,
                    "model_bytes": 16 * MIB,
                    "apply": apply,
                    "n": n,
                    "floor_s": floor,
                    "push_to_all_applied_s": floor * 5.63,
                    "ratio_to_floor": 5.63,
                    "trainer_block_s": 0.004,
                    "snapshot_copy_s": 0.0015,
                    "block_vs_snapshot": 0.004 / 0.0015,
                    "snapshot_in_push_s": 0.002,
                    "store_bytes_per_version": 16.2 * MIB,
                    "store_copies_per_version": 16.2 / 16,
                    "receiver_apply_max_s": 0.003,
                    "receiver_private_rss_bytes": 50 * MIB,
                    "verified": True,
                }
            )
    return fanout_report.add_ratios(rows)


def _checks_output(capsys: pytest.CaptureFixture[str]) -> str:
    fanout_report.print_checks(fanout_report.check_targets(_rows()), cpus=16)
    return capsys.readouterr().out


def test_bench_checks_show_each_value_beside_its_floor(capsys: pytest.CaptureFixture[str]) -> None:
    fanout_report.print_checks(fanout_report.check_targets(_rows()))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("  met ", "  MISS"))]
    assert len(lines) == 15
    by_target = {}
    for line in lines:
        by_target.setdefault(line[8:45].strip(), []).append(line)
    # push-to-all-applied 33.8 ms against the floor of 6.0 ms at N=2 (0.006 s), ratio 5.63
    (n2_copy,) = [x for x in by_target["push-to-all-applied / floor"] if "16 MiB copy N=2" in x]
    assert re.search(r"33\.8 ms +6\.0 ms +5\.63 +<= 1\.3$", n2_copy), n2_copy
    (block,) = [x for x in by_target["trainer block / snapshot copy"] if "16 MiB view N=1" in x]
    assert re.search(r"4\.0 ms +1\.5 ms +2\.67 +<= 1\.3$", block), block
    (store,) = [x for x in by_target["object-store copies per version"] if "16 MiB view N=1" in x]
    assert re.search(r"16\.2 MiB +16\.0 MiB +1\.01 +<= 1\.1$", store), store
    header = next(line for line in out.splitlines() if "target" in line and "where" in line)
    assert header.split()[-5:] == ["where", "measured", "floor", "ratio", "bound"]


def test_bench_checks_say_what_a_miss_means_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    out = _checks_output(capsys)
    text = " ".join(out.split())
    assert "ANCHORS" not in out and ".md" not in out  # no file the package does not ship
    assert "set on its 2-core reference machine (this machine: 16 CPUs)" in text
    assert "compare the measured column with the floor column beside it" in text
    assert "A MISS is information, not a failure: the exit code is 0" in text
    assert "8 of the misses are at 16 MiB, below the 256 MiB the targets are set for" in text
    for target in (
        "push-to-all-applied / floor",
        "trainer block / snapshot copy",
        "object-store copies per version",
        "view: push-to-all-applied flat in N",
        "trainer block flat in N",
    ):
        explained = re.search(re.escape(target) + r": (.+?); floor: (.+?)\. A miss: (.+?)\.", text)
        assert explained, f"{target!r} is not explained"
    assert "floor: one snapshot copy_ in the driver + N simultaneous copy_ in N plain actors" in text


def test_bench_scheme_checks_name_no_file_and_keep_the_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    scheme_rows.print_scheme_checks(
        [
            {
                "size_mib": 64,
                "n": 8,
                "apply": "copy",
                "target_x": 3.0,
                "bound_s": 0.03,
                "best_path": "raysync hub, apply=copy",
                "best_s": 0.09,
                "best_x": 1.1,
                "met": False,
                "floor_s": 0.04,
                "floor_x": 2.3,
            }
        ]
    )
    out = capsys.readouterr().out
    assert "ANCHORS" not in out and ".md" not in out
    assert "2-core reference machine" in out and "A MISS does not change the exit code" in " ".join(
        out.split()
    )


def test_no_benchmark_output_names_a_file_outside_the_package() -> None:
    """The targets' source (a file of the project's workspace) is not shipped: no output names it."""
    root = Path(raysync.__file__).parent / "ops"
    named = [str(p.relative_to(root)) for p in root.rglob("*.py") if "ANCHORS" in p.read_text()]
    assert not named, f"{named} name ANCHORS.md, which the package does not ship"

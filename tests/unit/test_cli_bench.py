"""What ``raysync bench`` tells a user, without Ray: its --help, its options, its report for fake rows."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import raysync
from raysync.ops import bench, cli

MIB = 2**20
OPTIONS = {
    "--address", "--quick", "--sizes-mib", "--small-kib", "--actors", "--apply", "--repeats", "--warmup",
    "--timeout", "--json", "--verbose",
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
    missing = sorted(flag for flag in OPTIONS if flag not in text)
    assert not missing, f"raysync bench --help does not list {missing}"
    shown = set(re.findall(r"\[(--[a-z-]+)", text))
    assert shown == OPTIONS, f"a new option: add it to OPTIONS ({shown ^ OPTIONS})"
    for flag, key in (("--sizes-mib", "sizes_mib"), ("--small-kib", "small_kib"), ("--actors", "actors")):
        full, quick = (" ".join(map(str, run[key])) for run in (bench.FULL, bench.QUICK))
        assert f"{flag} {full}" in text and f"{flag} {quick}" in text, f"{flag}'s runs are not in --help"
    assert "(default: 5; --quick: 3)" in text  # --repeats
    assert "default: $RAY_ADDRESS, else a local Ray of its own" in text  # where it runs
    assert "default: raysync-bench/bench.json" in text.replace("raysync- bench", "raysync-bench")
    assert "about 3.5 minutes on 2 cores" in text and "under a minute" in text  # how long each run takes
    assert "up to about 7 GiB of memory" in text
    assert "exit code: 0 when every receiver ended on the last version pushed" in text
    assert "whether or not the targets were met" in text
    assert "source checkout's benchmarks/" in text  # where the comparisons went


@pytest.mark.parametrize("option", ["--schemes", "--adapters", "--plot=x.png", "--floor-source=private"])
def test_bench_refuses_the_options_of_the_comparisons(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--quick", option])
    assert exit_info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--actors", "0"], ["--sizes-mib", "x"], ["--repeats", "-1"]])
def test_bench_refuses_counts_below_one(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_bench_options_given_win_over_quick() -> None:
    parser = cli._parser()
    quick = bench.config_from(parser.parse_args(["bench", "--quick"]))
    assert {key: getattr(quick, key) for key in bench.QUICK} == bench.QUICK
    mine = bench.config_from(
        parser.parse_args(["bench", "--quick", "--actors", "4", "1", "4", "--apply", "view"])
    )
    assert (mine.actors, mine.apply, mine.sizes_mib) == ((1, 4), ("view",), bench.QUICK["sizes_mib"])
    full = bench.config_from(parser.parse_args(["bench"]))
    assert full == bench.BenchConfig()
    with pytest.raises(ValueError, match="apply modes"):
        bench.BenchConfig(apply=("copy", "mmap"))


def test_raysync_help_names_bench_and_loads_neither_torch_nor_ray() -> None:
    """`raysync --help` and `raysync bench --help` stay fast: the check imports torch and Ray when it runs."""
    probe = (
        "import sys, contextlib, io; from raysync.ops import cli\n"
        "for argv in (['--help'], ['bench', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        cli.main(argv)\n"
        "    print(' '.join(out.getvalue().split()))\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    top, _, loaded = done.stdout.strip().splitlines()
    assert "bench check a Ray cluster: push fan-out and small versions beside Ray's floor" in top
    assert loaded == "[]"


def _report() -> dict[str, Any]:
    """A --quick run on a 3-node cluster: 16 MiB misses its fan-out bound, the small version meets its."""
    rows = []
    for check, where, size, measured, floor in (
        ("fan-out: all applied", "16 MiB copy N=2 on 2 nodes", 16 * MIB, 0.0338, 0.006),
        ("fan-out: trainer blocked", "16 MiB copy N=2 on 2 nodes", 16 * MIB, 0.004, 0.0015),
        ("small: all applied", "4 KiB copy N=2 on 2 nodes", 4096, 0.0045, 0.005),
        ("small: trainer blocked", "4 KiB copy N=2 on 2 nodes", 4096, 0.0018, 0.0012),
    ):
        bound = bench.CHECKS[check][0]
        ratio = measured / floor
        rows.append(
            {"check": check, "where": where, "bytes": size, "measured_s": measured, "floor_s": floor}
            | {"ratio": ratio, "bound": bound, "met": ratio <= bound, "verified": True}
        )
    rows[-1]["verified"] = False
    return {"meta": {"nodes": 3, "cpus": 48.0, "versions": {"ray": "2.60.0"}}, "rows": rows}


def test_bench_report_shows_each_value_beside_its_floor_and_what_a_miss_means() -> None:
    out = io.StringIO()
    bench.print_report(_report(), where="10.0.0.5:6379", file=out)
    text = out.getvalue()
    assert text.startswith("raysync bench on 10.0.0.5:6379: 3 node(s), 48 CPUs, Ray 2.60.0")
    lines = [line for line in text.splitlines() if line.startswith(("  met ", "  MISS"))]
    assert len(lines) == 4
    (fanout,) = [x for x in lines if "fan-out: all applied" in x]
    assert fanout.startswith("  MISS") and re.search(r"33\.80 ms +6\.00 ms +5\.63 +<= 1\.3 +yes$", fanout)
    (small,) = [x for x in lines if "small: all applied" in x]
    assert small.startswith("  met ") and re.search(r"4\.50 ms +5\.00 ms +0\.90 +<= 1\.0 +yes$", small)
    assert lines[-1].endswith(" NO")  # a receiver that did not end on the version pushed
    header = next(line for line in text.splitlines() if "check" in line and "where" in line)
    assert header.split()[-6:] == ["where", "measured", "floor", "ratio", "bound", "ok"]
    said = " ".join(text.split())
    assert "2/4 met" in said
    assert "set on its 2-core reference machine (this cluster: 3 node(s), 48 CPUs)" in said
    assert "compare the measured column with the floor column beside it" in said
    assert "A MISS is information, not a failure: the exit code is 0" in said
    assert "Fan-out misses at 16 MiB are below the 256 MiB the fan-out targets are set for" in said
    for check in bench.CHECKS:
        explained = re.search(
            re.escape(check) + r": (.+?); floor: (.+?); bound: (.+?)\. A miss: (.+?)\.", said
        )
        assert explained, f"{check!r} is not explained"
    assert "floor: ray.put of the same bytes + N plain actors ray.get it" in said


@pytest.mark.parametrize(
    "measured, floor, shown",
    [
        (0.01302, 0.01, "1.302"),  # a miss that two decimals would print as 1.30, beside "<= 1.3"
        (0.0130004, 0.01, "1.30004"),
        (0.013 + 1e-12, 0.01, ">1.3"),  # above the bound by less than any decimals shown
        (0.01299, 0.01, "1.30"),  # met, rounded up to the bound: still reads as met
        (0.0128, 0.01, "1.28"),
        (0.0338, 0.006, "5.63"),
    ],
)
def test_bench_report_never_prints_a_miss_as_a_ratio_within_its_bound(
    measured: float, floor: float, shown: str
) -> None:
    """`raysync bench --quick` printed a MISS with ratio "1.30" against "<= 1.3" (issue 48)."""
    report = _report()
    row = report["rows"][0]  # fan-out: all applied, bound 1.3
    row["measured_s"], row["floor_s"], row["ratio"] = measured, floor, measured / floor
    row["met"] = row["ratio"] <= row["bound"]
    out = io.StringIO()
    bench.print_report(report, file=out)
    line = next(x for x in out.getvalue().splitlines() if "fan-out: all applied" in x and "<=" in x)
    printed = line.split()[-4]  # ..., ratio, "<=", bound, ok
    assert printed == shown, line
    assert line.startswith("  MISS" if not row["met"] else "  met "), line
    if printed.startswith(">"):
        return
    assert (float(printed) <= row["bound"]) == row["met"], f"{line!r} reads as the other side of its bound"


def test_no_bench_output_names_a_file_outside_the_package() -> None:
    """The targets' source (a file of the project's workspace) is not shipped: no output names it."""
    root = Path(raysync.__file__).parent / "ops"
    named = [str(p.relative_to(root)) for p in root.rglob("*.py") if "ANCHORS" in p.read_text()]
    assert not named, f"{named} name ANCHORS.md, which the package does not ship"
    out = io.StringIO()
    bench.print_report(_report(), file=out)
    assert ".md" not in out.getvalue()

"""torchrl's own weight-sync tests, run with torchrl's classes and with raysync's in their place.

The yardstick of issue 16: from a pytorch/rl checkout (branch ``prepare-0.14``,
the 0.14.0 version bump; ``git clone -b prepare-0.14 https://github.com/pytorch/rl``),
the ``test/test_collectors.py`` tests that pass ``weight_sync_schemes``,
``test/collectors/test_evaluator.py::TestWeightStrategyExtraState`` and
``test/transforms/test_module_transforms.py::TestRayModuleTransform``. Each set
runs in its own pytest process (``-p raysync_in_place`` swaps the classes);
prints the counts of both and every case whose outcome differs.

Run (about 15 minutes on 2 cores)::

    python tests/yardstick/run_torchrl_tests.py --rl ~/src/rl
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent

SELECTED = [
    "test_collectors.py::test_weight_sync_scheme_from_backend",
    "test_collectors.py::test_weight_sync_scheme_from_backend_forwards_kwargs",
    "test_collectors.py::test_weight_sync_scheme_from_backend_rejects_unknown",
    "test_collectors.py::TestMakePolicyFactory",
    "test_collectors.py::TestCollectorGeneric::test_update_weights",
    "test_collectors.py::TestCollectorGeneric::test_update_weights_shared_mem",
    "test_collectors.py::TestAutoWrap::test_auto_wrap_modules",
    "test_collectors.py::TestUpdateParams",
    "test_collectors.py::TestPolicyVersion::test_multi_collector_restores_worker_policy_versions",
    "test_collectors.py::TestPolicyVersion::test_multi_collector_bumps_on_update",
    "test_collectors.py::TestPolicyFactory::test_update_weights",
    "test_collectors.py::TestPolicyFactory::test_nonserializable_policy_with_factory_and_weight_sync",
    "test_collectors.py::TestPolicyFactory::test_weight_update_after_device_cast",
    "test_collectors.py::TestAsyncCollection::test_start_update_policy",
    "collectors/test_evaluator.py::TestWeightStrategyExtraState",
    "transforms/test_module_transforms.py::TestRayModuleTransform",
]


def run(rl: Path, classes: str, out: Path, timeout: float) -> dict[str, str]:
    """One pytest run of the selection; ``{case: passed|failed|skipped}``."""
    xml = out / f"{classes}.xml"
    plugins = ["-p", "small_ray_store"] + (["-p", "raysync_in_place"] if classes == "raysync" else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *SELECTED,
        *plugins,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
    ]
    print(f"{classes}: {' '.join(cmd)}", flush=True)
    with open(out / f"{classes}.log", "w") as log:
        subprocess.run(cmd, cwd=rl / "test", env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rl", type=Path, required=True, help="a pytorch/rl checkout (branch prepare-0.14)")
    parser.add_argument("--out", type=Path, default=Path("yardstick-results"), help="logs and JUnit XML")
    parser.add_argument("--timeout", type=float, default=2400.0, help="seconds per run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        classes: run(args.rl.resolve(), classes, args.out, args.timeout) for classes in ("torchrl", "raysync")
    }
    for classes, outcomes in results.items():
        counts = collections.Counter(outcomes.values())
        passed, failed, skipped = counts["passed"], counts["failed"], counts["skipped"]
        print(f"{classes:8s} classes: {passed} passed, {failed} failed, {skipped} skipped")
    differ = sorted(c for c in results["torchrl"] if results["torchrl"][c] != results["raysync"].get(c))
    print(f"{len(differ)} case(s) differ (torchrl -> raysync):")
    for case in differ:
        print(f"  {case}: {results['torchrl'][case]} -> {results['raysync'].get(case)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

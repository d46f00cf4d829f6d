"""Small versions (4 KiB / 256 KiB / 4 MiB) to 8 actors: raysync, torchrl and Ray's floor in one run.

The scenario lives in the package (:mod:`raysync.ops.bench.small_versions`); this
script is its command line with the results in ``benchmarks/results/``.

Run (about five minutes on 2 cores)::

    python benchmarks/small_versions.py                         # 4 KiB, 256 KiB, 4 MiB to 8 actors
    python benchmarks/small_versions.py --sizes-kib 256 --repeats 40
    python benchmarks/small_versions.py --help                  # every option

Results: a table on stdout and JSON in ``--json`` (default
``benchmarks/results/small_versions.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from raysync.ops.bench.small_versions import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(results_dir=RESULTS))

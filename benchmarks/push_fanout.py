"""Push fan-out on one node: raysync against the memory-copy floor, measured in one run.

The scenario lives beside this script (``_fanout.py``, with ``_floor.py``,
``_fanout_report.py``, ``_scheme_rows.py`` and ``_adapter_rows.py``); this script is
its command line with the results in ``benchmarks/results/``. See
``benchmarks/README.md`` for what it measures. (``raysync bench``, in the package,
is the compact check of a cluster.)

Run (a full run takes several minutes and needs about 16 GiB of RAM at its peak)::

    python benchmarks/push_fanout.py                     # 256 MiB and 1 GiB, N = 1 2 4 8
    python benchmarks/push_fanout.py --quick             # 16 MiB, N = 1 2, 2 repeats (about a minute)
    python benchmarks/push_fanout.py --sizes-mib 64 --actors 1 4 --apply view --repeats 3
    python benchmarks/push_fanout.py --schemes-only --sizes-mib 64 --actors 8   # torchrl's schemes beside
    python benchmarks/push_fanout.py --quick --png fanout.png      # and a plot against N (matplotlib)
    python benchmarks/push_fanout.py --help              # every option

Results: a table on stdout and JSON in ``--json`` (default
``benchmarks/results/push_fanout.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from _fanout import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(results_dir=RESULTS))

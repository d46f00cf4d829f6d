"""Adapters against actors fetching on their own: N receivers behind one adapter vs N actors.

The scenario lives beside this script (``_adapter_rows.py``, also what
``push_fanout.py --adapters`` adds); this script is its command line with the
results in ``benchmarks/results/``.

Run::

    python benchmarks/adapters.py                      # 64 and 256 MiB, N = 8
    python benchmarks/adapters.py --quick              # 16 MiB, N = 8, 2 repeats

Results: a table on stdout and JSON in ``--json`` (default
``benchmarks/results/adapters.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from _adapter_rows import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main(results_dir=RESULTS))

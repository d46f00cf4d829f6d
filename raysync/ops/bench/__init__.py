"""raysync's benchmarks, shipped with the package so ``raysync bench`` runs from an installed wheel.

Modules (nothing is imported until asked for):

- :mod:`raysync.ops.bench.harness`: what every benchmark needs: model builders,
  a local Ray cluster of its own, timing helpers, the object-store gauge,
  JSON and PNG output and the common command-line options.
- :mod:`raysync.ops.bench.floor`: the copy floor (one snapshot ``copy_`` plus N
  simultaneous ``copy_`` in N plain actors), measured in the same run.
- :mod:`raysync.ops.bench.fanout`: the push fan-out scenario (``raysync bench``,
  ``benchmarks/push_fanout.py``); :mod:`raysync.ops.bench.fanout_report` its
  table, target checks and plot.
- :mod:`raysync.ops.bench.scheme_rows`: torchrl's weight-sync schemes beside
  raysync's (``push_fanout --schemes``).
- :mod:`raysync.ops.bench.small_versions`: small versions (4 KiB to 4 MiB) to N
  actors against Ray's floor and torchrl's ``RayWeightSyncScheme``, and the
  trainer blocked beside a bare ``ray.put`` (``benchmarks/small_versions.py``).
- :mod:`raysync.ops.bench.adapter_rows`: N receivers behind one adapter against
  N actors fetching on their own (``push_fanout --adapters``, ``benchmarks/adapters.py``).

The scripts in a source checkout's ``benchmarks/`` are thin command lines on
top of these modules.

Example:
    .. code-block:: bash

        raysync bench --quick                          # the fan-out scenario, progress bar, table, PNG
        python -m raysync.ops.bench.fanout --help      # every option of the scenario
        python -m raysync.ops.bench.adapter_rows --quick
"""

__all__: list[str] = []

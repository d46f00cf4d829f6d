"""Operations: the ``raysync`` command (status, bench), metrics and the benchmarks (``ops.bench``)."""

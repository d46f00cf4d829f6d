"""Operations: the ``raysync`` command (status, bench) and metrics."""

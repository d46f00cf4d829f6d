"""Operations: the ``raysync`` command, ``status`` (a hub's state) and ``bench`` (a compact cluster check)."""

"""Numbers as ``raysync bench`` prints them: milliseconds, and ratios read on the right side of a bound."""

from __future__ import annotations

__all__ = ["MAX_RATIO_DIGITS", "ms_text", "ratio_text"]

MAX_RATIO_DIGITS = 6
"""The most decimals :func:`ratio_text` prints before it says ``>bound`` instead."""


def ms_text(seconds: float | None) -> str:
    """Seconds as milliseconds with two decimals; ``-`` for None.

    Example:
        >>> ms_text(0.0123456)
        '12.35 ms'
    """
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def ratio_text(ratio: float, bound: float) -> str:
    """``ratio`` with two decimals, or as many more as it takes to read on its side of ``bound``.

    A check is met when ``ratio <= bound``. Rounded to two decimals, 1.3012 would print as
    ``1.30`` beside the bound ``<= 1.3`` and read as met; it prints as ``1.301`` instead. A ratio
    above the bound by less than :data:`MAX_RATIO_DIGITS` decimals show prints as ``>1.3``.

    Example:
        >>> ratio_text(1.2345, 1.3), ratio_text(1.3012, 1.3), ratio_text(1.3 + 1e-9, 1.3)
        ('1.23', '1.301', '>1.3')
    """
    met = ratio <= bound
    for digits in range(2, MAX_RATIO_DIGITS + 1):
        text = f"{ratio:.{digits}f}"
        if (float(text) <= bound) == met:
            return text
    return f">{bound:g}"  # only a miss can get here: a met ratio rounded down stays met

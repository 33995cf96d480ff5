"""Numbers as text with a unit prefix, three significant figures.

The one rule behind ``napkin cost``'s table (``human``, ``seconds``), the
picture's byte labels and the report's charts: round to three significant
figures first, then pick the unit, so 999,999 bytes is "1 MB", never
"1e+03 kB" (the unit picked first left 1000 of the smaller one).
"""
from __future__ import annotations


def three_figures(value: float, units) -> str:
    """``value`` in the largest of ``units`` it reaches once rounded.

    ``units``: (scale, suffix) pairs, largest first; the last is taken for
    anything smaller.  ``three_figures(999_999, ((1e6, " MB"), (1e3, " kB"),
    (1, " B")))`` is "1 MB".
    """
    rounded = float(f"{value:.3g}")
    for scale, suffix in units:
        if abs(rounded) >= scale:
            break
    return f"{rounded / scale:.3g}{suffix}"

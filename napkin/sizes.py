"""``WIRE=N`` pairs from the command line, parsed once for every command.

``napkin demo|cost|plan|render|report|bench --size q=4096`` (alias ``-D``),
``python -m napkin.bench.aot -D q=4096 -O num_warps=4`` and
``bench/dram_bytes.py`` all read their sizes here, so they accept the same
text and refuse it with the same words:

* each item is ``NAME=N``: a non-empty name (spaces around it and around N are
  ignored) and N a positive whole number in ASCII digits;
* a name given twice is refused, even with the same value (the command line
  should say each size once).

Which names are real (a wire of the diagram, a launcher option) is the
caller's check: this module knows no diagram.  Errors are ``NapkinError``s
whose message names the flag (``--size``, ``-D``, ``-O``) and the item.
"""
from __future__ import annotations

from typing import Iterable

from .errors import NapkinError


MAX_SIZE = 2 ** 62   # the largest a size given on the command line may be


def parse_pairs(items: Iterable[str], flag: str = "--size", *, key: str = "WIRE",
                what: str = "the size of", filename: str = "napkin") -> dict[str, int]:
    """``["q=4096", "x=1024"]`` -> ``{"q": 4096, "x": 1024}``.

    ``flag`` is the option as the caller's messages name it, ``key`` the
    placeholder of its metavar (``WIRE``, ``NAME``) and ``what`` the words
    before a name in the bad-value message (``the size of`` q, ``launcher
    option`` num_warps); ``filename`` is what the error is rendered against
    (a command-line argument has no file: the program's name).
    """
    out: dict[str, int] = {}
    for item in items:
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name:
            raise NapkinError(f"{flag} expects {key}=N with N a positive whole number, not {item!r}",
                              filename=filename)
        # isdigit() alone takes '²' (which int() refuses) and other scripts' digits.
        if not (value.isascii() and value.isdigit()) or int(value.lstrip("0") or "0") <= 0:
            raise NapkinError(f"{flag} {item}: {what} {name} must be a positive whole number, not {value!r}",
                              filename=filename)
        if len(value.lstrip("0")) > 19 or int(value) > MAX_SIZE:
            # the cost pass's floats overflowed (q = 10^400: an internal OverflowError)
            raise NapkinError(f"{flag} {name}={value if len(value) <= 30 else value[:27] + '...'}: {what} {name} "
                              f"is more than napkin takes (2^62)", filename=filename)
        if name in out:
            raise NapkinError(f"{flag} {item}: {name} is already given ({name}={out[name]})",
                              filename=filename)
        out[name] = int(value)
    return out


def positive_int(text: str) -> int:
    """An argparse ``type`` for a count such as ``--top``: 0 or -2 would
    print nothing, or drop the last results, without a word."""
    import argparse

    value = int(text) if text.strip().isascii() and text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value

"""Benchmarks: a compiled diagram against SDPA and FlexAttention.

flex.py       the diagram's FlexAttention equivalent, emitted from the IR
reference.py  inputs and an eager float64 reference straight from the IR
baselines.py  the implementations a diagram is compared with
harness.py    the grid runner: check, time, TFLOP/s, ratios (``napkin bench``)
results.py    the JSON and markdown files under bench/results/
"""
from __future__ import annotations


def register_cli(subparsers) -> None:
    """``napkin bench``: see harness.py (imported only when the command runs)."""
    from .harness import register_cli as register

    register(subparsers)

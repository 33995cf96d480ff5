"""napkin/interpreter.py: the probe that tells whether Triton's interpreter
runs a kernel here (Triton 3.6's fails on NumPy 2.4, with a message naming
neither), and the remedy it gives where it does not."""
from __future__ import annotations

import numpy
import pytest
import triton

from napkin import _probe, interpreter


def test_the_probe_runs_where_the_tests_run(monkeypatch):
    """The suite runs here, so the probe must pass (conftest stops the run
    otherwise); with the interpreter off there is nothing to probe."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter.problem() is None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreter.problem() is None


class _Failing:
    """A launch that fails as Triton 3.6's interpreter does on NumPy 2.4."""
    def __getitem__(self, grid):
        def launch(*args):
            raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
        return launch


class _Wrong:
    """A launch that runs but sums wrong."""
    def __getitem__(self, grid):
        def launch(x, n):
            x[0] = 7.0
        return launch


@pytest.mark.parametrize("kernel, failure", [
    (_Failing(), "TypeError: only 0-dimensional arrays can be converted to Python scalars"),
    (_Wrong(), "it summed 0 + 1 + 2 to 7.0")])
def test_a_failing_probe_names_both_versions_the_failure_and_the_remedy(monkeypatch, kernel, failure):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_probe, "loop_to_argument", kernel)
    assert interpreter.problem() == (
        f"Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1, how napkin's kernels run without a CUDA "
        f"GPU) cannot run a kernel with a loop bound from an argument on NumPy {numpy.__version__} ({failure}). "
        "Install NumPy < 2.4 (pip install 'numpy<2.4') or Triton 3.8 or later: Triton 3.6's interpreter fails on "
        "NumPy 2.4 and runs on 2.3.")

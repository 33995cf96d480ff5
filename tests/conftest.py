"""Shared pytest set-up for napkin's tests.

* ``TRITON_INTERPRET=1`` is set here, at import, when no CUDA GPU is present:
  Triton reads it when it is first imported, so it must be in the environment
  before any test module imports triton (conftest is imported first).
* ``--update-golden`` rewrites golden files instead of comparing with them;
  tests read it through the ``update_golden`` fixture.
* markers: ``gpu`` (skipped unless CUDA is available) and ``slow``.
* without a GPU, the run stops at once, with what to install, where
  Triton's interpreter cannot run a kernel here (napkin/interpreter.py:
  Triton 3.6 on NumPy 2.4).
* the repository root goes on ``sys.path`` so ``import generated.X`` works
  whatever folder pytest was started from.
* under CI (the ``CI`` environment variable set, as CI services and
  ``CI=true bash .ci/run`` do) hypothesis runs the ``ci`` profile: the
  property tests that draw fresh examples each run (parser, checker and
  round-trip fuzz) draw the same ones every time, so a landing never hangs
  on a new random draw.  Elsewhere they explore; a failure they find prints
  the seed that reproduces it.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # napkin needs torch, but let collection report that
        return False
    return bool(torch.cuda.is_available())


settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

CUDA = _cuda_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden", action="store_true", default=False,
        help="rewrite golden files from the current output instead of comparing",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    if not CUDA:
        # Triton 3.6's interpreter on NumPy 2.4 fails every kernel with a message naming neither
        # (napkin/interpreter.py): stop here with the remedy rather than fail hundreds of tests
        from napkin.interpreter import problem
        message = problem()
        if message:
            raise pytest.UsageError(message)


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def update_golden(request) -> bool:
    """True when the run was started with ``--update-golden``."""
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture
def quiet_flex():
    """Eager flex_attention's warning on every call that it is not compiled,
    kept quiet: intended in tests/test_bench*.py, which use it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield

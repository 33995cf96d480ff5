"""Whether Triton's interpreter (TRITON_INTERPRET=1, napkin's CPU path) can
run a kernel here, and if not, what to install.

Triton 3.6's interpreter turns a scalar argument into a one-element array and
reads a loop bound from it with ``int(...)``, which NumPy 2.4 refuses ("only
0-dimensional arrays can be converted to Python scalars"): every kernel whose
loop runs to an argument fails, and napkin's all do.  Measured on 2026-12-03
with a one-program kernel (``_probe.py``): Triton 3.6 fails on NumPy 2.4.6 and
runs on 2.3.5; Triton 3.8 and 3.9 run on 2.4.6.  The probe runs that kernel
rather than compare versions, so a Triton or NumPy that fixes it (or breaks it
another way) is seen as it is.  ``napkin demo`` and the tests check first and
stop with the remedy, where the failure itself names neither package.
"""
from __future__ import annotations

import os
from typing import Optional


def problem() -> Optional[str]:
    """None where the interpreter is off or runs the probe; else what fails
    and what to install."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    import numpy
    import torch
    import triton

    from ._probe import loop_to_argument

    x = torch.arange(3, dtype=torch.float32)
    try:
        loop_to_argument[(1,)](x, 3)
        if x[0].item() == 3.0:  # 0 + 1 + 2
            return None
        failure = f"it summed 0 + 1 + 2 to {x[0].item()}"
    except Exception as err:  # the interpreter's own error, whatever its type
        failure = f"{type(err).__name__}: {err}"
    return (f"Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1, how napkin's kernels run without "
            f"a CUDA GPU) cannot run a kernel with a loop bound from an argument on NumPy {numpy.__version__} "
            f"({failure}). Install NumPy < 2.4 (pip install 'numpy<2.4') or Triton 3.8 or later: Triton 3.6's "
            "interpreter fails on NumPy 2.4 and runs on 2.3.")

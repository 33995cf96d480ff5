"""The backward's dQ beside its dK/dV, timed against the serial backward.

A generated attention module runs its dQ kernel on a second CUDA stream,
beside dK/dV on the caller's, when its ``BACKWARD_OVERLAP`` is set
(templates/training.py.jinja): each kernel's last wave then leaves fewer
SMs idle.  It is off by default until a GPU has timed it, so on CUDA the
bench adds a row "napkin-overlap", the backward alone with it on, after
checking that it gives the serial backward's gradients bit for bit (the
kernels are the same; only their order on the GPU changes).
"""
from __future__ import annotations

import contextlib

from . import baselines

NAME = "napkin-overlap"


def applies(module, device: str) -> bool:
    return device == "cuda" and hasattr(module, "BACKWARD_OVERLAP")


def serial(module):
    """The napkin row's scope: the serial backward whatever the environment
    (NAPKIN_BACKWARD_OVERLAP) set the module's default to."""
    if not hasattr(module, "BACKWARD_OVERLAP"):
        return contextlib.nullcontext
    return lambda: overlapped(module, False)


@contextlib.contextmanager
def overlapped(module, on: bool = True):
    """The module's BACKWARD_OVERLAP set to ``on`` inside, restored after."""
    before = module.BACKWARD_OVERLAP
    module.BACKWARD_OVERLAP = on
    try:
        yield
    finally:
        module.BACKWARD_OVERLAP = before


REPEATS = 3  # overlapped backwards compared: a missing wait shows on some runs, not every one


def mismatch(module, run, inputs) -> str:
    """Empty when the backward gives the serial backward's bits with the
    overlap, REPEATS times over, else which gradients differ."""
    import torch

    outs = [o for o in run() if o is not None and o.is_floating_point() and o.requires_grad]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    upstream = torch.randn_like(outs[0])
    with overlapped(module, False):
        serial = torch.autograd.grad(outs[0], leaves, upstream, retain_graph=True)
    bad = set()
    for _ in range(REPEATS):
        with overlapped(module, True):
            beside = torch.autograd.grad(outs[0], leaves, upstream, retain_graph=True)
        bad |= {i for i, (a, b) in enumerate(zip(serial, beside)) if not torch.equal(a, b)}
    return f"the gradients of leaves {sorted(bad)} differ from the serial backward's" if bad else ""


def baseline(module, prepare) -> baselines.Baseline:
    """The napkin row's call (``prepare``), its backward timed with the
    overlap on, once it gave the serial backward's bits."""
    def checked(inputs, shape, device, grad=False):
        run = prepare(inputs, shape, device, grad)
        if grad:
            wrong = mismatch(module, run, inputs)
            if wrong:
                raise RuntimeError(wrong)
        return run

    return baselines.Baseline(NAME, True, "napkin, dQ on a second CUDA stream beside dK/dV (BACKWARD_OVERLAP)",
                              checked, passes=("bwd",), scope=lambda: overlapped(module))

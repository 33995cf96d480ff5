"""Timing for ``napkin bench``: one call's milliseconds and a row's record.

On CUDA, triton.testing.do_bench's median after warm-up (CUDA events); on
the CPU a wall-clock median under Triton's interpreter, which the harness
labels a smoke test of the plumbing, never a performance number.  The
harness, the ranges prepass's timing and bench/ scripts share these.
"""
from __future__ import annotations

import statistics
import time

from . import baselines, results

DO_BENCH = {"warmup": 25, "rep": 100}   # milliseconds, triton.testing.do_bench


def fresh_inputs(inputs, shape: dict, grad: bool) -> list:
    """Detached copies of a point's inputs; with grad, the float operands
    (shape["operands"]: what the backward differentiates) require it."""
    operands = set(shape["operands"])
    return [t.detach().clone().requires_grad_(grad and t.is_floating_point() and n in operands)
            for n, t in zip(shape["inputs"], inputs)]


def cuda_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=DO_BENCH["warmup"], rep=DO_BENCH["rep"], return_mode="median"))


def cpu_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def ms(fn, device: str, reps: int) -> float:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        return cuda_ms(fn)
    return cpu_ms(fn, reps)


def result(impl, p, equivalent, note, ms=None, flops=None, error=None) -> dict:
    return {"impl": impl, "pass": p, "ms": ms, "tflops": results.tflops(flops, ms) if flops else None,
            "equivalent": equivalent, "note": note, "error": error}


def time_forward(impl, inputs, shape, device, reps, flops, first: dict) -> dict:
    try:
        fn = impl.prepare(inputs, shape, device)
        first[impl.name] = fn()       # warm-up (and compile); kept for the full-size check
        took = ms(fn, device, reps)
    except Exception as err:  # noqa: BLE001 - e.g. an SDPA backend refusing this shape
        return result(impl.name, "fwd", impl.equivalent, impl.note, error=baselines.first_line(err))
    return result(impl.name, "fwd", impl.equivalent, impl.note, took, flops)


def attention_output(outs: list):
    """The output a backward row differentiates: the attention's, the one with
    a feature wire (the most dimensions), first in SDPA's outputs, maybe
    second in a diagram's (out lse, O), whose lse-only backward was timed
    against SDPA's O backward."""
    return max(outs, key=lambda o: o.dim())


def differentiable_call(impl, inputs, shape, device) -> tuple[tuple, list]:
    """(an implementation's outputs, the leaves its backward differentiates):
    its run on fresh copies of the inputs whose operands require grad, and the
    run's own leaves where it has them (SDPA's speed reference: its own q, k, v).
    What the backward check differentiates and the timing times."""
    xs = fresh_inputs(inputs, shape, grad=True)
    fn = impl.prepare(xs, shape, device, grad=True)
    return fn(), list(getattr(fn, "leaves", [t for t in xs if t.requires_grad]))


def time_backward(impl, inputs, shape, device, reps, flops) -> dict:
    """Time d(outputs)/d(Q, K, V) for a fixed upstream gradient, the forward
    graph built once outside the timed region."""
    import torch

    try:
        got, leaves = differentiable_call(impl, inputs, shape, device)
        outs = [o for o in got if o is not None and o.is_floating_point()]
        if not outs or not outs[0].requires_grad:
            return result(impl.name, "bwd", impl.equivalent, impl.note,
                          error="no backward (its outputs do not require grad)")
        out = attention_output(outs)
        upstream = torch.randn_like(out)

        def step():
            return torch.autograd.grad(out, leaves, upstream, retain_graph=True)

        step()
        took = ms(step, device, reps)
    except Exception as err:  # noqa: BLE001 - e.g. FlexAttention has no backward on the CPU
        return result(impl.name, "bwd", impl.equivalent, impl.note, error=baselines.first_line(err))
    return result(impl.name, "bwd", impl.equivalent, impl.note, took, flops)

"""What a compiled diagram is compared with: SDPA backends and FlexAttention.

Each ``Baseline`` turns the diagram's inputs into a callable with no
arguments (everything built outside the timed region) that returns the
diagram's outputs as a tuple, None where it does not compute one (SDPA
returns no log-sum-exp).

* ``flex``: the diagram's FlexAttention equivalent (napkin/bench/flex.py),
  compiled with torch.compile on a GPU (flex's fast path) and eager on the
  CPU.  It always computes the same function, so it is always checked.
* ``sdpa-<backend>``: F.scaled_dot_product_attention pinned to one backend
  with ``sdpa_kernel``.  It computes the diagram's function only for plain
  softmax attention (a scale, optionally is_causal, optionally GQA): then it
  runs on the diagram's own inputs and is checked.  For any other variant it
  is a *speed reference* (``equivalent=False``): plain attention of the same
  batch, heads, lengths and head dim (causal when the diagram's mask has a
  causal part), on inputs of its own, never compared with the reference.
  A backend that cannot run a shape reports why instead of a time.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

# SDPBackend member names -> our labels, in the order they are reported.
SDPA_BACKENDS = (("FLASH_ATTENTION", "sdpa-flash"), ("CUDNN_ATTENTION", "sdpa-cudnn"),
                 ("EFFICIENT_ATTENTION", "sdpa-efficient"))
CPU_SDPA_BACKENDS = (("MATH", "sdpa-math"),)   # added on the CPU (smoke runs), where math is what runs


@dataclass(frozen=True)
class Baseline:
    name: str
    equivalent: bool     # computes the diagram's function (so it is checked against the reference)
    note: str
    # prepare(inputs, shape, device, grad) -> run, and run() -> a tuple of outputs
    # (None: not computed).  run.leaves, when present, are the tensors a backward
    # pass differentiates (else the float inputs); grad asks for them to need grad.
    prepare: Callable
    passes: tuple = ("fwd", "bwd")           # what is timed
    scope: Callable = contextlib.nullcontext  # a context its timing runs in


def flex_baseline(flex_module, compiled: bool) -> Baseline:
    src = flex_module.FLEX_SOURCE
    note = "FlexAttention " + ("(torch.compile)" if compiled else "(eager, unfused)")
    mods = [m for m, on in (("score_mod", src.has_score_mod), ("block_mask", src.mask is not None)) if on]
    if mods:
        note += " with " + " and ".join(mods)

    def prepare(inputs, shape, device, grad=False):
        return flex_module.prepare(*inputs, compiled=compiled)

    return Baseline("flex", True, note, prepare)


def sdpa_baselines(flex_module, shape: dict, device: str) -> list[Baseline]:
    """One baseline per SDPA backend this torch knows (plus math on the CPU);
    whether each can run a shape is found out by running it.  ``shape`` is
    flex.attention_shape's dict (B, H, L, E sizes and the causal flags)."""
    import torch
    from torch.nn.attention import SDPBackend

    src = flex_module.FLEX_SOURCE if flex_module is not None else None
    # SDPA returns no lse, so no function of it (a sink): a speed reference then
    same = src is not None and not src.side and not src.has_score_mod and (src.mask is None or src.causal) \
        and src.epilogue is None
    causal = src.causal if same else shape["causal_part"]
    backends = SDPA_BACKENDS + (CPU_SDPA_BACKENDS if device == "cpu" else ())
    out = []
    for member, label in backends:
        backend = getattr(SDPBackend, member, None)
        if backend is None:
            continue
        if same:
            note = ("the same function" + (", is_causal" if causal else "")
                    + (", enable_gqa" if src.enable_gqa else ""))
        else:
            note = ("speed reference: plain " + ("causal " if causal else "")
                    + "softmax attention at the same sizes, not the diagram's function")
        out.append(Baseline(label, same, note, _sdpa_prepare(backend, flex_module if same else None, causal,
                                                             src.scale if same else shape["dim"] ** -0.5, torch)))
    return out


def _sdpa_prepare(backend, flex_module, causal: bool, scale: float, torch) -> Callable:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def prepare(inputs, shape: dict, device, grad=False):
        if flex_module is not None:
            q, k, v = flex_module.arrange(*inputs)
        else:
            gen = torch.Generator(device="cpu").manual_seed(1)
            dtype = getattr(torch, shape["dtype"])

            def make(h, n, e):
                t = torch.randn(shape["batch"], h, n, e, generator=gen).to(device=device, dtype=dtype)
                return t.requires_grad_(grad)

            q = make(shape["heads"], shape["q_len"], shape["dim"])
            k = make(shape["kv_heads"], shape["kv_len"], shape["dim"])
            v = make(shape["kv_heads"], shape["kv_len"], shape["value_dim"])
        gqa = q.shape[1] != k.shape[1]
        checked = False

        def call():
            return sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)

        def run():
            nonlocal checked
            with sdpa_kernel(backend):
                # the first call (the check, before timing) says why a backend refuses
                out = call() if checked else _with_reasons(call)
            checked = True
            if flex_module is None:
                return (out,)
            return flex_module.finish(out, None, k.shape[1])

        if flex_module is None:
            run.leaves = (q, k, v)
        return run

    return prepare


def _with_reasons(call: Callable):
    """call(), whose warnings become part of its error should it fail.  A
    backend that cannot run a shape warns why ("For dense input, both fused
    kernels require query, key and value to have the same num_heads") and
    then raises "No available kernel": the reasons went to the log, one
    UserWarning a line and no backend named, and the results said only
    "No available kernel".  On success the warnings are dropped: they
    explain why another backend was not picked, which sdpa_kernel ruled out."""
    import re
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return call()
        except RuntimeError as err:
            reasons = []
            for w in caught:
                text = re.sub(r"\s*\(Triggered internally at [^)]*\)\s*$", "", str(w.message)).strip()
                # "X not used because:" heads the reason that follows; "X has been runtime
                # disabled" is sdpa_kernel's own pinning
                if text and not text.endswith(("because:", "runtime disabled.")) and text not in reasons:
                    reasons.append(text)
            if not reasons:
                raise
            raise RuntimeError(f"{first_line(err).split(': ', 1)[-1]} ({'; '.join(reasons)})") from err


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]

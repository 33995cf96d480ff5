"""What ``napkin bench`` checks before it times anything.

Every implementation that computes the diagram's function (napkin, FlexAttention,
SDPA where it is the same function) is compared with the module's float64
``reference``, forward and backward, on the point's inputs (at reduced sizes
when the reference's scores would not fit, ``check_sizes``):

* forward: each output's max abs error against float64, at most TOLERANCE of
  the run's dtype;
* backward: the gradients the timed backward computes (of the attention
  output, for one seeded upstream gradient, with respect to the operands Q, K
  and V), each gradient's max abs error over its scale (the larger of 1 and
  its largest float64 entry), at most the same TOLERANCE.  Gradients grow
  with the lengths summed over (dV adds up a column of P times dO), so an
  absolute bound would be loose at 64 tokens and fail at 16K; relative to
  the scale it is one bound for both.  An implementation whose backward is
  wrong gets its backward row marked "not timed", as a forward is.

At the full size, napkin's warm-up outputs are compared with FlexAttention's
(``full_size_check``): the reference cannot afford them, the two can.
"""
from __future__ import annotations

from ..errors import NapkinError
from . import baselines, flex, reference
from .timing import attention_output, differentiable_call, fresh_inputs

CHECK_ELEMENTS = 1 << 26        # largest reference box (float64: 512 MiB) checked at full size
TOLERANCE = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 2e-3}   # max abs error vs float64
UPSTREAM_SEED = 11              # the backward check's dO, drawn on the CPU in float64


def check_sizes(diagram, roles, sizes: dict[str, int]) -> dict[str, int]:
    """The sizes the reference can afford: the real ones when its biggest box
    fits CHECK_ELEMENTS, else at most two batches and two (kv) heads (so that
    a kernel's batch and head offsets are still checked: at one of each, a
    dK wrong on every head but the first passed), then both lengths halved
    until it fits (none below 128, or below its own length)."""
    if reference.reference_elements(diagram, sizes) <= CHECK_ELEMENTS:
        return dict(sizes)
    small = dict(sizes)
    for w in (roles.batch, roles.kv_head):
        if w in small:
            small[w] = min(small[w], 2)
    lengths = (roles.row, roles.key)
    while reference.reference_elements(diagram, small) > CHECK_ELEMENTS and max(small[w] for w in lengths) > 128:
        for w in lengths:
            small[w] = min(small[w], max(128, small[w] // 2))
    return small


def max_abs_error(got, want) -> float:
    """Max |got - want|, equal entries (matching infinities) counting as exact and NaN as infinite;
    infinite for another shape (one that broadcasts against the reference's would pass unseen)."""
    import torch

    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    g, w = got.double(), want.double().to(got.device)
    diff = torch.where(g == w, torch.zeros_like(g), (g - w).abs())
    diff = torch.nan_to_num(diff, nan=float("inf"))
    return float(diff.max()) if diff.numel() else 0.0


def scale_of(want) -> float:
    """A reference's scale: max(1, max |want|) of its finite entries."""
    import torch

    finite = want[torch.isfinite(want)]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def relative_error(got, want) -> float:
    """max_abs_error over the gradient's scale (scale_of)."""
    return max_abs_error(got, want) / scale_of(want)


def check(module, diagram, impls: list, sizes: dict, dtype: str, device: str, backward: bool, docs=None) -> dict:
    """The point's check record: the sizes checked at, the tolerance, and per
    implementation its forward errors (``errors``) and, with ``backward``, its
    gradients' relative errors (``backward.errors``); "error" in either says
    why that pass is not timed.  ``ok`` is napkin's forward, and its backward
    when one was checked, being right: a backward napkin refuses to build (a
    diagram it cannot train: NapkinError, NotImplementedError) is reported,
    not counted wrong; any other exception is a crash, counted.  ``docs``:
    the ids of those documents (reference.example_inputs), cut at the check's lengths."""
    roles = flex.attention_roles(diagram)
    small = check_sizes(diagram, roles, sizes)
    inputs = reference.example_inputs(diagram, small, device=device, seed=0, docs=docs)
    wide = [t.double() if t.is_floating_point() else t for t in inputs]
    want = module.reference(*wide)
    want = want if isinstance(want, tuple) else (want,)
    tol = TOLERANCE[dtype]
    shape = flex.attention_shape(diagram, small)
    shape.update(dtype=dtype, inputs=[t.name for t in diagram.inputs])
    errors = {}
    for impl in impls:
        if not impl.equivalent:
            continue
        try:
            got = impl.prepare(inputs, shape, device)()
        except Exception as err:  # noqa: BLE001 - one implementation failing must not stop the others
            errors[impl.name] = {"error": baselines.first_line(err)}
            continue
        errors[impl.name] = _judged({o.name: max_abs_error(g, w) for o, g, w in zip(diagram.outputs, got, want)
                                     if g is not None}, tol, "")
    ok = "error" not in errors.get("napkin", {"error": "not run"})
    record = {"sizes": small, "tolerance": tol, "ok": ok, "errors": errors}
    if backward:
        record["backward"] = _check_backward(module, diagram, impls, inputs, shape, device, tol, errors)
        napkin = record["backward"]["errors"].get("napkin", {})
        record["ok"] = ok and not napkin.get("error", "").startswith(("wrong", "crashed"))
    return record


def _check_backward(module, diagram, impls, inputs, shape, device, tol, forward_errors) -> dict:
    """Each implementation's gradients of the attention output against the
    float64 reference's, for the same upstream gradient (what time_backward
    times, with its own random upstream: the check's is seeded)."""
    import torch

    # the operands in the order fresh_inputs makes them leaves: the diagram's (V, K, Q is an order too)
    names = [n for n in shape["inputs"] if n in shape["operands"]]
    wide = fresh_inputs([t.double() if t.is_floating_point() else t for t in inputs], shape, grad=True)
    outs = module.reference(*wide)
    outs = outs if isinstance(outs, tuple) else (outs,)
    chosen = attention_output([o for o in outs if o.is_floating_point()])
    which = next(i for i, o in enumerate(outs) if o is chosen)
    gen = torch.Generator().manual_seed(UPSTREAM_SEED)
    upstream = torch.randn(outs[which].shape, generator=gen, dtype=torch.float64).to(outs[which].device)
    leaves = [t for t in wide if t.requires_grad]
    want = torch.autograd.grad(outs[which], leaves, upstream, allow_unused=True)
    want = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, want)]
    errors = {}
    for impl in impls:
        if not impl.equivalent or "bwd" not in impl.passes or "error" in forward_errors.get(impl.name, {}):
            continue
        try:
            got, leaves = differentiable_call(impl, inputs, shape, device)
            out = got[which] if which < len(got) else None
            if out is None:
                raise ValueError(f"it does not compute output {which}, whose gradient is checked")
            grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype), allow_unused=True)
        except Exception as err:  # noqa: BLE001 - e.g. a backward napkin refuses, or flex's on the CPU
            # a refusal in words is no failure of the run; a crash is
            refused = isinstance(err, (NapkinError, NotImplementedError))
            errors[impl.name] = {"error": baselines.first_line(err) if refused else
                                 f"crashed: {baselines.first_line(err)}"}
            continue
        errors[impl.name] = _judged({f"d{n}": (float("inf") if g is None else relative_error(g, w))
                                     for n, g, w in zip(names, grads, want)}, tol, " of its scale")
    return {"relative_to": "max(1, max |float64 gradient|)", "upstream_seed": UPSTREAM_SEED,
            "output": diagram.outputs[which].name, "errors": errors}


def _judged(errs: dict, tol: float, of: str) -> dict:
    """An implementation's errors, with "error" saying which pass the tolerance (NaN counts)."""
    bad = {k: v for k, v in errs.items() if not v <= tol}
    if bad:
        return {**errs, "error": "wrong: " + ", ".join(f"{k} max abs error {v:.3g}{of} > {tol:g}"
                                                      for k, v in bad.items())}
    return dict(errs)


def full_size_check(check_record: dict, first: dict, diagram, dtype: str) -> None:
    """At the full size: napkin's warm-up outputs against FlexAttention's."""
    if "napkin" not in first or "flex" not in first:
        return
    errs = {o.name: max_abs_error(a, b) for o, a, b in zip(diagram.outputs, first["napkin"], first["flex"])
            if a is not None and b is not None}
    limit = 2 * TOLERANCE[dtype]
    check_record["full_size_vs_flex"] = {"errors": errs, "tolerance": limit,
                                         "ok": all(v <= limit for v in errs.values())}
    check_record["ok"] = check_record["ok"] and check_record["full_size_vs_flex"]["ok"]

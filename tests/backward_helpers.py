"""What the backward tests share: a diagram compiled into an imported module
once per key, the differentiable launcher of a module, autograd gradients
against random output weights, and the accuracy rule (tests/test_backward.py's
docstring)."""
from __future__ import annotations

import importlib.util
import math
import sys
import zlib
from pathlib import Path

import torch

import napkin
from napkin import ir
from napkin.codegen import emit_module

REPO = Path(__file__).resolve().parent.parent
REFUSED = {"naive_attention", "attention_fp8"}
EXAMPLES = sorted(p.stem for p in (REPO / "examples").glob("*.ncd") if p.stem not in REFUSED)
FAST = {"block_q": 16, "block_x": 16, "block_m": 16, "block_n": 16, "block_k": 16}
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23, torch.float64: 2.0 ** -52}
RECOMPUTED = EPS[torch.float32]   # assert_accurate: the backward's own float32 rounding of P
_CACHE: dict[str, object] = {}


def compile_text(text: str, key: str, folder: Path, diagram=None):
    """Emit and import a module once per key (registered in sys.modules, as
    Triton's JIT and torch.library want)."""
    if key not in _CACHE:
        diagram = diagram if diagram is not None else napkin.load_text(text, f"{key}.ncd")
        path = folder / f"{key}.py"
        path.write_text(emit_module(diagram, source_text=text, source_path=f"{key}.ncd"))
        spec = importlib.util.spec_from_file_location(f"_napkin_backward_{key}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _CACHE[key] = module
    return _CACHE[key]


def example(name: str, folder: Path, *replace: tuple[str, str]):
    text = (REPO / "examples" / f"{name}.ncd").read_text()
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    return compile_text(text, f"{name}_{zlib.crc32(repr(replace).encode())}", folder)


def launcher(m):
    """The module's differentiable entry point, named after its diagram."""
    kernel = next(n for n in vars(m) if n.startswith("_") and n.endswith("_kernel") and "_bwd_" not in n
                  and not n.endswith("_ranges_kernel"))  # a data mask's prepass (codegen/ranges.py)
    return getattr(m, kernel[1:-len("_kernel")])


def gradients(fn, inputs, seed: int = 7, **opts):
    """d(sum(out_i * W_i))/d(inputs) by autograd, W_i random; outputs' non-finite
    entries (an lse of -inf) get weight 0.  None for integer inputs."""
    # integer inputs (ids) are passed as they are: a mask_cache entry follows the tensor object
    xs = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fn(*xs, **opts)
    out = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    loss = 0
    for o in out:
        # drawn on the CPU (one stream of weights whatever the device), then moved
        w = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
        loss = loss + torch.where(torch.isfinite(o.double()), o.double() * w, 0.0).sum()
    loss.backward()
    return [x.grad if x.requires_grad else None for x in xs]


def assert_accurate(kernel, exact, same, label="", dtype=None, rows=None):
    """The rule of the module docstring.  The floor's ulps are those of the
    gradient's dtype or, when coarser, of the kernel inputs' ``dtype``: an
    fp32 ALiBi slope's gradient sums over every (q, x) of dS, whose delta =
    rowsum(dO * O) reads the stored fp16 O, as FlashAttention's does (the
    reference differentiates through its float32 O).

    ``rows`` (one count per gradient, or None) widens the floor of a
    gradient that adds up whole rows of dS (a side input holding neither the
    row nor the column wire: slope[h] sums over b, q and x) by the square
    root of the rows it adds.  FlashAttention's backward takes each row's
    sum of P dP as delta = rowsum(dO * O): one rounding of O per row, which
    the reference's autograd does not make (it sums P dP itself), and which
    such a gradient adds up row by row, times the row's sum of P times the
    weight; independent roundings grow as the root of their count.  Plain
    float32 torch with that delta (no kernel) misses the unwidened floor
    too: 3.5e-5 against 3.4e-5 on a drawn ALiBi + causal + document
    diagram at b=2, q=x=64, whose slope gradient is -31.1.

    The floor also holds 4 float32 ulps (RECOMPUTED) whatever the dtypes:
    the backward recomputes P = exp2(s c - lse2) from float32 scores of its
    own rounding, and one large P times a large dO carries that rounding
    into one entry, independent of where the reference's own error lands.
    A CI run drew it (test_mask_cache, fp32, seed 451706035): dV's worst
    entry sums 11 rows, one with P = 0.86 whose kernel P is off by 1.2e-6
    relative (17 ulps; float32 torch's softmax is off by up to 1.6e-6 on
    such inputs too), so the kernel's error came to 2.96e-6 where the
    reference's was 7.2e-7 and the old floor allowed 2.77e-6."""
    rows = rows or [1] * len(kernel)
    for i, (k, e, s) in enumerate(zip(kernel, exact, same)):
        if e is None:
            assert k is None
            continue
        assert k is not None and k.shape == e.shape and k.dtype == s.dtype, (label, i)
        assert torch.isfinite(k).all(), f"{label}: gradient {i} is not finite"
        err_k = (k.double() - e).abs().max().item() if e.numel() else 0.0
        err_r = (s.double() - e).abs().max().item() if e.numel() else 0.0
        scale = max(1.0, e.abs().max().item()) if e.numel() else 1.0
        eps = max(EPS[k.dtype], EPS.get(dtype, 0.0)) + RECOMPUTED
        assert err_k <= 2 * err_r + 4 * eps * scale * rows[i] ** 0.5, \
            f"{label}: gradient {i}: kernel error {err_k:.3g} vs reference error {err_r:.3g} (scale {scale:.3g})"


def check(m, sizes, dtype, seed=0, label="", rows=None, **opts):
    inputs = m.example_inputs(sizes, dtype=dtype, seed=seed)
    fn = launcher(m)
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    opts = {k: v for k, v in {**FAST, **opts}.items() if k in names}
    got = gradients(fn, inputs, **opts)
    exact = gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    assert_accurate(got, exact, gradients(m.reference, inputs), label, dtype, rows)
    return inputs, got


def block_rows(d, sizes) -> list:
    """assert_accurate's ``rows`` for the inputs read at blocks of the row wire q
    (examples/tile_bias.ncd's B[h, q // 64, x // 64]): an entry adds up a block of
    rows of dS, of each batch wire the input lacks; 1 for the others (a side input
    along the keys has no row correction: backward._Builder.centre)."""
    out = []
    for t in d.inputs:
        steps = [step for name, _, read, step, _ in ir.coarse_reads(d) if name == t.name and read == "q"]
        held = {w for a in t.axes for w in a}
        lacked = math.prod(sizes[w] for w in ("b", "h") if w in sizes and w not in held)
        out.append(min(steps[0], sizes["q"]) * lacked if steps else 1)
    return out

"""What the kernel test files share: compile a diagram's module once per
session, run it with small blocks, and the accuracy rule (test_kernels.py's
docstring says it).  Each test file that compiles keeps the folder its
modules are written to with a module-scoped fixture:

    @pytest.fixture(scope="module", autouse=True)
    def _folder(tmp_path_factory):
        K._FOLDER.append(tmp_path_factory.mktemp("NAME"))
        yield
        K._FOLDER.pop()
"""
from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

import napkin
from napkin.codegen import emit_module

REPO = Path(__file__).resolve().parent.parent
REFUSED = {"naive_attention", "attention_fp8"}
EXAMPLES = sorted(p.stem for p in (REPO / "examples").glob("*.ncd") if p.stem not in REFUSED)
FAST = {"block_q": 32, "block_x": 16, "block_m": 32, "block_n": 32, "block_k": 16}
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23, torch.float64: 2.0 ** -52}

_CACHE: dict[str, object] = {}
_FOLDER: list[Path] = []


def compile_text(text: str, key: str, diagram=None):
    """Emit and import a module (cached per key for the test session)."""
    if key not in _CACHE:
        diagram = diagram if diagram is not None else napkin.load_text(text, f"{key}.ncd")
        source = emit_module(diagram, source_text=text, source_path=f"{key}.ncd")
        path = _FOLDER[-1] / f"{key}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"_napkin_kernel_{key}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _CACHE[key] = module
    return _CACHE[key]


def example(name: str, *replace: tuple[str, str]):
    """An example's module, optionally with its text edited (old, new) first."""
    text = (REPO / "examples" / f"{name}.ncd").read_text()
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    return compile_text(text, f"{name}_{zlib.crc32(repr(replace).encode())}" if replace else name)


def launcher(m):
    """The module's launcher: the function named after its diagram."""
    kernel = next(n for n in vars(m) if n.startswith("_") and n.endswith("_kernel")
                  and not n.endswith("_ranges_kernel"))  # a data mask's prepass (codegen/ranges.py)
    return getattr(m, kernel[1:-len("_kernel")])


def run(m, inputs, **opts):
    fn = launcher(m)
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    opts = {k: v for k, v in {**FAST, **opts}.items() if k in names}
    out = fn(*inputs, **opts)
    return out if isinstance(out, tuple) else (out,)


def reference(m, inputs, dtype=None):
    if dtype is not None:
        inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    out = m.reference(*inputs)
    return out if isinstance(out, tuple) else (out,)


def assert_accurate(kernel, exact, same, label=""):
    """kernel error <= 2 x (same-dtype reference's error) + 4 ulps x scale."""
    for k, e, s in zip(kernel, exact, same):
        assert k.shape == e.shape and k.dtype == s.dtype, (label, k.shape, e.shape, k.dtype, s.dtype)
        k64 = k.double()
        assert torch.equal(torch.isnan(k64), torch.isnan(e)), f"{label}: NaN pattern differs"
        assert torch.equal(torch.isinf(k64), torch.isinf(e)) and torch.equal(k64[torch.isinf(e)], e[torch.isinf(e)]), \
            f"{label}: inf pattern differs"
        fin = torch.isfinite(e)
        if not fin.any():
            continue
        err_k = (k64 - e)[fin].abs().max().item()
        err_r = (s.double() - e)[fin].abs().max().item()
        scale = max(1.0, e[fin].abs().max().item())
        assert err_k <= 2 * err_r + 4 * EPS[k.dtype] * scale, \
            f"{label}: kernel error {err_k:.3g} vs reference error {err_r:.3g} (scale {scale:.3g})"


def check(m, sizes, dtype, seed=0, label="", **opts):
    inputs = m.example_inputs(sizes, dtype=dtype, seed=seed)
    out = run(m, inputs, **opts)
    assert_accurate(out, reference(m, inputs, torch.float64), reference(m, inputs), label)
    return inputs, out


# Hypothesis settings of the drawn-diagram tests: few examples (each
# compiles a module), the same ones every run.
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

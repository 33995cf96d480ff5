"""The code generator without running kernels: emitted text, module API,
argument checks, refusals, masks and lowering.  (Numerics: test_kernels.py;
generated/ against fresh output: test_golden.py.)"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import napkin
from napkin import ir, masks, visits
from napkin.codegen import emit_module, lower as L, source_label, write_module
from napkin.errors import NapkinError
from napkin.parse import parse

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.ncd"))
# Examples napkin's Triton backend refuses, and a word its message must contain.
REFUSED = {"naive_attention": "unfused", "attention_fp8": "e4m3"}
COMPILED = [p for p in EXAMPLES if p.stem not in REFUSED]


def emit_file(path: Path) -> str:
    text = path.read_text()
    return emit_module(napkin.load(path), source_text=text, source_path=str(path))


def import_text(text: str, folder: Path, name: str):
    path = folder / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"_napkin_test_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("emitted")
    return {p.stem: import_text(emit_file(p), folder, p.stem) for p in COMPILED}


def diagram_text(body: str, schedule: str = "") -> str:
    return "diagram t\nwire b, h, q, x\nwire d = 16\n" + body + "\n" + schedule


FLASH = """schedule on h100 {
  level smem { group b by 1, h by 1, q by 32
  stream x by 16 }
}"""


# --------------------------------------------------------------------------
# The emitted text.
# --------------------------------------------------------------------------

def test_every_example_is_compiled_or_refused_with_a_reason():
    assert {p.stem for p in EXAMPLES} >= set(REFUSED) | {"attention", "matmul", "l2_attention", "relu2_attention"}
    for path in EXAMPLES:
        if path.stem in REFUSED:
            with pytest.raises(NapkinError) as err:
                emit_file(path)
            text = str(err.value)
            assert "napkin cannot emit a kernel for" in text and REFUSED[path.stem] in text
            assert f"examples/{path.name}:" in text  # file:line:col
        else:
            assert emit_file(path)


def test_independent_refusals_come_together():
    """Refusals at separate places are reported in one error, as the checker's
    are: each e4m3 input at its line (the first alone was reported, so a user
    fixed one to meet the next), and one refusal a level naming every held
    intermediate."""
    with pytest.raises(NapkinError) as err:
        emit_file(REPO / "examples/attention_fp8.ncd")
    assert [(d.loc.line, d.message.split(":")[0]) for d in err.value.diagnostics] == [
        (14, "napkin cannot emit a kernel for input V")]   # e4m3 Q and K are taken
    text = (REPO / "examples/attention_fp8.ncd").read_text().replace(
        "in V[b, h, x, d] : e4m3", "in V[b, h, x, d] : e4m3\nin B[b, h, q, x] : e4m3").replace(
        "* |d|^-0.5", "* |d|^-0.5 + B").replace("hold Q, K, V, O, lse", "hold Q, K, V, B, O, lse")
    with pytest.raises(NapkinError) as err:
        emit_module(napkin.load_text(text), source_text=text, source_path="t.ncd")
    assert [(d.loc.line, d.message.split(":")[0]) for d in err.value.diagnostics] == [
        (14, "napkin cannot emit a kernel for input V"), (15, "napkin cannot emit a kernel for input B")]
    with pytest.raises(NapkinError) as err:
        emit_file(REPO / "examples/naive_attention.ncd")
    (only,) = err.value.diagnostics
    assert "holds the intermediates S, P in hbm" in only.message
    assert only.hint.startswith("drop S, P from 'hold' in level hbm")
    # a value integer input and an integer factor of the score: both named, each once
    text = (REPO / "examples/attention.ncd").read_text()
    text = text.replace("in K[b, h, x, d] : fp16", "in K[b, h, x, d] : int32")
    text = text.replace("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : int32")
    with pytest.raises(NapkinError) as err:
        emit_module(napkin.load_text(text), source_text=text, source_path="t.ncd")
    assert [d.message.split(":")[0] for d in err.value.diagnostics] == [
        "napkin cannot emit a kernel for input K", "napkin cannot emit a kernel for input V"]


@pytest.mark.parametrize("path", COMPILED, ids=lambda p: p.stem)
def test_emit_is_deterministic_and_independent_of_how_the_path_is_given(path):
    first = emit_file(path)
    again = emit_module(napkin.load(path), source_text=path.read_text(),
                        source_path=str(path.relative_to(REPO)))
    assert first == again
    assert source_label(str(path)) == f"examples/{path.name}"


@pytest.mark.parametrize("path", COMPILED, ids=lambda p: p.stem)
def test_module_imports_only_torch_and_triton(path):  # (and the standard library)
    tree = ast.parse(emit_file(path))
    imported, lazy = set(), set()
    for top in tree.body:
        # the distributed part of a diagram with a devices level imports
        # napkin.distributed when first called, never at import
        where = lazy if isinstance(top, ast.FunctionDef) and top.name == "_distributed" else imported
        for node in ast.walk(top):
            if isinstance(node, ast.Import):
                where.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                where.add(node.module or "")
    # (triton.tools.tensor_descriptor: the forward's TMA descriptors, imported only when tma= asks)
    # (torch's own submodules: torch.utils._python_dispatch to see a tracing mode, torch.autograd's forward_ad)
    imported = {m for m in imported if not m.startswith("torch.")}
    # (operator: _whole's operator.index, which torch.compile traces)
    # (contextvars: mask_cache=, carried from the launcher into the torch ops' Python;
    # weakref: its entries' stamps, which must not keep the mask inputs alive;
    # threading: a backward's one read of the tuned configs' file, held per thread)
    assert imported <= {"contextlib", "contextvars", "functools", "json", "math", "operator", "os", "threading",
                        "torch", "triton", "triton.language", "triton.tools.tensor_descriptor", "weakref"}, imported
    assert lazy <= {"napkin", "napkin.distributed"}, lazy


@pytest.mark.parametrize("path", COMPILED, ids=lambda p: p.stem)
def test_header_names_source_version_hash_and_cost(path):
    text = emit_file(path)
    doc = ast.get_docstring(ast.parse(text))
    assert text.startswith('"""')
    assert f"examples/{path.name}" in doc
    assert napkin.__version__ in doc
    assert hashlib.sha256(path.read_text().encode()).hexdigest() in doc
    assert "cost summary:" in doc
    summary = doc.split("cost summary:")[1].split("\n\n")[0]
    assert summary.strip(), "the cost summary is empty"


def test_header_has_its_own_cost_lines_without_the_cost_pass(monkeypatch):
    monkeypatch.setitem(sys.modules, "napkin.cost", None)  # importing it now fails
    doc = ast.get_docstring(ast.parse(emit_file(REPO / "examples/causal.ncd")))
    assert "FLOPs: 2*64 + 2*64 per (q, x) pair, only where the mask lets a block through" in doc
    assert "tiling: q by 128 per program (x b, h), x streamed by 64" in doc
    doc = ast.get_docstring(ast.parse(emit_file(REPO / "examples/matmul.ncd")))
    assert "FLOPs: 2*|k| per element of C" in doc


def test_symbolic_wires_are_runtime_arguments_and_blocks_constexpr():
    text = emit_file(REPO / "examples/attention.ncd")
    kernel = text[text.index("def _attention_kernel("):text.index("):\n", text.index("def _attention_kernel("))]
    for w in "bhqx":
        assert f"_size_{w}," in kernel and f"_size_{w}: tl.constexpr" not in kernel
    assert '"_size_q"' in text  # not specialised: one compile serves every length
    for w in "qxd":
        assert f"_BLOCK_{w}: tl.constexpr" in kernel
    assert "_size_d" not in kernel  # d is fixed at 64: a constant


def test_fp32_contractions_use_ieee_unless_tf32_is_allowed():
    text = diagram_text("in A[q, x] : fp32\nin B[x, d] : fp32\nC[q, d] = sum[x](A * B)\nout C",
                        "schedule { level smem { group q by 16, d by 16\nstream x by 16 } }")
    d = parse(text)
    assert 'input_precision="ieee"' in emit_module(d, source_text=text, source_path="t.ncd")
    tf = text.replace("schedule {", "schedule { allow tf32")
    assert 'input_precision="tf32"' in emit_module(parse(tf), source_text=tf, source_path="t.ncd")


# --------------------------------------------------------------------------
# The module's API.
# --------------------------------------------------------------------------

def test_module_tables_and_functions(modules):
    m = modules["gqa"]
    assert m.INPUTS == ("Q", "K", "V") and m.OUTPUTS == ("O", "lse")
    assert m.WIRES == {"b": None, "hk": None, "g": None, "q": None, "x": None, "d": 128}
    assert callable(m.gqa) and callable(m.reference) and m.__doc__
    q, k, v = m.example_inputs({"b": 2, "hk": 3, "g": 2, "q": 5, "x": 7}, dtype=torch.float32)
    assert q.shape == (2, 6, 5, 128) and k.shape == v.shape == (2, 3, 7, 128)
    assert q.dtype == torch.float32
    assert torch.equal(q, m.example_inputs({"b": 2, "hk": 3, "g": 2, "q": 5, "x": 7}, torch.float32)[0])
    with pytest.raises(ValueError, match="needs a size for wire x"):
        m.example_inputs({"b": 1, "hk": 1, "g": 1, "q": 5})
    with pytest.raises(ValueError, match="wire d is fixed at 128"):
        m.example_inputs({"b": 1, "hk": 1, "g": 1, "q": 5, "x": 5, "d": 64})


def test_example_inputs_for_side_tensors(modules):
    q, k, v, doc = modules["document_mask"].example_inputs({"b": 2, "h": 1, "q": 64, "x": 64})
    assert doc.dtype == torch.int32 and doc.shape == (2, 64)
    assert torch.equal(doc, doc.sort(dim=-1).values) and doc.max() > 0
    slope = modules["alibi"].example_inputs({"b": 1, "h": 4, "q": 3, "x": 3})[3]
    assert slope.dtype == torch.float32
    assert torch.allclose(slope, torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]))


def test_reference_is_plain_softmax_attention(modules):
    m = modules["attention"]
    q, k, v = m.example_inputs({"b": 2, "h": 3, "q": 5, "x": 9}, dtype=torch.float64)
    o, lse = m.reference(q, k, v)
    s = q @ k.transpose(-1, -2) / 8
    assert o.dtype == torch.float64
    assert torch.allclose(o, torch.softmax(s, -1) @ v)
    assert torch.allclose(lse, torch.logsumexp(s, -1))


def test_reference_gives_zero_for_fully_masked_rows(tmp_path):
    text = diagram_text("""in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
S[b, h, q, x] = where(x + 3 <= q, sum[d](Q * K), -inf)
O[b, h, q, d] = sum[x](softmax[x](S) * V)
lse[b, h, q] = logsumexp[x](S)
out O, lse""", FLASH)
    m = import_text(emit_module(parse(text), source_text=text, source_path="t.ncd"), tmp_path, "masked")
    o, lse = m.reference(*m.example_inputs({"b": 1, "h": 1, "q": 6, "x": 6}, torch.float64))
    assert torch.equal(o[0, 0, :3], torch.zeros(3, 16, dtype=torch.float64))
    assert torch.isneginf(lse[0, 0, :3]).all() and torch.isfinite(lse[0, 0, 3:]).all()
    assert torch.isfinite(o).all()


# --------------------------------------------------------------------------
# Bad calls: clear errors naming the tensor and the wire.
# --------------------------------------------------------------------------

def _qkv(b=1, h=2, q=5, x=7, d=64, dtype=torch.float16):
    return (torch.randn(b, h, q, d).to(dtype), torch.randn(b, h, x, d).to(dtype), torch.randn(b, h, x, d).to(dtype))


def test_bad_calls_raise_clear_errors(modules):
    att = modules["attention"].attention
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"Q has dtype torch.int64"):
        att(q.long(), k, v)
    with pytest.raises(TypeError, match=r"float64.*reference"):
        att(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match=r"K has dtype torch.float32 but Q has torch.float16"):
        att(q, k.float(), v)
    with pytest.raises(ValueError, match=r"Q must have 4 dimensions \[b, h, q, d\], but has 3"):
        att(q[0], k, v)
    with pytest.raises(ValueError, match=r"K dimension 0 \(b\) has size 3, but wire b has size 1 from Q"):
        att(q, torch.randn(3, 2, 7, 64).half(), v)
    with pytest.raises(ValueError, match=r"V dimension 2 \(x\) has size 8, but wire x has size 7 from K"):
        att(q, k, torch.randn(1, 2, 8, 64).half())
    with pytest.raises(ValueError, match=r"Q dimension 3 \(d\) has size 32, but wire d has size 64 from the diagram"):
        att(*_qkv(d=32))
    with pytest.raises(TypeError, match="V must be a torch.Tensor, not list"):
        att(q, k, [1.0])
    with pytest.raises(ValueError, match="block_q must be a power of two from 16 to 65536, not 24"):
        att(q, k, v, block_q=24)


def test_options_are_whole_numbers_of_any_integer_type_with_or_without_gradients(modules):
    """Options through autograd met the torch op's schema: block_q=16.0 raised
    torch's "Expected a value of type 'Optional[int]'", naming no option the
    caller wrote; numpy integers for num_warps and chunk were refused as not a
    power of two, where block sizes took them (helper's hunt)."""
    import numpy as np

    att = modules["attention"].attention
    q, k, v = (t.float() for t in _qkv(q=20, x=40))
    for grad in (False, True):
        for opts, bad in ((dict(block_q=16.0), "block_q"), (dict(num_stages="2"), "num_stages")):
            with pytest.raises(ValueError, match=rf"{bad} must be "):
                att(q.clone().requires_grad_(grad), k, v, **opts)
        o, _ = att(q.clone().requires_grad_(grad), k, v, block_q=np.int64(16), block_x=np.int32(16),
                   num_warps=np.int64(4), num_stages=np.int16(2))
        assert o.shape == (1, 2, 20, 64)
    o, _ = att(q, k, v, block_x=16, chunk=np.int64(16))   # two chunks of x, merged
    exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8, -1) @ v.double()
    assert (o.double() - exact).abs().max() < 1e-5
    mm = modules["matmul"].matmul
    a, b = torch.randn(20, 24, requires_grad=True), torch.randn(24, 20)
    with pytest.raises(ValueError, match="block_m must be a whole number or None, not 16.5"):
        mm(a, b, block_m=16.5)


@pytest.mark.parametrize("grad", [False, True])
def test_an_option_of_no_whole_number_says_so_eager_or_through_autograd(modules, grad):
    """block_m=16.0 was refused eagerly as "must be a power of two from 16 to 65536, not 16.0", which
    16 is, and through autograd as "must be a whole number or None" (contract hunt): both say the latter."""
    mm, att = modules["matmul"].matmul, modules["attention"].attention
    a, b = torch.randn(20, 24, requires_grad=grad), torch.randn(24, 20)
    # and True, tensor(True), tensor([16]), which operator.index takes (today4 hunt: num_warps=tensor(True)
    # ran with 1 warp; eager True read "at least 1, not True")
    for opts, words in ((dict(block_m=16.0), "block_m must be a whole number or None, not 16.0"),
                        (dict(num_warps=4.0), "num_warps must be a whole number or None, not 4.0"),
                        (dict(num_stages=2.0), "num_stages must be a whole number or None, not 2.0"),
                        (dict(num_stages=True), "num_stages must be a whole number or None, not True"),
                        (dict(block_m=True), "block_m must be a whole number or None, not True"),
                        (dict(num_warps=torch.tensor(True)),
                         "num_warps must be a whole number or None, not tensor(True)"),
                        (dict(block_m=torch.tensor([16])), "block_m must be a whole number or None, not tensor([16])")):
        with pytest.raises(ValueError) as err:
            mm(a, b, **opts)
        assert str(err.value) == words
    q, k, v = (t.float() for t in _qkv(q=20, x=40))
    with pytest.raises(ValueError) as err:
        att(q, k, v, block_x=16, chunk=16.0)
    assert str(err.value) == "chunk must be a whole number or None, not 16.0"


def test_options_left_out_come_from_the_autotune_cache(modules, monkeypatch, tmp_path):
    """A launch without explicit options reads the tuned config cached for its
    shape bucket (napkin.autotune writes it); explicit options always win, and
    a block or chunk given sets the cached blocks and chunk aside.  An
    entry no launch could take (a hand edit, another napkin) is ignored: it
    once made a call without options fail with "block_q must be a power of
    two", of a block_q the caller never passed."""
    import json
    import os

    from napkin import tunecache

    m = modules["attention"]
    sizes = {"b": 1, "h": 2, "q": 5, "x": 7, "d": 64}
    key = tunecache.cache_key(m.SOURCE_HASH, "cpu", {"fp16": "float16"}, sizes, ("b", "h", "q", "x"))
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))

    def cache(config):  # a new file each time, as the writer makes it (the reader watches the inode)
        (tmp_path / "new.json").write_text(json.dumps({"schema": tunecache.SCHEMA,
                                                       "entries": {key: {"config": config}}}))
        os.replace(tmp_path / "new.json", tmp_path / "autotune.json")

    unset = dict.fromkeys(("block_q", "block_x", "num_warps", "num_stages", "tma", "chunk"))
    tuned = {"block_q": 32, "block_x": 16, "num_warps": 4, "num_stages": 3, "tma": False, "chunk": 0}
    cache(tuned)
    cpu, f16 = torch.device("cpu"), {"fp16": torch.float16}
    assert m._autotune_fill(dict(unset), sizes, cpu, f16) == tuned
    # a block given: the cached blocks and chunk, tuned with each other, give way to the schedule's
    assert m._autotune_fill({**unset, "block_q": 16}, sizes, cpu, f16) == {**tuned, "block_q": 16, "block_x": None,
                                                                            "chunk": None}
    assert m._autotune_fill({**unset, "num_warps": 8}, sizes, cpu, f16) == {**tuned, "num_warps": 8}
    for bad in ({"block_q": 24}, {"num_warps": 0}, {"num_stages": 0}, {"chunk": 3}, {"tma": "yes"},
                {"block_x": 16.0}):
        cache({**tuned, **bad})
        assert m._autotune_fill(dict(unset), sizes, cpu, f16) == unset, bad
    o, lse = m.attention(*_qkv())                   # the last bad entry: ignored, the schedule's blocks
    assert o.shape == (1, 2, 5, 64)
    with pytest.raises(ValueError, match="block_x must be a power of two from 16 to 65536, not 8"):
        m.attention(*_qkv(), block_q=16, block_x=8)  # explicit options are checked
    with pytest.raises(ValueError, match="num_warps must be a power of two from 1 to 32, not 0"):
        m.attention(*_qkv(), num_warps=0)
    with pytest.raises(ValueError, match="num_stages must be at least 1, not -1"):
        m.attention(*_qkv(), num_stages=-1)


def test_a_grid_cuda_cannot_launch_is_refused_before_the_launch(modules):
    """CUDA launches at most 65535 programs along a grid's axes 1 and 2; the
    interpreter has no such limit, so without the check a CPU run passes
    what a GPU refuses with "invalid argument"."""
    q = torch.randn(1, 65536, 1, 64).half()         # b x h = 65536 one-row heads
    with pytest.raises(ValueError, match=r"this call needs 65536 programs along axis 1 of a kernel's launch grid"):
        modules["attention"].attention(q, q, q)


def test_the_backward_reads_its_own_tuned_config_not_the_forwards(modules, monkeypatch, tmp_path):
    """The backward's kernels hold other tiles than the forward's, so each
    pass has its own cache entry (kind "bwd"): an invalid block cached for
    one pass stops that pass and no other."""
    import json

    from napkin import tunecache

    m = modules["attention"]
    sizes = {"b": 1, "h": 2, "q": 5, "x": 7, "d": 64}
    wires = ("b", "h", "q", "x")
    fwd, bwd, kv = (tunecache.cache_key(m.SOURCE_HASH, "cpu", {"fp16": "float32"}, sizes, wires, kind)
                    for kind in ("", "bwd", "bwd_kv"))
    assert (bwd, kv) == (fwd + "|bwd", fwd + "|bwd_kv")
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))

    def cache(entries):
        (tmp_path / "autotune.json").write_text(json.dumps({"schema": tunecache.SCHEMA, "entries": entries}))

    good = {"block_q": 16, "block_x": 16, "num_warps": 4, "num_stages": 2}
    cache({fwd: {"config": good}, bwd: {"config": dict(good, block_x=32)}, kv: {"config": dict(good, block_q=32)}})
    cpu, unset, f32 = torch.device("cpu"), dict.fromkeys(good), {"fp16": torch.float32}
    assert m._autotune_fill(dict(unset), sizes, cpu, f32) == good
    assert m._autotune_fill(dict(unset), sizes, cpu, f32, "bwd") == dict(good, block_x=32)
    assert m._autotune_fill(dict(unset), sizes, cpu, f32, "bwd_kv") == dict(good, block_q=32)
    kinds, lookup = [], m._autotune_lookup     # which kernel asks for which entry: tests/test_backward.py
    monkeypatch.setattr(m, "_autotune_lookup", lambda s, d, c, kind="": kinds.append(kind) or lookup(s, d, c, kind))
    q, k, v = (t.float().requires_grad_() for t in _qkv())
    o, lse = m.attention(q, k, v)
    assert kinds == [""]
    (o.sum() + lse.sum()).backward()
    assert set(kinds[1:]) == {"bwd", "bwd_kv"}
    with torch.no_grad():
        o, lse = m.attention(q, k, v, block_x=16)
    grads = m.attention_backward(q, k, v, torch.randn_like(o), lse, torch.zeros_like(lse))
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_cpu_tensors_need_the_interpreter(modules, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Q is on the CPU.*TRITON_INTERPRET=1"):
        modules["attention"].attention(*_qkv())


def test_relabelled_and_grouped_wires_are_checked(modules):
    q, k, v = _qkv(q=5, x=7)
    with pytest.raises(ValueError, match=r"doc is read along q as well as x, so wires q \(5\) and x \(7\)"):
        modules["document_mask"].document_mask(q, k, v, torch.zeros(1, 7, dtype=torch.int32))
    with pytest.raises(TypeError, match="doc must hold integers"):
        modules["document_mask"].document_mask(q, k, v, torch.zeros(1, 7))
    gq = torch.randn(1, 5, 4, 128).half()
    gk = torch.randn(1, 2, 6, 128).half()
    with pytest.raises(ValueError, match=r"Q dimension 1 \(hk g\) has size 5, not a multiple of 2"):
        modules["gqa"].gqa(gq, gk, gk)
    with pytest.raises(ValueError, match=r"Q dimension 1 \(hk g\): the size of g cannot be told, as its other "
                                         r"wires have size 0"):   # it said "not a multiple of 0"
        modules["gqa"].gqa(gq[:, :0], gk[:, :0], gk[:, :0])


# --------------------------------------------------------------------------
# Refusals: NapkinError with a location and a plain reason.
# --------------------------------------------------------------------------

QKV = "in Q[b, h, q, d] : fp16\nin K[b, h, x, d] : fp16\nin V[b, h, x, d] : fp16\n"


@pytest.mark.parametrize("body, schedule, words", [
    (QKV + "S[b, h, q, x] = sum[d](Q * K)\nP[b, h, q, x] = softmax[x](S)\nO[b, h, q, d] = sum[x](P * V)\nout O",
     "schedule { level hbm { hold S }\nlevel smem { group q by 32\nstream x by 16 } }", "unfused"),
    (QKV + "S[b, h, q, x] = sum[d](Q * K)\nO[b, h, q, d] = sum[x](S * V)\nout O",
     "schedule { accumulate fp16\nlevel smem { group q by 32\nstream x by 16 } }", "accumulate in fp32"),
    (QKV + "S[b, h, q, x] = sum[d](Q * K)\nO[b, h, q, d] = sum[x](S * V)\nout O",
     "schedule { level smem { group h by 2, q by 32\nstream x by 16 } }", "group h by 1"),
    (QKV + "S[b, h, q, x] = sum[d](Q * K)\nO[b, h, q, d] = sum[x](S * V)\nT[b, h, q, x] = S * 2\nout O, T",
     FLASH, "keeps the streamed wire x"),
    (QKV + "S[b, h, q, x] = sum[d](Q * K * K)\nO[b, h, q, d] = sum[x](S * V)\nout O", FLASH,
     "sum[w](A * B) of two inputs"),
    # a per-dimension scale is one side's: the hint says which and how
    (QKV + "in s[h, d] : fp32\nS[b, h, q, x] = sum[d](Q * K * s)\nO[b, h, q, d] = sum[x](S * V)\nout O", FLASH,
     "sum[w](A * B) of two inputs\n    S[b, h, q, x] = sum[d](Q * K * s)\n                    ^^^^^^^^^^^^^^^^^\n"
     "  hint: multiply s into Q in torch before the call and pass Q * s as Q (the same scores; the tiles "
     "multiply two factors)"),
    # a matmul with two sums was told it had none (one sum read twice is one product: it trains)
    ("in A[b, q, d] : fp32\nin B[b, d, x] : fp32\nC[b, q, x] = relu(sum[d](A * B)) + sum[d](A * A)\nout C", "",
     "box C: its expression uses 2 different sums over d"),
    # the value in the weights' tile was said to be read "inside the score"
    (QKV + "in G[b, h, x, d] : fp16\nS[b, h, q, x] = sum[d](Q * K)\nP[b, h, q, x] = softmax[x](S)\n"
     "O[b, h, q, d] = sum[x](P * (V + G))\nout O", FLASH,
     "for V: it is read along d in a tile over (q, x) (the scores, or the weights of a sum over x); a tensor "
     "along d may only be the value of sum[x](weights * V), one input multiplied in alone"),
])
def test_unsupported_diagrams_are_refused_with_a_location(body, schedule, words):
    text = diagram_text(body, schedule)
    diagram = parse(text, "t.ncd")
    with pytest.raises(NapkinError) as err:
        emit_module(diagram, source_text=text, source_path="t.ncd")
    message = str(err.value)
    assert "napkin cannot emit a kernel for" in message and words in message, message
    assert err.value.diagnostics[0].loc.line > 0 and message.startswith("t.ncd:")


def test_a_contraction_over_two_wires_streams_the_last_and_loops_over_the_other():
    """sum[k, j](A * B) was refused ("a contraction kernel streams one wire"): with no stream in
    its schedule the kernel streams j, the sum's last wire, and each program loops over k around
    it (tests/test_contraction_sums.py runs it); 'stream k by 16' swaps them."""
    from napkin.codegen import lower as L
    text = ("diagram mm2\nwire m, n, k, j\nin A[m, k, j] : fp32\nin B[k, j, n] : fp32\n"
            "C[m, n] : fp32 = sum[k, j](A * B)\nout C\n")
    plan = L.lower(parse(text, "t.ncd"))
    assert (plan.red, plan.outer, plan.batch) == ("j", ("k",), ())
    source = emit_module(parse(text, "t.ncd"), source_text=text, source_path="t.ncd")
    assert "for _o in range(_size_k):" in source and "_rest = _o\n        _i_k = _rest\n" in source
    streamed = L.lower(parse(text + "schedule { level smem { stream k by 16 } }\n", "t.ncd"))
    assert (streamed.red, streamed.outer) == ("k", ("j",))


# --------------------------------------------------------------------------
# write_module and compile time.
# --------------------------------------------------------------------------

def test_write_module_writes_atomically(tmp_path):
    out = tmp_path / "gen"
    path = write_module(REPO / "examples/causal.ncd", out)
    assert path == out / "causal.py" and path.read_text() == emit_file(REPO / "examples/causal.ncd")
    assert (out / "__init__.py").is_file()
    with pytest.raises(NapkinError):
        write_module(REPO / "examples/naive_attention.ncd", out)
    assert sorted(p.name for p in out.iterdir()) == ["__init__.py", "causal.py"]


def test_a_module_that_is_not_python_is_napkins_bug_and_never_written(tmp_path, monkeypatch):
    """A template slip once emitted `f(Q, K, V, , _o)` and `napkin compile`
    said "wrote": the user met the SyntaxError at import.  emit_module now
    compiles its text first; the CLI reports such a failure as an internal
    error (exit status 2), and nothing is written."""
    from napkin.cli import main
    from napkin.codegen import emit

    real = emit.render
    monkeypatch.setattr(emit, "render", lambda *a, **k: real(*a, **k) + "\ndef broken(a, a):\n    pass\n")
    with pytest.raises(RuntimeError, match=r"napkin bug: the module emitted for diagram causal is not valid "
                                           r"Python \(line \d+: duplicate argument 'a'.*\): def broken\(a, a\):"):
        emit_file(REPO / "examples" / "causal.ncd")
    out = tmp_path / "out"
    assert main(["compile", str(REPO / "examples" / "causal.ncd"), "-o", str(out)]) == 2
    assert not out.exists() or not any(out.iterdir())


def test_compiling_needs_no_torch():
    """Compiling every example, in a fresh interpreter, never imports torch
    (a generated module needs it; napkin's compiler does not).  Runs
    bench/compile_time.py, which also prints each compile's seconds: a
    benchmark's number, not asserted here (under load on a 2-core box the
    first compile, imports and all, has taken from 0.6 s to over 2 s)."""
    out = subprocess.run([sys.executable, str(REPO / "bench" / "compile_time.py"), *map(str, COMPILED)],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout.splitlines()
    assert [line.split()[2:] for line in out[:-1]] == [[str(p), "compiled"] for p in COMPILED]
    assert out[-1] == "torch imported: False"


# --------------------------------------------------------------------------
# Masks.
# --------------------------------------------------------------------------

X, Q = ir.WireIndex("x"), ir.WireIndex("q")


def _pred(src: str) -> ir.Expr:
    d = parse(diagram_text(f"in A[q, x] : fp32\nS[q, x] = where({src}, A, -inf)\nout S"))
    return masks.mask_predicate(masks.mask_node(d.lets[0].expr))


def test_classify_block_by_interval_arithmetic():
    causal = _pred("x <= q")
    C = masks.BlockClass
    assert masks.classify_block(causal, {"q": (0, 16), "x": (16, 32)}, {}) is C.EMPTY
    assert masks.classify_block(causal, {"q": (16, 32), "x": (0, 16)}, {}) is C.FULL
    assert masks.classify_block(causal, {"q": (0, 16), "x": (0, 16)}, {}) is C.PARTIAL
    window = _pred("x <= q and q - x < 8")
    assert masks.classify_block(window, {"q": (32, 48), "x": (0, 16)}, {}) is C.EMPTY
    assert masks.classify_block(_pred("not (x <= q)"), {"q": (16, 32), "x": (0, 16)}, {}) is C.EMPTY
    assert masks.classify_block(_pred("x > q or x < 2"), {"q": (16, 32), "x": (0, 2)}, {}) is C.FULL
    bottom_right = _pred("x <= q + |x| - |q|")  # causal aligned to the last key
    assert masks.classify_block(bottom_right, {"q": (0, 4), "x": (0, 16)}, {"q": 4, "x": 16}) is C.PARTIAL
    assert masks.classify_block(bottom_right, {"q": (0, 4), "x": (0, 12)}, {"q": 4, "x": 16}) is C.FULL
    assert masks.classify_block(bottom_right, {"q": (0, 4), "x": (0, 16)}, {"q": 4}) is C.PARTIAL  # |x| unknown
    doc = parse(diagram_text("in doc[b, x] : int32\nin A[b, q, x] : fp32\n"
                             "S[b, q, x] = where(doc[b, q] == doc, A, -inf)\nout S"))
    pred = masks.mask_predicate(masks.mask_node(doc.lets[0].expr))
    assert masks.classify_block(pred, {"q": (0, 16), "x": (16, 32)}, {}) is C.PARTIAL


def test_masked_scores_contribute_nothing_only_when_the_body_vanishes():
    node = ir.Call("where", (ir.Binary("<=", X, Q), ir.TensorRef("A"), ir.Num(float("-inf"))))
    s = node
    assert masks.value_when_masked(ir.Call("exp", (s,)), node) == 0.0
    assert masks.value_when_masked(ir.Call("sigmoid", (ir.Binary("-", s, ir.Num(1.5)),)), node) == 0.0
    assert masks.value_when_masked(ir.Binary("^", ir.Call("relu", (s,)), ir.Num(2)), node) == 0.0
    assert masks.value_when_masked(ir.Binary("*", ir.Call("exp", (s,)), ir.TensorRef("V")), node) == 0.0
    assert masks.value_when_masked(ir.Binary("*", s, s), node) == float("inf")
    assert masks.value_when_masked(ir.Call("tanh", (s,)), node) == -1.0
    assert masks.value_when_masked(ir.Binary("*", ir.Call("exp", (s,)), ir.Binary("*", s, s)), node) is None


def test_stream_bounds_and_visited_blocks():
    window = _pred("x <= q and q - x < 40")
    bounds = masks.stream_bounds(window, "q", "x")
    assert {(b.kind, b.row_coeff, b.rest) for b in bounds} == {("upper", 1, ()), ("lower", 1, (("", -39),))}
    visited = visits.visited_blocks(bounds, 100, 100, 32, 16)
    # every block with an unmasked (q, x) pair is visited, and nothing else for this window
    needed = {(i // 32, j // 16) for i in range(100) for j in range(100) if j <= i and i - j < 40}
    assert set(visited) == needed and len(visited) == len(needed)
    assert visits.visited_blocks((), 40, 40, 32, 16) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    shifted = masks.stream_bounds(_pred("x <= q + |x| - |q|"), "q", "x")
    assert visits.visited_blocks(shifted, 2, 64, 16, 16, {"q": 2, "x": 64}) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    # 20 queries against 40 keys: rows 0..15 see keys up to 35, rows 16..19 up to 39
    assert visits.visited_blocks(shifted, 20, 40, 16, 16, {"q": 20, "x": 40}) == \
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert visits.visited_blocks(shifted, 20, 64, 16, 16, {"q": 20, "x": 64}) == \
        [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert visits.visited_blocks(masks.stream_bounds(_pred("x >= 40"), "q", "x"), 16, 64, 16, 16) == [(0, 2), (0, 3)]


# --------------------------------------------------------------------------
# Lowering: the plan's state follows the streaming rule.
# --------------------------------------------------------------------------

def _plan(name):
    return L.lower(napkin.load(REPO / "examples" / f"{name}.ncd"))


def test_plans_derive_their_streaming_state():
    softmax = _plan("attention")
    assert [(a.op, a.value is not None) for a in softmax.accums] == [("expsum", True), ("expsum", False)]
    assert len(softmax.groups) == 1 and softmax.skip is None
    sigmoid = _plan("sigmoid_attention")
    assert [a.op for a in sigmoid.accums] == ["sum"] and not sigmoid.groups  # no running max
    l2 = _plan("l2_attention")
    assert [(a.op, a.value is not None) for a in l2.accums] == [("sum", True), ("sum", False)]
    relu2 = _plan("relu2_attention")
    assert relu2.skip is not None and relu2.bounds  # relu(-inf)^2 = 0: skipping is sound
    assert _plan("causal").bounds and _plan("sliding_window").bounds
    assert _plan("document_mask").skip is not None and not _plan("document_mask").bounds
    assert _plan("matmul").family == "contraction"
    assert napkin.codegen.visited_blocks(napkin.load(REPO / "examples/matmul.ncd"), {}) is None
    causal = napkin.load(REPO / "examples/causal.ncd")
    assert napkin.codegen.visited_blocks(causal, {"q": 256, "x": 256}) == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                                           (1, 2), (1, 3)]


def test_a_body_that_is_not_zero_at_minus_inf_visits_every_block():
    text = diagram_text(QKV + "S[b, h, q, x] = where(x <= q, sum[d](Q * K), -inf)\n"
                        "O[b, h, q, d] = sum[x](S * S * V)\nout O", FLASH)
    plan = L.lower(parse(text))
    assert plan.skip is None and plan.bounds == ()


def test_a_negated_causal_mask_is_bounded_and_dropped_in_full_blocks_like_the_plain_one():
    """where(x > q, -inf, s) is where(x <= q, s, -inf): the same loop bounds (it had none under a
    bare `not`, and ran a ranges prepass at every launch), and the same full-block steps, where the
    comparison is known and the select is left out: it appears as often as the plain one's."""
    text = (REPO / "examples" / "causal.ncd").read_text()
    negated = text.replace("where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)",
                           "where(x > q, -inf, sum[d](Q * K) * |d|^-0.5)")
    assert negated != text
    plain = emit_module(napkin.load_text(text), source_text=text, source_path="causal.ncd")
    neg = emit_module(napkin.load_text(negated), source_text=negated, source_path="causal.ncd")
    assert "_ranges" not in neg and "_ranges" not in plain
    uses = plain.count("_idx_x[None, :] <= _idx_q[:, None]")
    assert uses > 0 and neg.count("_idx_x[None, :] > _idx_q[:, None]") == uses
    plan = L.lower(napkin.load_text(negated))
    assert plan.skip == ir.Binary("<=", ir.WireIndex("x"), ir.WireIndex("q")) and plan.full


def test_a_chain_of_boxes_nesting_past_the_depth_limit_is_refused_at_its_box():
    """Each box is at most 100 levels deep, but the kernels inline the boxes a box reads: 200 boxes
    S_i = exp(S_i-1) crashed the code generator (RecursionError, or Python too nested to compile)."""
    import napkin
    from napkin.codegen import emit_module
    from napkin.errors import NapkinError

    lines = ["diagram t", "wire q, x", "wire d = 64", "in Q[q, d] : fp16", "in K[x, d] : fp16", "in V[x, d] : fp16",
             "S[q, x] = sum[d](Q * K)", "S0[q, x] = exp(S)"] + [f"S{i}[q, x] = exp(S{i - 1})" for i in range(1, 200)]
    text = "\n".join(lines + ["O[q, d] = sum[x](softmax[x](S199) * V)", "out O"]) + "\n"
    with pytest.raises(NapkinError) as err:
        emit_module(napkin.load_text(text, "t.ncd"), source_text=text, source_path="t.ncd")
    assert str(err.value).startswith("t.ncd:105:1: napkin cannot emit a kernel for box S97: with the boxes it reads "
                                     "inlined, its expression nests 101 levels deep, more than the 100 a kernel takes")


@pytest.mark.parametrize("expr, bounded", [
    ("sigmoid(S)", True), ("2 * tanh(S) + 1", True), ("sigmoid(S) * 1000", True),
    ("where(x <= q, sigmoid(S), 0)", True), ("exp(-relu(S))", True), ("abs(tanh(S)) ^ 3", True),
    ("max(sigmoid(S), 0.5) / 4", True), ("sqrt(sigmoid(S))", True),
    ("relu(S) ^ 2", False), ("S", False), ("exp(S)", False), ("sigmoid(S) / 0.00001", False),
    ("where(x <= q, S, 0)", False), ("sigmoid(S) * q", False), ("sigmoid(S) * 20000", False),
])
def test_weight_tiles_known_to_fit_float16(expr, bounded):
    """codegen/weights.fits: the weight tiles a kernel may round to a float16
    V as they are (|w| <= 2^14 whatever the inputs); any other is scaled per
    row by a power of two first."""
    from napkin.codegen import weights

    d = napkin.load_text(f"diagram t\nwire q, x\nin S[q, x] : fp32\nW[q, x] = {expr}\nout W\n")
    assert weights.fits(d.tensor("W").expr, {}) is bounded


def test_an_option_out_of_range_under_torch_compile_is_a_value_error(modules):
    """block_q=17 under torch.compile raised torch's TorchRuntimeError wrapping the fake's
    ValueError (today4 hunt): the ranges that need no sizes are checked before the op."""
    att = torch.compile(modules["attention"].attention, backend="eager")
    q, k, v = (t.float() for t in _qkv(q=20, x=40))
    for opts, words in ((dict(block_q=17), "block_q must be a power of two from 16 to 65536, not 17"),
                        (dict(block_q=1 << 17), "block_q must be a power of two from 16 to 65536, not 131072"),
                        (dict(num_warps=3), "num_warps must be a power of two from 1 to 32, not 3"),
                        (dict(num_stages=0), "num_stages must be at least 1, not 0")):
        with pytest.raises(ValueError) as err:
            att(q.requires_grad_(), k, v, **opts)
        assert str(err.value) == words


_RELATIVES_HEAD = ("diagram rel\nwire b, h, q, x\nwire d = 32\nin Q[b, h, q, d] : fp32\nin K[b, h, x, d] : fp32\n"
                   "in V[b, h, x, d] : fp32\nS[b, h, q, x] = sum[d](Q * K) * |d|^-0.5\n")


@pytest.mark.parametrize("body, at, message, hint", [
    # cosine attention's norms: a contraction of one side alone ("exactly one factor must carry the
    # streamed wire x" named no way out); its box computed in torch and passed in trains (test_backward)
    ("Qn[b, h, q] = sum[d](Q * Q)\nC[b, h, q, x] = S / sqrt(Qn)\nO[b, h, q, d] = sum[x](softmax[x](C) * V)\n"
     "out O\n", (8, 15),
     "neither factor is along the streamed wire x; a kernel contracts d only in a score, one factor along x "
     "(the keys) and one without it (the rows)",
     "compute Qn in torch before the kernel and pass it in as an input: in Qn[b, h, q] : fp32"),
    ("Kn[b, h, x] = sum[d](K * K)\nC[b, h, q, x] = S / sqrt(Kn)\nO[b, h, q, d] = sum[x](softmax[x](C) * V)\n"
     "out O\n", (8, 15),
     "both factors are along the streamed wire x; a kernel contracts d only in a score, one factor along x "
     "(the keys) and one without it (the rows)",
     "compute Kn in torch before the kernel and pass it in as an input: in Kn[b, h, x] : fp32"),
    # Y = sum[d](O): the streamed wire is d, so O's sum read as a score contraction
    ("O[b, h, q, d] = sum[x](softmax[x](S) * V)\nY[b, h, q] = sum[d](O)\nout Y\n", (8, 17),
     "an output reduces it again along d: a kernel streams the wire of its outputs' outermost reduction "
     "(d here) and ends there", "output this result and reduce it in torch"),
    # a softmax of a softmax: the hint named what is written
    ("P[b, h, q, x] = softmax[x](S)\nO[b, h, q, d] = sum[x](softmax[x](P) * V)\nout O\n", (8, 17),
     "it uses a reduction over x inside a reduction over x", None),
    # a sum over heads too: "exactly one factor must carry the streamed wire h", at the score
    ("O[b, q, d] = sum[h, x](softmax[x](S) * V)\nout O\n", (8, 14),
     "it reduces h, x at once; a streamed kernel reduces x alone", None),
])
def test_refusals_of_attentions_relatives_blame_what_is_wrong(body, at, message, hint):
    """novel3 hunt: each of these blamed a line that is right, or hinted at what is written."""
    with pytest.raises(NapkinError) as e:
        L.lower(napkin.load_text(_RELATIVES_HEAD + body, "rel.ncd"))
    (diag,) = e.value.diagnostics
    assert (diag.loc.line, diag.loc.col) == at and diag.message.endswith(message) and diag.hint == hint


def test_a_value_without_a_feature_wire_says_so_in_the_backward_refusal(tmp_path):
    """V[b, h, x] ran forward; its backward refusal asked for sum[x](softmax[x](S) * V), the form
    written (novel3 hunt)."""
    text = _RELATIVES_HEAD.replace("in V[b, h, x, d]", "in V[b, h, x]") + \
        "O[b, h, q] = sum[x](softmax[x](S) * V)\nout O\n"
    m = import_text(emit_module(napkin.load_text(text, "rel.ncd"), source_text=text, source_path="rel.ncd"),
                    tmp_path, "rel")
    assert m._NO_BACKWARD == ("napkin has no backward for diagram rel: the value V has no feature wire (a wire "
                              "the scores lack, as d of V[b, h, x, d]): the backward takes sum[x](softmax[x](S) "
                              "* V) with one; give V a wire of size 1 (line 8, column 14 of the diagram)")


# --------------------------------------------------------------------------
# Floor division in the kernels: Triton's // truncates towards zero on the
# GPU (the interpreter's numpy floors), so a numerator that can be negative
# is divided as a non-negative one.  Checked here under truncation itself.
# --------------------------------------------------------------------------

class _Truncating(int):
    """An int whose // truncates towards zero and whose % takes the dividend's
    sign, as compiled Triton's do."""

    def _wrap(f):
        return lambda a, b: _Truncating(f(int(a), int(b)))

    __add__, __radd__ = _wrap(int.__add__), _wrap(int.__radd__)
    __sub__, __rsub__ = _wrap(int.__sub__), _wrap(int.__rsub__)
    __mul__, __rmul__ = _wrap(int.__mul__), _wrap(int.__rmul__)
    __floordiv__ = _wrap(lambda a, b: abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1))
    __rfloordiv__ = _wrap(lambda a, b: abs(b) // abs(a) * (1 if (a < 0) == (b < 0) else -1))
    __mod__ = _wrap(lambda a, b: abs(a) % abs(b) * (1 if a >= 0 else -1))

    def __neg__(self):
        return _Truncating(-int(self))


class _TL:
    """The few tl functions index arithmetic renders to, on scalars."""
    int64 = "int64"

    class PropagateNan:
        ALL = "all"

    @staticmethod
    def where(c, a, b):
        return a if c else b

    @staticmethod
    def cast(v, dtype):
        return v

    @staticmethod
    def maximum(a, b, propagate_nan=None):
        return max(a, b)


@pytest.mark.parametrize("text", ["(q - x - 3) // 7", "(x - q) // 24 * 24", "-x // 4", "q // 5 - x // 3",
                                  "(q - 2 * x) // |c|", "max(q - x, 0 - x) // 3", "(q - x) % 3", "(x - q - 2) % |c| * 2",
                                  "-x % 4 + q % 5", "(q % 7 - x) % 4", "(q - x) % 6 // 4"])
def test_floor_division_floors_where_triton_truncates(text):
    from napkin.codegen.exprs import Ctx, triton
    d = parse(f"diagram t\nwire q, x\nwire c = 6\nin A[q, x] : fp32\nS[q, x] = where({text} == 0, A, -inf)\nout S")
    e = d.lets[0].expr.args[0].lhs
    code = triton(e, Ctx(index={"q": "q", "x": "x"}, size={}, fixed={"c": 6}))
    for q in range(0, 40):
        for x in range(0, 40):
            want = eval(text.replace("|c|", "6"), {"q": q, "x": x, "max": max})
            got = eval(code, {"tl": _TL, "q": _Truncating(q), "x": _Truncating(x)})
            assert got == want, (code, q, x)

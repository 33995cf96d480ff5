"""A diagram's names against the generated code's own variables.

Every box a kernel step reads becomes a kernel variable ``_`` + its name and
every input load ``_`` + the input's name; the kernels also define their own
``_m``, ``_p``, ``_acc``, ``_qk``, ``_hi``, ``_offs_q``, ... (kernel_names.internal_names)
and call the module's jit helpers ``_safe_div``, ``_logsumexp``.  A user's
name must never take one of those: a box called ``m`` once overwrote the
running max (wrong results, no error), ``qk`` the score product ("cannot
render Reduce"), ``hi`` the loop bound (a crash).

Two kinds of test:

* structural, over the whole list NAMES (emitting only, fast): each name as a
  box read in the step and as an input; the module compiles, and every
  Triton kernel in it (forward, rows, dK/dV, dQ) is exactly the text the same
  diagram gives with the harmless name ``zq``, up to renaming ``zq``'s
  variable to the name's own: so no variable took a second meaning.
  (Inputs in the diagram with a backward only: with two outputs there is
  none, and the forward's loads were named apart already.)
* numerical, on the subsets NUMERIC (boxes: the names that clashed on main)
  and NUMERIC_INPUTS: the forward on ragged sizes (37 x 29, blocks 16)
  against the float64 reference, and the gradients dQ, dK, dV (and the side
  input's) against torch.autograd through that reference.

Plus the contraction family (an epilogue input ``full``, an input ``dC``
beside output C), outputs named like launcher options (and Triton's
num_warps / num_stages, refused), and the distributed launcher's own
parameters (refused).
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

import pytest
import torch

import napkin
from napkin.check import hostile_name
from napkin.codegen import emit_module, training
from napkin.codegen.attention import KERNEL_NAMES
from napkin.codegen.backward import FIXED_NAMES
from napkin.codegen.kernel_names import internal_names
from napkin.codegen.lower import inline, lower
from napkin.errors import NapkinError

REPO = Path(__file__).resolve().parent.parent

# Every base of kernel_names.internal_names (suffixed ones too), the skeleton's fixed
# names, per-wire and per-tensor ones, the module's jit helpers.
NAMES = (
    "s p m m_new m_use alpha qk acc l t w dot scale "
    "w0 s1 t0 t2 m1 acc1 l1 p0 alpha1 "
    "pid batch row0 col0 start lo hi flo fhi row_first row_last col_first col_last live rb outer o ok need grad_dtype "
    "grid opts pos full a "
    "offs_q offs_x ok_x ok_q gok_q idx_q idx_x i_b i_h size_x len_x pos_q BLOCK_x POS_q "
    "st_Q_d st_K_x out_O acc_V grad_Q part_Q saved_lse tma_Q tma_K_1 TMA "
    "tanh sigmoid relu safe_div logsumexp softmax exp scaled operand "
    "c0 CHUNK part n_chunks W at c m_c beta v WIDE e0 k0"
).split()
# builtins: the checker refuses them with a located error before codegen
REFUSED = ("max", "min", "sum")
# run for real: the box names that broke on main (wrong, crashed or refused);
# of the input names (loads were kept apart already), the jit helpers' that broke
# and a few that load under another name
NUMERIC = ("m", "p", "alpha", "l", "s", "w0", "acc", "m_new", "hi", "fhi", "qk", "offs_q", "ok_x", "size_x",
           "safe_div", "logsumexp")
NUMERIC_INPUTS = ("s", "qk", "hi", "offs_q", "safe_div", "logsumexp", "scaled", "operand")
CASES = [(n, "box") for n in NUMERIC] + [(n, "input") for n in NUMERIC_INPUTS]
NEUTRAL = "zq"
SIZES = {"b": 1, "h": 2, "q": 37, "x": 29}

BOX = """diagram clash

wire b, h, q, x
wire d = 16

in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32

{n}[b, h, q, x] = sum[d](Q * K) * |d|^-0.5 + 1.0
P[b, h, q, x] = softmax[x]({n})
O[b, h, q, d] : fp32 = sum[x](P * V)
{extra}
out O{outs}
"""
# ALiBi-like: the input is a side input of the score (it gets a gradient too)
INPUT = """diagram clash

wire b, h, q, x
wire d = 16

in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in {n}[h] : fp32

S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5 + {n} * (x - q)
P[b, h, q, x] = softmax[x](S)
O[b, h, q, d] : fp32 = sum[x](P * V)
{extra}
out O{outs}
"""


def _text(template: str, name: str, max_output: bool) -> str:
    # max[x](box) is a second reader of the box (it stays a step variable);
    # the gradient needs a single attention output
    if max_output:
        read = name if template is BOX else "S"
        return template.format(n=name, extra=f"mx[b, h, q] = max[x]({read})\n", outs=", mx")
    return template.format(n=name, extra="", outs="")


@functools.lru_cache(maxsize=None)
def _emit(text: str) -> tuple[str, object]:
    d = napkin.load_text(text, "clash.ncd")
    return emit_module(d, source_text=text, source_path="clash.ncd"), d


def _kernels(src: str) -> dict[str, str]:
    """Every @triton.jit kernel of a module (the helpers aside), name -> source."""
    tree = ast.parse(src)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
            out[node.name] = ast.get_source_segment(src, node)
    return out


def _own_var(d, name: str) -> str:
    """The kernel variable napkin gave the user's ``name``: the box's step
    tile, or the input's load."""
    plan = training.prepare(lower(d)).forward
    box = inline(d).get(name)
    for var, e in plan.tiles:
        if e == box:
            return var
    for ld in plan.loads:
        if ld.tensor == name:
            return ld.var
    raise AssertionError(f"{name} has no kernel variable")


def _renamed(src: str, var: str, name: str) -> str:
    """The neutral module's text with zq's variable renamed to ``var`` and zq
    (strides, pointers, buffers) to ``name``; in the names napkin joins from
    parts (strides, partial sums, descriptors) as kernel_names.part writes it."""
    from napkin.codegen.kernel_names import part

    for prefix in ("_part_acc_", "_part_pg_", "_part_", "_tma_"):   # also inside a stride's name: _st__part_zq_b
        src = re.sub(rf"{prefix}{NEUTRAL}(?=_|\b)", lambda _: prefix + part(name), src)
    src = re.sub(rf"\b_st_{NEUTRAL}(?=_)", lambda _: "_st_" + part(name), src)
    src = re.sub(rf"\b_{NEUTRAL}\b", "\0", src)
    src = src.replace(NEUTRAL, name)
    return src.replace("\0", var)


@pytest.mark.parametrize("name", REFUSED)
def test_builtin_names_are_refused_by_the_checker(name):
    assert hostile_name(name) is not None
    with pytest.raises(NapkinError, match="shadows a Python builtin"):
        napkin.load_text(_text(BOX, name, True), "clash.ncd")


@pytest.mark.parametrize("kind", ["box_with_max", "box", "input"])
@pytest.mark.parametrize("name", NAMES)
def test_kernels_are_the_neutral_ones_renamed(name, kind):
    template, max_output = (INPUT, False) if kind == "input" else (BOX, kind == "box_with_max")
    neutral_src, neutral_d = _emit(_text(template, NEUTRAL, max_output))
    src, d = _emit(_text(template, name, max_output))
    compile(src, "clash.py", "exec")  # no duplicate parameter in any launcher
    var = _own_var(d, name)
    assert var not in internal_names(d) | KERNEL_NAMES | FIXED_NAMES, var
    want = _kernels(_renamed(neutral_src, var, name))
    got = _kernels(src)
    if template is INPUT and name in training.BACKWARD_OPTIONS:
        # need= and grad_dtype= are the public backward's options (NAME_backward(..., need=None)),
        # so an input of that name gets no backward (nor saved row state), and says so
        assert f"{name}\\u0027 has the name of the backward" in src  # (tojson escapes the quote)
        assert list(got) == ["_clash_kernel"]
        return
    assert got.keys() == want.keys()
    assert _own_var(neutral_d, NEUTRAL) == f"_{NEUTRAL}"
    neutral = _kernels(neutral_src)
    for k in want:
        # the variable the name took is new to the kernel: the rename merged nothing
        assert var not in re.findall(r"\b_\w+\b", neutral[k]), (k, var)
        assert got[k] == want[k], f"kernel {k}: {name} changed more than its own variable {var}"


def _load_module(src: str, tmp_path, tag: str):
    path = tmp_path / f"clash_{tag}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"_napkin_clash_{tag}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _max_err(a, b) -> float:
    return float((a.detach().double() - b.detach()).abs().max())


@pytest.mark.parametrize("name, kind", CASES)
def test_forward_matches_the_reference(name, kind, tmp_path):
    template = BOX if kind == "box" else INPUT
    src, _ = _emit(_text(template, name, True))
    m = _load_module(src, tmp_path, f"fwd_{name}_{kind}")
    ins = m.example_inputs(SIZES, dtype=torch.float32)
    with torch.no_grad():
        out = m.clash(*ins, block_q=16, block_x=16)
        ref = m.reference(*[t.double() for t in ins])
    for o, r, what in zip(out, ref, ("O", "mx")):
        assert _max_err(o, r) < 1e-4, (name, what)


@pytest.mark.parametrize("name, kind", CASES)
def test_gradients_match_autograd(name, kind, tmp_path):
    template = BOX if kind == "box" else INPUT
    src, _ = _emit(_text(template, name, False))
    m = _load_module(src, tmp_path, f"bwd_{name}_{kind}")
    ins = m.example_inputs(SIZES, dtype=torch.float32)
    mine = [t.clone().requires_grad_() for t in ins]
    theirs = [t.double().requires_grad_() for t in ins]
    out, ref = m.clash(*mine, block_q=16, block_x=16), m.reference(*theirs)
    assert _max_err(out, ref) < 1e-4
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, mine, g.float())
    want = torch.autograd.grad(ref, theirs, g)
    for a, b, t in zip(got, want, ("Q", "K", "V", name)):
        assert _max_err(a, b) < 1e-3 * max(1.0, float(b.abs().max())), (name, f"d{t}")


@pytest.mark.parametrize("name", ["m", "qk", "s", "p", "scale"])
def test_opened_score_box(name, tmp_path):
    """A score box that is only a positive scale of the product is opened by
    scale.py (its tile is never computed: the exponent folds the scale); the
    rest of the step must still not take its name's variable."""
    text = BOX.replace(" + 1.0", "").format(n=name, extra="", outs="")
    src, _ = _emit(text)
    m = _load_module(src, tmp_path, f"opened_{name}")
    ins = m.example_inputs(SIZES, dtype=torch.float32)
    mine = [t.clone().requires_grad_() for t in ins]
    theirs = [t.double().requires_grad_() for t in ins]
    out, ref = m.clash(*mine, block_q=16, block_x=16), m.reference(*theirs)
    assert _max_err(out, ref) < 1e-4
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, mine, g.float()), torch.autograd.grad(ref, theirs, g)):
        assert _max_err(a, b) < 1e-3


# ---- the contraction family ----

MATMUL = """diagram mm

wire m, n, k

in {a}[m, k] : fp32
in {b}[k, n] : fp32
{side}
C[m, n] : fp32 = sum[k]({a} * {b}){epilogue}
out C
"""


@pytest.mark.parametrize("a, b, side", [("A", "B", "full"), ("a", "b", "acc"), ("b_1", "a", "a_1")])
def test_contraction_epilogue_input_names(a, b, side, tmp_path):
    """An epilogue input called ``full`` once became the load ``_full``,
    which the kernel then overwrote with its count of whole blocks."""
    text = MATMUL.format(a=a, b=b, side=f"in {side}[m, n] : fp32", epilogue=f" + {side}")
    src, _ = _emit(text)
    m = _load_module(src, tmp_path, f"mm_{a}_{b}_{side}")
    ins = m.example_inputs({"m": 37, "n": 29, "k": 45}, dtype=torch.float32)
    out = m.mm(*ins, block_m=16, block_n=16, block_k=16)
    assert _max_err(out, m.reference(*[t.double() for t in ins])) < 1e-4


@pytest.mark.parametrize("a, b", [("A", "dC"), ("dC", "dC_1")])
def test_contraction_backward_parameter_avoids_inputs(a, b, tmp_path):
    """mm_backward(A, B, dC): an input called dC once made a duplicate parameter."""
    src, _ = _emit(MATMUL.format(a=a, b=b, side="", epilogue=""))
    m = _load_module(src, tmp_path, f"mmg_{a}_{b}")
    ins = m.example_inputs({"m": 37, "n": 29, "k": 45}, dtype=torch.float32)
    mine = [t.clone().requires_grad_() for t in ins]
    theirs = [t.double().requires_grad_() for t in ins]
    out, ref = m.mm(*mine, block_m=16, block_n=16, block_k=16), m.reference(*theirs)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = torch.autograd.grad(ref, theirs, g)
    for x, y in zip(torch.autograd.grad(out, mine, g.float()), want):
        assert _max_err(x, y) < 1e-4
    direct = m.mm_backward(*ins, g.float(), block_m=16, block_n=16, block_k=16)  # positionally
    for x, y in zip(direct, want):
        assert _max_err(x, y) < 1e-4


# ---- the distributed launcher ----

@pytest.mark.parametrize("example, old, new", [("ring_attention", "V", "timeout"), ("ring_attention", "K", "q_len"),
                                               ("attention_2d", "Q", "mesh"), ("ring_attention", "V", "layout")])
def test_distributed_parameters_refused_with_a_location(example, old, new):
    """NAME_distributed(Q, K, V, mesh, *, q_len, x_len, timeout): an input of
    one of those names would be a duplicate parameter; its keywords are the
    launcher's documented API, so the input is refused where it is declared."""
    text = (Path(__file__).resolve().parent.parent / "examples" / f"{example}.ncd").read_text()
    text = re.sub(rf"\b{old}\b", new, text)
    d = napkin.load_text(text, f"{example}.ncd")
    with pytest.raises(NapkinError) as err:
        emit_module(d, source_text=text, source_path=f"{example}.ncd")
    msg = str(err.value)
    assert f"parameter named {new}" in msg and "rename the input" in msg
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s.startswith(f"in {new}["))
    assert f"{example}.ncd:{line}:" in msg


def test_only_a_rings_launcher_takes_layout():
    """A ring's launcher has layout= (the caller's token layout); an
    ATTENTION2D launcher has none, so an input may be named layout there."""
    text = (Path(__file__).resolve().parent.parent / "examples" / "attention_2d.ncd").read_text()
    text = re.sub(r"\bV\b", "layout", text)
    src = emit_module(napkin.load_text(text, "a2d.ncd"), source_text=text, source_path="a2d.ncd")
    assert "def attention_2d_distributed(Q, K, layout, mesh, *, q_len, x_len=None, timeout=300.0):" in src


# ---- outputs: kernel parameters and launcher locals ----

OUTPUTS = """diagram clash

wire b, h, q, x
wire d = 16

in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32

S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5 + 1.0
P[b, h, q, x] = softmax[x](S)
{o}[b, h, q, d] : fp32 = sum[x](P * V)
{lse}[b, h, q] = logsumexp[x](S)

out {o}, {lse}
"""


@pytest.mark.parametrize("o, lse", [("block_q", "lse"), ("O", "positions"), ("out_dtype", "lengths"),
                                    ("need", "grad_dtype"), ("m", "l")])
def test_output_names_forward_and_backward(o, lse, tmp_path):
    """Outputs are kernel pointer parameters and the launcher's locals (after
    it has read its options), never the backward launchers' parameters."""
    src, _ = _emit(OUTPUTS.format(o=o, lse=lse))
    m = _load_module(src, tmp_path, f"out_{o}_{lse}")
    ins = m.example_inputs(SIZES, dtype=torch.float32)
    mine = [t.clone().requires_grad_() for t in ins]
    theirs = [t.double().requires_grad_() for t in ins]
    out, ref = m.clash(*mine, block_q=16, block_x=16), m.reference(*theirs)
    for a, b in zip(out, ref):
        assert _max_err(a, b) < 1e-4
    # with descriptors too: _tma_args reads the position arguments, not a shadowed positions=
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(m.clash(*ins, block_q=16, block_x=16, tma=True), out))
    assert m._tma_last["used"]
    gen = torch.Generator().manual_seed(1)
    g = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in ref]
    for a, b in zip(torch.autograd.grad(out, mine, [x.float() for x in g]), torch.autograd.grad(ref, theirs, g)):
        assert _max_err(a, b) < 1e-3


@pytest.mark.parametrize("o, lse, bad", [("num_warps", "lse", "num_warps"), ("O", "num_stages", "num_stages"),
                                        ("enable_fp_fusion", "lse", "enable_fp_fusion")])
def test_outputs_named_like_tritons_launch_options_are_refused(o, lse, bad):
    """kernel[grid](..., num_warps=...): an output (a kernel parameter) of that
    name would be given twice; refused at the box, with a hint."""
    text = OUTPUTS.format(o=o, lse=lse)
    with pytest.raises(NapkinError) as err:
        _emit(text)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s.startswith(f"{bad}["))
    assert f"clash.ncd:{line}:1: napkin cannot emit a kernel for output {bad}" in str(err.value)
    assert "rename the box" in str(err.value)


@pytest.mark.parametrize("bad", ["debug", "instrumentation_mode", "fpsan_homomorphic_casts", "options", "params",
                                 "backend", "specialize_impl"])
def test_a_tensor_named_like_tritons_own_launch_names_is_refused(bad):
    """A compiled launch binds these beside the kernel's parameters (the interpreter does not):
    an input called debug or options ran under TRITON_INTERPRET=1 and failed every GPU launch
    inside Triton (names2 hunt).  Refused at the tensor, as an input and as an output."""
    for text, where, kind in ((OUTPUTS.format(o="O", lse="lse").replace("K[", f"{bad}[").replace("Q * K", f"Q * {bad}"),
                               f"in {bad}[", "input"), (OUTPUTS.format(o=bad, lse="lse"), f"{bad}[", "output")):
        with pytest.raises(NapkinError) as err:
            _emit(text)
        line = next(i for i, s in enumerate(text.splitlines(), 1) if s.startswith(where))
        assert f"napkin cannot emit a kernel for {kind} {bad}: the kernel launch takes a name of Triton's own " \
               f"({bad}), and each {kind} is a kernel parameter of its own name" in str(err.value)
        assert f"clash.ncd:{line}:" in str(err.value)


def test_an_input_named_like_tritons_fusion_option_is_refused():
    """Every launch passes enable_fp_fusion=True (launch.FP_FUSION); an input is
    a kernel parameter of its own name, so one named so would be given twice."""
    text = OUTPUTS.format(o="O", lse="lse").replace("K[", "enable_fp_fusion[").replace("Q * K", "Q * enable_fp_fusion")
    with pytest.raises(NapkinError) as err:
        _emit(text)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s.startswith("in enable_fp_fusion["))
    assert f"clash.ncd:{line}:4: napkin cannot emit a kernel for input enable_fp_fusion" in str(err.value)
    assert "rename the input" in str(err.value)


# Names napkin derives by joining a tensor's name and a wire's with "_": names hold "_"
# too, so Q along h_q and Q_h along q were both _st_Q_h_q (a duplicate argument: an
# internal error), and side inputs m and acc_m both _part_acc_m (m's running sum, acc_m's
# partial-gradient pointer: the backward died in tl.store).
JOINED = {
    "strides": """diagram joined
wire b, h_q, q, x
wire d = 16
in Q[b, h_q, q, d] : fp32
in K[b, h_q, x, d] : fp32
in V[b, h_q, x, d] : fp32
in Q_h[b, q] : fp32
S[b, h_q, q, x] = sum[d](Q * K) * |d|^-0.5 + Q_h
O[b, h_q, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O
""",
    "partial sums": """diagram joined
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in m[h] : fp32
in acc_m[h] : fp32
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5 + m * (x - q) + acc_m * (q - x) * 0.5
O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O
"""}


# a side input named like the stride of another's partial-sum buffer: its load _st__part_m_b was that stride
JOINED["a stride's name"] = JOINED["partial sums"].replace("in acc_m[h] : fp32", "in st__part_m_b[q, x] : fp32") \
    .replace("acc_m * (q - x) * 0.5", "st__part_m_b")
for _operand in ("scaled", "operand"):   # an operand's gradient buffer _grad_<name> met the helper _grad_<name>
    JOINED[f"operand {_operand}"] = JOINED["strides"].replace("Q_h", "B").replace(" V", f" {_operand}")


@pytest.mark.parametrize("case", sorted(JOINED))
def test_names_joined_from_names_with_underscores_stay_apart(case, tmp_path):
    src, _ = _emit(JOINED[case])
    m = _load_module(src, tmp_path, f"joined_{case.replace(' ', '_')}")
    ins = m.example_inputs({"b": 1, "h": 2, "h_q": 2, "q": 37, "x": 29}, dtype=torch.float32, seed=2)
    mine = [t.clone().requires_grad_() for t in ins]
    theirs = [t.double().requires_grad_() for t in ins]
    out, ref = m.joined(*mine, block_q=16, block_x=16), m.reference(*theirs)
    assert _max_err(out, ref) < 1e-4
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(out, mine, g.float()), torch.autograd.grad(ref, theirs, g))):
        assert _max_err(a, b) < 1e-3 * max(1.0, float(b.abs().max())), (case, i)


def test_derived_names_never_meet_a_helper_or_each_other():
    """kernel_names.part keeps joined names apart; no tensor name makes a jit helper's name
    (an input called scaled made _grad_scaled, the helper's name, before the helpers were renamed)."""
    from napkin.codegen.kernel_names import KERNEL_HELPERS, part, stride

    assert stride("Q", "h_q") != stride("Q_h", "q") and f"_part_{part('acc_m')}" != f"_part_acc_{part('m')}"
    for helper in KERNEL_HELPERS:
        for base in ("grad", "acc", "out", "saved", "NEED", "part", "part_acc", "part_pg", "tma"):
            assert not helper.startswith(f"_{base}_"), helper


# napkin's own tensors in the backward's kernels (their loads are kept apart by _Loads; an input
# may not take these names, training.py refuses it), O among them: the rows kernel reads the
# output as O whatever the diagram calls it (examples/differential_attention.ncd's A)
BACKWARD_TENSORS = {"O", "dO", "dP", "dR", "dS", "delta", "dlse", "lse", "lse2", "A0", "Aw", "N0", "Z0", "gN0", "dZ0", "P",
                    "dT0", "lseg", "lseg2"}


@pytest.mark.parametrize("path", sorted(p for p in (REPO / "generated").glob("*.py")
                                         if (REPO / "examples" / f"{p.stem}.ncd").exists()), ids=lambda p: p.stem)
def test_every_kernel_variable_is_reserved_or_the_users(path):
    """Every name a bundled module's @triton.jit function takes or assigns is either in
    internal_names (so a user's tensor of that name loads under another) or made from a
    tensor's name.  _c0, _k0, _CHUNK, _part and _WIDE were neither: a side input called c0
    took the chunk's start as its slope (names2 hunt)."""
    d = napkin.load(REPO / "examples" / f"{path.stem}.ncd")
    reserved = internal_names(d)
    made = {t.name for t in d.inputs + d.lets} | {w.name for w in d.wires} | BACKWARD_TENSORS

    def users(name: str) -> bool:
        base = re.sub(r"^_(st_|tma_|out_|part_|saved_|grad_|_)*", "", name)
        return any(re.fullmatch(rf"{re.escape(m)}(_\w+|\d+)?", base) for m in made)

    stray = set()
    for fn in ast.parse(path.read_text()).body:
        if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(x) for x in fn.decorator_list):
            names = {a.arg for a in fn.args.args} | {n.id for n in ast.walk(fn)
                                                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            stray |= {f"{fn.name}: {n}" for n in names if n.startswith("_") and n not in reserved and not users(n)}
    assert not stray, sorted(stray)


@pytest.mark.parametrize("name", ["c0", "part", "CHUNK"])
def test_a_side_input_named_like_the_chunks_state_runs_chunked(name, tmp_path):
    """A slope called c0 was loaded into _c0, then overwritten by the chunk's start: error 2.58
    with chunk=16; called part or CHUNK, every chunked (or every) launch failed (names2 hunt)."""
    src, _ = _emit(_text(INPUT, name, False))
    m = _load_module(src, tmp_path, f"chunk_{name}")
    ins = m.example_inputs({"b": 1, "h": 2, "q": 7, "x": 45}, dtype=torch.float32)
    ref = m.reference(*[t.double() for t in ins])
    for chunk in (None, 16):
        assert _max_err(m.clash(*ins, block_q=16, block_x=16, chunk=chunk), ref) < 1e-5, chunk


@pytest.mark.parametrize("lse", ["block_x", "lse"])
def test_an_output_named_like_a_block_option_leaves_the_callers_options_alone(lse, tmp_path):
    """The launcher allocates the outputs as locals of their own names; it read block_x after
    that, so an output named block_x made a chunk refusal say the caller gave block_x (the
    schedule's, names2 hunt).  The message names the schedule's block either way."""
    src, _ = _emit(OUTPUTS.format(o="O", lse=lse))
    m = _load_module(src, tmp_path, f"opt_{lse}")
    ins = m.example_inputs({"b": 1, "h": 1, "q": 16, "x": 64}, dtype=torch.float32)
    with pytest.raises(ValueError) as err:
        m.clash(*ins, block_q=16, chunk=8)
    assert str(err.value) == "chunk=8 is shorter than the schedule's block_x=64: a chunk is whole blocks"
    with pytest.raises(ValueError) as err:
        m.clash(*ins, block_q=16, block_x=16, chunk=8)
    assert str(err.value) == "chunk=8 is shorter than block_x=16: a chunk is whole blocks"

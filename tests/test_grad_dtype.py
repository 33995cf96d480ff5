"""Gradients in the input dtype (templates/training.py.jinja, grad_dtype=).

The autograd op asks the backward for grad_dtype="input": each gradient one
program writes once (dQ, dK, dV; a matrix product's dA, dB) is allocated in
its input's dtype and the kernel's store rounds its float32 accumulator
into it.  NAME_backward's default stays float32 (the distributed wrappers add
its results up).  The kernels accumulate the same way in both, so the
autograd gradient must equal, bit for bit, the public float32 result rounded
by torch's .to (round to nearest even) - on ragged sizes that cross several
16-row blocks.  A spy on the kernel launches checks the dtype of the buffers
the kernels really store into, and the op's fake implementation (what
torch.compile traces) must give the real op's dtypes and shapes.
"""
from __future__ import annotations

import pytest
import torch

from backward_helpers import example

BLOCKS = {"block_q": 16, "block_x": 16, "block_m": 16, "block_n": 16, "block_k": 16}
SIZES = {
    "causal": {"b": 2, "h": 2, "q": 37, "x": 53},
    "gqa": {"b": 1, "hk": 2, "g": 2, "q": 37, "x": 29},
    "alibi": {"b": 1, "h": 2, "q": 45, "x": 33},     # a side input: slope's partial sums stay float32
    "matmul": {"m": 37, "n": 29, "k": 45},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("grad_dtype")


def options(m) -> dict:
    return {o: BLOCKS[o] for o in m._OPTIONS if o in BLOCKS}


def setup(name, folder, dtype, seed=3):
    """The module, random inputs and a random gradient of the first output."""
    m = example(name, folder)
    inputs = m.example_inputs(SIZES[name], dtype=dtype, seed=seed)
    out = getattr(m, name)(*inputs, **options(m))
    first = out[0] if isinstance(out, tuple) else out
    upstream = torch.randn(first.shape, generator=torch.Generator().manual_seed(seed + 1)).to(first.dtype)
    return m, inputs, upstream


def autograd_grads(m, name, inputs, upstream):
    """The op's gradients (the only output weighted is the first: dlse is zero)."""
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = getattr(m, name)(*xs, **options(m))
    torch.autograd.backward(out[0] if isinstance(out, tuple) else out, upstream)
    return [x.grad for x in xs]


def public_grads(m, name, inputs, upstream, **kw):
    """NAME_backward called directly, as the distributed wrappers do."""
    opts = options(m)
    if name == "matmul":
        return list(m.matmul_backward(*inputs, upstream, **opts, **kw))
    outs, saved = getattr(m, f"_{name}_forward")(*inputs, *(opts.get(o) for o in m._OPTIONS), True)
    lse = outs[list(m.OUTPUTS).index("lse")] if "lse" in m.OUTPUTS else saved[0]
    (delta,) = getattr(m, f"{name}_preprocess")(*inputs, upstream, outs[0], block_q=opts["block_q"])
    return list(getattr(m, f"{name}_backward")(*inputs, upstream, lse, delta, **opts, **kw))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", ["causal", "gqa", "matmul", "alibi"])
def test_autograd_gradients_are_the_float32_ones_rounded(name, dtype, folder):
    m, inputs, upstream = setup(name, folder, dtype)
    got = autograd_grads(m, name, inputs, upstream)
    wide = public_grads(m, name, inputs, upstream)
    assert all(g.dtype == torch.float32 for g in wide)               # the public default is unchanged
    assert public_grads(m, name, inputs, upstream, grad_dtype="float32")[0].dtype == torch.float32
    for i, (g, w, t) in enumerate(zip(got, wide, inputs)):
        assert g.dtype == t.dtype and g.shape == t.shape, (name, i)
        assert torch.equal(g, w.to(t.dtype)), f"{name}: gradient {i} is not the float32 one rounded"
    narrow = public_grads(m, name, inputs, upstream, grad_dtype="input")
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(narrow, got))


class LaunchSpy:
    """Stands in for a backward kernel in its module: records, by kernel
    parameter name, the dtype of every tensor a launch passes, then launches."""

    def __init__(self, kernel, seen: dict):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            named = {**dict(zip(self.kernel.arg_names, args)), **kwargs}
            self.seen.update({n: t.dtype for n, t in named.items() if isinstance(t, torch.Tensor)})
            return launch(*args, **kwargs)
        return run


def spied_launches(m, monkeypatch) -> dict:
    seen = {}
    kernels = [n for n in vars(m) if "_bwd_" in n and n.endswith("_kernel") and not n.endswith("_rows_kernel")]
    assert kernels
    for n in kernels:
        monkeypatch.setattr(m, n, LaunchSpy(getattr(m, n), seen))
    return seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name,stored", [("causal", "QKV"), ("gqa", "QKV"), ("matmul", "AB"), ("alibi", "QKV")])
def test_kernels_store_into_buffers_of_the_asked_dtype(name, stored, dtype, folder, monkeypatch):
    m, inputs, upstream = setup(name, folder, dtype)
    dtypes = {n: t.dtype for n, t in zip(m.INPUTS, inputs)}
    seen = spied_launches(m, monkeypatch)
    autograd_grads(m, name, inputs, upstream)
    grads = {n: d for n, d in seen.items() if n.startswith("_grad_") and n[len("_grad_"):] in dtypes}
    assert sorted(grads) == sorted(f"_grad_{c}" for c in stored)
    assert grads == {n: dtypes[n[len("_grad_"):]] for n in grads}, "autograd: not the inputs' dtypes"
    assert all(d == torch.float32 for n, d in seen.items() if n.startswith("_part_"))   # partial sums
    seen.clear()
    public_grads(m, name, inputs, upstream)
    stores = {n: d for n, d in seen.items() if n in grads or n.startswith("_part_")}
    assert stores and set(stores.values()) == {torch.float32}, "NAME_backward's default: float32"


def test_grad_dtype_refuses_other_values(folder):
    for name in ("causal", "matmul"):
        m, inputs, upstream = setup(name, folder, torch.float16)
        with pytest.raises(ValueError, match="grad_dtype"):
            public_grads(m, name, inputs, upstream, grad_dtype=torch.float16)


@pytest.mark.parametrize("name", ["causal", "alibi", "matmul"])
def test_fake_backward_gives_the_real_dtypes(name, folder):
    """torch.compile traces the backward op through its fake implementation:
    it must describe what the real op returns, now that the kernels write
    the gradients in the inputs' dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    m, inputs, upstream = setup(name, folder, torch.float16)
    opts = options(m)
    outs, saved = getattr(m, f"_{name}_forward")(*inputs, *(opts.get(o) for o in m._OPTIONS), True)
    grads = [upstream] + [torch.zeros_like(o) for o in outs[1:]]
    need = sum(1 << i for i, t in enumerate(inputs) if t.is_floating_point())
    args = (*inputs, *outs, *saved, *grads, *(opts.get(o) for o in m._OPTIONS), need)
    op = getattr(torch.ops.napkin, m._BWD_OP)
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert [(t.dtype, t.shape) for t in fake] == [(t.dtype, t.shape) for t in real]
    assert [t.dtype for t in real] == [t.dtype for t in inputs if t.is_floating_point()]


@pytest.mark.parametrize("declared", ["", " : fp32"])
def test_an_lse_output_beside_fp32_inputs_called_in_fp16_is_no_16_bit_saved_state(folder, declared):
    """A diagram of fp32 inputs that outputs lse, called with fp16 tensors (autocast, .half()):
    its lse followed the inputs to fp16, and training rebuilt every P = exp(S - lse) from that
    lse: Q, K, V gradients 6.3e-3 off (relative to the largest) against 3.9e-4 with float32
    row state (layouts hunt).  An undeclared lse is the accumulator's fp32 at every call now
    (language.md); a declared fp32 one follows the inputs as declared outputs do, and training
    keeps its own float32 lse beside it."""
    from backward_helpers import compile_text

    text = ("diagram att32\nwire b, h, q, x\nwire d = 16\nin Q[b, h, q, d] : fp32\nin K[b, h, x, d] : fp32\n"
            "in V[b, h, x, d] : fp32\nS[b, h, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)\n"
            "O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)\n"
            f"lse[b, h, q]{declared} = logsumexp[x](S)\nout O, lse\n")
    m = compile_text(text, f"att32_{bool(declared)}", folder)
    g = torch.Generator().manual_seed(1)
    n = 100
    q, k, v = ((torch.randn(1, 2, n, 16, generator=g) * 2).half() for _ in range(3))
    weight = torch.randn(1, 2, n, 16, generator=g)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    keep = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    s = (exact[0] @ exact[1].transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf"))
    (torch.softmax(s, -1) @ exact[2] * weight.double()).sum().backward()
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = m.att32(*ours, block_q=16, block_x=16)
    assert out.dtype == torch.float16 and lse.dtype == (torch.float16 if declared else torch.float32)
    (out.float() * weight).sum().backward()
    for a, b in zip(ours, exact):
        assert (a.grad.double() - b.grad).abs().max() / b.grad.abs().max() < 1.5e-3


def test_a_weighted_sum_along_no_feature_wire_follows_the_inputs_as_o_does(folder):
    """O[b, h, q] = sum[x](softmax[x](S) * v) has no feature wire but is no row statistic: an fp32
    diagram called with fp16 tensors returns it in fp16, as O[b, h, q, d]; the first rule for
    row state kept it fp32 (today5 hunt).  lse and a row max stay float32."""
    from backward_helpers import compile_text

    text = ("diagram vecv\nwire b, h, q, x\nwire d = 16\nin Q[b, h, q, d] : fp32\nin K[b, h, x, d] : fp32\n"
            "in v[b, h, x] : fp32\nS[b, h, q, x] = sum[d](Q * K) * |d|^-0.5\nO[b, h, q] = sum[x](softmax[x](S) * v)\n"
            "lse[b, h, q] = logsumexp[x](S)\nm[b, h, q] = max[x](S)\nout O, lse, m\n")
    m = compile_text(text, "vecv", folder)
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 2, 20, 16, generator=g).half() for _ in range(2))
    v = torch.randn(1, 2, 20, generator=g).half()
    out, lse, top = m.vecv(q, k, v, block_q=16, block_x=16)
    assert (out.dtype, lse.dtype, top.dtype) == (torch.float16, torch.float32, torch.float32)
    s = q.double() @ k.double().transpose(-1, -2) / 4
    assert (out.double() - (torch.softmax(s, -1) @ v.double()[..., None])[..., 0]).abs().max() < 2e-3
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() < 1e-4

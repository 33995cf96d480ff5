"""Training with a generated attention: a tiny transformer block, torch.compile,
autocast and activation checkpointing (kernels under TRITON_INTERPRET=1).

The block's attention is the causal example at head dim 16, called as the
generated module's ``causal(Q, K, V)``: its torch op runs the forward kernel
and registers the backward kernels with autograd.  The same block with
torch's scaled_dot_product_attention is the yardstick.
"""
from __future__ import annotations

from pathlib import Path

import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backward_helpers import compile_text, gradients

REPO = Path(__file__).resolve().parent.parent
BLOCKS = {"block_q": 16, "block_x": 16}


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    text = (REPO / "examples" / "causal.ncd").read_text().replace("wire d = 64", "wire d = 16")
    return compile_text(text, "causal16", tmp_path_factory.mktemp("training"))


def generated_attention(m):
    return lambda q, k, v: m.causal(q, k, v, **BLOCKS)[0]


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    """Embedding, one pre-norm transformer block (2 heads of 16), a vocabulary head."""

    def __init__(self, attention, vocab=50, dim=32, heads=2):
        super().__init__()
        self.attention, self.heads = attention, heads
        self.embed = nn.Embedding(vocab, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        o = self.attention(q, k, v)                      # (b, heads, n, 16); q, k, v are strided views
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, dim))
        return self.head(x + self.mlp(self.norm2(x)))


def train(attention, steps=6, seed=0):
    torch.manual_seed(seed)
    model = Block(attention)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randint(0, 50, (2, 41), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 50), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tiny_block_follows_the_sdpa_loss_curve(causal):
    ours, theirs = train(generated_attention(causal)), train(sdpa)
    assert ours[-1] < ours[0] - 0.3                          # it learns
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4, (ours, theirs)


def test_torch_compile_sees_one_op_and_no_graph_break(causal):
    attention = generated_attention(causal)

    def step(q, k, v):
        return (attention(q, k, v) * torch.linspace(-1, 1, 16)).sum()

    q, k, v = causal.example_inputs({"b": 1, "h": 2, "q": 40, "x": 40}, dtype=torch.float32)
    explain = torch._dynamo.explain(step)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = gradients(compiled, (q, k, v))
    want = gradients(step, (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


def test_autocast_runs_the_kernels_in_the_autocast_dtype(causal):
    torch.manual_seed(0)
    model = Block(generated_attention(causal))
    tokens = torch.randint(0, 50, (2, 33), generator=torch.Generator().manual_seed(2))
    seen = []
    model.attention = lambda q, k, v: seen.append(q.dtype) or generated_attention(causal)(q, k, v)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    assert seen == [torch.float16]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    full = Block(sdpa)
    full.load_state_dict(model.state_dict())
    reference = full(tokens).float().logsumexp(-1).mean()
    assert abs(loss.item() - reference.item()) < 2e-2


def test_activation_checkpointing_gives_the_same_gradients(causal):
    from torch.utils.checkpoint import checkpoint

    attention = generated_attention(causal)
    inputs = causal.example_inputs({"b": 1, "h": 2, "q": 37, "x": 37}, dtype=torch.float32)
    plain = gradients(attention, inputs)
    checkpointed = gradients(lambda q, k, v: checkpoint(attention, q, k, v, use_reentrant=False), inputs)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def test_fake_gradients_are_laid_out_as_the_real_ones(causal):
    """Inductor checks an op's real output strides against its fake's.  With
    Q, K, V slices of one packed projection (Block's layout) the backward's
    fake kept each input's strides while the kernels write contiguous
    gradients: inductor's compiled backward failed on an assertion."""
    qkv = torch.randn(1, 21, 3, 2, 16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    with torch.no_grad():
        o, lse = causal.causal(q, k, v, **BLOCKS)
    bwd = getattr(torch.ops.napkin, causal._BWD_OP).default
    args = (q, k, v, o, lse, torch.randn_like(o), torch.randn_like(lse), 16, 16, None, None, None, 0b111)
    torch.library.opcheck(bwd, args, test_utils="test_faketensor")
    assert all(g.is_contiguous() for g in bwd(*args))


def test_compiled_inference_takes_chunk_and_out_dtype(causal):
    """Under torch.compile a call that wants no gradient may take the
    forward-only options (a decode step's chunk=); they were refused, since the
    training op's schema has no place for them."""
    q, k, v = causal.example_inputs({"b": 1, "h": 2, "q": 37, "x": 37}, dtype=torch.float16)

    def step(q, k, v):
        return causal.causal(q, k, v, chunk=16, out_dtype=torch.float32, **BLOCKS)

    eager = step(q, k, v)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    assert [t.dtype for t in got] == [torch.float32, torch.float32]
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    with torch.no_grad():                               # no_grad: the same op, whatever requires_grad says
        assert all(torch.equal(a, b) for a, b in zip(compiled(q.requires_grad_(), k, v), eager))


def test_meta_tensors_give_meta_outputs(causal):
    q, k, v = (torch.empty(1, 2, 21, 16, device="meta") for _ in range(3))
    o, lse = causal.causal(q.requires_grad_(), k, v)
    assert o.device.type == "meta" and o.shape == (1, 2, 21, 16) and lse.shape == (1, 2, 21)


def test_meta_tensors_give_meta_outputs_without_a_gradient_too(causal):
    """Only a call wanting a gradient went through the torch op (whose fake answers meta): a plain
    call, one under no_grad or with out_dtype= launched Triton on tensors without data ("Cannot copy
    out of meta tensor").  The backward launchers, which have no fake, refuse meta in words."""
    q, k, v = (torch.empty(1, 2, 21, 16, device="meta", dtype=torch.float16) for _ in range(3))
    for call in (lambda: causal.causal(q, k, v), lambda: causal.causal(q, k, v, out_dtype=torch.float32)):
        o, lse = call()
        assert o.device.type == "meta" and o.shape == (1, 2, 21, 16) and lse.shape == (1, 2, 21)
    assert causal.causal(q, k, v, out_dtype=torch.float32)[0].dtype == torch.float32
    with torch.no_grad():
        assert causal.causal(q, k, v)[0].device.type == "meta"
    with pytest.raises(ValueError, match="Q is on the meta device, which has no data for a kernel to read"):
        causal.causal_preprocess(q, k, v, torch.empty_like(q), torch.empty(1, 2, 21, device="meta"))


# (options, the launch's words, whether a call wanting a gradient takes them: chunk= and out_dtype= make a
# forward-only call)
META_OPTIONS = [
    ({"block_q": 3}, "block_q must be a power of two from 16 to 65536, not 3", True),
    ({"num_warps": 3}, "num_warps must be a power of two from 1 to 32, not 3", True),
    ({"chunk": 17}, "chunk must be None, 0 or a power of two, not 17", False),
    ({"chunk": 8, "block_x": 16}, "chunk=8 is shorter than block_x=16: a chunk is whole blocks", False),
    ({"out_dtype": "float32"}, "out_dtype must be one of torch.float16, torch.bfloat16, torch.float32, not 'float32'",
     False),
]


@pytest.mark.parametrize("options, words, grad", [(o, w, g) for o, w, trains in META_OPTIONS
                                                  for g in ((False, True) if trains else (False,))])
def test_meta_and_traced_calls_refuse_the_options_a_launch_refuses(causal, options, words, grad):
    """The op's fakes only bound and allocated: a model traced on meta tensors (or by torch.compile)
    took block_q=3 or chunk=17 and failed only when run; out_dtype="float32" met torch's schema error."""
    q, k, v = (torch.empty(1, 2, 21, 16, device="meta", dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match=re.escape(words)):
        causal.causal(q.requires_grad_(grad), k, v, **options)
    o, _ = causal.causal(q, k, v, block_q=16, block_x=16, num_warps=2)   # what a launch takes passes
    assert o.device.type == "meta"


def test_a_callers_blocks_or_chunk_set_a_cached_configs_blocks_aside(causal, monkeypatch, tmp_path):
    """A cached config's blocks and chunk were tuned together, and each option the caller left None
    took the cache's alone: a cached block_x=128 beside chunk=64 failed ("chunk=64 is shorter than
    block_x=128"), a cached block_q=65536 beside block_x=32 made a tile past 2^20, errors naming an
    option the caller never gave.  Now a caller's block or chunk takes the schedule's other blocks
    (the cache's warps still fill), and the fakes refuse what the launch refuses."""
    from napkin import tunecache

    sizes = {"b": 1, "h": 1, "q": 37, "x": 200}
    q, k, v = causal.example_inputs(sizes, dtype=torch.float32)
    key = tunecache.cache_key(causal.SOURCE_HASH, "cpu", {"fp16": "float32"}, sizes, causal._AUTOTUNE_WIRES)
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    want = causal.reference(q.double(), k.double(), v.double())[0]
    for cached, given in (({"block_q": 16, "block_x": 128, "num_warps": 2}, {"chunk": 64}),
                          ({"block_q": 65536, "block_x": 16, "num_warps": 2}, {"block_x": 32})):
        (tmp_path / "autotune.json").write_text(json.dumps(
            {"schema": tunecache.SCHEMA, "entries": {key: {"config": cached}}}))
        options = {"block_q": None, "block_x": None, "num_warps": None, "num_stages": None, "chunk": None, **given}
        filled = causal._autotune_fill(options, sizes, torch.device("cpu"), {"fp16": torch.float32})
        assert filled == {**options, "num_warps": 2}, filled
        got = causal.causal(q, k, v, **given)[0]
        assert (got.double() - want).abs().max() < 1e-4
        meta = [t.to("meta") for t in (q, k, v)]
        assert causal.causal(*meta, **given)[0].device.type == "meta"
    # the schedule's block_x (the fakes took an unknown block as 16), named as the schedule's: the
    # message read as if the caller had given block_x=64
    with pytest.raises(ValueError, match=re.escape("chunk=16 is shorter than the schedule's block_x=64")):
        causal.causal(*meta, chunk=16)
    with pytest.raises(ValueError, match=re.escape("chunk=16 is shorter than the schedule's block_x=64")):
        causal.causal(q, k, v, chunk=16)
    with pytest.raises(ValueError, match=re.escape("the schedule's block_q=128 and block_x=16384 make a tile")):
        causal.causal(*meta, block_x=16384)
    with pytest.raises(ValueError, match=re.escape("the schedule's block_q=128 and block_x=16384 make a tile")):
        causal.causal(q, k, v, block_x=16384)
    assert causal._autotune_fill({"block_q": None, "num_warps": None}, sizes, torch.device("cpu"),
                                 {"fp16": torch.float32}) == {"block_q": 65536, "num_warps": 2}   # none given: the config whole


def test_the_fakes_refuse_a_grid_the_launch_refuses(causal):
    """65536 one-row heads passed the op's fakes (meta tensors, torch.compile's trace) and failed
    only when run: the fakes check the launch grid's batch axis, and its chunks where chunk= is
    given (today2 hunt)."""
    words = "this call needs 65536 programs along axis 1"
    meta = [torch.empty(1, 65536, n, 16, device="meta") for n in (1, 1, 1)]
    with pytest.raises(ValueError, match=words):
        causal.causal(*meta)
    with pytest.raises(ValueError, match=words):
        causal.causal(*meta, chunk=64)
    real = [torch.randn(1, 65536, 1, 16) for _ in range(3)]
    with pytest.raises(ValueError, match=words):
        causal.causal(*real)
    keys = [torch.empty(1, 1, 64 * 65537, 16, device="meta") for _ in range(2)]
    with pytest.raises(ValueError, match="this call needs 65537 programs along axis 2"):
        causal.causal(torch.empty(1, 1, 1, 16, device="meta"), *keys, chunk=64)
    assert causal.causal(torch.empty(1, 1, 1, 16, device="meta"), *keys)[0].shape == (1, 1, 1, 16)


def test_numpy_and_tensor_options_trace_under_torch_compile(causal):
    """Whole-number options of numpy types (np.int64 and np.int32 together) or a 0-d tensor ran
    eagerly but failed under torch.compile (a TypeError in _whole's hasattr(type(v), "__index__"),
    "Unsupported hasattr call" with fullgraph): _whole takes operator.index now.  (Two numpy types
    under fullgraph=True still fail: dynamo makes the second a data-dependent SymInt.)"""
    np = pytest.importorskip("numpy")
    q, k, v = causal.example_inputs({"b": 1, "h": 1, "q": 37, "x": 29}, dtype=torch.float32)
    for options, whole in (({"block_q": np.int64(16), "block_x": np.int32(16)}, False),
                           ({"block_q": np.int64(16), "block_x": 16}, True),
                           ({"block_q": torch.tensor(16), "block_x": 16}, True)):
        want = causal.causal(q, k, v, **options)
        torch._dynamo.reset()
        got = torch.compile(lambda a, b, c: causal.causal(a, b, c, **options), backend="eager", fullgraph=whole)(q, k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), options


def test_second_derivatives_are_refused_in_words(causal):
    q, k, v = causal.example_inputs({"b": 1, "h": 2, "q": 20, "x": 20}, dtype=torch.float32)
    o, _ = causal.causal(q.requires_grad_(), k, v, **BLOCKS)
    (g,) = torch.autograd.grad((o * o).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="napkin emits no second derivative: diagram causal's backward"):
        g.sum().backward()


def test_an_eager_backward_runs_the_ops_body_directly_and_a_graph_building_one_the_op(causal, monkeypatch):
    """Eager without create_graph, autograd's backward calls the backward op's
    body itself, skipping custom_op's Python dispatch (host time a short
    backward's kernels wait for); with create_graph it goes through the op,
    whose own backward refuses a second derivative.  The op keeps the body it
    was made with, so a stand-in body counts the direct calls alone; both
    paths give the same gradients."""
    body, direct = causal._causal_bwd_impl, []
    monkeypatch.setattr(causal, "_causal_bwd_impl", lambda *a: direct.append(1) or body(*a))
    q, k, v = causal.example_inputs({"b": 1, "h": 2, "q": 23, "x": 23}, dtype=torch.float32)
    o, _ = causal.causal(q.requires_grad_(), k.requires_grad_(), v, **BLOCKS)
    up = torch.randn_like(o)
    eager = torch.autograd.grad(o, (q, k), up, retain_graph=True)
    assert direct == [1]
    through_op = torch.autograd.grad(o, (q, k), up, retain_graph=True, create_graph=True)
    assert direct == [1]
    assert all(torch.equal(a, b) for a, b in zip(eager, through_op))


def test_fake_tensors_and_make_fx_take_the_ops_fake_without_a_gradient_too(causal):
    """FakeTensorMode and make_fx on inputs wanting no gradient launched Triton on tensors without data
    ("Attempted to set the storage of a tensor on device meta", "Cannot access data pointer")."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        q = torch.empty(1, 2, 21, 16)
        o, lse = causal.causal(q, q, q)
        assert o.shape == (1, 2, 21, 16) and lse.shape == (1, 2, 21)
    q, k, v = causal.example_inputs({"b": 1, "h": 2, "q": 21, "x": 21}, dtype=torch.float32)
    graph = make_fx(lambda a, b, c: causal.causal(a, b, c)[0], tracing_mode="fake")(q, k, v)
    assert any("napkin" in str(n.target) for n in graph.graph.nodes)


def test_forward_mode_tangents_are_refused_not_dropped(causal):
    """A dual input with no gradient wanted ran the kernel on its primal: the tangent came back None."""
    import torch.autograd.forward_ad as fwad

    q, k, v = causal.example_inputs({"b": 1, "h": 2, "q": 21, "x": 21}, dtype=torch.float32)
    with fwad.dual_level():
        with pytest.raises(NotImplementedError, match="input Q carries a forward-mode tangent"):
            causal.causal(fwad.make_dual(q, torch.ones_like(q)), k, v, **BLOCKS)
    o, _ = causal.causal(q, k, v, **BLOCKS)   # no dual level: the plain call
    assert o.shape == q.shape


def test_block_options_past_tritons_largest_tile_are_refused_in_words(causal):
    """block_q=2^21 failed inside Triton (numel exceeds its maximum), 2^31 as an int32 overflow; a
    numpy integer was refused as 'not np.int64(16)'."""
    import numpy as np

    q, k, v = causal.example_inputs({"b": 1, "h": 1, "q": 20, "x": 20}, dtype=torch.float32)
    with pytest.raises(ValueError, match="block_q must be a power of two from 16 to 65536, not 2097152"):
        causal.causal(q, k, v, block_q=1 << 21, block_x=16)
    with pytest.raises(ValueError, match=r"block_q=65536 and block_x=32 make a tile of 2097152 elements"):
        causal.causal(q, k, v, block_q=1 << 16, block_x=32)
    o, _ = causal.causal(q, k, v, block_q=np.int64(16), block_x=16)
    assert torch.allclose(o.double(), causal.reference(q.double(), k.double(), v.double())[0], atol=1e-5)


@pytest.fixture(scope="module")
def causal_any_d(tmp_path_factory):
    """The causal example with its head dim symbolic: d's block is its size padded at the launch."""
    text = (REPO / "examples" / "causal.ncd").read_text().replace("wire d = 64", "wire d")
    return compile_text(text, "causal_any_d", tmp_path_factory.mktemp("training"))


def test_a_block_beside_the_padded_head_dim_past_2_20_is_refused_in_words(causal_any_d):
    """block_q=32, block_x=32768 make a 2^20 score tile, which the test of two blocks let pass, and
    a [32768, 64] tile of K: every launch failed in Triton's interpreter ("numel (2097152) exceeds
    triton maximum tensor numel (1048576)"), eager and traced alike.  Refused in words now, by
    the launch and by the op's fakes (meta tensors, torch.compile), the head dim's padding named."""
    q, k, v = causal_any_d.example_inputs({"b": 1, "h": 1, "q": 20, "x": 20, "d": 40}, dtype=torch.float32)
    words = re.escape("block_x=32768 and wire d, its size 40 padded to 64, which the kernels hold whole beside "
                      "each block, make a tile of 2097152 elements, past Triton's largest tensor (2^20)")
    options = {"block_q": 32, "block_x": 32768}
    for grad in (False, True):
        with pytest.raises(ValueError, match=words):
            causal_any_d.causal(q.clone().requires_grad_(grad), k, v, **options)
        with pytest.raises(ValueError, match=words):
            causal_any_d.causal(q.to("meta").requires_grad_(grad), k.to("meta"), v.to("meta"), **options)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=words):
        torch.compile(lambda a, b, c: causal_any_d.causal(a, b, c, **options), backend="eager")(q, k, v)
    # a block of rows too ([32768, 64] tiles of Q and O); at d = 16 the same blocks fit
    with pytest.raises(ValueError, match=re.escape("block_q=32768 and wire d, its size 40 padded to 64")):
        causal_any_d.causal(q, k, v, block_q=32768, block_x=16)
    small = causal_any_d.example_inputs({"b": 1, "h": 1, "q": 20, "x": 20, "d": 16}, dtype=torch.float32)
    assert causal_any_d.causal(*(t.to("meta") for t in small), **options)[0].shape == (1, 1, 20, 16)


def test_a_fixed_head_dim_is_named_as_its_own_width(tmp_path):
    module = compile_text((REPO / "examples" / "causal.ncd").read_text(), "causal64", tmp_path)
    meta = [torch.empty(1, 1, 20, 64, device="meta") for _ in range(3)]
    with pytest.raises(ValueError, match=re.escape("block_q=65536 and wire d, 64 wide, which the kernels hold whole")):
        module.causal(*meta, block_q=65536, block_x=16)


@pytest.mark.parametrize("kind", ["", "bwd", "bwd_kv"])
def test_a_cached_config_whose_block_and_head_dim_pass_2_20_is_ignored(causal_any_d, monkeypatch, tmp_path, kind):
    """A cached block_q=16 beside block_x=65536 (16 * 65536 = 2^20: it "fit") crashed every call
    that took it on its [65536, 64] K tile, and a backward entry so the backward (Triton's
    InterpreterError).  The lookup knows the sizes, so it holds each block beside the padded head dim
    to 2^20 too: the entry is ignored, the schedule's blocks run and the numbers are right."""
    from napkin import tunecache

    sizes = {"b": 1, "h": 2, "q": 24, "x": 24, "d": 40}
    q, k, v = causal_any_d.example_inputs(sizes, dtype=torch.float32)
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    key = tunecache.cache_key(causal_any_d.SOURCE_HASH, "cpu", {"fp16": "float32"}, sizes,
                              causal_any_d._AUTOTUNE_WIRES, kind)
    cached = {"block_q": 16, "block_x": 65536} if kind != "bwd" else {"block_q": 65536, "block_x": 16}
    (tmp_path / "autotune.json").write_text(json.dumps(
        {"schema": tunecache.SCHEMA, "entries": {key: {"config": {**cached, "num_warps": 2}}}}))
    options = {"block_q": None, "block_x": None, "num_warps": None}
    assert causal_any_d._autotune_fill(options, sizes, torch.device("cpu"), {"fp16": torch.float32}, kind) == options
    want = causal_any_d.reference(q.double(), k.double(), v.double())
    got = causal_any_d.causal(q, k, v)
    assert all((a.double() - b).abs().max() < 1e-4 for a, b in zip(got, want))
    if kind:
        got = gradients(causal_any_d.causal, (q, k, v))
        ref = gradients(causal_any_d.reference, (q.double(), k.double(), v.double()))
        assert all((a.double() - b).abs().max() < 1e-3 for a, b in zip(got, ref))
    # at head dim 16 the same entry fits: it is taken
    small = dict(sizes, d=16)
    key = tunecache.cache_key(causal_any_d.SOURCE_HASH, "cpu", {"fp16": "float32"}, small,
                              causal_any_d._AUTOTUNE_WIRES, kind)
    (tmp_path / "autotune.json").write_text(json.dumps(
        {"schema": tunecache.SCHEMA, "entries": {key: {"config": {**cached, "num_warps": 2}}}}))
    assert causal_any_d._autotune_fill(options, small, torch.device("cpu"), {"fp16": torch.float32}, kind) \
        == {**cached, "num_warps": 2}


def test_the_backward_launchers_refuse_the_blocks_the_forward_refuses(causal_any_d, tmp_path):
    """NAME_backward called directly took given blocks unchecked: block_q=65536 beside block_x=32
    (a 2^21 score tile) or block_x=32768 beside head dim 64, and matmul_backward's block_m=65536
    beside block_k=32, each failed in Triton's interpreter.  Refused in the forward's words now."""
    q, k, v = causal_any_d.example_inputs({"b": 1, "h": 1, "q": 20, "x": 20, "d": 40}, dtype=torch.float32)
    o, lse = causal_any_d.causal(q, k, v, **BLOCKS)
    do = torch.randn_like(o)
    (delta,) = causal_any_d.causal_preprocess(q, k, v, do, o)
    for options, words in (({"block_q": 65536, "block_x": 32}, "block_q=65536 and block_x=32 make a tile of 2097152"),
                           ({"block_q": 32, "block_x": 32768}, "block_x=32768 and wire d, its size 40 padded to 64")):
        with pytest.raises(ValueError, match=re.escape(words)):
            causal_any_d.causal_backward(q, k, v, do, lse, delta, **options)
    got = causal_any_d.causal_backward(q, k, v, do, lse, delta, **BLOCKS)
    assert all(g.shape == t.shape for g, t in zip(got, (q, k, v)))
    matmul = compile_text((REPO / "examples" / "matmul.ncd").read_text(), "matmul_tiles", tmp_path)
    a, b = torch.randn(20, 24), torch.randn(24, 18)
    with pytest.raises(ValueError, match=re.escape("block_m=65536 and block_k=32 make a tile of 2097152")):
        matmul.matmul_backward(a, b, torch.randn(20, 18), block_m=65536, block_n=16, block_k=32)

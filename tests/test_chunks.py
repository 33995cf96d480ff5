"""Chunks of the streamed wire (flash-decoding): ``group x by C`` beside
``stream x by B`` in level smem, or the launcher's ``chunk=``.

Each program of the forward streams one chunk of x and stores its partial
state; the merge kernel folds the chunks' states and stores the outputs
(napkin/codegen/emit.py chunk_state).  Checked here: the language (the
parser's fold, printing, the checker's errors), the numerics of chunked
launches against the float64 reference for every normaliser family and
mask kind (empty chunks, a data mask's ranges, ragged sizes), that the merge
really runs, training through a chunked forward, positions, TMA, and the
launcher's refusals.
"""
from __future__ import annotations

import ast

import pytest
import torch
from hypothesis import given

import napkin
import kernel_helpers as K
from napkin.codegen import emit_module
from napkin.errors import NapkinError
from napkin.parse import parse
from napkin.printer import to_text
from strategies import attention_diagrams, drawn_sizes
from test_check import errors, pos


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("chunks"))
    yield
    K._FOLDER.pop()


# --------------------------------------------------------------------------
# The language.
# --------------------------------------------------------------------------

DECODE = (K.REPO / "examples" / "flash_decoding.ncd").read_text()


def test_group_beside_stream_is_one_chunked_stream_tile_and_prints_back():
    d = napkin.load_text(DECODE, "flash_decoding.ncd")
    (x,) = [t for t in d.level("smem").tiles if t.wire == "x"]
    assert (x.kind, x.size, x.chunk) == ("stream", 64, 1024)
    assert (x.chunk_loc.line, x.chunk_loc.col) == pos(DECODE, "x by 1024  ")
    text = to_text(d)
    assert "group x by 1024\n" in text and "stream x by 64" in text
    assert parse(text, "back.ncd") == d


SMEM = """diagram t
wire b, h, q, x
wire d = 64
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
S[b, h, q, x] = sum[d](Q * K)
O[b, h, q, d] : fp16 = sum[x](softmax[x](S) * V)
out O
schedule on h100 {
  level smem {
    group b by 1, h by 1, q by 64
    %s
  }
}
"""


@pytest.mark.parametrize("tiles, message, snippet, hint", [
    ("group x by 64\n    stream x by 64",
     "group x by 64 must be longer than the block it streams, 64: each program streams its chunk of x in blocks",
     "x by 64", "group x by 128 or more, or drop the group"),
    ("stream x by 64\n    group x by 96", "chunk size 96 for x is not a power of two", "x by 96", "try 64 or 128"),
])
def test_chunk_errors_point_at_the_group(tiles, message, snippet, hint):
    text = SMEM % tiles
    (found,) = errors(text)
    assert (found.message, loc_of(found)) == (message, pos(text, snippet))
    assert found.hint == hint


@pytest.mark.parametrize("tiles, at", [("group x by 256, x by 512\n    stream x by 64", ("x by 512", "x by 64")),
                                       ("group x by 256\n    stream x by 64, x by 32", ("x by 64", "x by 32"))])
def test_a_wire_grouped_or_streamed_twice_is_no_chunk(tiles, at):
    text = SMEM % tiles
    assert [(d.message, loc_of(d)) for d in errors(text)] == [
        ("wire x is tiled twice in level smem", pos(text, snippet)) for snippet in at]


def loc_of(d):
    return (d.loc.line, d.loc.col)


def test_chunks_belong_in_level_smem():
    text = SMEM.replace("level smem {", "level smem { group b by 1 }\n  level regs {") % \
        "group x by 256\n    stream x by 32"
    found = [d for d in errors(text) if "chunks" in d.message]
    assert [(d.message, loc_of(d)) for d in found] == [
        ("level regs both groups and streams x: only level smem may split a streamed wire into chunks "
         "(one per program)", pos(text, "x by 256"))]


def test_a_contraction_with_chunks_is_refused_in_words():
    text = (K.REPO / "examples" / "matmul.ncd").read_text()
    text = text.replace("stream k by", "group k by 512\n    stream k by")
    with pytest.raises(NapkinError) as e:
        napkin.codegen.emit_module(napkin.load_text(text, "m.ncd"), source_text=text, source_path="m.ncd")
    assert "napkin cannot emit a kernel for 'group k by 512': chunks of the streamed wire" in str(e.value)


# --------------------------------------------------------------------------
# Numerics: every chunked launch against the float64 reference.
# --------------------------------------------------------------------------

class LaunchSpy:
    """Stands in for a kernel (the merge, the main one): records the grid of each launch."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def merge_name(m):
    return next(n for n in vars(m) if n.endswith("_merge") and n.startswith("_"))


def chunked(m, inputs, **opts):
    """Run with a spy on the merge kernel: (outputs, grids the merge ran on).
    The kernel is put back however the run ends."""
    name = merge_name(m)
    spy = LaunchSpy(getattr(m, name))
    setattr(m, name, spy)
    try:
        out = K.run(m, inputs, **opts)
    finally:
        setattr(m, name, spy.kernel)
    return out, spy.grids


# (example, its text edits, sizes, chunk): chunk 32 with block_x 16 makes
# several chunks at small sizes; every length ragged against block and chunk
SHORT = ("q - x < 256", "q - x < 40")
CASES = [
    ("flash_decoding", (), {"b": 1, "hk": 2, "g": 2, "q": 3, "x": 301}, 64),
    ("causal", (), {"b": 1, "h": 2, "q": 70, "x": 70}, 32),          # early rows: later chunks empty
    ("sliding_window", (SHORT,), {"b": 1, "h": 2, "q": 90, "x": 90}, 32),   # chunks outside the window
    ("document_mask", (), {"b": 2, "h": 1, "q": 75, "x": 75}, 32),   # the ranges prepass, per chunk
    ("attention", (), {"b": 1, "h": 2, "q": 20, "x": 150}, 32),
    ("gqa", (), {"b": 1, "hk": 2, "g": 2, "q": 9, "x": 99}, 32),
    ("softcap", (), {"b": 1, "h": 2, "q": 33, "x": 77}, 32),
    ("alibi", (), {"b": 1, "h": 2, "q": 40, "x": 40}, 32),
    ("l2_attention", (), {"b": 1, "h": 2, "q": 21, "x": 83}, 32),     # sums: merged by addition
    ("relu2_attention", (), {"b": 1, "h": 2, "q": 21, "x": 83}, 32),
    ("sigmoid_attention", (), {"b": 1, "h": 2, "q": 21, "x": 83}, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name, edits, sizes, chunk", CASES, ids=[c[0] for c in CASES])
def test_chunked_forward_matches_the_reference(name, edits, sizes, chunk, dtype):
    m = K.example(name, *edits)
    inputs = m.example_inputs(sizes, dtype=dtype, seed=11)
    out, grids = chunked(m, inputs, block_q=16, block_x=16, chunk=chunk)
    assert len(grids) == 1 and grids[0][0] == -(-sizes["q"] // 16), grids   # the merge ran, once
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), f"{name} chunk={chunk}")


def test_the_schedule_chunk_is_the_default_and_a_long_one_runs_whole():
    m = K.example("flash_decoding", ("group x by 1024", "group x by 128"))
    inputs = m.example_inputs({"b": 1, "hk": 1, "g": 2, "q": 2, "x": 300}, dtype=torch.float32, seed=2)
    out, grids = chunked(m, inputs, block_q=16, block_x=16)
    assert len(grids) == 1                                   # 300 keys: 3 chunks of the schedule's 128
    whole, none = chunked(m, inputs, block_q=16, block_x=16, chunk=512)
    assert none == []                                        # one chunk: the whole kernel, no merge
    assert chunked(m, inputs, block_q=16, block_x=16, chunk=0)[1] == []
    for a, b in zip(out, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tma_and_pointer_chunked_launches_agree_bitwise():
    m = K.example("flash_decoding")
    inputs = m.example_inputs({"b": 1, "hk": 2, "g": 1, "q": 5, "x": 200}, dtype=torch.float16, seed=4)
    ptr, _ = chunked(m, inputs, block_q=16, block_x=16, chunk=32, tma=False)
    tma, grids = chunked(m, inputs, block_q=16, block_x=16, chunk=32, tma=True)
    assert m._tma_last["used"] and grids
    for a, b in zip(ptr, tma):
        assert torch.equal(a, b)


def test_positions_compose_with_chunks():
    """Keys at global positions (the distributed wrappers' local call): the
    loop tests each tile; a chunk cuts the same range."""
    m = K.example("causal")
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 50, "x": 50}, dtype=torch.float32, seed=5)
    pos_ = {"q": torch.arange(50), "x": torch.arange(50)}
    lens = {"q": 50, "x": 50}
    with_pos, grids = chunked(m, inputs, block_q=16, block_x=16, chunk=16, positions=pos_,
                              lengths=lens)
    assert grids
    K.assert_accurate(with_pos, K.reference(m, inputs, torch.float64), K.reference(m, inputs), "positions")


# --------------------------------------------------------------------------
# Training through a chunked forward; the launcher's refusals.
# --------------------------------------------------------------------------

def test_training_takes_the_schedule_chunk_and_its_gradients_are_right(monkeypatch):
    m = K.example("flash_decoding", ("group x by 1024", "group x by 32"), ("stream x by 64", "stream x by 16"))
    sizes = {"b": 1, "hk": 2, "g": 2, "q": 5, "x": 90}
    inputs = [t.requires_grad_() for t in m.example_inputs(sizes, dtype=torch.float32, seed=6)]
    spy = LaunchSpy(getattr(m, merge_name(m)))
    monkeypatch.setattr(m, merge_name(m), spy)
    O, lse = K.launcher(m)(*inputs, block_q=16, block_x=16)
    assert spy.grids                                          # the forward that saved lse was chunked
    g = torch.Generator().manual_seed(9)
    dO, dl = torch.randn(O.shape, generator=g), torch.randn(lse.shape, generator=g)
    grads = torch.autograd.grad((O * dO).sum() + (lse * dl).sum(), inputs)

    def ref(dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in inputs]
        o, l = m.reference(*xs)
        return torch.autograd.grad((o * dO.to(dtype)).sum() + (l * dl.to(dtype)).sum(), xs)

    K.assert_accurate(grads, ref(torch.float64), ref(torch.float32), "chunked training")


@pytest.mark.parametrize("chunk, message", [
    (24, "chunk must be None, 0 or a power of two, not 24"),
    (True, "chunk must be a whole number or None, not True"),
    (8, "chunk=8 is shorter than block_x=16: a chunk is whole blocks"),
])
def test_bad_chunks_are_refused_in_words(chunk, message):
    m = K.example("flash_decoding")
    inputs = m.example_inputs({"b": 1, "hk": 1, "g": 1, "q": 2, "x": 40}, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError) as e:
        K.run(m, inputs, block_q=16, block_x=16, chunk=chunk)
    assert str(e.value) == message


def test_chunk_with_gradients_is_refused():
    m = K.example("flash_decoding")
    inputs = [t.requires_grad_() for t in m.example_inputs({"b": 1, "hk": 1, "g": 1, "q": 2, "x": 40},
                                                           dtype=torch.float32, seed=1)]
    with pytest.raises(ValueError, match="chunk= make a forward-only call"):
        K.launcher(m)(*inputs, chunk=32)


# --------------------------------------------------------------------------
# Autotuning: chunk lengths for grids that leave SMs idle; the cache's chunk.
# --------------------------------------------------------------------------

def test_the_tuner_tries_chunks_only_where_the_grid_leaves_sms_idle():
    from napkin import autotune, tunecache
    d = napkin.load(K.REPO / "examples" / "flash_decoding.ncd")
    # 8 programs unchunked on 132 SMs: each packs the 4 heads x 4 queries of a kv head (16 rows)
    decode = {"b": 1, "hk": 8, "g": 4, "q": 4, "x": 32768}
    keep, _ = autotune.candidates(d, decode)
    assert keep and all(c.num_warps == 1 for c in keep)      # 16 rows: one warp each (4 and 8 idle)
    # 0 (the whole wire: the schedule chunks), then ~2 programs an SM: 33 chunks -> 1024, and twice it
    assert sorted({c.chunk for c in keep if c.chunk is not None}) == [0, 1024, 2048]
    shape = autotune.kernel_shape(d, decode)
    assert autotune.chunk_lengths(shape, decode, {"q": 16, "x": 64}) == [0, 1024, 2048]
    assert autotune.chunk_lengths(shape, {**decode, "b": 32}, {"q": 16, "x": 64}) == [0]   # 256 programs
    unpacked = napkin.load_text(K.REPO.joinpath("examples", "flash_decoding.ncd").read_text().replace(
        "g by 4, q by 4", "g by 1, q by 16"), "u.ncd")              # 32 programs: 9 chunks -> 4096
    assert autotune.chunk_lengths(autotune.kernel_shape(unpacked, decode), decode, {"q": 16, "x": 64}) == \
        [0, 4096, 8192]
    plain = napkin.load(K.REPO / "examples" / "attention.ncd")
    target = {"b": 1, "h": 16, "q": 16384, "x": 16384}
    assert all(c.chunk is None for c in autotune.candidates(plain, target)[0])
    for bwd in ("bwd", "bwd_kv"):
        assert all(c.chunk is None for c in autotune.candidates(d, decode, kind=bwd)[0])
    c = tunecache.Config((("q", 16), ("x", 64)), 1, 3, chunk=4096)
    assert c.kwargs()["chunk"] == 4096 and tunecache.Config.from_kwargs(c.kwargs()) == c


def test_a_launch_without_chunk_takes_the_cached_one(tmp_path, monkeypatch):
    from napkin import tunecache
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    m = K.example("flash_decoding", ("group x by 1024", "group x by 512"))
    sizes = {"b": 1, "hk": 1, "g": 2, "q": 3, "x": 100}
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=8)
    key = tunecache.cache_key(m.SOURCE_HASH, "cpu", {"fp16": "float32"}, sizes, ("b", "hk", "g", "q", "x"))
    tunecache.Cache().put(key, tunecache.Config((("q", 16), ("x", 16)), 1, 2, chunk=32), ms=1.0)
    spy = LaunchSpy(m._flash_decoding_kernel)
    monkeypatch.setattr(m, "_flash_decoding_kernel", spy)
    out = K.launcher(m)(*inputs)                     # no options: the cached config, chunk 32
    assert [g[2] for g in spy.grids] == [4]          # 100 keys in 4 chunks of 32
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), "cached chunk")
    K.launcher(m)(*inputs, chunk=0)                  # an explicit chunk wins
    assert spy.grids[-1][2] == 1


# --------------------------------------------------------------------------
# The merge kernel's arguments (codegen/chunks.py merge_launch): Triton binds
# every argument of a launch on the host, so the merge takes only the main
# kernel's parameters its body reads, and the launcher passes a slice of the
# kernel's positional tuple plus keywords.  A swapped or shifted argument of
# equal value (two strides, say) would pass the numerical tests: this reads
# the generated source and checks each argument lands on its own parameter.
# --------------------------------------------------------------------------

def merge_arguments(text: str, name: str) -> tuple[list[str], list[str], list[str], set[str]]:
    """(main kernel's parameters, merge's parameters, the merge launch's
    arguments as the kernel parameters they land on, in order, and the names
    the merge reads)."""
    tree = ast.parse(text)
    defs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    kernel = [a.arg for a in defs[f"_{name}_kernel"].args.args]
    merge_def = defs[f"_{name}_merge"]
    merge = [a.arg for a in merge_def.args.args]
    read = {n.id for n in ast.walk(merge_def) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    (call,) = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)
               and isinstance(c.func.value, ast.Name) and c.func.value.id == f"_{name}_merge"]
    # the kernel's positional tuple _args holds its parameters up to the first constexpr (the blocks)
    first_constexpr = next(i for i, a in enumerate(defs[f"_{name}_kernel"].args.args) if a.annotation is not None)
    positional = kernel[:first_constexpr]
    (star,) = call.args
    assert isinstance(star, ast.Starred)
    passed, todo = [], [star.value]
    while todo:   # _args[a:b] + _args[c:d] + ...
        node = todo.pop(0)
        if isinstance(node, ast.BinOp):
            todo[:0] = [node.left, node.right]
        else:
            assert isinstance(node, ast.Subscript) and node.value.id == "_args", ast.dump(node)
            passed += positional[node.slice.lower.value:node.slice.upper.value]
    triton_options = {"num_warps", "num_stages", "enable_fp_fusion"}
    passed += [k.arg for k in call.keywords if k.arg not in triton_options]
    return kernel, merge, passed, read


# the examples napkin emits a streamed attention kernel for (not the cost-only ones: fp8, unfused)
STREAMED = [p for p in sorted((K.REPO / "examples").glob("*.ncd"))
            if "stream x" in p.read_text() and (K.REPO / "generated" / f"{p.stem}.py").exists()]


@pytest.mark.parametrize("path", STREAMED, ids=lambda p: p.stem)
def test_the_merge_takes_exactly_the_kernel_parameters_it_reads(path):
    d = napkin.load(path)
    text = emit_module(d, source_text=path.read_text(), source_path=str(path))
    kernel, merge, passed, read = merge_arguments(text, d.name)
    assert merge == [p for p in kernel if p in read], path.stem
    assert passed == merge, path.stem        # each argument, positional or keyword, on its own parameter
    assert {"K", "V", "_BLOCK_x", "_CHUNK"}.isdisjoint(merge) and "_part" in merge   # the keys stay out


@K.SETTINGS
@given(diagram=attention_diagrams())
def test_random_merges_take_exactly_the_kernel_parameters_they_read(diagram):
    text = emit_module(diagram, source_text=to_text(diagram), source_path="drawn.ncd")
    kernel, merge, passed, read = merge_arguments(text, diagram.name)
    assert merge == [p for p in kernel if p in read]
    assert passed == merge


# --------------------------------------------------------------------------
# Random diagrams (tests/strategies.py), chunked: every normaliser, bias and
# mask the strategy draws, at its own blocks, one block per chunk.
# --------------------------------------------------------------------------

@K.SETTINGS
@given(diagram=attention_diagrams())
def test_random_attention_diagrams_chunked(diagram):
    import zlib
    key = f"drawn_{zlib.crc32(to_text(diagram).encode())}"
    m = K.compile_text(to_text(diagram), key, diagram)
    sizes = drawn_sizes(diagram, zlib.crc32(key.encode()))
    dtype = {"fp16": torch.float16, "fp32": torch.float32}[diagram.inputs[0].dtype]
    inputs = m.example_inputs(sizes, dtype=dtype, seed=2)
    block = next(t.size for t in diagram.level("smem").tiles if t.kind == "stream")
    out, grids = chunked(m, inputs, **{k: None for k in K.FAST}, chunk=block)   # one block a chunk
    assert len(grids) == (sizes["x"] > block), (sizes, block)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), to_text(diagram))

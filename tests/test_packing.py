"""Packed rows: ``group g by 4`` beside ``group q by 4`` in level smem packs
a batch wire into the row block (grouped-query decoding: the query heads of
one key/value head share a program, so K and V are read once for all of
them).

The launcher views the (g, q) pairs as the rows of q, g-major, and gives
each row its own q as a position (napkin/codegen/lower.py packed_wire,
codegen/packed.py, the module's _pack).  Checked here: the checker's and
codegen's rules, the launch really packs (its grid), the numerics against
float64 at ragged sizes, chunked and not, with the caller's positions,
through a non-contiguous Q (a copy), training (a packed forward, the usual
backward), and a diagram whose q is read by an integer input alone (a
document mask: its ranges prepass on the packed rows, the bytes of K it saves).
"""
from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from hypothesis import assume, given

import napkin
import kernel_helpers as K
from napkin import ir, tiling
from napkin.codegen import lower
from napkin.cost import packing
from napkin.errors import NapkinError
from napkin.printer import to_text
from strategies import attention_diagrams, drawn_sizes
from test_check import errors, pos
from test_chunks import LaunchSpy


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("packing"))
    yield
    K._FOLDER.pop()


DECODE = (K.REPO / "examples" / "flash_decoding.ncd").read_text()
PACKED = "group b by 1, hk by 1, g by 4, q by 4"


def plan_of(text: str):
    return lower.lower(napkin.load_text(text, "t.ncd"))


def kernel_grids(m, inputs, **opts):
    """Run with a spy on the forward kernel: (outputs, its launch grids)."""
    name = next(n for n in vars(m) if n.endswith("_kernel") and n.startswith("_") and "bwd" not in n
                and "ranges" not in n)
    spy = LaunchSpy(getattr(m, name))
    setattr(m, name, spy)
    try:
        out = K.run(m, inputs, **opts)
    finally:
        setattr(m, name, spy.kernel)
    return out, spy.grids


# --------------------------------------------------------------------------
# The language: the checker lets 4 x 4 make a block; codegen's rules.
# --------------------------------------------------------------------------

def test_the_example_packs_its_query_heads_into_16_rows():
    plan = plan_of(DECODE)
    assert plan.pack == ("g", 4) and dict(plan.blocks)["q"] == 16 and "g" in plan.batch
    assert packing.of_plan(plan).sizes({"b": 2, "hk": 8, "g": 4, "q": 3, "x": 9}) == \
        {"b": 2, "hk": 8, "g": 1, "q": 12, "x": 9}


def test_a_small_group_alone_is_still_too_small_for_a_dot():
    text = DECODE.replace(PACKED, "group b by 1, hk by 1, g by 1, q by 4")
    (found,) = errors(text)
    assert found.message == ("block size 4 for q is too small: q takes part in a contraction, and matrix "
                             "products (tl.dot) need blocks of at least 16")
    assert (found.loc.line, found.loc.col) == pos(text, "q by 4   #")


def test_two_small_groups_whose_product_is_short_of_a_dot_are_refused():
    text = DECODE.replace(PACKED, "group b by 1, hk by 1, g by 2, q by 4")
    assert [(e.message.split(":")[0], (e.loc.line, e.loc.col)) for e in errors(text)] == [
        ("block size 2 for g is too small", pos(text, "g by 2")),
        ("block size 4 for q is too small", pos(text, "q by 4   #"))]


def test_the_example_checks():
    assert errors(DECODE) == []


TOO_SMALL = ("block size 4 for {} is too small: {} takes part in a contraction, and matrix products (tl.dot) "
             "need blocks of at least 16")


def test_a_small_group_beside_the_contracted_wire_packs_nothing():
    """q by 4 beside d by 4 (Q[b, (hk g), q, d]) is no packed row block: d is contracted."""
    text = DECODE.replace(PACKED, "group b by 1, hk by 1, g by 1, q by 4, d by 4")
    assert [(e.message, (e.loc.line, e.loc.col)) for e in errors(text)] == [
        (TOO_SMALL.format("q", "q"), pos(text, "q by 4, d")), (TOO_SMALL.format("d", "d"), pos(text, "d by 4"))]


def test_small_groups_pack_rows_in_level_smem_only():
    text = DECODE.replace(PACKED, "group b by 1, hk by 1, g by 1, q by 16") \
        .replace("    hold S, P\n  }", "    hold S, P\n  }\n  level regs { group g by 4, q by 4 }")
    assert [(e.message, (e.loc.line, e.loc.col)) for e in errors(text)] == [
        (TOO_SMALL.format("g", "g"), pos(text, "g by 4, q")),
        ("'group g by 4' in level regs is larger than level smem's block of g (1): each regs block is part of "
         "a smem block", pos(text, "g by 4, q")),
        (TOO_SMALL.format("q", "q"), pos(text, "q by 4 }"))]


def test_codegen_runs_the_checkers_rule_of_small_groups():
    """lower.packed_wire refuses what tiling.packs_rows (the checker's rule) does not allow, should the
    two ever disagree: here on diagrams the checker never saw.  Small groups in level regs never reach
    it (codegen reads smem's tiles): they are refused as any regs tile other than smem's."""
    from napkin.parse import parse
    qd = DECODE.replace(PACKED, "group b by 1, hk by 1, g by 1, q by 4, d by 4")
    with pytest.raises(NapkinError) as e:
        lower.lower(parse(qd, "t.ncd"))
    (diag,) = e.value.diagnostics
    assert diag.message == ("napkin cannot emit a kernel for 'group q by 4': its blocks of 4 rows are short of a "
                            "tl.dot block of 16, and no wire packs into them")
    assert (diag.loc.line, diag.loc.col) == pos(qd, "q by 4, d")
    regs = DECODE.replace(PACKED, "group b by 1, hk by 1, g by 1, q by 16") \
        .replace("    hold S, P\n  }", "    hold S, P\n  }\n  level regs { group g by 4, q by 4 }")
    with pytest.raises(NapkinError) as e:
        lower.lower(parse(regs, "t.ncd"))
    (diag,) = e.value.diagnostics
    assert diag.message.startswith("napkin cannot emit a kernel for 'group g by 4': the kernels' blocks are level "
                                   "smem's") and "level smem groups g by 1;" in diag.message
    assert (diag.loc.line, diag.loc.col) == pos(regs, "g by 4, q")


REGS = "    hold S, P\n  }\n  level regs { %s }"


@pytest.mark.parametrize("smem, regs, wire, size, outer", [
    ("g by 1, q by 16", "group g by 16", "g", 16, 1),      # would pack 16 x 16 where smem packs nothing
    (PACKED, "group g by 32", "g", 32, 4),                 # 128 rows, not 16
    (PACKED, "group q by 16", "q", 16, 4),                 # 64 rows, not 16
], ids=["regs-packs", "regs-more", "regs-rows"])
def test_a_regs_group_larger_than_smems_is_the_checkers_to_refuse(smem, regs, wire, size, outer):
    """These reached codegen, which refused them as packed rows unlike smem's; a regs block larger than
    the smem block of its wire is now the checker's (check_nesting), for cost and check too."""
    text = DECODE.replace(PACKED, f"group b by 1, hk by 1, {smem}" if smem != PACKED else PACKED) \
        .replace("    hold S, P\n  }", REGS % regs)
    assert [(e.message, (e.loc.line, e.loc.col)) for e in errors(text)] == [
        (f"'group {wire} by {size}' in level regs is larger than level smem's block of {wire} ({outer}): "
         "each regs block is part of a smem block", pos(text, f"{wire} by {size} }}"))]


@pytest.mark.parametrize("smem, regs, refused", [
    (PACKED, "group g by 1", ("g by 1 }", "g", 1, "groups g by 4")),                    # would pack nothing
    (PACKED, "group b by 1, hk by 1", None),                                           # smem's own: 16 rows
], ids=["regs-unpacks", "same"])
def test_packed_rows_are_the_ones_level_smem_forms(smem, regs, refused):
    """Packed rows are formed in level smem (tiling.packs_rows, the
    checker's rule; the checker's and the cost pass's footprints), where
    codegen took the innermost group: a group of the packed or the row wire
    in level regs that differs from smem's packed the kernels otherwise (or
    not at all), and the cost report showed that grid beside smem's tiles.
    It is refused at that group (in packed rows' words where smem packs);
    one equal to smem's changes nothing.  Each diagram passes the checker:
    the refusal is codegen's."""
    text = DECODE.replace(PACKED, f"group b by 1, hk by 1, {smem}" if smem != PACKED else PACKED) \
        .replace("    hold S, P\n  }", REGS % regs)
    assert errors(text) == []
    d = napkin.load_text(text, "t.ncd")
    if refused is None:
        plan = lower.lower(d)
        assert plan.pack == ("g", 4) and dict(plan.blocks)["q"] == 16 and tiling.packs_rows(d, "g", "q")
        assert packing.find(d) == packing.Packing("g", "q", 16, (4, 4))
        return
    snippet, wire, size, there = refused
    diag = emit_error(text)
    if smem == PACKED:   # smem's packed rows: the reason says so
        assert diag.message == (f"napkin cannot emit a kernel for 'group {wire} by {size}': packed rows (g grouped "
                                f"beside q) are formed in level smem, which {there}; a group of {wire} in level "
                                f"regs would give the kernels other row blocks than that level's")
        assert diag.hint == f"group {wire} in level smem alone: drop 'group {wire} by {size}' from level regs"
    else:
        assert diag.message.startswith(f"napkin cannot emit a kernel for 'group {wire} by {size}': the kernels' "
                                       f"blocks are level smem's") and f"level smem {there};" in diag.message
        assert diag.hint.startswith(f"drop 'group {wire} by {size}' from level regs, or group {wire} by {size} "
                                    f"in level smem")
    assert (diag.loc.line, diag.loc.col) == pos(text, snippet)
    assert packing.find(d) is None      # the cost pass prices no packed launch the code generator refuses


def emit_error(text: str) -> NapkinError:
    with pytest.raises(NapkinError) as e:
        napkin.codegen.emit_module(napkin.load_text(text, "t.ncd"), source_text=text, source_path="t.ncd")
    (diag,) = e.value.diagnostics
    return diag


def test_a_tensor_with_q_but_not_g_right_before_it_is_refused_at_the_group():
    text = DECODE.replace("in Q[b, (hk g), q, d] : bf16", "in Q[b, (hk g), q, d] : bf16\nin B[b, q, x] : bf16") \
        .replace("sum[d](Q * K) * |d|^-0.5", "sum[d](Q * K) * |d|^-0.5 + B")
    diag = emit_error(text)
    assert diag.message == ("napkin cannot emit a kernel for 'group g by 4': it packs g into the rows of q, so "
                            "every tensor along either holds g right before q; B is [b, q, x]")
    assert (diag.loc.line, diag.loc.col) == pos(text, "g by 4, q") and diag.hint == "write 'group g by 1'"


def test_a_box_that_reads_the_packed_wire_is_refused():
    text = DECODE.replace("sum[d](Q * K) * |d|^-0.5, -inf)", "sum[d](Q * K) * |d|^-0.5 + g, -inf)")
    diag = emit_error(text)
    assert diag.message == ("napkin cannot emit a kernel for 'group g by 4': box S uses the index g, which "
                            "packed rows do not keep (the kernel sees g as size 1)")
    assert diag.hint == "write 'group g by 1'; or, to pack q into the rows of g, hold q right before g in every tensor"


def test_q_held_before_g_makes_g_the_rows_and_the_hint_says_how_to_swap():
    """Q[b, hk, q, g, d]: g, the innermost grouped wire, becomes the rows and
    q would be packed, which the causal mask's index q forbids; the hint says
    to hold g right before q (what was meant) as well as to drop q's group."""
    text = DECODE
    for old, new in (("Q[b, (hk g), q, d]", "Q[b, hk, q, g, d]"), ("O[b, (hk g), q, d]", "O[b, hk, q, g, d]"),
                     ("lse[b, (hk g), q]", "lse[b, hk, q, g]")):
        assert old in text
        text = text.replace(old, new)
    diag = emit_error(text)
    assert diag.message == ("napkin cannot emit a kernel for 'group q by 4': box S uses the index q, which "
                            "packed rows do not keep (the kernel sees q as size 1)")
    assert diag.hint == "write 'group q by 1'; or, to pack g into the rows of q, hold g right before q in every tensor"
    assert (diag.loc.line, diag.loc.col) == pos(text, "q by 4   # 16 rows")


def test_only_one_wire_packs():
    text = DECODE.replace(PACKED, "group b by 1, hk by 4, g by 4, q by 4")
    diag = emit_error(text)
    assert diag.message == ("napkin cannot emit a kernel for 'group g by 4': only one wire may share the rows "
                            "of q (group hk by 4 packs hk already)")
    assert (diag.loc.line, diag.loc.col) == pos(text, "g by 4, q") and diag.hint == "write 'group g by 1'"


def test_g_by_1_packs_nothing():
    plan = plan_of(DECODE.replace(PACKED, "group b by 1, hk by 1, g by 1, q by 16"))
    assert plan.pack is None and dict(plan.blocks)["q"] == 16


# --------------------------------------------------------------------------
# The launch: packed programs, the numerics.
# --------------------------------------------------------------------------

# (sizes, block_q, chunk): ragged everywhere; |q| = 1 is decoding proper
CASES = [
    ({"b": 2, "hk": 2, "g": 4, "q": 1, "x": 300}, 16, None),   # 4 rows of 16, schedule's chunk (none at 300)
    ({"b": 1, "hk": 2, "g": 3, "q": 5, "x": 200}, 16, 64),     # 15 rows: one block, 4 chunks
    ({"b": 1, "hk": 1, "g": 8, "q": 3, "x": 77}, 16, 32),      # 24 rows: two blocks, the second ragged
    ({"b": 2, "hk": 1, "g": 4, "q": 4, "x": 130}, 16, 0),      # whole
    ({"b": 1, "hk": 3, "g": 5, "q": 7, "x": 99}, 32, 32),      # 35 rows, block 32
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("sizes, block, chunk", CASES, ids=[f"g{c[0]['g']}q{c[0]['q']}" for c in CASES])
def test_packed_forward_matches_the_reference_and_runs_one_program_per_packed_block(sizes, block, chunk, dtype):
    m = K.example("flash_decoding")
    inputs = m.example_inputs(sizes, dtype=dtype, seed=3)
    out, grids = kernel_grids(m, inputs, block_q=block, block_x=16, chunk=chunk)
    rows = sizes["g"] * sizes["q"]
    assert grids[0][:2] == (-(-rows // block), sizes["b"] * sizes["hk"]), grids   # K and V: once per hk
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), f"{sizes}")


def test_fixed_sizes_of_the_packed_wires():
    """``wire g = 4`` and ``wire q = 1`` (a one-token decode step): the
    kernels take both sizes at run time, the launcher still checks them."""
    m = K.example("flash_decoding", ("wire b, hk, g, q, x", "wire b, hk, x\nwire g = 4\nwire q = 1"))
    assert m.WIRES["g"] == 4 and m.WIRES["q"] == 1
    sizes = {"b": 2, "hk": 3, "g": 4, "q": 1, "x": 100}
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=15)
    out, grids = kernel_grids(m, inputs, block_x=16, chunk=32)
    assert grids[0] == (1, 6, 4)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), "fixed g, q")
    Q, Kt, V = inputs
    with pytest.raises(ValueError, match="wire q has size 1 from the diagram"):
        K.run(m, (torch.cat([Q, Q], 2), Kt, V))


class CallSpy(LaunchSpy):
    """A LaunchSpy that also records each launch's keyword arguments."""

    def __init__(self, kernel):
        super().__init__(kernel)
        self.calls = []

    def __getitem__(self, grid):
        launch = super().__getitem__(grid)

        def call(*args, **kwargs):
            self.calls.append(kwargs)
            return launch(*args, **kwargs)
        return call


@pytest.mark.parametrize("g", [1, 2])
def test_one_query_head_a_group_packs_nothing(g):
    """|g| = 1: the ordinary launch, no packed positions reach the kernel (|g| = 2 packs: they do)."""
    m = K.example("flash_decoding")
    sizes = {"b": 1, "hk": 2, "g": g, "q": 5, "x": 90}
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=4)
    spy = CallSpy(m._flash_decoding_kernel)
    m._flash_decoding_kernel = spy
    try:
        out = K.run(m, inputs, block_q=16, block_x=16, chunk=0)
    finally:
        m._flash_decoding_kernel = spy.kernel
    (call,) = spy.calls
    assert spy.grids == [(1, 2, 1)]                      # 5 or 10 rows: one block per kv head
    if g == 1:
        assert call["_POS_q"] is False and call["_pos_q"] is None
    else:
        assert call["_POS_q"] is True and call["_pos_q"].tolist() == list(range(5)) * 2
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), f"g={g}")


def test_packed_equals_unpacked_and_sdpa():
    """The same diagram with g by 1 (one program per query head): the same
    outputs; and torch's SDPA (GQA) on the decode mask."""
    m = K.example("flash_decoding")
    u = K.example("flash_decoding", (PACKED, "group b by 1, hk by 1, g by 1, q by 16"))
    sizes = {"b": 2, "hk": 2, "g": 4, "q": 3, "x": 150}
    Q, Kt, V = m.example_inputs(sizes, dtype=torch.float32, seed=5)
    (O, lse), (Ou, lseu) = K.run(m, (Q, Kt, V), block_x=16, chunk=0), K.run(u, (Q, Kt, V), block_x=16, chunk=0)
    torch.testing.assert_close(O, Ou, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lseu, rtol=1e-5, atol=1e-6)
    x, q = sizes["x"], sizes["q"]
    allowed = torch.arange(x)[None, :] <= torch.arange(q)[:, None] + x - q
    want = torch.nn.functional.scaled_dot_product_attention(
        Q.double(), Kt.double(), V.double(), attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(O.double(), want, rtol=1e-5, atol=1e-6)


def test_the_callers_positions_are_repeated_for_each_packed_head():
    m = K.example("flash_decoding")
    sizes = {"b": 1, "hk": 2, "g": 4, "q": 3, "x": 100}
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=6)
    positions, lengths = {"q": torch.tensor([5, 9, 40])}, {"q": 50}
    O, lse = K.run(m, inputs, block_x=16, chunk=32, positions=positions, lengths=lengths)
    # row q at global position p sees keys x <= p + |x| - 50: the reference on those rows alone
    Q, Kt, V = (t.double() for t in inputs)
    allowed = torch.arange(100)[None, :] <= positions["q"][:, None] + 100 - 50
    want = torch.nn.functional.scaled_dot_product_attention(Q, Kt, V, attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(O.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"positions\['q'\] must be a 1-D integer tensor of 3"):
        K.run(m, inputs, positions={"q": torch.arange(12)}, lengths=lengths)


def test_keys_at_global_positions_as_a_devices_shard_of_the_cache():
    """The distributed decode's local call: this device's keys sit at global
    positions 20.. of a cache of 150, the rows at the end of 50 queries."""
    m = K.example("flash_decoding")
    sizes = {"b": 1, "hk": 2, "g": 4, "q": 3, "x": 100}
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=10)
    positions = {"q": torch.tensor([46, 47, 49]), "x": torch.arange(100) + 20}
    lengths = {"q": 50, "x": 150}
    O, lse = K.run(m, inputs, block_x=16, chunk=32, positions=positions, lengths=lengths)
    Q, Kt, V = (t.double() for t in inputs)
    allowed = positions["x"][None, :] <= positions["q"][:, None] + 150 - 50
    want = torch.nn.functional.scaled_dot_product_attention(Q, Kt, V, attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(O.double(), want, rtol=1e-5, atol=1e-6)


def test_a_q_whose_g_and_q_do_not_merge_is_copied_and_still_right():
    m = K.example("flash_decoding")
    sizes = {"b": 1, "hk": 2, "g": 4, "q": 3, "x": 70}
    Q, Kt, V = m.example_inputs(sizes, dtype=torch.float32, seed=7)
    Qt = Q.transpose(1, 2).contiguous().transpose(1, 2)          # same values, (hk g) innermost but one
    assert not Qt.is_contiguous()
    out = K.run(m, (Qt, Kt, V), block_x=16, chunk=0)
    K.assert_accurate(out, K.reference(m, (Q, Kt, V), torch.float64), K.reference(m, (Q, Kt, V)), "strided Q")


def test_training_through_a_packed_forward_matches_float64_autograd():
    m = K.example("flash_decoding")
    sizes = {"b": 1, "hk": 2, "g": 4, "q": 3, "x": 45}
    inputs = [t.requires_grad_() for t in m.example_inputs(sizes, dtype=torch.float32, seed=8)]
    O, lse = m.flash_decoding(*inputs, block_x=16)
    w = torch.randn_like(O)
    (O * w).sum().backward()
    got = [t.grad.clone() for t in inputs]
    ref = [t.detach().double().requires_grad_() for t in inputs]
    O64, _ = m.reference(*ref)
    (O64 * w.double()).sum().backward()
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r.grad, rtol=1e-4, atol=1e-5)


DOC = """diagram packed_docs
wire b, hk, g, q, x
wire d = 64
in Q[b, (hk g), q, d] : fp16
in K[b, hk, x, d] : fp16
in V[b, hk, x, d] : fp16
in qdoc[b, q] : int32
in kdoc[b, x] : int32
S[b, hk, g, q, x] = where(qdoc == kdoc, sum[d](Q * K) * |d|^-0.5, -inf)
O[b, (hk g), q, d] : fp16 = sum[x](softmax[x](S) * V)
out O
schedule on h100 {
  level smem {
    group b by 1, hk by 1, g by 4, q by 4
    stream x by 32
  }
}
"""


def test_an_integer_input_along_q_alone_is_read_at_each_rows_q():
    m = K.compile_text(DOC, "packed_docs")
    sizes = {"b": 2, "hk": 2, "g": 4, "q": 5, "x": 60}
    Q, Kt, V, qdoc, kdoc = m.example_inputs(sizes, dtype=torch.float32, seed=9)
    qdoc = torch.tensor([[0, 0, 1, 2, 2], [0, 1, 1, 1, 3]], dtype=torch.int32)
    kdoc = torch.randint(0, 4, (2, 60), generator=torch.Generator().manual_seed(1)).sort(-1).values.int()
    inputs = (Q, Kt, V, qdoc, kdoc)
    out, grids = kernel_grids(m, inputs, block_q=16, block_x=16)
    assert grids[0][:2] == (2, 4)                                  # 20 packed rows, b x hk programs
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), "docs")


def test_a_packed_document_mask_visits_only_the_live_key_blocks():
    """The ranges prepass runs on packed rows (codegen/packed.py; it once never did: _pack gives the
    packed rows positions, which turned it off): its row blocks are the packed launch's, each row's
    document read at its own q.  One block of 16 (g, q) rows whose queries sit in documents 5, 6, 7, 7
    visits the key blocks from document 5's first to document 7's last: 6 of 16 blocks of K."""
    from napkin.bytecount import ByteCounter
    m = K.compile_text(DOC, "packed_docs")
    sizes = {"b": 1, "hk": 1, "g": 4, "q": 4, "x": 512}
    Q, Kt, V, _, _ = m.example_inputs(sizes, dtype=torch.float32, seed=1)
    qdoc = torch.tensor([[5, 6, 7, 7]], dtype=torch.int32)
    kdoc = torch.tensor([[0] * 320 + [5] * 64 + [6] * 64 + [7] * 64], dtype=torch.int32)
    inputs = (Q, Kt, V, qdoc, kdoc)
    with ByteCounter(tensors={"K": Kt}) as bc:
        out = K.run(m, inputs, block_q=16, block_x=32)
    assert bc.loads["K"] == 6 * 32 * 64 * 4                      # keys 320..511, d = 64, fp32: not all 512
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), "docs")
    # the caller's positions still mean no prepass (every block, tested per tile), as unpacked
    with ByteCounter(tensors={"K": Kt}) as bc:
        placed = K.run(m, inputs, block_q=16, block_x=32, positions={"q": torch.arange(4)}, lengths={"q": 4})
    assert bc.loads["K"] == 512 * 64 * 4
    torch.testing.assert_close(placed[0], out[0])


@pytest.mark.parametrize("g, q, block", [(4, 6, 16), (3, 5, 16), (8, 3, 32)])
def test_packed_row_blocks_of_documents_match_the_reference(g, q, block):
    """Ragged packed blocks whose rows span several heads: the prepass's ranges per packed block (the
    union of its rows' live blocks, full only where every row's document covers the block)."""
    m = K.compile_text(DOC, "packed_docs")
    sizes = {"b": 2, "hk": 2, "g": g, "q": q, "x": 150}
    Q, Kt, V, _, _ = m.example_inputs(sizes, dtype=torch.float32, seed=4)
    gen = torch.Generator().manual_seed(g * 10 + q)
    qdoc = torch.randint(0, 4, (2, q), generator=gen).sort(-1).values.int()
    kdoc = torch.randint(0, 4, (2, 150), generator=gen).sort(-1).values.int()
    inputs = (Q, Kt, V, qdoc, kdoc)
    out = K.run(m, inputs, block_q=block, block_x=16)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), f"docs g{g} q{q}")


def test_packed_rows_under_a_document_mask_are_launched_from_a_plan(monkeypatch):
    """A plan (codegen/launch_plan.py) is kept for packed rows under a mask that reads data too: its
    call runs the ranges prepass again at the packed launch's positions, which the plan holds.  Other
    ids of the same shapes give, through the plan, the outputs of a launcher that plans nothing, bit
    for bit; each call runs its own prepass, with mask_cache as without."""
    m = K.compile_text(DOC, "packed_docs")
    sizes = {"b": 2, "hk": 2, "g": 4, "q": 6, "x": 90}
    Q, Kt, V, _, _ = m.example_inputs(sizes, dtype=torch.float32, seed=3)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))   # fresh ids each run
    ids = [(torch.randint(0, n, (2, 6), generator=gen).sort(-1).values.int(),
            torch.randint(0, n, (2, 90), generator=gen).sort(-1).values.int()) for n in (2, 5, 3)]
    runs = []
    real_ranges = m._packed_docs_ranges
    monkeypatch.setattr(m, "_packed_docs_ranges", lambda *a, **kw: runs.append(a[8]) or real_ranges(*a, **kw))
    monkeypatch.setattr(m, "_LAUNCH_PLANS", {})
    real_plan, from_plans = m._launch_plan, []

    def spy(key):   # the plan lookup, recording whether it found one
        from_plans.append(real_plan(key)[0] is not None)
        return real_plan(key)

    monkeypatch.setattr(m, "_launch_plan", spy)
    for cache in (None, {}):
        planned = [K.run(m, (Q, Kt, V, qd, kd), block_q=16, block_x=16, mask_cache=cache)[0] for qd, kd in ids]
        assert len(m._LAUNCH_PLANS) == 1 and from_plans[-2:] == [True, True]
        assert all(p[1][5]["_ranges"] is None for p in m._LAUNCH_PLANS.values())   # no call's ranges kept
        assert runs[-3:] == [True] * 3   # a prepass each call (new ids: no cache hit)
        monkeypatch.setattr(m, "_launch_plan", lambda key: (None, None))
        whole = [K.run(m, (Q, Kt, V, qd, kd), block_q=16, block_x=16)[0] for qd, kd in ids]
        monkeypatch.setattr(m, "_launch_plan", spy)
        for got, want, (qd, kd) in zip(planned, whole, ids):
            assert torch.equal(got, want)
            (exact,) = K.reference(m, (Q.double(), Kt.double(), V.double(), qd, kd))
            assert (got.double() - exact).abs().max() < 1e-5


def test_an_integer_input_that_holds_the_packed_wire_is_refused_at_the_group():
    """The launcher views only float tensors as packed rows; an integer input is read at each row's q
    with |g| = 1, so one holding g would give each packed head another head's ids: refused."""
    text = DOC.replace("in qdoc[b, q] : int32", "in qdoc[b, (hk g), q] : int32")
    diag = emit_error(text)
    assert diag.message == ("napkin cannot emit a kernel for 'group g by 4': an integer input that holds g cannot "
                            "be packed (integer inputs are read at the rows' positions of q); qdoc is "
                            "[b, hk, g, q]")
    line, col = pos(text, "g by 4, q")
    assert (diag.loc.line, diag.loc.col) == (line, col) and diag.hint == "write 'group g by 1'"
    assert diag.format("t.ncd", text).splitlines() == [
        f"t.ncd:{line}:{col}: {diag.message}",
        "        group b by 1, hk by 1, g by 4, q by 4",
        " " * (4 + col - 1) + "^",
        "  hint: write 'group g by 1'"]
    unpacked = text.replace("g by 4, q by 4", "g by 1, q by 16")   # the hint's schedule compiles
    assert lower.lower(napkin.load_text(unpacked, "t.ncd")).pack is None


def test_an_integer_input_that_flattens_the_row_wire_is_refused_at_the_group():
    """An integer input is read at the packed rows' positions with the packed sizes, so a dimension
    (hk q) would step hk by |g||q| rows instead of |q|: the launch gave wrong scores (max error 0.8
    against the reference at |g| = 2) where the unpacked launch is right.  Refused at compile time."""
    text = DOC.replace("in qdoc[b, q] : int32", "in qdoc[b, (hk q)] : int32")
    diag = emit_error(text)
    assert diag.message == ("napkin cannot emit a kernel for 'group g by 4': an integer input that flattens q "
                            "with other wires cannot be packed (integer inputs are read at the rows' positions "
                            "of q); qdoc is [b, (hk q)]")
    line, col = pos(text, "g by 4, q")
    assert (diag.loc.line, diag.loc.col) == (line, col)
    assert diag.hint == "write 'group g by 1'; or give q a dimension of its own in qdoc"
    unpacked = text.replace("g by 4, q by 4", "g by 1, q by 16")   # the hint's schedule compiles, and runs
    m = K.compile_text(unpacked, "flat_docs")
    sizes = {"b": 2, "hk": 2, "g": 2, "q": 5, "x": 40}
    Q, Kt, V, _, kdoc = m.example_inputs(sizes, dtype=torch.float32, seed=3)
    gen = torch.Generator().manual_seed(5)
    qdoc = torch.randint(0, 3, (2, 2 * 5), generator=gen).int()
    kdoc = torch.randint(0, 3, (2, 40), generator=gen).sort(-1).values.int()
    inputs = (Q, Kt, V, qdoc, kdoc)
    out = K.run(m, inputs, block_x=16)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), "flat docs")


@pytest.mark.parametrize("empty", ["g", "q", "b", "x"])
def test_empty_wires_give_the_references_shapes(empty):
    m = K.example("flash_decoding")
    sizes = {"b": 1, "hk": 2, "g": 4, "q": 3, "x": 20, empty: 0}
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=12)
    out = K.run(m, inputs, block_x=16)
    want = K.reference(m, inputs)
    assert [t.shape for t in out] == [t.shape for t in want]
    for a, b in zip(out, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_tma_and_pointer_packed_launches_agree_bitwise():
    """The descriptors are built over the packed views (Q and O as [b, hk, 1, |g||q|, d])."""
    m = K.example("flash_decoding")
    inputs = m.example_inputs({"b": 1, "hk": 2, "g": 4, "q": 5, "x": 90}, dtype=torch.float16, seed=13)
    ptr = K.run(m, inputs, block_q=16, block_x=16, chunk=32, tma=False)
    tma = K.run(m, inputs, block_q=16, block_x=16, chunk=32, tma=True)
    assert m._tma_last["used"], m._tma_last
    for a, b in zip(ptr, tma):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------
# Every normaliser and mask family, packed: the rows' positions reach the
# mask, the sums and the merge as each row's own q.
# --------------------------------------------------------------------------

VARIANT = """diagram packed_{name}
wire b, hk, g, q, x
wire d = 64
in Q[b, (hk g), q, d] : fp16
in K[b, hk, x, d] : fp16
in V[b, hk, x, d] : fp16
{body}
out O
schedule on h100 {{
  level smem {{
    group b by 1, hk by 1, g by 4, q by 4
    {chunk}
    stream x by 16
  }}
}}
"""
SCORE = "sum[d](Q * K) * |d|^-0.5"
QKX, OUT = "[b, hk, g, q, x]", "O[b, (hk g), q, d] : fp16"
BODIES = {
    "softcap": f"S{QKX} = 50 * tanh({SCORE} / 50)\nP{QKX} = softmax[x](S)\n{OUT} = sum[x](P * V)",
    "window": f"S{QKX} = where(x <= q + |x| - |q| and q + |x| - |q| - x < 40, {SCORE}, -inf)\n"
              f"P{QKX} = softmax[x](S)\n{OUT} = sum[x](P * V)",
    "causal": f"S{QKX} = where(x <= q, {SCORE}, -inf)\nP{QKX} = softmax[x](S)\n{OUT} = sum[x](P * V)",
    "sigmoid": f"S{QKX} = {SCORE}\nP{QKX} = sigmoid(S - log(|x|))\n{OUT} = sum[x](P * V)",
    "l2": f"S{QKX} = {SCORE}\n{OUT} = sum[x](S * V) / sqrt(sum[x](S * S) + 1e-6)",
    "relu2": f"S{QKX} = where(x <= q + |x| - |q|, {SCORE}, -inf)\nW{QKX} = relu(S)^2\n"
             f"{OUT} = sum[x](W * V) / (sum[x](W) + 1e-6)",
}


@pytest.mark.parametrize("chunk", ["", "group x by 32"], ids=["whole", "chunked"])
@pytest.mark.parametrize("name", sorted(BODIES))
def test_every_family_packs(name, chunk):
    m = K.compile_text(VARIANT.format(name=name, body=BODIES[name], chunk=chunk), f"packed_{name}_{bool(chunk)}")
    sizes = {"b": 1, "hk": 2, "g": 3, "q": 7, "x": 90 if name != "causal" else 7}   # 21 rows: ragged blocks
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=14)
    out, grids = kernel_grids(m, inputs, block_q=16, block_x=16)
    assert grids[0][:2] == (2, 2), grids                    # two blocks of (g, q) pairs for each kv head
    assert grids[0][2] == (3 if chunk and name != "causal" else 1)   # 90 keys: 3 chunks of 32 (7: one)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), name)


def test_the_tuner_blocks_the_packed_rows():
    """Its lead is the launcher's default (16 packed rows, not g's or q's
    group of 4), and its row blocks are packed blocks of at least 16."""
    from napkin import autotune
    from napkin.bench import harness
    d = napkin.load(K.REPO / "examples" / "flash_decoding.ncd")
    sizes = {"b": 1, "hk": 8, "g": 4, "q": 64, "x": 4096}
    (lead,) = harness.untuned(d, sizes, "")
    assert dict(lead.blocks) == {"q": 16, "x": 64}
    keep, _ = autotune.candidates(d, sizes, lead=[lead])
    rows = {dict(c.blocks)["q"] for c in keep}
    assert 16 in rows and min(rows) >= 16 and max(rows) > 16 and all(set(dict(c.blocks)) == {"q", "x"} for c in keep)


# --------------------------------------------------------------------------
# Random diagrams (tests/strategies.py) made grouped-query and packed: every
# normaliser, bias, mask and document id the strategy draws.
# --------------------------------------------------------------------------

def packed_gqa(d: ir.Diagram, group: int = 4):
    """``d`` (wires b, h, q, x, d) with its heads h split into hk key/value
    heads of g query heads each: K and V along hk, every other tensor along
    (hk g), and the schedule's row block made of group(g) x block/group(g)
    (g, q) pairs.  None when a tensor cannot pack (ALiBi's slope[h] has h
    but not q; bias[q, x] has q but not h)."""
    def split(t, kv):
        out = []
        for axis in t.axes:
            if axis != ("h",):
                out.append(axis)
            elif kv:
                out.append(("hk",))
            elif isinstance(t, ir.Let) and t.name not in outputs:
                out += [("hk",), ("g",)]
            else:
                out.append(("hk", "g"))
        return tuple(out)

    outputs = {o.name for o in d.outputs}
    inputs = []
    for t in d.inputs:
        wires = ir.axis_wires(t.axes)
        kv = t.name in ("K", "V")
        if not kv and t.dtype not in ir.INT_DTYPES and ("h" in wires) != ("q" in wires):
            return None
        inputs.append(dataclasses.replace(t, axes=split(t, kv), wire_locs=()))
    lets = tuple(dataclasses.replace(let, axes=split(let, False), wire_locs=()) for let in d.lets)
    wires = []
    for w in d.wires:
        wires += [ir.Wire("hk"), ir.Wire("g")] if w.name == "h" else [w]
    levels = []
    for lv in d.schedule.levels:
        tiles = []
        for t in lv.tiles:
            if t.wire == "h":
                tiles += [dataclasses.replace(t, wire="hk"), dataclasses.replace(t, wire="g", size=group)]
            elif t.wire == "q" and lv.name == "smem":
                tiles.append(dataclasses.replace(t, size=t.size // group))
            else:
                tiles.append(t)
        levels.append(dataclasses.replace(lv, tiles=tuple(tiles)))
    schedule = dataclasses.replace(d.schedule, levels=tuple(levels))
    return dataclasses.replace(d, wires=tuple(wires), inputs=tuple(inputs), lets=lets, schedule=schedule)


@K.SETTINGS
@given(drawn=attention_diagrams())
def test_random_attention_diagrams_packed(drawn):
    diagram = packed_gqa(drawn)
    assume(diagram is not None)
    text = to_text(diagram)
    diagram = napkin.load_text(text, "packed.ncd")            # checked, as a user's file is
    plan = lower.lower(diagram)
    assert plan.pack == ("g", 4)
    key = f"packed_{zlib.crc32(text.encode())}"
    m = K.compile_text(text, key, diagram)
    sizes = drawn_sizes(diagram, zlib.crc32(key.encode()))
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    sizes.update(hk=int(torch.randint(1, 3, (1,), generator=gen)), g=int(torch.randint(2, 6, (1,), generator=gen)))
    dtype = {"fp16": torch.float16, "fp32": torch.float32}[diagram.inputs[0].dtype]
    inputs = m.example_inputs(sizes, dtype=dtype, seed=3)
    out, grids = kernel_grids(m, inputs, **{k: None for k in K.FAST}, chunk=0)
    block = dict(plan.blocks)["q"]
    assert grids[0][:2] == (-(-sizes["g"] * sizes["q"] // block), sizes["b"] * sizes["hk"]), (sizes, grids)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), text)


@pytest.mark.parametrize("tensor, read", [("tb[qb, xb]", "tb[q // 3, x // 16]"), ("bx[x]", "bx[q] * bx")])
def test_a_float_read_along_the_rows_from_another_wire_indexes_each_rows_own_query(tensor, read):
    """tb[q // 3, x // 16], or bx[q] of bx[x] (|q| = |x|), beside 4 heads packed into the
    rows: a row's q is its position (the packed row index runs over |g| |q|), so the read
    takes the position.  It took the packed index: every head past the first read another
    block's bias, and bx ran past its end (NaN).  Found by test_random_attention_diagrams_packed
    once the strategy drew a bias per tile."""
    name = tensor[:tensor.index("[")]
    text = (K.REPO / "examples" / "gqa.ncd").read_text()
    for old, new in (("wire b, hk, g, q, x", "wire b, hk, g, q, x" + (", qb, xb" if name == "tb" else "")),
                     ("wire d = 128", "wire d = 16"),
                     ("in V[b, hk, x, d] : fp16", f"in V[b, hk, x, d] : fp16\nin {tensor} : fp32"),
                     ("* |d|^-0.5", f"* |d|^-0.5 + {read}"), ("hold Q, K, V, O", f"hold Q, K, V, {name}, O"),
                     ("g by 1, q by 128", "g by 4, q by 16")):
        assert old in text
        text = text.replace(old, new)
    diagram = napkin.load_text(text, f"packed_{name}.ncd")
    assert lower.lower(diagram).pack == ("g", 4)
    m = K.compile_text(text, f"packed_{name}", diagram)
    inputs = m.example_inputs({"b": 1, "hk": 1, "g": 4, "q": 20, "x": 20 if name == "bx" else 37},
                              dtype=torch.float32, seed=1)
    K.assert_accurate(K.run(m, inputs), K.reference(m, inputs, torch.float64), K.reference(m, inputs), "packed")

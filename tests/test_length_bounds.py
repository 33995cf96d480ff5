"""A mask bounded by a length input: the loops read it, no ranges prepass.

A length input compared with an index (ragged decoding's ``x < n[b]``, a
window read at run time ``q - x < w``) is data, and until now such a mask
ran the ranges prepass (two kernels and torch's lists) at every launch.
When every conjunct of the mask is an affine bound once the length is read
(masks.exact_bounds with ``data``), the kernels' loop bounds read it
instead: each program loads it once (the masked step's own load) and its
range [_lo, _hi) and full blocks come from the same formulas as causal's
(codegen/bounds.py, clipped in int64).  Checked here:

* which masks take it (plan.bounds read the length, ``ranges.applies``
  false, no prepass kernel in the module; an ``or`` of bounds of one kind
  is one, ``x <= max(q, n - 1)``) and which keep the prepass: an ``or`` of
  a lower and an upper bound, a length along a wire the key lacks (dK/dV loops over GQA's g),
  a coarse read;
* forward and every gradient against float64 on ragged sizes, lengths of
  0, 1, on and off the blocks, past every key, negative and at int32's ends
  (the clip), per batch row;
* one launch a call: the prepass's kernels are gone;
* the Python side (masks.at_values, napkin.codegen.visited_blocks'
  lengths=): a length given is a constant, the blocks the kernel loads;
  one not given drops its bound.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import napkin
from napkin import masks
from napkin.bytecount import ByteCounter
from napkin.codegen import lower, ranges
import backward_helpers as B
import kernel_helpers as K


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("length_bounds"))
    yield
    K._FOLDER.pop()


def _text(mask: str, extra: str = "", key: str = "K[b, h, x, d]", query: str = "Q[b, h, q, d]",
          scores: str = "b, h, q, x", out: str = "b, h, q, d") -> str:
    held = "".join(f", {line.split()[1].split('[')[0]}" for line in extra.splitlines() if line.startswith("in "))
    return f"""diagram lb
wire b, h, q, x
wire d = 16
in Q[{query[2:-1]}] : fp32
in {key} : fp32
in V[{key[2:-1]}] : fp32
in n[b] : int32
in w : int32
{extra}
S[{scores}] = where({mask}, sum[d](Q * K) * |d|^-0.5, -inf)
P[{scores}] = softmax[x](S)
O[{out}] = sum[x](P * V)
out O

schedule on h100 {{
  accumulate fp32
  level hbm {{ hold Q, K, V, n, w{held}, O }}
  level smem {{
    group b by 1, h by 1, q by 32
    stream x by 16
    hold S, P
  }}
}}
"""


def _plan(text: str):
    return lower.lower(napkin.load_text(text, "lb.ncd"))


@pytest.mark.parametrize("mask, read, extra", [
    ("x <= q and q - x < v[h]", {"v"}, "in v[h] : int32"),   # per head: K has h
    ("x < n[b]", {"n"}, ""),
    ("x <= q and q - x < w", {"w"}, ""),
    ("x <= q + n[b] - |q| and x < n[b]", {"n"}, ""),
    ("x <= q and x < n[b] and q - x < w", {"n", "w"}, ""),
    ("n[b] > x", {"n"}, ""),                       # either side
    ("x >= q - w + 1", {"w"}, ""),                 # a lower bound alone
    ("x <= q or x < n[b]", {"n"}, ""),             # a prefix-LM's or: x <= max(q, n - 1), one bound
    ("(x <= q or x < n[b]) and q - x < w", {"n", "w"}, ""),
])
def test_a_mask_of_length_bounds_runs_no_prepass(mask, read, extra):
    plan = _plan(_text(mask, extra))
    assert not ranges.applies(plan)
    assert plan.full == plan.bounds
    assert set(masks.lengths_read(plan.bounds)) == read
    m = K.compile_text(_text(mask, extra), f"lb_{zlib.crc32(mask.encode())}")
    assert not any(name.endswith("_ranges_kernel") for name in vars(m))


@pytest.mark.parametrize("mask, extra", [
    ("x <= q and (q - x < w or x < n[b])", ""),                  # an or of a lower and an upper bound: two runs
    ("x < n[b] and doc[b, q] == doc", "in doc[b, x] : int32"),   # a conjunct of ids beside it
])
def test_a_mask_that_reads_more_keeps_the_prepass(mask, extra):
    plan = _plan(_text(mask, extra))
    assert ranges.applies(plan)
    assert not any(b.lengths_read for b in plan.bounds)


def test_a_length_along_a_wire_the_key_lacks_keeps_the_prepass():
    """GQA's per-query-head window w[g]: the dK/dV kernel loops over g inside a
    program, so no program has one value of it."""
    text = _text("x <= q and q - x < v[g]", "in v[g] : int32", key="K[b, h, x, d]",
                 query="Q[b, h, g, q, d]", scores="b, h, g, q, x", out="b, h, g, q, d") \
        .replace("wire b, h, q, x", "wire b, h, g, q, x") \
        .replace("group b by 1, h by 1, q by 32", "group b by 1, h by 1, g by 1, q by 32")
    plan = _plan(text)
    assert ranges.applies(plan)
    assert [b.lengths_read for b in plan.bounds] == [frozenset()]   # x <= q alone


CASES = [   # n per batch row (b = 4), w, sizes (q, x)
    ((0, 1, 17, 53), 5, (53, 53)),
    ((53, 16, 32, 40), 2, (53, 53)),               # two keys a row at most
    ((7, 100, 48, 33), 2 ** 31 - 1, (45, 70)),     # past every key; no window (int32's largest)
    ((20, 30, 40, 50), -2 ** 31, (37, 50)),        # a window of nothing (int32's least)
    ((3, 64, 64, 9), 33, (64, 64)),                # on the blocks
]


@pytest.mark.parametrize("n, w, qx", CASES)
def test_forward_and_gradients_against_float64(n, w, qx):
    """x <= q + |x| - |q| (the queries at the end of the keys), x < n[b] and a
    window q - x < w, float32, blocks 32 x 16 (and 16 x 16 forward)."""
    text = _text("x <= q + |x| - |q| and x < n[b] and q - x < w")
    m = K.compile_text(text, "lb_all")
    assert not any(name.endswith("_ranges_kernel") for name in vars(m))
    q, x = qx
    gen = torch.Generator().manual_seed(sum(n) + q)
    Q = torch.randn(4, 2, q, 16, generator=gen)
    Kt, V = (torch.randn(4, 2, x, 16, generator=gen) for _ in range(2))
    inputs = [Q, Kt, V, torch.tensor(n, dtype=torch.int32), torch.tensor(w, dtype=torch.int32)]
    for blocks in ({"block_q": 32, "block_x": 16}, {"block_q": 16, "block_x": 16}):
        out = K.run(m, inputs, **blocks)
        K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), f"{n} {w} {blocks}")
    got = B.gradients(m.lb, inputs, block_q=32, block_x=16)
    exact = B.gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    B.assert_accurate(got, exact, B.gradients(m.reference, inputs), f"{n} {w}")


def test_one_launch_a_call():
    """The runtime window's forward: its kernel alone (the prepass ran two and torch's lists)."""
    m = K.example("runtime_window", ("fp16", "fp32"))
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 40, "x": 40}, dtype=torch.float32, seed=3)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m.runtime_window(*inputs, block_q=16, block_x=16)
    assert bc.launches == 1


def test_visited_blocks_take_the_lengths_the_kernel_reads():
    """napkin.codegen.visited_blocks with lengths= is the runtime window's blocks at that width (the
    diagram with it written in), without them causal's; the kernel's K loads are those blocks'."""
    from napkin.codegen import visited_blocks

    text = (K.REPO / "examples" / "runtime_window.ncd").read_text()
    d = napkin.load_text(text, "runtime_window.ncd")
    fixed = napkin.load_text(text.replace("q - x < w", "q - x < 20"), "fixed.ncd")
    sizes = {"b": 1, "h": 1, "q": 70, "x": 70}
    got = visited_blocks(d, sizes, 16, 16, lengths={"w": 20})
    assert got == visited_blocks(fixed, sizes, 16, 16)
    assert set(got) < set(visited_blocks(d, sizes, 16, 16)) == {(i, j) for i in range(5) for j in range(i + 1)}
    m = K.example("runtime_window", ("fp16", "fp32"), ("d = 64", "d = 16"))
    inputs = (*m.example_inputs(sizes, dtype=torch.float32, seed=5)[:-1], torch.tensor(20, dtype=torch.int32))
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m.runtime_window(*inputs, block_q=16, block_x=16)
    assert bc.loads["K"] == sum(min(16, 70 - 16 * j) for _, j in got) * 16 * 4


def test_at_values_reads_a_given_length_and_drops_an_unknown_one():
    plan = _plan(_text("x <= q and x < n[b] and q - x < w"))
    bounds = plan.bounds
    assert [sorted(b.lengths_read) for b in bounds] == [[], ["n"], ["w"]]
    with pytest.raises(ValueError, match="the bound reads the length n, known at run time alone"):
        bounds[1].value(0, {})
    known = masks.at_values(bounds, {"n": 40})
    assert len(known) == 2 and all(not b.lengths_read for b in known)
    assert known[1].value(7, {}) == 39 and known[0].value(7, {}) == 7
    assert masks.at_values(bounds, {"n": 40, "w": 4})[2].value(9, {}) == 6   # x >= q - w + 1


def test_a_window_per_head_against_float64():
    """v[h]: a window width per head (K has h, so dK/dV's programs each have one), ragged sizes."""
    m = K.compile_text(_text("x <= q and q - x < v[h]", "in v[h] : int32"), "lb_per_head")
    gen = torch.Generator().manual_seed(11)
    Q, Kt, V = (torch.randn(2, 2, 45, 16, generator=gen) for _ in range(3))
    inputs = [Q, Kt, V, torch.tensor([3, 40], dtype=torch.int32), torch.tensor(0, dtype=torch.int32),
              torch.tensor([2, 19], dtype=torch.int32)]
    assert m.INPUTS == ("Q", "K", "V", "n", "w", "v")
    out = K.run(m, inputs, block_q=32, block_x=16)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), "per head")
    got = B.gradients(m.lb, inputs, block_q=32, block_x=16)
    exact = B.gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    B.assert_accurate(got, exact, B.gradients(m.reference, inputs), "per head")

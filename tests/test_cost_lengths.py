"""napkin cost --lengths: a length input read as one value at every index.

A mask of length bounds (ragged decoding's ``x < n[b]``, the runtime
window's ``q - x < w``, the prefix-LM's ``x <= q or x < p[b]``, one bound
``x <= max(q, p - 1)``) has its loops bounded by the length, and
``--lengths`` gives the cost pass its value (masks.at_values).  One that
reads a length in an ``or`` that is no bound (sinks read at run time beside
a window: ``x <= q and (q - x < 48 or x < p[b])``) finds its blocks with the
ranges prepass, so without the values the cost pass counts every block;
with ``--lengths p=N`` the mask compares indices alone and the counts are
the blocks the prepass finds live on it (napkin/cost/lengths.py).  Checked
here:

* the bytes the kernels move (napkin.bytecount) with the input filled with
  that value equal the counted ones, tensor by tensor, for the prefix-LM's
  and the sinks' forward and backward's kernels, for ragged decoding's chunked,
  packed forward and for the runtime window's forward and backward, at
  ragged sizes and several values;
* that the counts drop below the dense ones, and the note says what they are;
* that the option refuses, in words, what it cannot price.
"""
from __future__ import annotations

import json

import pytest
import torch

import napkin
from napkin.bytecount import ByteCounter
from napkin.cost import analyse, with_blocks
from napkin.cost.backward import backward_cost
from napkin.errors import NapkinError
import kernel_helpers as K
from cost_helpers import backward_bytes, predicted_bytes, without_tensors


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("lengths"))
    yield
    K._FOLDER.pop()


PREFIX = (K.REPO / "examples" / "prefix_lm.ncd").read_text()
RAGGED = (K.REPO / "examples" / "ragged_decode.ncd").read_text().replace("bf16", "fp16")  # the interpreter's bf16 dot


# attention sinks whose count is read at run time beside a causal window: an or of a lower and an
# upper bound (two runs of keys a row), so the ranges prepass, which --lengths prices as it finds
SINKS = "x <= q and (q - x < 48 or x < p[b])"


@pytest.mark.parametrize("mask, prefix", [*((None, p) for p in (1, 37, 96, 149, 400)),
                                          *((SINKS, p) for p in (1, 37, 149))])
def test_the_prefix_lm_counts_are_the_bytes_its_kernels_move(mask, prefix):
    """p[b] = prefix in every batch row: on and off the 16-key blocks, inside
    the first row block, the last key, past every key.  Forward, training
    forward and the backward's kernels, at 150 tokens, blocks 32 x 16.  The
    prefix-LM's loops read p (its or is one bound); the sinks' prepass finds
    the blocks (a launch's prepass kernels counted too)."""
    text = PREFIX.replace("d = 64", "d = 32")
    text = text if mask is None else text.replace("x <= q or x < p[b]", mask)
    m = K.compile_text(text, "lengths_prefix" if mask is None else "lengths_sinks")
    d = napkin.load_text(text, "prefix_lm.ncd")
    n, blocks = 150, {"q": 32, "x": 16}
    sizes = {"b": 2, "h": 2, "q": n, "x": n}
    q, k, v, _ = m.example_inputs(sizes, dtype=torch.float16, seed=prefix)
    inputs = (q, k, v, torch.full((2,), prefix, dtype=torch.int32))
    lengths = {"p": prefix}
    report = analyse(with_blocks(d, blocks), sizes, lengths=lengths)
    what = "they visit" if mask is None else "the kernels' ranges prepass finds live"
    assert f"the counts are the blocks {what} when p = {prefix} at every index (--lengths)" in " ".join(report.notes)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m.prefix_lm(*inputs, block_q=32, block_x=16)
    assert (without_tensors(bc.loads), without_tensors(bc.stores)) == \
        predicted_bytes(report)
    dense = analyse(with_blocks(d, blocks), sizes)
    # below dense unless it keeps every block (dense: the causal triangle, every block of it)
    assert (report_bytes(report, "K") < report_bytes(dense, "K")) == (prefix < n - 16)

    back = backward_cost(with_blocks(d, blocks), sizes, given=True, lengths=lengths)
    options = tuple({"block_q": 32, "block_x": 16}.get(o) for o in m._OPTIONS)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        outs, saved = m._prefix_lm_forward(*inputs, *options, True)
    assert (without_tensors(bc.loads), without_tensors(bc.stores)) == \
        predicted_bytes(back.forward)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m._prefix_lm_grads(inputs, (*outs, *saved), grads, options, None)
    assert (without_tensors(bc.loads), without_tensors(bc.stores)) == \
        (without_tensors(backward_bytes(back, "load")), without_tensors(backward_bytes(back, "store")))


@pytest.mark.parametrize("length, chunk", [(1, None), (64, None), (65, 128), (299, 128), (300, 256)])
def test_ragged_decoding_counts_the_cache_up_to_the_length(length, chunk):
    """n[b] = length in every sequence: ragged decoding's packed (g, q) rows,
    in chunks of the cache (the schedule's 1024, or chunk=) or whole, load
    the blocks up to the length and no further, as counted."""
    m = K.compile_text(RAGGED, "lengths_ragged")
    # the launch's chunk= is the schedule's chunk to the cost pass
    d = napkin.load_text(RAGGED if chunk is None else RAGGED.replace("group x by 1024", f"group x by {chunk}"),
                         "ragged_decode.ncd")
    sizes = {"b": 3, "hk": 2, "g": 4, "q": 3, "x": 300}
    gen = torch.Generator().manual_seed(length)
    Q, Kc, Vc = (torch.randn(shape, generator=gen).half() for shape in
                 ((3, 8, 3, 128), (3, 2, 300, 128), (3, 2, 300, 128)))
    inputs = (Q, Kc, Vc, torch.full((3,), length, dtype=torch.int32))
    report = analyse(d, sizes, lengths={"n": length})
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m.ragged_decode(*inputs, **({} if chunk is None else {"chunk": chunk}))
    # the packed rows' positions: the main kernel's reads and the prepass's scan's
    loads, stores = without_tensors(bc.loads, "n"), without_tensors(bc.stores, "n")
    want_loads, want_stores = predicted_bytes(report, "n")
    assert stores == want_stores and loads == want_loads
    assert 0 < report_bytes(report, "_pos_q") == bc.loads["_pos_q"]
    # the keys counted are the 64-key blocks up to the length, per sequence and kv head
    assert want_loads["K"] == 3 * 2 * min(300, -(-length // 64) * 64) * 128 * 2


WINDOW = (K.REPO / "examples" / "runtime_window.ncd").read_text().replace("d = 64", "d = 32")


@pytest.mark.parametrize("width", [1, 16, 37, 150, 2 ** 31 - 1])
def test_the_runtime_window_counts_are_the_bytes_its_kernels_move(width):
    """w = width: the loops' bounds read it (no prepass), so the counts at --lengths w=width are the
    blocks they visit, forward and backward, tensor by tensor; without a value the window's bound is
    left out: causal's blocks, an upper bound, and the note says which."""
    m = K.compile_text(WINDOW, "lengths_window")
    d = napkin.load_text(WINDOW, "runtime_window.ncd")
    n, blocks = 150, {"q": 32, "x": 16}
    sizes = {"b": 2, "h": 2, "q": n, "x": n}
    q, k, v, t, _ = m.example_inputs(sizes, dtype=torch.float16, seed=width % 1000)
    inputs = (q, k, v, t, torch.tensor(width, dtype=torch.int32))
    report = analyse(with_blocks(d, blocks), sizes, lengths={"w": width})
    notes = " ".join(report.notes)
    assert (f"the kernels' loops are bounded by w at run time, each program loading it (no ranges prepass): "
            f"the counts are the blocks they visit when w = {width} (--lengths)") in notes
    assert "prepass finds" not in notes
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m.runtime_window(*inputs, block_q=32, block_x=16)
    assert (without_tensors(bc.loads), without_tensors(bc.stores)) == predicted_bytes(report)
    assert bc.launches == 1
    causal = analyse(with_blocks(d, blocks), sizes)
    assert "the counts leave out the bounds that read w (an upper bound" in " ".join(causal.notes)
    assert (report_bytes(report, "K") < report_bytes(causal, "K")) == (width < n - 16)

    back = backward_cost(with_blocks(d, blocks), sizes, given=True, lengths={"w": width})
    options = tuple({"block_q": 32, "block_x": 16}.get(o) for o in m._OPTIONS)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        outs, saved = m._runtime_window_forward(*inputs, *options, True)
    assert (without_tensors(bc.loads), without_tensors(bc.stores)) == predicted_bytes(back.forward)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m._runtime_window_grads(inputs, (*outs, *saved), grads, options, None)
    assert (without_tensors(bc.loads), without_tensors(bc.stores)) == \
        (without_tensors(backward_bytes(back, "load")), without_tensors(backward_bytes(back, "store")))


def report_bytes(report, tensor: str) -> int:
    return sum(t.bytes for t in report.transfers if t.tensor == tensor)


def _cli(capsys, *args):
    from napkin.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


SIZES = ("-D", "b=2", "-D", "h=4", "-D", "q=1000", "-D", "x=1000")


def test_the_cli_prices_the_prefix_and_says_so(capsys):
    code, out, err = _cli(capsys, "cost", "examples/prefix_lm.ncd", *SIZES, "--lengths", "p=200")
    assert code == 0, err
    assert ("note: the kernels' loops are bounded by p at run time, each program loading it (no ranges prepass): "
            "the counts are the blocks they visit when p = 200 at every index (--lengths)") in out
    code, dense, err = _cli(capsys, "cost", "examples/prefix_lm.ncd", *SIZES)
    assert "--lengths NAME=N counts them where the length input holds N" in dense
    backward = {}
    for extra in ((), ("--lengths", "p=200")):
        code, out, err = _cli(capsys, "cost", "examples/prefix_lm.ncd", *SIZES, *extra, "--backward", "--json")
        assert code == 0, err
        backward[extra] = json.loads(out)["backward"]["load_bytes"]
    assert backward[("--lengths", "p=200")] < 0.75 * backward[()]   # about causal's half, and the prefix
    code, out, err = _cli(capsys, "cost", "examples/prefix_lm.ncd", *SIZES, "--lengths", "p=200", "--tune",
                          "--top", "1")
    assert code == 0 and "best blocks for prefix_lm" in out


@pytest.mark.parametrize("args, message", [
    (("examples/prefix_lm.ncd", "--lengths", "q=5"),
     "--lengths q=5: q is no tensor, not a length input (those of diagram prefix_lm: p)"),
    (("examples/prefix_lm.ncd", "--lengths", "K=5"),
     "--lengths K=5: K is an input, not a length input (those of diagram prefix_lm: p)"),
    (("examples/document_mask.ncd", "--lengths", "doc=5"),
     "--lengths doc=5: diagram document_mask has no length input (an integer input compared with an index of "
     "a wire it is not read along, as x < n[b])"),
    (("examples/prefix_lm.ncd", "--lengths", "p=0"),
     "--lengths p=0: the length p must be a positive whole number, not '0'"),
    (("examples/prefix_lm.ncd", "--lengths", "p=5", "--lengths", "p=6"),
     "--lengths p=6: p is already given (p=5)"),
    (("examples/prefix_lm.ncd", "--lengths", "p=5", "--docs", "100"),
     "--lengths and --docs together are not priced: the documents' blocks leave the lengths out; give one of them"),
    (("examples/prefix_lm.ncd", "--lengths", "p=5", "--dtypes", "fp16"),
     "--lengths prices the schedule or a tile search; --dtypes prints another report"),
])
def test_the_cli_refuses_what_it_cannot_price(capsys, args, message):
    code, out, err = _cli(capsys, "cost", *args, *SIZES)
    assert code == 1 and message in err, err


def test_lengths_need_the_sizes_and_a_mask_that_reads_them():
    d = napkin.load(K.REPO / "examples" / "prefix_lm.ncd")
    with pytest.raises(NapkinError, match=r"--lengths counts blocks at given sizes: give b, h, q, x too"):
        analyse(d, {}, lengths={"p": 5})
    # p read beside ids: the mask reads more than the lengths, so nothing it prices changes
    both = napkin.load_text(PREFIX.replace("in p[b] : int32", "in p[b] : int32\nin doc[b, x] : int32")
                            .replace("x <= q or x < p[b]", "(x <= q or x < p[b]) and doc[b, q] == doc")
                            .replace("hold Q, K, V, p, O", "hold Q, K, V, p, doc, O"), "both.ncd")
    with pytest.raises(NapkinError, match=r"--lengths: p = 5 changes nothing napkin prices for diagram prefix_lm: "
                                          r"no ranges prepass of its kernels reads only these lengths and indices"):
        analyse(both, {"b": 1, "h": 1, "q": 64, "x": 64}, lengths={"p": 5})


def test_report_and_render_count_at_the_lengths(tmp_path, capsys):
    """napkin report and napkin render take --lengths as napkin cost does (and as they take --docs):
    the report's note and K's row are the prefix's, the picture's edges too; --no-costs refuses it."""
    path = "examples/prefix_lm.ncd"
    sizes = ["-D", "b=1", "-D", "h=16", "-D", "q=8192", "-D", "x=8192"]
    for name, extra in (("prefix", ("--lengths", "p=1024")), ("dense", ())):
        code, out, err = _cli(capsys, "report", path, *sizes, *extra, "-o", str(tmp_path / f"{name}.html"))
        assert code == 0, err
        code, out, err = _cli(capsys, "render", path, *sizes, *extra, "-o", str(tmp_path / f"{name}.dot"))
        assert code == 0, err
    prefix, dense = ((tmp_path / f"{n}.html").read_text() for n in ("prefix", "dense"))
    assert "when p = 1024 at every index (--lengths)" in prefix and "p = 1024" not in dense
    k_row = '<td>K</td><td>load</td><td>fp16</td><td><code>b*d*h*q*x/g_q</code></td><td class="num">{}</td>'
    assert k_row.format("537M") in dense and k_row.format("537M") not in prefix
    pictures = [(tmp_path / f"{n}.dot").read_text() for n in ("prefix", "dense")]
    assert "HBM&#8594;SMEM: 1.07 GB" in pictures[1] and "HBM&#8594;SMEM: 1.07 GB" not in pictures[0]
    code, out, err = _cli(capsys, "render", path, "--lengths", "p=5", "--no-costs", "-o", str(tmp_path / "r.dot"))
    assert code == 1 and err.strip() == \
        "napkin: --lengths prices the byte counts on the edges, which --no-costs leaves off: give one"
    code, out, err = _cli(capsys, "report", "examples/causal.ncd", "--lengths", "p=5", "-o", str(tmp_path / "c.html"))
    assert code == 1 and "--lengths p=5: diagram causal has no length input" in err, err

"""The cost pass's bytes against the bytes the generated kernels move, on
random attention diagrams (tests/strategies.py), forward and backward.

tests/test_bytecount.py holds the bundled examples to this; a feature no
example has goes uncounted there: an fp32 output beside fp16 inputs, whose
dO the launcher rounds to fp16 for the rows kernel, was priced at fp32 (found
here, session 56).  Each drawn diagram is compiled, run at its
schedule's blocks under napkin.bytecount.ByteCounter, and its loads and
stores per tensor compared with napkin.cost's, exactly.  Two things are left
out, each for its reason:

* the loads of a tensor read at a wire's blocks (tb[q // 16, x // 40]): the
  interpreter counts a load per lane, the cost pass the distinct cells a
  tile meets, which the GPU's cache serves the repeats of;
* diagrams with a document mask: its ranges prepass (kept across calls or
  not, its lists in torch) is test_bytecount.py's to count, on the bundled
  document examples (assert_prepassed);
* a length input (x < n[b], q - x < w) is filled with one value, given to
  the cost pass as --lengths gives it;
* masks with a remainder (``(q - x) % 2 == 0``): the cost pass takes every
  tile a remainder cuts for live, which only a tile of one row and one key
  (q = 1 beside |x| = 33 at blocks of 32: key 32 alone, q - x even) is not;
  the prepass finds it dead and the kernel skips one tile the cost pass
  prices (checked by hand, 32 bytes of K in 1,056; left as it is).
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the byte counter counts only under TRITON_INTERPRET=1", allow_module_level=True)

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402

from backward_helpers import compile_text  # noqa: E402
from cost_helpers import backward_bytes, gathered_reads, predicted_bytes, triton_launches, without_tensors  # noqa: E402
from napkin import ir  # noqa: E402
from napkin.bytecount import ByteCounter  # noqa: E402
from napkin.cost import analyse  # noqa: E402
from napkin.cost.backward import backward_cost  # noqa: E402
from napkin.printer import to_text  # noqa: E402
from strategies import attention_diagrams, drawn_sizes  # noqa: E402


@settings(max_examples=12, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(diagram=attention_diagrams())
def test_counted_bytes_equal_the_cost_pass_on_random_diagrams(diagram, tmp_path_factory):
    assume(not any(t.name == "doc" for t in diagram.inputs))
    text = to_text(diagram)
    assume("%" not in text)
    key = f"counted_{zlib.crc32(text.encode()):08x}"
    m = compile_text(text, key, tmp_path_factory.mktemp("counted"), diagram)
    sizes = drawn_sizes(diagram, zlib.crc32(key.encode()))
    dtype = {"fp16": torch.float16, "fp32": torch.float32}[diagram.inputs[0].dtype]
    inputs = m.example_inputs(sizes, dtype=dtype, seed=2)
    # each length input at one value, about half its wire, the cost pass told (--lengths)
    lengths = {n: max(1, sizes[w] // 2 + 3) for n, w in ir.length_inputs(diagram)}
    inputs = [torch.full_like(t, lengths[n]) if n in lengths else t for n, t in zip(m.INPUTS, inputs)]
    coarse = gathered_reads(diagram)
    none = (None,) * len(m._OPTIONS)
    forward = getattr(m, f"_{diagram.name}_forward")
    backward = getattr(m, f"_{diagram.name}_grads")
    # a mask of indices alone keeps its ranges across calls: the cost pass counts a launch after the first
    kept = getattr(m, f"_{diagram.name.upper()}_RANGES_KEPT", None) is not None
    if kept:
        forward(*inputs, *none, True)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        outs, saved = forward(*inputs, *none, True)
    cost = backward_cost(diagram, sizes, lengths=lengths or None)
    loads, stores = predicted_bytes(cost.forward, *coarse)
    assert without_tensors(bc.loads, *coarse) == loads, text
    assert without_tensors(bc.stores) == stores, text
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    if kept:
        backward(inputs, (*outs, *saved), grads, none, None)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        backward(inputs, (*outs, *saved), grads, none, None)
    assert bc.launches == triton_launches(cost), text
    # torch's part (a gated value's product and gradients) left out: the counter sees Triton's
    assert without_tensors(bc.loads, *coarse) == without_tensors(backward_bytes(cost, "load"), *coarse), text
    assert without_tensors(bc.stores) == without_tensors(backward_bytes(cost, "store")), text


def test_the_forward_bytes_are_the_analysis_ones():
    """cost.forward above is napkin.cost.analyse's report of the training forward (it stores
    the row state too): the same transfers as analysing the diagram itself, where it has lse."""
    import napkin
    from pathlib import Path

    d = napkin.load(Path(__file__).resolve().parent.parent / "examples" / "causal.ncd")
    sizes = {"b": 1, "h": 2, "q": 70, "x": 70}
    assert predicted_bytes(backward_cost(d, sizes).forward) == predicted_bytes(analyse(d, sizes))

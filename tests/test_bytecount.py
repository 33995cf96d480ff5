"""The byte counter (napkin/bytecount.py) on small hand-written Triton kernels.

Each test predicts by hand, from the kernel's own loop structure, the bytes
its masked loads and stores move, and checks the counter agrees exactly:
masked-out lanes must not count, every call must, and bytes must land on the
right tensor.  (tests/test_cost.py uses the counter on napkin's generated
kernels.)
"""
from __future__ import annotations

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the byte counter counts only under TRITON_INTERPRET=1", allow_module_level=True)

import triton
import triton.language as tl

from napkin.bytecount import ByteCounter


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(x_ptr + offs, mask=keep, other=0.0)
    tl.store(y_ptr + offs, x * 2, mask=keep)


@triton.jit
def _tiled_matmul(a_ptr, b_ptr, c_ptr, M, N, K,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _descriptor_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0) * BLOCK
    src = tl.make_tensor_descriptor(x_ptr, shape=[n], strides=[1], block_shape=[BLOCK])
    dst = tl.make_tensor_descriptor(y_ptr, shape=[n], strides=[1], block_shape=[BLOCK])
    dst.store([start], src.load([start]))


@pytest.mark.parametrize("n", [1, 100, 128, 333])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_copy_counts_only_live_lanes(n, dtype):
    x = torch.randn(n, dtype=dtype)
    y = torch.empty_like(x)
    with ByteCounter(tensors={"x": x, "y": y}) as bc:
        _scale_kernel[(triton.cdiv(n, 64),)](x, y, n, BLOCK=64)
    size = x.element_size()
    assert bc.launches == 1
    assert dict(bc.loads) == {"x": n * size}
    assert dict(bc.stores) == {"y": n * size}
    assert bc.load_calls == bc.store_calls == triton.cdiv(n, 64)
    torch.testing.assert_close(y, x * 2)


@pytest.mark.parametrize("m,n,k", [(64, 64, 64), (50, 70, 40), (33, 17, 100)])
def test_tiled_matmul_rereads(m, n, k):
    """A is re-read once per column block, B once per row block: the
    textbook H = abc(1/g_a + 1/g_c) + ac, exact with ragged edges."""
    bm, bn, bk = 32, 32, 16
    a, b = torch.randn(m, k), torch.randn(k, n)
    c = torch.empty(m, n)
    with ByteCounter(tensors={"A": a, "B": b, "C": c}) as bc:
        _tiled_matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn))](a, b, c, m, n, k, BM=bm, BN=bn, BK=bk)
    assert bc.loads["A"] == m * k * math.ceil(n / bn) * 4
    assert bc.loads["B"] == k * n * math.ceil(m / bm) * 4
    assert dict(bc.stores) == {"C": m * n * 4}
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)


def test_tensor_descriptor_loads_are_counted():
    """Descriptor loads and stores clip at the tensor's edge: the padding moves nothing."""
    n = 150
    x = torch.arange(n, dtype=torch.float32)
    y = torch.zeros_like(x)
    with ByteCounter(tensors={"x": x, "y": y}) as bc:
        _descriptor_copy[(triton.cdiv(n, 64),)](x, y, n, BLOCK=64)
    assert dict(bc.loads) == {"x": n * 4}
    assert dict(bc.stores) == {"y": n * 4}
    assert torch.equal(x, y)


def test_unnamed_tensors_fall_back_to_parameter_names_and_views_share_storage():
    x = torch.randn(2, 100)
    y = torch.empty(100)
    with ByteCounter() as bc:
        _scale_kernel[(2,)](x[1], y, 100, BLOCK=64)   # a view: bytes go to x's storage
    assert dict(bc.loads) == {"x_ptr": 400}
    assert dict(bc.stores) == {"y_ptr": 400}


def test_counter_restores_the_interpreter():
    from triton.runtime import interpreter

    before = (interpreter.InterpreterBuilder.create_masked_load,
              interpreter.InterpreterBuilder.create_masked_store,
              interpreter.GridExecutor._init_args_hst)
    with ByteCounter():
        pass
    with pytest.raises(ZeroDivisionError):
        with ByteCounter():
            1 / 0
    after = (interpreter.InterpreterBuilder.create_masked_load,
             interpreter.InterpreterBuilder.create_masked_store,
             interpreter.GridExecutor._init_args_hst)
    assert before == after
    # and nothing is counted outside the block
    x, y = torch.randn(10), torch.empty(10)
    with ByteCounter() as bc:
        pass
    _scale_kernel[(1,)](x, y, 10, BLOCK=16)
    assert bc.total == 0 and bc.launches == 0


# --------------------------------------------------------------------------
# The cost pass's predictions against napkin's generated kernels.
# --------------------------------------------------------------------------

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import napkin  # noqa: E402
from napkin import ir  # noqa: E402
from napkin.codegen import lower  # noqa: E402
from napkin.cost import analyse, packing, with_blocks  # noqa: E402
from napkin.cost.cli import recast  # noqa: E402
from napkin.cost.tune import searchable  # noqa: E402
from cost_helpers import (backward_bytes, coarse_wires, gathered_reads, triton_launches,  # noqa: E402
                          triton_transfers)
from napkin.errors import NapkinError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ALL_EXAMPLES = sorted((REPO / "examples").glob("*.ncd"))
# Examples that exist for the cost model alone: the code generator refuses them
# (an unfused schedule, fp8 inputs), so there is no kernel whose bytes to count.
# test_cost_only_examples_are_refused fails the day codegen emits one of them,
# so it then joins the counted examples.
COST_ONLY = {"naive_attention": "unfused", "attention_fp8": "e4m3"}
EXAMPLES = [p for p in ALL_EXAMPLES if p.stem not in COST_ONLY]

# (first sequence size, second sequence size, blocks for the searchable wires in
# schedule order, as the launcher takes them: see case_blocks): aligned, ragged
# both ways, and blocks that differ per case.
CASES = [(64, 64, (16, 32, 16)), (50, 70, (32, 16, 16)), (97, 33, (16, 16, 32))]
# Masked diagrams also run where the mask skips many blocks (the window is 256).
MASKED_CASE = (400, 330, (64, 32, 16))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Each example compiled once into a temporary folder: name -> module or
    the NapkinError saying why napkin cannot emit it."""
    from napkin.codegen import write_module

    out, modules = tmp_path_factory.mktemp("generated"), {}
    for path in ALL_EXAMPLES:
        try:
            target = write_module(path, out)
        except NapkinError as err:
            modules[path.stem] = err
            continue
        spec = importlib.util.spec_from_file_location(f"napkin_counted_{path.stem}", target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module   # Triton's JIT looks kernels' source up through it
        spec.loader.exec_module(module)
        modules[path.stem] = module
    yield modules
    for path in ALL_EXAMPLES:
        sys.modules.pop(f"napkin_counted_{path.stem}", None)


def single_device(d: ir.Diagram) -> ir.Diagram:
    """The kernel a distributed schedule compiles to runs one device's share:
    the schedule without its device-mesh levels (nodes, devices)."""
    levels = tuple(lv for lv in d.schedule.levels if lv.name not in ir.MESH_LEVELS)
    return dataclasses.replace(d, schedule=dataclasses.replace(d.schedule, levels=levels))


def case_sizes(d: ir.Diagram, n1: int, n2: int) -> dict[str, int]:
    """n1 for the first sequence-like wire (q, m, k), n2 for the second (x, n);
    heads small; wires a relabel ties together get equal sizes."""
    small = {"b": 1, "h": 2, "hk": 2, "g": 2}
    sizes = {w.name: small.get(w.name, n2 if w.name in ("x", "n") else n1) for w in d.wires
             if w.size is None and w.name not in coarse_wires(d)}
    for let in d.lets:
        for r in ir.walk(let.expr):
            if isinstance(r, ir.TensorRef) and r.wires:
                for declared, read in zip(ir.axis_wires(d.tensor(r.name).axes), r.wires):
                    if declared in sizes and read in sizes:
                        sizes[read] = sizes[declared]
    return sizes


def case_blocks(d: ir.Diagram, block_list) -> tuple[dict, dict]:
    """(the blocks the cost pass is given, the launcher's block options) for a
    case's blocks of the searchable wires.  They are the launcher's
    block_<wire>; with packed rows (napkin/cost/packing.py: flash_decoding's
    g by 4 beside q by 4) block_q is the packed block, the (g, q) pairs a
    program holds, so the cost pass gets q's group as that over g's, and the
    launcher no block_g: the packed rows the cost pass is given are the
    launcher's block_q."""
    launch = dict(zip(searchable(d), block_list))
    blocks = packing.schedule_blocks(d, launch)
    pack = packing.find(with_blocks(d, blocks))
    if pack is not None:
        assert pack.block == launch[pack.row] and pack.wire not in launch
    return blocks, launch


def predicted(d: ir.Diagram, sizes, blocks) -> tuple[dict, dict]:
    loads, stores = defaultdict(int), defaultdict(int)
    for t in triton_transfers(analyse(with_blocks(d, blocks), sizes)):
        (loads if t.direction == "load" else stores)[t.tensor] += t.bytes
    return dict(loads), dict(stores)


def prepassed(module, d: ir.Diagram) -> bool:
    """A mask that reads data (document ids): its launcher runs the ranges
    prepass (codegen/ranges.py) before each kernel, and its kernels skip the
    blocks it finds dead, which the cost pass, without the data, counts."""
    return hasattr(module, f"_{d.name}_ranges")


def looped(module, d: ir.Diagram) -> bool:
    """A mask whose loop bounds read a length input (x < n[b], q - x < w): no prepass; the cost
    pass, without the value, leaves those bounds out (masks.at_values)."""
    plan = lower.lower(d)
    return plan.family == "attention" and not prepassed(module, d) and any(b.lengths_read for b in plan.bounds)


def reads_data(module, d: ir.Diagram) -> bool:
    """Either: counted on one_document's inputs, against assert_prepassed's rule."""
    return prepassed(module, d) or looped(module, d)


def one_document(module, inputs, sizes) -> list:
    """The inputs with every id 0, every bool true and every length its wire's whole size
    (module._LENGTH_INPUTS: x < n[b]): every block live, as the cost pass counts."""
    lengths = module._LENGTH_INPUTS
    return [t if t.is_floating_point() else torch.full_like(t, sizes[lengths[n]]) if n in lengths
            else torch.ones_like(t) if t.dtype == torch.bool else torch.zeros_like(t)   # a bool mask keeps all
            for n, t in zip(module.INPUTS, inputs)]


def assert_prepassed(module, counted, predicted) -> None:
    """A data mask's counts against the cost pass's, both without the ids
    (without_ids).  The cost pass prices every block of a mask the data
    bounds.  With every id 0 that is every block the kernels visit.  With
    lengths at their wire's whole size a mask may still skip blocks
    (ragged_decode's x <= q + n[b] - |q| is causal then; prefix_lm's
    x <= q or x < p[b] keeps everything), so a tensor's counted loads are at
    most the predicted ones; test_ragged.py and test_prefix_lm.py count the
    live blocks exactly; the stores must still be equal (the prepass's
    buffers' among them, its scan and merge visiting every block)."""
    counted, predicted = without_ids(module, *counted), without_ids(module, *predicted)
    if not module._LENGTH_INPUTS:
        assert counted == predicted
        return
    (loads, stores), (want_loads, want_stores) = counted, predicted
    assert stores == want_stores and loads.keys() == want_loads.keys()
    assert all(loads[k] <= want_loads[k] for k in loads), (loads, want_loads)


def without_ids(module, *counts) -> list[dict]:
    """The counts without the ids' bytes (a full block's step reads none: only
    the mask does, which the cost pass still counts)."""
    ids = {n for n, dt in module._DTYPES.items() if dt in ir.INT_DTYPES}
    return [{k: v for k, v in c.items() if k not in ids} for c in counts]


def counted(module, d: ir.Diagram, sizes, launch, dtype) -> tuple[dict, dict, int]:
    """Bytes the launch at the launcher's blocks ``launch`` moves."""
    inputs = module.example_inputs(sizes, dtype=dtype)
    if reads_data(module, d):
        inputs = one_document(module, inputs, sizes)
    options = {f"block_{w}": b for w, b in launch.items()}
    if keeps(module, d):   # a launch after the first, as the cost pass counts it
        getattr(module, d.name)(*inputs, **options)
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        getattr(module, d.name)(*inputs, **options)
    return dict(bc.loads), dict(bc.stores), bc.launches


def keeps(module, d: ir.Diagram) -> bool:
    """Whether the module keeps its ranges across calls (a mask of indices
    alone: its own dict), so that a launch after the first runs no prepass."""
    return getattr(module, f"_{d.name.upper()}_RANGES_KEPT", None) is not None


def _cases(path: Path):
    masked = any(word in path.read_text() for word in ("x <= q", "-inf)"))
    return CASES + ([MASKED_CASE] if masked else [])


@pytest.mark.parametrize("path,case", [(p, c) for p in EXAMPLES for c in _cases(p)],
                         ids=lambda v: v.stem if isinstance(v, Path) else f"{v[0]}x{v[1]}")
def test_counted_bytes_equal_predicted_bytes(compiled, path, case):
    module = compiled[path.stem]
    assert not isinstance(module, NapkinError), module.render()
    d = single_device(napkin.load(path))
    n1, n2, block_list = case
    sizes = case_sizes(d, n1, n2)
    blocks, launch = case_blocks(d, block_list)
    loads, stores, launches = counted(module, d, sizes, launch, torch.float16)
    want = predicted(d, sizes, blocks)
    if reads_data(module, d):  # one document: every block visited, as counted; the prepass (scan, merge) first
        assert launches == (1 if keeps(module, d) or looped(module, d) else 3)
        assert_prepassed(module, (loads, stores), want)
        return
    assert launches == 1
    assert (gathered(d, loads), stores) == (gathered(d, want[0]), want[1])


def gathered(d: ir.Diagram, loads: dict) -> dict:
    """Loads less those of a float tensor read at blocks (cost_helpers.gathered_reads)."""
    return {n: v for n, v in loads.items() if n not in gathered_reads(d)}


@pytest.mark.parametrize("name", ["attention", "causal", "matmul", "alibi"])
def test_counted_bytes_follow_the_dtype(compiled, name):
    """fp32 inputs: the same kernels move twice the bytes of the fp16 inputs,
    and the cost pass says so from the diagram recast to fp32."""
    module = compiled[name]
    d = single_device(napkin.load(REPO / "examples" / f"{name}.ncd"))
    sizes = case_sizes(d, 50, 70)
    blocks, launch = case_blocks(d, (32, 16, 16))
    loads, stores, _ = counted(module, d, sizes, launch, torch.float32)
    assert (loads, stores) == predicted(recast(d, "fp32"), sizes, blocks)


# --------------------------------------------------------------------------
# Chunks of the streamed wire (flash-decoding: group x by C beside stream x
# by B).  A launch of more than one chunk runs the main kernel on a grid of
# chunks, storing each program's float32 streaming state to _part (the
# launcher's buffer, counted under its kernel parameter name), then the merge
# kernel, which loads the states and stores the outputs: the model's
# napkin/cost/chunks.py.  Ragged sizes throughout (neither the blocks nor the
# chunks divide them), masks where whole chunks visit nothing, a sum
# normaliser (L2), an output the merge reads an input for, and one chunk
# (the whole kernel, one launch).  flash_decoding packs its rows (g by 4
# beside q by 4, napkin/cost/packing.py): its cases' blocks are the packed
# ones (block_q: (g, q) pairs), at |g||q| not a multiple of them, |q| = 1
# and 5 (blocks of several heads), |q| longer than the keys (packed rows no
# key is visible to, whole chunks none of a block's rows sees), chunked and
# whole, and |g| = 1 (nothing packed).
# --------------------------------------------------------------------------

import re  # noqa: E402
from typing import NamedTuple  # noqa: E402


class Chunked(NamedTuple):
    stem: str
    chunk: int
    replace: tuple           # text replacements
    n1: int                  # first and second sequence sizes (case_sizes)
    n2: int
    blocks: tuple            # the launcher's blocks of the searchable wires (case_blocks)
    launches: int            # 2: chunked (main kernel and merge), 1: whole
    sizes: tuple = ()        # other sizes, (wire, size) pairs: |g| (case_sizes gives 2)

RESIDUAL = ("O[b, h, q, d] : fp16 = sum[x](P * V)", "O[b, h, q, d] : fp16 = sum[x](P * V) + Q")
# an output reading its row's index: the merge loads the packed rows' positions (it reads them only so)
ROW_INDEX = ("O[b, (hk g), q, d] : bf16 = sum[x](P * V)", "O[b, (hk g), q, d] : bf16 = sum[x](P * V) * (q + 1)")
CHUNKED = [Chunked(*case) for case in (
    ("flash_decoding", 32, (), 5, 100, (16, 16), 2),       # 4 chunks, the last of 4 keys
    ("flash_decoding", 64, (), 37, 333, (16, 32), 2),      # 6 chunks, 5 row blocks (74 rows), ragged both ways
    ("flash_decoding", 32, (), 20, 170, (16, 64), 2),      # a block of 64 grows the chunk to 64
    ("flash_decoding", 64, (), 37, 64, (16, 32), 1),       # one chunk: the whole kernel
    ("causal", 32, (), 50, 70, (16, 16), 2),               # keys 64..69: a chunk no row sees
    ("sliding_window", 64, (), 400, 330, (64, 32), 2),     # most (row block, chunk) pairs visit nothing
    ("l2_attention", 32, (), 50, 70, (32, 16), 2),         # a sum normaliser: acc[d], l
    ("l2_attention", 32, (), 97, 33, (16, 16), 2),         # a second chunk of one key
    ("causal", 32, (RESIDUAL,), 50, 70, (16, 16), 2),      # the merge reads Q again for O
    # packed rows
    ("flash_decoding", 32, (), 1, 100, (16, 16), 2, (("g", 4),)),    # |q| = 1: 4 rows of one block
    ("flash_decoding", 32, (), 5, 333, (16, 16), 2, (("g", 7),)),    # |q| = 5: 35 rows, blocks across heads
    ("flash_decoding", 64, (), 5, 64, (16, 32), 1, (("g", 3),)),     # |q| = 5, whole: 15 rows
    ("flash_decoding", 128, (), 1, 100, (16, 16), 1, (("g", 5),)),   # |q| = 1, whole
    ("flash_decoding", 64, (), 37, 333, (32, 16), 2, (("g", 3),)),   # 111 rows by 32: runs of one head and across
    ("flash_decoding", 32, (), 60, 50, (16, 16), 2, (("g", 3),)),    # |q| > |x|: rows and chunks seeing nothing
    ("flash_decoding", 64, (), 60, 50, (32, 16), 1, (("g", 3),)),    # the same whole, blocks of 32
    ("flash_decoding", 64, (), 37, 333, (16, 32), 2, (("g", 1),)),   # |g| = 1: nothing packed
    ("flash_decoding", 64, (), 37, 64, (32, 32), 1, (("g", 1),)),    # |g| = 1, whole
    ("flash_decoding", 32, (ROW_INDEX,), 5, 100, (16, 16), 2, (("g", 4),)),   # the merge reads positions
)]


def chunked_text(stem: str, chunk: int, replace=()) -> str:
    """The example with its streamed wire in chunks of ``chunk`` (stream block 16 as written)."""
    text = (REPO / "examples" / f"{stem}.ncd").read_text()
    text = re.sub(r"(?m)^\s*group x by \d+.*\n", "", text)   # flash_decoding's own chunk
    text = re.sub(r"(?m)^(\s*)stream x by \d+", rf"\1group x by {chunk}\n\1stream x by 16", text)
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def chunked_modules(tmp_path_factory):
    folder, cache = tmp_path_factory.mktemp("chunked"), {}

    def get(stem: str, chunk: int, replace=()):
        from backward_helpers import compile_text
        text = chunked_text(stem, chunk, replace)
        key = f"chunked_{stem}_{chunk}_{len(replace)}"
        if key not in cache:
            cache[key] = (napkin.load_text(text, f"{key}.ncd"), compile_text(text, key, folder))
        return cache[key]
    return get


def _chunked_case(case: Chunked):
    what = "".join("+residual" if r == RESIDUAL else "+row-index" if r == ROW_INDEX else "+edited"
                   for r in case.replace)
    return (f"{case.stem}{what}-C{case.chunk}-{case.n1}x{case.n2}"
            + "".join(f"-{w}{n}" for w, n in case.sizes) + f"-B{case.blocks[0]}")


def chunked_sizes(d: ir.Diagram, case: Chunked) -> dict[str, int]:
    return {**case_sizes(d, case.n1, case.n2), **dict(case.sizes)}


@pytest.mark.parametrize("case", CHUNKED, ids=_chunked_case)
def test_chunked_counted_bytes_equal_predicted_bytes(chunked_modules, case):
    stem, chunk, replace, n1, n2, block_list, launches, _ = case
    d, module = chunked_modules(stem, chunk, replace)
    sizes = chunked_sizes(d, case)
    blocks, launch = case_blocks(d, block_list)
    loads, stores, counted_launches = counted(module, d, sizes, launch, torch.float16)
    assert counted_launches == launches
    want = predicted(d, sizes, blocks)
    assert (loads, stores) == want
    assert ("_part" in stores) == (launches == 2)
    kernels = analyse(with_blocks(d, blocks), sizes).kernels
    assert len(kernels) == launches   # the main kernel, and the merge when there are chunks to merge
    assert kernels[0].chunks == (math.ceil(n2 / max(chunk, blocks["x"])) if launches == 2 else 1)


@pytest.mark.parametrize("case", [CHUNKED[0], CHUNKED[6], CHUNKED[14]], ids=_chunked_case)
def test_chunked_training_forward_bytes(chunked_modules, case):
    """The training forward takes the schedule's chunk; the merge stores the
    saved row state (L2's sums) beside the outputs.  It packs rows as the
    forward does (flash_decoding)."""
    d, module = chunked_modules(case.stem, case.chunk, case.replace)
    sizes = chunked_sizes(d, case)
    blocks, launch = case_blocks(d, case.blocks)
    inputs = module.example_inputs(sizes, dtype=torch.float16)
    options = tuple(launch.get(o[len("block_"):]) if o.startswith("block_") else None for o in module._OPTIONS)
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        getattr(module, f"_{d.name}_forward")(*inputs, *options, True)
    want = defaultdict(int), defaultdict(int)
    from napkin.cost.backward import backward_cost
    for t in backward_cost(with_blocks(d, blocks), sizes, given=True).forward.transfers:
        want[t.direction == "store"][t.tensor] += t.bytes
    assert bc.launches == 2 and "_part" in want[1]
    assert (dict(bc.loads), dict(bc.stores)) == (dict(want[0]), dict(want[1]))


@pytest.mark.parametrize("sizes", [{"b": 1, "hk": 2, "g": 4, "q": 5, "x": 1500},    # packed, 2 chunks
                                   {"b": 2, "hk": 1, "g": 3, "q": 7, "x": 300},     # packed, whole
                                   {"b": 1, "hk": 2, "g": 1, "q": 5, "x": 1100}],   # |g| = 1: nothing packed
                         ids=lambda s: "-".join(f"{w}{n}" for w, n in s.items()))
def test_packed_launch_with_no_options(compiled, sizes):
    """flash_decoding as written (g by 4 beside q by 4, chunks of 1024), no
    option given: the launcher's own packed block (the plan's) and chunk,
    and the backward's own tiles, unpacked (g a batch wire), as the cost
    pass takes them from the diagram alone."""
    module = compiled["flash_decoding"]
    d = napkin.load(REPO / "examples" / "flash_decoding.ncd")
    inputs = module.example_inputs(sizes, dtype=torch.float16)
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        module.flash_decoding(*inputs)
    assert (dict(bc.loads), dict(bc.stores)) == predicted(d, sizes, {})
    none = (None,) * len(module._OPTIONS)
    outs, saved = module._flash_decoding_forward(*inputs, *none, True)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    want = backward_cost(d, sizes)
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        module._flash_decoding_grads(inputs, (*outs, *saved), grads, none, None)
    assert bc.launches == len(want.kernels)
    assert (dict(bc.loads), dict(bc.stores)) == (want.by_tensor("load"), want.by_tensor("store"))


# --------------------------------------------------------------------------
# The backward: napkin.cost.backward's predictions against the generated
# backward kernels (and the training forward, which also writes the row
# state), for every example at the same sizes.  Tensors the backward
# allocates itself (delta, the gradients, partial sums) are counted under
# their kernel parameter names, which are the names the model uses.  The
# gradients are in the inputs' dtype on the autograd path (_NAME_grads) and
# float32 from NAME_backward's default; backward_cost's grad_dtype says which.
# --------------------------------------------------------------------------

from napkin.cost.backward import backward_cost  # noqa: E402


@pytest.mark.parametrize("path,case", [(p, c) for p in EXAMPLES for c in _cases(p)],
                         ids=lambda v: v.stem if isinstance(v, Path) else f"{v[0]}x{v[1]}")
def test_backward_counted_bytes_equal_predicted_bytes(compiled, path, case):
    module = compiled[path.stem]
    assert not isinstance(module, NapkinError), module.render()
    d = single_device(napkin.load(path))
    n1, n2, block_list = case
    sizes = case_sizes(d, n1, n2)
    blocks, launch = case_blocks(d, block_list)
    inputs = module.example_inputs(sizes, dtype=torch.float16)
    data = reads_data(module, d)
    if data:  # one document: every block visited, as the cost pass counts
        inputs = one_document(module, inputs, sizes)
    options = tuple(launch.get(o[len("block_"):]) if o.startswith("block_") else None for o in module._OPTIONS)
    predicted = backward_cost(with_blocks(d, blocks), sizes, given=True)
    forward = getattr(module, f"_{d.name}_forward")
    kept = keeps(module, d)
    if kept:   # launches after the first, as the cost pass counts them
        forward(*inputs, *options, True)
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        outs, saved = forward(*inputs, *options, True)
    trained = defaultdict(int), defaultdict(int)
    for t in triton_transfers(predicted.forward):
        trained[t.direction == "store"][t.tensor] += t.bytes
    if data:
        assert_prepassed(module, (bc.loads, bc.stores), trained)
    else:
        assert (gathered(d, bc.loads), dict(bc.stores)) == (gathered(d, trained[0]), dict(trained[1]))
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    if kept:
        getattr(module, f"_{d.name}_grads")(inputs, (*outs, *saved), grads, options, None)
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        getattr(module, f"_{d.name}_grads")(inputs, (*outs, *saved), grads, options, None)
    if data:  # a prepass (scan, merge; lists in torch) before dK/dV and one before dQ, each at its kernel's blocks
        lists = 0 if kept or looped(module, d) else 2   # the prepasses' lists: torch's
        assert bc.launches == triton_launches(predicted) == len(predicted.kernels) - lists
        assert_prepassed(module, (bc.loads, bc.stores),
                         (backward_bytes(predicted, "load"), backward_bytes(predicted, "store")))
        return
    assert bc.launches == len(predicted.kernels)
    assert (gathered(d, bc.loads), dict(bc.stores)) == \
        (gathered(d, predicted.by_tensor("load")), predicted.by_tensor("store"))


@pytest.mark.parametrize("stem", ["causal", "gqa", "sliding_window", "alibi", "l2_attention", "relu2_attention"])
def test_backward_bytes_of_the_launch_with_no_options(compiled, stem):
    """No block given: the dK/dV kernel runs its own default tile (the
    forward's transposed, rows halved to fit the registers; for L2 and ReLU²
    attention counting the float32 operands of their widened products too),
    which the cost pass evaluates with the launcher's rule (dkdv_default_tile)."""
    module = compiled[stem]
    d = single_device(napkin.load(REPO / "examples" / f"{stem}.ncd"))
    sizes = case_sizes(d, 150, 333)
    inputs = module.example_inputs(sizes, dtype=torch.float16)
    none = (None,) * len(module._OPTIONS)
    predicted = backward_cost(d, sizes)
    assert predicted.by_tensor("load") != backward_cost(d, sizes, given=True).by_tensor("load")
    outs, saved = getattr(module, f"_{d.name}_forward")(*inputs, *none, True)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        getattr(module, f"_{d.name}_grads")(inputs, (*outs, *saved), grads, none, None)
    assert (dict(bc.loads), dict(bc.stores)) == (predicted.by_tensor("load"), predicted.by_tensor("store"))


@pytest.mark.parametrize("grad_dtype", ["input", "float32"])
@pytest.mark.parametrize("stem", ["causal", "gqa", "alibi", "matmul"])
def test_backward_gradient_bytes_follow_grad_dtype(compiled, stem, grad_dtype):
    """NAME_backward(grad_dtype=...) called directly, as the distributed
    wrappers call it ("float32", its default) and as autograd does ("input"):
    its kernels' bytes are backward_cost's with the same grad_dtype.  The
    fp16 examples' two predictions differ in every gradient store, so a
    launch storing gradients in the other dtype fails here."""
    module = compiled[stem]
    d = single_device(napkin.load(REPO / "examples" / f"{stem}.ncd"))
    sizes = case_sizes(d, 50, 70)
    inputs = module.example_inputs(sizes, dtype=torch.float16)
    predicted = backward_cost(d, sizes, grad_dtype=grad_dtype)
    other = backward_cost(d, sizes, grad_dtype="float32" if grad_dtype == "input" else "input")
    grads = {m.tensor for m in predicted.moves if m.tensor.startswith("_grad_") and m.direction == "store"}
    assert grads and all(predicted.by_tensor("store")[g] != other.by_tensor("store")[g] for g in grads)
    none = (None,) * len(module._OPTIONS)
    outs, saved = getattr(module, f"_{d.name}_forward")(*inputs, *none, True)
    upstream = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(0)).to(outs[0].dtype)
    if stem == "matmul":
        state = (upstream,)
    else:   # the row state, from the public preprocess (not counted: the rows kernel is left out below)
        lse = outs[list(module.OUTPUTS).index("lse")] if "lse" in module.OUTPUTS else saved[0]
        state = (upstream, lse, *getattr(module, f"{d.name}_preprocess")(*inputs, upstream, outs[0]))
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        getattr(module, f"{d.name}_backward")(*inputs, *state, grad_dtype=grad_dtype)
    want = defaultdict(int), defaultdict(int)
    for m in predicted.moves:
        if m.kernel != "rows":
            want[m.direction == "store"][m.tensor] += m.bytes
    assert (dict(bc.loads), dict(bc.stores)) == (dict(want[0]), dict(want[1]))


@pytest.mark.parametrize("stem", sorted(COST_ONLY))
def test_cost_only_examples_are_refused(compiled, stem):
    """The examples left out of the counted ones are left out because codegen
    refuses them, with a located reason - not because their counts disagree."""
    err = compiled[stem]
    assert isinstance(err, NapkinError)
    assert "napkin cannot emit a kernel" in err.render()
    assert COST_ONLY[stem] in err.render()
    assert err.diagnostics[0].loc.line > 0


# --------------------------------------------------------------------------
# Masks composed through lets: W = a window, S = causal W.
# --------------------------------------------------------------------------

NESTED = """diagram NAME
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
SCORE
O[b, h, q, d] : fp16 = sum[x](softmax[x](S) * V)
out O
schedule { level smem { group b by 1, h by 1, q by 32
stream x by 16 } }
"""
SCORES = {
    "single": "S[b, h, q, x] = where(x <= q and q - x < 40, sum[d](Q * K) * |d|^-0.5, -inf)",
    "lets": "W[b, h, q, x] = where(q - x < 40, sum[d](Q * K) * |d|^-0.5, -inf)\n"
            "S[b, h, q, x] = where(x <= q, W, -inf)",
    "inline": "S[b, h, q, x] = where(x > q, -inf, where(q - x < 40, sum[d](Q * K) * |d|^-0.5, -inf))",
}


def test_a_window_composed_through_lets_skips_the_blocks_of_the_whole_window(tmp_path):
    """The kernel skipped by the outermost mask alone: a window written as S = causal(W) visited every
    causal block (at q = x = 8192, 4160 (program, step) pairs where the one-where window visits 378).
    Now the nested masks' conjunction bounds the loop: the three spellings move the same bytes, the
    cost pass predicts them, and the output matches a float64 torch of its own (ragged lengths).  The
    third writes the causal part negated, where(x > q, -inf, ...): under a bare `not` it had no affine
    bounds, so its kernel ran a ranges prepass at every launch and the cost pass counted every block."""
    from backward_helpers import compile_text

    counts = {}
    for key, score in SCORES.items():
        text = NESTED.replace("NAME", f"window_{key}").replace("SCORE", score)
        d = napkin.load_text(text, f"window_{key}.ncd")
        module = compile_text(text, f"counted_window_{key}", tmp_path)
        sizes = {"b": 1, "h": 2, "q": 200, "x": 190}
        inputs = module.example_inputs(sizes, dtype=torch.float32)
        with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
            out = getattr(module, d.name)(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        counts[key] = (dict(bc.loads), dict(bc.stores))
        assert counts[key] == predicted(recast(d, "fp32"), sizes, {"q": 32, "x": 16}), key
        Q, K, V = (t.double() for t in inputs)
        i, j = torch.arange(200)[:, None], torch.arange(190)[None, :]
        S = torch.where((j <= i) & (i - j < 40), Q @ K.transpose(-1, -2) / 4, -math.inf)
        want = torch.softmax(S, -1) @ V
        assert (out.double() - want).abs().max() < 1e-5, key
    assert counts["lets"] == counts["inline"] == counts["single"]
    # the loads are those of about a window, not of the causal half
    k_bytes = counts["single"][0]["K"]
    assert k_bytes < 2 * (200 // 32 + 1) * (40 // 16 + 2) * 16 * 16 * 4 * 2


def test_backward_bytes_of_an_lse_output_declared_fp16(tmp_path):
    """An fp16 lse output: the backward reads its float32 twin (_saved_lse) and autograd hands dlse
    over in fp16; the cost pass had the two dtypes swapped (lse 1200 B predicted, 2400 counted)."""
    from backward_helpers import compile_text

    text = (REPO / "examples" / "causal.ncd").read_text().replace("wire d = 64", "wire d = 32") \
        .replace("lse[b, h, q] = logsumexp[x](S)", "lse[b, h, q] : fp16 = logsumexp[x](S)")
    assert "lse[b, h, q] : fp16" in text
    module = compile_text(text, "counted_lse16", tmp_path)
    d = napkin.load_text(text, "lse16.ncd")
    sizes = {"b": 2, "h": 2, "q": 50, "x": 37}
    inputs = module.example_inputs(sizes, dtype=torch.float16)
    none = (None,) * len(module._OPTIONS)
    outs, saved = module._causal_forward(*inputs, *none, True)
    assert outs[1].dtype == torch.float16 and saved[0].dtype == torch.float32
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        module._causal_grads(inputs, (*outs, *saved), grads, none, None)
    predicted = backward_cost(d, sizes)
    assert (dict(bc.loads), dict(bc.stores)) == (predicted.by_tensor("load"), predicted.by_tensor("store"))


@pytest.mark.parametrize("steps", [(64, 32), (8, 4), (3, 5), (256, 128), (40, 48)])
def test_backward_bytes_of_a_bias_summed_inside_the_tile(tmp_path, steps):
    """B[h, q // sq, x // sx]: the dQ kernel stores a granule of each tile's partial
    (backward_emit.tiled_reads), and the cost pass counts those stores, not one a score."""
    from backward_helpers import compile_text
    from test_block_read_gradients import _tiles

    text = _tiles(*steps).replace("diagram attention", "diagram tiles")
    module = compile_text(text, f"counted_tiles_{steps[0]}_{steps[1]}", tmp_path)
    d = napkin.load_text(text, "tiles.ncd")
    sizes = {"b": 2, "h": 2, "q": 150, "x": 77}
    inputs = module.example_inputs(sizes, dtype=torch.float16)
    none = (None,) * len(module._OPTIONS)
    outs, saved = module._tiles_forward(*inputs, *none, True)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    with ByteCounter(tensors=dict(zip(module.INPUTS, inputs))) as bc:
        module._tiles_grads(inputs, (*outs, *saved), grads, none, None)
    predicted = backward_cost(d, sizes)
    assert dict(bc.stores) == predicted.by_tensor("store")
    assert gathered(d, bc.loads) == gathered(d, predicted.by_tensor("load"))
    assert bc.stores["_part_B"] < 4 * 2 * 2 * 150 * 77 or steps == (3, 5)

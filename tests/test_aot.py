"""The generated kernels compiled for Hopper (sm_90) on this CPU-only machine
(napkin.bench.aot): every example's forward, and the backward of the
FlashAttention-family targets, at the benchmark's head dim 128 in bf16.

What is asserted is what would make a kernel slow on the GPU whatever the
autotuner picks: register spills, no tensor-core instructions, an attention
loop whose loads are not asynchronous copies (not software-pipelined), or
more shared memory than an H100 block has.  It also proves the kernels
compile on this Triton for a real target, which the interpreter never does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import napkin
from example_sizes import has_prepass
from napkin.bench import aot
from napkin.cost import profiles

REPO = Path(__file__).resolve().parent.parent
COMPILABLE = sorted(p.stem for p in (REPO / "generated").glob("*.py") if p.stem != "__init__")
# The targets (FlexAttention-expressible): their training must be fast too.
TARGETS = ["attention", "causal", "sliding_window", "softcap", "alibi", "document_mask", "gqa"]
H100_SMEM = profiles.get_profile("h100").capacity("smem")

pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend cannot target sm_90")


def run_aot(stems, *args) -> str:
    """The standard output of one `python -m napkin.bench.aot` run over the
    examples ``stems``.  A process of its own: this one imported Triton under
    TRITON_INTERPRET=1 (conftest.py), whose library then cannot be compiled
    for a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    files = [str(REPO / "examples" / f"{s}.ncd") for s in stems]
    done = subprocess.run([sys.executable, "-m", "napkin.bench.aot", *files, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def compile_on_paper(stems, *args) -> dict:
    """{stem: [kernel reports]} from one run with --json."""
    return {Path(d["file"]).stem: [aot.KernelReport(**k) for k in d["kernels"]]
            for d in json.loads(run_aot(stems, "--json", *args))["diagrams"]}


def split(reports, stem):
    """(the kernel named ``name``, the ranges prepass's reports): a mask that
    reads data launches a prepass (scan and merge) before it (codegen/ranges.py), no products
    in it, so the tensor-core and exp checks are not its."""
    return [r for r in reports if not r.kernel.endswith("_ranges_kernel")], \
        [r for r in reports if r.kernel.endswith("_ranges_kernel")]


@pytest.fixture(scope="module")
def forwards():
    return compile_on_paper(COMPILABLE, "--head-dim", "128", "--forward-only")


@pytest.fixture(scope="module")
def trainings():
    return compile_on_paper(TARGETS, "--head-dim", "128")


@pytest.mark.slow
@pytest.mark.parametrize("stem", COMPILABLE)
def test_forward_kernel_compiles_for_hopper_without_spilling(forwards, stem):
    [r], prepass = split(forwards[stem], stem)
    assert r.kernel == f"_{stem}_kernel"
    assert sorted(p.kernel for p in prepass) == \
        ([f"_{stem}_merge_ranges_kernel", f"_{stem}_ranges_kernel"] if has_prepass(stem) else [])
    for p in prepass:
        assert not p.spills, f"{p.kernel} spills {p.spill_stores} B / loads {p.spill_loads} B per thread"
    assert not r.spills, f"{r.kernel} spills {r.spill_stores} B / loads {r.spill_loads} B per thread"
    assert r.wgmma + r.mma > 0, f"{r.kernel} runs its products without tensor cores"
    assert r.shared <= H100_SMEM


@pytest.mark.slow
@pytest.mark.parametrize("stem", TARGETS)
def test_target_forward_runs_on_warpgroup_mma_with_pipelined_loads(forwards, stem):
    [r], _ = split(forwards[stem], stem)
    assert r.wgmma > 0, f"{r.kernel} does not use Hopper's wgmma"
    assert r.cp_async > 0, f"{r.kernel}'s loads are not asynchronous copies: the loop is not pipelined"


@pytest.mark.slow
@pytest.mark.parametrize("stem", TARGETS)
def test_target_backward_kernels_compile_for_hopper_without_spilling(trainings, stem):
    reports = trainings[stem]
    assert {r.kernel for r in reports} >= {f"_{stem}_kernel", f"_{stem}_bwd_dkdv_kernel", f"_{stem}_bwd_dq_kernel"}
    for r in reports:
        assert not r.spills, f"{r.kernel} spills {r.spill_stores} B / loads {r.spill_loads} B per thread"
        assert r.shared <= H100_SMEM
        if "_bwd_rows_" not in r.kernel and not r.kernel.endswith("_ranges_kernel"):
            assert r.wgmma > 0 and r.cp_async > 0, r


# Sum normalisers: dN = dO / b(Z) is float32 row state, and its products ran
# as FMAs (no tensor core) that spilled kilobytes a thread until they took tf32
# and the default tiles counted their float32 operands (backward_hold.HELD_FP32).
SUM_NORMALISED = ["l2_attention", "relu2_attention"]


@pytest.fixture(scope="module")
def sum_normalised():
    return compile_on_paper(SUM_NORMALISED, "--head-dim", "128")


def fit_without_spilling(reports) -> None:
    for r in reports:
        assert not r.spills, f"{r.kernel} spills {r.spill_stores} B / loads {r.spill_loads} B per thread"
        assert r.shared <= H100_SMEM


@pytest.mark.slow
@pytest.mark.parametrize("stem", SUM_NORMALISED)
def test_sum_normaliser_backward_kernels_do_not_spill(sum_normalised, stem):
    reports = {r.kernel: r for r in sum_normalised[stem]}
    assert set(reports) >= {f"_{stem}_bwd_{k}_kernel" for k in ("rows", "dkdv", "dq")}
    fit_without_spilling(reports.values())
    for k in ("dkdv", "dq"):
        assert reports[f"_{stem}_bwd_{k}_kernel"].wgmma > 0, f"{stem}'s {k} kernel runs without wgmma"


# Keys several rows' heads share (GQA's g, decoding's): the dK/dV kernel walks (row block, g)
# pairs in one flat loop.  Nested in a loop over g, causal GQA's (the sink example) spilled
# 124 B a thread at head dim 128, and decode's held 224 registers where it now holds about 100.
SHARED_KEYS = ["attention_sink", "decode"]


@pytest.fixture(scope="module")
def shared_keys():
    return compile_on_paper(SHARED_KEYS, "--head-dim", "128")


@pytest.mark.slow
@pytest.mark.parametrize("stem", SHARED_KEYS)
def test_shared_key_backward_kernels_do_not_spill(shared_keys, stem):
    reports = {r.kernel: r for r in shared_keys[stem]}
    assert f"_{stem}_bwd_dkdv_kernel" in reports
    fit_without_spilling(reports.values())


@pytest.mark.slow
def test_mla_trains_on_warpgroup_mma_without_spilling():
    """Multi-head latent attention at its own sizes (128 + 64 wide scores, 128 wide values):
    both contractions of the score in every kernel, on wgmma, no spill."""
    reports = {r.kernel: r for r in compile_on_paper(["mla"])["mla"]}
    assert set(reports) == {f"_mla{k}_kernel" for k in ("", "_bwd_rows", "_bwd_dkdv", "_bwd_dq")}
    fit_without_spilling(reports.values())
    assert all(reports[f"_mla{k}_kernel"].wgmma > 0 for k in ("", "_bwd_dkdv", "_bwd_dq"))


@pytest.mark.slow
def test_int8_scores_train_on_warpgroup_mma_without_spilling():
    """SageAttention's int8 Q . K (examples/sage_attention.ncd, head dim 128): the
    forward and both backward loops take the int8 tiles to tl.dot (an int32 sum),
    dK/dV storing dV alone and dQ the scales' sums; every product kernel on
    tensor cores, none spilling."""
    reports = {r.kernel: r for r in compile_on_paper(["sage_attention"], "--head-dim", "128")["sage_attention"]}
    assert set(reports) == {f"_sage_attention{k}_kernel" for k in ("", "_bwd_rows", "_bwd_dkdv", "_bwd_dq")}
    fit_without_spilling(reports.values())
    assert all(reports[f"_sage_attention{k}_kernel"].wgmma + reports[f"_sage_attention{k}_kernel"].mma > 0
               for k in ("", "_bwd_dkdv", "_bwd_dq"))


@pytest.mark.slow
def test_matmul_pipelines_its_reduction_loop(forwards):
    # The sizes are not specialised, so a mask along the contiguous k would
    # make every load scalar: whole blocks of k run unmasked (emit.py).
    [r] = forwards["matmul"]
    assert r.cp_async > 0 and r.wgmma > 0


def test_compiling_here_is_refused_with_the_way_out():
    # This process imported Triton under the interpreter (conftest.py).
    path = REPO / "examples" / "softcap.ncd"
    d = napkin.load(path)
    with pytest.raises(napkin.NapkinError, match="python -m napkin.bench.aot"):
        aot.compile_diagram(d, path.read_text(), str(path), aot.default_sizes(d, {}))


def test_the_paper_gpu_is_put_away_afterwards():
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    run, active, env = JITFunction.run, driver._active, os.environ.get("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="inside"):
        with aot._compiling_for(90):
            assert driver.active.get_current_target().arch == 90
            raise RuntimeError("inside")
    assert JITFunction.run is run and driver._active is active
    assert os.environ.get("TRITON_INTERPRET") == env


def test_ptxas_resource_line_is_read():
    log = ("ptxas info    : Compiling entry function '_k' for 'sm_90a'\n"
           "ptxas info    : Function properties for _k\n"
           "    48 bytes stack frame, 112 bytes spill stores, 168 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 704 bytes cmem[0]\n")
    assert aot.parse_ptxas(log) == {"registers": 255, "stack": 48, "spill_stores": 112, "spill_loads": 168}
    with pytest.raises(napkin.NapkinError, match="no resource line"):
        aot.parse_ptxas("ptxas fatal : nothing")


def test_programs_per_sm_count_registers_by_the_warp_shared_memory_and_warps():
    # sm_90: 64K registers, 228 KiB of shared memory (1 KiB of it kept per program), 64 warps
    assert aot.programs_per_sm(90, 8, 255, 96 * 1024) == 1    # 8 warps x 8192 registers fill it
    assert aot.programs_per_sm(90, 8, 128, 64 * 1024) == 2    # 4096 a warp: two programs
    assert aot.programs_per_sm(90, 4, 224, 25 * 1024) == 2    # 7168 a warp: 9 warps, two programs
    assert aot.programs_per_sm(90, 4, 102, 25 * 1024) == 4    # 102 x 32 = 3264 -> 3328: 19 warps
    assert aot.programs_per_sm(90, 4, 40, 100 * 1024) == 2    # shared memory: 101 KiB twice in 228
    assert aot.programs_per_sm(90, 1, 16, 0) == 32             # the cap on programs
    assert aot.programs_per_sm(80, 4, 64, 80 * 1024) == 2      # A100: 164 KiB
    assert aot.programs_per_sm(75, 4, 64, 0) is None           # a target without limits here
    r = aot.KernelReport("_k", 90, 4, 2, 25 * 1024, 102, 0, 0, 0, 0, 48, 36, 0)
    assert r.per_sm == 4 and r.row()[aot.HEADER.index("per SM")] == "4"


def test_sass_counts_read_each_fp32_family():
    sass = """
        /*0100*/                   FFMA R203, R105, 0.18033687770366668701, -R121.reuse ;  /* 0x3e38aa3b69cb7823 */
        /*0110*/                   FFMA.FTZ R3, R2, R1, R0 ;
        /*0120*/              @!P0 FMUL R8, R8, 0.5 ;
        /*0130*/                   FADD R168, -R193, R168 ;
        /*0140*/                   MUFU.EX2 R232, R168 ;
        /*0150*/                   MUFU.RCP R0, R0 ;
        /*0160*/                   FSEL R168, R168, -INF , !P5 ;
        /*0170*/               @P1 FMNMX R4, R4, R5, !PT ;
        /*0180*/                   HFMA2.MMA R6, -RZ, RZ, 0, 0 ;
        /*0190*/                   FADD.FTZ R9, R9, 1 ;
    """
    assert aot.count_sass(sass) == {"ffma": 2, "fmul": 1, "fadd": 2, "ex2": 1, "fsel": 1, "fmnmx": 1}


@pytest.mark.slow
@pytest.mark.parametrize("stem", TARGETS)
def test_reports_count_the_fp32_work_of_each_kernel(trainings, stem):
    # every score of the forward and of both loop kernels goes through an exp2 (MUFU.EX2), the
    # forward keeps a running max (FMNMX); the rows kernel takes no exp2 but multiplies and adds.
    # The counts are static: instructions in the code, not executed ones.
    for r in split(trainings[stem], stem)[0]:
        if "_bwd_rows_" in r.kernel:
            assert r.ex2 == 0 and r.fmul > 0 and r.fadd > 0, r
        else:
            assert r.ex2 > 0 and r.ffma + r.fmul > 0, r
        if "_bwd_" not in r.kernel:
            assert r.fmnmx > 0, r


def test_default_sizes_tile_the_streamed_wires_and_keep_the_rest_small():
    d = napkin.load(REPO / "examples" / "gqa.ncd")
    sizes = aot.default_sizes(d, {"q": 384})
    assert sizes["q"] == 384 and sizes["x"] == aot.DEFAULT_SIZE
    assert all(n == aot.OTHER_SIZE for w, n in sizes.items() if w not in ("q", "x"))


def test_cli_prints_one_table_per_diagram():
    out = run_aot(["softcap", "matmul"], "--forward-only", "-D", "q=128")
    assert "softcap at {'b': 2, 'h': 2, 'q': 128, 'x': 256}, compiled for sm_90" in out
    assert "_softcap_kernel" in out and "_matmul_kernel" in out
    assert all(op in out.splitlines()[2] for op in aot.SASS_OPS.values())   # the table's header
    assert aot.main([str(REPO / "examples" / "softcap.ncd"), "-D", "q"]) == 1

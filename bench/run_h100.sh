#!/usr/bin/env bash
# The benchmark a session with a lent H100 (or H200) runs, in stages that each
# fit one 10-minute device command.  Usage, from the repository root:
#
#     bench/run_h100.sh [env|test|benchtest|main|variants|misses|others|extras|masks|sweep|ncu|tma|decode|ragged|matmul|aot|all]   (default: all)
#
# Results go to $NAPKIN_BENCH_OUT, else $OUT (the device tool's folder that
# comes back), else bench/results; copy them into bench/results/ and commit
# them.  The autotune cache goes beside them unless NAPKIN_CACHE is set, so
# the tuned configs come back too.
#
# The targets (issue "Speed on a real GPU", background section 4): 16K tokens,
# head dim 128, bf16, causal and not, then the variants.  With the h100
# preset, --seqlen 16K gives batch 1 (16K tokens per batch) and 16 heads
# (hidden 2048 / 128).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OUT_DIR="${NAPKIN_BENCH_OUT:-${OUT:-bench/results}}"
export NAPKIN_CACHE="${NAPKIN_CACHE:-$OUT_DIR/autotune-cache}"
PYTHON="${PYTHON:-python}"
BENCH=("$PYTHON" -m napkin.bench --preset h100 --out "$OUT_DIR")
TARGET=(--seqlen 16K --head-dim 128 --dtype bfloat16)

stage_env() {
  # What machine and software the numbers come from; fails early without CUDA.
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true
  "$PYTHON" - <<'EOF'
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
assert torch.cuda.is_available(), "no CUDA device: these numbers need a GPU"
p = torch.cuda.get_device_properties(0)
print(p.name, "capability", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
      "smem/block opt-in", getattr(p, "shared_memory_per_block_optin", "?"))
EOF
  # napkin itself, from the carried wheels (bench/device.sh fetch): a missing
  # one fails here, in seconds, not in every later stage
  "$PYTHON" -c 'import napkin; d = napkin.load("examples/causal.ncd"); print("napkin", napkin.__version__, "parses", d.name)'
}

stage_test() {
  # The GPU-marked tests: bf16 forward and backward kernels against float64.
  "$PYTHON" -m pytest -q -rs -m "gpu and not slow" tests/
}

stage_benchtest() {
  # The GPU-marked bench test: the real timing path, tuning, the autotune
  # cache read back at a new length (a few minutes: apart from `test`).
  "$PYTHON" -m pytest -q -m "gpu and slow" tests/
}

# Tuning budgets: each --autotune run shares its time among the kernels it
# tunes (forward, dQ, dK/dV per diagram; napkin/bench/budget.py, TuneShare),
# again before each grid point: one 10-minute command (RUN_S) unless
# $NAPKIN_BENCH_SECONDS says less, as bench/device.sh does for a stage given
# its share (`main:270`).  A run must therefore be ONE bench command per
# stage; NAPKIN_TUNE_BUDGET (seconds per kernel) overrides the share.
TUNE=(--autotune ${NAPKIN_TUNE_BUDGET:+--tune-budget "$NAPKIN_TUNE_BUDGET"})

stage_main() {
  # Plain and causal attention at the target, forward and backward, tuned first.
  "${BENCH[@]}" examples/attention.ncd examples/causal.ncd "${TARGET[@]}" "${TUNE[@]}"
}

stage_variants() {
  # The FlexAttention-expressible variants at the target size, in one run so
  # that the tuning budget is shared by all five (--group applies to GQA only).
  "${BENCH[@]}" examples/sliding_window.ncd examples/softcap.ncd examples/alibi.ncd \
    examples/document_mask.ncd examples/gqa.ncd "${TARGET[@]}" --group 4 "${TUNE[@]}"
}

stage_misses() {
  # The targets the H200 run of 2026-11-26 missed (docs/bench.md, "Measured"),
  # each of whose tunings its budget had cut short: with the autotune cache
  # carried (bench/results/autotune-DATE.json as .device/autotune.json), the
  # tuner goes on with the candidates it never reached.  Plain attention
  # for its backward, then the document mask and the sliding window.
  "${BENCH[@]}" examples/attention.ncd examples/document_mask.ncd examples/sliding_window.ncd \
    "${TARGET[@]}" "${TUNE[@]}"
}

stage_others() {
  # Variants FlexAttention cannot express: compared with SDPA as a speed reference only.
  "${BENCH[@]}" examples/sigmoid_attention.ncd examples/l2_attention.ncd examples/relu2_attention.ncd \
    "${TARGET[@]}" "${TUNE[@]}"
}

stage_extras() {
  # Variants built since the GPU runs (2026-12-02), FlexAttention-expressible: the gpt-oss
  # attention sink (causal GQA: its dK/dV no longer spills) and multi-head latent attention
  # (a 128 + 64 wide score, no padding to 256 where flex and SDPA take the parts concatenated);
  # Llama 4's chunked attention (causal within chunks of 8192: two at 16K; --group is for GQA alone).
  "${BENCH[@]}" examples/attention_sink.ncd examples/mla.ncd examples/chunked_attention.ncd "${TARGET[@]}" \
    --group 4 "${TUNE[@]}"
}

stage_masks() {
  # Masks built since the GPU runs, none timed on a GPU, FlexAttention-expressible: differential
  # attention (its (g d) maps are heads to flex and SDPA), prefix-LM (kv_idx <= q_idx | kv_idx < p[b],
  # prefixes drawn in 1..N), StreamingLLM's 1024-token window with 4 sinks (the dead blocks
  # between sinks and window skipped: 37,616 of the 264,192 causal pairs at 16K, by the cost
  # pass); the document mask again, whose partial loops walk a list of live blocks since 2026-12-06; and
  # block-sparse attention (a bool per 64 x 64 block, drawn at random, causal within: flex's mask_mod
  # reads the same blocks; napkin's lists skip every dead block, as flex's kv_indices do).
  "${BENCH[@]}" examples/differential_attention.ncd examples/prefix_lm.ncd examples/streaming_llm.ncd \
    examples/document_mask.ncd examples/block_sparse.ncd "${TARGET[@]}" "${TUNE[@]}"
}

stage_sweep() {
  # The FlashAttention papers' grid for plain and causal attention: lengths
  # 1K-16K, head dims 64 and 128, bf16 and fp16; configs from the cache when
  # the main stage tuned that bucket, else the schedule's.
  "${BENCH[@]}" examples/attention.ncd examples/causal.ncd --seqlen 1K,2K,4K,8K,16K \
    --head-dim 64,128 --dtype bfloat16,float16
}

stage_ncu() {
  # The cost pass's bytes against Nsight Compute's DRAM bytes, plain and causal
  # at the target (bench/dram_bytes.py); launcher options from the main stage's
  # cache when it ran.  ncu measures the second launch (the first compiles).
  local sizes=(-D b=1 -D h=16 -D q=16384 -D x=16384 --dtype bfloat16 --head-dim 128)
  for f in attention causal; do
    ncu --clock-control none --csv --print-units base --log-file "$OUT_DIR/ncu-$f.csv" \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum -k "_${f}_kernel" --launch-skip 1 --launch-count 1 \
      "$PYTHON" bench/dram_bytes.py run "examples/$f.ncd" "${sizes[@]}" --options-file "$OUT_DIR/ncu-$f.json"
    "$PYTHON" bench/dram_bytes.py compare "examples/$f.ncd" "$OUT_DIR/ncu-$f.csv" "${sizes[@]}" \
      --options-file "$OUT_DIR/ncu-$f.json" --out "$OUT_DIR"
  done
  # The chunked decode: two kernels a forward (the chunks, the merge), both profiled.
  local decode=(-D b=1 -D hk=8 -D g=4 -D q=4 -D x=32768 --dtype bfloat16)
  ncu --clock-control none --csv --print-units base --log-file "$OUT_DIR/ncu-flash_decoding.csv" \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum -k "regex:_flash_decoding_(kernel|merge)" \
    --launch-skip 2 --launch-count 2 \
    "$PYTHON" bench/dram_bytes.py run examples/flash_decoding.ncd "${decode[@]}" \
    --options-file "$OUT_DIR/ncu-flash_decoding.json"
  "$PYTHON" bench/dram_bytes.py compare examples/flash_decoding.ncd "$OUT_DIR/ncu-flash_decoding.csv" \
    "${decode[@]}" --options-file "$OUT_DIR/ncu-flash_decoding.json" --out "$OUT_DIR"
}

stage_tma() {
  # TMA descriptor loads against the pointer kernel, forward, head dim 128, 16K
  # tokens (bench/tma/tma_fwd.py: the compile-only study's timing half, never run
  # before; bench/results/tma-sm90-2026-11-21.md), as the launcher's tma=True
  # and tma=False.  The tuner already tries tma=True at head dim 128 in
  # main/variants; this is the direct A/B.
  # 2 diagrams x 2 tiles x 2 stage counts x 2 forms = 16 compiles and timings: one command.
  # the repository on the path before what is there (bench/device.sh's carried
  # wheels, lark among them: napkin cannot parse a diagram without it)
  PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" bench/tma/tma_fwd.py time --head-dims 128 --seqlens 16384 --out "$OUT_DIR/tma-times.jsonl"
}

stage_decode() {
  # Decoding on one GPU (examples/flash_decoding.ncd): chunk lengths 0 (one
  # program per batch x head) to 4096 against Flex and SDPA, 1 and 4 query rows, caches
  # of 8K-128K, bf16, 8 kv heads x 4 (bench/decode.py; never run on a GPU yet).
  # First napkin's Python per launch, kernels stubbed (seconds): the host share
  # of decode's step times.  Before decode.py, not after: that runs until the
  # stage's limit stops it (a point a write) or exits 1 on a failed check,
  # either of which skipped it under set -e.
  "$PYTHON" bench/launch_overhead.py --out "$OUT_DIR"
  # and a training step's backward through autograd (three launchers, autograd's engine): the host
  # work a short backward's kernels wait for (the sliding window's, docs/bench.md)
  "$PYTHON" bench/launch_overhead.py --backward --out "$OUT_DIR"
  # and a decode loop's growing cache, a new signature every call: the launch plans' miss path
  "$PYTHON" bench/launch_overhead.py --new-shapes --out "$OUT_DIR"
  # and a decode loop passing its preallocated cache's length (lengths=): planned by which are short
  "$PYTHON" bench/launch_overhead.py --lengths --out "$OUT_DIR"
  "$PYTHON" bench/decode.py --out "$OUT_DIR"
}

stage_ragged() {
  # Decoding a batch of caches filled to their own lengths (examples/ragged_decode.ncd,
  # bench/decode.py --ragged; never run on a GPU yet): napkin's loops stop at each
  # sequence's length, read at every call; FlexAttention timed with its block
  # mask built once (flex) and rebuilt each call (flex-step), as a loop whose lengths grow.
  "$PYTHON" bench/decode.py --ragged --out "$OUT_DIR"
}

stage_matmul() {
  # A contraction's program order (bench/matmul_order.py; never run on a GPU yet): examples/matmul.ncd
  # forward and backward at 4K and 8K with its programs in the plain order and in groups of 4 and
  # 8 row blocks, against torch.matmul, beside the L2 model's DRAM bytes for each (docs/cost.md);
  # then an e4m3 product scaled per row and column against torch._scaled_mm (cuBLAS's fp8 GEMM),
  # and an int8 one against torch._int_mm (cuBLAS's int8 GEMM) scaled in torch
  "$PYTHON" bench/matmul_order.py --out "$OUT_DIR"
  "$PYTHON" bench/matmul_order.py --fp8 --out "$OUT_DIR"
  "$PYTHON" bench/matmul_order.py --int8 --out "$OUT_DIR"
}

stage_aot() {
  # What the machine's own Triton makes of the kernels before anything is
  # timed (napkin.bench.aot: registers, spills, wgmma): ALiBi with its slope
  # trained (every floating input needs a gradient there), whose dQ kernel
  # sums two more row vectors since 2026-11-27, then the two targets.
  "$PYTHON" -m napkin.bench.aot examples/alibi.ncd examples/causal.ncd --head-dim 128 --dtype bfloat16
}

stage="${1:-all}"
case "$stage" in
  env|test|benchtest|main|variants|misses|others|extras|masks|sweep|ncu|tma|decode|ragged|matmul|aot) "stage_$stage" ;;
  all) for s in env test aot main variants others extras masks benchtest sweep ncu tma decode ragged matmul; do "stage_$s"; done ;;
  *) echo "usage: $0 [env|test|benchtest|main|variants|misses|others|extras|masks|sweep|ncu|tma|decode|ragged|matmul|aot|all]" >&2; exit 2 ;;
esac

"""What the backward's kernels hold: the dtype each product is taken in, and
the default tiles that keep what one thread holds in float32 within its
registers.

The emitter (backward_emit.py) writes the products in these dtypes; the
launcher's twin rules (templates/training.py.jinja), the cost pass
(cost/backward.py), the tuner (autotune.py) and the benchmark harness ask
the default tiles here, so that all of them agree on what a launch runs.
"""
from __future__ import annotations

from .. import ir
from . import lower as L
from .backward import BackwardPlan, Kernel


def product_dt(plan: BackwardPlan, *tensors: str) -> str:
    """The dtype a product is taken in: the kernel dtype, or float32 when a
    factor is float32 row state.  Only a sum normaliser's dN_i = dO dF/dN_i
    is ever such a factor, and only where dF/dN_i reads an N_k (gradrules.
    sums_rule): it may be huge where the normaliser is tiny (rounded to 16
    bits it would overflow) and it often cancels against dZ_j.  Where each
    dF/dN_i is a per-row factor gN_i (L2, ReLU^2, sigmoid attention) no
    float32 row state enters a product: dP = dO . V and dV's weights
    sum_i A_i gN_i (bounded by the weights' own normalisation) are taken in
    the kernel dtype as softmax's dP and P, and gN_i multiplies elementwise."""
    narrow = {"dO", "O"} | {n for n, src in plan.aliases if src in ("dO", "O")}
    wide = {n for n, _ in plan.axes if n not in narrow and not n.startswith("_grad_")}
    return "tl.float32" if wide & set(tensors) or wider_input(plan, *tensors) else f"{plan.typed}.dtype.element_ty"


def do_names(plan: BackwardPlan) -> set[str]:
    """dO and the names the plan gives it (dN0 = dO: an alias)."""
    return {"dO"} | {n for n, src in plan.aliases if src == "dO"}


def rows_round_do(plan: BackwardPlan) -> bool:
    """Whether the row values must read dO rounded to Q's dtype: the dQ
    kernel's products of dO (dP = dO V) are taken in the kernel dtype, and
    dO may arrive wider (an O declared fp32 beside fp16 Q, K, V).  delta =
    rowsum(dO * O) from the float32 dO then disagreed with dP by dO's
    rounding, which dS = P (dP - delta) kept: a per-query temperature's
    gradient was 0.27 off at peaked scores (novel3 hunt).  Both rounded,
    they cancel as in exact arithmetic."""
    dO = do_names(plan)
    dq = plan.kernel("dq")
    dts = [product_dt(plan, dot.lhs.tensor, dot.rhs.tensor) for dot in (dq.dots if dq else ())
           if {dot.lhs.tensor, dot.rhs.tensor} & dO]
    return bool(dts) and "tl.float32" not in dts


def wider_input(plan: BackwardPlan, *tensors: str) -> bool:
    """Whether one of ``tensors`` is an input declared wider than the kernel's
    dtype (Q's): a product of it is taken in float32, not rounded to Q's dtype.
    fp16 Q beside fp32 K and V: dQ = dS K rounded K to fp16 and dP = dO V
    rounded V, and dS sums to 0 along a row, so their rounding against K
    near 2048 was all dQ had (0.22 off on a largest 0.6).  dO keeps the
    kernel's dtype, as FlashAttention's does: only the user's inputs count."""
    inputs = {t.name: t for t in plan.forward.diagram.inputs}
    kernel = ir.DTYPE_BYTES[inputs[plan.typed].dtype]
    return any(n in inputs and ir.DTYPE_BYTES[inputs[n].dtype] > kernel for n in tensors)


def grad_dt(plan: BackwardPlan, g) -> str:
    """The dtype of a gradient's product: product_dt's (an operand declared wider than
    Q among its reasons), or float32 for a tile of unbounded weights
    (backward.Grad.wide)."""
    return "tl.float32" if g.wide else product_dt(plan, g.operand.tensor)


def widens(plan: BackwardPlan, dt: str) -> bool:
    """Whether a product taken in ``dt`` is one widened to float32 for row
    state whose precision the launcher picks (the schedule did not ask for
    tf32 everywhere)."""
    return dt == "tl.float32" and plan.forward.precision == "ieee"


def wide_precision(plan: BackwardPlan) -> str:
    """The launch argument _WIDE: the precision of the products widened to
    float32 for row state (dN, where dF/dN reads an N: product_dt).  With 16-bit inputs, tf32: its range is float32's
    (dN = dO / b(Z) never overflows, the reason they are widened) and its 10
    stored mantissa bits as many as fp16's (bf16 has 7), while
    an "ieee" float32 product has no tensor core: Triton runs it as FMAs
    whose operand tiles, a head dim deep, spilled every such kernel on sm_90
    (napkin.bench.aot: L2 attention's dK/dV 7 KB a thread, dQ 11 KB).
    float32 inputs keep "ieee", as the kernels' other products."""
    return f'"tf32" if {plan.typed}.dtype in (torch.float16, torch.bfloat16) else "ieee"'


# The default tiles of the dK/dV and rows kernels (templates/training.py.jinja)
# keep what one thread holds in float32 under this many values.  dK/dV: its
# accumulators ([x, feature]: dK, dV), its product tiles ([x, q]: the scores,
# dP) and the operands of the products it widens to float32 for its row state
# (wide_operands: V and dN of a sum normaliser whose dF/dN reads an N,
# [x, feature] and [q, feature]; L2, ReLU^2 and sigmoid attention have none).
# Its rows are halved down to 32, then its keys down to 64 (one warpgroup's
# wgmma rows), then its rows down to 16.  Set by compiling for sm_90
# (napkin.bench.aot, bf16, 8 warps, 128 keys): softmax at head dim 128 with 64
# rows (192 a thread) spilled in every bundled example, with 32 rows (160) in
# none on Triton 3.9 or 3.6; head dim 64 with 64 rows (128) in none.  What
# the count leaves out (addresses, masks, the row state lse and delta) takes
# another 60-95 of the 255 registers at that tile: on Triton 3.6 GQA and
# sliding window spilled there (36 B, 8 B) until the row state was loaded
# one value a thread (_step_load: 242 and 245 registers now).  Under 64 keys the
# products run on mma.sync (no wgmma), which takes both operands from
# registers (the warps split the rows, so each holds its K, V, P and dS
# tiles whole), unseen by the count: the rows are halved to 32 there
# whatever it says (decode: 16 keys by 64 rows, 4 warps,
# spilled 44 B on 3.9 and 84 B on 3.6 at head dim 128, 8 B and 28 B at 64;
# by 32 rows none).  L2 and ReLU^2 attention once
# took dN = dO / b(Z) as a float32 [q, feature] tile into tf32 products with
# V: at head dim 128 they spilled on Triton 3.9 at 128 keys by 32 rows (240 a
# thread) and on 3.6 even at 64 by 32 (V a float32 register operand of
# wgmma).  Now their dF/dN is a per-row factor (product_dt) and their tiles count
# as softmax's: compiled for sm_90 at their default tiles (128 keys by 32
# rows at head dim 128, by 64 at 64) none of their backward kernels spills on
# Triton 3.9 or 3.6 (dK/dV at head dim 128: 236 / 243 registers on 3.9,
# 234 / 241 on 3.6).  The rows
# kernel (one row block, no loop, 4 warps) holds what outlives its row sums:
# the loaded [q, feature] tiles read again after them and the tiles it stores
# (a dN form at head dim 128: dO and dN, 256 a thread at 128 rows spilled;
# softmax, L2 and ReLU^2 read nothing [q, feature] after their sums: unchanged).
HELD_FP32 = 160


def feature_block(plan: BackwardPlan, w: str, sizes) -> int:
    """The block a feature wire takes (its padded size): fixed, or from ``sizes``."""
    return L.feature_block(plan.diagram, w, sizes)


def wide_operands(plan: BackwardPlan, k: Kernel) -> list:
    """The loads that enter a product the kernel takes in float32 (product_dt: a
    factor is float32 row state), once each: held as float32 tiles."""
    out = {}
    for dot in k.dots:
        if dot.var != "_qk" and product_dt(plan, dot.lhs.tensor, dot.rhs.tensor) == "tl.float32":
            out.setdefault(dot.lhs.tensor, dot.lhs)
            out.setdefault(dot.rhs.tensor, dot.rhs)
    for g in k.grads:
        if grad_dt(plan, g) == "tl.float32":
            out.setdefault(g.operand.tensor, g.operand)
    return list(out.values())


def held_terms(plan: BackwardPlan, k: Kernel) -> list[tuple[str, str]]:
    """What one dK/dV or dQ program holds in float32, as a sum of tiles (two
    wires each: the row wire, the key wire or a feature wire): its
    accumulators, its product tiles, the float32 operands: see HELD_FP32."""
    # a tile per product; the score's contractions (several for MLA's) add into one
    terms = [(k.grid_wire, g.cols) for g in k.grads] + [(k.grid_wire, k.loop_wire)] * len({d.var for d in k.dots})
    return terms + [(ld.rows, ld.cols) for ld in wide_operands(plan, k) if ld.rows and ld.cols]


def held(plan: BackwardPlan, terms, br: int, bc: int, sizes) -> int:
    block = {plan.row: br, plan.col: bc}
    return sum((block.get(a) or feature_block(plan, a, sizes)) * (block.get(b) or feature_block(plan, b, sizes))
               for a, b in terms)


def dkdv_default_tile(plan: BackwardPlan, sizes, num_warps=None) -> tuple[int, int, int]:
    """(row block, key block, warps) the launcher gives the dK/dV kernel when
    no block is given or tuned, at ``sizes`` (every symbolic wire bound): the
    rule templates/training.py.jinja runs, evaluated here for the cost pass
    (a test holds the two to the same launches)."""
    blocks = dict(plan.forward.blocks)
    br, bc = blocks[plan.col], blocks[plan.row]
    warps = num_warps or (8 if max(br, bc) >= 128 else 4)
    terms = held_terms(plan, plan.kernel("dkdv"))
    budget = HELD_FP32 * 32 * warps

    def over(br, bc):
        return held(plan, terms, br, bc, sizes) > budget

    while br > 32 and (bc < 64 or over(br, bc)):  # under 64 keys: mma.sync (HELD_FP32)
        br //= 2
    while bc > 64 and over(br, bc):
        bc //= 2
    while br > 16 and over(br, bc):
        br //= 2
    return br, bc, warps


def dq_default_tile(plan: BackwardPlan, sizes, num_warps=None) -> tuple[int, int, int]:
    """(row block, key block, warps) of the dQ kernel when no block is given
    or tuned: the schedule's blocks, the keys halved (down to 32) while a
    thread would hold more than HELD_FP32 float32 values.  Softmax (and L2,
    ReLU^2 and sigmoid attention, whose products are softmax's) never reaches
    that at head dims 64 and 128; a dN form at head dim 128 (dN and V in
    float32 too) runs 32 keys, where 64 spilled L2's on Triton 3.6.
    The rule templates/training.py.jinja runs, evaluated for the cost pass."""
    blocks = dict(plan.forward.blocks)
    br, bc = blocks[plan.row], blocks[plan.col]
    warps = num_warps or (8 if br >= 128 else 4)
    terms = held_terms(plan, plan.kernel("dq"))
    while bc > 32 and held(plan, terms, br, bc, sizes) > HELD_FP32 * 32 * warps:
        bc //= 2
    return br, bc, warps


# Each loop kernel's default-tile rule, by role: what the cost pass, the
# tuner's first candidates and the tuner's pruning ask (the template's twins
# run the same rules at launch).
DEFAULT_TILE = {"dq": dq_default_tile, "dkdv": dkdv_default_tile}

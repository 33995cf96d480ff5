"""What a plan's operands may be: the refusals lower() makes once the family's plan is built.

A tensor core product (tl.dot) takes float operands loaded as tiles; fp8 and
int8 ones only as a matrix product's factors.  Split from lower.py, which calls
``refuse_operands`` on every plan it returns.
"""
from __future__ import annotations

from .. import ir, tiling
from .lower import Plan, _refuse_all, unsupported


def refuse_operands(plan: Plan) -> Plan:
    """``plan``, once its operands pass the checks below; else the NapkinError of the first."""
    return _eight_bit_sum(_factor_only(_integer(plan)))


def _factor_only(plan: Plan) -> Plan:
    """fp8 (e4m3, e5m2) and int8 inputs only as the factors of a matrix
    product or of attention's scores, which tl.dot multiplies as they are (a
    pair of one kind at the tensor cores' 8-bit rate, an int8 pair into an
    int32 sum); mixed kinds meet in fp16, which holds both exactly.
    Attention's second product takes P in V's dtype, and P in 8 bits needs
    scaling into its range (FlashAttention-3's way), which napkin does not
    generate: an 8-bit V is refused, 8-bit Q and K beside a float V
    (SageAttention's) are not.  An epilogue's arithmetic on an 8-bit tile has
    no Triton path.  `napkin cost` prices all of them."""
    d = plan.diagram
    factors = {x.tensor for dot in plan.dots for x in (dot.lhs, dot.rhs)} if plan.family == "attention" \
        else {plan.lhs.tensor, plan.rhs.tensor}
    operands = {ld.tensor for ld in _dot_loads(plan)}
    errors = []
    for t in d.inputs:
        if t.dtype in ir.FACTOR_DTYPES and t.name not in factors:
            kind = "int8" if t.dtype == "int8" else "fp8"
            if t.name in operands:   # attention's V
                why = (f"an {kind} value has no kernel path here (attention's P · V product would take P in "
                       f"{kind}, which needs scaling into its range: not generated; {kind} Q and K are taken)")
                hint = f"declare {t.name} fp16 or bf16 (napkin cost prices the {kind} diagram)"
            else:
                why = (f"only the factors of a matrix product or of attention's scores may be {kind} (an "
                       f"epilogue's arithmetic on an {kind} tile has no Triton path)")
                # an int8 mask input is most likely ids or lengths, napkin's int32
                hint = (f"declare {t.name} int32 if it holds ids or lengths, else fp16 or bf16" if kind == "int8"
                        else f"declare {t.name} fp16 or bf16 (napkin cost prices the {kind} diagram)")
            errors.append(unsupported(f"input {t.name}", f"it is {t.dtype}: {why}", t.loc, hint))
    _refuse_all(errors)
    return plan


def _eight_bit_sum(plan: Plan) -> Plan:
    """A product of two 8-bit tiles (e4m3 by e4m3, int8 by int8) sums at least
    32 of its wire a step (tiling.least_block): a schedule streaming 16 ran in
    Triton's interpreter and failed to compile for a GPU."""
    if plan.family == "attention":
        return plan
    d = plan.diagram
    least, block = tiling.least_block(d, plan.red), dict(plan.blocks)[plan.red]
    if block >= least:
        return plan
    tile = next((t for lv in d.schedule.levels for t in lv.tiles if t.wire == plan.red and t.kind == "stream"),
                None) if d.schedule is not None else None
    dtype = d.tensor(plan.lhs.tensor).dtype
    raise unsupported(f"'stream {plan.red} by {block}'", f"{plan.lhs.tensor} and {plan.rhs.tensor} are {dtype}, "
                      f"and a product of 8-bit tiles sums at least {least} of {plan.red} a step on NVIDIA GPUs "
                      "(Triton refuses a smaller block when it compiles for one)",
                      tile.loc if tile is not None else ir.NOLOC, f"write 'stream {plan.red} by {least}' or more")


def _dot_loads(plan: Plan) -> list:
    """The loads a plan's tensor core products (tl.dot) multiply: attention's
    score factors and value, a matrix product's two factors."""
    if plan.family == "attention":
        return [x for dot in plan.dots for x in (dot.lhs, dot.rhs)] + \
            [a.value for a in plan.accums if a.value is not None]
    return [plan.lhs, plan.rhs]


def _integer(plan: Plan) -> Plan:
    """A tensor core product (tl.dot) takes float operands: an integer or bool
    input multiplied into one (Q : int32 in sum[d](Q * K), or the value V)
    failed inside Triton at the call, or crashed the backward's emitter; and
    tiles, not a read at a wire's blocks (A[m // 2, k]: the matmul's loads
    dropped the step)."""
    d = plan.diagram
    loads = _dot_loads(plan)
    errors = [unsupported(f"input {name}", "it is read at a wire's blocks and multiplied in a matrix product "
                          "(tl.dot), whose operands napkin loads as tiles", d.tensor(name).loc,
                          f"expand {name} in torch and pass it along the wires")
              for name in dict.fromkeys(ld.tensor for ld in loads if ld.steps)]
    for name in dict.fromkeys(ld.tensor for ld in loads):   # each input once, in order
        t = d.tensor(name)
        if isinstance(t, ir.Input) and t.dtype not in ir.FLOAT_DTYPES + ir.FACTOR_DTYPES:   # int8: _factor_only
            errors.append(unsupported(f"input {t.name}", f"it is {t.dtype}, and the kernels multiply it in a "
                                      "matrix product (tl.dot), which takes float operands", t.loc,
                                      f"declare {t.name} as a float tensor (fp16, bf16 or fp32) and pass one"))
    _refuse_all(errors)
    return plan

"""What a plan's operands may be: the refusals lower() makes once the family's plan is built.

A tensor core product (tl.dot) takes float operands loaded as tiles; fp8 ones
only as a matrix product's factors.  Split from lower.py, which calls
``refuse_operands`` on every plan it returns.
"""
from __future__ import annotations

from .. import ir
from .lower import FP8_DTYPES, Plan, _refuse_all, unsupported


def refuse_operands(plan: Plan) -> Plan:
    """``plan``, once its operands pass both checks below; else the NapkinError of the first."""
    return _fp8(_integer(plan))


def _fp8(plan: Plan) -> Plan:
    """fp8 inputs (e4m3, e5m2) only as a matrix product's two factors, which
    tl.dot multiplies as they are (an fp8 pair of one kind at the tensor cores'
    fp8 rate; mixed kinds meet in fp16, which holds both exactly).  Attention's
    second product takes P in V's dtype, and P in e4m3 needs scaling into its
    range (FlashAttention-3's way), which napkin does not generate; an epilogue's
    arithmetic on an fp8 tile has no Triton path.  `napkin cost` prices both."""
    d = plan.diagram
    factors = set() if plan.family == "attention" else {plan.lhs.tensor, plan.rhs.tensor}
    errors = []
    for t in d.inputs:
        if t.dtype in FP8_DTYPES and t.name not in factors:
            why = ("fp8 attention has no kernel path here (its P · V product would take P in fp8, which "
                   "needs scaling into its range: not generated)" if plan.family == "attention" else
                   "only a matrix product's two factors may be fp8 (an epilogue's arithmetic on an fp8 "
                   "tile has no Triton path)")
            errors.append(unsupported(f"input {t.name}", f"it is {t.dtype}: {why}", t.loc,
                                      f"declare {t.name} fp16 or bf16 (napkin cost prices the fp8 diagram)"))
    _refuse_all(errors)
    return plan


def _integer(plan: Plan) -> Plan:
    """A tensor core product (tl.dot) takes float operands: an integer or bool
    input multiplied into one (Q : int32 in sum[d](Q * K), or the value V)
    failed inside Triton at the call, or crashed the backward's emitter; and
    tiles, not a read at a wire's blocks (A[m // 2, k]: the matmul's loads
    dropped the step)."""
    d = plan.diagram
    if plan.family == "attention":
        loads = [x for dot in plan.dots for x in (dot.lhs, dot.rhs)] + \
            [a.value for a in plan.accums if a.value is not None]
    else:
        loads = [plan.lhs, plan.rhs]
    errors = [unsupported(f"input {name}", "it is read at a wire's blocks and multiplied in a matrix product "
                          "(tl.dot), whose operands napkin loads as tiles", d.tensor(name).loc,
                          f"expand {name} in torch and pass it along the wires")
              for name in dict.fromkeys(ld.tensor for ld in loads if ld.steps)]
    for name in dict.fromkeys(ld.tensor for ld in loads):   # each input once, in order
        t = d.tensor(name)
        if isinstance(t, ir.Input) and t.dtype not in ir.FLOAT_DTYPES:
            errors.append(unsupported(f"input {t.name}", f"it is {t.dtype}, and the kernels multiply it in a "
                                      "matrix product (tl.dot), which takes float operands", t.loc,
                                      f"declare {t.name} as a float tensor (fp16, bf16 or fp32) and pass one"))
    _refuse_all(errors)
    return plan

"""A matrix product's kernel context: C = f(sum[k](A * B)), the forward's
(templates/contraction.py.jinja) and the backward's dA, dB and recomputed sum
(training.py, through templates/contraction_kernel.py.jinja).

One program per (row block, column block, batch index), taken in groups of
row blocks (tiling.grouped_program: the kernel's lines, the L2 model's
order); the sum's streamed wire in blocks, whole ones unmasked, then the
ragged last; the sum's other wires (ContractionPlan.outer) looped over index
by index around that stream; the epilogue f on the float32 accumulator (an
int8 pair's exact int32 one, made float32 unless every output is an
integer), then one store.
"""
from __future__ import annotations

from typing import Optional

from .. import ir, tiling
from . import launch as H
from . import lower as L
from .emit import _decode, _finalise, _kinds, _load, _Names, _params, _wire_ctx, dot_operands


def contraction_context(plan: L.ContractionPlan) -> dict:
    d = plan.diagram
    names = _Names(d, plan.dims)
    kinds = _kinds(d)
    row, col, red = plan.row, plan.col, plan.red
    dtypes = {t.name: t.dtype for t in d.inputs}
    lhs, rhs = dot_operands(plan.lhs.var, dtypes[plan.lhs.tensor], plan.rhs.var, dtypes[plan.rhs.tensor])
    step = f'_acc = tl.dot({lhs}, {rhs}, _acc, input_precision="{plan.precision}")'
    finalise, stores = _finalise(d, names, plan.outputs, kinds, {})
    # an int8 pair sums exactly in int32 (tl.dot's integer path); the epilogue takes it as float32
    # unless every output is an integer (C : int32 = sum[k](A * B) stores the exact sum)
    integral = dtypes[plan.lhs.tensor] == dtypes[plan.rhs.tensor] == "int8"
    if integral and any(tiling.tensor_dtype(d, o.name) not in ir.INT_DTYPES for o in d.outputs):
        finalise = "_acc = _acc.to(tl.float32)\n" + finalise
    least = tiling.least_block(d, red)   # 32 along an 8-bit product's sum
    blocks_list = [names.block(w) for w in (row, col, red)] + ["_INT64", "_GROUP"]
    params, sizes = _params(d, names, blocks_list)
    opts = H.options(d, [row, col, red])
    batch = " * ".join(f'_sz["{w}"]' for w in plan.batch) or "1"
    pairs = ((row, col), (row, red), (red, col))
    block_var = {row: "_br", col: "_bc", red: "_bk"}
    launch = H.fill_options(opts) + [
              f'_br = _block_size(_opts["block_{row}"], "{row}", "block_{row}")',
              f'_bc = _block_size(_opts["block_{col}"], "{col}", "block_{col}")',
              f'_bk = _block_size(_opts["block_{red}"], "{red}", "block_{red}")',
              *H.least_block(red, least, "_bk"),
              *(H.tile_fits(x, y, block_var[x], block_var[y]) for x, y in pairs),
              f"[{', '.join(o.name for o in d.outputs)}] = _allocate(_sz, _cls, _dev)",
              f'_grid = _fits((_cdiv(_sz["{row}"], _br), _cdiv(_sz["{col}"], _bc), {batch}))']
    block_args = [f"{names.block(row)}=_br", f"{names.block(col)}=_bc", f"{names.block(red)}=_bk",
                  f"_INT64=_int64_offsets({', '.join([t.name for t in d.inputs] + [o.name for o in d.outputs])})",
                  "_GROUP=_GROUP_ROWS"]
    launch.append(H.launch_call(d, f"_{d.name}_kernel", "_grid", block_args,
                               ['num_warps=_opts["num_warps"] or (8 if _br * _bc >= 128 * 128 else 4)',
                                'num_stages=_opts["num_stages"] or 2', H.FP_FUSION]))
    return {
        "kernel": f"_{d.name}_kernel", "group_rows": tiling.GROUP_ROWS, "params": params,
        "no_specialize": ", ".join(f'"{s}"' for s in sizes),
        "decode": _decode(names, plan.batch, 2), "outer": _outer(names, plan.outer),
        "row": _wire_ctx(names, row), "col": _wire_ctx(names, col), "red": _wire_ctx(names, red),
        # an epilogue's float tiles read 1.0 past the edges: lanes the store drops, where a 0.0
        # divisor (tanh(sum[k](A * B)) / bias) made inf and NaN (the interpreter warned of them)
        "pre_loads": [_load(d, names, ld, pad="1.0") for ld in plan.loads],
        "step_loads": [_load(d, names, ld) for ld in (plan.lhs, plan.rhs)],
        "full_loads": [_load(d, names, ld, inside=(red,)) for ld in (plan.lhs, plan.rhs)],
        "step": step, "acc_dtype": "tl.int32" if integral else "tl.float32", "finalise": finalise,
        "stores": stores, "launch": "\n".join(launch),
        "check_options": H.option_checks(H.given_blocks([row, col, red]) + [
            *H.least_block(red, least)] + [H.tile_fits(x, y) for x, y in pairs] + [
            # the grid's limits (_fits): axis 1 the column blocks where a block is given (else the
            # tuned blocks may differ), axis 2 the batch
            f'_fits((1, _cdiv(_sz["{col}"], _b_{col}) if (block_{row}, block_{col}, block_{red}) != (None, None, None) '
            f'else 1, {batch}))']),
        "launcher_params": ", ".join([t.name for t in d.inputs] + ["*"] + [f"{o}=None" for o in opts]),
        "options": opts,
    }


def _outer(names: _Names, outer: tuple[str, ...]) -> Optional[dict]:
    """The loop of a program over the sum's other wires (ContractionPlan.outer), around its
    stream: the count of its steps and each step's indices, decoded as the batch's are (the
    loop's own index copied first: it may not be reassigned); None where the sum is over the
    streamed wire alone."""
    if not outer:
        return None
    return {"wires": ", ".join(outer), "count": " * ".join(names.size(w) for w in outer),
            "decode": "_rest = _o\n" + _decode(names, outer, flat="_rest")}

"""The kernels' own variable names, and the names a diagram's tensors take there.

A diagram's names are the user's: a tensor or box called ``s``, ``acc`` or
``offs_q`` must not overwrite a variable the kernel's skeleton defines.
``internal_names`` lists every variable the kernels may define for a
diagram (a superset), and ``fresh_name`` gives a user's name its kernel
variable clear of them, deterministically.  Split from lower.py, whose
loads (``_Loads``) and the attention lowering's boxes take their names here.
"""
from __future__ import annotations

from .. import ir


# The @triton.jit helpers every module defines (templates/module.py.jinja)
# and kernels call by name: a kernel variable of that name would shadow the
# helper, and the call would fail or read a tile.
KERNEL_HELPERS = frozenset({"_ix", "_tanh", "_sigmoid", "_relu", "_logsumexp", "_safe_div", "_operand_grad",
                            "_scaled_grad", "_tile_sum", "_coarse"})   # the last two: training.py.jinja's
# What the ranges prepass of a mask that reads data, and the kernels' code
# reading its ranges, define (ranges.py; templates/ranges.py.jinja).
RANGES_NAMES = frozenset({"_ranges", "_RANGES", "_rg", "_mb", "_steps", "_j", "_keep",
                          "_any", "_all", "_whole", "_out", "_BY_COL", "_WHOLE_ROWS", "_chunk", "_first",
                          "_last", "_parts", "_per", "_tiles", "_state", "_rp", "_rl", "_fp", "_fl", "_pa", "_pb",
                          "_is", "_iv", "_rq", "_fq"})


def part(name: str) -> str:
    """A name as one part of a kernel name napkin derives from it (a stride
    ``_st_Q_d``, a side input's partial sums ``_part_slope``, a TMA descriptor
    ``_tma_Q``): a user's name with its underscores doubled, so that parts
    joined by one underscore say one thing.  Tensor Q along wire h_q is
    ``_st_Q_h__q`` and tensor Q_h along q ``_st_Q__h_q`` (both were
    ``_st_Q_h_q``: a duplicate argument); side input acc_m's partial sums are
    ``_part_acc__m`` and m's running sum ``_part_acc_m``.  napkin's own names
    (a leading underscore, which a diagram's names cannot have, built from
    parts already) stay as they are."""
    return name if name.startswith("_") else name.replace("_", "__")


def joined(base: str, *names: str) -> str:
    """The kernel name napkin derives from ``names`` (each a part): ``_base_N1_N2``."""
    return "_" + base + "".join("_" + part(n) for n in names)


def stride(tensor: str, wire: str) -> str:
    """The kernel parameter holding ``tensor``'s stride along ``wire``."""
    return joined("st", tensor, wire)


def internal_names(d: ir.Diagram) -> frozenset:
    """Every variable the kernels' own code may define for ``d`` (a superset):
    loop bounds, the step's temporaries (``_s``, ``_p``, ``_m_new``, ``_t0``),
    running state (``_m``, ``_l``, ``_acc``), the exponent's folded scale
    (``_scale``), fp16 weight fitting's row exponents (``_e0``, ``_k0``), the
    chunks' and the merge's state (``_c0``, ``_part``, ``_beta``), per-wire offsets and masks (``_offs_q``, ``_ok_x``), per-tensor strides and gradient accumulators,
    the contraction's ``_a``, ``_b`` and ``_full``, the module's jit helpers;
    not the names loads and box tiles themselves take (those of the
    backward's dO, lse, delta: ``_Loads`` keeps loads apart).  A load is
    named ``_`` + the tensor's name and a box's per-step tile ``_`` + the
    box's name (``fresh_name``), and a diagram's names are the user's: a
    tensor or box called ``s``, ``acc`` or ``offs_q`` must not overwrite the
    kernel's own variable, so it takes another name (``_s_1``)."""
    suffixes = [""] + [str(i) for i in range(16)]
    out = {"_pid", "_batch", "_row0", "_col0", "_start", "_lo", "_hi", "_flo", "_fhi", "_row_first",
           "_row_last", "_col_first", "_col_last", "_live", "_rb", "_it", "_o", "_ok", "_need", "_grid",
           # a union bound's run of row blocks (backward_emit._union_rows)
           "_ulo", "_uhi",
           "_opts", "_pos", "_SAVE", "_SPLIT_WEIGHTS", "_FIT_WEIGHTS", "_INT64", "_a", "_b", "_full", "_TMA", "_tma",
           # chunks (flash-decoding): the chunk's start and size, its partial state, the merge's own
           "_c0", "_CHUNK", "_part", "_n_chunks", "_W", "_at", "_c", "_m_c", "_beta", "_v",
           # the backward's widened products' precision; the ranges merge kernel's locals
           "_WIDE", "_chunks", "_inner", "_joined", "_n", "_src",
           # the dQ kernel's per-row sum of dS (backward_emit.DS_ROWS)
           "_ds_rows",
           # a contraction kernel's grouped program order (tiling.grouped_program)
           "_GROUP", "_rows", "_in_group", "_linear", "_size"} | KERNEL_HELPERS
    # (a side input called c0, k0 or WIDE was overwritten by these: wrong numbers or a crash)
    for sfx in suffixes:
        out |= {f"_{base}{sfx}" for base in ("s", "p", "m", "m_new", "m_use", "alpha", "qk", "acc", "l", "max",
                                             "min", "t", "w", "dot", "sum", "scale", "e", "k")}
    wires = [w.name for w in d.wires]
    for w in wires:
        out |= {f"_{base}_{w}" for base in ("offs", "ok", "gok", "idx", "size", "i", "pos", "len", "BLOCK", "POS")}
    tensors = [t.name for t in d.inputs] + [t.name for t in d.lets]
    for t in tensors:
        out |= {f"_{base}_{t}" for base in ("out", "acc", "grad", "saved", "NEED")}
        out |= {joined(base, t) for base in ("part", "part_acc", "part_pg", "tma")}
        # the forward's TMA descriptor parameters (_tma_Q; _tma_Q_1 for a second tile of Q)
        out |= {f"{joined('tma', t)}_{i}" for i in range(1, 4)}
        out |= {stride(t, w) for w in wires}
        out |= {joined("G", t, w) for w in wires}   # a side partial's granules (backward_emit.granule)
    # napkin's own tensors (training's saved row state _saved_lse, the gradient
    # buffers _grad_Q) are kernel parameters: a box called saved_lse must not
    # overwrite the pointer the lse is stored through
    out |= {t for t in tensors if t.startswith("_")}
    return frozenset(out | RANGES_NAMES)


def fresh_name(name: str, taken, reserved=(), prefix: str = "_") -> str:
    """The kernel variable for the user's tensor or box ``name``: ``_name``,
    else the first free of ``_name_1``, ``_name_2``, ... (deterministic: it
    depends only on what is taken); the caller adds it to ``taken``.  With
    another ``prefix`` ("" for a launcher's parameter), the same scheme."""
    var, n = f"{prefix}{name}", 1
    while var in taken or var in reserved:
        var, n = f"{prefix}{name}_{n}", n + 1
    return var

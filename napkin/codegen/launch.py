"""The host side of a kernel launch, as source: the call itself (tensors,
sizes and strides in the kernels' order), the launcher's options, the
tuned-config lookup that fills them, and the checks of those options that the
torch op's fakes run without a launch (templates/module.py.jinja), and the
launcher's docstring.  Shared by the forward's emitter (emit.py) and the
backward's (backward_emit.py)."""
from __future__ import annotations

from typing import Optional

from .. import ir, masks, tiling
from . import lower as L
from . import ranges as R
from .pysrc import quote, tuple_of


def size_wires(d: ir.Diagram, runtime=frozenset()) -> list[str]:
    """The wires whose sizes a kernel takes as arguments: the symbolic ones,
    and ``runtime`` (_Names.runtime)."""
    return [w.name for w in d.wires if w.size is None or w.name in runtime]


def positional_args(d, runtime=frozenset()) -> list[str]:
    """A kernel's positional arguments, a line each: tensors, sizes, then each tensor's wire strides."""
    tensors = [t.name for t in d.inputs] + [o.name for o in d.outputs]
    sizes = [f'_sz["{w}"]' for w in size_wires(d, runtime)]
    strides = [f'*_wire_strides({t}, "{t}", _sz)' for t in tensors]
    return [", ".join(tensors)] + ([", ".join(sizes)] if sizes else []) + strides


def kernel_call(d, kernel: str, grid: str, blocks: list[str], extra: list[str], runtime=frozenset()) -> str:
    """``kernel[grid](tensors, sizes, strides, blocks..., extra...)``, unindented."""
    body = ",\n    ".join(positional_args(d, runtime) + [", ".join(blocks + extra)])
    return f"{kernel}[{grid}](\n    {body},\n)"


def indent(text: str, n: int = 4) -> str:
    """Each line of ``text`` indented by n spaces (a launch placed in a block)."""
    return "\n".join(" " * n + line for line in text.split("\n"))


def launch_call(d, kernel: str, grid: str, blocks: list[str], extra: list[str], runtime=frozenset()) -> str:
    """The launch, skipped when the grid is empty."""
    return "if math.prod(_grid) > 0:\n" + indent(kernel_call(d, kernel, grid, blocks, extra, runtime))


def option_checks(lines: list[str]) -> str:
    """The body of _NAME_check_options (templates/module.py.jinja): the launch
    options' checks that need no launch, the same helpers the launch calls."""
    return "\n".join(['_autotune_fill({"num_warps": num_warps, "num_stages": num_stages}, _sz, None, None, lookup=False)']
                     + lines)


def given_blocks(wires: list[str], option: str = "block_{}") -> list[str]:
    """_b_<wire>: each block option given, checked; one not given is the
    schedule's, as at the launch: a launch given any block or chunk takes no
    cached blocks (_autotune_fill), and one given none has nothing to refuse.
    ``option``: the option's value, a format of the wire's name."""
    return [f'_b_{w} = _block_size({option.format(w)}, "{w}", "block_{w}")' for w in wires]


def least_block(wire: str, least: int, var: str = "") -> list[str]:
    """The check that the block of ``wire`` (the variable ``var``; the fakes'
    _b_wire by default) is at least ``least`` (tiling.least_block): none where
    it is tl.dot's usual least, which _block_size checks already."""
    if least <= tiling.MIN_DOT_BLOCK:
        return []
    var = var or f"_b_{wire}"
    return [f"if {var} < {least}:   # an 8-bit product's sum (tiling.least_block)\n"
            f'    raise ValueError(f"block_{wire} must be at least {least} here, not {{{var}}}: a product of '
            f'8-bit tiles sums {least} of {wire} a step on NVIDIA GPUs")']


def tile_fits(x: str, y: str, bx: str = "", by: str = "", given: str = "block_{}") -> str:
    """The check that the blocks of wires x and y (the variables ``bx``,
    ``by``; the fakes' _b_x, _b_y by default) make a tile Triton takes, naming
    a block the caller did not give as the schedule's; each block beside the
    feature wires the kernels hold whole too (_AUTOTUNE_DIMS, at the sizes _sz).
    ``given``: the caller's option of a wire, a format of the wire's name."""
    return (f'_tile_fits(({bx or "_b_" + x}, {by or "_b_" + y}), ("block_{x}", "block_{y}"), '
            f'({given.format(x)} is not None, {given.format(y)} is not None), _sz)')


def tile_dims(d: ir.Diagram, dims) -> str:
    """_AUTOTUNE_DIMS (templates/autotune.py.jinja): each feature wire of ``dims``
    (those the kernels hold whole, forward and backward) in declaration order,
    with the block the launches pass as its _BLOCK_<wire> where the diagram
    fixes it, else None (_dim_block of its size at the launch), and its least
    block (tiling.least_block)."""
    held = set(dims)
    return tuple_of(tuple_of([quote(w.name), str(L._dim_block(d, w.name)), str(tiling.least_block(d, w.name))])
                    for w in d.wires if w.name in held)


def fill_options(opts: list[str]) -> list[str]:
    """Options left None take the tuned config cached for this shape bucket
    (templates/autotune.py.jinja), else the schedule's defaults."""
    pairs = ", ".join(f'"{o}": {o}' for o in opts)
    return [f"_opts = _autotune_fill({{{pairs}}}, _sz, _dev, _cls)"]


def options(d: ir.Diagram, wires: list[str], extra=()) -> list[str]:
    """The tuned options of a launcher with a block along each of ``wires``
    (and ``extra``), refused where an input or output takes one's name."""
    opts = [f"block_{w}" for w in wires] + ["num_warps", "num_stages"] + list(extra)
    clash = sorted(set(opts) & {t.name for t in d.inputs})
    if clash:
        t = d.tensor(clash[0])
        raise L.unsupported(f"input {t.name}", f"the launcher has an option named {t.name}", t.loc,
                            "rename the input")
    # every input and output is a kernel parameter of its own name, and the launches
    # pass Triton's options (TRITON_LAUNCH): a tensor of that name would be given twice
    # (an input named num_warps or num_stages is refused above, as a launcher option)
    for t in (*d.inputs, *d.outputs):
        if t.name in TRITON_LAUNCH + TRITON_RESERVED:
            kind, fix = ("input", "rename the input") if isinstance(t, ir.Input) else ("output", "rename the box")
            what = f"Triton's option {t.name}" if t.name in TRITON_LAUNCH else f"a name of Triton's own ({t.name})"
            raise L.unsupported(f"{kind} {t.name}", f"the kernel launch takes {what}, and "
                                f"each {kind} is a kernel parameter of its own name", d.tensor(t.name).loc, fix)
    return opts


# Every launch asks for floating-point fusion (a * b + c as one FMA: the folded
# softmax exponent is one FFMA a score) instead of taking Triton's default,
# which is on up to 3.9 and off from 3.10 (TRITON_DEFAULT_FP_FUSION).
FP_FUSION = "enable_fp_fusion=True"

# Triton's launch options napkin's launches pass (kernel[grid](..., num_warps=...)).
TRITON_LAUNCH = ("num_warps", "num_stages", "enable_fp_fusion")
# Names a compiled (not interpreted) launch binds beside the kernel's parameters:
# JITFunction.run passes debug, instrumentation_mode and fpsan_homomorphic_casts
# by keyword, and the binder it generates names options, params, backend and
# specialize_impl itself.  A tensor so named passed the interpreter and failed
# every GPU launch inside Triton (names2 hunt, Triton 3.9's runtime/jit.py).
TRITON_RESERVED = ("debug", "instrumentation_mode", "fpsan_homomorphic_casts", "options", "params", "backend",
                   "specialize_impl")


# Launcher options of attention kernels beyond the tuned ones (block sizes,
# warps, stages and tma: codegen/tma.py): rows at global positions, global
# lengths, the float outputs' dtype (templates/attention.py.jinja).
POSITION_OPTIONS = ("positions", "lengths", "out_dtype")
# chunk=: the length of the streamed wire's chunk each program streams (_chunks in
# templates/attention.py.jinja); mask_cache=: the caller's dict the ranges prepass's
# results are kept in across calls (ranges.py), accepted by every attention launcher
LAUNCH_OPTIONS = POSITION_OPTIONS + ("chunk", "mask_cache")


def refuse_clash(d: ir.Diagram, names) -> None:
    """An input or output named like a launcher option: an input would be a
    duplicate parameter, an output's buffer replaces the option's value in
    the launcher (an output 'chunk' made every call fail)."""
    # (the launcher keeps positions=, lengths= and out_dtype= apart from outputs of those names;
    # chunk and mask_cache are read after the outputs are allocated under their names)
    clash = sorted(set(names) & ({t.name for t in d.inputs} | ({o.name for o in d.outputs} & {"chunk", "mask_cache"})))
    if clash:
        t = d.tensor(clash[0])
        what = "input" if isinstance(t, ir.Input) else "output"
        raise L.unsupported(f"{what} {t.name}", f"the launcher has an option named {t.name}", t.loc,
                            f"rename the {what}")


# --------------------------------------------------------------------------
# The launcher's docstring, in words (emit.module_context's launcher_doc).
# --------------------------------------------------------------------------

def launcher_doc(plan: L.Plan, options, no_backward: Optional[str] = None, ungradable=None) -> str:
    """The forward launcher's docstring: its inputs and outputs, its options, whether it trains."""
    d = plan.diagram
    outs = ", ".join(o.name for o in d.outputs)
    blocks = ", ".join(f"block_{w}={n}" for w, n in plan.blocks)
    grads = ("Differentiable: when an input requires a\n"
             f"gradient (or under torch.compile) this calls the torch op, whose backward\n"
             f"runs the backward kernels (see {d.name}_backward)." if no_backward is None else
             "Not differentiable: an input that requires a\n"
             "gradient raises NotImplementedError with the reason (_NO_BACKWARD).")
    if no_backward is None and ungradable:
        grads += (f"  {', '.join(ungradable)} must not require a\ngradient: napkin has no kernel for "
                  "it (NotImplementedError; _NO_GRADIENT says why).")
    return (f'"""Run the kernel: {", ".join(t.name for t in d.inputs)} -> {outs}.\n\n'
            f"Block sizes default to the schedule's ({blocks}); smaller ones\n"
            "(e.g. 16 or 32) keep runs under TRITON_INTERPRET=1 fast.  num_warps and\n"
            "num_stages go to Triton.  " + grads
            + (_POSITIONS_DOC.format(row=plan.row, col=plan.col, chunk=_chunk_doc(d, plan.col))
               if plan.family == "attention" else "")
            + (_mask_cache_doc(plan) if plan.family == "attention" else "")
            + (f"\nThe forward packs {plan.pack[0]} into the rows (group {plan.pack[0]} by {plan.pack[1]}): "
               f"its block_{plan.row}\ncounts ({plan.pack[0]}, {plan.row}) pairs; the backward's counts "
               f"rows of {plan.row}."
               if plan.family == "attention" and plan.pack else "")
            + '"""')


def _mask_cache_doc(plan: L.AttentionPlan) -> str:
    """The launcher's mask_cache= in words: what it keeps for this diagram."""
    if not R.applies(plan):
        read = masks.lengths_read(plan.bounds)
        why = (f"reads {', '.join(read)}, which the kernels' loop bounds load once a\nprogram" if read
               else "reads no data")
        return ("\nmask_cache: accepted (a dict or None) and left empty: this diagram's mask\n"
                f"{why}, so it has no ranges prepass to keep.")
    reads = ", ".join(R.mask_tensors(plan)) or "no tensor"
    return ("\nmask_cache={} (a dict of yours; default None: none kept) keeps the mask's\n"
            "ranges prepass results (which blocks are live, which full; the mask reads\n"
            f"{reads}) across calls, the forward's and, through autograd or\n"
            f"{plan.diagram.name}_backward, the dK/dV and dQ kernels': later calls with the same\n"
            "blocks, sizes, device and mask input shapes run no prepass, as a\n"
            f"FlexAttention BlockMask is built once.  An entry serves the same {reads}\n"
            "tensor objects, unwritten since (their version counters): a new batch's\n"
            "tensor, or one written in place, runs the prepass again.  Writes the\n"
            "counter does not see (through .data, outside torch, to inference tensors)\n"
            "leave stale entries, which give wrong results.  Eager calls only\n"
            "(not under torch.compile); with positions=/lengths= no prepass runs and\n"
            "nothing is kept.")


def _chunk_doc(d: ir.Diagram, col: str) -> str:
    chunk = L.chunk_of(d)
    return f"group {col} by {chunk}" if chunk is not None else "none"


_POSITIONS_DOC = """

Forward only: positions={{{row!r}: ..., {col!r}: ...}} gives the global index
of each local row (int tensors; integer inputs are read there and hold
the global length), lengths={{{row!r}: ..., {col!r}: ...}} the global sizes
(needed with positions; {col} rows at positions >= it, or negative, are
padding, and so are {row} rows, whose outputs are then unspecified; without positions a
row's position is its offset, so lengths={{{col!r}: n}} alone makes the rows
from n on padding), and
out_dtype (e.g. torch.float32) the dtype of every float output.
tma=True moves the qualifying tiles (one tiled wire and the head dim: Q,
K, V, O; in training also dO, dQ, dK, dV) of the forward and, through
autograd, of the dQ and dK/dV kernels through TMA descriptors on sm_90+ (or
the interpreter), else the pointer code, silently (_tma_last, _tma_last_dq,
_tma_last_dkdv say which and why); None (the default) takes each kernel's
tuned config's choice, else off: untimed on a GPU so far.
chunk=C (a power of two, whole blocks of {col}) gives each program one chunk
of C {col} rows and merges the chunks' states in a second kernel
(flash-decoding: for few rows of {row} against many of {col}); 0 streams
the whole of {col} in one program; None takes the tuned config's, else the
schedule's ({chunk}).  Forward only; training takes the tuned or schedule's."""

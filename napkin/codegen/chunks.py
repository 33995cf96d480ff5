"""Chunks of the streamed wire (flash-decoding's split of the keys), as
Triton source for the attention template (templates/attention.py.jinja).

``group x by C`` beside ``stream x by B`` (ir.Tile.chunk), or the launcher's
chunk=C: the forward's grid gains an axis of chunks; each program streams
[_lo, _hi) cut to its chunk (chunk_bounds) and stores its streaming state
(the running maxes and the accumulators, float32) to a scratch buffer instead
of the outputs (chunk_store); then the merge kernel folds the chunks' states
into one as the step folds a block (expsums rescaled to the larger max, sums
added, max and min taken: chunk_merge) and finalises and stores as the whole
kernel would.  The state is row-major per row: [chunk, batch program, row,
state] with the state's parts at the offsets of chunk_state(); a part with a
value wire is the whole padded block of it.  The cost model reads the same
layout (napkin/cost/chunks.py); which tiles the merge loads again is
emit.merge_loads (it renders the finalise)."""
from __future__ import annotations

from typing import Optional

from . import lower as L
from .pysrc import NEG_INF, POS_INF, names_read


def chunk_state(plan: L.AttentionPlan, names, block=None) -> tuple[list[tuple[str, str, Optional[str]]], str]:
    """The streaming state's parts (variable, offset, value wire or None) and
    its width per row; ``block(wire)`` renders a value wire's block (the
    kernel's constexpr name by default, the launcher's value for the launcher)."""
    block = block or names.block
    state = [(m, None) for m, _ in plan.groups] \
        + [(a.var, a.value.cols if a.value is not None else None) for a in plan.accums]
    parts, terms = [], []
    for var, cols in state:
        parts.append((var, " + ".join(terms) or "0", cols))
        terms.append(block(cols) if cols is not None else "1")
    width = " + ".join(_merge_ones(terms))
    return parts, width


def _merge_ones(terms: list[str]) -> list[str]:
    ones = sum(t == "1" for t in terms)
    return ([str(ones)] if ones else []) + [t for t in terms if t != "1"]


def _part(off: str, cols: Optional[str]) -> str:
    """A state part's pointers from _at: one per row, or the row's block of ``cols``."""
    return f"_at + {off}" + (f" + _offs_{cols}[None, :]" if cols else "")


def _state_at(names, row: str, chunk: str) -> str:
    return (f"_at = _part + (({chunk} * tl.num_programs(1) + tl.program_id(1).to(tl.int64)) * {names.size(row)} "
            f"+ _offs_{row}[:, None]) * _W")


def chunk_bounds(segs: list[dict]) -> list[str]:
    """[_lo, _hi) and the full run inside it cut to this program's chunk
    (grid axis 2).  Chunks are whole blocks, so every bound stays on a block
    edge; a chunk past the range leaves every loop empty."""
    lines = ["_c0 = tl.program_id(2) * _CHUNK",
             "_lo = tl.maximum(_lo, _c0)",
             "_hi = tl.minimum(_hi, _c0 + _CHUNK)"]
    used = [v for v in ("_flo", "_fhi") if any(v in (seg["lo"], seg["hi"]) for seg in segs)]
    return lines + [f"{v} = tl.minimum(tl.maximum({v}, _lo), _hi)" for v in used]


def chunk_store(plan: L.AttentionPlan, names) -> list[str]:
    """The main kernel's store of its chunk's state."""
    row = plan.row
    parts, width = chunk_state(plan, names)
    lines = [f"_W = {width}  # the state's float32 width per row", _state_at(names, row, "tl.program_id(2).to(tl.int64)")]
    for var, off, cols in parts:
        lines.append(f"tl.store({_part(off, cols)}, {var}, mask=_ok_{row}[:, None])")
    return lines


def chunk_merge(plan: L.AttentionPlan, names) -> list[str]:
    """The merge kernel's loop over the chunks: each chunk's state folded
    into the running one as the step folds a block."""
    row = plan.row
    parts, width = chunk_state(plan, names)
    offset = {var: (off, cols) for var, off, cols in parts}
    body = [_state_at(names, row, "_c")]
    group_sfx = {m: ("" if i == 0 else str(i)) for i, (m, _) in enumerate(plan.groups)}
    for m, sfx in group_sfx.items():
        body += [f"_m_c{sfx} = tl.load({_part(offset[m][0], None)}, mask=_ok_{row}[:, None], other={NEG_INF})",
                 f"_m_new{sfx} = tl.maximum({m}, _m_c{sfx})",
                 f"_m_use{sfx} = tl.where(_m_new{sfx} == {NEG_INF}, 0.0, _m_new{sfx})  # all -inf so far: no NaN",
                 f"_alpha{sfx} = tl.exp2({m} - _m_use{sfx})",
                 f"_beta{sfx} = tl.exp2(_m_c{sfx} - _m_use{sfx})",
                 f"{m} = _m_new{sfx}"]
    for a in plan.accums:
        off, cols = offset[a.var]
        fill = {"max": NEG_INF, "min": POS_INF}.get(a.op, "0.0")
        body.append(f"_v = tl.load({_part(off, cols)}, mask=_ok_{row}[:, None], other={fill})")
        if a.op == "expsum":
            sfx = group_sfx[a.group]
            body.append(f"{a.var} = {a.var} * _alpha{sfx} + _v * _beta{sfx}")
        elif a.op in ("max", "min"):
            body.append(f"{a.var} = tl.{'maximum' if a.op == 'max' else 'minimum'}({a.var}, _v)")
        else:
            body.append(f"{a.var} = {a.var} + _v")
    return [f"_W = {width}  # the state's float32 width per row", "for _c in range(0, _n_chunks):"] \
        + ["    " + line for line in body]


def merge_launch(kernel: str, body: str, params: list[str], positional: int, keywords: dict[str, str],
                 extra: list[str]) -> tuple[list[str], str]:
    """The merge kernel's parameters and its launch, unindented.  The merge
    takes only the kernel's parameters that its ``body`` (the rendered
    Triton source) reads: Triton's launcher binds and specialises every
    argument it is passed on the host, and a chunked decode step pays it for
    both kernels (flash_decoding's merge, 52 arguments cut to 23: about 9 us
    less a call, bench/launch_overhead.py --triton on the development machine).
    ``params``: the main kernel's, the first ``positional`` of them passed
    as the launcher's tuple ``_args`` (sliced here, so the strides are not
    worked out twice), the rest by keyword, each rendered by ``keywords``;
    ``extra``: Triton's launch options."""
    read = names_read(body)
    kept = [i for i, p in enumerate(params) if p.split(":")[0] in read]
    runs: list[list[int]] = []   # the kept positional arguments, as runs of consecutive indices
    for i in (i for i in kept if i < positional):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    args = " + ".join(f"_args[{a}:{b}]" for a, b in runs) or "()"
    by_name = []
    for i in (i for i in kept if i >= positional):
        name = params[i].split(":")[0]
        if name not in keywords:  # a parameter the launch has no value for: the generator's bug
            raise AssertionError(f"merge kernel {kernel}: no launch value for its parameter {name}")
        by_name.append(f"{name}={keywords[name]}")
    call = f"{kernel}[_grid[:2]](\n    *({args}),\n    " + ",\n    ".join(filter(None, [", ".join(by_name), ", ".join(extra)])) + ",\n)"
    return [params[i] for i in kept], call

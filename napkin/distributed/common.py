"""What ATTENTION2D and Ring Attention share: argument checking through the
handshake, padding rows, and the outputs in the diagram's order."""
from __future__ import annotations

import zlib
from typing import Optional, Sequence

import torch

from .. import ir
from ..printer import to_text
from . import groups as G
from .commcount import phase
from .layouts import KINDS, TokenLayout
from .local import Roles

SCHEME_CODES = {"attention2d": 1, "ring": 2, "burst": 3, "tree": 4, "ring2": 5, "burst2": 6}


def split_side(r: Roles, side: dict, tokens: Sequence[torch.Tensor] = ()) -> dict:
    """The keyword inputs in order: the side inputs, then the row inputs (Roles.rows).  A
    Python number given for a scalar input (in t : fp32) becomes a 0-dimensional tensor on
    the tokens' device, as the single-device launchers take it: floats in the tokens' dtype."""
    names = r.side + r.rows
    missing = [n for n in names if n not in side]
    extra = [n for n in side if n not in names]
    if missing or extra:
        raise ValueError(f"side inputs: expected {', '.join(names) or 'none'}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; unexpected {', '.join(extra)}" if extra else ""))
    return {n: _scalar(r.diagram.tensor(n), side[n], tokens) for n in names}


def _scalar(t, value, tokens):
    if isinstance(value, torch.Tensor) or t.axes or not isinstance(value, (bool, int, float)):
        return value
    like = tokens[0] if tokens and isinstance(tokens[0], torch.Tensor) else None
    if t.dtype == "bool" or isinstance(value, bool):
        if t.dtype != "bool" or not isinstance(value, bool):
            raise TypeError(f"side input {t.name} is declared {t.dtype}: {value!r} is not one")
        dtype = torch.bool
    elif t.dtype in ("int32", "int64"):
        if not isinstance(value, int):
            raise TypeError(f"side input {t.name} holds integers (declared {t.dtype}): {value!r} is not one")
        dtype = getattr(torch, t.dtype)
    else:
        dtype = like.dtype if like is not None and like.is_floating_point() else torch.float32
    return torch.tensor(value, dtype=dtype, device=like.device if like is not None else "cpu")


def attention_side(r: Roles, side: dict) -> dict:
    """The side inputs the attention takes: those the epilogue alone reads detached (the
    attention never reads them; their gradient is the epilogue's, by autograd), no row input."""
    only = r.epilogue.only if r.epilogue is not None else ()
    return {n: (side[n].detach() if n in only else side[n]) for n in r.side}


def handshake(r: Roles, scheme: str, tokens: Sequence[torch.Tensor], side: dict, q_lay: TokenLayout,
              x_lay: TokenLayout, group_seq: Sequence, timeout: float, where: callable) -> dict[str, int]:
    """Exchange every rank's shapes, dtypes and lengths; raise the same
    ValueError on every rank when they disagree or do not fit the layouts.
    ``where(part)`` names a device in messages.  Returns the side inputs'
    fingerprints (a crc32 of each one's values, the same on every rank)."""
    if len(tokens) != len(r.tokens):
        # every rank of a correct program passes the same count; a wrong count
        # is caught here before any collective, and the peers time out
        raise ValueError(f"expected {len(r.tokens)} token inputs ({', '.join(r.tokens)}), got {len(tokens)}")
    tensors = list(tokens) + [side[n] for n in r.side + r.rows]
    names = list(r.tokens) + list(r.side) + list(r.rows)
    # the token layout and the diagram itself too: ranks that disagree on either compute
    # another function together (a zigzag rank beside a contiguous one) without a shape to differ
    head = [SCHEME_CODES[scheme], q_lay.length, x_lay.length, KINDS.index(q_lay.kind) + 1,
            zlib.crc32(to_text(r.diagram).encode()) & 0x7FFFFFFF]
    with phase("check"):
        # side inputs are passed whole, so every rank's values must agree too
        prints = [-1] * len(tokens) + [G.fingerprint(side[n]) for n in r.side] + [-1] * len(r.rows)
        table = G.exchange_meta(G.describe(head, tensors, prints), group_seq, timeout, tokens[0].device)
    first = table[0]
    for part in range(1, table.shape[0]):
        row = table[part]
        if torch.equal(row, first):
            continue
        if not torch.equal(row[:G.META_HEAD], first[:G.META_HEAD]):
            raise ValueError(f"{where(part)} called with scheme/lengths/layout/diagram {row[:G.META_HEAD].tolist()} "
                             f"but {where(0)} with {first[:G.META_HEAD].tolist()} (scheme code, q_len, x_len, "
                             f"token layout ({', '.join(f'{i + 1} {k}' for i, k in enumerate(KINDS))}), a hash "
                             "of the diagram's text)")
        for k, name in enumerate(names):
            if G.decode(row, k) != G.decode(first, k):
                raise ValueError(f"{name} differs across devices: {where(part)} has {G.decode(row, k)}, "
                                 f"{where(0)} has {G.decode(first, k)}")
            if G.fingerprint_at(row, k) != G.fingerprint_at(first, k):
                raise ValueError(f"side input {name} holds other values on {where(part)} than on {where(0)} "
                                 f"(a crc32 of its bytes differs): side inputs are passed whole, the same on "
                                 f"every device")
    decls = {t.name: t for t in r.written.inputs}   # a row input is the written diagram's alone
    for k, name in enumerate(names):
        nd = len(G.shape_at(first, k))
        if nd != len(decls[name].axes):
            raise ValueError(f"{name} has {nd} dimensions on each device, but the diagram declares "
                             f"{len(decls[name].axes)}")
    trains = r.epilogue.only if r.epilogue is not None else ()   # F's alone: autograd of F gives theirs
    grads = [n for n, t in zip(r.side, (side[n] for n in r.side))
             if t.requires_grad and torch.is_grad_enabled() and n not in trains]
    if grads:
        # the wrappers pass side inputs whole and return no gradient for them:
        # refuse rather than leave .grad silently empty (every rank agrees,
        # since requires_grad is part of the handshake)
        raise ValueError(f"side input(s) {', '.join(grads)} require gradients, which the distributed wrappers "
                         f"do not compute (their .grad would stay empty): pass them detached")
    rows = [(k, name, r.token_wire[k], r.token_axis[k]) for k, name in enumerate(r.tokens)]
    rows += [(len(r.tokens) + len(r.side) + k, name, r.query, r.row_axis[k]) for k, name in enumerate(r.rows)]
    for k, name, wire, axis in rows:
        lay = q_lay if wire == r.query else x_lay
        got = G.shape_at(first, k)[axis]
        if got != lay.rows:
            raise ValueError(
                f"{name} holds {got} rows along {wire} on each device, but {lay.length} tokens in the "
                f"{lay.kind} layout over {lay.parts} devices need {lay.rows} (padding included); "
                f"cut full tensors with napkin.distributed shard helpers")
    _check_side_lengths(r, first, len(r.tokens), {r.query: q_lay.length, r.key: x_lay.length})
    return dict(zip(r.side, prints[len(tokens):]))


def _check_side_lengths(r: Roles, first, offset: int, lengths: dict) -> None:
    """Side inputs are passed whole: each dimension along a token wire holds
    that wire's global length, and one read along both token wires (doc[b, q]
    of doc[b, x]) makes the lengths equal, as a single-process call does.
    Checked here, on every rank alike, before any collective: found later,
    the float64 local raised torch's index error (and the float32 kernel
    accepted a longer doc) with a pass in flight, and the next call died on
    the group's timeout."""
    for k, name in enumerate(r.side):
        shape = G.shape_at(first, offset + k)
        for axis, n in zip(r.diagram.tensor(name).axes, shape):
            if len(axis) == 1 and axis[0] in lengths and n != lengths[axis[0]]:
                raise ValueError(f"side input {name} holds {n} entries along {axis[0]}, but {axis[0]}'s global "
                                 f"length is {lengths[axis[0]]}: side inputs are passed whole")
    if lengths[r.query] == lengths[r.key]:
        return
    for let in r.diagram.lets:
        for n in ir.walk(let.expr):
            if isinstance(n, ir.TensorRef) and n.name in r.side and n.wires is not None:
                declared = ir.axis_wires(r.diagram.tensor(n.name).axes)
                if any({a, b} == {r.query, r.key} for a, b in zip(declared, n.wires)):
                    raise ValueError(f"side input {n.name} is read along {r.query} as well as {r.key}, so q_len "
                                     f"({lengths[r.query]}) and x_len ({lengths[r.key]}) must be equal")


def pad_rows(out: torch.Tensor, lse: Optional[torch.Tensor], pos: torch.Tensor, length: int, axis: int):
    """Padding query rows (positions >= length) read O = 0 and lse = -inf,
    like a row that sees no key."""
    if int(pos.max()) < length:
        return out, lse
    shape = [1] * out.dim()
    shape[axis] = pos.numel()
    pad = (pos >= length).to(out.device)
    out = torch.where(pad.view(shape), torch.zeros((), dtype=out.dtype, device=out.device), out)
    if lse is not None:
        lse = torch.where(pad.view(shape[:lse.dim()]), torch.full((), float("-inf"), dtype=lse.dtype,
                                                                  device=lse.device), lse)
    return out, lse


def zero_rows(t: torch.Tensor, pos: torch.Tensor, length: int, axis: int) -> torch.Tensor:
    if int(pos.max()) < length:
        return t
    shape = [1] * t.dim()
    shape[axis] = pos.numel()
    return torch.where((pos >= length).to(t.device).view(shape), torch.zeros((), dtype=t.dtype, device=t.device), t)


def results(r: Roles, out: torch.Tensor, lse: Optional[torch.Tensor], side: Optional[dict] = None,
            real: Optional[torch.Tensor] = None):
    """The outputs in the diagram's order: one tensor, or a tuple.  With an
    epilogue (reading.Epilogue: a sink's A * sigmoid(L - sink)), its output is
    computed here from the merged rows, ``side`` the side inputs and ``real``
    which local rows are real (padding rows get 0)."""
    got = tuple(out if name == r.value else lse for name in r.outputs)
    if r.epilogue is not None:
        by_name = dict(zip(r.outputs, got))
        by_name[r.epilogue.output] = epilogue(r, out, lse, side or {}, real)
        got = tuple(by_name[o.name] for o in r.written.outputs)
    return got[0] if len(got) == 1 else got


def epilogue(r: Roles, out: torch.Tensor, lse: Optional[torch.Tensor], side: dict,
             real: Optional[torch.Tensor]) -> torch.Tensor:
    """F of the merged attention ``out`` and ``lse`` and the side inputs, by
    the eager evaluator (evaluate.py: wires matched by name) in the
    accumulator dtype, then in ``out``'s: differentiable, so autograd takes
    F's gradient to the merge (dO, dlse) and to the side inputs.  Padding
    rows (``real`` false) enter as 0, 0 and leave as 0: an lse of -inf there
    made F's gradient NaN."""
    from .evaluate import Evaluator
    from .local import _bind, _stored_shape, _unflatten, accumulator_dtype

    epi, d = r.epilogue, r.diagram
    pad = real is not None and not bool(real.all())

    def kept(t: torch.Tensor, axis: int) -> torch.Tensor:   # 0 on the padding rows along ``axis``
        shape = [1] * t.dim()
        shape[axis] = real.numel()
        return torch.where(real.to(t.device).view(shape), t, torch.zeros((), dtype=t.dtype, device=t.device))

    reads = {n: side[n] for n in epi.reads}
    if pad:   # lse shares O's query axis; a row input's padding rows hold what the caller left there
        out = kept(out, r.out_axis)
        lse = kept(lse, r.out_axis) if lse is not None else None
        reads.update((n, kept(reads[n], axis)) for n, axis in zip(r.rows, r.row_axis))
    named = [(r.value, out)] + ([(r.lse, lse)] if r.lse is not None else []) + list(reads.items())
    # A and L are the split diagram's boxes; a row input is the written diagram's alone
    decl = {n: d.tensor(n) or r.written.tensor(n) for n, _ in named}
    pairs = [(t, decl[n], {}) for n, t in named]
    sizes = {w.name: w.size for w in d.wires if w.size is not None}
    _bind(pairs, sizes)
    acc = accumulator_dtype(*(t for _, t in named))
    env = {n: _unflatten(t, decl[n], sizes, {}).to(acc) for n, t in named}
    layouts = {n: ir.axis_wires(decl[n].axes) for n, _ in named}
    user = epi.diagram.tensor(epi.output)
    o = Evaluator(env, layouts, acc, out.device).run(epi.expr, ir.axis_wires(user.axes))
    o = o.reshape(_stored_shape(o, user))
    if pad:
        o = kept(o, r.query_axis(epi.output))
    return o.to(out.dtype)


def upstream_rows(call, grads, tokens, out: torch.Tensor, lse: Optional[torch.Tensor]):
    """A scheme's backward's own rows, from the gradients autograd hands it:
    dO, zero on padding rows and in the queries' dtype (it travels so), and
    delta = rowsum(dO * O) - dlse, zero on padding rows whatever dlse holds
    there (an lse of -inf made a cotangent of inf: NaN in real rows' dK), or
    None without an lse."""
    r = call.fn.roles
    dO = grads[0] if grads[0] is not None else torch.zeros_like(out)
    dlse = grads[1] if len(grads) > 1 else None
    dO = zero_rows(dO, call.my_q, call.ql.length, r.out_axis)
    first_q = next(t for k, t in enumerate(tokens) if r.is_query(k))
    dO = dO.to(first_q.dtype)
    if lse is None:
        return dO, None
    return dO, zero_rows(row_delta(r, dO, out, dlse), call.my_q, call.ql.length, r.out_axis)


def row_delta(r: Roles, dO: torch.Tensor, out: torch.Tensor, dlse: Optional[torch.Tensor]) -> torch.Tensor:
    """delta = rowsum(dO * O) - dlse, in O's (accumulator) dtype."""
    prod = dO.to(out.dtype) * out
    dims = tuple(range(out.dim() - r.value_axes, out.dim()))
    delta = prod.sum(dims) if dims else prod
    return delta - dlse.to(delta.dtype) if dlse is not None else delta


def save_and_show(ctx, call, tokens, out: torch.Tensor, lse: Optional[torch.Tensor]):
    """End of a scheme's forward: pad the merged rows back to the token layout,
    save what the backward needs, and return the output in the queries' dtype
    (merging ran in fp32), with lse when the diagram has one."""
    r = call.fn.roles
    out, lse = pad_rows(out, lse, call.my_q, call.ql.length, r.out_axis)
    ctx.call = call
    ctx.save_for_backward(*tokens, out, *([lse] if lse is not None else []))
    first_q = next(t for k, t in enumerate(tokens) if r.is_query(k))
    visible = out.to(first_q.dtype)
    return (visible, lse) if lse is not None else (visible,)


def saved_state(ctx, n_tokens: int):
    """What save_and_show saved: (tokens, out, lse or None)."""
    saved = ctx.saved_tensors
    tokens, out = saved[:n_tokens], saved[n_tokens]
    lse = saved[n_tokens + 1] if len(saved) > n_tokens + 1 else None
    return tokens, out, lse

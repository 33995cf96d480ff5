"""Hypothesis strategies that draw napkin diagrams as IR.

Three families, from most to least constrained:

* ``attention_diagrams()``: valid attention variants (they pass
  ``napkin.check.check``) with the FlashAttention schedule.  Built for
  differential tests: compile a drawn diagram, run it and the reference on
  random inputs and compare.  The drawn expressions are numerically tame when
  the inputs are: Q, K, V and float bias tensors drawn from randn (or
  uniform [-1, 1]), ``slope`` from uniform [0, 1], ``doc`` small non-negative
  document ids in non-decreasing order along the sequence.  Scores stay in a
  few units (scaled by ~1/sqrt(d) or capped), every log has a positive
  argument, every division a denominator >= 1 or a sum of positive terms,
  and where a mask can empty a whole row the normaliser maps that row to 0
  (the -inf convention of softmax, or a denominator bounded away from 0).
* ``matmul_diagrams()``: valid tiled matrix products ``C = sum[k](A * B)``.
* ``any_diagrams()``: syntactically valid but semantically arbitrary
  diagrams (unknown dtypes, dangling names, odd numbers), built from the
  ``expressions`` strategy; the printer and parser must round-trip them all,
  and the checker must answer them with diagnostics, never a crash.

Wire sizes are either symbolic (``Wire.size is None``: the test picks a size
at run time) or fixed and small; a test that runs a drawn diagram must read
``diagram.wire(name).size`` and honour the fixed ones.  When a diagram relabels
``doc[b, q]`` the q and x wires must have equal sizes at run time (the drawn
fixed sizes are then equal already).

Every drawn IR is canonical: it is exactly what ``napkin.parse.parse`` builds
from its printed text (no ``Unary('-', Num)``: the parser folds ``-2`` into a
number), so ``parse(to_text(d)) == d`` is a fair test.
"""
from __future__ import annotations

from hypothesis import strategies as st

from napkin import ir
from napkin.parse import fold_chunks

# The grammar's reserved words (tests/test_grammar.py checks the list against
# the parser's): no drawn name may be one of them.
KEYWORDS = frozenset("diagram wire in out schedule on accumulate allow level capacity group stream "
                     "hold by across and or not inf".split())

BLOCKS = (16, 32, 64)
ATTENTION_DTYPES = ("fp16", "fp32")  # bf16 is wrong under TRITON_INTERPRET (see background)

# --------------------------------------------------------------------------
# Small IR builders: they keep the strategies below readable.
# --------------------------------------------------------------------------


def _t(name: str, wires=None) -> ir.TensorRef:
    return ir.TensorRef(name, wires)


def _n(value) -> ir.Num:
    return ir.Num(value)


def _b(op: str, lhs: ir.Expr, rhs: ir.Expr) -> ir.Binary:
    return ir.Binary(op, lhs, rhs)


def _call(fn: str, *args: ir.Expr) -> ir.Call:
    return ir.Call(fn, tuple(args))


def _axes(*wires: str) -> tuple[ir.Axis, ...]:
    return tuple((w,) for w in wires)


Q_IDX, X_IDX = ir.WireIndex("q"), ir.WireIndex("x")
D_SIZE, X_SIZE, Q_SIZE = ir.WireSize("d"), ir.WireSize("x"), ir.WireSize("q")
NEG_INF = _n(float("-inf"))


# --------------------------------------------------------------------------
# Attention.
# --------------------------------------------------------------------------

# Fixed sizes stay small so a kernel under the Triton interpreter runs fast;
# they include sizes that are not multiples of any block (1, 33, 100).
_SEQ_SIZES = (1, 16, 33, 64, 100)
_HEAD_DIMS = (16, 32, 64)


@st.composite
def _wire_sizes(draw, equal_seq: bool) -> dict[str, int | None]:
    def maybe(sizes):
        return draw(st.one_of(st.none(), st.sampled_from(sizes)))

    sizes = {"b": maybe((1, 2)), "h": maybe((1, 2, 3)), "q": maybe(_SEQ_SIZES),
             "x": maybe(_SEQ_SIZES), "d": maybe(_HEAD_DIMS)}
    if equal_seq:  # doc[b, q] reads a tensor declared along x as if along q
        sizes["x"] = sizes["q"]
    return sizes


def _scaled_scores(draw) -> ir.Expr:
    """sum[d](Q * K) times a 1/sqrt(d)-like scale, possibly soft-capped."""
    qk = ir.Reduce("sum", ("d",), _b("*", _t("Q"), _t("K")))
    scale = draw(st.sampled_from(("pow", "rsqrt", "div_sqrt", "const")))
    if scale == "pow":
        s = _b("*", qk, _b("^", D_SIZE, _n(-0.5)))
    elif scale == "rsqrt":
        s = _b("*", qk, _call("rsqrt", D_SIZE))
    elif scale == "div_sqrt":
        s = _b("/", qk, _call("sqrt", D_SIZE))
    else:  # a constant scale: 1/8 is exact, 0.1 is not
        s = _b("*", qk, _n(draw(st.sampled_from((0.125, 0.1)))))
    if draw(st.booleans()):  # Gemma-2 soft-capping: cap * tanh(s / cap)
        cap = _n(draw(st.sampled_from((5, 20, 30.0, 50))))
        s = _b("*", cap, _call("tanh", _b("/", s, cap)))
    return s


def _bias_terms(draw, bounded_only: bool) -> tuple[list[tuple[str, ir.Expr]], list[ir.Input]]:
    """Score terms, as (+ or -, term), and the inputs they read.

    ALiBi's slope * (x - q) grows with the distance, so it is offered only to
    normalisers that shrug off large scores (softmax subtracts its max,
    sigmoid saturates): ``bounded_only`` leaves it out.
    """
    menu = ["rel_bias", "distance", "tile_bias", "key_blocks"] + ([] if bounded_only else ["alibi"])
    chosen = draw(st.lists(st.sampled_from(menu), unique=True, max_size=2))
    terms, inputs = [], []
    for kind in chosen:
        if kind == "tile_bias":   # one bias per block of queries and keys, read at the wires' blocks
            # (64: a block of 16 to 64 lies inside one of the bias's, which the dQ kernel sums whole)
            steps = (draw(st.sampled_from((2, 3, 16, 40, 64))), draw(st.sampled_from((2, 3, 16, 40, 64))))
            inputs.append(ir.Input("tb", _axes("qb", "xb"), "fp32"))
            terms.append(("+", ir.TensorRef("tb", ("q", "x"), steps=steps)))
        elif kind == "key_blocks":   # one bias per block of keys, every row and head alike
            inputs.append(ir.Input("kb", _axes("kx"), "fp32"))
            terms.append(("+", ir.TensorRef("kb", ("x",), steps=(draw(st.sampled_from((4, 7, 32))),))))
        elif kind == "alibi":
            inputs.append(ir.Input("slope", _axes("h"), "fp32"))
            terms.append(("+", _b("*", _t("slope"), _b("-", X_IDX, Q_IDX))))
        elif kind == "rel_bias":
            layout = draw(st.sampled_from((("h", "q", "x"), ("q", "x"), ("b", "h", "q", "x"))))
            inputs.append(ir.Input("bias", _axes(*layout), "fp32"))
            terms.append(("+", _t("bias")))
        else:  # a gentle distance penalty, at most a few units over 100 keys
            terms.append(("-", _b("*", _n(0.02), _call("abs", _b("-", Q_IDX, X_IDX)))))
    return terms, inputs


def _mask_atom(draw, floors: bool) -> ir.Expr:
    kind = draw(st.sampled_from(("causal", "strict", "window", "key_from", "key_below", "not_diag")
                                + (("chunk", "dilated") if floors else ())))
    if kind == "chunk":  # one chunk (==) or block-causal (<=): bounds on the row's chunk (masks.Bound.step)
        n = _n(draw(st.sampled_from((4, 16, 50))))
        return _b(draw(st.sampled_from(("==", "<="))), _b("//", X_IDX, n), _b("//", Q_IDX, n))
    if kind == "dilated":  # every other (or third) key: no bound, a remainder of a negative numerator too
        return _b("==", _b("%", _b("-", Q_IDX, X_IDX), _n(draw(st.sampled_from((2, 3))))), _n(0))
    if kind == "causal":
        return _b("<=", X_IDX, Q_IDX)
    if kind == "strict":  # query 0 sees nothing: a fully masked row
        return _b("<", X_IDX, Q_IDX)
    if kind == "window":
        width = draw(st.sampled_from((1, 4, 16, 50)))
        return _b("<", _b("-", Q_IDX, X_IDX), _n(width))
    if kind == "key_from":
        return _b(">=", X_IDX, _n(draw(st.sampled_from((0, 3, 40)))))
    if kind == "key_below":
        return _b("<", X_IDX, _b("+", Q_IDX, _n(draw(st.sampled_from((1, 8))))))
    return _b("!=", X_IDX, Q_IDX)


def _mask(draw, floors: bool, depth: int = 0) -> ir.Expr:
    """A boolean over q and x: comparisons joined by and / or / not."""
    shape = draw(st.sampled_from(("atom", "atom", "and", "or", "not")) if depth < 2 else st.just("atom"))
    if shape == "atom":
        return _mask_atom(draw, floors)
    if shape == "not":
        return ir.Unary("not", _mask(draw, floors, depth + 1))
    return _b(shape, _mask(draw, floors, depth + 1), _mask(draw, floors, depth + 1))


# a(s) for the general normaliser sum[x](a1(S) * V) / b(sum[x](a2(S))).
# "zero_at_minus_inf": a(-inf) == 0, so a -inf mask removes a key cleanly.
# "positive": a(s) > 0 for finite s, so a sum of them over an unmasked row is
# positive and may be divided by.
_WEIGHTS = {
    "exp": (lambda s: _call("exp", s), True, True),
    "sigmoid": (lambda s: _call("sigmoid", s), True, True),
    "relu": (lambda s: _call("relu", s), True, False),
    "square": (lambda s: _b("^", s, _n(2)), False, False),
}
# b(z): "needs_positive" when b(0) is 0 (z would be divided by as is).
_DENOMINATORS = {
    "identity": (lambda z: z, True),
    "plus_one": (lambda z: _b("+", z, _n(1)), False),
    "sqrt_plus_one": (lambda z: _call("sqrt", _b("+", z, _n(1))), False),
    "at_least_one": (lambda z: _call("max", z, _n(1)), False),
}


@st.composite
def attention_diagrams(draw, floors: bool = True) -> ir.Diagram:
    """A valid attention diagram: S (scores), a normaliser, O, maybe lse.

    Wires b, h, q, x (keys), d (head dim); inputs Q[b, h, q, d], K and
    V[b, h, x, d] (a quarter of the time V[b, x, d], shared by the heads)
    in one dtype (fp16 or fp32) plus whatever bias or mask
    tensors the scores read (slope[h], bias[..., q, x], a bias per tile read at
    the wires' blocks tb[q // s, x // t] of tb[qb, xb], a bias per block of keys
    kb[x // t] of kb[kx], doc[b, x] : int32), and a quarter of the time a gate
    on the value, vg along x and some of V's other wires (sum[x](P * V * vg)).
    About half the time a length bound joins the mask (``x < n[b]``, ``q - x < w``
    of a scalar w, ``x <= q + n[b] - |q|``, or a prefix-LM's ``x <= q or
    x < n[b]``): the loops read it.
    Boxes: ``S`` always; then one normaliser:

    * softmax: ``P = softmax[x](S)``, ``O = sum[x](P * V)``, optionally
      ``lse = logsumexp[x](S)`` as a second output;
    * sigmoid: ``P = sigmoid(S + c)``, ``O = sum[x](P * V)``;
    * general: ``O = sum[x](a1(S) * V) / b(sum[x](a2(S)))``.

    Schedule: ``schedule on h100``, accumulate fp32, inputs and outputs held
    in hbm; in smem ``group b by 1, h by 1, q by BLOCK_Q``,
    ``stream x by BLOCK_X`` (blocks 16, 32 or 64) holding the intermediates.

    ``floors``: masks may also take chunks (``x // 16 == q // 16``) and
    remainders (``(q - x) % 2 == 0``).
    """
    normaliser = draw(st.sampled_from(("softmax", "sigmoid", "general")))
    doc_mask = draw(st.booleans())
    sizes = draw(_wire_sizes(equal_seq=doc_mask))
    dtype = draw(st.sampled_from(ATTENTION_DTYPES))
    wires = tuple(ir.Wire(name, sizes[name]) for name in ("b", "h", "q", "x", "d"))
    # V shared by the heads now and then (as differential attention's by its maps): every head
    # reads it, and the backward sums the heads' shares of its gradient
    shared_v = draw(st.sampled_from((False, False, False, True)))
    inputs = [ir.Input("Q", _axes("b", "h", "q", "d"), dtype),
              ir.Input("K", _axes("b", "h", "x", "d"), dtype),
              ir.Input("V", _axes("b", "x", "d") if shared_v else _axes("b", "h", "x", "d"), dtype)]

    score = _scaled_scores(draw)
    terms, extra = _bias_terms(draw, bounded_only=normaliser == "general")
    for op, term in terms:
        score = _b(op, score, term)
    inputs += extra

    masks = []
    if draw(st.booleans()):
        masks.append(_mask(draw, floors))
    if doc_mask:  # packed sequences: a query sees only keys of its own document
        inputs.append(ir.Input("doc", _axes("b", "x"), "int32"))
        masks.append(_b("==", _t("doc", ("b", "q")), _t("doc")))
    # a length input the loops' bounds read (codegen/attention.py's lengths): a cache's, a window's
    # or a prefix-LM's, x <= q or x < n[b]: one bound, x <= max(q, n - 1) (masks._union)
    length = draw(st.sampled_from((None, None, None, "n", "w", "end", "prefix")))
    if length in ("n", "end", "prefix"):
        inputs.append(ir.Input("n", _axes("b"), "int32"))
        masks.append(_b("<", X_IDX, _t("n")) if length == "n" else
                     _b("or", _b("<=", X_IDX, Q_IDX), _b("<", X_IDX, _t("n"))) if length == "prefix" else
                     _b("<=", X_IDX, _b("-", _b("+", Q_IDX, _t("n")), Q_SIZE)))
    elif length == "w":
        inputs.append(ir.Input("w", (), "int32"))
        masks.append(_b("<", _b("-", Q_IDX, X_IDX), _t("w")))
    if masks:
        cond = masks[0]
        for m in masks[1:]:
            cond = _b("and", cond, m)
        score = _call("where", cond, score, NEG_INF)

    if any(t.name == "tb" for t in inputs):   # the tile bias's blocks: ceil(|q| / step), from |q| at the call
        wires += (ir.Wire("qb"), ir.Wire("xb"))
    if any(t.name == "kb" for t in inputs):   # the key bias's blocks, as the tile bias's
        wires += (ir.Wire("kx"),)

    # a gate on the value now and then, sum[x](P * V * vg): along the keys and V's wires alone
    value = _t("V")
    if draw(st.sampled_from((False, False, False, True))):
        vg = draw(st.sampled_from((("x",), ("b", "x"), ("x", "b")) + (() if shared_v else (("b", "h", "x"), ("x", "h")))))
        inputs.append(ir.Input("vg", _axes(*vg), draw(st.sampled_from((dtype, "fp32")))))
        value = _b("*", value, _t("vg"))

    qkx = _axes("b", "h", "q", "x")
    out_dtype = draw(st.sampled_from((dtype, None)))
    lets = [ir.Let("S", qkx, None, score)]
    outputs = ["O"]
    if normaliser == "softmax":
        lets.append(ir.Let("P", qkx, None, ir.Normalize("softmax", "x", _t("S"))))
        lets.append(ir.Let("O", _axes("b", "h", "q", "d"), out_dtype,
                           ir.Reduce("sum", ("x",), _b("*", _t("P"), value))))
        if draw(st.booleans()):
            lets.append(ir.Let("lse", _axes("b", "h", "q"), None, ir.Reduce("logsumexp", ("x",), _t("S"))))
            outputs.append("lse")
    elif normaliser == "sigmoid":
        shift = draw(st.sampled_from(("none", "log_n", "const")))
        arg = _t("S")
        if shift == "log_n":  # sigmoid attention's -log(n) bias; |x| >= 1
            arg = _b("-", arg, _call("log", X_SIZE))
        elif shift == "const":
            arg = _b("+", arg, _n(draw(st.sampled_from((-2, -1.5, 1)))))
        lets.append(ir.Let("P", qkx, None, _call("sigmoid", arg)))
        lets.append(ir.Let("O", _axes("b", "h", "q", "d"), out_dtype,
                           ir.Reduce("sum", ("x",), _b("*", _t("P"), value))))
    else:
        usable = [k for k, (_, zero_at_inf, _) in _WEIGHTS.items() if zero_at_inf or not masks]
        a1 = draw(st.sampled_from(usable))
        a2 = draw(st.sampled_from(usable))
        # b(z) = z divides by the sum itself: only safe when that sum is a
        # sum of positive terms over a row no mask can empty.
        denominators = [k for k, (_, needs_positive) in _DENOMINATORS.items()
                        if not needs_positive or (_WEIGHTS[a2][2] and not masks)]
        b = _DENOMINATORS[draw(st.sampled_from(denominators))][0]
        num = ir.Reduce("sum", ("x",), _b("*", _WEIGHTS[a1][0](_t("S")), value))
        den = b(ir.Reduce("sum", ("x",), _WEIGHTS[a2][0](_t("S"))))
        lets.append(ir.Let("O", _axes("b", "h", "q", "d"), out_dtype, _b("/", num, den)))

    block_q, block_x = draw(st.sampled_from(BLOCKS)), draw(st.sampled_from(BLOCKS))
    hbm = tuple(t.name for t in inputs) + tuple(outputs)
    held = tuple(let.name for let in lets if let.name not in outputs)
    schedule = ir.Schedule("h100", "fp32", False, (
        ir.Level("hbm", None, (), hbm),
        ir.Level("smem", None, (ir.Tile("b", "group", 1), ir.Tile("h", "group", 1),
                                ir.Tile("q", "group", block_q), ir.Tile("x", "stream", block_x)), held),
    ))
    name = draw(st.sampled_from(("attention", "attn", "variant")))
    return ir.Diagram(name, wires, tuple(inputs), tuple(lets),
                      tuple(ir.Output(o) for o in outputs), schedule)


# --------------------------------------------------------------------------
# Matrix products.
# --------------------------------------------------------------------------

@st.composite
def matmul_diagrams(draw) -> ir.Diagram:
    """A valid tiled matmul ``C[m, n] = sum[k](A * B)``.

    A is stored [m, k] or [k, m], B [k, n] or [n, k] (either may be
    transposed); one input dtype (fp16 or fp32); C in that dtype or the
    accumulator's.  Schedule: ``group m by BM, n by BN``, ``stream k by BK``
    (16, 32 or 64 each) in smem, A, B, C held in hbm.  Sizes as for attention.
    """
    sizes = {w: draw(st.one_of(st.none(), st.sampled_from((1, 16, 40, 64, 100)))) for w in "mnk"}
    dtype = draw(st.sampled_from(ATTENTION_DTYPES))
    a_axes = draw(st.sampled_from((("m", "k"), ("k", "m"))))
    b_axes = draw(st.sampled_from((("k", "n"), ("n", "k"))))
    inputs = (ir.Input("A", _axes(*a_axes), dtype), ir.Input("B", _axes(*b_axes), dtype))
    c = ir.Let("C", _axes("m", "n"), draw(st.sampled_from((dtype, None))),
               ir.Reduce("sum", ("k",), _b("*", _t("A"), _t("B"))))
    bm, bn, bk = (draw(st.sampled_from(BLOCKS)) for _ in range(3))
    schedule = ir.Schedule("h100", "fp32", False, (
        ir.Level("hbm", None, (), ("A", "B", "C")),
        ir.Level("smem", None, (ir.Tile("m", "group", bm), ir.Tile("n", "group", bn),
                                ir.Tile("k", "stream", bk)), ()),
    ))
    return ir.Diagram("matmul", tuple(ir.Wire(w, sizes[w]) for w in "mnk"), inputs, (c,),
                      (ir.Output("C"),), schedule)


# --------------------------------------------------------------------------
# Anything the grammar can say (printer and parser tests only).
# --------------------------------------------------------------------------

# Names come from small pools, not from a regex: drawing them character by
# character made these strategies ten times slower, and what matters here is
# the lexer's edges: names that start with a keyword (inx, bylaw), that are a
# function or reduction's name (exp, sum), underscores, digits, case.
_PLAIN = ("a", "b", "h", "q", "x", "d", "k2", "w_1", "inx", "bylaw", "notice", "orx", "andy",
          "infty", "outer", "wired", "levels", "diagrams", "ona")
_CAPITAL = ("Q", "K", "V", "S", "P", "O", "_p", "_", "Doc", "INF", "IN", "Out", "A1_b", "Not")
_WORDS = ("fp16", "bf16", "int32", "h100", "smem", "hbm", "devices", "regs",
          "exp", "sum", "max", "softmax", "where", "sigmoid", "tf32")
assert not KEYWORDS & set(_PLAIN + _CAPITAL + _WORDS)

names = st.sampled_from(_PLAIN + _CAPITAL + _WORDS)
# Bare names in expressions: the parser reads a declared wire's name as its
# index and any other name as a tensor, so the two come from disjoint pools.
wire_names = st.sampled_from(_PLAIN)
tensor_names = st.sampled_from(_CAPITAL + _WORDS)

# Every finite float, +-inf and -0.0 included (the printer must spell them
# all); NaN has no spelling.
numbers = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=False)).map(ir.Num)


def _grow(sub):
    def call(fn):
        return st.tuples(*[sub] * ir.FUNCTIONS[fn]).map(lambda args: ir.Call(fn, args))
    return st.one_of(
        sub.filter(lambda e: not isinstance(e, ir.Num)).map(lambda e: ir.Unary("-", e)),
        sub.map(lambda e: ir.Unary("not", e)),
        st.builds(ir.Binary, st.sampled_from(ir.BINARY_OPS), sub, sub),
        st.sampled_from(sorted(ir.FUNCTIONS)).flatmap(call),
        st.builds(ir.Reduce, st.sampled_from(ir.REDUCTIONS),
                  st.lists(names, min_size=1, max_size=2).map(tuple), sub),
        st.builds(ir.Normalize, st.just("softmax"), names, sub),
    )


# Canonical expression trees: a minus is never applied to a number directly
# (the parser folds -2 into Num(-2)).  Their WireIndex names are declared as
# wires by any_diagrams(), which is what makes them wire indices.
expressions = st.recursive(st.one_of(
    numbers,
    wire_names.map(ir.WireIndex),
    names.map(ir.WireSize),
    tensor_names.map(ir.TensorRef),
    st.builds(ir.TensorRef, names, st.lists(names, min_size=1, max_size=3).map(tuple)),
), _grow, max_leaves=12)

_layouts = st.lists(st.lists(names, min_size=1, max_size=3).map(tuple), min_size=1, max_size=4).map(tuple)
_tiles = st.builds(ir.Tile, names, st.sampled_from(("group", "stream")), st.integers(0, 4096), st.booleans())
_capacities = st.one_of(st.none(), st.integers(1, 1 << 40),
                        st.integers(1, 4096).map(lambda n: n << 10),  # exact KiB, MiB, ...
                        st.integers(1, 64).map(lambda n: n << 30))
# the parser's canonical form: a group beside a stream of one wire is one chunked stream tile
_levels = st.builds(ir.Level, names, _capacities, st.lists(_tiles, max_size=4).map(fold_chunks),
                    st.lists(names, max_size=3).map(tuple))
_schedules = st.builds(ir.Schedule, st.one_of(st.none(), names), names, st.booleans(),
                       st.lists(_levels, max_size=3).map(tuple))
_sizes = st.one_of(st.none(), st.integers(0, 10**6))


@st.composite
def any_diagrams(draw) -> ir.Diagram:
    """A diagram the grammar can express, whatever the checker thinks of it."""
    lets = draw(st.lists(st.builds(ir.Let, names, _layouts, st.one_of(st.none(), names), expressions),
                         max_size=4))
    # Declared wires: some drawn ones, then every wire an expression indexes
    # (or it would read back as a tensor), in order of first use.
    declared = draw(st.lists(wire_names, unique=True, max_size=3))
    used = [e.wire for let in lets for e in ir.walk(let.expr) if isinstance(e, ir.WireIndex)]
    wires = tuple(ir.Wire(w, draw(_sizes)) for w in dict.fromkeys(declared + used))
    inputs = draw(st.lists(st.builds(ir.Input, names, _layouts, names), max_size=3))
    outputs = draw(st.lists(names.map(ir.Output), max_size=3))
    schedule = draw(st.one_of(st.none(), _schedules))
    return ir.Diagram(draw(names), wires, tuple(inputs), tuple(lets), tuple(outputs), schedule)


def drawn_sizes(diagram: ir.Diagram, seed: int) -> dict[str, int]:
    """Run-time sizes for a drawn diagram's wires: the fixed ones as drawn,
    the symbolic ones picked by a seeded generator among ragged values (q and
    x equal when the diagram reads ``doc`` along both)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pick = {"b": (1, 2), "h": (1, 2), "q": (1, 33, 50), "x": (1, 33, 50), "d": (16, 32),
            "m": (1, 40, 70), "n": (1, 40, 70), "k": (1, 40, 70)}
    sizes = {}
    blocks = {declared for _, declared, _, _, _ in ir.coarse_reads(diagram)}
    for w in diagram.wires:
        if w.name in blocks and w.size is None:
            continue   # a coarse read's blocks: from the wire read, below
        choices = pick.get(w.name, (8,))
        sizes[w.name] = w.size if w.size is not None else choices[int(torch.randint(len(choices), (1,),
                                                                                      generator=gen))]
    if any(t.name == "doc" for t in diagram.inputs):
        sizes["x"] = sizes["q"]
    return ir.coarse_sizes(diagram, sizes)

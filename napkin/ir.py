"""The napkin IR: one readable block of immutable node definitions.

A diagram is a set of wires (named axes), input tensors laid out along those
wires, boxes (``Let`` statements) that compute new tensors from expressions,
the outputs, and a schedule saying where each part lives and how wires are
tiled at each memory level.

Every node is a frozen dataclass carrying its source location.  Locations
take no part in equality (``compare=False``), so ``parse(print(ir)) == ir``
holds even though printing moves things around.  A layout axis is a plain
tuple of wire names, so tensors keep where each of their layout's wires is
written beside it (``wire_locs``), for messages about one wire.

Passes never mutate these nodes; analyses return reports and rewrites return
new nodes (``dataclasses.replace``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence, Union


@dataclass(frozen=True)
class Loc:
    """A span in the source text: 1-based line and column of its start."""

    line: int = 0
    col: int = 0
    end_line: int = 0
    end_col: int = 0


NOLOC = Loc()


def _loc() -> Loc:
    return field(default=NOLOC, compare=False, repr=False)


def _locs() -> tuple:
    return field(default=(), compare=False, repr=False)


# --------------------------------------------------------------------------
# Element types.  bytes per element.  fp8 and int8 are a matrix product's
# factors' (quantised values, multiplied at the tensor cores' 8-bit rates):
# int8 holds numbers to multiply, not indices, so it is in neither integer
# tuple below (the reference computes with it in float, as with fp8).
# --------------------------------------------------------------------------

DTYPE_BYTES = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,
    "fp16": 2,
    "bf16": 2,
    "e4m3": 1,
    "e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "bool": 1,
}
FLOAT_DTYPES = ("fp64", "fp32", "fp16", "bf16", "e4m3", "e5m2")
# The 8-bit dtypes only a matrix product's factor may take (codegen/operands.py).
FACTOR_DTYPES = ("e4m3", "e5m2", "int8")
INT_DTYPES = ("int64", "int32", "bool")
# The integer dtypes that hold numbers (indices, document ids, lengths): bool holds truth values.
NUMBER_INT_DTYPES = ("int64", "int32")
# The torch dtype (its attribute name) of each dtype a tensor can be made in (not tf32).
TORCH_NAMES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
               "int64": "int64", "int32": "int32", "bool": "bool",
               "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "int8": "int8"}


# --------------------------------------------------------------------------
# Expressions (the elementwise language inside boxes).
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Num:
    """A numeric constant; ``inf`` is ``Num(float('inf'))``."""

    value: Union[int, float]
    loc: Loc = _loc()


@dataclass(frozen=True)
class WireIndex:
    """The index along a wire, e.g. ``q`` and ``x`` in a causal mask ``x <= q``."""

    wire: str
    loc: Loc = _loc()


@dataclass(frozen=True)
class WireSize:
    """The size of a wire, written ``|d|`` (so a scale reads ``|d|^-0.5``)."""

    wire: str
    loc: Loc = _loc()


@dataclass(frozen=True)
class TensorRef:
    """A tensor used in an expression.

    ``wires`` is None when the tensor is used along its own declared wires
    (``Q``), or a relabelling, one wire per declared wire in order
    (``doc[b, q]`` reads a tensor declared ``doc[b, x]`` along ``q``).
    ``steps``: None, or one whole number per wire, the read's index at each
    declared wire being that wire's index floor-divided by it: a coarse read
    (``keep[b, h, q // 64, x // 64]`` of ``keep[b, h, qb, xb]``, each element
    serving a 64 x 64 block of (q, x) pairs); 1 where a wire is read whole.
    The read varies along ``wires`` all the same.
    """

    name: str
    wires: Optional[tuple[str, ...]] = None
    loc: Loc = _loc()
    steps: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class Unary:
    """``-e`` or ``not e``."""

    op: str
    operand: "Expr"
    loc: Loc = _loc()


@dataclass(frozen=True)
class Binary:
    """Arithmetic ``+ - * / ^``, comparisons ``< <= > >= == !=``, ``and``, ``or``."""

    op: str
    lhs: "Expr"
    rhs: "Expr"
    loc: Loc = _loc()


@dataclass(frozen=True)
class Call:
    """An elementwise function: exp, exp2, log, log2, sqrt, tanh, sigmoid,
    abs, relu, max, min, where."""

    fn: str
    args: tuple["Expr", ...]
    loc: Loc = _loc()


@dataclass(frozen=True)
class Reduce:
    """A reduction that removes ``wires``: ``sum[d](Q * K)`` is a contraction,
    ``max[x](S)``, ``logsumexp[x](S)``.  op is sum, max, min or logsumexp."""

    op: str
    wires: tuple[str, ...]
    body: "Expr"
    loc: Loc = _loc()


@dataclass(frozen=True)
class Normalize:
    """A normaliser that keeps its wire: ``softmax[x](S)``."""

    op: str
    wire: str
    body: "Expr"
    loc: Loc = _loc()


Expr = Union[Num, WireIndex, WireSize, TensorRef, Unary, Binary, Call, Reduce, Normalize]

UNARY_OPS = ("-", "not")
ARITH_OPS = ("+", "-", "*", "/", "//", "%", "^")
COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")
LOGIC_OPS = ("and", "or")
BINARY_OPS = ARITH_OPS + COMPARE_OPS + LOGIC_OPS
# function name -> number of arguments
FUNCTIONS = {
    "exp": 1, "exp2": 1, "log": 1, "log2": 1, "sqrt": 1, "rsqrt": 1,
    "tanh": 1, "sigmoid": 1, "abs": 1, "relu": 1,
    "max": 2, "min": 2, "where": 3,
}
REDUCTIONS = ("sum", "max", "min", "logsumexp")
NORMALIZERS = ("softmax",)


# --------------------------------------------------------------------------
# Declarations and boxes.
# --------------------------------------------------------------------------

# One dimension of a stored tensor: one wire, or several wires flattened
# row-major, written ``(hk g)``.  Grouped-query attention stores query heads
# as ``(hk g)``: kv head ``hk`` serves the ``g`` query heads of its group.
Axis = tuple[str, ...]


@dataclass(frozen=True)
class Wire:
    """A named axis.  size None means symbolic: bound from shapes at call time."""

    name: str
    size: Optional[int] = None
    loc: Loc = _loc()


@dataclass(frozen=True)
class Input:
    """An input tensor: ``in Q[b, h, q, d] : fp16``; with no axes a scalar, ``in t : fp32``.

    ``wire_locs``: where each wire of the layout is written, one per wire of
    ``axis_wires(axes)`` (a grouped axis ``(hk g)`` gives one per wire, so a
    message about ``g`` points at ``g``); () for a node built in code.  Read
    it through ``layout_locs``.
    """

    name: str
    axes: tuple[Axis, ...]
    dtype: str
    loc: Loc = _loc()
    wire_locs: tuple[Loc, ...] = _locs()
    dtype_loc: Loc = _loc()     # where the dtype is written (a message about it points there)


@dataclass(frozen=True)
class Let:
    """A box: ``S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5``.

    ``axes`` is the declared layout of the result; the checker proves its
    wires equal the wires the expression produces.  dtype None means the
    accumulator type (fp32 by default), for outputs too: an undeclared lse is
    fp32.  ``wire_locs`` as for ``Input``.
    """

    name: str
    axes: tuple[Axis, ...]
    dtype: Optional[str]
    expr: Expr
    loc: Loc = _loc()
    wire_locs: tuple[Loc, ...] = _locs()
    dtype_loc: Loc = _loc()


@dataclass(frozen=True)
class Output:
    """``out O``: a tensor the launcher returns, in declaration order."""

    name: str
    loc: Loc = _loc()


# --------------------------------------------------------------------------
# The schedule: memory levels, tiling of wires, placement, accumulator.
# --------------------------------------------------------------------------

LEVELS = ("devices", "hbm", "smem", "regs")  # outermost first
# A two-level device mesh adds ``nodes`` above ``devices``: wires split across
# nodes first (InfiniBand between them), then across the GPUs of a node
# (NVLink).  Kept out of LEVELS so passes that walk the memory levels need not
# know it; the checker and napkin/tiling.py read ALL_LEVELS.
MESH_LEVELS = ("nodes", "devices")
ALL_LEVELS = ("nodes",) + LEVELS
PROFILES = ("h100", "h200", "a100", "cpu")


@dataclass(frozen=True)
class Tile:
    """A wire relabelled at one level.

    kind is "group" (split across processors: grid programs or devices) or
    "stream" (fed through a loop in chunks).  With ``by`` the number is the
    block size (``group q by 128``: 128 queries per program); with ``across``
    it is the number of parts (``group q across 2``: two rows of devices).

    ``chunk``: a streamed wire also grouped at the same level (``group x by
    4096`` beside ``stream x by 64``: flash-decoding's split of the keys).
    Each program streams only its chunk of the wire and the programs' partial
    states are merged.  The parser folds the pair into this one stream tile,
    so every pass that reads the schedule still sees one tile per wire;
    ``chunk_loc`` is where the group was written.

    ``layout``: how an ``across`` tile deals the wire's tokens to the parts
    (``stream x across 8 contiguous``): one of LAYOUTS, or None for the
    scheme's default (napkin/distributed/layouts.py).
    """

    wire: str
    kind: str
    size: int
    across: bool = False
    loc: Loc = _loc()
    chunk: Optional[int] = None
    chunk_loc: Loc = _loc()
    layout: Optional[str] = None
    layout_loc: Loc = _loc()


# Token layouts an ``across`` tile may name: napkin/distributed/layouts.py's kinds (its KINDS
# is this tuple; the handshake codes a layout by its index here).
LAYOUTS = ("cyclic", "zigzag", "contiguous")


@dataclass(frozen=True)
class Level:
    """One memory level: its tiles, the tensors it holds, its capacity in bytes
    (None: taken from the device profile)."""

    name: str
    capacity: Optional[int] = None
    tiles: tuple[Tile, ...] = ()
    holds: tuple[str, ...] = ()
    loc: Loc = _loc()
    hold_locs: tuple[Loc, ...] = _locs()   # one per hold, where its name is written


@dataclass(frozen=True)
class Schedule:
    """``schedule on h100 { ... }``.  accumulate is the accumulator dtype;
    tf32 lets fp32 contractions use tf32 tensor cores."""

    profile: Optional[str] = None
    accumulate: str = "fp32"
    tf32: bool = False
    levels: tuple[Level, ...] = ()
    loc: Loc = _loc()
    profile_loc: Loc = _loc()
    accumulate_loc: Loc = _loc()


@dataclass(frozen=True)
class Diagram:
    name: str
    wires: tuple[Wire, ...]
    inputs: tuple[Input, ...]
    lets: tuple[Let, ...]
    outputs: tuple[Output, ...]
    schedule: Optional[Schedule] = None
    loc: Loc = _loc()

    # -- lookups (pure helpers, no caching so the node stays a plain value) --
    def wire(self, name: str) -> Optional[Wire]:
        return next((w for w in self.wires if w.name == name), None)

    def tensor(self, name: str) -> Optional[Union[Input, Let]]:
        for t in self.inputs + self.lets:
            if t.name == name:
                return t
        return None

    def level(self, name: str) -> Optional[Level]:
        if self.schedule is None:
            return None
        return next((lv for lv in self.schedule.levels if lv.name == name), None)


def fold_constant(e: "Expr", fixed: Mapping[str, int], calls: Mapping[str, Callable] = {}):
    """The value of numbers and fixed sizes under - and + - * / ^ (and the
    functions ``calls`` names), else None: also where it has no value of its
    own (1 / 0, 0 ^ -1, a complex power, an overflow), which the checker
    reports and the folding passes leave to the kernel."""
    if isinstance(e, Num):
        return e.value
    if isinstance(e, WireSize):
        return fixed.get(e.wire)
    if isinstance(e, Unary) and e.op == "-":
        v = fold_constant(e.operand, fixed, calls)
        return None if v is None else -v
    if isinstance(e, Binary) and e.op in ARITH_OPS:
        a, b = fold_constant(e.lhs, fixed, calls), fold_constant(e.rhs, fixed, calls)
        if a is None or b is None:
            return None
        try:
            v = arith(e.op, a, b)
        except (ZeroDivisionError, OverflowError):
            return None
        return None if isinstance(v, complex) else v
    if isinstance(e, Call) and e.fn in calls:
        args = [fold_constant(a, fixed, calls) for a in e.args]
        if any(a is None for a in args):
            return None
        try:
            return calls[e.fn](*args)
        except (ValueError, OverflowError, ZeroDivisionError):
            return None
    return None


def arith(op: str, a, b):
    """``a op b`` of two constants for an operator of ARITH_OPS, as every
    folding pass computes it (``^`` through ``power``).  Raises as Python
    does (1 / 0, 1 // 0)."""
    if op == "^":
        return power(a, b)
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
            "//": lambda: a // b, "%": lambda: a % b}[op]()


def power(a, b):
    """``a ^ b`` of two constants, as every folding pass computes it: exact
    for integers while the result fits in 63 bits, a float beyond (inf past
    the floats), so that 10 ^ 10 ^ 10 costs no ten-billion-digit integer.
    Raises as ``**`` does (0 ^ -1)."""
    if type(a) is int and type(b) is int and b > 0 and abs(a) > 1 and b * (abs(a).bit_length() - 1) > 62:
        try:
            return float(a) ** b
        except OverflowError:
            return -math.inf if a < 0 and b % 2 else math.inf
    return a ** b


def axis_wires(axes: tuple[Axis, ...]) -> tuple[str, ...]:
    """The wires of a layout, flattened: ``(b, (hk g), q)`` -> ``(b, hk, g, q)``."""
    return tuple(w for axis in axes for w in axis)


def layout_locs(tensor: Union[Input, Let]) -> tuple[Loc, ...]:
    """Where each wire of a tensor's layout is written, parallel to
    ``axis_wires(tensor.axes)``.  A node built in code (or rebuilt with other
    axes) has no such record: every wire is then at the tensor's own loc."""
    wires = axis_wires(tensor.axes)
    if len(tensor.wire_locs) == len(wires):
        return tensor.wire_locs
    return (tensor.loc,) * len(wires)


def relabels(d: "Diagram") -> tuple[tuple[str, str, str, Loc], ...]:
    """Each (input, declared wire, wire read along, where) an input is read
    along another wire than its own (``A[n, k]`` of ``A[m, k]``: A, m, n):
    the two wires must have one size.  First occurrence of each, in the
    inputs' order, then the boxes'."""
    out: dict[tuple[str, str, str], Loc] = {}
    for tensor, dw, rw, step, loc in _named_reads(d):
        if dw != rw and step == 1:   # a coarse read's wires differ in size (coarse_reads)
            out.setdefault((tensor, dw, rw), loc)
    return tuple((*key, loc) for key, loc in out.items())


def _named_reads(d: "Diagram"):
    """(input, declared wire, wire read along, step, where) for each wire of each
    read that names its wires, in the inputs' order, then the boxes'."""
    for t in d.inputs:
        declared = axis_wires(t.axes)
        for let in d.lets:
            for n in walk(let.expr):
                if isinstance(n, TensorRef) and n.name == t.name and n.wires is not None:
                    for dw, rw, step in zip(declared, n.wires, read_steps(n)):
                        yield t.name, dw, rw, step, n.loc


def read_steps(ref: TensorRef) -> tuple[int, ...]:
    """The step of each wire ``ref`` reads (1: the wire itself; TensorRef.steps)."""
    return ref.steps if ref.steps is not None else (1,) * len(ref.wires or ())


def read_along(ref: TensorRef, own: Sequence[str]) -> tuple[tuple[str, ...], Optional[tuple[int, ...]]]:
    """The wires ``ref`` reads its tensor (declared along ``own``) along, one
    per declared wire, and their steps: None where each is read whole (its
    own wires, or a relabelling)."""
    steps = read_steps(ref)
    return tuple(ref.wires or own), (steps if any(st != 1 for st in steps) else None)


def coarse_reads(d: "Diagram") -> tuple[tuple[str, str, str, int, Loc], ...]:
    """Each (input, declared wire, wire read along, step, where) an input is
    read at blocks of a wire (``keep[b, h, q // 64, x // 64]`` of
    ``keep[b, h, qb, xb]``: keep, qb, q, 64): the declared wire's size must
    be ceil(|read| / step).  First occurrence of each, as ``relabels``."""
    out: dict[tuple[str, str, str, int], Loc] = {}
    for tensor, dw, rw, step, loc in _named_reads(d):
        if step != 1:
            out.setdefault((tensor, dw, rw, step), loc)
    return tuple((*key, loc) for key, loc in out.items())


def coarse_sizes(d: "Diagram", sizes: Mapping[str, int], given=None) -> dict[str, int]:
    """``sizes`` with each symbolic wire a coarse read's blocks lie along (qb of
    keep[.., q // 64, ..]) set to ceil(|q| / 64), |q| from ``sizes`` or the
    diagram, unless ``given`` names it (default: every wire ``sizes`` holds).
    The one rule napkin demo's, the bench's, the aot report's and the cost
    pass's sizes follow; the launcher's _bind checks it."""
    given = sizes if given is None else given
    out = dict(sizes)
    for _, declared, read, step, _ in coarse_reads(d):
        n = out.get(read, d.wire(read).size)
        if declared not in given and d.wire(declared).size is None and n is not None:
            out[declared] = -(-n // step)
    return out


def tie_relabels(d: "Diagram", sizes: dict) -> Optional[tuple[str, str, str, Loc]]:
    """Give each wire a relabel ties to a sized one its size, in place, to a
    fixed point (chains of relabels); the first relabel whose two wires
    already hold different sizes, else None."""
    ties = relabels(d)
    changed = True
    while changed:
        changed = False
        for tensor, declared, read, loc in ties:
            if declared in sizes and read in sizes and sizes[declared] != sizes[read]:
                return tensor, declared, read, loc
            for a, b in ((declared, read), (read, declared)):
                if a in sizes and b not in sizes:
                    sizes[b], changed = sizes[a], True
        blocks = coarse_sizes(d, sizes)   # the blocks of a sized wire: ceil(|read| / step)
        if blocks.keys() != sizes.keys():
            sizes.update(blocks)
            changed = True
    return None


def coarse_clash(d: "Diagram", sizes: Mapping[str, int]) -> Optional[tuple[str, Loc]]:
    """(message, where) for the first coarse read whose declared wire is not
    ceil(|read| / step) at these sizes, else None."""
    for tensor, declared, read, step, loc in coarse_reads(d):
        if declared in sizes and read in sizes and sizes[declared] != -(-sizes[read] // step):
            return (f"{tensor} is read at {read} // {step}, so wire {declared} must have size ceil(|{read}| / "
                    f"{step}) = {-(-sizes[read] // step)} (|{read}| = {sizes[read]}), not {sizes[declared]}", loc)
    return None


def length_inputs(d: "Diagram") -> tuple[tuple[str, str], ...]:
    """Each (integer input, wire) where the input is a length of the wire:
    compared with an expression of the wire's index on the other side while
    not read along that wire (``x < n[b]``, ``x <= q + n[b] - |q|``: n is a
    length of x per b; ``doc[b, q] == doc`` compares ids, not a length).
    Its values are the wire's positions, 0..|w|, where document ids are
    small numbers: example_inputs draws each kind its own way.  First wire
    found for each input, in the boxes' order."""
    ints = {t.name: axis_wires(t.axes) for t in d.inputs if t.dtype in NUMBER_INT_DTYPES}
    out: dict[str, str] = {}

    def reads(e: Expr) -> list[tuple[str, tuple[str, ...]]]:
        # a read at blocks of a wire (n[b, q // 64]) holds no length of one token's: left out
        return [(n.name, n.wires or ints[n.name]) for n in walk(e)
                if isinstance(n, TensorRef) and n.name in ints and n.steps is None]

    for let in d.lets:
        for n in walk(let.expr):
            if isinstance(n, Binary) and n.op in COMPARE_OPS:
                for side, other in ((n.lhs, n.rhs), (n.rhs, n.lhs)):
                    indices = [i.wire for i in walk(other) if isinstance(i, WireIndex)]
                    for name, along in reads(side):
                        w = next((w for w in indices if w not in along), None)
                        if w is not None:
                            out.setdefault(name, w)
    return tuple(out.items())


def children(expr: Expr) -> tuple:
    """The direct sub-expressions of a node, in source order."""
    if isinstance(expr, Unary):
        return (expr.operand,)
    if isinstance(expr, Binary):
        return (expr.lhs, expr.rhs)
    if isinstance(expr, Call):
        return expr.args
    if isinstance(expr, (Reduce, Normalize)):
        return (expr.body,)
    return ()


def map_children(e: Expr, f: Callable[[Expr], Expr]) -> Expr:
    """``e`` with ``f`` applied to each direct child (location kept): the one
    step of every rewrite of an expression tree."""
    if isinstance(e, Unary):
        return replace(e, operand=f(e.operand))
    if isinstance(e, Binary):
        return replace(e, lhs=f(e.lhs), rhs=f(e.rhs))
    if isinstance(e, Call):
        return replace(e, args=tuple(f(a) for a in e.args))
    if isinstance(e, (Reduce, Normalize)):
        return replace(e, body=f(e.body))
    return e


def plain_reads(d: "Diagram") -> "Diagram":
    """``d`` with each tensor read along its own declared wires written out
    (``K[b, h, x, d]`` of ``K[b, h, x, d]``) read plainly (``K``): the same
    read, which the passes that take a written relabel for a read along other
    wires (the backward's rules) then see as what it is.  ``d`` itself when
    it has none."""
    declared = {t.name: axis_wires(t.axes) for t in d.inputs + d.lets}

    def plain(e: Expr) -> Expr:
        if isinstance(e, TensorRef):
            return replace(e, wires=None) if e.wires is not None and e.wires == declared.get(e.name) else e
        return map_children(e, plain)

    lets = tuple(replace(let, expr=plain(let.expr)) for let in d.lets)
    return d if lets == d.lets else replace(d, lets=lets)


def terms(e: Expr) -> list:
    """The terms of a chain of + (one term where ``e`` is no sum)."""
    if isinstance(e, Binary) and e.op == "+":
        return terms(e.lhs) + terms(e.rhs)
    return [e]


def product_factors(d: "Diagram") -> frozenset:
    """The names of tensors read as a factor of some sum of products (sum[d](Q * K),
    sum[x](P * V)): the kernels' tiled operands."""
    return frozenset(f.name for let in d.lets for n in walk(let.expr)
                     if isinstance(n, Reduce) and n.op == "sum" for f in factors(n.body) if isinstance(f, TensorRef))


def factors(e: Expr) -> list:
    """The factors of a chain of * (one factor where ``e`` is no product)."""
    if isinstance(e, Binary) and e.op == "*":
        return factors(e.lhs) + factors(e.rhs)
    return [e]


def sum_of(expr: Expr, parts) -> Optional[Expr]:
    """The node of ``expr`` that adds up exactly ``parts`` (each once, any order), or None:
    a score of several contractions (MLA's sum[c](Qc * Kc) + sum[r](Qr * Kr)) as one."""
    parts = list(parts)
    return next((n for n in walk(expr) if isinstance(n, Binary) and n.op == "+"
                 and len(terms(n)) == len(parts) and all(p in terms(n) for p in parts)), None)


def walk(expr: Expr):
    """Yield every node of an expression tree, parents before children."""
    yield expr
    for child in children(expr):
        yield from walk(child)


def show(e: Expr) -> str:
    """A compact rendering of an expression, for messages."""
    def sub(x):
        negative = isinstance(x, Num) and math.copysign(1, x.value) < 0     # (-8) ^ 0.5, not -8 ^ 0.5
        return f"({show(x)})" if isinstance(x, (Binary, Unary)) or negative else show(x)
    if isinstance(e, Num):
        return {float("inf"): "inf", float("-inf"): "-inf"}.get(e.value, repr(e.value))
    if isinstance(e, WireIndex):
        return e.wire
    if isinstance(e, WireSize):
        return f"|{e.wire}|"
    if isinstance(e, TensorRef):
        if e.wires is None:
            return e.name
        return f"{e.name}[{', '.join(w if k == 1 else f'{w} // {k}' for w, k in zip(e.wires, read_steps(e)))}]"
    if isinstance(e, Unary):
        return f"{e.op}{' ' if e.op == 'not' else ''}{sub(e.operand)}"
    if isinstance(e, Binary):
        return f"{sub(e.lhs)} {e.op} {sub(e.rhs)}"
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(show(a) for a in e.args)})"
    wires = e.wires if isinstance(e, Reduce) else (e.wire,)
    return f"{e.op}[{', '.join(wires)}]({show(e.body)})"

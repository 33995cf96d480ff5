"""Pass 2: semantic checks.  ``check(diagram) -> list[Diagnostic]``.

The checker reads a parsed Diagram and reports every problem it finds, not
just the first, each at the source location of the offending node, sorted by
position.  It never changes the IR.  The passes, in order:

1. names: hostile names (they flow into generated Python), duplicates, one
   wire given two sizes;
2. layouts and dtypes of inputs and boxes;
3. boxes: every expression is walked once, inferring its wires and whether it
   is a number or a boolean, resolving names, relabels and reductions; the
   wires a box's expression produces must equal its declared layout;
4. outputs and the schedule (profile, levels, tiles, holds);
5. streamability of every streamed wire (napkin.streamability);
6. capacity: the tiles resident at a level must fit it (napkin.tiling).

Passes 5 and 6 need resolved names, so they skip what earlier passes found
broken instead of piling follow-on errors on top.
"""
from __future__ import annotations

import builtins
import difflib
import keyword
import math
import re
import sys
from typing import Optional

from . import ir, tiling
from .errors import Diagnostic
from .ir import show as _show
from .streamability import Streamability

# Names the generated module defines or imports itself; a diagram name must not
# shadow them.  (Names starting with "_" are banned outright.)
RESERVED = frozenset({
    "torch", "triton", "tl", "contextlib", "contextvars", "functools", "math", "os", "sys", "weakref", "reference",
    "example_inputs", "INPUTS", "OUTPUTS", "WIRES", "NAPKIN_VERSION", "SOURCE_HASH", "BACKWARD_OVERLAP",
})
ACCUMULATE_DTYPES = ("fp32", "fp16", "bf16", "fp64")
MIN_DOT_BLOCK = tiling.MIN_DOT_BLOCK  # tl.dot needs every matrix dimension >= 16
# The most devices a schedule may split over: the cost pass walks every device once
# (to sort the devices into classes that send alike, collectives._link_classes), and
# 10^20 of them ran until memory ran out.  napkin cost of a 1024 x 1024 ATTENTION2D grid
# (2^20) takes 1.5-1.8 s and 240 MB on one core of a 2-core machine, a tree of 2^20 - 1
# devices 4.5-5.4 s (2026-12-01).
MAX_DEVICES = 2 ** 20
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_BUILTINS = frozenset(dir(builtins))
# Modules a compiled diagram's file would shadow wherever its folder comes first on sys.path:
# a diagram named json wrote json.py, and then "import torch" failed half-initialised
_MODULES = frozenset(sys.stdlib_module_names) | {"torch", "triton", "numpy", "jinja2", "lark", "napkin"}
_NUM, _BOOL = "number", "boolean"
# The kind of a value whose own kind check failed, or of an input of an unknown dtype or an
# unknown name: later checks take it silently (a dtype typo or one wrong operand under '-' gave a
# second error, at the reader, saying the opposite of the first)
_ANY = "unknown"


def check(diagram: ir.Diagram, capacity: bool = True) -> list[Diagnostic]:
    """Every problem in ``diagram``, sorted by (line, col); empty when it is
    sound.  ``capacity=False`` leaves out whether each level's tiles fit its
    capacity: for the tile search (napkin cost --tune), which is how a
    schedule that overflows finds blocks that fit."""
    checker = _Checker(diagram)
    checker.run(capacity)
    unique = list(dict.fromkeys(checker.errors))  # same message at the same spot once
    return sorted(unique, key=lambda d: (d.loc.line, d.loc.col))


def hostile_name(name: str) -> Optional[str]:
    """Why ``name`` cannot be used in generated Python, or None when it can."""
    if name.startswith("_"):
        return f"'{name}' starts with an underscore: such names are reserved for napkin's generated code"
    if not _NAME.fullmatch(name):
        return f"'{name}' is not a plain name: use ASCII letters, digits and '_', starting with a letter"
    if keyword.iskeyword(name):
        return f"'{name}' is a Python keyword"
    if keyword.issoftkeyword(name):
        return f"'{name}' is a Python soft keyword"
    if name in _BUILTINS:
        return f"'{name}' shadows a Python builtin"
    if name in RESERVED:
        return f"'{name}' is reserved: the generated module uses that name itself"
    return None


def _at(loc: ir.Loc, fallback: ir.Loc) -> ir.Loc:
    """``loc`` when the parser recorded it, else ``fallback`` (IR built in code has no locations)."""
    return loc if loc.line > 0 else fallback


def _closest(name: str, *groups) -> Optional[str]:
    """'did you mean X?' for the closest name, trying each group of candidates in turn."""
    for candidates in groups:
        match = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
        if match:
            return f"did you mean '{match[0]}'?"
    return None


def _layout(axes) -> str:
    return "[" + ", ".join(a[0] if len(a) == 1 else "(" + " ".join(a) + ")" for a in axes) + "]"


class _Checker:
    def __init__(self, diagram: ir.Diagram):
        self.d = diagram
        self.errors: list[Diagnostic] = []
        self.wire_names = {w.name for w in diagram.wires}
        self.tensor_names = {t.name for t in diagram.inputs + diagram.lets}
        self.kinds: dict[str, str] = {}           # tensor -> number/boolean
        self.contraction_wires: set[str] = set()  # wires of the factors of sum[w](A * B)
        self.contractions: set[tuple] = set()     # (wires of A, wires of B, w) of each sum[w](A * B)
        self.broken_boxes: set[str] = set()       # boxes with unresolved names
        self.unknown_layouts: set[str] = set()    # tensors whose layout is refused (see broken_layout)
        self.names_ok = True                      # no unknown names anywhere (a dtype typo leaves the sizes checkable)
        self.memo: dict[int, tuple] = {}          # id(expr) -> (expr, inferred wires and kind)

    def err(self, message: str, loc: ir.Loc, hint: Optional[str] = None) -> None:
        self.errors.append(Diagnostic(message, loc, hint))

    def unknown(self, what: str, name: str, loc: ir.Loc, candidates, where: str = "", more=()) -> None:
        self.names_ok = False
        # hold q (a wire) or group Q (a tensor): the name exists, as the other kind
        other = ("a wire" if what == "tensor" and name in self.wire_names else
                 "a tensor" if what == "wire" and name in self.tensor_names else None)
        hint = f"{name} is {other}, not a {what}" if other else _closest(name, candidates, more)
        self.err(f"unknown {what} '{name}'{where}", loc, hint)

    def run(self, capacity: bool = True) -> None:
        self.check_names()
        self.check_layouts()
        self.check_boxes()
        if self.names_ok:
            self.check_sizes()
        self.check_outputs()
        schedule_ok = self.check_schedule()
        for level in self.d.schedule.levels if self.d.schedule else ():
            for wire in tiling.streamed_wires(self.d, level.name) if level.name in ir.ALL_LEVELS else ():
                if wire in self.wire_names:
                    Streamability(self, wire).run()
        if capacity and self.d.schedule and schedule_ok and self.names_ok and not self.errors:
            self.check_capacity()

    # ---- 1. names ------------------------------------------------------------

    def check_names(self) -> None:
        d = self.d
        decls = [("diagram", d.name, d.loc, None)]
        decls += [("wire", w.name, w.loc, w.size) for w in d.wires]
        decls += [("input", t.name, t.loc, None) for t in d.inputs]
        decls += [("box", t.name, t.loc, None) for t in d.lets]
        seen: dict[str, tuple] = {}
        for i, (kind, name, loc, size) in sorted(enumerate(decls), key=lambda x: (x[1][2].line, x[1][2].col)):
            why = hostile_name(name)
            if why:
                self.err(why, loc, "rename it: names become Python identifiers in the generated code")
            elif kind == "diagram" and name in _MODULES:
                self.err(f"diagram name '{name}' is the name of the Python module {name}: the compiled "
                         f"{name}.py would shadow it wherever its folder is on sys.path", loc,
                         "rename the diagram (it names the generated module)")
            if kind == "wire" and size is not None and size < 1:   # |n| = 0 divides by zero, or holds nothing
                self.err(f"wire {name} has size {size}: a wire's size is a whole number of at least 1", loc,
                         f"leave the size out (wire {name}) to take it from the inputs at each call")
            first = seen.setdefault(name, (kind, loc, size, i))
            if first[3] == i:
                continue
            if kind == first[0] == "wire" and None not in (size, first[2]) and size != first[2]:
                self.err(f"one wire given two sizes: '{name}' is {size} here but {first[2]} "
                         f"at line {first[1].line}", loc)
            else:
                article = "an" if first[0][0] in "aeiou" else "a"
                self.err(f"duplicate name '{name}': already declared as {article} {first[0]} "
                         f"at line {first[1].line}", loc, "wires, tensors and the diagram share one namespace")

    # ---- 2. layouts and dtypes -------------------------------------------------

    def check_layouts(self) -> None:
        for tensor in self.d.inputs + self.d.lets:
            if not self.check_wire_list(ir.axis_wires(tensor.axes), tensor.loc, f"the layout of {tensor.name}",
                                        ir.layout_locs(tensor)):
                self.broken_layout(tensor.name)
            if tensor.dtype is not None:
                self.check_dtype(tensor.dtype, _at(tensor.dtype_loc, tensor.loc))

    def check_wire_list(self, wires, loc: ir.Loc, where: str, locs: tuple[ir.Loc, ...] = ()) -> bool:
        """Unknown or repeated wires in a layout, relabel or reduction; each
        reported at its own spot when ``locs`` (one per wire) says where that
        is, else at ``loc``.  (Only layouts record where each wire is.)"""
        ok = True
        for i, w in enumerate(wires):
            at = locs[i] if i < len(locs) else loc
            if w not in self.wire_names:
                self.unknown("wire", w, at, self.wire_names, f" in {where}")
                ok = False
            elif w in wires[:i]:
                self.err(f"wire '{w}' appears twice in {where}", at)
                ok = False
        return ok

    def broken_layout(self, name: str) -> None:
        """``name``'s layout was refused (an unknown or repeated wire, or wires
        its expression does not have): its wires are a slip's, so its readers
        are not compared with them ("reduce y" or "drop x" of a correct box),
        nor are the wires' sizes sought ("wire g has no size" of Q[(hk hk)])."""
        self.unknown_layouts.add(name)
        self.names_ok = False

    def check_dtype(self, dtype: str, loc: ir.Loc) -> bool:
        if dtype in ir.DTYPE_BYTES:
            return True
        hint = _closest(dtype, ir.DTYPE_BYTES)
        self.err(f"unknown dtype '{dtype}'", loc,
                 (hint + " " if hint else "") + "dtypes are " + ", ".join(ir.DTYPE_BYTES))
        return False

    # ---- 3. boxes ----------------------------------------------------------------

    def check_boxes(self) -> None:
        env: dict[str, frozenset] = {}  # tensors defined so far -> their wires
        for t in self.d.inputs:
            if t.name not in env:
                env[t.name] = frozenset(ir.axis_wires(t.axes))
                self.kinds[t.name] = _BOOL if t.dtype == "bool" else _NUM if t.dtype in ir.DTYPE_BYTES else _ANY
        for let in self.d.lets:
            self.box, self.env, self.poisoned = let, env, False
            wires, kind = self.infer(let.expr)
            declared = ir.axis_wires(let.axes)
            if not self.poisoned and let.name not in self.unknown_layouts \
                    and not self.compare_wires(let, set(declared), wires):
                self.broken_layout(let.name)
            if self.poisoned:
                self.broken_boxes.add(let.name)
            if let.name not in env:
                env[let.name] = frozenset(declared)
                self.kinds[let.name] = kind

    def compare_wires(self, let: ir.Let, declared: set[str], produced: frozenset) -> bool:
        """Whether a box's expression has the wires its layout declares; if not, errors say which."""
        order = [w.name for w in self.d.wires] + sorted(produced | declared)  # undeclared wires last
        extra = sorted(produced - declared, key=order.index)
        missing = sorted(declared - produced, key=order.index)
        if extra:
            ws, it = ", ".join(extra), "it" if len(extra) == 1 else "them"
            self.err(f"{let.name} declares {_layout(let.axes)} but its expression has {ws} too: "
                     f"reduce {it} (sum[{ws}](...)) or declare {it}", let.loc)
        if missing:
            # At the first of them in the layout: that is what the hint says to drop.
            ws = ", ".join(missing)
            wires, locs = ir.axis_wires(let.axes), ir.layout_locs(let)
            at = next(loc for w, loc in zip(wires, locs) if w in missing)
            self.err(f"{let.name} declares {_layout(let.axes)} but its expression has no {ws}", at,
                     f"a box has exactly the wires of its expression: drop {ws} from the layout")
        return not extra and not missing

    def infer(self, e: ir.Expr) -> tuple[frozenset, str]:
        """The wires ``e`` produces and whether it is a number or a boolean.
        Remembered per node, so later questions about a subexpression are free."""
        if id(e) not in self.memo:
            self.memo[id(e)] = (e, self.infer_node(e))  # keep e alive so its id stays unique
        return self.memo[id(e)][1]

    def infer_node(self, e: ir.Expr) -> tuple[frozenset, str]:
        if isinstance(e, ir.Num):
            return frozenset(), _NUM
        if isinstance(e, (ir.WireIndex, ir.WireSize)):
            if e.wire not in self.wire_names:
                self.poisoned = True
                self.unknown("wire", e.wire, e.loc, self.wire_names)
                return frozenset(), _NUM
            return frozenset([e.wire] if isinstance(e, ir.WireIndex) else []), _NUM
        if isinstance(e, ir.TensorRef):
            return self.infer_ref(e)
        if isinstance(e, ir.Unary):
            wires, kind = self.infer(e.operand)
            want = _BOOL if e.op == "not" else _NUM
            if kind not in (want, _ANY):
                self.err(f"'{e.op}' needs a {want}, not a {kind}", e.loc, _KIND_HINT[want])
            return wires, want if kind == want else _ANY
        if isinstance(e, ir.Binary):
            return self.infer_binary(e)
        if isinstance(e, ir.Call):
            return self.infer_call(e)
        if isinstance(e, ir.Reduce):
            return self.infer_reduce(e)
        return self.infer_normalize(e)

    def infer_ref(self, e: ir.TensorRef) -> tuple[frozenset, str]:
        if e.name not in self.env:
            self.poisoned = True
            later = next((t for t in self.d.lets if t.name == e.name), None)
            if later is self.box:
                self.err(f"{e.name} uses itself", e.loc, "a box can only use tensors defined before it")
            elif later is not None:
                self.err(f"{e.name} is used before it is defined (line {later.loc.line})", e.loc,
                         "define boxes before the boxes that use them")
            elif e.wires is None:
                # a mistyped tensor is likelier than a mistyped one-letter wire
                self.unknown("name", e.name, e.loc, self.tensor_names, more=self.wire_names)
            else:
                self.unknown("tensor", e.name, e.loc, self.tensor_names)
            return frozenset(), _ANY
        kind = self.kinds.get(e.name, _NUM)
        if e.name in self.unknown_layouts:
            # its wires are a typo's: comparing them would say "reduce y" or "drop x" of the reader
            self.poisoned = True
        if e.wires is None:
            return self.env[e.name], kind
        declared = ir.axis_wires(self.d.tensor(e.name).axes)
        shown = _show(e)
        if not self.check_wire_list(e.wires, e.loc, shown):
            self.poisoned = True
        elif not declared:
            self.poisoned = True
            self.err(f"{shown} reads {e.name} along wires, but {e.name} is a scalar (declared along none)",
                     e.loc, f"write {e.name} alone")
        elif len(e.wires) != len(declared):
            self.poisoned = True
            self.err(f"{shown} gives {len(e.wires)} wire{'s' if len(e.wires) != 1 else ''} but "
                     f"{e.name} is declared along {len(declared)}: {_layout(tuple((w,) for w in declared))}",
                     e.loc, "a relabel names one wire per declared wire, in order")
        else:
            for old, new, step in zip(declared, e.wires, ir.read_steps(e)):
                a, b = self.d.wire(old), self.d.wire(new)
                if step != 1:
                    self.check_coarse(e, old, new, step)
                elif a and b and a.size is not None and b.size is not None and a.size != b.size:
                    self.err(f"one wire given two sizes: {shown} reads {old} (= {a.size}) "
                             f"as {new} (= {b.size})", e.loc)
        return frozenset(e.wires), kind

    def check_coarse(self, e: ir.TensorRef, old: str, new: str, step: int) -> None:
        """``keep[.., q // 64, ..]`` of ``keep[.., qb, ..]``: qb holds the blocks of q,
        ceil(|q| / 64) of them, on one device (the wrappers split no such read)."""
        a, b = self.d.wire(old), self.d.wire(new)
        if old == new:
            self.err(f"{_show(e)} reads {e.name} at {new} // {step}, but {e.name} is declared along {new} itself",
                     e.loc, f"declare {e.name} along a wire of the blocks of {new}, of size ceil(|{new}| / {step})")
        elif a and b and a.size is not None and b.size is not None and a.size != -(-b.size // step):
            self.err(f"{_show(e)} reads {old} at {new} // {step}, so {old} must have size ceil({b.size} / {step}) = "
                     f"{-(-b.size // step)}, not {a.size}", e.loc)
        mesh = [lv for lv in (self.d.schedule.levels if self.d.schedule else ()) if lv.name in ir.MESH_LEVELS]
        if mesh:
            self.err(f"{_show(e)} reads {e.name} at blocks of {new}, which napkin's distributed wrappers do not "
                     f"split across devices", e.loc, f"drop level {mesh[0].name}, or pass {e.name} along {new}")

    def infer_binary(self, e: ir.Binary) -> tuple[frozenset, str]:
        (lw, lk), (rw, rk) = self.infer(e.lhs), self.infer(e.rhs)
        kinds = {lk, rk} - {_ANY}
        if e.op in ir.ARITH_OPS:
            result, wrong = _NUM, _BOOL in kinds
            if wrong:
                self.err(f"'{e.op}' needs numbers, not a boolean", e.loc, _KIND_HINT[_NUM])
            elif e.op in ("/", "^"):
                self.check_constant(e)
            elif e.op in ("//", "%"):
                self.check_floor_division(e)
        elif e.op in ir.LOGIC_OPS:
            result, wrong = _BOOL, _NUM in kinds
            if wrong:
                self.err(f"'{e.op}' needs booleans, not a number", e.loc, _KIND_HINT[_BOOL])
        elif e.op in ("==", "!="):
            result, wrong = _BOOL, len(kinds) > 1
            if wrong:
                self.err(f"'{e.op}' compares a boolean with a number", e.loc)
        else:
            result, wrong = _BOOL, _BOOL in kinds
            if wrong:
                self.err(f"'{e.op}' compares numbers, not booleans", e.loc, "== and != compare booleans")
        return lw | rw, _ANY if wrong else result

    def check_floor_division(self, e: ir.Binary) -> None:
        """``a // b`` and ``a % b`` are index arithmetic: whole numbers divided
        by a positive whole constant or a wire's size, so they are the same
        floor and remainder in Python, torch and the kernels (Triton's // and
        % truncate towards zero, which the kernels correct for a negative
        numerator) and never divide by zero."""
        fixed = {w.name: w.size for w in self.d.wires if w.size is not None and w.size >= 1}
        if not self.whole(e.lhs):
            self.err(f"'{e.op}' divides whole numbers, and {_show(e.lhs)} may not be one", e.lhs.loc,
                     "its left side is index arithmetic: wire indices, sizes, whole numbers, integer inputs, "
                     "combined by + - * // % and max, min, abs, where")
        divisor = ir.fold_constant(e.rhs, fixed)
        if isinstance(e.rhs, ir.WireSize) and divisor is None:
            return
        if divisor is None or not float(divisor).is_integer() or divisor < 1:
            self.err(f"'{e.op}' needs a positive whole divisor, not {_show(e.rhs)}", e.rhs.loc,
                     f"divide by a whole number (q {e.op} 128) or a wire's size (q {e.op} |c|)")

    def whole(self, e: ir.Expr) -> bool:
        """Whether ``e`` is a whole number wherever it is read (check_floor_division)."""
        if isinstance(e, ir.Num):
            return math.isfinite(e.value) and float(e.value).is_integer()
        if isinstance(e, (ir.WireIndex, ir.WireSize)):
            return True
        if isinstance(e, ir.TensorRef):
            t = self.d.tensor(e.name)   # (None: an unknown name, reported already)
            return t is None or isinstance(t, ir.Input) and t.dtype in ir.NUMBER_INT_DTYPES
        if isinstance(e, ir.Unary):
            return e.op == "-" and self.whole(e.operand)
        if isinstance(e, ir.Binary):
            return e.op in ("+", "-", "*", "//", "%") and self.whole(e.lhs) and self.whole(e.rhs)
        if isinstance(e, ir.Call) and e.fn in ("max", "min", "abs", "where"):
            return all(self.whole(a) for a in (e.args[1:] if e.fn == "where" else e.args))
        return False

    def check_constant(self, e: ir.Binary) -> None:
        """A division or power of numbers (and fixed sizes) with no real value:
        it folded to nothing, and the kernel and reference() raised
        ZeroDivisionError at run time (or the reference a complex number)."""
        # (not a size check_names refused: wire d = 0 also blamed |d|^-0.5)
        fixed = {w.name: w.size for w in self.d.wires if w.size is not None and w.size >= 1}
        a, b = ir.fold_constant(e.lhs, fixed), ir.fold_constant(e.rhs, fixed)
        if a is None or b is None:
            return
        if e.op == "/" and b == 0:
            self.err(f"division by zero: {_show(e)} has no value", e.loc,
                     "write inf or -inf for an infinite constant")
        elif e.op == "^" and a == 0 and b < 0:
            self.err(f"0 to a negative power: {_show(e)} has no value", e.loc,
                     "write inf or -inf for an infinite constant")
        elif e.op == "^" and -math.inf < a < 0 and math.isfinite(b) and b != int(b):
            self.err(f"a negative number to a fractional power: {_show(e)} is not a real number", e.loc)

    def infer_call(self, e: ir.Call) -> tuple[frozenset, str]:
        args = [self.infer(a) for a in e.args]
        wires = frozenset().union(*(w for w, _ in args))
        if e.fn == "where" and len(args) == 3:
            if args[0][1] == _NUM:
                self.err("where's condition must be a boolean (a comparison), not a number",
                         e.args[0].loc, "compare it, e.g. where(x <= q, S, -inf)")
            branches = {args[1][1], args[2][1]} - {_ANY}
            if len(branches) > 1:
                self.err("where's two branches must both be numbers or both booleans", e.loc)
            return wires, branches.pop() if len(branches) == 1 else _ANY
        if any(k == _BOOL for _, k in args):
            self.err(f"{e.fn} needs numbers, not a boolean", e.loc, _KIND_HINT[_NUM])
            return wires, _ANY
        return wires, _NUM

    def infer_reduce(self, e: ir.Reduce) -> tuple[frozenset, str]:
        body, kind = self.infer(e.body)
        head = f"{e.op}[{', '.join(e.wires)}]"
        result = _NUM
        if kind == _BOOL:
            self.err(f"{head} needs numbers, not booleans", e.loc, _KIND_HINT[_NUM])
            result = _ANY
        if not self.check_wire_list(e.wires, e.loc, head):
            self.poisoned = True
            return body - set(e.wires), result
        factors = self.factors(e)
        for w in e.wires:
            if self.poisoned:
                break
            if w not in body:
                self.err(f"{head} reduces {w}, but its operand has no {w}", e.loc,
                         f"its operand is along {_layout(tuple((x,) for x in sorted(body)))}")
            elif factors and (w in factors[0][1]) != (w in factors[1][1]):
                (has, _), (lacks, _) = factors if w in factors[0][1] else factors[::-1]
                self.err(f"{head} contracts nothing: {w} is in {has} but not in {lacks}", e.loc,
                         f"a contraction joins a wire of both factors; check the layouts of {has} and {lacks}")
        return body - set(e.wires), result

    def factors(self, e: ir.Reduce):
        """For sum[w](A * B): ((A, wires of A), (B, wires of B)) when both factors
        are tensors (a contraction), else None.  Records the contracted wires."""
        if e.op != "sum" or not isinstance(e.body, ir.Binary) or e.body.op != "*":
            return None
        lw, rw = self.infer(e.body.lhs)[0], self.infer(e.body.rhs)[0]  # remembered: no new errors
        self.contraction_wires |= lw | rw
        self.contractions.add((frozenset(lw), frozenset(rw), frozenset(e.wires)))
        if isinstance(e.body.lhs, ir.TensorRef) and isinstance(e.body.rhs, ir.TensorRef):
            return (_show(e.body.lhs), lw), (_show(e.body.rhs), rw)
        return None

    def infer_normalize(self, e: ir.Normalize) -> tuple[frozenset, str]:
        body, kind = self.infer(e.body)
        head = f"{e.op}[{e.wire}]"
        result = _NUM
        if kind == _BOOL:
            self.err(f"{head} needs numbers, not booleans", e.loc, _KIND_HINT[_NUM])
            result = _ANY
        if not self.check_wire_list((e.wire,), e.loc, head):
            self.poisoned = True
        elif e.wire not in body and not self.poisoned:
            self.err(f"{head} normalises along {e.wire}, but its operand has no {e.wire}", e.loc)
        return body, result

    def check_sizes(self) -> None:
        """Every symbolic wire a box uses gets its size at a call from an
        input's shape: an input lies along it, or along a wire a relabel ties
        it to (A[n, k] of A[m, k]: |n| = |m|).  A wire only indexed or output
        (C[m, n, j] = ... * j) has no size the launcher could find."""
        d = self.d
        tie = {w.name: w.name for w in d.wires}

        def root(w):
            while tie[w] != w:
                w = tie[w]
            return w

        # a group of tied wires holds at most one fixed size: A[n, k] * A[p, k] of A[m, k] with
        # n = 8 and p = 16 asks |m| to be both (check passed it, compile refused it at <input>)
        fixed = {w.name: (w.size, w.name) for w in d.wires if w.size is not None}
        used = set()
        for t in d.lets:
            used.update(ir.axis_wires(t.axes))
            for n in ir.walk(t.expr):
                if isinstance(n, (ir.WireIndex, ir.WireSize)):
                    used.add(n.wire)
                elif isinstance(n, ir.TensorRef) and n.wires is not None:
                    used.update(n.wires)
                    for old, new, step in zip(ir.axis_wires(d.tensor(n.name).axes), n.wires, ir.read_steps(n)):
                        # a coarse read ties no sizes: |qb| follows |q|, |q| is not told by |qb|
                        if step == 1 and old in tie and new in tie and root(old) != root(new):
                            a, b = fixed.get(root(old)), fixed.get(root(new))
                            direct = d.wire(old).size is not None and d.wire(new).size is not None
                            if a and b and a[0] != b[0] and not direct:   # (both fixed: infer_ref's)
                                self.err(f"one wire given two sizes: {_show(n)} reads {old} as {new}, which "
                                         f"ties {a[1]} (= {a[0]}) to {b[1]} (= {b[0]})", n.loc)
                            if a:
                                fixed.setdefault(root(new), a)
                            tie[root(old)] = root(new)
        # a flattened axis (b h) gives the product of its wires' sizes: a call
        # tells one of them from it once it knows the others by name (the
        # launcher's _bind, which spreads sizes along relabels only after: T[h]
        # of T[g] does not tell h inside (b h))
        named = {w.name for w in d.wires if w.size is not None}
        packed = []
        for t in d.inputs:
            for axis in t.axes:
                if len(axis) == 1:
                    named.update(axis)
                else:
                    packed.append(set(axis))
        while any(len(p - named) == 1 for p in packed):
            for p in packed:
                if len(p - named) == 1:
                    named.update(p)
        sized = {root(w) for w in named if w in tie}
        for w in d.wires:
            # (an unused one too: the launcher takes every symbolic wire's size; it was a KeyError)
            if w.size is None and root(w.name) not in sized and (w.name in used or d.inputs) \
                    and not hostile_name(w.name):   # (a name refused already: one error for it)
                flat = next((f"({' '.join(axis)}) of {t.name}" for t in d.inputs for axis in t.axes
                             if len(axis) > 1 and root(w.name) in {root(v) for v in axis if v in tie}), None)
                if flat:
                    self.err(f"wire {w.name} has no size: it lies only in flattened axes such as {flat}, beside "
                             "another wire of no size, so a call cannot tell the one from the other in their "
                             "product", w.loc, f"give it one (wire {w.name} = 8), or an input along it alone")
                    continue
                self.err(f"wire {w.name} has no size: no input lies along it (nor along a wire a relabel "
                         "ties it to), so a call cannot tell it from the shapes", w.loc,
                         f"give it one (wire {w.name} = 8), or an input along it")

    # ---- 4. outputs and schedule -------------------------------------------------

    def check_outputs(self) -> None:
        seen = set()
        for out in self.d.outputs:
            if out.name not in self.tensor_names:
                self.unknown("tensor", out.name, out.loc, self.tensor_names, " in out")
            elif out.name in seen:
                self.err(f"'{out.name}' is already an output", out.loc)
            seen.add(out.name)

    def check_schedule(self) -> bool:
        """Checks the schedule; True when its levels are sound enough to measure."""
        s = self.d.schedule
        if s is None:
            return True
        before = len(self.errors)
        profiles = set(ir.PROFILES) | set(tiling.profile_table())
        if s.profile is not None and s.profile not in profiles:
            hint = _closest(s.profile, profiles)
            self.err(f"unknown profile '{s.profile}'", _at(s.profile_loc, s.loc),
                     (hint + " " if hint else "") + "profiles are " + ", ".join(sorted(profiles)))
        where = _at(s.accumulate_loc, s.loc)
        if self.check_dtype(s.accumulate, where) and s.accumulate not in ACCUMULATE_DTYPES:
            self.err(f"cannot accumulate in {s.accumulate}: the accumulator must be "
                     + ", ".join(ACCUMULATE_DTYPES[:-1]) + " or " + ACCUMULATE_DTYPES[-1], where)
        seen: dict[str, ir.Level] = {}
        held: dict[str, ir.Level] = {}
        # the nodes level is named in messages only to files that use it
        order = ir.ALL_LEVELS if any(lv.name == "nodes" for lv in s.levels) else ir.LEVELS
        for level in s.levels:
            duplicate = level.name in seen
            if level.name not in ir.ALL_LEVELS:
                hint = _closest(level.name, ir.ALL_LEVELS)
                self.err(f"unknown level '{level.name}'", level.loc,
                         (hint + " " if hint else "") + "levels are " + ", ".join(ir.ALL_LEVELS))
            elif duplicate:
                self.err(f"level {level.name} appears twice (first at line {seen[level.name].loc.line})",
                         level.loc)
            else:
                inner = [n for n in seen if ir.ALL_LEVELS.index(n) > ir.ALL_LEVELS.index(level.name)]
                if inner:
                    self.err(f"level {level.name} comes after level {inner[0]}: levels go outermost first "
                             f"({', '.join(order)})", level.loc)
                seen[level.name] = level
            if level.name == "nodes" and (level.holds or level.capacity is not None):
                self.err("level nodes only splits wires across nodes: it holds no tensors and has no capacity",
                         level.loc, "tensors live in hbm; write 'group w across N' or 'stream w across N'")
            if not duplicate:   # (a mistyped name's tiles: 'level hbm' for smem gave an error per block)
                self.check_tiles(level)
            locs = level.hold_locs or (level.loc,) * len(level.holds)
            for name, loc in zip(level.holds, locs):
                if name not in self.tensor_names:
                    self.unknown("tensor", name, loc, self.tensor_names, " in hold")
                elif name in held and held[name] is level:
                    self.err(f"{name} is held twice in level {level.name}", loc)
                elif name in held:
                    self.err(f"{name} is held at both level {held[name].name} and level {level.name}",
                             loc, "a tensor lives at one level")
                else:
                    held[name] = level
                    self.check_io_hold(name, level, loc)
        self.check_mesh(seen)
        self.check_nesting(list(seen.values()))
        return len(self.errors) == before

    def check_io_hold(self, name: str, level: ir.Level, loc: ir.Loc) -> None:
        """Inputs and outputs live in hbm: the kernels read the caller's tensors
        there and write the results there.  An output held in smem compiled and
        ran (codegen ignored the hold) while the cost pass priced its kernel at
        0 bytes and 0 FLOPs, as if on chip for free."""
        role = ("input" if any(t.name == name for t in self.d.inputs) else
                "output" if any(o.name == name for o in self.d.outputs) else None)
        if role is not None and level.name != "hbm":
            self.err(f"{role} {name} is held in level {level.name}, but inputs and outputs live in hbm "
                     "(the kernels read the caller's tensors and write the results there)", loc,
                     f"hold {name} in level hbm, or leave it out of 'hold'")

    def check_nesting(self, levels) -> None:
        """A block at an inner level is part of the enclosing level's block of
        the same wire, so no larger (regs' 256 rows inside smem's 128 gave the
        cost pass a register tile no program has, and more traffic into smem
        than out of it)."""
        outer: dict[str, tuple[int, str]] = {}
        # outermost first, as written or not (one written out of order has its own error)
        known = [lv for lv in levels if lv.name in ir.ALL_LEVELS]
        for level in sorted(known, key=lambda lv: ir.ALL_LEVELS.index(lv.name)):
            blocks = [t for t in level.tiles if not t.across and t.wire in self.wire_names]
            for t in blocks:
                if t.wire in outer and t.size > outer[t.wire][0]:
                    size, name = outer[t.wire]
                    self.err(f"'{t.kind} {t.wire} by {t.size}' in level {level.name} is larger than level {name}'s "
                             f"block of {t.wire} ({size}): each {level.name} block is part of a {name} block",
                             t.loc, f"use a block of at most {size}, or a larger one in level {name}")
            outer.update((t.wire, (t.size, level.name)) for t in blocks)

    def check_mesh(self, seen: dict[str, ir.Level]) -> None:
        """A wire split at both mesh levels (nodes, then the devices of a
        node) is split the same way at both: grouped or streamed."""
        first: dict[str, ir.Tile] = {}
        for name in ir.MESH_LEVELS:
            for t in seen[name].tiles if name in seen else ():
                old = first.setdefault(t.wire, t)
                if t.across and old is not t and old.across and old.kind != t.kind:
                    self.err(f"{t.wire} is {old.kind}ed across nodes but {t.kind}ed across devices", t.loc,
                             "split a wire the same way at both mesh levels")

    def check_tiles(self, level: ir.Level) -> None:
        devices = level.name in ir.MESH_LEVELS
        tiled: set[str] = set()
        streamed: Optional[str] = None
        for t in level.tiles:
            if t.wire not in self.wire_names:
                self.unknown("wire", t.wire, t.loc, self.wire_names, f" in level {level.name}")
            elif t.wire in tiled:
                self.err(f"wire {t.wire} is tiled twice in level {level.name}", t.loc)
            tiled.add(t.wire)
            if t.kind == "stream":
                if streamed is not None and streamed != t.wire:
                    self.err(f"level {level.name} streams {streamed} and {t.wire}: "
                             "at most one wire is streamed per level", t.loc)
                streamed = streamed or t.wire
            if t.across and not devices:
                self.err(f"'{t.kind} {t.wire} across {t.size}' splits {t.wire} over devices: "
                         "'across' belongs in level devices", t.loc,
                         f"write '{t.kind} {t.wire} by N' for blocks of N")
            elif devices and not t.across:
                self.err(f"level {level.name} splits wires over {level.name}: write '{t.kind} {t.wire} across N', "
                         "not 'by'", t.loc)
            elif level.name == "hbm":
                # one processor of hbm is the whole GPU, which sees every wire whole: a block there
                # has no program to run it, and the cost pass and the kernels would each read it
                # their own way (tiling.tile_extent narrowed smem by it, the grid did not)
                self.err(f"'{t.kind} {t.wire} by {t.size}' in level hbm: one processor of hbm is the whole GPU, "
                         "which sees every wire whole; blocks belong in level smem (one program's)", t.loc,
                         f"write '{t.kind} {t.wire} by {t.size}' in level smem, or '{t.kind} {t.wire} across N' "
                         f"in level devices to split {t.wire} over GPUs")
            elif t.across and t.size < 1:
                self.err(f"cannot split {t.wire} across {t.size} devices", t.loc)
            elif t.across and (made := self._processors(t))[1] > MAX_DEVICES >= made[0]:
                # refused once, at the tile that passes the limit
                self.err(f"'{t.kind} {t.wire} across {t.size}' makes {made[1]:,} devices in all: napkin "
                         f"models at most {MAX_DEVICES:,} (2^20)", t.loc)
            elif not t.across:
                self.check_block(t, level)
            if t.chunk is not None:
                self.check_chunk(level, t)
            if t.layout is not None and t.layout not in ir.LAYOUTS:
                self.err(f"unknown token layout '{t.layout}' for {t.wire}", t.layout_loc,
                         _closest(t.layout, ir.LAYOUTS) or f"the layouts are {', '.join(ir.LAYOUTS)}")

    def _processors(self, upto: ir.Tile) -> tuple[int, int]:
        """The devices the schedule's across tiles make before ``upto`` and with
        it (each level's counts multiply: a grid, nodes times devices).  A ring,
        ``stream x across N`` beside ``group q across N`` at the same level
        whose chunks lack q (tiling.shares_a_group), runs on the group's N
        devices, not N more (Ring Attention's P devices are P, as the cost
        pass and napkin plan count them: a ring of 1025 was refused as
        1,050,625 devices, so plan could not emit one)."""
        n = 1
        for level in self.d.schedule.levels:
            for t in level.tiles:
                before = n
                if t.across and t.size >= 1 and not tiling.shares_a_group(self.d, level, t):
                    n *= t.size
                if t is upto:
                    return before, n
        return n, n

    def check_chunk(self, level: ir.Level, t: ir.Tile) -> None:
        """``group x by C`` beside ``stream x by B`` (ir.Tile.chunk): each
        program streams its chunk of C; the chunk is a whole number of blocks."""
        if level.name != "smem":
            self.err(f"level {level.name} both groups and streams {t.wire}: only level smem may split a "
                     "streamed wire into chunks (one per program)", t.chunk_loc)
        elif self.power_of_two("chunk size", t.chunk, t.wire, t.chunk_loc) and t.chunk <= t.size:
            self.err(f"group {t.wire} by {t.chunk} must be longer than the block it streams, {t.size}: "
                     f"each program streams its chunk of {t.wire} in blocks", t.chunk_loc,
                     f"group {t.wire} by {t.size * 2} or more, or drop the group")

    def power_of_two(self, what: str, n: int, wire: str, loc: ir.Loc) -> bool:
        """Whether ``n`` is a power of two; else an error ("block size 96 for q
        is not a power of two", hint the two nearest)."""
        if n >= 1 and not n & (n - 1):
            return True
        low = 1 << max(n.bit_length() - 1, 0)
        self.err(f"{what} {n} for {wire} is not a power of two", loc, f"try {low} or {low * 2}")
        return False

    def check_block(self, t: ir.Tile, level: ir.Level) -> None:
        small = 1 < t.size < MIN_DOT_BLOCK and t.wire in self.contraction_wires
        if self.power_of_two("block size", t.size, t.wire, t.loc) and small and not self.packed_rows(t, level):
            self.err(f"block size {t.size} for {t.wire} is too small: {t.wire} takes part in a "
                     f"contraction, and matrix products (tl.dot) need blocks of at least {MIN_DOT_BLOCK}",
                     t.loc, f"use 1 or a power of two >= {MIN_DOT_BLOCK}")

    def packed_rows(self, t: ir.Tile, level: ir.Level) -> bool:
        """Whether ``t`` is one of the two groups of packed rows
        (tiling.packs_rows, the rule codegen's lower.packed_wire runs): in
        level smem, ``group g by 4, q by 4`` where an input holds g right
        before q, 16 rows of grouped-query heads packed with their queries.
        The wires in the roles the kernels give them: the row wire one
        factor's own wire in a contraction sum[w](A * B) (q of Q, not of K),
        the packed wire a wire of its factors; neither contracted (w) nor
        streamed anywhere.  Codegen checks the rest (lower.packed_wire)."""
        if level.name != "smem":
            return False
        # neither wire may be contracted (d of sum[d](Q * K)) or streamed (x) anywhere
        taken = {u.wire for lv in self.d.schedule.levels for u in lv.tiles if u.kind == "stream"}
        taken |= {w for _, _, red in self.contractions for w in red}
        for other in {u.wire for u in level.tiles if u.kind == "group"} - {t.wire}:
            for packed, row in ((t.wire, other), (other, t.wire)):
                if {packed, row} & taken or not tiling.packs_rows(self.d, packed, row):
                    continue
                if any(row in lw ^ rw and packed in lw | rw for lw, rw, _ in self.contractions):
                    return True
        return False

    # ---- 6. capacity ---------------------------------------------------------------

    def check_capacity(self) -> None:
        for level in self.d.schedule.levels:
            capacity = tiling.level_capacity(self.d, level.name)
            if capacity is None:
                continue
            try:
                tiles = tiling.level_footprint(self.d, level.name, {})
            except tiling.UnboundWire:
                continue  # a symbolic wire untiled here: its size is known only at call time
            total = sum(b for _, _, b in tiles)
            if total <= capacity:
                continue
            source = "its own capacity" if level.capacity is not None else self.d.schedule.profile
            biggest = sorted(tiles, key=lambda t: -t[2])[:3]
            self.err(f"tiles at level {level.name} need {total} bytes but its capacity is {capacity} "
                     f"bytes ({source}): over by {total - capacity} bytes", level.loc,
                     "biggest tiles: " + ", ".join(f"{n} {b} bytes" for n, _, b in biggest)
                     + "; smaller blocks shrink them (napkin cost --tune finds blocks that fit)")


_KIND_HINT = {
    _NUM: "where(cond, a, b) turns a condition into numbers",
    _BOOL: "compare first, e.g. x <= q",
}

"""napkin's code generator: a checked diagram -> one Python module holding
Triton kernel(s), a differentiable launcher named after the diagram (a
torch op whose backward runs generated backward kernels, see training.py),
``NAME_backward``, an eager PyTorch ``reference`` and ``example_inputs``.

    emit_module(diagram, source_text=..., source_path=...) -> str
    write_module(path, out_dir="generated") -> pathlib.Path

Pipeline: lower.py (IR -> kernel plan) -> emit.py (plan -> template context;
exprs.py renders expressions, reference.py the eager reference; training.py
and backward.py the backward) -> the Jinja skeletons in templates/.  The emitted module imports only torch and
triton.  Same input, byte-identical output.
"""
from __future__ import annotations

import ast
import hashlib
import os
import shlex
from pathlib import Path
from typing import Optional

from .. import ir
from ..errors import NapkinError
from ..files import why_not, write_atomic

__all__ = ["emit_module", "write_module", "visited_blocks", "source_label"]

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def source_label(source_path: str) -> str:
    """The source path as the header shows it: relative to the repository when
    inside it, else the file name alone, so that the module's bytes depend on
    neither where the checkout lives nor how the path was spelled
    (``../x.ncd``, ``/tmp/x.ncd``)."""
    path = Path(source_path)
    try:
        label = path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        label = path.name
    # a name that is not UTF-8 (caf\xe9.ncd from an old archive; any non-ASCII one under LC_ALL=C)
    # reaches Python as surrogate escapes, which a UTF-8 module cannot hold: it failed to compile
    return os.fsencode(label).decode("utf-8", "backslashreplace")


def _cost_lines(diagram: ir.Diagram, plan) -> list[str]:
    """The cost summary for the header: napkin.cost's when it is available,
    else a few lines of our own (FLOPs per output element and the tiling)."""
    try:
        from ..cost import summary_lines  # written alongside; optional here
    except ImportError:
        summary_lines = None
    if summary_lines is not None:
        return list(summary_lines(diagram))  # symbolic sizes: formulas only, deterministic
    return _own_cost_lines(diagram, plan)


def _own_cost_lines(d: ir.Diagram, plan) -> list[str]:
    def size(w):
        wire = d.wire(w)
        return str(wire.size) if wire is not None and wire.size is not None else f"|{w}|"

    blocks = dict(plan.blocks)
    if plan.family == "contraction":
        return [f"FLOPs: 2*{size(plan.red)} per element of {plan.outputs[0].name}",
                f"tiling: {plan.row} by {blocks[plan.row]} x {plan.col} by {blocks[plan.col]} per program, "
                f"{plan.red} streamed by {blocks[plan.red]}"]
    flops = []
    for dot in plan.dots:
        flops.append(f"2*{size(dot.wire)}")
    for a in plan.accums:
        if a.value is not None:
            flops.append(f"2*{size(a.value.cols)}")
    lines = [f"FLOPs: {' + '.join(flops)} per ({plan.row}, {plan.col}) pair"
             + (", only where the mask lets a block through" if plan.bounds else "")]
    lines.append(f"tiling: {plan.row} by {blocks[plan.row]} per program"
                 + (f" (x {', '.join(plan.batch)})" if plan.batch else "")
                 + f", {plan.col} streamed by {blocks[plan.col]}")
    return lines


def emit_module(diagram: ir.Diagram, *, source_text: str, source_path: str) -> str:
    """The generated module's text for a checked diagram.  Raises NapkinError
    (with a location and a plain reason) when napkin cannot emit a kernel."""
    from .. import __version__
    from . import emit, lower

    label = source_label(source_path)
    try:
        plan = lower.lower(diagram)
    except NapkinError as err:   # errors name the file as the user gave it, like the checker's
        raise err.with_source(str(source_path), source_text) from None
    digest = hashlib.sha256(source_text.encode()).hexdigest()
    doc = _docstring(diagram, plan, label, __version__, digest)
    try:
        text = emit.render(plan, docstring=doc, version=__version__, source_hash=digest) \
            + _distributed_part(diagram, label)
    except NapkinError as err:
        raise err.with_source(str(source_path), source_text) from None
    _assert_compiles(text, diagram.name)
    return _without_unused_imports(text)


def _without_unused_imports(text: str) -> str:
    """The module less its top-level ``import X`` lines whose X it never names.
    The template imports every standard module some diagram's code needs
    (weakref for a data mask's cache, contextvars for training's state);
    a matmul's module imported three it never used."""
    tree = ast.parse(text)
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    unused = {node.lineno for node in tree.body if isinstance(node, ast.Import) and len(node.names) == 1
              and node.names[0].asname is None and "." not in node.names[0].name
              and node.names[0].name not in named}
    lines = text.splitlines(keepends=True)
    return "".join(line for k, line in enumerate(lines, 1) if k not in unused)


def _assert_compiles(text: str, name: str) -> None:
    """A module that is not Python is napkin's bug, never the user's: stop
    here, before anything is written, rather than at the user's import."""
    try:
        compile(text, f"<generated {name}.py>", "exec")
    except SyntaxError as err:
        line = text.splitlines()[err.lineno - 1] if err.lineno else ""
        raise RuntimeError(f"napkin bug: the module emitted for diagram {name} is not valid Python "
                           f"(line {err.lineno}: {err.msg}): {line.strip()}") from None


def _distributed_part(diagram: ir.Diagram, label: str) -> str:
    """For a diagram with a devices level: NAME_distributed and its shard /
    gather helpers (napkin.distributed.emit), which import napkin.distributed
    on first call, so importing the module still needs only torch and triton."""
    from ..distributed.reading import mesh_splits

    if not mesh_splits(diagram):
        return ""
    from ..distributed.emit import distributed_source
    text = distributed_source(diagram, label).strip("\n")
    return f"\n\n{text}\n" if text else ""


def _docstring(d: ir.Diagram, plan, label: str, version: str, digest: str) -> str:
    def layout(t):
        return "[" + ", ".join(a[0] if len(a) == 1 else "(" + " ".join(a) + ")" for a in t.axes) + "]"

    outs = {o.name: o for o in plan.outputs}
    lines = [f"{d.name}: a Triton kernel generated by napkin from a neural circuit diagram.", "",
             f"source:  {label}",
             f"napkin:  {version}",
             f"sha256:  {digest}",
             f"Do not edit: regenerate with `napkin compile {shlex.quote(label)}`.", "",
             "cost summary:"]
    lines += [f"    {line}" for line in _cost_lines(d, plan)]
    lines += ["", f"{d.name}({', '.join(t.name for t in d.inputs)}) -> {', '.join(outs)}"]
    lines += [f"    in  {t.name}{layout(t)} : {t.dtype}" for t in d.inputs]
    lines += [f"    out {o.name}{layout(d.tensor(o.name))} : {outs[o.name].dtype}" for o in d.outputs]
    lines += ["",
              "Inputs declared with the same float dtype must share one dtype at a call",
              "(float16, bfloat16 or float32; reference() also takes float64); an output",
              "declared like some inputs follows their dtype.  Symbolic wires take their",
              "sizes from the shapes, so one compiled kernel serves every length.",
              "reference(...) is the same diagram in eager PyTorch; example_inputs(sizes)",
              "makes random inputs."]
    body = "\n".join(lines).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    return f'"""{body}\n"""'


def write_module(path, out_dir="generated", claimed: Optional[dict] = None) -> Path:
    """Load, check and compile an .ncd file into OUT_DIR/NAME.py, NAME being
    the diagram's name.  Written atomically (a temporary file, then
    os.replace): a failure leaves nothing half-written.  Creates OUT_DIR and
    an __init__.py in it when missing.  Returns the module's path.

    ``claimed`` (diagram name -> source path, updated here): the modules one
    run has written; a second source of the same name is refused rather
    than let it replace the first's module without a word."""
    import napkin

    path = Path(path)
    source = napkin.read_source(path)
    diagram = napkin.load_text(source, str(path))
    out = Path(out_dir)
    target = out / f"{diagram.name}.py"
    if claimed is not None and diagram.name in claimed:
        raise NapkinError(f"diagram {diagram.name} was compiled from {claimed[diagram.name]} already: "
                          f"{target} is not replaced", filename=str(path))
    text = emit_module(diagram, source_text=source, source_path=str(path))
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(target, text)
        init = out / "__init__.py"   # after the module: a module that could not be written leaves none
        if not init.exists():
            write_atomic(init, '"""Modules generated by napkin (`napkin compile examples/*.ncd`)."""\n')
    except OSError as err:  # an -o that is a file, a folder without write permission, a full disk
        raise NapkinError(f"cannot write {target}: {why_not(err, target)}", filename=str(path)) from None
    if claimed is not None:
        claimed[diagram.name] = str(path)
    return target


def visited_blocks(diagram: ir.Diagram, sizes: dict, block_row: int | None = None,
                   block_col: int | None = None, lengths: dict | None = None) -> list[tuple[int, int]] | None:
    """For an attention diagram: the (row block, streamed block) pairs one
    program row of its kernel visits (exactly what it loads), for wire sizes
    ``sizes`` and optional block overrides; None for a contraction.  A length
    input the loops read (x < n[b]) is taken at its value in ``lengths``; one
    not given leaves its bound out (the kernel then visits at most these)."""
    from .. import masks, visits
    from . import lower

    plan = lower.lower(diagram)
    if plan.family != "attention":
        return None
    blocks = dict(plan.blocks)
    br = block_row or blocks[plan.row]
    bc = block_col or blocks[plan.col]
    all_sizes = {w.name: w.size for w in diagram.wires if w.size is not None}
    all_sizes.update(sizes)
    bounds = masks.at_values(plan.bounds, lengths or {})
    return visits.visited_blocks(bounds, all_sizes[plan.row], all_sizes[plan.col], br, bc, all_sizes)

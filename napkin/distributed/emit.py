"""The distributed part of a generated module (templates/distributed.py.jinja).

``distributed_source(diagram)`` returns Python text to append to the module
napkin.codegen writes for a diagram with a devices level: a function
``NAME_distributed(Q, K, V, mesh, *, q_len, ...)`` (ATTENTION2D; for Ring
Attention, its double ring over nodes, and decoding the argument after the
tokens is a process group, default the world) plus ``NAME_distributed_shard`` and
``NAME_distributed_gather``.
The text is deterministic: the same diagram gives the same bytes.
"""
from __future__ import annotations

import functools

from .. import ir
from ..errors import Diagnostic, NapkinError
from .reading import roles   # pure IR: compiling a module must not import torch


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2

    from ..resources import data_dir
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


def distributed_source(diagram: ir.Diagram, label: str = "") -> str:
    """The module text, or "" when the diagram has no devices level.
    Raises NapkinError when the diagram cannot be distributed."""
    from ..printer import to_text

    r = roles(diagram)
    if r.scheme is None:
        return ""
    scheme, grid = r.scheme
    kind = {"attention2d": ("ATTENTION2D", "Attention2D", "cyclic", f", a {' x '.join(map(str, grid))} grid"),
            "ring": ("Ring Attention", "RingAttention", "zigzag", f", a ring of {grid[0]}"),
            "tree": ("Decoding (tree merge)", "TreeAttention", "contiguous",
                     f", keys over {grid[0]} devices; queries whole on every rank")}[scheme]
    if r.double_ring is not None:
        kind = ("Ring Attention (double ring)", "RingAttention", "zigzag",
                ", {} nodes x {} GPUs".format(*r.double_ring))
    group = scheme != "attention2d"
    ring = scheme == "ring"
    outs = ", ".join(o.name for o in r.written.outputs)   # a sink's O, not the A and L that merge
    side = list(r.side) + list(r.rows)
    _refuse_parameters(diagram, "group" if group else "mesh", side, ring)
    ctx = dict(
        title=kind[0],
        cls=kind[1],
        name=diagram.name,
        fname=f"{diagram.name}_distributed",
        text_literal=_literal(to_text(diagram)),
        label_literal=repr(label or f"{diagram.name}.ncd"),
        tokens=", ".join(r.tokens),
        place="group" if group else "mesh",
        place_kw="group" if group else "grid",
        place_default="=None" if group else "",
        place_doc=(f"group: the {'ring' if scheme == 'ring' else 'tree'}'s process group or 1-D DeviceMesh "
                   "(None: the default group)." if group else
                   "mesh: a 2-D DeviceMesh (init_device_mesh(device, (R, C))) or a napkin Grid2D."),
        layout=(r.layout or kind[2]) + (" layout by default" if ring else " layout"),
        grid_note=kind[3],
        # a ring's token layout is the caller's choice (the same in the call, shard and gather):
        # over contiguous shards a window or chunk mask cuts the ring short (reach.py)
        layout_param=f', layout="{r.layout or "zigzag"}"' if ring else "",
        layout_arg="layout" if ring else "",
        layout_kw=", layout=layout" if ring else "",
        layout_doc=('layout: "zigzag" (balances causal work) or "contiguous" (a mask of nearby\n'
                    '    keys, a window or chunks, then cuts the ring short); the default is the\n'
                    '    one the diagram names, else zigzag; pass the same to _shard and _gather.\n    '
                    if ring else ""),
        lengths_doc=(f"q_len, x_len: the number of queries and the length of the key/value\n"
                     f"    cache (x_len is required); each rank holds its contiguous share of the\n"
                     f"    cache, padded, and every query.  Returns the whole {outs} on\n"
                     f"    every rank; forward only (inputs that require gradients are refused)."
                     if scheme == "tree" else
                     f"q_len, x_len: the true sequence lengths (x_len defaults to q_len); each\n"
                     f"    rank's inputs hold their padded share of rows.  Returns this rank's rows\n"
                     f"    of {outs}; differentiable."
                     + "".join(f"\n    {n}: this rank's rows of it, laid out as the queries'." for n in r.rows)),
        side_params="".join(f", {n}" for n in side),
        side_args="".join(f", {n}={n}" for n in side),
    )
    return _environment().get_template("distributed.py.jinja").render(**ctx)


# NAME_distributed's own parameters besides the diagram's inputs (the template);
# a ring's launcher has layout= too.
LAUNCHER_PARAMETERS = ("q_len", "x_len", "timeout")
# The keywords side inputs travel beside: the schemes pass them on by name, as
# **side, next to these (attention2d.py, ring.py, tree.py, local.py; a test
# holds this to their signatures).  A side input of one of these names was a
# repeated keyword: the module did not compile (grid), or every call failed
# (self, q_pos), or only the backward (delta, dO).
SIDE_KEYWORDS = ("self", "grid", "group", "mesh", "q_pos", "x_pos", "dO", "lse", "delta")


def _refuse_parameters(diagram: ir.Diagram, place: str, side, ring: bool = False) -> None:
    """An input named like one of NAME_distributed's own parameters would be a
    duplicate parameter (the module would not import).  Those parameters are
    the launcher's documented keywords, the same for every diagram, so the
    input is the one to rename.  A side input is passed by name further in,
    so it may not take a name of SIDE_KEYWORDS either."""
    own = (place,) + LAUNCHER_PARAMETERS + (("layout",) if ring else ())
    for t in diagram.inputs:
        if t.name in own:
            raise NapkinError([Diagnostic(
                f"napkin cannot emit a distributed launcher for input {t.name}: "
                f"{diagram.name}_distributed has a parameter named {t.name}", t.loc,
                f"rename the input (the launcher's own parameters are {', '.join(own)})")])
        if t.name in side and t.name in SIDE_KEYWORDS:
            raise NapkinError([Diagnostic(
                f"napkin cannot emit a distributed launcher for side input {t.name}: the distributed schemes "
                f"pass side inputs by name beside their own keyword {t.name}", t.loc,
                f"rename the input (side inputs may not be named {', '.join(SIDE_KEYWORDS)})")])


def _literal(text: str) -> str:
    """A Python string literal for multi-line text, readable in the module."""
    if '"""' in text or "\\" in text:
        return repr(text)
    return '"""\\\n' + text + '"""'

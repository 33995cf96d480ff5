"""Pictures and reports of diagrams.

Public API:

* ``to_dot(diagram, costs=None) -> str``: the Graphviz text (dot.py), pure;
* ``report_html(diagram, costs, svg, ...) -> str``: the one-page report
  (report.py), pure;
* ``render_file(path, out_path, sizes=None, profile=None, costs=True) -> Path``:
  load a .ncd file and draw it to .svg/.png/.pdf/.dot (``napkin compile
  --render`` calls it); returns the path written, which ends in .dot when
  Graphviz's ``dot`` program is missing;
* ``write_report(path, out_path, sizes=None, profile=None) -> Path``;
* ``register_cli(subparsers)``: ``napkin render`` and ``napkin report``;
* ``python -m napkin.render --docs`` redraws the README's pictures.

Only drawing pictures runs a program (``dot``); everything up to the DOT
text is a pure function of the IR and the cost report.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from ..documents import add_docs_option
from ..errors import NapkinError
from ..files import why_not, write_atomic
from ..sizes import parse_pairs
from .costs import DEFAULT_SIZES, check_profile, default_sizes, try_costs
from .dot import to_dot
from .report import report_html

FORMATS = ("svg", "png", "pdf", "dot")
INSTALL_HINT = ("install Graphviz for pictures (Debian/Ubuntu: apt-get install graphviz; "
                "macOS: brew install graphviz; conda: conda install -c conda-forge graphviz)")
DOT_TIMEOUT_S = 120

__all__ = ["to_dot", "report_html", "render_file", "write_report", "register_cli",
           "run_dot", "dot_program", "DEFAULT_SIZES", "FORMATS"]


# --------------------------------------------------------------------------
# Running Graphviz.
# --------------------------------------------------------------------------

def dot_program() -> Optional[str]:
    """The path of Graphviz's ``dot``, or None when it is not installed."""
    return shutil.which("dot")


# What dot says of a -T it was built without (Graphviz without cairo knows no png or pdf).
_UNKNOWN_FORMAT = re.compile(r'Format: "([^"]*)" not recognized\.(?: Use one of:(.*))?')


def run_dot(dot_text: str, fmt: str) -> bytes:
    """``dot -T<fmt>`` on the text.  ``dot`` rejecting napkin's own output is
    napkin's bug, so that raises RuntimeError, not NapkinError; a format this
    Graphviz was built without is the installation's, a NapkinError."""
    program = dot_program()
    if program is None:
        raise FileNotFoundError("Graphviz's dot program is not installed")
    # in UTC: cairo writes a PDF's creation date with the local offset beside it (+05'30'), which
    # the fixed digits below leave, so the bytes differed across zones
    env = {**os.environ, "TZ": "UTC"} if fmt == "pdf" else None
    done = subprocess.run([program, f"-T{fmt}"], input=dot_text.encode(), capture_output=True, env=env,
                          timeout=DOT_TIMEOUT_S)
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()
        unknown = _UNKNOWN_FORMAT.search(said)
        if unknown:
            known = set((unknown.group(2) or "").split())
            can = [f".{f}" for f in FORMATS if f == "dot" or f in known]   # napkin writes .dot itself
            raise NapkinError(f"this Graphviz's dot cannot write .{fmt} (of napkin's formats it writes "
                              f"{' and '.join(can)}): write one of those, or install a Graphviz built with "
                              "cairo, which writes .png and .pdf")
        raise RuntimeError(f"dot -T{fmt} failed: {said}")
    if fmt == "pdf":
        return _undated(done.stdout)
    return done.stdout


# cairo stamps a PDF with the time it was written (and ignores SOURCE_DATE_EPOCH),
# so the same diagram gave a different file every run; the other formats carry no date.
_PDF_DATE = re.compile(rb"(/CreationDate \(D:)[0-9]{14}")
FIXED_PDF_DATE = b"19700101000000"


def _undated(pdf: bytes) -> bytes:
    """The PDF with its creation date fixed: the same number of digits, so
    the byte offsets in its cross-reference table still hold."""
    return _PDF_DATE.sub(lambda m: m.group(1) + FIXED_PDF_DATE, pdf)


def svg_text(dot_text: str) -> Optional[str]:
    """The picture as inline SVG (no XML prolog), or None without ``dot``."""
    if dot_program() is None:
        return None
    svg = run_dot(dot_text, "svg").decode()
    return svg[svg.index("<svg"):] if "<svg" in svg else svg


def _refuse_bare_suffix(out_path: Path, suffixes) -> None:
    """``-o .svg``: Path takes a name that starts with its only dot for a stem
    with no suffix, and the refusal said the name must end in .svg, which it does."""
    if not out_path.suffix and out_path.name.lower() in suffixes:
        raise NapkinError(f"the name is only a suffix: it needs a stem before {out_path.name} "
                          f"(say a{out_path.name})", filename=str(out_path))


def _format_of(out_path: Path) -> str:
    _refuse_bare_suffix(out_path, tuple("." + f for f in FORMATS))
    fmt = out_path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise NapkinError(f"unknown picture format {repr(out_path.suffix) if out_path.suffix else '(none)'}: "
                          "the name must end in "
                          + ", ".join("." + f for f in FORMATS[:-1]) + " or ." + FORMATS[-1],
                          filename=str(out_path))
    return fmt


def _write(out_path: Path, data) -> None:
    """The whole file or, on a failure, the one that was there (write_atomic)."""
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out_path, data)
    except OSError as err:
        raise NapkinError(f"cannot write {out_path}: {why_not(err, out_path)}", filename=str(out_path)) from None


# --------------------------------------------------------------------------
# Files.
# --------------------------------------------------------------------------

def draw(diagram, out_path, costs=None, source=None) -> Path:
    """Draw a checked diagram to ``out_path`` (format from its suffix).

    Without ``dot`` it writes the DOT text beside, as ``<out>.dot``, says
    how to install Graphviz on stderr (one line), and returns that path;
    refused where that is ``source``, the diagram's own file.
    """
    out_path = Path(out_path)
    fmt = _format_of(out_path)
    text = to_dot(diagram, costs)
    if fmt == "dot":
        _write(out_path, text)
        return out_path
    if dot_program() is None:
        fallback = out_path.with_suffix(".dot")
        if source is not None and fallback.resolve() == Path(source).resolve():
            # the name is napkin's, not the user's: say where it came from
            raise NapkinError(f"Graphviz's dot was not found, so the DOT text would go to {fallback} "
                              f"instead of {out_path}, and {fallback} is the diagram itself; "
                              f"give -o a name with another stem, or " + INSTALL_HINT, filename=str(source))
        if fallback != out_path and fallback.is_file() and not _same_drawing(fallback, text):
            # a file the user never named: replaced, a hand-written pic.dot was gone (atomic hunt);
            # an earlier drawing of this diagram (compile --render again) is napkin's to replace
            raise NapkinError(f"Graphviz's dot was not found, so the DOT text would go to {fallback} instead "
                              f"of {out_path}, and {fallback} exists and is not a drawing of diagram "
                              f"{diagram.name}: it is left as it is; give -o {fallback} to replace it, or "
                              + INSTALL_HINT, filename=str(fallback))
        _write(fallback, text)
        print(f"napkin: Graphviz's dot was not found, so wrote {fallback} instead of {out_path}; "
              + INSTALL_HINT, file=sys.stderr)
        return fallback
    _write(out_path, run_dot(text, fmt))
    return out_path


def _same_drawing(path: Path, text: str) -> bool:
    """Whether ``path`` starts as ``text`` does (digraph "NAME" {): napkin's drawing of the diagram."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline() == text.splitlines(keepends=True)[0]
    except OSError:
        return False


def _load(path):
    import napkin

    return napkin.load(path)


def render_file(path, out_path, sizes: Optional[dict] = None, profile: Optional[str] = None,
                costs: bool = True, docs=None, lengths=None) -> Path:
    """Load and check ``path``, draw it to ``out_path``; the path written.

    With ``costs`` the edges carry the bytes the cost pass predicts at
    ``sizes`` (symbolic wires not given take DEFAULT_SIZES); if the cost
    pass is missing or fails, the picture is drawn without them.
    """
    diagram = _load(path)
    report = None
    given = _checked_sizes(diagram, sizes or {}, path)   # an unknown wire or device is refused either way
    if costs:   # (try_costs refuses an unknown device itself)
        report, why = try_costs(diagram, given, profile, docs, lengths)
        if why is not None:
            print(f"napkin: {path}: drawn without byte counts: {why}", file=sys.stderr)
    else:
        check_profile(profile)
    return draw(diagram, out_path, report, source=path)


def write_report(path, out_path, sizes: Optional[dict] = None, profile: Optional[str] = None, docs=None,
                 lengths=None) -> Path:
    """Load ``path`` and write the one-page HTML report to ``out_path``
    (``docs``: a document mask's costs on those documents, napkin/documents.py;
    ``lengths``: length inputs at these values, napkin/cost/lengths.py)."""
    diagram = _load(path)
    given = _checked_sizes(diagram, sizes or {}, path)
    report, why = try_costs(diagram, given, profile, docs, lengths)
    dot_text = to_dot(diagram, report)
    html = report_html(diagram, report, svg_text(dot_text), dot_text=dot_text,
                       sizes=default_sizes(diagram, given), why_no_costs=why,
                       profile=_profile(diagram, report, profile))
    out_path = Path(out_path)
    _write(out_path, html)
    return out_path


def _profile(diagram, report, profile: Optional[str]):
    """The device profile the report is against (None when unavailable)."""
    key = report.profile if report is not None else (
        profile or (diagram.schedule.profile if diagram.schedule else None) or "h100")
    try:
        from ..cost import get_profile
    except ImportError:
        return None
    try:
        return get_profile(key)
    except NapkinError:
        return None


def _checked_sizes(diagram, sizes: dict, path) -> dict:
    """The user's sizes, refused (NapkinError) for a wire the diagram lacks
    or a fixed wire given another size."""
    for name, value in sizes.items():
        wire = diagram.wire(name)
        if wire is None:
            raise NapkinError(f"--size {name}={value}: diagram {diagram.name} has no wire {name!r} "
                              f"(its wires: {', '.join(w.name for w in diagram.wires)})", filename=str(path))
        if wire.size is not None and wire.size != value:
            raise NapkinError(f"--size {name}={value}: wire {name} is fixed at {wire.size}", filename=str(path))
    return sizes


# --------------------------------------------------------------------------
# The command line.
# --------------------------------------------------------------------------

def _common(p) -> None:
    p.add_argument("file", metavar="FILE")
    p.add_argument("--size", "-D", action="append", default=[], metavar="WIRE=N", dest="sizes",
                   help="size of a symbolic wire for the byte counts (repeatable; default "
                        + " ".join(f"{k}={v}" for k, v in DEFAULT_SIZES.items()) + ")")
    p.add_argument("--device", "--profile", dest="device", default=None, metavar="NAME",
                   help="device profile for the costs (default: the diagram's)")
    add_docs_option(p)
    from ..cost.lengths import add_lengths_option   # (the cost pass's own option, as cost takes it)
    add_lengths_option(p)


def _docs(args):
    from ..documents import Documents

    return Documents.parse(args.docs) if args.docs is not None else None


def _lengths(args):
    from ..cost.lengths import parse_lengths

    return parse_lengths(args.lengths)


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("render", help="draw a diagram and its schedule (svg, png, pdf or dot)")
    _common(p)
    p.add_argument("-o", "--out", default=None, metavar="OUT",
                   help="output file; the format follows its suffix (default: FILE's name + .svg)")
    p.add_argument("--no-costs", action="store_true", help="leave the byte counts off the edges")
    p.set_defaults(func=_cmd_render)

    p = subparsers.add_parser("report", help="write a one-page HTML report: picture, costs, roofline")
    _common(p)
    p.add_argument("-o", "--out", default=None, metavar="OUT",
                   help="output file (default: FILE's name + .html)")
    p.set_defaults(func=_cmd_report)


def _default_out(path: str, suffix: str) -> Path:
    return Path(Path(path).stem + suffix)


def _not_the_diagram(out: Path, path: str) -> Path:
    if out.resolve() == Path(path).resolve():
        raise NapkinError(f"-o {out} is the diagram itself, which the output would replace", filename=path)
    return out


def _cmd_render(args) -> int:
    out = _not_the_diagram(Path(args.out) if args.out else _default_out(args.file, ".svg"), args.file)
    _format_of(out)  # refuse a bad suffix before any work
    for flag, given in (("--docs", args.docs), ("--lengths", args.lengths)):
        if args.no_costs and given is not None:   # the documents and the lengths change only the counts
            raise NapkinError(f"{flag} prices the byte counts on the edges, which --no-costs leaves off: give one")
    written = render_file(args.file, out, parse_pairs(args.sizes, "--size"), args.device, costs=not args.no_costs,
                          docs=_docs(args), lengths=_lengths(args))
    print(f"wrote {written}")
    return 0


def _cmd_report(args) -> int:
    out = _not_the_diagram(Path(args.out) if args.out else _default_out(args.file, ".html"), args.file)
    _refuse_bare_suffix(out, (".html", ".htm"))
    if out.suffix.lower() not in (".html", ".htm"):
        raise NapkinError(f"-o {out}: the report is an HTML page, so the name must end in .html or .htm",
                          filename=str(out))
    written = write_report(args.file, out, parse_pairs(args.sizes, "--size"), args.device, _docs(args),
                           _lengths(args))
    print(f"wrote {written}")
    return 0

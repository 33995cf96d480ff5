"""napkin: attention kernels from neural circuit diagrams.

Pipeline: text --parse--> IR --check--> IR --cost--> report
                                       --codegen--> generated/NAME.py
                                       --render--> picture
"""
from __future__ import annotations

import weakref
from pathlib import Path

__version__ = "0.1.0"

from .errors import Diagnostic, NapkinError  # noqa: E402

# Where each loaded diagram came from, for the refusals of APIs that take a
# Diagram (RingAttention(napkin.load(path))): the IR keeps lines, not files.
_SOURCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def load_text(text: str, filename: str = "<input>", capacity: bool = True):
    """Parse and check diagram text; raise NapkinError listing every problem.
    ``capacity=False``: a schedule whose tiles overflow a level passes (the
    tile search's input; nothing else should run such a diagram)."""
    from .check import check
    from .parse import parse

    # universal newlines, as read_source has them: Lark counts only \n, so with CR-only line
    # endings the first comment ran to the end of the text and an empty diagram passed
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    diagram = parse(text, filename)
    problems = check(diagram, capacity)
    if problems:
        raise NapkinError(problems, filename=filename, source=text)
    _SOURCES[diagram] = (filename, text)
    return diagram


def located(err: NapkinError, diagram) -> NapkinError:
    """``err`` rendered against the text ``diagram`` was loaded from (file
    name, source line, caret), when napkin loaded it and ``err`` names none."""
    source = _SOURCES.get(diagram) if err.filename == "<input>" else None
    return err.with_source(*source) if source else err


def load(path, capacity: bool = True) -> "object":
    """Parse and check an .ncd file (``capacity``: as load_text's)."""
    return load_text(read_source(path), str(path), capacity)


def read_source(path) -> str:
    """An .ncd file's text: UTF-8 whatever the locale, a byte-order mark
    skipped (some editors write one), NapkinErrors for what cannot be read."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8-sig")
    except OSError as err:
        raise NapkinError(f"cannot read {path}: {err.strerror}", filename=str(path)) from None
    except UnicodeDecodeError as err:  # a ValueError, not an OSError
        line = err.object.count(b"\n", 0, err.start) + 1
        col = err.start - (err.object.rfind(b"\n", 0, err.start) + 1) + 1
        raise NapkinError(f"cannot read {path}: not UTF-8 text (byte {err.object[err.start]:#04x} "
                          f"at line {line}, column {col})", filename=str(path)) from None


__all__ = ["Diagnostic", "NapkinError", "load", "load_text", "read_source", "__version__"]

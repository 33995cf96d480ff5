"""napkin's one user-facing error type.

A ``NapkinError`` carries one or more ``Diagnostic``s.  Each renders as

    file:line:col: message
        <the source line>
        ^ (caret under the spot)
    hint: ...

Anything else that escapes napkin is a bug (an internal error); the CLI shows
its traceback only with ``--traceback``.
"""
from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Iterable, Optional

from .ir import NOLOC, Loc

# Unicode categories an echoed source line shows as U+FFFD: controls (Cc), format
# characters (Cf: bidi controls, zero-width joiners) and line/paragraph separators.
_UNSHOWN = frozenset({"Cc", "Cf", "Zl", "Zp"})


@dataclass(frozen=True)
class Diagnostic:
    message: str
    loc: Loc = NOLOC
    hint: Optional[str] = None

    def format(self, filename: str = "<input>", source: Optional[str] = None) -> str:
        if self.loc.line <= 0:
            # no file behind it (a command-line option, an API argument): say who speaks, as Unix tools do
            who = "napkin" if filename == "<input>" else filename
            head = f"{who}: {self.message}"
            return head + (f"\n  hint: {self.hint}" if self.hint else "")
        out = [f"{filename}:{self.loc.line}:{self.loc.col}: {self.message}"]
        lines = source.replace("\r\n", "\n").split("\n") if source is not None else []  # as Lark counts lines
        if 0 < self.loc.line <= len(lines):
            # one column a character: a tab as a space, any other control character (a vertical
            # tab, NUL, which terminals draw as a line break or nothing) as U+FFFD, and so every
            # format character and line separator: a bidi override (U+202E) or isolate would
            # reorder the echoed line on screen (a "Trojan source"), a zero-width one shift the caret
            text = "".join("\ufffd" if unicodedata.category(c) in _UNSHOWN else c
                           for c in lines[self.loc.line - 1].expandtabs(1))
            out.append("    " + text)
            width = 1
            if self.loc.end_line == self.loc.line and self.loc.end_col > self.loc.col:
                width = self.loc.end_col - self.loc.col
            out.append("    " + " " * (self.loc.col - 1) + "^" * width)
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)


class NapkinError(Exception):
    """A user error: bad input, with where and why.  Never a bug."""

    def __init__(self, diagnostics: Iterable[Diagnostic] | str, *,
                 filename: str = "<input>", source: Optional[str] = None):
        if isinstance(diagnostics, str):
            diagnostics = [Diagnostic(diagnostics)]
        self.diagnostics = list(diagnostics)
        self.filename = filename
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.format(self.filename, self.source) for d in self.diagnostics)

    def with_source(self, filename: str, source: Optional[str]) -> "NapkinError":
        """The same diagnostics, rendered against a named file."""
        return NapkinError(self.diagnostics, filename=filename, source=source)

    @property
    def messages(self) -> list[str]:
        return [d.message for d in self.diagnostics]

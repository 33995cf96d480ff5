"""``python -m napkin.render --docs [DIR]``: redraw the README's pictures.

Writes attention.png and attention_2d.png (the README's pictures) and
naive_attention.png (the tutorial's first step) - the shipped examples, with
the cost pass's byte counts at the default sizes - into DIR, by default the
repository's docs/ folder.  Needs Graphviz's ``dot``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import NapkinError
from . import dot_program, render_file, INSTALL_HINT

REPO = Path(__file__).resolve().parent.parent.parent
DOCS_PICTURES = ("attention", "attention_2d", "naive_attention")


def write_docs(folder: Path) -> list[Path]:
    """Draw each of DOCS_PICTURES from examples/ into ``folder``; the paths."""
    return [render_file(REPO / "examples" / f"{name}.ncd", Path(folder) / f"{name}.png")
            for name in DOCS_PICTURES]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m napkin.render",
                                     description="Redraw the pictures the README shows.")
    parser.add_argument("--docs", nargs="?", const=str(REPO / "docs"), default=None, metavar="DIR",
                        help="write the pictures of DOCS_PICTURES into DIR (default: docs/)")
    args = parser.parse_args(argv)
    if args.docs is None:
        parser.print_help()
        return 2
    if dot_program() is None:
        print("napkin: the README's pictures need Graphviz's dot; " + INSTALL_HINT, file=sys.stderr)
        return 1
    try:
        written = write_docs(Path(args.docs))
    except NapkinError as err:   # a folder that is a file, one not writable: in words, not a traceback
        print(err, file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

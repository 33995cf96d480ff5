"""napkin's own time to compile diagrams, in a fresh interpreter: the first
pays for the imports, Lark's parser tables and the Jinja templates, every
later one only for its own work.  A benchmark, not a test (tests assert no
timings): run it from the repository root,

    python bench/compile_time.py examples/*.ncd

and it prints one line per file with the seconds its emit_module took, then
whether compiling imported torch (it must not: compiling needs no torch).
"""
from __future__ import annotations

import sys
import time

t0 = time.perf_counter()
import napkin  # noqa: E402  (the imports are part of what the first compile pays)
from napkin.codegen import emit_module  # noqa: E402
from napkin.errors import NapkinError  # noqa: E402


def main(paths: list[str]) -> int:
    t = t0
    for p in paths:
        try:
            text = open(p, encoding="utf-8").read()
            emit_module(napkin.load(p), source_text=text, source_path=p)
            status = "compiled"
        except NapkinError as err:  # e.g. a diagram with no kernel family (naive_attention)
            status = f"refused: {str(err).splitlines()[0]}"
        now = time.perf_counter()
        print(f"{now - t:8.3f} s  {p}  {status}")
        t = now
    print(f"torch imported: {'torch' in sys.modules}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

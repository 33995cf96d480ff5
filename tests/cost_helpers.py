"""What the cost pass's test files share: the bundled examples, a printed
formula evaluated exactly, the CLI run in-process, and a report's bytes per
tensor beside the ByteCounter's."""
from __future__ import annotations

from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import napkin
from napkin import ir

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.ncd"))


def load(name: str) -> ir.Diagram:
    return napkin.load(REPO / "examples" / f"{name}.ncd")


def sizes_for(d: ir.Diagram, n: int, heads: int = 2) -> dict[str, int]:
    """n for every sequence-like symbolic wire, ``heads`` for head wires, 1 for b."""
    small = {"b": 1, "h": heads, "hk": heads, "g": 2}
    return {w.name: small.get(w.name, n) for w in d.wires if w.size is None and w.name not in coarse_wires(d)}


def coarse_wires(d: ir.Diagram) -> set[str]:
    """The wires a coarse read's blocks lie along (qb of keep[.., q // 64, ..]):
    their sizes follow from the wires read (ceil(|q| / 64)), so the sizes the
    tests give leave them out, for the cost pass and example_inputs to derive."""
    return {declared for _, declared, _, _, _ in ir.coarse_reads(d)}


def evaluate(formula: str, env) -> Fraction:
    """Evaluate a printed formula (a*b/c + ... with ^) exactly."""
    expr = formula.replace("^", "**")
    return Fraction(eval(expr, {"__builtins__": {}}, {k: Fraction(v) for k, v in env.items()}))


def run_cli(*argv, capsys):
    from napkin.cli import main
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def predicted_bytes(report, *without) -> tuple[dict, dict]:
    """A report's (loads, stores) bytes per tensor, as the ByteCounter keys
    them (triton_transfers), less the tensors ``without``."""
    out = (defaultdict(int), defaultdict(int))
    for t in triton_transfers(report):
        out[t.direction != "load"][t.tensor] += t.bytes
    return tuple(without_tensors(c, *without) for c in out)


def triton_transfers(report) -> list:
    """A report's transfers but those of the ranges prepass's lists, which
    torch's ops make (the ByteCounter sees Triton's loads and stores alone)."""
    torch_made = {k.index for k in report.kernels if k.prepass_step == "lists"}
    return [t for t in report.transfers if t.kernel not in torch_made]


def backward_bytes(back, direction: str) -> dict:
    """A backward cost's bytes per tensor in one direction, as the ByteCounter
    sees them: the prepasses' lists (torch's) left out."""
    out: dict = defaultdict(int)
    for m in back.moves:
        if m.direction == direction and not m.kernel.endswith("prepass lists"):
            out[m.tensor] += m.bytes
    return dict(out)


def triton_launches(back) -> int:
    """The backward's Triton launches: its kernels less the prepasses' lists."""
    return sum(not k.endswith("prepass lists") for k in back.kernels)


def without_tensors(counts, *names) -> dict:
    """Bytes per tensor less ``names`` and the zeros."""
    return {k: v for k, v in counts.items() if k not in names and v}

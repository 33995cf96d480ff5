"""What the checker's tests share (tests/test_check.py, test_check_schedule.py):
a diagram's head and a FlashAttention schedule and body, the checker's
errors for a text, and where a snippet or a diagnostic sits."""
from __future__ import annotations

from napkin.check import check
from napkin.parse import parse

HEAD = """diagram t
wire b, h, q, x
wire d = 64
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
"""
FLASH = """
schedule on h100 {
  level hbm { hold Q, K, V, O }
  level smem {
    group b by 1, h by 1, q by 128
    stream x by 64
  }
}
"""
ATTENTION = """S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
P[b, h, q, x] = softmax[x](S)
O[b, h, q, d] : fp16 = sum[x](P * V)
out O
"""


def errors(text: str):
    return check(parse(text, "t.ncd"))


def one(text: str):
    found = errors(text)
    assert len(found) == 1, [d.message for d in found]
    return found[0]


def pos(text: str, snippet: str, nth: int = 0) -> tuple[int, int]:
    """1-based (line, col) of the nth occurrence of snippet in text."""
    at = -1
    for _ in range(nth + 1):
        at = text.index(snippet, at + 1)
    line = text.count("\n", 0, at) + 1
    return line, at - (text.rfind("\n", 0, at) + 1) + 1


def where(diag) -> tuple[int, int]:
    return diag.loc.line, diag.loc.col

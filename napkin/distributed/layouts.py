"""Token layouts: which global token positions each of P devices holds.

A layout deals the N tokens of a sequence wire (q or x) to P parts.  When N is
not a multiple of what the layout needs, the sequence is padded at the end:
positions >= N are padding.  Every part holds the same number of rows
(``rows``), so every collective moves equal-sized blocks, and the padded rows
are zeros on the way in and are dropped on the way out.  The attention
wrappers mask padded keys and zero padded query rows, so padding is never
silently counted as data.

* cyclic: token t lives on part t mod P (ATTENTION2D).  Under a causal mask
  every part then holds early and late queries alike, so the work is balanced
  without any reordering.
* zigzag: the padded sequence is cut into 2P chunks and part p holds chunks p
  and 2P-1-p (Ring Attention's causal balance: an early chunk and a late one).
* contiguous: part p holds one block of ceil(N/P) consecutive tokens (plain
  sequence parallelism; unbalanced under a causal mask).

Positions are int64 tensors; ``shard`` and ``unshard`` are single-process
helpers (cut a full tensor, put the parts back together); the wrappers in
attention2d.py and ring.py gather distributed parts with collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .. import ir

KINDS = ir.LAYOUTS     # the words a diagram's across tiles may name, one list


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TokenLayout:
    """``length`` tokens dealt to ``parts`` devices in the ``kind`` layout."""

    kind: str
    parts: int
    length: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown token layout {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.parts < 1:
            raise ValueError(f"a layout needs at least one part, not {self.parts}")
        if self.length < 1:
            raise ValueError(f"a sequence needs at least one token, not {self.length}")

    # -- sizes ---------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Rows every part holds, padding included."""
        if self.kind == "zigzag":
            return 2 * self.chunk
        return _ceil_div(self.length, self.parts)

    @property
    def chunk(self) -> int:
        """zigzag only: the size of each of the 2P chunks."""
        return _ceil_div(self.length, 2 * self.parts)

    @property
    def padded(self) -> int:
        """The padded sequence length, ``rows * parts``."""
        return self.rows * self.parts

    # -- positions -----------------------------------------------------------
    def positions(self, part: int, device=None) -> torch.Tensor:
        """Global positions of the rows ``part`` holds, in storage order.
        Entries >= ``length`` are padding."""
        if not 0 <= part < self.parts:
            raise ValueError(f"part {part} is outside 0..{self.parts - 1}")
        if self.kind == "cyclic":
            pos = torch.arange(self.rows, device=device) * self.parts + part
        elif self.kind == "contiguous":
            pos = torch.arange(self.rows, device=device) + part * self.rows
        else:
            c = self.chunk
            first = torch.arange(c, device=device) + part * c
            second = torch.arange(c, device=device) + (2 * self.parts - 1 - part) * c
            pos = torch.cat([first, second])
        return pos

    def all_positions(self, device=None) -> torch.Tensor:
        """Positions of every part, concatenated in part order: what an
        all-gather over all parts holds, row for row."""
        return torch.cat([self.positions(p, device) for p in range(self.parts)])

    # -- single-process shard / unshard ----------------------------------------
    def shard(self, full: torch.Tensor, part: int, dim: int) -> torch.Tensor:
        """The rows of ``full`` (``length`` rows along ``dim``) that ``part``
        holds; padded rows are zeros."""
        if full.shape[dim] != self.length:
            raise ValueError(f"expected {self.length} tokens along dim {dim}, got shape {tuple(full.shape)}")
        return take_rows(full, self.positions(part, full.device), self.length, dim)

    def shards(self, full: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return [self.shard(full, p, dim) for p in range(self.parts)]

    def unshard(self, parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """The full tensor back from every part's rows (given in part order);
        padding is dropped."""
        if len(parts) != self.parts:
            raise ValueError(f"expected {self.parts} parts, got {len(parts)}")
        return from_rows(torch.cat(list(parts), dim), self.all_positions(parts[0].device), self.length, dim)


def take_rows(full: torch.Tensor, pos: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``full`` read at positions ``pos`` along ``dim``; zeros where pos >= length."""
    valid = pos < length
    rows = full.index_select(dim, pos.clamp(max=length - 1))
    shape = [1] * full.dim()
    shape[dim] = pos.numel()
    return torch.where(valid.view(shape), rows, torch.zeros((), dtype=full.dtype, device=full.device))


def from_rows(rows: torch.Tensor, pos: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Inverse of ``take_rows`` over a complete set of positions: sort the rows
    by position and keep the first ``length`` (padding sorts last)."""
    order = torch.argsort(pos, stable=True)[:length]
    return rows.index_select(dim, order.to(rows.device))


def scheme_layout(scheme: str, parts: int, length: int) -> TokenLayout:
    """The layout each scheme uses: cyclic for ATTENTION2D, zigzag for Ring."""
    if scheme == "attention2d":
        return TokenLayout("cyclic", parts, length)
    if scheme == "ring":
        return TokenLayout("zigzag", parts, length)
    raise ValueError(f"unknown scheme {scheme!r}; expected 'attention2d' or 'ring'")

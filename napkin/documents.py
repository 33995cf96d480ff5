"""Document masks priced on document lengths: ``--docs`` of napkin cost, plan, report and render.

A mask that compares ids at the query and at the key, ``doc[b, q] == doc``
of packed sequences, has no formula for the blocks it keeps: the kernels
find them at run time with the ranges prepass (codegen/ranges.py), and Ring
Attention reads the ids at each call to cut its steps (distributed/ring.py).
Without the data the cost pass can only count every block and every step.
Given the documents' lengths (the same in every batch row, each document's
tokens contiguous, as packing lays them out) it counts what the kernels and
the ring will do on such ids:

* ``id_conjuncts``: the conjuncts ``A[.., q, ..] == A[.., x, ..]`` of a
  mask's predicate (one input read at the query and at the key, the same
  elsewhere); distributed/reach.py's ``same_ids`` is this one over a ring's
  roles.
* ``row_spans``: per row block, the [first, stop) key blocks the prepass
  finds live (first to last block holding a kept pair), the mask's affine
  conjuncts (``x <= q``, a window) included, which the kernels' loop then
  visits; ``column_spans`` the same seen from the key blocks (dK/dV).
* ``ring_meets``: whether two chunks of a ring's token shards share a
  document, the test RingAttention makes from the ids (ring.id_meets), for
  reach.ring_schedule; ``ShardPairs``, the pairs the mask keeps, in all
  and per device in each scheme's token layout (napkin plan times each
  step at its busiest device).

The spans are exact where the mask's other conjuncts are all bounds the
kernels' loops read (masks.stream_bounds: x against q plus a constant or a
chunk's floor, as causal masks, windows and chunks are), rows that keep
nothing included: a row block's live keys are then one run per document,
bounded as a block of rows is (visits.stream_range).  Any other conjunct
(``2 * x <= q``, an ``or``) is left out, so the spans are an upper bound of
the blocks the prepass, which evaluates it, finds.  tests/test_documents.py
holds them to the prepass's own numbers and to the bytes the kernels move.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

from . import ir, masks, visits
from .errors import NapkinError


@dataclass(frozen=True)
class SameIds:
    """A conjunct ``A[.., q, ..] == A[.., x, ..]`` of a mask's predicate:
    an input read at the query and at the key, the same elsewhere."""
    name: str        # the input holding the ids
    axis: int        # its dimension the query and the key index
    batch: tuple     # the wires of its other dimensions, in order


def id_conjuncts(diagram: ir.Diagram, pred: Optional[ir.Expr], query: str, key: str,
                 names: Sequence[str]) -> tuple[SameIds, ...]:
    """The conjuncts of ``pred`` comparing ids of an input in ``names`` at
    the query and at the key.  Only an input whose every stored dimension is
    one wire (an id per token, not a merged ``(h q)``), read with the query
    and the key at the same dimension and the same wires elsewhere."""
    out = []
    for c in masks.conjuncts(pred) if pred is not None else ():
        if not (isinstance(c, ir.Binary) and c.op == "==" and isinstance(c.lhs, ir.TensorRef)
                and isinstance(c.rhs, ir.TensorRef) and c.lhs.name == c.rhs.name and c.lhs.name in names
                and c.lhs.steps is None and c.rhs.steps is None):   # ids at blocks (doc[b, q // 64]): no tokens'
            continue
        decl = diagram.tensor(c.lhs.name)
        if any(len(axis) != 1 for axis in decl.axes):
            continue
        declared = ir.axis_wires(decl.axes)
        a, b = (n.wires if n.wires is not None else declared for n in (c.lhs, c.rhs))
        differ = [k for k in range(len(a)) if a[k] != b[k]]
        if len(differ) == 1 and {a[differ[0]], b[differ[0]]} == {query, key} \
                and not {query, key} & {a[k] for k in range(len(a)) if k != differ[0]}:
            k = differ[0]
            out.append(SameIds(c.lhs.name, k, a[:k] + a[k + 1:]))
    return tuple(out)


def id_wire(diagram: ir.Diagram, same: SameIds) -> str:
    """The wire the ids input is declared along at the compared dimension:
    the tokens the documents cover."""
    return ir.axis_wires(diagram.tensor(same.name).axes)[same.axis]


def covered(docs: "Documents", diagram: ir.Diagram, same: SameIds, sizes) -> int:
    """The tokens the ids cover (|wire| of id_wire), the documents' lengths
    checked against it: a NapkinError naming the wire where they differ."""
    wire = id_wire(diagram, same)
    docs.starts(sizes[wire], wire=wire)
    return sizes[wire]


# --------------------------------------------------------------------------
# The lengths.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Documents:
    """Packed documents, the same in every batch row: ``lengths`` in order,
    or documents of ``every`` tokens each, the last cut where the tokens end."""
    lengths: tuple[int, ...] = ()
    every: Optional[int] = None

    @staticmethod
    def parse(text: str, flag: str = "--docs") -> "Documents":
        """``512`` (documents of 512 tokens) or ``1000,3000,4192`` (their
        lengths in order, adding up to the tokens)."""
        items = [t.strip() for t in text.split(",")]
        for t in items:
            if not t.isdigit() or int(t) <= 0:
                raise NapkinError(f"{flag}: {t!r} is not a positive whole number of tokens "
                                  f"(give a length, 512, or the lengths in order, 1000,3000,4192)")
        values = tuple(int(t) for t in items)
        return Documents(every=values[0]) if len(values) == 1 else Documents(lengths=values)

    def starts(self, n: int, flag: str = "--docs", wire: str = "") -> list[int]:
        """Each document's first position, then ``n``: document k holds
        [starts[k], starts[k + 1])."""
        if self.every is not None:
            return list(range(0, n, self.every)) + [n]
        total = sum(self.lengths)
        if total != n:
            where = f"|{wire}| = {n}" if wire else f"{n}"
            raise NapkinError(f"{flag}: the lengths add up to {total:,} tokens, but the ids cover {where}")
        out = [0]
        for length in self.lengths:
            out.append(out[-1] + length)
        return out

    def cut(self, n: int, flag: str = "--docs") -> list[int]:
        """starts() of the first ``n`` tokens: the documents up to there, the
        last cut short (napkin bench's shorter runs and checks)."""
        if self.every is not None or sum(self.lengths) == n:
            return self.starts(n, flag)
        if sum(self.lengths) < n:
            raise NapkinError(f"{flag}: the lengths add up to {sum(self.lengths):,} tokens, fewer than the {n:,} "
                              "a run holds")
        out = [0]
        for length in self.lengths:
            if out[-1] + length >= n:
                break
            out.append(out[-1] + length)
        return out + [n]

    def describe(self, n: int) -> str:
        """In words, for notes: '16 documents of 512 tokens'."""
        if self.every is not None:
            count, last = -(-n // self.every), n % self.every
            if count == 1:
                return f"1 document of {n} tokens"
            cut = f", the last of {last}" if last else ""
            return f"{count} documents of {self.every} tokens{cut}"
        shown = ", ".join(str(x) for x in self.lengths[:6]) + (", ..." if len(self.lengths) > 6 else "")
        return f"{len(self.lengths)} documents of {shown} tokens"


def add_docs_option(parser) -> None:
    """--docs of napkin cost, plan, report and render (Documents.parse reads it)."""
    parser.add_argument(
        "--docs", default=None, metavar="LENGTHS",
        help="a mask comparing ids (doc[b, q] == doc) read on packed documents of these lengths, the same in "
             "every batch row: N (each N tokens, the last cut short) or N1,N2,... (in order, adding up to the "
             "tokens); counts the blocks the kernels and the steps the ring keep")


# --------------------------------------------------------------------------
# The blocks the ranges prepass keeps.
# --------------------------------------------------------------------------

def _key_range(starts: list[int], bounds, first: int, stop: int, cols: int, sizes) -> Optional[tuple[int, int]]:
    """[lo, hi) of the keys some row of positions [first, stop) keeps: per
    document the rows hold, the keys of that document within the affine
    bounds of those rows."""
    lo, hi = cols, 0
    k = bisect.bisect_right(starts, first) - 1
    while k < len(starts) - 1 and starts[k] < stop:
        a, b = max(first, starts[k]), min(stop, starts[k + 1])
        start, end = visits.stream_range(bounds, a, b, cols, sizes)
        start, end = max(start, starts[k]), min(end, starts[k + 1], cols)
        if start < end:
            lo, hi = min(lo, start), max(hi, end)
        k += 1
    return (lo, hi) if lo < hi else None


def row_spans(docs: Documents, bounds, row_size: int, col_size: int, block_row: int, block_col: int,
              sizes, ids_length: int, cycle: Optional[int] = None) -> tuple[tuple[int, int], ...]:
    """Per row block, the [first, stop) key blocks from its first to its last
    live one ((0, 0) for none): what the ranges prepass writes and the
    kernels' loop visits, but for the dead runs row_visits gives too.
    ``bounds``: the mask's affine conjuncts (masks.Bound); ``ids_length``:
    the tokens the ids cover; ``cycle``: packed rows, |q| rows a head
    (``row_size`` = |g||q|)."""
    return row_visits(docs, bounds, row_size, col_size, block_row, block_col, sizes, ids_length, cycle)[0]


def row_visits(docs: Documents, bounds, row_size: int, col_size: int, block_row: int, block_col: int,
               sizes, ids_length: int, cycle: Optional[int] = None):
    """(spans, holes): row_spans' spans and, per row block, the runs of dead
    key blocks between live ones (() for none), which the kernels' lists
    leave out.  Consecutive rows of contiguous documents meet one run
    of keys; a block of packed rows (one per head at a few queries) may meet
    two documents apart."""
    starts = docs.starts(ids_length)

    def runs(i):
        for a, b in visits.rows_of_block(i, block_row, row_size, cycle):
            if (r := _key_range(starts, bounds, a, b, col_size, sizes)) is not None:
                yield r[0] // block_col, -(-r[1] // block_col)

    return visits.prepass_blocks(runs, -(-row_size // block_row))


def row_full(docs: Documents, bounds, row_size: int, col_size: int, block_row: int, block_col: int,
             sizes, ids_length: int, cycle: Optional[int] = None, whole_rows: bool = False):
    """Per row block, the runs of key blocks the ranges prepass finds full on
    these documents (visits.full_runs): each row's keys, its document's
    within the affine bounds (row_intervals), every one of them kept."""
    lo, hi = row_intervals(docs, bounds, cycle or row_size, col_size, sizes, ids_length)

    def kept(rows):
        pos = rows if cycle is None else rows % cycle
        return lo[pos], hi[pos] - 1
    return visits.full_runs(kept, row_size, block_row, block_col, col_size, whole_rows)


def column_spans(spans: Sequence[tuple[int, int]], col_blocks: int) -> tuple[tuple[int, int], ...]:
    """Per key block, the [first, stop) row blocks whose span holds it (the
    dK/dV kernels' loop, the prepass run by column): the first and the last
    row block covering each key block, each found once by skipping the key
    blocks already claimed (a pointer per block, path-halved)."""
    def firsts(order) -> list[Optional[int]]:
        got: list[Optional[int]] = [None] * col_blocks
        nxt = list(range(col_blocks + 1))

        def find(j: int) -> int:
            while nxt[j] != j:
                nxt[j] = nxt[nxt[j]]
                j = nxt[j]
            return j
        for i in order:
            a, b = spans[i]
            j = find(min(a, col_blocks))
            while j < min(b, col_blocks):
                got[j] = i
                nxt[j] = j + 1
                j = find(j + 1)
        return got
    lo = firsts(range(len(spans)))
    hi = firsts(range(len(spans) - 1, -1, -1))
    return tuple((a, b + 1) if a is not None else (0, 0) for a, b in zip(lo, hi))


def row_intervals(docs: Documents, bounds, q_len: int, x_len: int, sizes, ids_length: int):
    """(lo, hi) numpy arrays: query q keeps the keys [lo[q], hi[q]), those of
    its document within its affine bounds (lo = hi: none; bound_interval)."""
    import numpy as np

    starts = np.array(docs.starts(ids_length), dtype=np.int64)
    q = np.arange(q_len, dtype=np.int64)
    k = np.minimum(np.searchsorted(starts, q, side="right") - 1, len(starts) - 2)
    lo, hi = starts[k], np.minimum(starts[k + 1], x_len)
    hi = np.where(q < ids_length, hi, lo)     # a row past the ids: no document, no key
    return bound_interval(bounds, q, lo, hi, sizes)


def bound_interval(bounds, q, lo, hi, sizes):
    """(lo, hi) arrays: rows ``q``'s keys [lo, hi) narrowed by a conjunction
    of affine bounds on the key (masks.Bound: a lower bound raises lo, an
    upper one lowers hi), hi never below lo.  Each bound is evaluated on every
    row at once (masks.Bound.value takes arrays)."""
    import numpy as np

    for b in bounds:
        value = b.value(q, sizes)
        if b.kind == "lower":
            lo = np.maximum(lo, value)
        else:
            hi = np.minimum(hi, value + 1)
    return lo, np.maximum(hi, lo)


def _below_each(np, ends, edges):
    """How many of the sorted ``ends`` lie below each of the sorted
    ``edges`` (np.searchsorted(ends, edges)), searched the cheaper way round:
    plan at thousands of ranks asks it of one rank's 128 rows at 16K edges,
    where placing each end among the edges and counting them up is far
    cheaper than searching each edge among the ends."""
    if len(ends) >= len(edges):
        return np.searchsorted(ends, edges, side="left")
    at = np.searchsorted(edges, ends, side="right")    # an end lies below edges[k] for every k >= at
    return np.cumsum(np.bincount(at, minlength=len(edges) + 1))[:len(edges)]


class ShardPairs:
    """The pairs a mask keeps, counted per device in each scheme's token
    layout (napkin plan on documents: a step of a scheme waits for its
    busiest device, and a long document's devices work while the others
    wait; bench/cp_bench.py on the LCA benchmark's masks).  Built from the
    keys each query row keeps, a union of disjoint intervals [lo, hi) given
    as (lo, hi) arrays, one pair per interval (``on_documents``: one, by
    row_intervals).  Each count is O(rows + P) or O(rows log rows + P^2)
    numpy; ring_steps holds no P x P table, so 8,192 devices cost seconds."""

    def __init__(self, q_len: int, x_len: int, intervals):
        import numpy as np

        self.q_len, self.x_len = q_len, x_len
        self.intervals = tuple((np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64))
                               for lo, hi in intervals)
        self.total = int(sum((hi - lo).sum() for lo, hi in self.intervals))
        self._np = np
        self._memo: dict = {}    # each count once: plan prices several options on one

    @staticmethod
    def on_documents(docs: Documents, bounds, q_len: int, x_len: int, sizes, ids_length: int) -> "ShardPairs":
        """The pairs a document mask keeps on these documents (row_intervals)."""
        return ShardPairs(q_len, x_len, [row_intervals(docs, bounds, q_len, x_len, sizes, ids_length)])

    # -- the keys some rows keep, in runs of positions or by residue ----------
    def _below(self, rows, edges):
        """F(E) at each edge: the kept pairs of ``rows`` whose key is below E
        (sum over rows of |[lo, hi) & [0, E)|), from the sorted ends and
        their prefix sums: rows with lo < E add E - lo, those with hi < E
        give back E - hi."""
        np = self._np
        out = np.zeros(len(edges), dtype=np.int64)
        for lo, hi in self.intervals:
            for ends, sign in ((lo[rows], 1), (hi[rows], -1)):
                ends = np.sort(ends)
                prefix = np.concatenate([[0], np.cumsum(ends)])
                n = _below_each(np, ends, edges)
                out += sign * (n * edges - prefix[n])
        return out

    def _by_residue(self, rows, m: int, group=None, groups: int = 1):
        """[g, j]: the kept pairs of the rows in group g (``group``, one per
        row of ``rows``; all in group 0 without it) whose key is j modulo m.
        Each row's L = hi - lo keys hold L // m of every residue and one
        more of the L % m residues from lo's on: a difference array per
        group, the wrapping ones split in two."""
        return sum(self._residues(lo[rows], hi[rows], m, group, groups) for lo, hi in self.intervals)

    def _residues(self, lo, hi, m: int, group, groups: int):
        np = self._np
        length = hi - lo
        group = np.zeros(len(lo), dtype=np.int64) if group is None else group
        first = lo % m
        stop = first + length % m
        wraps = stop > m
        width = m + 1

        def count(g, j):        # how many (group, residue) pairs fall at each cell
            return np.bincount(g * width + j, minlength=groups * width).reshape(groups, width)
        diff = count(group, first) - count(group, np.where(wraps, m, stop)) \
            + count(group[wraps], np.zeros(int(wraps.sum()), dtype=np.int64)) - count(group[wraps], stop[wraps] - m)
        base = np.bincount(group, weights=length // m, minlength=groups).astype(np.int64)
        return np.cumsum(diff[:, :m], axis=1) + base[:, None]

    def _query_rows(self, kind: str, parts: int, part: int):
        np = self._np
        if kind == "cyclic":
            return np.arange(part, self.q_len, parts)
        runs = _part_runs(kind, parts, self.q_len, part)
        return np.concatenate([np.arange(a, b) for a, b in runs]) if runs else np.zeros(0, dtype=np.int64)

    def key_parts(self, rows, kind: str, parts: int):
        """W[b]: the pairs ``rows`` (indices into this count's rows) keep with
        part b's keys, in the ``kind`` layout of ``parts`` (a rank's row of
        part_pairs; ring_steps_at counts a rank at a time with it)."""
        np = self._np
        if kind == "cyclic":
            return self._by_residue(rows, parts)[0]
        # contiguous shards are runs of `size` keys; zigzag's parts hold chunks b and 2P - 1 - b
        runs = parts if kind == "contiguous" else 2 * parts
        size = -(-self.x_len // runs)
        edges = np.minimum(np.arange(runs + 1, dtype=np.int64) * size, self.x_len)
        per_run = np.diff(self._below(rows, edges))
        return per_run if kind == "contiguous" else per_run[:parts] + per_run[::-1][:parts]

    # -- per scheme ------------------------------------------------------------
    def ring_steps(self, kind: str, parts: int, nodes: int = 1, queries: bool = False) -> tuple[int, ...]:
        """steps[s]: the most pairs any rank keeps at step s of the ring, the
        blocks it holds then those of rank ``origin(r, s)``: a flat ring's
        r - s (s = 0: its own; the other way round, step t brings rank r +
        t's, which is steps[P - t]); a double ring of ``nodes`` x P / nodes
        works through the node o before it in round o (distributed/groups.py's
        ring_origin, which the tests hold this to).  The key blocks travel
        (rank r's queries against origin's keys), or with ``queries`` the
        query blocks (BurstAttention's backward over the whole ring: rank r's
        keys against origin's queries)."""
        key = ("ring", kind, parts, nodes, queries)
        if key not in self._memo:
            # one pass over the ranks fills the flat ring's and this double ring's, both ways
            # (plan asks for all of them: Ring, Burst, the double rings)
            np = self._np
            shapes = sorted({1, nodes})
            outs = {(n, qs): np.zeros(parts, dtype=np.int64) for n in shapes for qs in (False, True)}
            for a in range(parts):
                w = self.key_parts(self._query_rows(kind, parts, a), kind, parts)
                for n in shapes:
                    # steps and ranks as (node o, place i), s = o * per_node + i; rolls (contiguous
                    # copies), not gathers through index arrays: at 8192 ranks this loop was 7 s
                    per_node = parts // n
                    node, local = divmod(a, per_node)
                    grid = w.reshape(n, per_node)
                    # step (o, i): rank a holds the keys of origin(a, s), rank ((node - o) % n, (local - i) % per_node)
                    np.maximum(outs[n, False], np.roll(grid[::-1, ::-1], (node + 1, local + 1), (0, 1)).ravel(),
                               out=outs[n, False])
                    # rank b = (o, i) holds a's queries at step ((o - node) % n, (i - local) % per_node)
                    np.maximum(outs[n, True], np.roll(grid, (-node, -local), (0, 1)).ravel(), out=outs[n, True])
            for (n, qs), out in outs.items():
                self._memo["ring", kind, parts, n, qs] = tuple(int(v) for v in out)
        return self._memo[key]

    def part_pairs(self, kind: str, parts: int):
        """W[a, b]: the pairs rank a's queries keep with rank b's keys, both in
        the ``kind`` layout (a P x P table: for reports on a few ranks)."""
        return self._np.array([self.key_parts(self._query_rows(kind, parts, a), kind, parts)
                               for a in range(parts)])

    def grid_pairs(self, rows: int, cols: int):
        """ATTENTION2D on an R x C grid, [i, j]: the pairs device (i, j) keeps.
        It holds part iC + j of the P = RC cyclic parts and computes the
        queries of its grid row's parts (positions t with (t mod P) // C = i)
        against the keys of its column's (t = j modulo C)."""
        t = self._np.arange(self.q_len)
        return self._by_residue(t, cols, (t % (rows * cols)) // cols, rows)

    def grid_busiest(self, rows: int, cols: int) -> int:
        """The most pairs any device of the R x C grid keeps (grid_pairs)."""
        if ("grid", rows, cols) not in self._memo:
            self._memo["grid", rows, cols] = int(self.grid_pairs(rows, cols).max())
        return self._memo["grid", rows, cols]

    def tree_busiest(self, parts: int) -> int:
        """Decoding's tree: every query on every device, the keys in
        contiguous shards; the most pairs any device keeps."""
        return int(self.key_parts(self._np.arange(self.q_len), "contiguous", parts).max())


def ring_steps_at(keeps, kind: str, parts: int, q_len: int, x_len: int, offsets,
                  most: Optional[int] = None) -> tuple[int, ...]:
    """ShardPairs.ring_steps at the flat ring's steps holding the keys of
    rank r - d, for each offset d (mod P), in the ``kind`` layout (a ring
    cut short), where the rows' kept keys come from ``keeps(q)`` (the
    [lo, hi) arrays of rows ``q``, a union, one pair an interval) rather
    than arrays over every row.  ``most``: count at most that many ranks,
    the first and last quarter of them and the rest spread evenly, where
    there are more (napkin plan at 32,768 devices of 8,192 tokens: 2^28
    rows); a mask of bounds treats every rank alike but near the ends.
    O(ranks counted x (rows a rank log rows + P))."""
    import numpy as np

    ranks = np.arange(parts)
    if most is not None and parts > most:
        edge = most // 4
        ranks = np.unique(np.concatenate([ranks[:edge], ranks[-edge:],
                                          np.linspace(0, parts - 1, most - 2 * edge).round().astype(np.int64)]))
    out = [0] * len(offsets)
    for a in ranks:
        rows = np.arange(a, q_len, parts) if kind == "cyclic" else \
            np.concatenate([np.arange(lo, hi) for lo, hi in _part_runs(kind, parts, q_len, int(a))] or
                           [np.zeros(0, dtype=np.int64)])
        # the rank's rows as a ShardPairs of their own: its pairs with every part's keys
        mine = ShardPairs(len(rows), x_len, keeps(rows.astype(np.int64)))
        w = mine.key_parts(np.arange(len(rows)), kind, parts)
        for i, d in enumerate(offsets):
            out[i] = max(out[i], int(w[(a - d) % parts]))
    return tuple(out)


# --------------------------------------------------------------------------
# The ring: which chunks of its shards share a document.
# --------------------------------------------------------------------------

def _part_runs(kind: str, parts: int, length: int, part: int) -> list[tuple[int, int]]:
    """The positions a part holds, as runs [first, stop), in layouts.py's
    arithmetic (contiguous shards, or zigzag's two chunks of 2P); not cyclic."""
    if kind == "contiguous":
        rows = -(-length // parts)
        runs = [(part * rows, (part + 1) * rows)]
    else:
        c = -(-length // (2 * parts))
        runs = [(part * c, (part + 1) * c), ((2 * parts - 1 - part) * c, (2 * parts - part) * c)]
    return [(a, min(b, length)) for a, b in runs if a < length]


def layout_chunks(kind: str, parts: int, length: int) -> list[tuple[int, int, int]]:
    """A contiguous or zigzag layout as runs of consecutive positions, in
    token order: (the part holding it, first, stop), the runs holding real
    tokens (a prefix: padding is at the end).  Contiguous shards are P runs,
    zigzag's 2P chunks (chunk m on part m, or 2P - 1 - m from P on); these
    are the units reach.py tests pairs of.  Not cyclic."""
    runs = parts if kind == "contiguous" else 2 * parts
    size = -(-length // runs)
    return [(m if m < parts else 2 * parts - 1 - m, m * size, min((m + 1) * size, length))
            for m in range(runs) if m * size < length]


def _cyclic_documents(starts: list[int], parts: int, length: int) -> list[set[int]]:
    """The documents each cyclic part's tokens (positions below ``length``)
    meet: part p holds p, p + P, ..., so a document of P tokens or more meets
    every part."""
    out: list[set[int]] = [set() for _ in range(parts)]
    for k in range(len(starts) - 1):
        a, b = starts[k], min(starts[k + 1], length)
        for pos in range(a, min(b, a + parts)):
            out[pos % parts].add(k)
    return out


class RingMeets:
    """reach.Meets on documents: whether unit u's queries and unit v's keys
    share a document (``meets(u, v)``).  The units are reach.py's: a
    contiguous or zigzag layout's chunks (layout_chunks), cyclic's ranks.  A
    chunk's tokens are consecutive, so its documents are a run [first,
    last]: two chunks meet where their runs overlap, and the key chunks
    meeting a query chunk are a run of them too (``run``), which lets
    reach._chunk_offsets mark them at once rather than test every pair (at
    8,192 devices those tests were most of napkin plan --docs' time,
    cProfile: 12.5 of 16.4 s).  A cyclic rank's documents are a set."""

    def __init__(self, queries: list, keys: list, chunks: bool):
        self._queries, self._keys = queries, keys
        self.run = None
        if chunks:
            self._first, self._last = [k[0] for k in keys], [k[1] for k in keys]
            self.run = self._run

    def __call__(self, u: int, v: int) -> bool:
        if self.run is None:
            return not self._queries[u].isdisjoint(self._keys[v])
        (a, b), (c, d) = self._queries[u], self._keys[v]
        return a <= d and c <= b

    def _run(self, u: int) -> Optional[tuple[int, int]]:
        """[j0, j1]: the key chunks meeting chunk u's queries (None: none).
        Their first and last documents grow with the chunk: those ending at
        or after u's first document and starting at or before its last."""
        first, last = self._queries[u]
        j0 = bisect.bisect_left(self._last, first)
        j1 = bisect.bisect_right(self._first, last) - 1
        return (j0, j1) if j0 <= j1 else None


def ring_meets(docs: Documents, kind: str, parts: int, q_len: int, x_len: int, ids_length: int) -> RingMeets:
    """reach.Meets on these documents: whether unit u's queries and unit v's
    keys share a document, in the ``kind`` token layout (RingMeets)."""
    starts = docs.starts(ids_length)
    if kind == "cyclic":
        return RingMeets(_cyclic_documents(starts, parts, q_len), _cyclic_documents(starts, parts, x_len), False)

    def runs(length: int) -> list[tuple[int, int]]:
        return [(bisect.bisect_right(starts, a) - 1, bisect.bisect_right(starts, b - 1) - 1)
                for _, a, b in layout_chunks(kind, parts, length)]
    return RingMeets(runs(q_len), runs(x_len), True)

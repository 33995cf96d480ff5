"""The kernels' blocks are level smem's (napkin/codegen/lower.py
_kernel_level, _refuse_off_smem, _refuse_unsplit).

The checker and the cost pass count a kernel's programs at level smem (its
groups are the grid), while codegen once took each wire's innermost tile: a
level regs inside smem re-blocked the kernels behind the cost report's back
(regs 'group q by 64' under smem 'q by 128': 64-row programs, priced as
q/128).  Now codegen reads no tile inside smem, and one there that differs
from smem's is refused at its line:column; one equal to smem's changes
nothing.  A schedule whose smem tiles nothing (or has no smem) keeps its
tiled regs as the kernel level, as the cost pass does (cost/model.chip_levels).
"""
from __future__ import annotations

import pytest

import napkin
import kernel_helpers as K
from napkin.codegen import emit_module, lower
from napkin.cost import analyse, model
from napkin.errors import NapkinError
from test_check import errors, pos

EXAMPLES = K.REPO / "examples"
SMEM = """  level smem {
    group b by 1, h by 1, q by 128
    stream x by 64
    hold S, P
  }"""


def with_regs(name: str, regs: str, smem: str = SMEM) -> str:
    """examples/NAME.ncd with a level regs of body ``regs`` after its level
    smem (that of causal.ncd replaced by ``smem``)."""
    text = (EXAMPLES / f"{name}.ncd").read_text()
    if smem != SMEM:
        assert SMEM in text
        text = text.replace(SMEM, smem)
    end = text.index("\n  }", text.index("level smem {")) + len("\n  }")
    return text[:end] + f"\n  level regs {{ {regs} }}" + text[end:]


def emit(text: str) -> str:
    return emit_module(napkin.load_text(text, "t.ncd"), source_text=text, source_path="t.ncd")


def refusal(text: str):
    with pytest.raises(NapkinError) as e:
        emit(text)
    (diag,) = e.value.diagnostics
    return diag


NO_Q = SMEM.replace("h by 1, q by 128", "h by 1")


@pytest.mark.parametrize("name, regs, smem, there", [
    ("causal", "group q by 64", SMEM, "groups q by 128"),        # 64-row programs, priced as q/128
    # (a regs block larger than smem's, q by 256, is the checker's: test_check.py)
    ("causal", "stream x by 32", SMEM, "streams x by 64"),
    ("causal", "group x by 64", SMEM, "streams x by 64"),        # another kind than smem's
    ("causal", "group d by 16", SMEM, "does not group d"),       # the kernels hold d whole
    ("attention", "group q by 64", SMEM, "groups q by 128"),
    ("matmul", "group m by 64", SMEM, "groups m by 128"),
    ("matmul", "stream k by 16", SMEM, "streams k by 32"),
    ("causal", "group q by 64", NO_Q, "does not group q"),       # codegen's default block is no schedule's
    ("causal", "group q by 1", NO_Q, "does not group q"),        # one row per program it would be
    ("causal", "group b by 1, h by 1, q by 128, d by 16", SMEM, "does not group d"),  # the first that differs
    ("flash_decoding", "stream x by 32", SMEM, "streams x by 64 in chunks of 1024"),
], ids=["q64", "x32", "group-x", "d16", "attention-q64", "matmul-m64", "matmul-k16", "no-q-64", "no-q-1",
        "among-equal", "chunked"])
def test_a_regs_tile_other_than_smems_is_refused_at_it(name, regs, smem, there):
    text = with_regs(name, regs, smem)
    assert errors(text) == []                    # the checker passes it: the refusal is codegen's
    kind = regs.split()[0]
    wire, _, size = regs.split(", ")[-1].split()[-3:]
    tile = f"{kind} {wire} by {size}"
    diag = refusal(text)
    assert diag.message == (f"napkin cannot emit a kernel for '{tile}': the kernels' blocks are level smem's (its "
                            f"groups are the grid's programs, as the checker and the cost pass count them), and "
                            f"level smem {there}; a {kind} of {wire} in level regs would give the kernels other "
                            f"blocks than that level's")
    own = "" if there.startswith("does not") else f" in place of '{there.split()[0][:-1]} {wire} by " \
        f"{there.split()[3]}'"
    assert diag.hint == f"drop '{tile}' from level regs, or {tile} in level smem{own}"
    assert (diag.loc.line, diag.loc.col) == pos(text, f"{wire} by {size} }}")
    d = napkin.load_text(text, "t.ncd")
    assert lower.streamed_attention(d) is None   # nor does the cost pass read a launch from it


def without_hash(module: str, text: str) -> str:
    """The module less what depends on the source text alone: its sha256
    (header, SOURCE_HASH, op names) and the cost summary's smem/regs line."""
    import hashlib
    digest = hashlib.sha256(text.encode()).hexdigest()
    lines = module.replace(digest, "HASH").replace(digest[:8], "HASH").splitlines()
    return "\n".join(ln for ln in lines if not ln.lstrip().startswith("smem/regs traffic:"))


@pytest.mark.parametrize("name, regs, smem", [
    ("causal", "group b by 1, h by 1, q by 128\n    stream x by 64", SMEM),
    ("attention", "group q by 128", SMEM),
    ("matmul", "group m by 128, n by 128\n    stream k by 32", SMEM),
    ("causal", "group h by 1", SMEM.replace("b by 1, h by 1, ", "b by 1, ")),  # a batch wire: a program per h
    # packed and chunked (the packed groups, short of 16, the checker allows in smem alone)
    ("flash_decoding", "group b by 1, hk by 1\n    stream x by 64", SMEM),
], ids=["causal", "attention", "matmul", "batch-by-1", "chunked"])
def test_a_regs_tile_equal_to_smems_changes_nothing(name, regs, smem):
    base = (EXAMPLES / f"{name}.ncd").read_text()
    if smem != SMEM:
        base = base.replace(SMEM, smem)
    text = with_regs(name, regs, smem)
    assert errors(text) == [] and text != base
    assert without_hash(emit(text), text) == without_hash(emit(base), base)
    # smem's chunks too (flash_decoding's 1024): once, a regs stream's chunk (none) was taken
    assert lower.chunk_of(napkin.load_text(text, "t.ncd")) == lower.chunk_of(napkin.load_text(base, "t.ncd"))


def test_a_tiled_regs_without_a_tiled_smem_is_the_kernel_level():
    """No smem tiles (none at all, or only holds): regs forms the programs,
    in the kernels and in the cost pass alike."""
    text = (EXAMPLES / "causal.ncd").read_text()
    for smem in ("", "  level smem { hold S, P }\n"):
        t = text.replace(SMEM, smem + "  level regs {\n    group b by 1, h by 1, q by 64\n    stream x by 32\n  }")
        assert errors(t) == []
        d = napkin.load_text(t, "t.ncd")
        assert dict(lower.lower(d).blocks) == {"q": 64, "x": 32}
        assert model.chip_levels(d) == ["regs"]
        tiles = model.tiling_at(d, "regs")
        assert dict(tiles.groups)["q"] == 64 and tiles.stream == ("x", 32)
        emit(t)


@pytest.mark.parametrize("name, old, new, tile, why, hint", [
    # a feature wire: every program loads all of d (padded), whatever the group says
    ("causal", "q by 128", "q by 128, d by 32", "group d by 32",
     "the kernels' programs are blocks of q, one per index of b, h, and each holds all of d: no launch splits d "
     "into the blocks of 32 the cost pass would count", "drop 'group d by 32' from level smem"),
    # the streamed wire with no stream tile: the loop runs over all of x (chunks need the stream beside them)
    ("causal", "q by 128\n    stream x by 64", "q by 128, x by 128", "group x by 128",
     "the kernels' programs are blocks of q, one per index of b, h, and each loops over all of x, the streamed "
     "wire: no launch splits x into the blocks of 128 the cost pass would count",
     "for chunks of x (one per program, merged after: flash-decoding) stream x beside it ('stream x by 64'); "
     "else drop 'group x by 128' from level smem"),
    ("matmul", "n by 128\n    stream k by 32", "n by 128, k by 64", "group k by 64",
     "the kernels' programs are blocks of m and n, and each loops over all of k, the streamed wire: no launch "
     "splits k into the blocks of 64 the cost pass would count",
     "drop 'group k by 64' from level smem (chunks of a streamed wire are generated for attention only)"),
], ids=["feature-d", "attention-x", "matmul-k"])
def test_a_group_the_kernels_do_not_split_is_refused_at_it(name, old, new, tile, why, hint):
    """The checker and the cost pass count a group's programs (grid ... d/32);
    the kernels split only their row (and column) blocks and batch wires."""
    text = (EXAMPLES / f"{name}.ncd").read_text()
    assert old in text
    text = text.replace(old, new)
    assert errors(text) == []
    wire, size = tile.split()[1], int(tile.split()[-1])
    assert (wire, size) in analyse(napkin.load_text(text, "t.ncd")).kernels[0].grid   # priced as programs
    diag = refusal(text)
    assert (diag.message, diag.hint) == (f"napkin cannot emit a kernel for '{tile}': {why}", hint)
    assert (diag.loc.line, diag.loc.col) == pos(text, tile.split(" ", 1)[1])

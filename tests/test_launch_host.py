"""The host side of a launch: what every call of a generated launcher does in
Python before its kernels start.  A decode step's kernels take microseconds,
so this path is kept short (the binding order worked out once, bindings and
the autotune cache's key and path remembered, an attention forward's whole
launch plan remembered per signature, host arithmetic in plain Python);
these tests hold the shortcuts to what they replace.
bench/launch_overhead.py measures it.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin
from napkin.parse import parse
from backward_helpers import compile_text


def _oracle_bind(m, shapes, free=()):
    """The binding as first written (before the order was planned): bind each
    dimension once at most one of its wires is unknown, in rounds, every
    message built as it goes.  Returns sizes or the (type, message) raised."""
    sizes = {w: n for w, n in m.WIRES.items() if n is not None}
    source = {w: "the diagram" for w in sizes}
    pending = [(name, i, axis, shape[i]) for name, shape in zip(m.INPUTS, shapes)
               for i, axis in enumerate(m._LAYOUTS[name]) if (name, i) not in free]
    while pending:
        ready = [p for p in pending if sum(w not in sizes for w in p[2]) <= 1]
        if not ready:
            names = sorted({w for p in pending for w in p[2] if w not in sizes})
            return ValueError, f"cannot tell the sizes of wires {', '.join(names)} from the input shapes"
        for item in ready:
            pending.remove(item)
            name, i, axis, n = item
            what = f"{name} dimension {i} ({' '.join(axis)})"
            unknown = [w for w in axis if w not in sizes]
            known = math.prod(sizes[w] for w in axis if w in sizes)
            if unknown:
                if known == 0:
                    return ValueError, f"{what}: the size of {unknown[0]} cannot be told, as its other wires have size 0"
                if n % known:
                    return ValueError, f"{what} has size {n}, not a multiple of {known} (the size of its other wires)"
                sizes[unknown[0]], source[unknown[0]] = n // known, what
            elif known != n:
                w = next(w for w in axis if source.get(w) != what)
                return ValueError, f"{what} has size {n}, but wire {w} has size {sizes[w]} from {source[w]}"
    for name, declared, read in m._RELABELS:
        if sizes[declared] != sizes[read] and not any(f[0] == name for f in free):
            return ValueError, (f"{name} is read along {read} as well as {declared}, so wires {read} "
                                f"({sizes[read]}) and {declared} ({sizes[declared]}) must have equal sizes")
    return sizes


@pytest.fixture(scope="module")
def modules():
    """The checked-in generated modules (test_golden holds them to the compiler's output)."""
    names = ("attention", "gqa", "document_mask", "flash_decoding", "matmul")
    return {n: importlib.import_module(f"generated.{n}") for n in names}


@pytest.fixture(scope="module")
def bound_modules(modules):
    return list(modules.values())


def _tensors(m, shapes):
    floats = {"fp16": torch.float16, "bf16": torch.float16, "fp32": torch.float32}
    return tuple(torch.empty(shape, dtype=floats.get(m._DTYPES[name], torch.int32))
                 for name, shape in zip(m.INPUTS, shapes))


def _drawn_shapes(m, data, most: int, nudged: int) -> list[list[int]]:
    """The inputs' shapes: each wire one size (0 to ``most``), drawn per wire;
    sometimes one dimension nudged to another (0 to ``nudged``), or zero."""
    wire = {w: (n if n is not None else data.draw(st.integers(0, most), label=w)) for w, n in m.WIRES.items()}
    shapes = [[math.prod(wire[w] for w in axis) for axis in m._LAYOUTS[name]] for name in m.INPUTS]
    if data.draw(st.booleans(), label="nudge"):
        k = data.draw(st.integers(0, len(shapes) - 1), label="tensor")
        i = data.draw(st.integers(0, len(shapes[k]) - 1), label="dim")
        shapes[k][i] = data.draw(st.integers(0, nudged), label="size")
    return shapes


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_planned_binding_binds_and_refuses_as_the_rounds_did(bound_modules, data):
    """Random shapes, mostly consistent (each wire one size, drawn per wire)
    and sometimes not (one dimension nudged, or zero): the launcher's _bind
    returns the oracle's sizes or raises its exact message."""
    m = data.draw(st.sampled_from(bound_modules), label="module")
    shapes = _drawn_shapes(m, data, 6, 9)
    expected = _oracle_bind(m, shapes)
    if isinstance(expected, dict):
        assert m._bind(_tensors(m, shapes), kernel=True)[0] == expected
    else:
        with pytest.raises(expected[0]) as err:
            m._bind(_tensors(m, shapes), kernel=True)
        assert str(err.value) == expected[1]


def test_a_wire_no_input_binds_is_named_after_the_others_are_checked(tmp_path):
    """A diagram whose |g| no input shows alone (only inside (hk g)) cannot be
    bound: the message names it, after the dimensions that can be bound were
    checked (a mismatch there is reported first, as before).  napkin check
    refuses such a diagram now (test_check.py); the launcher's message stays
    for a diagram built past the checker, compiled here from the parse alone."""
    text = """diagram nog
wire b, hk, g, q, x, d
in Q[b, (hk g), q, d] : fp32
in K[b, (hk g), x, d] : fp32
in V[b, (hk g), x, d] : fp32
S[b, hk, g, q, x] = sum[d](Q * K)
P[b, hk, g, q, x] = softmax[x](S)
O[b, (hk g), q, d] : fp32 = sum[x](P * V)
out O
schedule on h100 {
  level hbm { hold Q, K, V, O }
  level smem { group q by 16
    stream x by 16
    hold S, P }
}
"""
    with pytest.raises(napkin.NapkinError, match="wire hk has no size: it lies only in flattened axes"):
        napkin.load_text(text, "nog.ncd")
    m = compile_text(text, "nog", tmp_path, diagram=parse(text, "nog.ncd"))
    q, k = torch.empty(1, 4, 3, 16), torch.empty(1, 4, 5, 16)
    with pytest.raises(ValueError, match=r"^cannot tell the sizes of wires g, hk from the input shapes$"):
        m._bind((q, k, k), kernel=True)
    with pytest.raises(ValueError, match=r"^K dimension 0 \(b\) has size 2, but wire b has size 1 from Q"):
        m._bind((q, torch.empty(2, 4, 5, 16), k), kernel=True)


def test_host_arithmetic_matches_tritons(modules):
    m = modules["attention"]
    for a in range(0, 300):
        for b in (1, 3, 16, 64, 128):
            assert m._cdiv(a, b) == triton.cdiv(a, b)
        assert m._dim_block(a) == max(16, triton.next_power_of_2(a))


def test_shapes_multiply_each_axis_wires(modules):
    """_shape's one-wire fast path and the grouped product, against the
    layout read by hand: Q[b, (hk g), q, d] and K[b, hk, x, d]."""
    m = modules["gqa"]
    sizes = {"b": 2, "hk": 3, "g": 4, "q": 5, "x": 6, "d": 128}
    assert m._shape("Q", sizes) == [2, 12, 5, 128]
    assert m._shape("K", sizes) == [2, 3, 6, 128]
    assert m._shape("O", {**sizes, "g": 1}) == [2, 3, 5, 128]


def test_plain_layouts_take_their_strides_and_grouped_ones_split_them(modules):
    m = modules["gqa"]
    sizes = {"b": 2, "hk": 3, "g": 4, "q": 5, "x": 6, "d": 128}
    q = torch.empty(2, 12, 5, 128).transpose(2, 3)   # not contiguous: the strides are the tensor's
    k = torch.empty(2, 3, 6, 128)
    assert "K" in m._PLAIN and "Q" not in m._PLAIN
    assert m._wire_strides(k, "K", sizes) == list(k.stride())
    s = q.stride()
    assert m._wire_strides(q, "Q", sizes) == [s[0], s[1] * 4, s[1], s[2], s[3]]


def test_the_remembered_autotune_lookup_sees_a_new_file_and_a_new_cache_dir(modules, monkeypatch, tmp_path):
    """The lookup is remembered per shape bucket, keyed also by the cache
    file's path and stamp: pointing NAPKIN_CACHE elsewhere, or rewriting the
    file, is seen by the very next launch."""
    from napkin import tunecache

    m = modules["attention"]
    sizes = {"b": 1, "h": 2, "q": 5, "x": 7, "d": 64}
    key = tunecache.cache_key(m.SOURCE_HASH, "cpu", {"fp16": "float16"}, sizes, ("b", "h", "q", "x"))
    one, two = tmp_path / "one", tmp_path / "two"
    for folder, block in ((one, 16), (two, 32)):
        folder.mkdir()
        (folder / "autotune.json").write_text(json.dumps(
            {"schema": tunecache.SCHEMA, "entries": {key: {"config": {"block_q": block}}}}))
    dev, f16 = torch.device("cpu"), {"fp16": torch.float16}
    monkeypatch.setenv("NAPKIN_CACHE", str(one))
    assert m._autotune_lookup(sizes, dev, f16) == {"block_q": 16}
    monkeypatch.setenv("NAPKIN_CACHE", str(two))
    assert m._autotune_lookup(sizes, dev, f16) == {"block_q": 32}
    (two / "autotune.json").unlink()
    assert m._autotune_lookup(sizes, dev, f16) is None
    (two / "autotune.json").write_text(json.dumps(
        {"schema": tunecache.SCHEMA, "entries": {key: {"config": {"block_q": 64}}}}))
    assert m._autotune_lookup(sizes, dev, f16) == {"block_q": 64}
    assert m._autotune_lookup(dict(sizes, x=8), dev, f16) == {"block_q": 64}      # the same bucket
    assert m._autotune_lookup(dict(sizes, x=9), dev, f16) is None                 # another


def test_the_autotune_memo_is_bounded_and_answers_alike_after_it_is_cleared(modules, monkeypatch, tmp_path):
    """The memo is keyed by the sizes themselves (a decode loop makes one entry
    per cache length): it is cleared when full, and the next lookup reads the
    file again, to the same answer."""
    from napkin import tunecache

    m = modules["attention"]
    sizes = {"b": 1, "h": 2, "q": 5, "x": 7, "d": 64}
    key = tunecache.cache_key(m.SOURCE_HASH, "cpu", {"fp16": "float16"}, sizes, ("b", "h", "q", "x"))
    (tmp_path / "autotune.json").write_text(json.dumps(
        {"schema": tunecache.SCHEMA, "entries": {key: {"config": {"block_q": 32}}}}))
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    monkeypatch.setattr(m, "_AUTOTUNE_MEMO", 3)
    dev, f16 = torch.device("cpu"), {"fp16": torch.float16}
    answers = [m._autotune_lookup(dict(sizes, x=x), dev, f16) for x in (5, 6, 7, 8, 9, 7)]
    assert answers == [{"block_q": 32}] * 4 + [None, {"block_q": 32}]
    assert len(m._autotune_memo) <= 3


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_remembered_binding_answers_as_the_rounds_do_whatever_came_before(bound_modules, data):
    """_bind_for_launch remembers _bind's answers by the inputs' signatures
    (shape, dtype, device, type): a run of calls, consistent shapes and
    nudged ones, repeats among them, each answers with the oracle's sizes or
    raises its exact message, whatever was remembered before it."""
    m = data.draw(st.sampled_from(bound_modules), label="module")
    for _ in range(data.draw(st.integers(2, 5), label="calls")):
        shapes = _drawn_shapes(m, data, 3, 4)
        expected = _oracle_bind(m, shapes)
        for _ in range(2):   # the second call is answered from the memo
            if isinstance(expected, dict):
                sizes, _, device = m._bind_for_launch(_tensors(m, shapes))
                assert (sizes, device) == (expected, torch.device("cpu"))
            else:
                with pytest.raises(expected[0]) as err:
                    m._bind_for_launch(_tensors(m, shapes))
                assert str(err.value) == expected[1]


def test_the_remembered_binding_tells_dtypes_and_non_tensors_apart_and_is_bounded(modules, monkeypatch):
    """The signature holds each input's dtype: the same shapes in float32
    after float16 bind float32, and a mix the diagram's one dtype forbids is
    refused even after both were remembered; a non-tensor is refused in
    words; the memo is cleared when full."""
    m = modules["attention"]
    shapes = ([1, 2, 5, 64], [1, 2, 7, 64], [1, 2, 7, 64])
    half = tuple(torch.empty(s, dtype=torch.float16) for s in shapes)
    full = tuple(torch.empty(s, dtype=torch.float32) for s in shapes)
    assert m._bind_for_launch(half)[1] == {"fp16": torch.float16}
    assert m._bind_for_launch(full)[1] == {"fp16": torch.float32}
    assert m._bind_for_launch(half)[1] == {"fp16": torch.float16}
    with pytest.raises(TypeError, match="K has dtype torch.float32 but Q has torch.float16"):
        m._bind_for_launch((half[0], full[1], half[2]))
    with pytest.raises(TypeError, match="K must be a torch.Tensor, not list"):
        m._bind_for_launch((half[0], [1.0], half[2]))
    monkeypatch.setattr(m, "_BIND_MEMO", {})
    monkeypatch.setattr(m, "_BIND_MEMO_SIZE", 2)
    for x in (3, 4, 5, 6, 4):
        tensors = tuple(torch.empty(s[:2] + [x if i else 5, 64], dtype=torch.float16) for i, s in enumerate(shapes))
        assert m._bind_for_launch(tensors)[0]["x"] == x
        assert len(m._BIND_MEMO) <= 2


class _CountingOs:
    """The generated module's ``os`` for the autotune lookups, counting stats."""

    def __init__(self):
        import os
        self.environ, self.path, self._os, self.stats = os.environ, os.path, os, 0

    def stat(self, path):
        self.stats += 1
        return self._os.stat(path)


def test_a_backward_reads_the_tuned_configs_file_once_for_its_three_lookups(modules, monkeypatch, tmp_path):
    """A training step's backward looks up three tuned configs (the rows
    kernel's, dQ's, dK/dV's) under _AUTOTUNE_ONCE: one stat of the cache file
    for the three.  A file rewritten
    after the backward is seen by the next launch, and a backward that
    raised leaves no stamp held."""
    from napkin import tunecache

    m = modules["attention"]
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    counting = _CountingOs()
    monkeypatch.setattr(m, "_autotune_os", counting)
    lookups, lookup = [], m._autotune_lookup
    monkeypatch.setattr(m, "_autotune_lookup", lambda s, d, c, kind="": lookups.append(kind) or lookup(s, d, c, kind))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=gen).requires_grad_() for s in ([1, 2, 5, 64], [1, 2, 7, 64], [1, 2, 7, 64]))
    o, _ = m.attention(q, k, v, block_q=16, block_x=16)
    assert lookups == [""]
    before = counting.stats
    o.sum().backward()
    assert sorted(lookups[1:]) == ["bwd", "bwd", "bwd_kv"] and counting.stats == before + 1
    assert getattr(m._autotune_held, "stamp", None) is None and m._autotune_held.depth == 0
    sizes = {"b": 1, "h": 2, "q": 5, "x": 7, "d": 64}
    key = tunecache.cache_key(m.SOURCE_HASH, "cpu", {"fp16": "float32"}, sizes, ("b", "h", "q", "x"))
    (tmp_path / "autotune.json").write_text(json.dumps(
        {"schema": tunecache.SCHEMA, "entries": {key: {"config": {"block_q": 32}}}}))
    assert m._autotune_lookup(sizes, torch.device("cpu"), {"fp16": torch.float32}) == {"block_q": 32}
    with pytest.raises(RuntimeError, match="inside"):
        with m._AUTOTUNE_ONCE:
            assert m._autotune_stamp() is m._autotune_stamp()
            raise RuntimeError("inside")
    assert m._autotune_held.stamp is None and m._autotune_held.depth == 0


# --------------------------------------------------------------------------
# Launch plans (napkin/codegen/launch_plan.py): an attention forward launcher
# remembers what it works out from a call's signature.  A launch from a plan
# must be the launch the whole launcher makes: the kernels are stubbed and
# record what they are given.
# --------------------------------------------------------------------------

class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, tuple(grid), args, kwargs))


@contextlib.contextmanager
def _recorded(m):
    """Every Triton kernel the module launches from the host recording into a list."""
    import re

    log = []
    kernels = {n: v for n, v in vars(m).items()
               if re.fullmatch(r"_\w+_(kernel|merge)", n) and callable(getattr(v, "fn", None))}
    try:
        for n in kernels:
            setattr(m, n, _Recorder(n, log))
        yield log
    finally:
        for n, v in kernels.items():
            setattr(m, n, v)


def _seen(log, inputs):
    """The launches with each tensor as its shape, strides, dtype and which
    input's storage it views (None: the launcher's own), other values as they are."""
    def norm(v):
        if isinstance(v, torch.Tensor):
            src = next((i for i, t in enumerate(inputs) if t.untyped_storage().data_ptr()
                        == v.untyped_storage().data_ptr()), None)
            return ("tensor", tuple(v.shape), v.stride(), v.dtype, src)
        return v
    return [(n, g, tuple(map(norm, a)), {k: norm(v) for k, v in kw.items()}) for n, g, a, kw in log]


def _launcher(m, suffix=""):
    """The module's launcher named after it (``suffix``: "_backward", its backward's)."""
    return getattr(m, m.__name__.rsplit(".", 1)[-1] + suffix)


def _call(m, inputs, options):
    """The launcher's outputs (shape, strides, dtype) and its launches, or the error it raised."""
    with _recorded(m) as log, torch.no_grad():
        try:
            out = _launcher(m)(*inputs, **options)
        except (TypeError, ValueError) as err:
            return type(err), str(err)
    out = out if isinstance(out, tuple) else (out,)
    return [(tuple(o.shape), o.stride(), o.dtype) for o in out], _seen(log, inputs)


_PLANNED = ("attention", "gqa", "flash_decoding", "mla", "attention_sink", "sliding_window", "document_mask")


@pytest.fixture(scope="module")
def planned_modules():
    return {n: importlib.import_module(f"generated.{n}")
            for n in _PLANNED + ("document_mask", "alibi", "l2_attention")}


def _inputs(m, data, dtype):
    """Inputs of drawn sizes; sometimes one float input a transposed view (strides not its shape's).
    Wires a relabel ties (document ids read along q and x) get one size."""
    sizes = {w: data.draw(st.integers(1, 3) if w in ("b", "h", "hk", "g") else st.integers(1, 40), label=w)
             for w, n in m.WIRES.items() if n is None}
    for _, declared, read in m._RELABELS:
        if declared in sizes and read in sizes:
            sizes[read] = sizes[declared]
    inputs = list(m.example_inputs(sizes, dtype=dtype, seed=data.draw(st.integers(0, 9), label="seed")))
    k = data.draw(st.integers(0, len(inputs) - 1), label="view")
    if inputs[k].is_floating_point() and inputs[k].dim() >= 3 and data.draw(st.booleans(), label="transposed"):
        inputs[k] = inputs[k].transpose(1, 2).contiguous().transpose(1, 2)
    return inputs


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_launch_from_its_plan_is_the_launch_the_whole_launcher_makes(planned_modules, data):
    """Random calls (sizes, dtypes, a transposed input, blocks, warps,
    chunks, out_dtype) of modules with plain, packed, chunked, saved and
    two-part scores: each call's launches and outputs, made with the plans
    remembered so far, equal those of the whole launcher with no plan; a
    refusal is the same refusal.  The second call of a signature is made
    from its plan."""
    m = planned_modules[data.draw(st.sampled_from(_PLANNED), label="module")]
    with pytest.MonkeyPatch.context() as monkeypatch:   # (a fixture's would last across the examples)
        monkeypatch.setenv("NAPKIN_CACHE", "/nonexistent/napkin-test-cache")
        _compare_plans(m, data, monkeypatch)


# lengths= a plan takes (plain ints: its key holds which are under the local size, a plan's call
# passes the lengths themselves) and ones the whole launcher refuses (a bool, a negative length, a
# wire that is not positional) or takes unplanned (a NumPy integer)
_LENGTHS = st.one_of(
    st.none(), st.none(),
    st.dictionaries(st.sampled_from(["q", "x"]), st.integers(0, 45), min_size=1),
    st.sampled_from([{"x": True}, {"x": -1}, {"d": 3}, {"x": 2.0}, {}]),
    st.integers(0, 45).map(lambda n: {"x": np.int64(n)}))


def _compare_plans(m, data, monkeypatch):
    whole = m._launch_plan
    for _ in range(data.draw(st.integers(1, 3), label="calls")):
        inputs = _inputs(m, data, data.draw(st.sampled_from([torch.float16, torch.float32]), label="dtype"))
        options = {"block_q": data.draw(st.sampled_from([None, 16, 32]), label="block_q"),
                   "block_x": data.draw(st.sampled_from([None, 16, 32]), label="block_x"),
                   "num_warps": data.draw(st.sampled_from([None, 2, 4]), label="num_warps"),
                   "chunk": data.draw(st.sampled_from([None, 0, 32, 48]), label="chunk"),
                   "out_dtype": data.draw(st.sampled_from([None, torch.float32]), label="out_dtype"),
                   "lengths": data.draw(_LENGTHS, label="lengths")}
        monkeypatch.setattr(m, "_launch_plan", lambda key: (None, None))
        expected = _call(m, inputs, options)
        monkeypatch.setattr(m, "_launch_plan", whole)
        assert _call(m, inputs, options) == expected
        lengths = m._lengths_key(options["lengths"], inputs)
        key = None if lengths is None else m._launch_key(
            inputs, [options[o] for o in ("block_q", "block_x", "num_warps")]
            + [None, None, False, options["out_dtype"], options["chunk"], lengths])
        planned = isinstance(expected[0], list) and type(options["lengths"]) in (type(None), dict) and all(
            type(n) is int for n in (options["lengths"] or {}).values())
        assert (key is not None and whole(key)[0] is not None) == planned   # remembered unless refused
        assert _call(m, inputs, options) == expected
        if planned and options["lengths"]:   # other lengths through the same plan: each call's own
            other = {w: data.draw(st.integers(0, 45), label=f"other {w}") for w in options["lengths"]}
            monkeypatch.setattr(m, "_launch_plan", lambda key: (None, None))
            expected = _call(m, inputs, dict(options, lengths=other))
            monkeypatch.setattr(m, "_launch_plan", whole)
            assert _call(m, inputs, dict(options, lengths=other)) == expected


def test_a_plan_is_made_again_for_a_retuned_config_and_never_answers_a_refused_option(planned_modules,
                                                                                        monkeypatch, tmp_path):
    """A plan holds the tuned configs' file stamp: a rewritten file's config
    is launched at once.  Options 16.0 and True hash as 16 and 1, and are
    still refused after those were planned; a call with lengths= makes one
    (keyed by which lengths are short), one with tma=True none, a diagram
    whose mask reads data one; the plans are cleared when full."""
    from napkin import tunecache

    m = planned_modules["attention"]
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    monkeypatch.setattr(m, "_LAUNCH_PLANS", {})
    sizes = {"b": 1, "h": 2, "q": 5, "x": 7, "d": 64}
    inputs = m.example_inputs(sizes, dtype=torch.float32)
    blocks = lambda seen: seen[1][0][3]["_BLOCK_q"]   # the first launch's keyword
    assert blocks(_call(m, inputs, {})) == 128 and len(m._LAUNCH_PLANS) == 1
    key = tunecache.cache_key(m.SOURCE_HASH, "cpu", {"fp16": "float32"}, sizes, ("b", "h", "q", "x"))
    (tmp_path / "autotune.json").write_text(json.dumps(
        {"schema": tunecache.SCHEMA, "entries": {key: {"config": {"block_q": 32}}}}))
    assert blocks(_call(m, inputs, {})) == 32
    assert blocks(_call(m, inputs, {"block_q": 16, "num_stages": 1})) == 16
    assert _call(m, inputs, {"block_q": 16.0, "num_stages": 1}) == (
        ValueError, "block_q must be a whole number or None, not 16.0")
    assert _call(m, inputs, {"block_q": 16, "num_stages": True}) == (
        ValueError, "num_stages must be a whole number or None, not True")
    planned = len(m._LAUNCH_PLANS)
    for n in (6, 5, 7, 9):   # short of the 7 keys, short, whole, past the end: two plans
        _call(m, inputs, {"lengths": {"x": n}})
    assert len(m._LAUNCH_PLANS) == planned + 2
    _call(m, inputs, {"tma": True})
    assert m._tma_last["used"] and len(m._LAUNCH_PLANS) == planned + 2
    _call(m, inputs, {})
    assert m._tma_last == {"used": False, "why": "tma not requested"}   # the plan's call says so again
    d = planned_modules["document_mask"]   # planned, its prepass run again each call (test_mask_cache.py)
    monkeypatch.setattr(d, "_LAUNCH_PLANS", {})
    for _ in range(2):
        assert isinstance(_call(d, d.example_inputs(dict(sizes, x=5), dtype=torch.float32), {})[0], list)
    assert len(d._LAUNCH_PLANS) == 1
    monkeypatch.setattr(m, "_LAUNCH_PLANS_SIZE", 2)
    for x in (3, 4, 5, 6):
        _call(m, m.example_inputs(dict(sizes, x=x), dtype=torch.float32), {})
        assert len(m._LAUNCH_PLANS) <= 2


# The backward launchers (NAME_backward, which autograd's backward calls) keep
# plans too: the dQ and dK/dV launches, checked the same way.
_BACKWARD_PLANNED = ("attention", "gqa", "mla", "attention_sink", "sliding_window", "l2_attention", "alibi",
                     "document_mask")


def _state(m, inputs, dtype):
    """The backward's other tensors (dO, the saved row state), shaped per the
    inputs: dO in ``dtype``, the row state float32; random values (the
    kernels are stubbed)."""
    sz = m._bind_for_launch(tuple(inputs))[0]
    names = list(inspect.signature(_launcher(m, "_backward")).parameters)[len(m.INPUTS):]
    names = names[:names.index("need") - len(m._OPTIONS)]
    return [torch.randn(m._shape(n, sz), dtype=dtype if n == "dO" else torch.float32) for n in names]


def _call_backward(m, tensors, options):
    """NAME_backward's gradients (shape, strides, dtype, or None) and launches, or the error it raised."""
    with _recorded(m) as log:
        try:
            out = _launcher(m, "_backward")(*tensors, **options)
        except (TypeError, ValueError) as err:
            return type(err), str(err)
    return [None if g is None else (tuple(g.shape), g.stride(), g.dtype) for g in out], _seen(log, tensors)


def _backward_options(m, data):
    need = data.draw(st.sampled_from(["none", "mask", "flags"]), label="need kind")
    n = len(m.INPUTS)
    return {"block_q": data.draw(st.sampled_from([None, 16, 32]), label="block_q"),
            "block_x": data.draw(st.sampled_from([None, 16, 32]), label="block_x"),
            "num_warps": data.draw(st.sampled_from([None, 2, 4]), label="num_warps"),
            "num_stages": data.draw(st.sampled_from([None, 1, 2]), label="num_stages"),
            "need": None if need == "none" else data.draw(st.integers(0, (1 << n) - 1), label="mask")
            if need == "mask" else tuple(data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="flags")),
            "grad_dtype": data.draw(st.sampled_from(["float32", "input"]), label="grad_dtype")}


def _backward_key(m, tensors, options):
    return m._launch_key(tuple(tensors), ("backward", *[options.get(o) for o in m._OPTIONS],
                                          options["need"], options["grad_dtype"]))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_backward_launch_from_its_plan_is_the_one_the_whole_launcher_makes(planned_modules, data):
    """Random direct calls of NAME_backward (sizes, dtypes, a transposed
    input, blocks, warps, stages, need as a mask or flags, grad_dtype) of
    modules with plain, grouped, two-part, sink, normalised, ALiBi (the
    slope's zeroed partial sums) and document-id scores (ranges prepasses
    run again): the
    gradients' shapes, strides and dtypes and the launches, with the plans
    remembered so far, equal the whole launcher's with no plan, refusals
    too; the second call of a signature is made from its plan.  Calls may
    reuse the tensors before them with other options."""
    m = planned_modules[data.draw(st.sampled_from(_BACKWARD_PLANNED), label="module")]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("NAPKIN_CACHE", "/nonexistent/napkin-test-cache")
        whole, tensors = m._launch_plan, None
        for _ in range(data.draw(st.integers(1, 4), label="calls")):
            # the tensors of the call before, sometimes, with other options: a key must tell them apart
            if tensors is None or not data.draw(st.booleans(), label="same tensors"):
                dtype = data.draw(st.sampled_from([torch.float16, torch.float32]), label="dtype")
                inputs = _inputs(m, data, dtype)
                tensors = inputs + _state(m, inputs, dtype)
            options = _backward_options(m, data)
            monkeypatch.setattr(m, "_launch_plan", lambda key: (None, None))
            expected = _call_backward(m, tensors, options)
            monkeypatch.setattr(m, "_launch_plan", whole)
            assert _call_backward(m, tensors, options) == expected
            planned = whole(_backward_key(m, tensors, options))[0] is not None
            assert planned == isinstance(expected[0], list)   # remembered unless refused
            assert _call_backward(m, tensors, options) == expected


def test_a_backward_plan_follows_a_retuned_config_and_never_answers_a_refused_option(planned_modules,
                                                                                     monkeypatch, tmp_path):
    """As the forward's: a rewritten tuned-configs file is read at once;
    16.0, True (as need or a block) are refused after 16 and 1 were planned;
    tma=True and positions= make no plan.  (A mask that reads data:
    tests/test_mask_cache.py.)"""
    from napkin import tunecache

    m = planned_modules["attention"]
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    monkeypatch.setattr(m, "_LAUNCH_PLANS", {})
    sizes = {"b": 1, "h": 2, "q": 5, "x": 7, "d": 64}
    inputs = list(m.example_inputs(sizes, dtype=torch.float32))
    tensors = inputs + _state(m, inputs, torch.float32)
    dq_block = lambda seen: next(kw["_BLOCK_q"] for n, _, _, kw in seen[1] if n.endswith("_dq_kernel"))
    assert dq_block(_call_backward(m, tensors, {})) == dq_block(_call_backward(m, tensors, {}))
    assert len(m._LAUNCH_PLANS) == 1
    key = tunecache.cache_key(m.SOURCE_HASH, "cpu", {"fp16": "float32"}, sizes, ("b", "h", "q", "x"), "bwd")
    (tmp_path / "autotune.json").write_text(json.dumps(
        {"schema": tunecache.SCHEMA, "entries": {key: {"config": {"block_q": 32, "block_x": 16}}}}))
    assert dq_block(_call_backward(m, tensors, {})) == 32
    assert dq_block(_call_backward(m, tensors, {"block_q": 16, "need": 1})) == 16
    assert _call_backward(m, tensors, {"block_q": 16.0, "need": 1}) == (
        ValueError, "block_q must be a whole number or None, not 16.0")
    assert _call_backward(m, tensors, {"block_q": 16, "need": True})[0] is ValueError
    planned = len(m._LAUNCH_PLANS)
    _call_backward(m, tensors, {"tma": True})
    assert m._tma_last_dq["used"] and len(m._LAUNCH_PLANS) == planned
    _call_backward(m, tensors, {"positions": {"q": torch.arange(5), "x": torch.arange(7)}})
    assert len(m._LAUNCH_PLANS) == planned
    _call_backward(m, tensors, {})
    assert m._tma_last_dq == {"used": False, "why": "tma not requested"}   # the plan's call says so again


# --------------------------------------------------------------------------
# The device a launch runs on.  Triton launches on the current CUDA device;
# each launcher makes its tensors' device current first.
# --------------------------------------------------------------------------

class _OnCuda1(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (this machine may have no GPU)."""

    @property
    def device(self):
        return torch.device("cuda", 1)

    @property
    def is_cuda(self):   # the launchers ask this first (no device object built)
        return True


def _record_current_device(monkeypatch):
    """Replace torch.cuda.device with one that records which device each
    launch ran under; returns the list of launches' devices."""
    current, seen = [None], []

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], torch.device(d)
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "device", device)
    return current, seen


def test_a_launch_runs_with_its_tensors_cuda_device_current(modules, monkeypatch):
    current, seen = _record_current_device(monkeypatch)
    m = modules["attention"]
    launch = m._on_inputs_device(lambda *a, **k: seen.append(current[0]) or "done")
    on1 = torch.Tensor._make_subclass(_OnCuda1, torch.zeros(2))
    assert launch(None, on1, torch.zeros(1), flag=True) == "done"   # the first tensor argument names it
    assert launch(torch.zeros(1), need=(True,)) == "done"            # a CPU tensor: no CUDA call at all
    assert launch() == "done"
    assert seen == [torch.device("cuda", 1), None, None]
    assert current[0] is None   # and the device before is current again


def test_a_launch_that_raises_restores_the_current_device(modules, monkeypatch):
    current, _ = _record_current_device(monkeypatch)

    def fails(*args):
        assert current[0] == torch.device("cuda", 1)
        raise ValueError("from the launch")

    with pytest.raises(ValueError, match="from the launch"):
        modules["gqa"]._on_inputs_device(fails)(torch.Tensor._make_subclass(_OnCuda1, torch.zeros(1)))
    assert current[0] is None


def test_every_launcher_of_every_generated_module_runs_on_its_tensors_device():
    """Each function that launches kernels (forward, backward, the backward's
    per-row pass) is wrapped; the wrapper's code is _on_inputs_device's."""
    folder = Path(importlib.import_module("generated").__file__).parent
    names = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    checked = 0
    for name in names:   # a module is named after its diagram
        m = importlib.import_module(f"generated.{name}")
        wrapper = m._on_inputs_device(lambda: None).__code__
        launches = [f for f in (f"_{name}_forward", f"_{name}_preprocess", f"_{name}_backward") if hasattr(m, f)]
        assert f"_{name}_forward" in launches, name
        for f in launches:
            assert getattr(m, f).__code__ is wrapper, f"{name}.{f} does not enter its tensors' device"
            checked += 1
    assert checked >= 2 * len(names)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_the_second_gpu_compute_there_while_the_first_is_current(modules):
    m = modules["attention"]
    torch.cuda.set_device(0)
    inputs = [t.requires_grad_() for t in m.example_inputs({"b": 1, "h": 2, "q": 200, "x": 333},
                                                            dtype=torch.float16, device="cuda:1")]
    out = m.attention(*inputs)
    out.float().pow(2).sum().backward()
    exact = [t.detach().double().requires_grad_() for t in inputs]
    want = m.reference(*exact)
    want.pow(2).sum().backward()
    assert out.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
    assert torch.allclose(out.double(), want, atol=2e-2)
    for t, e in zip(inputs, exact):
        assert torch.allclose(t.grad.double(), e.grad, atol=5e-2, rtol=5e-2)

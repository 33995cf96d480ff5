"""An attention forward launcher's plan: what it works out from a call's
signature alone, remembered per signature.

A decode step's kernels take microseconds, and before them the launcher's
Python binds the inputs, reads the tuned config, picks blocks and chunks,
and works out the grid, every stride and the constexpr flags: 75-160 us a
call on the CPU here (bench/launch_overhead.py), 80-230 us on the H200's
host.  All of it follows from the call's signature: each input's type,
shape, strides, dtype and device, and the options (their types too: 16.0
and True are refused where 16 and 1 pass, and they hash alike).  So the
launcher keeps it per signature (the module's ``_LAUNCH_PLANS``, with the
tuned configs' file stamp it was made under: a retuned config is read
again).  A call whose signature it has seen allocates its outputs, builds
its argument tuple and launches; the first call of a signature runs the
launcher's whole code, which makes the plan.  A call with lengths= alone
(a decode loop over one preallocated cache) is planned by which lengths
fall short of their wire's local size (those rows are padding, read at
their own offsets): the key holds those flags, not the lengths, and a
plan's call passes its own lengths (``_lengths_key``; plain ints only,
anything else goes through the whole launcher, which checks it), the
streamed wire's also as the kernel's size of it (``_streamed_cut``: the
kernel stops there, as for a cache narrowed to it).  Never
planned: calls with positions (tensors of their own, checked each call)
and calls whose tiles move through TMA descriptors (built on the tensors
themselves).
A mask that reads data is planned, and a plan's call runs its ranges
prepass again at the plan's blocks: the ids are data, not signature
(mask_cache makes it a dict hit when the caller keeps one).  Packed rows'
prepass reads the launch's positions (each packed row's q), which the
plan's keywords hold.

The backward's launchers keep plans the same way, in the same memo, under
keys tagged "preprocess" and "backward" (templates/training.py.jinja: each
works its launches out as (grid, the positional arguments after the
kernel's tensors, the keywords) and hands them to a launch function that a
plan's call goes to directly; side inputs' partial sums, ALiBi's slope's,
zeroed again; a mask that reads data has its prepasses run again, as the
forward's).  Not with positions or TMA, as the forward's (a backward
takes no lengths).

A plan: the device; packed rows' input shapes (the launch reshapes the
caller's tensors); each allocated tensor's shape and dtype (outputs, saved
row state); the grid; the kernel's positional arguments after its tensors
(sizes, strides); its keyword arguments but the chunks' state buffer
``_part``, whose size it keeps; the chunk; packed rows' caller sizes
(``_real``, which the return unpacks by); and why TMA was off (the
``_tma_last`` record a call leaves); for a mask that reads data, the sizes
and blocks its prepass takes.
"""
from __future__ import annotations

from .launch import indent

PLAN_FIELDS = "_dev, _views, _allocs, _grid, _tail, _fixed, _part_n, _chunk, _real, _tma_why, _at"


def forward_launch(inputs: list[str], allocated: list[str], options: list[str], work: str, tail: str,
                   packed: list[str], ranges: str = "", cut_at=None) -> str:
    """The launch block of an attention forward launcher.  ``work``: the
    launcher's whole code from the binding to ``_args`` and ``_meta``;
    ``tail``: the launches; ``allocated``: the tensors ``work`` allocates,
    as the kernel takes them after the inputs; ``options``: the launcher's
    parameters besides the inputs that decide a launch; ``packed``: the
    inputs packed rows reshape (none without them).  ``ranges``: a mask
    that reads data, the line running its ranges prepass (``_rng``,
    ``_rng_on`` at ``_sz``, ``_br``, ``_bc``; packed rows' positions from
    the plan's keywords, ``_fixed``), which a plan's call runs again: the
    ids are data, not signature.  ``cut_at``: (the index in ``_args`` of
    the streamed wire's size, the wire), which a plan's call whose length
    of it is short replaces with that length (``_streamed_cut``)."""
    ins, outs = ", ".join(inputs) + ",", ", ".join(allocated) + ","
    opts = ", ".join(options) + ","
    key = ("_lk = _lengths_key(lengths, (" + ins + ")) if positions is None else None  "
           "# lengths= alone: keyed by which are short\n"
           f"_key = _launch_key(({ins}), ({opts} _lk)) if _lk is not None else None  "
           "# the call's signature: None where it holds tensors of its own")
    fast = [
        f"{PLAN_FIELDS} = _plan",
        *(["if _views is not None:  # packed rows: as _pack reshaped them (it packs nothing at a group of 1)",
           f"    {', '.join(packed)}, = [t.reshape(s) for t, s in zip(({', '.join(packed)},), _views)]"]
          if packed else []),
        f"{outs} = [torch.empty(s, dtype=t, device=_dev) for s, t in _allocs]",
        "_part = torch.empty(_part_n, dtype=torch.float32, device=_dev) if _part_n else None",
        f"_args = ({ins} {outs} *_tail)",
        *(["_sz, _br, _bc = _at  # the mask reads data: its ranges at the plan's blocks", ranges,
           "_meta = dict(_fixed, _part=_part, _ranges=_rng, _RANGES=_rng_on)"] if ranges else
          ["_meta = dict(_fixed, _part=_part)"]),
        "if lengths:  # the call's own lengths (the plan's key holds only which are short)",
        "    _meta.update({_LENGTH_ARGS[_w]: _n for _w, _n in lengths.items()})",
        *([f"    if ({cut_at[1]!r}, True) in _lk:  # the kernel stops at this call's length (_streamed_cut)",
           f"        _args = (*_args[:{cut_at[0]}], lengths[{cut_at[1]!r}], *_args[{cut_at[0] + 1}:])"]
          if cut_at else []),
        "_tma_last.update(used=False, why=_tma_why)",
    ]
    # _pack hands back the caller's sizes, and tensors, when it packs nothing
    views = f"None if _sz is _real else [t.shape for t in ({', '.join(packed)},)]" if packed else "None"
    real = "_real" if packed else "None"
    # a plan keeps no call's part buffer, nor its ranges (a plan's call finds its own)
    cleared = '"_part": None, "_ranges": None' if ranges else '"_part": None'
    at = "(_sz, _br, _bc)" if ranges else "None"
    store = [
        "# not for positions (no key), nor TMA: descriptors are built on the tensors, each call",
        "if _key is not None and not _meta.get(\"_TMA\"):",
        f"    _remember_launch(_key, _stamp, (_dev, {views}, [(t.shape, t.dtype) for t in ({outs})], _grid, "
        f"_args[{len(inputs) + len(allocated)}:], {{**_meta, {cleared}}}, "
        f"0 if _part is None else _part.numel(), _chunk, {real}, _tma_last[\"why\"], {at}))",
    ]
    return "\n".join([
        key,
        "with _AUTOTUNE_ONCE:  # one read of the tuned configs' file stamp, for the plan and the lookup",
        indent("\n".join([
            "_plan, _stamp = _launch_plan(_key)",
            "if _plan is not None:  # a signature seen before: its plan (codegen/launch_plan.py)",
            indent("\n".join(fast)),
            "else:",
            indent(work + "\n" + "\n".join(store))])),
        tail,
    ])

"""Count the bytes Triton kernels really move, under TRITON_INTERPRET=1.

The measured side of the cost model.  Under Triton's interpreter every
global load and store, whatever the kernel wrote (``tl.load``,
``tl.store``, block pointers, tensor descriptors), ends in the interpreter
builder's ``create_masked_load`` or ``create_masked_store``.  ``ByteCounter``
wraps those two methods for the duration of a ``with`` block and adds up,
per call, the lanes whose mask is true times the element size: masked-out
lanes move nothing, exactly as on the GPU.

Bytes are attributed to tensors by address: each launch's tensor arguments
are recorded (the interpreter's host copies, so CUDA tensors work too) with
their storage's address range, under the name given in ``tensors=`` when the
argument shares storage with one of those, else under the kernel's parameter
name.  Lanes outside every recorded range count under "?".

    with ByteCounter(tensors={"Q": q, "K": k}) as bc:
        kernel[grid](q, k, ...)
    bc.loads["K"], bc.stores, bc.total

Only the interpreter is counted: on a GPU without TRITON_INTERPRET=1 nothing
is (``launches`` stays 0, and tests should check it).  Written against the
interpreter of triton 3.x (create_masked_load / create_masked_store on
InterpreterBuilder, GridExecutor._init_args_hst); without the latter, bytes
still count, all under "?".
"""
from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Mapping, Optional

import numpy as np


class ByteCounter:
    """A context manager summing the bytes of every interpreted global load and store."""

    def __init__(self, tensors: Optional[Mapping[str, object]] = None, distinct: bool = False):
        """``distinct``: count each load or store call's distinct addresses once,
        as a warp's lanes at one address are served once (a coarse read's
        tile, keep[.., q // 64, ..], repeats each block's element along the
        tile); else every lane whose mask is true."""
        self.names = dict(tensors or {})
        self.distinct = distinct
        self.loads: dict[str, int] = defaultdict(int)     # bytes per tensor
        self.stores: dict[str, int] = defaultdict(int)
        self.load_calls = 0
        self.store_calls = 0
        self.launches = 0
        self._ranges: dict[int, tuple[int, str]] = {}      # start address -> (end, name)
        self._saved: list[tuple[object, str, object]] = []

    # -- results ---------------------------------------------------------------
    @property
    def load_bytes(self) -> int:
        return sum(self.loads.values())

    @property
    def store_bytes(self) -> int:
        return sum(self.stores.values())

    @property
    def total(self) -> int:
        return self.load_bytes + self.store_bytes

    # -- patching ----------------------------------------------------------------
    def __enter__(self) -> "ByteCounter":
        from triton.runtime import interpreter

        builder = interpreter.InterpreterBuilder
        load, store = builder.create_masked_load, builder.create_masked_store
        counter = self

        def create_masked_load(b, ptrs, mask, other, *rest, **kw):
            counter._count(counter.loads, ptrs, mask)
            counter.load_calls += 1
            return load(b, ptrs, mask, other, *rest, **kw)

        def create_masked_store(b, ptrs, value, mask, *rest, **kw):
            counter._count(counter.stores, ptrs, mask)
            counter.store_calls += 1
            return store(b, ptrs, value, mask, *rest, **kw)

        self._patch(builder, "create_masked_load", create_masked_load)
        self._patch(builder, "create_masked_store", create_masked_store)
        executor = getattr(interpreter, "GridExecutor", None)
        init_args = getattr(executor, "_init_args_hst", None)
        if init_args is not None:
            def _init_args_hst(ex, args_dev, kwargs):
                args_hst, kwargs_hst = init_args(ex, args_dev, kwargs)
                counter._record(ex, args_dev, args_hst, kwargs, kwargs_hst)
                return args_hst, kwargs_hst
            self._patch(executor, "_init_args_hst", _init_args_hst)
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def _patch(self, owner, name: str, fn) -> None:
        self._saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, fn)

    # -- bookkeeping -----------------------------------------------------------------
    def _record(self, executor, args_dev, args_hst, kwargs, kwargs_hst) -> None:
        """Remember each tensor argument's host address range and its name."""
        self.launches += 1
        try:
            params = inspect.getfullargspec(executor.fn).args
        except TypeError:
            params = []
        pairs = list(zip(params, args_dev, args_hst)) + [(k, kwargs[k], kwargs_hst[k]) for k in kwargs]
        for param, dev, hst in pairs:
            if not hasattr(hst, "untyped_storage"):
                continue
            storage = hst.untyped_storage()
            start = storage.data_ptr()
            self._ranges[start] = (start + storage.nbytes(), self._name_of(dev, param))

    def _name_of(self, dev, param: str) -> str:
        ptr = dev.untyped_storage().data_ptr()
        for name, t in self.names.items():
            if hasattr(t, "untyped_storage") and t.untyped_storage().data_ptr() == ptr:
                return name
        return param

    def _count(self, table: dict, ptrs, mask) -> None:
        addresses = np.asarray(ptrs.data)
        active = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
        live = addresses[active].astype(np.uint64)
        if self.distinct:
            live = np.unique(live)
        if live.size == 0:
            return
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        left = live.size
        for start, (end, name) in self._ranges.items():
            n = int(np.count_nonzero((live >= start) & (live < end)))
            if n:
                table[name] += n * size
                left -= n
        if left:
            table["?"] += left * size

"""The tuned-config cache: what a launch's key is, and the file that holds
one tuned configuration per key.

A configuration (``Config``) is what a generated launcher takes besides its
inputs: one block size per tiled wire (``block_q``, ``block_x``),
``num_warps`` and ``num_stages``, and for an attention kernel ``tma`` and
``chunk``.  The cache is one JSON file, ``$NAPKIN_CACHE/autotune.json``
(default ``~/.cache/napkin``), keyed by (diagram source hash, device name,
the inputs' float dtypes, shape bucket), the bucket being each symbolic
wire's size rounded up to a power of two.  A new sequence length in a tuned
bucket reuses the config.  Writers lock it (files.locked) and rename a whole
new file over it (files.write_atomic).

The run-time half (key, path, lookup) lives in templates/autotune.py.jinja so
the code generator can inline it into a generated module, which may import
only torch and triton.  This module renders that same template and executes
it: the writer here and the reader there share one definition of the key.
napkin.autotune fills the cache.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from . import files, ir

SCHEMA = "napkin-autotune/2"   # the run-time reader's (templates/autotune.py.jinja); /2: keys name dtypes


# --------------------------------------------------------------------------
# The run-time snippet: rendered from the template, also used here.
# --------------------------------------------------------------------------

def runtime_source(diagram_hash: str, wires: Sequence[str]) -> str:
    """The cache-reading code for a generated module (see the template)."""
    import jinja2

    from .resources import data_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    text = env.get_template("autotune.py.jinja").render(diagram_hash=diagram_hash, wires=repr(tuple(wires)),
                                                             dims="()")
    return text.strip("\n") + "\n"


@functools.lru_cache(maxsize=1)
def _runtime() -> dict:
    namespace: dict = {}
    exec(compile(runtime_source("", ()), "<napkin autotune runtime>", "exec"), namespace)
    return namespace


def cache_path() -> Path:
    return Path(_runtime()["_autotune_cache_path"]())


def shape_bucket(sizes: Mapping[str, int], wires: Sequence[str]) -> tuple[tuple[str, int], ...]:
    return _runtime()["_autotune_bucket"](sizes, tuple(wires))


def cache_key(diagram_hash: str, device_name: str, classes: Mapping[str, object], sizes: Mapping[str, int],
              wires: Sequence[str], kind: str = "") -> str:
    """The cache key of a launch: kind "" for the forward, "bwd" for the
    backward's dQ kernel, "bwd_kv" for its dK/dV kernel.  ``classes``: each
    declared float dtype's torch dtype (or its name) at the launch, as the
    launcher's _bind finds them (``input_classes`` for inputs as declared)."""
    return _runtime()["_autotune_key"](diagram_hash, device_name, dict(classes), sizes, tuple(wires), kind)


def input_classes(diagram: ir.Diagram) -> dict[str, str]:
    """The dtype classes of a launch whose float inputs have their declared
    dtypes (what napkin bench passes): declared -> torch dtype name."""
    return {t.dtype: ir.TORCH_NAMES[t.dtype] for t in diagram.inputs
            if t.dtype in ir.FLOAT_DTYPES and t.dtype in ir.TORCH_NAMES}


def device_name(device) -> str:
    return _runtime()["_autotune_device_name"](device)


def diagram_hash(source_text: str) -> str:
    """sha256 of the diagram's source text: the generated module's SOURCE_HASH."""
    return hashlib.sha256(source_text.encode()).hexdigest()


def symbolic_wires(diagram: ir.Diagram) -> tuple[str, ...]:
    return tuple(w.name for w in diagram.wires if w.size is None)


# --------------------------------------------------------------------------
# The cached value: a launcher's options.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    blocks: tuple[tuple[str, int], ...]   # (wire, block) in schedule order
    num_warps: int
    num_stages: int
    tma: Optional[bool] = None           # the kernel's TMA descriptors (launcher tma=); None: not set
    chunk: Optional[int] = None          # the forward's chunk of the streamed wire (launcher chunk=); None: not set

    def kwargs(self) -> dict:
        """The launcher options: block_<wire>=..., num_warps=..., num_stages=...,
        and tma=... and chunk=... when the config sets them."""
        out = {f"block_{w}": b for w, b in self.blocks}
        out.update(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.tma is not None:
            out.update(tma=self.tma)
        if self.chunk is not None:
            out.update(chunk=self.chunk)
        return out

    @staticmethod
    def from_kwargs(options: Mapping[str, int]) -> "Config":
        """The config of launcher options; an entry cached before tma= or chunk= existed has none (None)."""
        blocks = tuple((k[len("block_"):], int(v)) for k, v in options.items() if k.startswith("block_"))
        tma, chunk = options.get("tma"), options.get("chunk")
        return Config(blocks, int(options["num_warps"]), int(options["num_stages"]),
                      None if tma is None else bool(tma), None if chunk is None else int(chunk))


# --------------------------------------------------------------------------
# The cache file.
# --------------------------------------------------------------------------

@dataclass
class Cache:
    path: Path = field(default_factory=cache_path)

    def entries(self) -> dict:
        return _runtime()["_autotune_read"](str(self.path))

    def _beside(self, suffix: str) -> Path:
        """A file next to the cache: its lock, the probe of a write, a set-aside old cache."""
        return self.path.with_name(self.path.name + suffix)

    def get(self, key: str) -> Optional[Config]:
        """The entry's config when a launch would take it (the run-time reader's
        test, _autotune_config) and it sets num_warps and num_stages, as every
        entry the tuner writes does, else None: on those the tuner and the
        launcher agree (a hand-made entry of blocks alone the launcher takes
        and this does not)."""
        config = _runtime()["_autotune_config"](self.entries().get(key))
        if config is None or "num_warps" not in config or "num_stages" not in config:
            return None
        return Config.from_kwargs(config)

    def put(self, key: str, config: Config, **facts) -> None:
        """Store (replace) one entry; the others are kept, also ones another
        process wrote meanwhile: the read, change and write hold a lock (a
        file beside the cache), and the write is a rename, so a reader never
        sees half a file.  A file there that is no readable cache of this
        schema (damaged, or an older napkin's) is kept as <name>.old, with a
        warning, not overwritten unseen.  OSError when it cannot write."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with files.locked(self._beside(".lock")):
            entries = self.entries()
            if not entries and self.path.is_file() and not _empty_cache(self.path):
                old = self._beside(".old")
                os.replace(self.path, old)
                warnings.warn(f"{self.path} was no readable {SCHEMA} cache (damaged, or another napkin's): "
                              f"moved to {old}, a new cache started", stacklevel=2)
            entries[key] = {"config": config.kwargs(), **facts}
            text = json.dumps({"schema": SCHEMA, "entries": dict(sorted(entries.items()))}, indent=1) + "\n"
            files.write_atomic(self.path, text)

    def unwritable(self) -> Optional[str]:
        """Why ``put`` could not write here, in words, or None: asked before a
        tuning spends its time (napkin bench --autotune)."""
        if self.path.is_dir():
            return f"{self.path} is a folder"
        probe = self._beside(".probe")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with files.locked(self._beside(".lock")):
                files.write_atomic(probe, "")
            probe.unlink()
        except OSError as err:
            return files.why_not(err, self.path)
        return None


def _empty_cache(path: Path) -> bool:
    """Whether ``path`` holds an empty file or a cache of this schema with no entries."""
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if text.strip() else {"schema": SCHEMA, "entries": {}}
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("schema") == SCHEMA and data.get("entries") == {}


def entry_count(entry: Mapping, name: str) -> int:
    """A count a cache entry records (timed, failed, skipped), 0 when it holds no whole number >= 0."""
    value = entry.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

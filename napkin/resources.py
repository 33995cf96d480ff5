"""Where napkin's data files live: the grammar and the Jinja templates.

They sit at the top of the repository (``grammars/``, ``templates/``) and are
installed as the package data ``napkin.grammars`` / ``napkin.templates`` (see
pyproject.toml), so an installed, non-editable napkin finds them too.
"""
from __future__ import annotations

import importlib.resources
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def data_dir(name: str) -> Path:
    """The folder holding napkin's ``grammars`` or ``templates``."""
    try:
        found = importlib.resources.files(f"napkin.{name}")
        path = Path(str(found))
        if path.is_dir():
            return path
    except ModuleNotFoundError:
        pass
    path = _REPO / name
    if path.is_dir():
        return path
    raise RuntimeError(f"napkin is installed without its {name}/ folder")


def grammar_text() -> str:
    return (data_dir("grammars") / "ncd.lark").read_text(encoding="utf-8")

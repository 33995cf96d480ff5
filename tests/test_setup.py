"""Cheap checks that packaging, CI, README and docs agree with each other.

Nothing here installs anything: the real install is exercised by .ci/run
itself (it runs install.sh before the tests).
"""
from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

import napkin
from napkin.parse import parse

REPO = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _code_blocks(markdown: str, lang: str | None = None) -> list[str]:
    """The fenced code blocks of a markdown text, optionally of one language."""
    blocks = re.findall(r"^```([\w+-]*)\n(.*?)^```\s*$", markdown, flags=re.S | re.M)
    return [body for tag, body in blocks if lang is None or tag == lang]


# --------------------------------------------------------------------------
# pyproject.toml
# --------------------------------------------------------------------------

def test_pyproject_declares_the_console_script():
    assert _pyproject()["project"]["scripts"] == {"napkin": "napkin.cli:main"}


def test_pyproject_ships_grammar_templates_and_profiles_as_package_data():
    tool = _pyproject()["tool"]["setuptools"]
    assert {"napkin", "napkin.grammars", "napkin.templates"} <= set(tool["packages"])
    assert tool["package-dir"] == {"napkin.grammars": "grammars", "napkin.templates": "templates"}
    data = tool["package-data"]
    assert "*.toml" in data["napkin"]
    assert "*.lark" in data["napkin.grammars"]
    assert "*.jinja" in data["napkin.templates"]
    # The folders the mapping points at exist and hold what the globs name.
    assert (REPO / "grammars" / "ncd.lark").is_file()
    assert (REPO / "templates").is_dir()


def test_pyproject_lists_every_subpackage():
    """A subpackage missing from the explicit list would be left out of a
    non-editable install (and only there), so compare with the tree."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "napkin").rglob("*.py")
             if "__pycache__" not in p.parts}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"
    for folder in ("grammars", "templates"):  # regular packages once installed
        assert (REPO / folder / "__init__.py").is_file()


def test_pyproject_version_and_dependencies():
    project = _pyproject()["project"]
    assert project["dynamic"] == ["version"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "napkin.__version__"}
    assert napkin.__version__ == "0.1.0"
    names = {re.split(r"[<>=!~ \[]", dep)[0] for dep in project["dependencies"]}
    assert names == {"lark", "interegular", "jinja2", "torch", "triton", "numpy", "graphviz"}
    assert set(project["optional-dependencies"]["test"]) == {"pytest", "hypothesis", "pytest-xdist"}
    # napkin reads its TOML files with tomllib (3.11); install.sh refuses what pyproject refuses
    assert project["requires-python"] == ">=3.11"
    assert "sys.exit(sys.version_info < (3, 11))" in (REPO / "install.sh").read_text()


# --------------------------------------------------------------------------
# README <-> .ci/run <-> install.sh
# --------------------------------------------------------------------------

def _readme_setup_commands() -> list[str]:
    """The README's first two code blocks: the two set-up commands."""
    blocks = _code_blocks((REPO / "README.md").read_text())
    return [b.strip() for b in blocks[:2]]


def test_readme_opens_with_the_two_setup_commands():
    assert _readme_setup_commands() == ["./install.sh && napkin demo",
                                        "./install.sh --test && python -m pytest -q -n 2 --dist loadfile"]


def test_ci_runs_the_readmes_second_command():
    ci = (REPO / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    second = _readme_setup_commands()[1]
    assert any(line == second or line.startswith(second + " ||") for line in commands), commands
    assert "set -euo pipefail" in ci


def test_ci_treats_no_tests_as_failure():
    ci = (REPO / ".ci" / "run").read_text()
    # The status of pytest is kept and returned as is, so 5 (no tests) fails.
    assert '|| status=$?' in ci and 'exit "$status"' in ci
    assert "exit 0" not in ci


@pytest.mark.parametrize("script", ["install.sh", ".ci/run"])
def test_scripts_are_executable_bash(script):
    path = REPO / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text


def test_install_pins_torch_and_installs_editable():
    text = (REPO / "install.sh").read_text()
    assert '"torch==2.13.0"' in text
    assert "import torch" in text  # only when torch is missing
    assert "editable_mode=compat -e" in text
    assert "${PYTHON:-python3}" in text


# --------------------------------------------------------------------------
# docs/language.md: every ```ncd example parses and checks; every
# ```ncd-error example parses and is rejected with the text the doc shows
# --------------------------------------------------------------------------

LANGUAGE_DOC = REPO / "docs" / "language.md"


def _doc_examples(lang: str = "ncd") -> list[str]:
    return _code_blocks(LANGUAGE_DOC.read_text(), lang)


def test_language_doc_has_examples():
    assert len(_doc_examples()) >= 20
    assert len(_doc_examples("ncd-error")) >= 1


@pytest.mark.parametrize("index", range(len(_doc_examples()) if LANGUAGE_DOC.exists() else 0))
def test_language_doc_example_parses_and_checks(index):
    source = _doc_examples()[index]
    name = f"docs/language.md example {index + 1}"
    assert parse(source, name).name
    napkin.load_text(source, name)  # raises NapkinError if the doc went stale


def test_language_doc_error_examples_fail_as_shown():
    text = LANGUAGE_DOC.read_text()
    for source in _doc_examples("ncd-error"):
        parse(source, "st.ncd")
        with pytest.raises(napkin.NapkinError) as err:
            napkin.load_text(source, "st.ncd")
        # The doc shows the rendered error right after the example.
        assert str(err.value) in text


def test_readme_ncd_example_loads():
    (source,) = _code_blocks((REPO / "README.md").read_text(), "ncd")
    assert napkin.load_text(source, "README.md").name == "attention"

"""The command line: exit statuses, exact error text, the plugin hook, demo.

Most tests call ``napkin.cli.main`` in-process (fast); a few run
``python -m napkin`` as a subprocess to prove the real entry point works.
"""
from __future__ import annotations

import importlib.machinery
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import napkin
from napkin import cli
from napkin.errors import NapkinError

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.ncd"))
ATTENTION = (REPO / "examples" / "attention.ncd").read_text()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def variant(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """examples/attention.ncd with one edit, written to tmp_path/name."""
    assert old in ATTENTION, old
    path = tmp_path / name
    path.write_text(ATTENTION.replace(old, new, 1))
    return path


# --------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_check_accepts_every_example(capsys, path):
    code, out, err = run(capsys, "check", str(path))
    assert (code, err) == (0, "")
    d = napkin.load(path)
    assert out.startswith(f"{path}: ok ({len(d.wires)} wires, ")
    assert out.endswith(" outputs)\n") or out.endswith(" 1 output)\n")


def test_check_counts_wires_inputs_boxes_outputs(capsys):
    code, out, _ = run(capsys, "check", str(REPO / "examples" / "attention.ncd"),
                       str(REPO / "examples" / "matmul.ncd"))
    assert code == 0
    assert out.splitlines() == [
        f"{REPO}/examples/attention.ncd: ok (5 wires, 3 inputs, 4 boxes, 2 outputs)",
        f"{REPO}/examples/matmul.ncd: ok (3 wires, 2 inputs, 1 box, 1 output)",
    ]


# Each case: an edit to attention.ncd and the exact text napkin must print.
BAD = {
    "typo": (
        "P[b, h, q, x] = softmax[x](S)", "P[b, h, q, x] = softmx[x](S)",
        "{f}:16:17: unknown reduction 'softmx'\n"
        "    P[b, h, q, x] = softmx[x](S)                # normalise along the keys\n"
        "                    ^^^^^^\n"
        "  hint: reductions are sum, max, min, logsumexp, softmax\n"),
    "syntax": (
        "in V[b, h, x, d] : fp16", "in V[b, h, x, d] fp16",
        "{f}:13:18: unexpected 'fp16'\n"
        "    in V[b, h, x, d] fp16\n"
        "                     ^^^^\n"
        "  hint: expected ':'\n"),
    "unknown_wire": (
        "sum[x](P * V)", "sum[y](P * V)",
        "{f}:17:24: unknown wire 'y' in sum[y]\n"
        "    O[b, h, q, d] : fp16 = sum[y](P * V)         # PV\n"
        "                           ^^^^^^^^^^^^^\n"),
    "unknown_tensor": (
        "sum[x](P * V)", "sum[x](P * W)",
        "{f}:17:35: unknown name 'W'\n"
        "    O[b, h, q, d] : fp16 = sum[x](P * W)         # PV\n"
        "                                      ^\n"),
    "size_conflict": (
        "wire d = 64              # fixed", "wire d = 64\nwire d = 128",
        "{f}:10:6: one wire given two sizes: 'd' is 128 here but 64 at line 9\n"
        "    wire d = 128\n"
        "         ^\n"),
    "over_capacity": (
        "q by 128", "q by 4096",
        "{f}:27:9: tiles at level smem need 3702784 bytes but its capacity is 232448 bytes (h100): "
        "over by 3470336 bytes\n"
        "      level smem {{\n"
        "            ^^^^\n"
        "  hint: biggest tiles: S 1048576 bytes, P 1048576 bytes, O 1048576 bytes; "
        "smaller blocks shrink them (napkin cost --tune finds blocks that fit)\n"),
    "hostile_name": (
        "wire b, h, q, x ", "wire b, h, q, x, lambda ",
        "{f}:8:18: 'lambda' is a Python keyword\n"
        "    wire b, h, q, x, lambda          # symbolic: bound from tensor shapes at call time\n"
        "                     ^^^^^^\n"
        "  hint: rename it: names become Python identifiers in the generated code\n"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_check_reports_errors_exactly(capsys, tmp_path, case):
    old, new, expected = BAD[case]
    path = variant(tmp_path, f"{case}.ncd", old, new)
    code, out, err = run(capsys, "check", str(path))
    assert code == 1
    assert out == ""
    assert "Traceback" not in err
    assert err == expected.format(f=path)


def test_check_goes_on_after_a_bad_file(capsys, tmp_path):
    bad = variant(tmp_path, "bad.ncd", "softmax[x]", "softmx[x]")
    good = REPO / "examples" / "causal.ncd"
    code, out, err = run(capsys, "check", str(bad), str(good), str(tmp_path / "missing.ncd"))
    assert code == 1
    assert out == f"{good}: ok (5 wires, 3 inputs, 4 boxes, 2 outputs)\n"
    assert f"{bad}:16:17: unknown reduction 'softmx'" in err
    assert f"{tmp_path}/missing.ncd: cannot read {tmp_path}/missing.ncd: No such file or directory" in err


# --------------------------------------------------------------------------
# global flags and internal errors
# --------------------------------------------------------------------------

def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert (code, out) == (0, "napkin 0.1.0\n")


def test_help_lists_the_subcommands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert out.startswith("usage: napkin ")
    for word in ("check", "compile", "demo", "--traceback", "--version"):
        assert word in out


def test_no_subcommand_is_a_usage_error(capsys):
    code, _, err = run(capsys)
    assert code == 2
    assert "usage: napkin" in err


def _explode(*args, **kwargs):
    raise RuntimeError("boom")


def test_internal_error_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(napkin, "load", _explode)
    code, out, err = run(capsys, "check", str(EXAMPLES[0]))
    assert code == 2
    assert err.endswith("napkin: internal error: RuntimeError: boom "
                        "(this is a bug; rerun with --traceback for details)\n")
    assert "Traceback" not in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_traceback_flag_shows_the_traceback(capsys, monkeypatch, where):
    monkeypatch.setattr(napkin, "load", _explode)
    argv = ["--traceback", "check", str(EXAMPLES[0])]
    if where == "after":
        argv = ["check", str(EXAMPLES[0]), "--traceback"]
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert "RuntimeError: boom" in err


# --------------------------------------------------------------------------
# the plugin hook: register_cli(subparsers)
# --------------------------------------------------------------------------

def _fake_plugin(monkeypatch, name: str, module: types.ModuleType) -> None:
    module.__spec__ = importlib.machinery.ModuleSpec(f"napkin.{name}", None)
    monkeypatch.setitem(sys.modules, f"napkin.{name}", module)
    monkeypatch.setattr(cli, "PLUGINS", (name,))


def test_plugins_register_subcommands(capsys, monkeypatch):
    plugin = types.ModuleType("napkin.fakeplugin")

    def register_cli(subparsers):
        p = subparsers.add_parser("fake", help="a plugin command")
        p.add_argument("word")
        p.set_defaults(func=lambda args: print(f"fake {args.word}") or 3)

    plugin.register_cli = register_cli
    _fake_plugin(monkeypatch, "fakeplugin", plugin)
    assert run(capsys, "fake", "hello")[:2] == (3, "fake hello\n")


def test_a_broken_plugin_does_not_break_check(capsys, monkeypatch):
    plugin = types.ModuleType("napkin.brokenplugin")
    plugin.register_cli = _explode
    _fake_plugin(monkeypatch, "brokenplugin", plugin)
    code, out, err = run(capsys, "check", str(EXAMPLES[0]))
    assert code == 0 and out.endswith("1 output)\n")
    assert "napkin.brokenplugin are unavailable: RuntimeError: boom" in err
    # With --traceback the broken plugin is fatal, so its traceback shows.
    code, _, err = run(capsys, "--traceback", "check", str(EXAMPLES[0]))
    assert code == 2 and "Traceback" in err


def test_a_missing_plugin_is_skipped(capsys, monkeypatch):
    monkeypatch.setattr(cli, "PLUGINS", ("no_such_module_here",))
    assert run(capsys, "check", str(EXAMPLES[0]))[0] == 0


# --------------------------------------------------------------------------
# compile and demo
# --------------------------------------------------------------------------

def test_compile_writes_a_module_or_summarises(capsys, tmp_path):
    code, out, err = run(capsys, "compile", str(REPO / "examples" / "matmul.ncd"), "-o", str(tmp_path))
    assert code == 0, err
    assert out == f"wrote {tmp_path / 'matmul.py'}\n"
    assert (tmp_path / "matmul.py").is_file()


def test_compile_reports_errors(capsys, tmp_path):
    bad = variant(tmp_path, "bad.ncd", "softmax[x]", "softmx[x]")
    code, out, err = run(capsys, "compile", str(bad), "-o", str(tmp_path))
    assert code == 1 and f"{bad}:16:17: unknown reduction 'softmx'" in err
    assert not (tmp_path / "attention.py").exists()
    # nothing half-written: not even the output folder
    code, out, err = run(capsys, "compile", str(bad), "-o", str(tmp_path / "gen"))
    assert code == 1 and not (tmp_path / "gen").exists()


def test_compile_into_what_is_no_folder_is_a_user_error(capsys, tmp_path):
    """-o naming a file (or a folder below one) was an internal error
    (FileExistsError, exit 2) that also stopped the files after it."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in (afile, afile / "sub"):
        code, _, err = run(capsys, "compile", str(REPO / "examples" / "matmul.ncd"), str(REPO / "examples" /
                                                                                         "causal.ncd"), "-o", str(out))
        assert code == 1, err
        assert f"matmul.ncd: cannot write {out / 'matmul.py'}: {afile} is a file, not a folder" in err
        assert f"causal.ncd: cannot write {out / 'causal.py'}: {afile} is a file, not a folder" in err


def test_a_module_that_cannot_be_written_leaves_no_init_behind(capsys, tmp_path):
    """__init__.py was written first: a module the folder refused (here a folder in its place)
    left a new __init__.py in an -o folder the failed compile should not have touched."""
    out = tmp_path / "out"
    (out / "attention.py").mkdir(parents=True)
    code, _, err = run(capsys, "compile", str(REPO / "examples" / "attention.ncd"), "-o", str(out))
    assert code == 1 and f"cannot write {out / 'attention.py'}" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["attention.py"]


def test_render_report_and_plan_into_a_file_name_the_file(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    example = str(REPO / "examples" / "attention.ncd")
    for argv in (["render", example, "-o", str(afile / "x.svg")], ["report", example, "-o", str(afile / "x.html")],
                 ["plan", example, "--devices", "2", "-D", "b=1", "-D", "h=16", "-D", "q=4096", "-D", "x=4096",
                  "--emit", str(afile / "x.ncd")]):
        code, _, err = run(capsys, *argv)
        assert code == 1 and f"{afile} is a file, not a folder" in err, (argv, err)
    code, _, err = run(capsys, "plan", example, "--devices", "2", "-D", "b=1", "-D", "h=16", "-D", "q=4096",
                       "-D", "x=4096", "--emit", str(tmp_path))       # a folder: was IsADirectoryError, exit 2
    assert code == 1 and f"cannot write {tmp_path}: " in err, err
    assert afile.read_text() == ""


@pytest.mark.parametrize("length", [230, 240, 252])
def test_a_long_diagram_name_is_written_where_its_module_name_fits(capsys, tmp_path, monkeypatch, length):
    """The temporary file was .NAME.py.XXXXXXXX.tmp, 14 bytes longer than NAME.py: a
    240-character diagram name (a 243-byte file name, which Linux allows) failed with
    "File name too long" (names2 hunt).  The temporary name is no longer than the module's."""
    import tempfile

    name = "a" * length
    made = []
    mkstemp = tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", lambda **kw: made.append(mkstemp(**kw)) or made[-1])
    path = variant(tmp_path, "long.ncd", "diagram attention", f"diagram {name}")
    code, out, err = run(capsys, "compile", str(path), "-o", str(tmp_path / "gen"))
    assert code == 0, err
    assert out == f"wrote {tmp_path / 'gen' / (name + '.py')}\n"
    assert all(len(Path(tmp).name) <= len(name + ".py") for _, tmp in made) and made
    assert sorted(p.name for p in (tmp_path / "gen").iterdir()) == ["__init__.py", name + ".py"]


def test_compiled_modules_are_readable_as_the_umask_says(capsys, tmp_path):
    import os
    import stat

    code, _, err = run(capsys, "compile", str(REPO / "examples" / "matmul.ncd"), "-o", str(tmp_path))
    assert code == 0, err
    umask = os.umask(0)
    os.umask(umask)
    for name in ("matmul.py", "__init__.py"):   # mkstemp's 0600 once stayed on them
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask


def test_a_rewrite_goes_through_a_link_keeps_the_mode_and_spares_a_read_only_file(capsys, tmp_path, monkeypatch):
    """The rename replaced a symbolic link with a plain file (the module it pointed to stayed
    stale) and gave a 0600 file the umask's 0644; a file its owner may not write was replaced
    too (atomic hunt).  Root may write anything, so the read-only case asks os.access as an
    ordinary owner would be answered."""
    import os
    import stat

    (tmp_path / "real").mkdir()
    (tmp_path / "gen").mkdir()
    (tmp_path / "real" / "matmul.py").write_text("OLD")
    os.chmod(tmp_path / "real" / "matmul.py", 0o600)
    (tmp_path / "gen" / "matmul.py").symlink_to(tmp_path / "real" / "matmul.py")
    code, _, err = run(capsys, "compile", str(REPO / "examples" / "matmul.ncd"), "-o", str(tmp_path / "gen"))
    assert code == 0, err
    assert (tmp_path / "gen" / "matmul.py").is_symlink()
    assert (tmp_path / "real" / "matmul.py").read_text().startswith('"""matmul')
    assert stat.S_IMODE((tmp_path / "real" / "matmul.py").stat().st_mode) == 0o600
    picture = tmp_path / "ro.dot"
    picture.write_text("KEEP")
    monkeypatch.setattr(os, "access", lambda path, how, **kw: Path(path) != picture)
    code, _, err = run(capsys, "render", str(REPO / "examples" / "matmul.ncd"), "-o", str(picture))
    assert code == 1 and err == f"{picture}: cannot write {picture}: it is read-only\n"
    assert picture.read_text() == "KEEP" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_two_files_of_one_diagram_name_do_not_overwrite_each_other(capsys, tmp_path):
    twin = tmp_path / "twin.ncd"
    twin.write_text((REPO / "examples" / "causal.ncd").read_text().replace("diagram causal", "diagram attention"))
    code, out, err = run(capsys, "compile", str(REPO / "examples" / "attention.ncd"), str(twin), "-o",
                         str(tmp_path / "gen"))
    assert code == 1 and out == f"wrote {tmp_path / 'gen' / 'attention.py'}\n"
    assert err == (f"{twin}: diagram attention was compiled from {REPO / 'examples' / 'attention.ncd'} already: "
                   f"{tmp_path / 'gen' / 'attention.py'} is not replaced\n")
    assert "where(x <= q" not in (tmp_path / "gen" / "attention.py").read_text()


def test_a_byte_order_mark_and_a_non_utf8_locale(tmp_path):
    """Some editors start a file with a UTF-8 byte-order mark (it was an
    'unexpected character'); and under LC_ALL=C compile re-read the file as
    ASCII (UnicodeDecodeError, exit 2) after check had read it as UTF-8."""
    import os

    path = tmp_path / "bom.ncd"
    path.write_bytes(b"\xef\xbb\xbf" + ("# caf\u00e9 \u2014 a comment\n" + ATTENTION).encode())
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    for argv in (["check", str(path)], ["compile", str(path), "-o", str(tmp_path / "gen")]):
        done = subprocess.run([sys.executable, "-m", "napkin", *argv], capture_output=True, text=True, env=env,
                              cwd=REPO)
        assert done.returncode == 0, done.stderr
    assert napkin.load(path) == napkin.load(REPO / "examples" / "attention.ncd")


def test_counts_below_one_are_usage_errors(capsys):
    for argv in (["cost", str(REPO / "examples" / "attention.ncd"), "--tune", "--top", "0"],
                 ["plan", str(REPO / "examples" / "gqa.ncd"), "--devices", "4", "--top", "-1"]):
        assert cli.main(argv) == 2
        assert "argument --top: expected a whole number of at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("extra, status, words", [
    # each printed one report and dropped the others' flags unseen (exit 0)
    (["--tune", "--dtypes", "fp32"], 2, "argument --dtypes: not allowed with argument --tune"),
    (["--dtypes", "fp32", "--capacities", "65536"], 2, "argument --capacities: not allowed with argument --dtypes"),
    (["--tune", "--backward"], 1, "napkin: --backward costs the schedule as written; --tune prints another report"),
    (["--top", "3"], 1, "napkin: --top is an option of --tune"),
    (["--objective", "transfers", "--top", "2"], 1, "napkin: --top and --objective are options of --tune"),
    # an empty list printed the plain report
    (["--dtypes", ""], 1, "--dtypes: '' is not a float dtype"),
    (["--capacities", ""], 1, "--capacities: '' is not a positive whole number of bytes"),
])
def test_cost_refuses_flags_it_would_ignore(capsys, extra, status, words):
    argv = ["cost", str(REPO / "examples" / "causal.ncd"), "-D", "b=1", "-D", "h=2", "-D", "q=256", "-D", "x=256"]
    assert cli.main(argv + extra) == status
    err = capsys.readouterr().err
    assert words in err


def test_render_and_report_keep_the_diagram(capsys, tmp_path):
    path = tmp_path / "keep.ncd"
    path.write_text(ATTENTION)
    for cmd in ("render", "report"):
        code, _, err = run(capsys, cmd, str(path), "-o", str(path))
        assert code == 1 and err == f"{path}: -o {path} is the diagram itself, which the output would replace\n"
    assert path.read_text() == ATTENTION
    code, _, err = run(capsys, "render", str(path), "-D", "unknown=5", "-o", str(tmp_path / "k.dot"))
    assert code == 1 and err.startswith(f"{path}: --size unknown=5: diagram attention has no wire 'unknown'")



def test_render_and_report_name_refusals_say_what_was_typed(capsys, monkeypatch, tmp_path):
    """Refusals contradicted the name typed (render hunt): -o .svg was told "the name must end in
    .svg" (it does; it has no stem), the report took -o x.htm while saying the name must end in
    .html, and without Graphviz `render att.dot -o att.svg` said "-o att.dot is the diagram
    itself" of a name napkin chose."""
    monkeypatch.chdir(tmp_path)
    example = str(REPO / "examples" / "attention.ncd")
    code, _, err = run(capsys, "render", example, "-o", ".svg")
    assert code == 1 and err == ".svg: the name is only a suffix: it needs a stem before .svg (say a.svg)\n"
    code, _, err = run(capsys, "report", example, "-o", ".html")
    assert code == 1 and err == ".html: the name is only a suffix: it needs a stem before .html (say a.html)\n"
    code, _, err = run(capsys, "report", example, "-o", "x.txt")
    assert code == 1 and err == "x.txt: -o x.txt: the report is an HTML page, so the name must end in .html or .htm\n"
    assert run(capsys, "report", example, "-o", "x.htm")[0] == 0
    (tmp_path / "att.dot").write_text(ATTENTION)
    from napkin import render
    monkeypatch.setattr(render, "dot_program", lambda: None)
    code, _, err = run(capsys, "render", "att.dot", "-o", "att.svg")
    assert code == 1 and err == ("att.dot: Graphviz's dot was not found, so the DOT text would go to att.dot "
                                 "instead of att.svg, and att.dot is the diagram itself; give -o a name with "
                                 "another stem, or " + render.INSTALL_HINT + "\n")
    assert (tmp_path / "att.dot").read_text() == ATTENTION and not (tmp_path / "att.svg").exists()
    # a pic.dot the user wrote is no drawing of this diagram: replaced, it was gone (atomic hunt);
    # napkin's own earlier drawing of it (compile --render again) is replaced
    (tmp_path / "pic.dot").write_text("digraph mine { a -> b }\n")
    code, _, err = run(capsys, "render", example, "-o", "pic.png")
    assert code == 1 and err == ("pic.dot: Graphviz's dot was not found, so the DOT text would go to pic.dot "
                                 "instead of pic.png, and pic.dot exists and is not a drawing of diagram "
                                 "attention: it is left as it is; give -o pic.dot to replace it, or "
                                 + render.INSTALL_HINT + "\n")
    assert (tmp_path / "pic.dot").read_text() == "digraph mine { a -> b }\n"
    (tmp_path / "pic.dot").unlink()
    for _ in range(2):
        assert run(capsys, "render", example, "-o", "pic.png")[0] == 0
    assert (tmp_path / "pic.dot").read_text().startswith('digraph "attention" {')

def test_demo_default_sizes_are_small_and_cover_symbolic_wires():
    d = napkin.load(REPO / "examples" / "gqa.ncd")
    assert cli._demo_sizes(d, {}, "gqa.ncd") == {"b": 1, "hk": 2, "g": 2, "q": 200, "x": 200}
    assert cli._demo_sizes(d, {"q": 7}, "gqa.ncd")["q"] == 7
    # a wire the kernels take index by index is small whatever its name: t grouped by 1 (one
    # program each), k looped around the stream of j (sum[k, j]); a name the demo knows keeps
    # its size where grouped by 1 (b), and any other wire is 64 (j)
    looped = napkin.load_text("""diagram lin
wire b, t, m, n, k, j
in X[b, t, m, k, j] : fp32
in W[k, j, n] : fp32
Y[b, t, m, n] : fp32 = sum[k, j](X * W)
out Y
schedule { level smem { group b by 1, t by 1, m by 16, n by 16
stream j by 16 } }
""")
    assert cli._demo_sizes(looped, {}, "lin.ncd") == {"b": 1, "t": 3, "m": 200, "n": 200, "k": 3, "j": 64}
    assert cli._demo_sizes(looped, {"k": 5}, "lin.ncd")["k"] == 5


def test_demo_sizes_tie_the_wires_a_relabel_reads_one_tensor_along():
    """doc[b, q] of doc[b, x]: q and x are one size.  --size q=90 left x at its default 200, and
    the module's example_inputs raised ValueError, reported as an internal error (a bug); now x
    takes q's size, and two unequal sizes are refused at the relabel."""
    path = REPO / "examples" / "document_mask.ncd"
    d = napkin.load(path)
    assert cli._demo_sizes(d, {"q": 90}, path) == {"b": 1, "h": 2, "q": 90, "x": 90}
    assert cli._demo_sizes(d, {"x": 33}, path)["q"] == 33
    with pytest.raises(NapkinError) as e:
        cli._demo_sizes(d, {"q": 90, "x": 80}, path)
    assert e.value.messages == ["--size: doc is read along q as well as x, so wires q (90) and x (80) must have "
                                "equal sizes"]
    assert e.value.diagnostics[0].loc.line == 13


def test_demo_finds_the_example_from_any_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert cli._find_demo_file(cli.DEMO_FILE) == REPO / "examples" / "attention.ncd"


@pytest.mark.parametrize("argv, message", [
    (["--size", "q"], "napkin: --size expects WIRE=N with N a positive whole number, not 'q'\n"),
    (["--size", "q=0"], "napkin: --size q=0: the size of q must be a positive whole number, not '0'\n"),
    (["--size", "q=4", "--size", "q=8"], "napkin: --size q=8: q is already given (q=4)\n"),
    (["--size", "z=3"], "{f}: --size z=3: diagram attention has no wire 'z'\n"),
    (["--size", "d=32"], "{f}: --size d=32: wire d is fixed at 64\n"),
    (["nowhere.ncd"], "napkin: no such file: nowhere.ncd\n"),
])
def test_demo_rejects_bad_arguments(capsys, monkeypatch, argv, message):
    monkeypatch.chdir(REPO)
    code, _, err = run(capsys, "demo", *argv)
    assert code == 1
    assert err.endswith(message.format(f="examples/attention.ncd"))


FAKE_MODULE = """
import torch

_NO_BACKWARD = "no backward for scale: a reason"

def example_inputs(sizes, dtype=torch.float16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(sizes["r"], sizes["n"], generator=gen)
    return {"X": X.to(dtype=dtype, device=device)}

def reference(X):
    assert X.dtype == torch.float64
    return X * 2, X.sum(-1)

def scale(X):
    assert X.dtype == torch.float16
    return (X.float() * 2 + ERROR).to(X.dtype), X.float().sum(-1)
"""
SCALE = "diagram scale\nwire r, n\nin X[r, n] : fp16\nY[r, n] : fp16 = 2 * X\ntotal[r] = sum[n](X)\nout Y, total\n"


# A module that trains: the demo takes its diagram's dtype (SCALE32's fp32) and
# checks the gradient autograd gives through it (off by GRAD_ERROR of dY)
# against the float64 reference's.  scale_backward marks it as training, as a
# generated module's NAME_backward does; the demo never calls it.
FAKE_TRAINING_MODULE = """
import torch

INPUTS = ("X",)

def example_inputs(sizes, dtype=torch.float16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(sizes["r"], sizes["n"], generator=gen).to(dtype=dtype, device=device),)

def reference(X):
    assert X.dtype == torch.float64
    return X * 2, X.sum(-1)

class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X):
        assert X.dtype == torch.float32
        return X * 2, X.sum(-1)

    @staticmethod
    def backward(ctx, dY, dtotal):
        return (2 + GRAD_ERROR) * dY + dtotal[:, None]

def scale(X):
    return _Scale.apply(X)

def scale_backward(*args, **kwargs):
    raise AssertionError("the demo trains through autograd")
"""


def _fake_passes(monkeypatch, error: float, calls: list, module: str = FAKE_MODULE):
    """Stand-ins for codegen.write_module and cost.summary_lines, so the demo's
    own work (sizes, import by path, float64 comparison, report) is tested
    whatever state the real passes are in."""
    def write_module(path, out_dir, claimed=None):
        target = Path(out_dir) / "scale.py"
        target.parent.mkdir(parents=True, exist_ok=True)  # as the real one does, once the diagram checks
        target.write_text(module.replace("GRAD_ERROR", repr(error)).replace("ERROR", repr(error)))
        calls.append(("write_module", Path(path).name))
        return target

    def summary_lines(diagram, sizes):
        calls.append(("summary_lines", diagram.name, dict(sizes)))
        return ["hbm traffic: 1 byte"]

    fakes = {("codegen", "write_module"): write_module, ("cost", "summary_lines"): summary_lines}
    real = cli._provided
    monkeypatch.setattr(cli, "_provided", lambda m, a: fakes.get((m, a)) or real(m, a))


@pytest.mark.parametrize("error, code", [(0.0, 0), (0.5, 1)])
def test_demo_compares_with_the_float64_reference(capsys, monkeypatch, tmp_path, error, code):
    (tmp_path / "scale.ncd").write_text(SCALE)
    monkeypatch.chdir(tmp_path)
    calls: list = []
    _fake_passes(monkeypatch, error, calls)
    got, out, err = run(capsys, "demo", "scale.ncd", "--size", "n=100")
    assert got == code, err
    assert calls == [("write_module", "scale.ncd"), ("summary_lines", "scale", {"r": 64, "n": 100})]
    lines = out.splitlines()
    import torch

    where = "the GPU" if torch.cuda.is_available() else "the CPU (Triton interpreter)"
    assert lines[0] == f"scale.ncd: diagram scale, sizes r=64, n=100, on {where}, float16 inputs"
    verdict = "ok" if error == 0 else "TOO LARGE"
    assert lines[1].startswith("  Y[64, 100] float16: max abs error ")
    assert re.search(rf"vs float64 reference \({verdict}, tolerance 0.02 x [0-9.]+\)$", lines[1]), lines[1]
    assert lines[2].startswith("  total[64] float32: max abs error ")
    assert lines[3:] == ["  gradients not checked: no backward for scale: a reason", "cost model:",
                         "  hbm traffic: 1 byte"]
    if code:
        assert err == "napkin demo: the kernel's outputs differ from the reference\n"
    assert "napkin_demo_scale" not in sys.modules  # the temporary module is dropped


@pytest.mark.parametrize("error, code", [(0.0, 0), (0.5, 1)])
def test_demo_checks_the_gradients_of_a_module_that_trains(capsys, monkeypatch, tmp_path, error, code):
    (tmp_path / "scale.ncd").write_text(SCALE.replace(": fp16", ": fp32"))
    monkeypatch.chdir(tmp_path)
    _fake_passes(monkeypatch, error, [], FAKE_TRAINING_MODULE)
    got, out, err = run(capsys, "demo", "scale.ncd", "--size", "n=100")
    assert got == code, err
    lines = out.splitlines()
    assert lines[0].endswith(", float32 inputs")   # the diagram's own dtype, not fp16
    verdict = "ok" if error == 0 else "TOO LARGE"
    assert [line.split(":")[0] for line in lines[1:4]] == ["  Y[64, 100] float32", "  total[64] float32",
                                                           "  dX[64, 100] float32"]
    assert all("(ok, tolerance 0.002 x " in line for line in lines[1:3]), lines
    assert f"({verdict}, tolerance 0.002 x " in lines[3], lines[3]
    assert lines[4:] == ["cost model:", "  hbm traffic: 1 byte"]
    if code:
        assert err == "napkin demo: the kernel's outputs differ from the reference\n"


@pytest.mark.parametrize("declared, cuda, want, why", [
    ("fp32", False, "float32", False), ("fp16", False, "float16", False), ("bf16", True, "bfloat16", False),
    ("bf16", False, "float16", True), ("fp64", False, "float32", False)])
def test_demo_runs_a_diagram_in_its_declared_dtype(declared, cuda, want, why):
    """bf16 on the CPU runs as fp16 (the interpreter's bf16 dot is wrong) and says so; the first
    float input the kernels take decides (not the integer ids before it; an fp64 Q leaves it to K)."""
    import torch

    diagram = napkin.load_text(f"diagram dt\nwire r, n\nin ids[r] : int32\nin Q[r, n] : {declared}\n"
                               "in K[r, n] : fp32\nY[r, n] = Q * K + ids\nout Y\n", "dt.ncd")
    dtype, note = cli._demo_dtype(diagram, cuda, torch)
    assert dtype == getattr(torch, want)
    assert (note is not None) == why


@pytest.mark.slow
def test_demo_takes_the_tolerance_at_the_outputs_scale(capsys):
    """A matmul over k = 1000 has outputs near 30, whose fp16 rounding alone is 0.015 or more: the
    demo said "TOO LARGE" (5.68e-02 against an absolute 0.02) of a kernel exact to fp16."""
    code, out, err = run(capsys, "demo", str(REPO / "examples" / "matmul.ncd"), "-D", "m=64", "-D", "n=64",
                         "-D", "k=1000")
    assert code == 0, out + err
    line = next(x for x in out.splitlines() if "max abs error" in x)
    err_v, scale = (float(v) for v in re.search(r"error ([0-9.e+-]+) .* x ([0-9.e+-]+)\)$", line).groups())
    assert 0 < err_v <= 0.02 * scale and scale > 10, line


def test_compile_render_draws_beside_the_module(capsys, monkeypatch, tmp_path):
    (tmp_path / "scale.ncd").write_text(SCALE)
    monkeypatch.chdir(tmp_path)
    _fake_passes(monkeypatch, 0.0, [])
    code, out, err = run(capsys, "compile", "scale.ncd", "-o", "gen", "--render")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "wrote gen/scale.py"
    # an SVG, or .dot text when graphviz's dot is missing
    assert lines[1] in ("wrote gen/scale.svg", "wrote gen/scale.dot")
    assert (tmp_path / lines[1].split()[1]).stat().st_size > 0


def test_demo_runs_the_kernel_and_compares(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, "demo", "--size", "q=70", "-D", "x=90")   # -D, as cost and render take it
    assert code == 0, err
    assert "sizes b=1, h=2, q=70, x=90" in out and "max abs error" in out
    for line in out.splitlines():
        if "max abs error" in line:
            assert "(ok," in line


def test_demo_says_the_lengths_it_drew(capsys, monkeypatch):
    """A length input (x < n[b]) is drawn in 1..|x|, a value per sequence: the demo says which,
    so its numbers can be read (at b = 1 a single length could be anything from 1 to |x|)."""
    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, "demo", "examples/ragged_decode.ncd", "-D", "b=3", "-D", "q=1", "-D", "x=100")
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if "lengths of" in line]
    drawn = [int(v) for v in line.rsplit(": ", 1)[1].rstrip(")").split(", ")]
    assert line.startswith("  (n: lengths of x drawn in 1..100: ") and len(drawn) == 3
    assert all(1 <= v <= 100 for v in drawn)
    assert "lengths of" not in run(capsys, "demo", "-D", "q=20", "-D", "x=20")[1]   # none without one
    # a scalar's one value (runtime_window's width) is "a length", and the demo passes, dt included
    code, out, err = run(capsys, "demo", "examples/runtime_window.ncd", "-D", "q=20", "-D", "x=20")
    assert code == 0, err
    assert re.search(r"^  \(w: a length of q drawn in 1\.\.20: [0-9]+\)$", out, re.M), out
    assert re.search(r"^  dt\[\] float32: max abs error .* \(ok, tolerance \(0\.002 \+ 4 float16 ulps x "
                     r"sqrt\(40 rows summed\)\) x ", out, re.M), out


# --------------------------------------------------------------------------
# the real entry point, as a subprocess
# --------------------------------------------------------------------------

def test_python_dash_m_napkin(tmp_path):
    bad = variant(tmp_path, "bad.ncd", "softmax[x]", "softmx[x]")
    proc = subprocess.run([sys.executable, "-m", "napkin", "check", *map(str, EXAMPLES), str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout.count(": ok (") == len(EXAMPLES)
    assert proc.stderr == BAD["typo"][2].format(f=bad)
    version = subprocess.run([sys.executable, "-m", "napkin", "--version"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (version.returncode, version.stdout) == (0, "napkin 0.1.0\n")


def test_a_closed_pipe_is_no_internal_error():
    """``napkin cost FILE | head -1``: the reader has gone before napkin
    writes; napkin stops quietly with the shell's status for SIGPIPE."""
    proc = subprocess.Popen([sys.executable, "-m", "napkin", "cost", str(REPO / "examples" / "causal.ncd")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()   # before the interpreter has even imported napkin
    err = proc.stderr.read()
    assert (proc.wait(timeout=120), err) == (141, "")


def test_napkin_demo_as_the_readme_runs_it(tmp_path):
    """`napkin demo` with no arguments, from another folder, with no
    TRITON_INTERPRET set: the demo must find the example and pick the
    interpreter itself on a machine without a GPU."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-m", "napkin", "demo"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{REPO / 'examples' / 'attention.ncd'}: diagram attention, "
                                  "sizes b=1, h=2, q=200, x=200, on ")
    # O and lse, then the gradients of Q, K and V through autograd
    assert proc.stdout.count("(ok, tolerance") == 5
    assert [line.split("[")[0] for line in proc.stdout.splitlines()[1:6]] == ["  O", "  lse", "  dQ", "  dK", "  dV"]
    assert "cost model:" in proc.stdout


def test_an_option_error_with_no_file_behind_it_is_signed_napkin(capsys):
    # it printed "<input>: ..." (the name of a diagram read from no file)
    code, out, err = run(capsys, "bench", str(REPO / "examples" / "attention.ncd"), "--seqlen", "0")
    assert code == 1 and out == ""
    assert err == "napkin: --seqlen expects positive whole numbers (1K = 1024), not '0'\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_output_that_cannot_be_written_is_the_users_error_not_a_bug():
    """napkin check ... > /dev/full said 'internal error ... this is a bug' (exit 2)."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "napkin", "check", str(REPO / "examples" / "attention.ncd")],
                              stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 1
    assert done.stderr == "napkin: cannot write the output: No space left on device\n"


def test_compile_errors_name_the_path_given_and_modules_not_depend_on_its_spelling(capsys, tmp_path, monkeypatch):
    """A code-generation refusal named the module header's label (the file
    name alone for a file outside the checkout) where the checker's errors
    name the path given; the header's source line changed with the spelling
    of a path outside the checkout (in/x.ncd, ../w/in/x.ncd, /abs/in/x.ncd)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "w").mkdir()
    src = tmp_path / "in" / "fp8.ncd"
    src.write_text((REPO / "examples" / "attention_fp8.ncd").read_text())
    code, _, err = run(capsys, "compile", str(src), "-o", str(tmp_path / "g"))
    assert code == 1 and err.startswith(f"{src}:14:4: napkin cannot emit a kernel for input V")
    good = tmp_path / "in" / "causal.ncd"
    good.write_text((REPO / "examples" / "causal.ncd").read_text())
    monkeypatch.chdir(tmp_path / "w")
    texts = set()
    for i, spelling in enumerate(["../in/causal.ncd", str(good), "../w/../in/causal.ncd"]):
        assert cli.main(["compile", spelling, "-o", str(tmp_path / f"g{i}")]) == 0
        texts.add((tmp_path / f"g{i}" / "causal.py").read_text())
    assert len(texts) == 1 and "causal.ncd" in texts.pop()


def test_cost_binds_a_relabels_wires_to_one_size(capsys, tmp_path):
    """A[n, k] of A[m, k] ties |n| to |m|, as the launcher does: cost priced m=1024 n=512, a
    problem no launch runs, and asked for n when only m was given (contract hunt)."""
    path = tmp_path / "gram.ncd"
    path.write_text("diagram gram\nwire m, n, k\nin A[m, k] : fp16\nC[m, n] : fp16 = sum[k](A * A[n, k])\n"
                    "out C\nschedule on h100 {\n  level hbm { hold A, C }\n"
                    "  level smem {\n    group m by 128, n by 128\n    stream k by 32\n  }\n}\n")
    code, _, err = run(capsys, "cost", str(path), "-D", "m=1024", "-D", "n=512", "-D", "k=256")
    assert code == 1 and err.splitlines() == [
        f"{path}:4:29: A is read along n as well as m, so wires n (512) and m (1024) must have equal sizes",
        "    C[m, n] : fp16 = sum[k](A * A[n, k])", "                                ^^^^^^^"], err
    code, out, _ = run(capsys, "cost", str(path), "-D", "m=1024", "-D", "k=256")
    assert code == 0 and out.splitlines()[0] == "napkin cost: diagram gram on h100, sizes m=1024 n=1024 k=256"


def test_writing_over_a_folder_names_the_target_not_its_temporary_file(tmp_path, monkeypatch, capsys):
    """`napkin render x.ncd -o pic.svg` with pic.svg a folder said "cannot write pic.svg:
    /tmp/.../.pic.svg.XXXX.tmp is a folder": files.why_not took mkstemp's absolute temporary
    name beside the relative target for another file in the way (today5 hunt)."""
    from napkin.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "pic.svg").mkdir()
    assert main(["render", str(REPO / "examples" / "matmul.ncd"), "-o", "pic.svg", "--no-costs"]) == 1
    err = capsys.readouterr().err
    assert "cannot write pic.svg: " in err and ".tmp" not in err


def test_compile_a_file_whose_name_is_not_utf8_or_has_spaces(tmp_path, capsys):
    """caf\\xe9.ncd (a Latin-1 name; any non-ASCII one under LC_ALL=C) reached the module's
    header as surrogate escapes and compile failed with an internal error (atomic hunt).
    The header shows the name with backslash escapes, shell-quoted."""
    latin = os.fsdecode(b"caf\xe9.ncd")
    spaced = "my diagram.ncd"
    for name, shown in ((latin, "'caf\\\\xe9.ncd'"), (spaced, "'my diagram.ncd'")):
        (tmp_path / name).write_text(ATTENTION)
        code, out, err = run(capsys, "compile", str(tmp_path / name), "-o", str(tmp_path / "g"))
        assert code == 0, err
        text = (tmp_path / "g" / "attention.py").read_text()
        assert f"regenerate with `napkin compile {shown}`" in text


def test_sigterm_cleans_up_the_demos_temporary_folder(tmp_path):
    """timeout or a batch system's limit send SIGTERM, which stopped napkin at once and left
    napkin-demo-* behind (atomic hunt); the command now unwinds, exit status 143."""
    import signal
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "napkin", "demo", str(REPO / "examples" / "attention.ncd")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("napkin-demo-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob("napkin-demo-*")), "the demo made no temporary folder"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert list(tmp_path.glob("napkin-demo-*")) == []


def test_a_sigterm_lost_in_a_finalizer_still_ends_the_run_as_one(monkeypatch):
    """A SIGTERM handled while a finalizer runs raises there, and Python ignores an exception
    from a finalizer ("Exception ignored in ..."): the run went on and exited 0, as
    test_sigterm_cleans_up_the_demos_temporary_folder once saw in CI. The run still ends 143."""
    import gc
    import signal

    from napkin import cli

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)   # handled here, inside __del__, and lost
            for _ in range(1000):                  # bytecodes for the handler to run between
                pass

    def run(argv, show_traceback):
        Finalized()
        gc.collect()
        return 0

    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_type.__name__))
    monkeypatch.setattr(cli, "_run", run)
    assert cli.main(["check", "x.ncd"]) == 143
    assert lost == ["_Terminated"]   # Python ignored it: without the record the run said 0


def test_an_accumulator_other_than_fp32_is_refused_at_its_line(capsys, tmp_path):
    """The refusal pointed at the schedule's first line, not at the accumulate statement that says bf16."""
    src = tmp_path / "acc.ncd"
    src.write_text((REPO / "examples" / "causal.ncd").read_text().replace("accumulate fp32", "accumulate bf16"))
    code, _, err = run(capsys, "compile", str(src), "-o", str(tmp_path / "g"))
    line = next(i for i, t in enumerate(src.read_text().splitlines(), 1) if "accumulate bf16" in t)
    assert code == 1 and err == (
        f"{src}:{line}:14: napkin cannot emit a kernel for diagram causal: napkin's kernels accumulate in fp32, "
        "not bf16\n      accumulate bf16\n                 ^^^^\n  hint: write 'accumulate fp32'\n")
    assert not (tmp_path / "g").exists() or not any((tmp_path / "g").iterdir())   # nothing half-written


def test_demo_checks_the_gradients_it_can_and_says_why_not_the_others(capsys, tmp_path):
    """sigmoid(S + beta): beta is read past the score box, which the backward has no kernel for. The demo
    passed it requiring a gradient and died on NotImplementedError as "internal error ... this is a bug";
    it now checks dQ, dK and dV and gives the module's reason for beta."""
    text = (REPO / "examples" / "sigmoid_attention.ncd").read_text()
    text = text.replace("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : fp16\nin beta : fp32")
    (tmp_path / "beta.ncd").write_text(text.replace("sigmoid(S - log(|x|))", "sigmoid(S + beta)"))
    code, out, err = run(capsys, "demo", str(tmp_path / "beta.ncd"), "-D", "q=20", "-D", "x=20")
    assert code == 0, err
    checked = [line.split("[")[0].strip() for line in out.splitlines() if "max abs error" in line]
    assert checked == ["O", "dQ", "dK", "dV"], out
    assert "  dbeta not checked: napkin cannot emit a backward for input beta: its gradient would need the path " \
           "past the score box" in out

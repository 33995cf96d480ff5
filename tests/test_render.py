"""Rendering: the DOT text (golden files and what it must show), drawing with
and without Graphviz, the HTML report and its charts, the CLI.

Golden files live in tests/golden/render/; refresh them with
``pytest tests/test_render.py --update-golden`` and review the diff.
"""
from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
import types
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest

import napkin
from napkin import render
from napkin.cli import main as cli_main
from napkin.render import costs as render_costs
from napkin.render.dot import box_uses, to_dot
from napkin.render.report import report_html
from napkin.render.roofline import roofline_svg, time_bars_svg

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden" / "render"
GOLDEN_EXAMPLES = ("attention", "attention_2d", "attention_2d_nodes", "ring_attention", "gqa",
                   "document_mask", "matmul")
HAVE_DOT = shutil.which("dot") is not None
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_dot = pytest.mark.skipif(not HAVE_DOT, reason="Graphviz's dot is not installed")


def load(name: str):
    return napkin.load(EXAMPLES / f"{name}.ncd")


def dot_of(name: str) -> str:
    return to_dot(load(name))


# --------------------------------------------------------------------------
# Reading the DOT text back (just enough for the assertions below).
# --------------------------------------------------------------------------

_EDGE = re.compile(r'^\s*"([^"]+)" -> "([^"]+)" \[(.*)\];$')
_NODE = re.compile(r'^\s*"([^"]+)" \[(.*)\];$')


def edges(text: str) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(source, destination) -> [(label, attributes)], with the label nodes
    (``e.N``) that labelled edges run through joined back up: ``label`` is the
    label node's, ``attributes`` the edge's own (colour, style, arrows)."""
    raw = [m.groups() for m in map(_EDGE.match, text.splitlines()) if m]
    labels = {m.group(1): m.group(2) for m in map(_NODE.match, text.splitlines())
              if m and re.fullmatch(r"e\.\d+", m.group(1))}
    into = {dst: src for src, dst, _ in raw if dst in labels}
    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for src, dst, attrs in raw:
        if dst in labels:
            continue
        if src in labels:
            out.setdefault((into[src], dst), []).append((labels[src], attrs))
        else:
            out.setdefault((src, dst), []).append(("", attrs))
    return out


def label(e, src: str, dst: str) -> str:
    """The plain text of the (first) edge from src to dst."""
    return plain(e[(src, dst)][0][0])


def attrs(e, src: str, dst: str) -> str:
    return e[(src, dst)][0][1]


def clusters_of(text: str) -> dict[str, tuple[str, ...]]:
    """node -> the clusters it is declared in, outermost first."""
    stack: list[str] = []
    where = {}
    for line in text.splitlines():
        opened = re.match(r"^\s*subgraph (cluster_\w+) \{$", line)
        if opened:
            stack.append(opened.group(1))
        elif line.strip() == "}" and stack:
            stack.pop()
        else:
            m = _NODE.match(line)
            if m:
                where[m.group(1)] = tuple(stack)
    return where


def cluster_titles(text: str) -> dict[str, str]:
    """cluster -> the plain text of its title (the first ``label=`` inside it)."""
    titles, current = {}, None
    for line in text.splitlines():
        opened = re.match(r"^\s*subgraph (cluster_\w+) \{$", line)
        if opened:
            current = opened.group(1)
        elif current and current not in titles and line.strip().startswith("label=<"):
            titles[current] = plain(line.strip()[len("label=<"):-2])
    return titles


def plain(label: str) -> str:
    """An HTML label's text without its tags."""
    return re.sub(r"<[^>]*>", "", label).replace("&#93;", "]").replace("&#8594;", "->")


# --------------------------------------------------------------------------
# Golden files.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name", GOLDEN_EXAMPLES)
def test_dot_matches_golden(name, update_golden):
    text = dot_of(name)
    golden = GOLDEN / f"{name}.dot"
    if update_golden:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"no golden file {golden}; run pytest --update-golden"
    assert text == golden.read_text(), f"{name}: DOT text changed; review and run pytest --update-golden"


def test_dot_is_deterministic():
    from napkin.printer import to_text
    assert dot_of("attention_2d") == dot_of("attention_2d")
    # A re-parsed copy of the same diagram (comments and layout gone) draws the same picture.
    d = load("gqa")
    assert to_dot(napkin.load_text(to_text(d), "copy.ncd")) == to_dot(d)


@needs_dot
@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.ncd")), ids=lambda p: p.stem)
def test_dot_accepts_every_example(path):
    svg = render.run_dot(to_dot(napkin.load(path)), "svg").decode()
    ET.fromstring(svg[svg.index("<svg"):])  # well-formed


# --------------------------------------------------------------------------
# What the picture shows.
# --------------------------------------------------------------------------

def test_each_wire_has_one_colour_everywhere():
    text = dot_of("attention")
    colours: dict[str, set[str]] = {}
    for colour, wire in re.findall(r'<font color="(#[0-9a-f]{6})">(\w+)</font>', text):
        colours.setdefault(wire, set()).add(colour)
    assert set(colours) >= {"b", "h", "q", "x", "d"}
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == len(colours), "two wires share a colour"
    # The parallel lines of an edge are the wires' colours, in order: Q -> S carries b h q.
    line = re.search(r'color="([^"]+)"', attrs(edges(text), "t.Q", "op.S")).group(1)
    assert line.split(":") == [next(iter(colours[w])) for w in ("b", "h", "q")]


def test_contracted_wires_meet_at_a_dot_beside_their_box():
    e = edges(dot_of("attention"))
    # d leaves Q and K, meets at one point, and only a stub runs into S.
    assert ("t.Q", "j.S.d") in e and ("t.K", "j.S.d") in e
    assert ("j.S.d", "op.S") in e
    assert 'arrowhead="none"' in attrs(e, "j.S.d", "op.S")
    # x is contracted in O: P and V meet; and nothing called d reaches S directly.
    assert ("op.P", "j.O.x") in e and ("t.V", "j.O.x") in e
    q_to_s = label(e, "t.Q", "op.S")
    assert "d" not in re.findall(r"\b(\w)\[", q_to_s) and "q[128]" in q_to_s


def test_broadcast_inputs_are_marked():
    e = edges(dot_of("attention"))
    k_label = label(e, "t.K", "op.S")
    assert "broadcast over q" in k_label and "re-read per q block" in k_label
    q_label = label(e, "t.Q", "op.S")
    # Q lacks x, but x is streamed, not grouped: no re-read is charged for it.
    assert "broadcast over x" in q_label and "re-read" not in q_label


def test_box_uses_lists_broadcasts_in_layout_order():
    d = load("alibi")
    uses = {u.tensor: u for u in box_uses(d, d.tensor("S"))}
    assert uses["slope"].broadcast == ("b", "q", "x")
    assert uses["Q"].summed == ("d",) and uses["Q"].kept == ("b", "h", "q")
    assert uses["K"].broadcast == ("q",)


def test_streamed_wire_is_dashed_and_grouped_labelled():
    e = edges(dot_of("attention"))
    assert 'style="dashed"' in attrs(e, "t.K", "op.S")          # K arrives in chunks along x
    assert 'style="dashed"' not in attrs(e, "t.Q", "op.S")
    assert "x~64" in label(e, "t.K", "op.S")
    e2 = edges(dot_of("attention_2d"))
    assert "q[2 dev][128]" in label(e2, "t.Q", "op.S")
    assert "x[2 dev]~64" in label(e2, "t.K", "op.S")


def test_packed_rows_are_named_in_the_legend():
    assert "packed: 16 (g, q) rows per program" in dot_of("flash_decoding")
    assert "packed" not in dot_of("gqa")          # its g by 1: one program per query head


def test_levels_are_nested_clusters_holding_their_tensors():
    where = clusters_of(dot_of("attention_2d"))
    assert where["t.Q"] == ("cluster_devices", "cluster_hbm")
    assert where["op.S"] == ("cluster_devices", "cluster_hbm", "cluster_smem")
    assert where["t.O"] == ("cluster_devices", "cluster_hbm")       # O is written back
    assert where["op.O"][-1] == "cluster_smem"                        # computed on chip
    assert where["peers.in"] == ("cluster_devices",)
    e = edges(dot_of("attention_2d"))
    assert "gathered over x" in label(e, "peers.in", "t.Q")
    assert "merged over x" in label(e, "t.O", "peers.out")
    ring = edges(dot_of("ring_attention"))
    assert "round the ring over x" in label(ring, "peers.in", "t.K")


def test_nodes_level_is_drawn_around_the_devices_level():
    text = dot_of("attention_2d_nodes")
    where = clusters_of(text)
    assert where["t.Q"] == ("cluster_nodes", "cluster_devices", "cluster_hbm")
    assert where["op.S"] == ("cluster_nodes", "cluster_devices", "cluster_hbm", "cluster_smem")
    assert where["peers.in"] == where["peers.out"] == ("cluster_nodes", "cluster_devices")
    titles = cluster_titles(text)
    assert "nodes: q[2 nodes]" in titles["cluster_nodes"] and "InfiniBand" in titles["cluster_nodes"]
    assert "devices: x[2 dev]" in titles["cluster_devices"] and "NVLink" in titles["cluster_devices"]
    e = edges(text)
    assert "q[2 nodes][128]" in label(e, "t.Q", "op.S")
    # Q is gathered along x (split inside a node), K and V along q (split across nodes).
    assert "gathered over x, NVLink within a node" in label(e, "peers.in", "t.Q")
    assert "gathered over q, InfiniBand across nodes" in label(e, "peers.in", "t.K")
    assert "merged over x, NVLink within a node" in label(e, "t.O", "peers.out")
    peers = plain(re.search(r'"peers\.in" \[.*label=<(.*)>\];', text).group(1))
    assert "InfiniBand across nodes: q; NVLink within a node: x" in peers


def test_a_wire_split_at_both_mesh_levels_shows_both_splits():
    text = (EXAMPLES / "attention_2d_nodes.ncd").read_text()
    text = text.replace("group x across 2       # grid columns", "group q across 2, x across 2  #")
    text = to_dot(napkin.load_text(text, "both.ncd"))
    e = edges(text)
    assert "q[2 nodes x 2 dev][128]" in label(e, "t.Q", "op.S")
    assert "gathered over q, InfiniBand across nodes and NVLink within a node" in label(e, "peers.in", "t.K")
    assert "grid 4 x 2" in plain(text)


def test_a_nodes_level_of_across_1_says_one_node_not_infiniband():
    """napkin plan --emit writes 'across 1' at a mesh level to say where the nodes
    are (16 GPUs on one node; one GPU a node); the picture titled such a level
    'InfiniBand across nodes' and its legend said 'split over 1 nodes'."""
    text = (EXAMPLES / "attention_2d.ncd").read_text()
    one = text.replace("  level devices {", "  level nodes { group q across 1, x across 1 }\n  level devices {", 1)
    t = plain(to_dot(napkin.load_text(one, "one_node.ncd")))
    assert "nodes &#183; one node" in t and "devices &#183; NVLink within a node" in t, t
    assert "InfiniBand" not in t and "1 nodes" not in t
    assert "q[1 node] not split: every device on one node" in t
    spread = text.replace("  level devices {", "  level nodes { group q across 2, x across 2 }\n  level devices {", 1)
    spread = re.sub(r"group q across 2 +# grid rows", "group q across 1", spread)
    spread = re.sub(r"group x across 2 +# grid columns[^\n]*", "group x across 1", spread)
    t = plain(to_dot(napkin.load_text(spread, "gpu_a_node.ncd")))
    assert "nodes &#183; InfiniBand across nodes" in t and "devices &#183; one GPU a node" in t, t
    assert "not split: one GPU a node" in t


def test_mesh_levels_without_a_nodes_level_name_no_links():
    text = dot_of("attention_2d")
    assert "cluster_nodes" not in text
    assert not re.search(r"\bnodes\b|NVLink|InfiniBand|within a node", plain(text))


def test_per_link_bytes_go_on_the_peer_devices_with_a_nodes_level():
    from napkin.render.dot import format_bytes
    d = load("attention_2d_nodes")
    report, why = render_costs.try_costs(d)
    if report is None:
        pytest.skip(f"cost pass unavailable: {why}")
    comm = report.devices
    assert comm.sent_across > 0 and comm.sent_within > 0
    text = to_dot(d, report)
    expected = f"sends {format_bytes(comm.sent_within)} within its node, {format_bytes(comm.sent_across)} across nodes"
    peers = re.search(r'"peers\.in" \[.*label=<(.*)>\];', text).group(1)
    assert expected in plain(peers) and plain(text).count(expected) == 1
    # A one-level mesh keeps its picture: the cost pass splits links there too, the picture does not.
    flat = load("attention_2d")
    flat_report, _ = render_costs.try_costs(flat)
    assert "within its node" not in to_dot(flat, flat_report)


def test_double_ring_is_named_and_k_v_bytes_are_labelled_once():
    """A ring over nodes is drawn as the double ring it runs as; K and V
    travel between devices as one cost row, labelled once with both names
    and the cost pass's bytes (on K's edge, the first to cross)."""
    from napkin.render.dot import format_bytes
    d = load("ring_attention_nodes")
    report, why = render_costs.try_costs(d)
    if report is None:
        pytest.skip(f"cost pass unavailable: {why}")
    text = plain(to_dot(d, report))
    assert "double ring of 2 nodes x 4 over x" in text
    row = sum(r.bytes_received for r in report.devices.rows if r.tensor == "K, V")
    assert text.count(f"between devices (K, V): {format_bytes(row)}") == 1
    assert "ring of 8" not in text


def test_unfused_schedule_writes_the_intermediate_out():
    text = (EXAMPLES / "attention.ncd").read_text().replace("hold Q, K, V, O, lse", "hold Q, K, V, O, lse, S")
    text = text.replace("hold S, P", "hold P")
    d = napkin.load_text(text, "unfused.ncd")
    text = to_dot(d)
    where, e = clusters_of(text), edges(text)
    assert where["t.S"][-1] == "cluster_hbm"
    assert ("op.S", "t.S") in e and ("t.S", "op.P") in e


def test_no_schedule_draws_no_clusters():
    text = (EXAMPLES / "matmul.ncd").read_text()
    text = text[:text.index("\nschedule")]
    d = napkin.load_text(text, "plain.ncd")
    dot = to_dot(d)
    assert "subgraph" not in dot
    assert ("t.A", "j.C.k") in edges(dot)


# --------------------------------------------------------------------------
# Bytes from the cost pass.
# --------------------------------------------------------------------------

def _fake_report():
    T = types.SimpleNamespace
    transfers = (T(boundary="hbm/smem", kernel=0, tensor="K", direction="load", bytes=268_435_456),
                 T(boundary="hbm/smem", kernel=0, tensor="O", direction="store", bytes=8_388_608))
    return T(transfers=transfers, devices=None, kernels=(T(index=0, boxes=("S", "P", "O", "lse")),),
             sizes=(("b", 1), ("h", 16)), per_device=False)


def test_bytes_go_on_the_edges_that_cross_the_boundary():
    text = to_dot(load("attention"), _fake_report())
    e = edges(text)
    assert "HBM->SMEM: 268 MB" in label(e, "t.K", "op.S")
    assert "SMEM->HBM: 8.39 MB" in label(e, "op.O", "t.O")
    assert "HBM->" not in label(e, "t.Q", "op.S")   # no figure given for Q
    assert text.count("268 MB") == 1                       # once, not on K's d edge too
    assert "bytes moved at b=1 h=16" in plain(text)


def test_real_cost_report_labels_every_crossing_edge():
    d = load("attention")
    report, why = render_costs.try_costs(d)
    if report is None:
        pytest.skip(f"cost pass unavailable: {why}")
    e = edges(to_dot(d, report))
    for tensor in ("Q", "K", "V"):
        assert "HBM->SMEM" in label(e, f"t.{tensor}", "op.S" if tensor != "V" else "op.O")


def test_picture_survives_a_failing_cost_pass(monkeypatch, tmp_path):
    import napkin.cost

    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")
    monkeypatch.setattr(napkin.cost, "analyse", broken)
    out = render.render_file(EXAMPLES / "attention.ncd", tmp_path / "a.dot")
    text = out.read_text()
    assert "op.S" in text and "HBM->" not in plain(text)
    assert render_costs.try_costs(load("attention"))[1].startswith("the cost pass failed")


# --------------------------------------------------------------------------
# Files and the command line.
# --------------------------------------------------------------------------

@needs_dot
@pytest.mark.parametrize("fmt,magic", [("svg", b"<?xml"), ("png", b"\x89PNG"), ("pdf", b"%PDF")])
def test_render_file_formats(tmp_path, fmt, magic):
    out = render.render_file(EXAMPLES / "matmul.ncd", tmp_path / f"m.{fmt}", costs=False)
    assert out == tmp_path / f"m.{fmt}"
    assert out.read_bytes().startswith(magic)


def test_without_dot_writes_the_dot_text_and_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(render, "dot_program", lambda: None)
    out = render.render_file(EXAMPLES / "matmul.ncd", tmp_path / "m.svg", costs=False)
    assert out == tmp_path / "m.dot" and out.read_text().startswith('digraph "matmul"')
    assert not (tmp_path / "m.svg").exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "install Graphviz" in err and "apt-get install graphviz" in err


def test_cli_render_and_report(tmp_path, capsys):
    target = tmp_path / "a.dot"
    assert cli_main(["render", str(EXAMPLES / "attention.ncd"), "-o", str(target), "--size", "q=1000"]) == 0
    assert "q=1000" in target.read_text()
    page = tmp_path / "r.html"
    assert cli_main(["report", str(EXAMPLES / "attention.ncd"), "-o", str(page)]) == 0
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert f"wrote {page}" in capsys.readouterr().out


def test_wires_of_no_default_size_draw_without_costs_and_say_which_sizes_to_give(tmp_path, capsys):
    """Wires napkin has no default for take 1024: batch and heads so make a
    launch grid past what the cost pass walks.  The picture, the report and
    compile --render failed on that legal diagram (exit 1); they draw without
    byte labels now and name the sizes to give."""
    text = (EXAMPLES / "causal.ncd").read_text()
    text = re.sub(r"\bb\b", "batch", re.sub(r"\bh\b", "heads", text))
    src = tmp_path / "renamed.ncd"
    src.write_text(text)
    assert cli_main(["render", str(src), "-o", str(tmp_path / "r.dot")]) == 0
    err = capsys.readouterr().err
    assert "drawn without byte counts" in err and "batch=1024, heads=1024" in err and "-D WIRE=N" in err
    assert "HBM->" not in plain((tmp_path / "r.dot").read_text())
    assert cli_main(["report", str(src), "-o", str(tmp_path / "r.html")]) == 0
    assert "give the wires&#x27; sizes with -D WIRE=N" in (tmp_path / "r.html").read_text()
    assert cli_main(["compile", str(src), "-o", str(tmp_path / "gen"), "--render"]) == 0
    assert (tmp_path / "gen" / "causal.svg").exists() or (tmp_path / "gen" / "causal.dot").exists()
    given = ["-D", "batch=1", "-D", "heads=2", "-D", "q=64", "-D", "x=64"]
    assert cli_main(["render", str(src), "-o", str(tmp_path / "s.dot"), *given]) == 0
    assert "HBM->" in plain((tmp_path / "s.dot").read_text())


def test_a_failed_write_leaves_the_picture_or_report_that_was_there(tmp_path):
    """A file-size limit (or a full disk) stopped the write half-way and left
    a cut-off page where a good one had been: written through a temporary
    file and a rename now."""
    import resource
    import sys

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))   # Python ignores SIGXFSZ: EFBIG

    page = tmp_path / "r.html"
    page.write_text("the good report\n")
    done = subprocess.run([sys.executable, "-m", "napkin", "report", str(EXAMPLES / "causal.ncd"), "-o", str(page)],
                          preexec_fn=limited, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 1 and f"cannot write {page}" in done.stderr
    assert page.read_text() == "the good report\n" and [p.name for p in tmp_path.iterdir()] == ["r.html"]


@pytest.mark.parametrize("argv,words", [
    (["render", "FILE", "-o", "x.jpg"], "unknown picture format '.jpg'"),
    (["render", "FILE", "-o", "x.dot", "--size", "zz=4"], "has no wire 'zz'"),
    (["render", "FILE", "-o", "x.dot", "--size", "d=32"], "fixed at 64"),
    (["render", "FILE", "-o", "x.dot", "--size", "q=-1"], "positive whole number"),
    (["report", "FILE", "-o", "x.html", "--device", "tpu9"], "unknown device profile"),
    (["render", "FILE", "-o", "x.svg", "--device", "tpu9"], "unknown device profile"),
    # with the byte counts off, the same mistakes were taken silently
    (["render", "FILE", "-o", "x.dot", "--no-costs", "--size", "zz=4"], "has no wire 'zz'"),
    (["render", "FILE", "-o", "x.dot", "--no-costs", "--device", "tpu9"], "unknown device profile"),
    (["report", "FILE", "-o", "x.svg"], "the report is an HTML page"),
    # sizes the user gave: the cost pass's refusal is theirs to see, not drawn around
    (["render", "FILE", "-o", "x.dot", "-D", "b=100000", "-D", "h=1000"], "ask for smaller sizes"),
])
def test_cli_refuses_bad_options(tmp_path, capsys, argv, words):
    argv = [str(EXAMPLES / "attention.ncd") if a == "FILE" else
            str(tmp_path / a) if a.startswith("x.") else a for a in argv]
    assert cli_main(argv) == 1
    assert words in capsys.readouterr().err


@needs_dot
def test_docs_command_writes_the_readme_pictures(tmp_path):
    from napkin.render.__main__ import main
    assert main(["--docs", str(tmp_path)]) == 0
    for name in ("attention", "attention_2d"):
        assert (tmp_path / f"{name}.png").read_bytes().startswith(b"\x89PNG")


# --------------------------------------------------------------------------
# The report and its charts.
# --------------------------------------------------------------------------

def _synthetic_costs():
    """Round numbers whose chart positions are known: 1 TFLOP of contractions,
    4 ms of HBM time at 1 TB/s (4 GB from DRAM), 8 GB issued before L2
    reuse, a 1 GB lower bound."""
    T = types.SimpleNamespace
    roof = T(profile="h100", contraction_rate=1e15, contraction_s=1e-3, exp_s=5e-4, other_s=2e-4,
             hbm_s=4e-3, hbm_issued_s=8e-3, communication_s=0.0, estimate_s=4e-3, bound="bandwidth")
    return T(roofline=roof, flops=T(contraction=1e12), hbm_bytes=8e9, bound=T(bytes=1e9))


def test_roofline_places_the_points_on_the_roofs():
    svg = roofline_svg(_synthetic_costs(), {"hbm_bandwidth": 1e12})
    root = ET.fromstring(svg)
    circles = root.findall("{http://www.w3.org/2000/svg}circle")
    assert len(circles) == 6                     # three points, three key markers
    # 4 GB from DRAM: intensity 250 FLOP/B, 250 TFLOP/s = flops / estimate, on the memory roof.
    assert "this schedule: 250 TFLOP/s at 250 FLOP/B" in svg
    assert "same, without L2 reuse: 125 TFLOP/s at 125 FLOP/B" in svg
    # The lower bound (1 GB) sits at intensity 1000, on the roof's flat part.
    assert "I/O lower bound: 1 PFLOP/s at 1e+03 FLOP/B" in svg
    sched, issued, bound = (float(c.get("cx")) for c in circles[0::2])
    assert issued < sched < bound
    assert roofline_svg(types.SimpleNamespace(roofline=None), {"hbm_bandwidth": 1e12}) is None
    assert roofline_svg(_synthetic_costs(), None) is None


def test_time_bars_mark_the_bound():
    svg = time_bars_svg(_synthetic_costs())
    ET.fromstring(svg)
    widths = [float(w) for w in re.findall(r'<rect x="170" y="[\d.]+" width="([\d.]+)"', svg)]
    assert len(widths) == 5 and max(widths) == widths[4]      # HBM without L2 reuse is longest,
    assert widths[3] == widths[4] / 2                          # twice real HBM time,
    assert svg.count("#d62728") == 1                           # and the bound (HBM) the only red bar
    assert re.search(r'#d62728"/>\s*<text[^>]*>4 ms', svg)


def test_report_is_self_contained_and_degrades_without_costs():
    d = load("attention")
    page = report_html(d, None, None, dot_text="digraph x {}", why_no_costs="no cost pass here")
    assert "No cost tables: no cost pass here" in page and "digraph x {}" in page
    for forbidden in ("<script", "<link", "src=", "@import", "url("):
        assert forbidden not in page
    report, _ = render_costs.try_costs(d)
    if report is not None:
        from napkin.cost import get_profile
        full = report_html(d, report, "<svg></svg>", profile=get_profile("h100"))
        assert "Roofline" in full and "Where the time goes" in full and "<svg></svg>" in full
        assert full == report_html(d, report, "<svg></svg>", profile=get_profile("h100"))
        for forbidden in ("<script", "<link", "src=", "url("):
            assert forbidden not in full


def _png_pixels(data: bytes):
    """(width, height, rows of RGB bytes) of an 8-bit RGB/RGBA PNG."""
    pos, chunks = 8, {}
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        chunks[kind] = chunks.get(kind, b"") + data[pos + 8:pos + 8 + n]
        pos += 12 + n
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert depth == 8 and colour in (2, 6), (depth, colour)
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(chunks[b"IDAT"]), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line[j] for j in range(stride) if j % bpp < 3) if bpp == 4 else bytes(line))
        prev = line
    return width, height, rows


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_report_screenshot_in_headless_chromium(tmp_path):
    page = render.write_report(EXAMPLES / "attention.ncd", tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}", "--hide-scrollbars",
         f"--screenshot={shot}", "--window-size=1000,700", page.resolve().as_uri()],
        capture_output=True, timeout=120)
    assert shot.is_file(), done.stderr.decode(errors="replace")[-2000:]
    width, height, rows = _png_pixels(shot.read_bytes())
    assert (width, height) == (1000, 700)
    pixels = [row[i:i + 3] for row in rows[::4] for i in range(0, len(row), 12)]
    white = sum(p == b"\xff\xff\xff" for p in pixels)
    assert white < 0.97 * len(pixels), "the screenshot is (almost) blank"
    # The time bars are SVG: the bound's red bar must have been painted.
    report, _ = render_costs.try_costs(load("attention"))
    if report is not None:
        assert any(p == b"\xd6\x27\x28" for row in rows for p in (row[i:i + 3] for i in range(0, len(row), 3)))


def _peer_labels(name: str, sizes: dict) -> list[str]:
    d = napkin.load(str(EXAMPLES / f"{name}.ncd"))
    text = render.to_dot(d, render.try_costs(d, sizes)[0])
    return [" ".join(re.sub(r"<[^>]+>", " ", line).split()) for line in text.splitlines()
            if re.search(r"gathered over|merged over|round the ring", line)]


def test_peer_edges_say_what_travels_and_the_merges_bytes():
    """Decoding's picture said its queries were "gathered over x" (every device holds them whole:
    a tensor split over no mesh wire is not gathered), and no merge edge showed its bytes (the
    cost pass files them as "partial states (round 0)", the edges looked up O and lse)."""
    decode = _peer_labels("decode", {"b": 1, "hk": 8, "g": 4, "q": 1, "x": 32768})
    assert not any("gathered" in x for x in decode), decode
    assert any("merged over x between devices: 33 kB" in x for x in decode), decode   # 2 rounds of 16,512 B
    two_d = _peer_labels("attention_2d", {"b": 1, "h": 16, "q": 4096, "x": 4096})
    assert any("gathered over x between devices: 2.1 MB" in x for x in two_d), two_d
    assert any("merged over x between devices: 4.26 MB" in x for x in two_d), two_d


@needs_dot
def test_docs_command_into_a_file_says_so(tmp_path, capsys):
    """--docs naming a file printed a traceback of a NapkinError."""
    from napkin.render.__main__ import main
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["--docs", str(afile)]) == 1
    assert f"{afile} is a file, not a folder" in capsys.readouterr().err


def test_a_relabel_to_a_fixed_wire_sizes_its_partner_by_default(tmp_path, capsys):
    """X[b, x, d] of X[b, q, d] with wire x = 128: the defaults took q = 4096 beside it, which
    the cost pass refuses, so render and report failed on a valid diagram (today3 hunt).  q
    takes x's 128 now; sizes the user gives that disagree are refused at the relabel, in the file."""
    src = tmp_path / "fixedrel.ncd"
    src.write_text("diagram fixedrel\nwire b, q\nwire x = 128\nwire d = 64\nin X[b, q, d] : fp16\n"
                   "S[b, q, x] = sum[d](X * X[b, x, d])\nO[b, q, d] : fp16 = sum[x](softmax[x](S) * X[b, x, d])\n"
                   "out O\n")
    assert cli_main(["render", str(src), "-o", str(tmp_path / "f.dot")]) == 0
    assert cli_main(["report", str(src), "-o", str(tmp_path / "f.html")]) == 0
    assert "drawn without byte counts" not in capsys.readouterr().err
    assert cli_main(["render", str(src), "-D", "q=64", "-o", str(tmp_path / "g.dot")]) == 1
    assert capsys.readouterr().err.startswith(f"{src}:6:25: X is read along x as well as q, so wires x (128) "
                                              "and q (64) must have equal sizes")


def _peer_lines(d, costs) -> list[str]:
    """The plain text of the peer devices nodes and the peer edges' labels."""
    text = render.to_dot(d, costs)
    found = [re.search(r"label=<(.*)>\]", line) for line in text.splitlines()]
    return [" ".join(re.sub(r"<[^>]+>", " ", m.group(1)).split()) for m in found
            if m and re.search(r"gathered over|merged over|round the ring|peer devices", m.group(1))]


@pytest.mark.parametrize("levels,sizes,lines", [
    # a matmul split over m: every device needs all of B, which no mesh wire splits
    ("level devices { group m across 4 }", {"m": 4096, "n": 4096, "k": 4096},
     ["gathered over m between devices: 25.2 MB"]),
    # attention split over the queries only: K and V are gathered along the column
    ("level devices { group q across 4 }", {"b": 1, "h": 16, "q": 4096, "x": 4096},
     ["gathered over q between devices (K, V): 12.6 MB", "gathered over q"]),
    ("level nodes { group q across 2 }", {"b": 1, "h": 16, "q": 4096, "x": 4096},
     ["gathered over q, InfiniBand across nodes between devices (K, V): 8.39 MB",
      "gathered over q, InfiniBand across nodes"]),
    # a split of one part moves nothing: without costs the picture said "gathered over n, " (today5 hunt)
    ("level nodes { group n across 1 }\n  level devices { group m across 4 }", {"m": 4096, "n": 4096, "k": 4096},
     ["gathered over m, NVLink within a node between devices: 25.2 MB"]),
])
def test_inputs_no_mesh_wire_splits_are_drawn_gathered_as_the_cost_pass_charges(levels, sizes, lines):
    """The cost pass all-gathers an input no mesh wire splits (a matmul's B under 'group m across 4',
    attention's K and V under 'group q across 4': 25.2 MB, 12.6 MB a device), but the picture drew
    an input as gathered only when it carried a split wire: no peer devices, no edge, no bytes
    (render hunt).  The peer edges follow the cost report's device rows now, and without a report
    the schedule gives the same edges."""
    if "m across" in levels:
        text = (EXAMPLES / "matmul.ncd").read_text()
        text = text.replace("accumulate fp32\n", f"accumulate fp32\n  {levels}\n", 1)
    else:
        text = (EXAMPLES / "attention_2d.ncd").read_text()
        text = re.sub(r"  level devices \{[^}]*\}", "  " + levels, text)
    d = napkin.load_text(text, "split.ncd")
    report, why = render.try_costs(d, sizes)
    assert why is None, why
    assert [r.collective for r in report.devices.rows] == ["all-gather"]
    drawn = _peer_lines(d, report)
    assert [x for x in drawn if "over" in x] == lines, drawn
    assert any(x.startswith("peer devices") for x in drawn), drawn
    bare = [x for x in _peer_lines(d, None) if "over" in x]
    assert bare == [x.split(" between devices")[0] for x in lines], bare


def test_the_picture_names_and_measures_the_device_the_costs_are_for(tmp_path):
    """--device a100 changed the costs but the picture still said "schedule on h100" with h100's
    232 kB of shared memory and the report's footprint table said 167 kB on the same page (render
    hunt).  The capacities are the costed device's now, and the title says both devices."""
    out = tmp_path / "a.dot"
    assert cli_main(["render", str(EXAMPLES / "attention.ncd"), "--device", "a100", "-o", str(out)]) == 0
    text = out.read_text()
    assert "attention: schedule on h100, costed on a100, accumulate fp32" in plain(text)
    titles = cluster_titles(text)
    assert titles["cluster_smem"].startswith("shared memory 167 kB"), titles
    assert cli_main(["render", str(EXAMPLES / "attention.ncd"), "--device", "cpu", "-o", str(out)]) == 0
    assert cluster_titles(out.read_text())["cluster_hbm"].startswith("HBM 16 GB")
    assert cli_main(["render", str(EXAMPLES / "attention.ncd"), "--device", "h100", "-o", str(out)]) == 0
    text = out.read_text()
    assert "attention: schedule on h100, accumulate fp32" in plain(text)
    assert cluster_titles(text)["cluster_smem"].startswith("shared memory 232 kB")


def test_a_wire_streamed_in_chunks_marks_its_broadcast_inputs_re_read():
    """flash_decoding's x is grouped by 1024 and streamed by 64 in each chunk: the cost pass fetches
    Q once per chunk (4 times at x=4096), but Q's edge said only "broadcast over x" (render hunt:
    the note counted grouped tiles, and a chunked stream is a stream with a chunk)."""
    d = load("flash_decoding")
    report, why = render.try_costs(d, {"b": 1, "hk": 8, "g": 4, "q": 16, "x": 4096})
    assert why is None, why
    assert [t.fetches for t in report.transfers if t.tensor == "Q"] == [4]
    e = edges(to_dot(d, report))
    q = label(e, "t.Q", "op.S")
    assert "broadcast over xre-read per x blockHBM->SMEM: 524 kB" in q, q   # three rows of the label


def test_an_unscheduled_diagram_says_why_its_edges_carry_no_bytes():
    """Without a schedule no edge crosses a level, so none carries a byte count, yet the legend
    said "bytes moved at b=1 h=16 ..." (render hunt).  It says why there are none now, and where
    the untuned launch is priced."""
    text = (EXAMPLES / "attention.ncd").read_text()
    d = napkin.load_text(text[:text.index("\nschedule")], "plain.ncd")
    report, why = render.try_costs(d)
    assert why is None and report.transfers, why
    drawn = plain(to_dot(d, report))
    assert "bytes moved" not in drawn and "->SMEM" not in drawn
    assert ("no byte counts on the edges: the diagram has no schedule (napkin cost prices its untuned launch)"
            in drawn)
    assert "no byte counts" not in plain(to_dot(d))


def test_numbers_just_below_a_unit_round_up_into_it():
    """999,500 to 999,999 bytes were "1e+03 kB" on the picture's edges and in the report
    (napkin cost printed 1MB): the unit was picked before rounding to three figures (render
    hunt).  The picture, the charts and the cost table share the one rule now."""
    from napkin.cost.report import human, seconds as cost_seconds
    from napkin.render.dot import format_bytes
    from napkin.render.roofline import seconds, si
    assert [format_bytes(n) for n in (999_499, 999_500, 999_999, 999.6, 512)] == [
        "999 kB", "1 MB", "1 MB", "1 kB", "512 B"]
    assert (si(999_999), si(999_999, "FLOP/s"), si(0.25)) == ("1M", "1 MFLOP/s", "0.25")
    assert (seconds(0.0009996), seconds(1.5e-10), cost_seconds(0.0009996)) == ("1 ms", "0.15 ns", "1 ms")
    assert human(999_999, "B") == "1MB"
    d = load("matmul")
    report, why = render.try_costs(d, {"m": 3, "n": 128, "k": 166600})
    assert why is None, why
    assert "HBM->SMEM: 1 MB" in label(edges(to_dot(d, report)), "t.A", "op.C")


@needs_dot
def test_a_pdf_is_the_same_bytes_every_run(tmp_path):
    """cairo stamps /CreationDate with the time, so each `napkin render -o X.pdf` differed (svg, png
    and dot did not; render hunt).  The date is fixed now, with as many digits, so the offsets of
    the PDF's cross-reference table still point at their objects."""
    import time
    first = render.render_file(EXAMPLES / "matmul.ncd", tmp_path / "a.pdf", costs=False).read_bytes()
    time.sleep(1.1)
    second = render.render_file(EXAMPLES / "matmul.ncd", tmp_path / "b.pdf", costs=False).read_bytes()
    assert first == second
    # and in another time zone: cairo wrote the local offset beside the date (+05'30'; today5 hunt)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TZ", "Asia/Kolkata")
        third = render.render_file(EXAMPLES / "matmul.ncd", tmp_path / "c.pdf", costs=False).read_bytes()
    assert third == first
    assert b"/CreationDate (D:19700101000000" in first
    start = int(re.search(rb"startxref\s+(\d+)", first).group(1))
    assert first[start:start + 4] == b"xref"
    table = first[start:].split(b"\n")
    count = int(table[1].split()[1])
    for entry in table[3:2 + count]:   # object 1 onwards: "OFFSET 00000 n"
        offset = int(entry.split()[0])
        assert re.match(rb"\d+ 0 obj", first[offset:offset + 12]), first[offset:offset + 12]


def test_a_graphviz_without_the_format_is_told_in_words(monkeypatch, tmp_path, capsys):
    """A Graphviz built without cairo knows svg but not png or pdf: `render -o a.png` ended in
    "internal error ... this is a bug", exit 2, since every failure of dot was taken for napkin's
    (render hunt).  The format it lacks is the installation's, said in words, exit 1."""
    fake = tmp_path / "dot"
    fake.write_text('#!/bin/sh\necho "Format: \\"${1#-T}\\" not recognized. Use one of: canon dot svg xdot" >&2\n'
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(render, "dot_program", lambda: str(fake))
    assert cli_main(["render", str(EXAMPLES / "matmul.ncd"), "-o", str(tmp_path / "m.png")]) == 1
    assert capsys.readouterr().err == (
        "napkin: this Graphviz's dot cannot write .png (of napkin's formats it writes .svg and .dot): write one "
        "of those, or install a Graphviz built with cairo, which writes .png and .pdf\n")
    assert not (tmp_path / "m.png").exists()
    fake.write_text("#!/bin/sh\necho 'Error: syntax error in line 1' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="dot -Tsvg failed: Error: syntax error in line 1"):
        render.run_dot("digraph {", "svg")   # dot refusing napkin's own text is still napkin's bug

"""`Report.graph` / `Report.save` and `jaxfuse-explain`: the
dataflow graph before and after the rewrite, with fused sites in one colour,
declined ones in another and the reason where it arose, nested bodies as
clusters, far nodes folded by `hops`; written as DOT, SVG, PNG or HTML, and
a clear error where nothing can draw it."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

import jaxfuse
from jaxfuse.fusion import api, rewrite
from jaxfuse.fusion.report import save as picture_save
from jaxfuse.fusion.match.patterns import registered_patterns
from jaxfuse.fusion.report.picture import COLORS, DECLINED, FUSED

from conftest import TESTS

pytestmark = pytest.mark.filterwarnings("ignore:jaxfuse. no kernel:RuntimeWarning")
FUSED_LINE, FUSED_FILL = COLORS[FUSED]
DECLINED_LINE, DECLINED_FILL = COLORS[DECLINED]
X = jnp.ones((8, 128), jnp.float32)


def add_relu(x, y):
    return jax.nn.relu(x + y)


def add_read_twice(x, y):
    s = x + y
    return jax.nn.relu(s), s * 2.0


@jax.jit
def helper(x):
    return jnp.clip(x * 2.0 + 1.0, 0)


def nested(x, y, i):
    def body(c, a):
        return jnp.maximum(c + a, 0.0), None

    c, _ = lax.scan(body, y[0], x)
    d = lax.cond(c[0] > 0, lambda z: jax.nn.relu(z + 1.0), lambda z: z, c)
    k = jnp.maximum(i + 1, 0)  # int32: declined, and no edge to blame
    return d, helper(x), k


def long_chain(x, y):
    h = x
    for _ in range(6):
        h = jnp.sin(h) * 2.0
    return jax.nn.relu(h + y)


@pytest.fixture(scope="module")
def fused_report():
    return jaxfuse.explain(add_relu, X, X, policy="always")


@pytest.fixture(scope="module")
def declined_report():
    return jaxfuse.explain(add_read_twice, X, X, policy="always")


@pytest.fixture(scope="module")
def nested_report():
    return jaxfuse.explain(nested, X, X, jnp.ones(4, jnp.int32), policy="always")


# ------------------------------------------------------------------ helpers
def labelled(pic, text, kind=None):
    """Node ids whose label's first line starts with `text`."""
    return [n.id for n in pic.nodes.values()
            if n.label.split("\n")[0].split(" ")[0] == text and (kind is None or n.kind == kind)]


def with_status(pic, status):
    """The nodes of the picture's sites with `status` (the legend left out)."""
    return [n for n in pic.nodes.values() if n.status == status and n.kind != "legend"]


def one(items):
    assert len(items) == 1, items
    return items[0]


def dot_nodes(dot: str) -> dict:
    """node id -> its DOT attributes."""
    found = {}
    for m in re.finditer(r'^\s*"(\w+)" \[(.*)\];$', dot, re.M):
        found[m[1]] = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[2]))
    return found


def dot_edges(dot: str) -> dict:
    """(src, dst) -> the edge's DOT attributes."""
    found = {}
    for m in re.finditer(r'^\s*"(\w+)" -> "(\w+)" \[?(.*?)\]?;$', dot, re.M):
        found[(m[1], m[2])] = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[3]))
    return found


def dot_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def assert_well_formed(dot: str):
    assert dot.startswith("digraph jaxfuse {") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    nodes = dot_nodes(dot)
    for src, dst in dot_edges(dot):
        assert src in nodes and dst in nodes, (src, dst)


def program_of(pic, nid) -> str:
    """"before" or "after": the half of a kind="both" picture a node is in."""
    return {"b_program": "before", "a_program": "after"}[_outermost(pic, pic.nodes[nid].cluster)]


def _outermost(pic, cluster):
    while pic.clusters[cluster].parent is not None:
        cluster = pic.clusters[cluster].parent
    return cluster


# ---------------------------------------------------------------------- DOT
def test_fused_site_before_and_after(fused_report):
    pic = fused_report.graph("both")
    assert pic.source == pic.dot == str(pic)
    dot = pic.dot
    assert_well_formed(dot)
    nodes = dot_nodes(dot)
    # before: the add and jax.nn.relu's call, both in the fused colour
    add = one(labelled(pic, "add"))
    relu = one(labelled(pic, "custom_jvp_call[relu]"))
    assert program_of(pic, add) == program_of(pic, relu) == "before"
    for nid in (add, relu):
        assert pic.nodes[nid].status == FUSED
        assert nodes[nid]["fillcolor"] == FUSED_FILL and nodes[nid]["color"] == FUSED_LINE
    assert "[add_relu]" in pic.nodes[relu].label  # the root names its pattern
    assert (add, relu) in dot_edges(dot)
    # after: one node, our custom call, fed by both inputs and feeding the output
    call = one(labelled(pic, "jaxfuse_add_relu"))
    assert program_of(pic, call) == "after" and nodes[call]["fillcolor"] == FUSED_FILL
    edges = dot_edges(dot)
    ins = [n for n in pic.nodes.values() if n.kind == "input" and program_of(pic, n.id) == "after"]
    out = one([n for n in pic.nodes.values()
               if n.kind == "output" and program_of(pic, n.id) == "after"])
    assert len(ins) == 2 and all((i.id, call) in edges for i in ins) and (call, out.id) in edges
    assert not [n for n in pic.nodes.values()
                if n.kind == "op" and program_of(pic, n.id) == "after" and n.id != call]
    assert not with_status(pic, DECLINED)


def test_declined_reason_labels_the_edge_to_the_second_reader(declined_report):
    (site,) = declined_report.sites
    assert not site.fused and "2 uses" in site.reason
    for kind in ("before", "after"):  # a declined site is in both programs, unchanged
        pic = declined_report.graph(kind)
        dot = pic.dot
        assert_well_formed(dot)
        nodes, edges = dot_nodes(dot), dot_edges(dot)
        add, relu = one(labelled(pic, "add")), one(labelled(pic, "custom_jvp_call[relu]"))
        mul = one(labelled(pic, "mul"))
        for nid in (add, relu):
            assert pic.nodes[nid].status == DECLINED and nodes[nid]["fillcolor"] == DECLINED_FILL
        # the reason is on the add -> mul edge (the reader outside the region), in red
        blamed = edges[(add, mul)]
        assert blamed["label"] == dot_label(textwrap.fill(site.reason, 38))
        assert blamed["color"] == DECLINED_LINE
        assert "label" not in edges[(add, relu)]
        assert [(e.src, e.dst) for e in pic.edges if e.label] == [(add, mul)]
        # ... and the reader is outlined in red, dashed; it is no part of the site
        assert pic.nodes[mul].status == "culprit"
        assert nodes[mul]["color"] == DECLINED_LINE and "dashed" in nodes[mul]["style"]
        assert nodes[mul]["fillcolor"] != DECLINED_FILL
        assert not labelled(pic, "jaxfuse_add_relu")


def exp_add_relu(x, y):
    return jax.nn.relu(jnp.exp(x) + y)


def test_declined_reason_labels_the_edge_from_the_producer_xla_would_fuse():
    report = jaxfuse.explain(exp_add_relu, X, X, policy="auto", platform="cpu")
    (site,) = report.sites
    assert not site.fused and "comes from a `exp` that XLA fuses" in site.reason
    pic = report.graph("before")
    assert_well_formed(pic.dot)
    edges = dot_edges(pic.dot)
    exp, add = one(labelled(pic, "exp")), one(labelled(pic, "add"))
    assert [(e.src, e.dst) for e in pic.edges if e.label] == [(exp, add)]
    assert edges[(exp, add)]["label"] == dot_label(textwrap.fill(site.reason, 38))
    assert edges[(exp, add)]["color"] == DECLINED_LINE
    assert pic.nodes[exp].status == "culprit" and pic.nodes[add].status == DECLINED
    assert not [n for n in pic.nodes.values() if n.kind == "note"]


def test_nesting_is_drawn_as_clusters(nested_report):
    paths = {s.path for s in nested_report}
    assert paths == {"scan/body", "cond/branch1", "jit[helper]", ""}
    pic = nested_report.graph("before")
    dot = pic.dot
    assert_well_formed(dot)
    by_path = {c.path: c for c in pic.clusters.values() if c.role == "body"}
    assert {"scan/body", "cond/branch0", "cond/branch1", "jit[helper]"} <= set(by_path)
    for c in by_path.values():
        head = rf'subgraph "cluster_{c.id}" {{\n\s*graph \[label="{re.escape(c.label)}"'
        assert re.search(head, dot)
    # each site's equations lie in the cluster of its path, its root naming the pattern
    expected = {"scan/body": ({"add", "max"}, "max"),
                "cond/branch1": ({"add", "custom_jvp_call[relu]"}, "custom_jvp_call[relu]"),
                "jit[helper]": ({"mul", "add", "jit[clip]"}, "jit[clip]")}
    for site in nested_report.fused:
        inside = [n for n in with_status(pic, FUSED) if n.cluster == by_path[site.path].id]
        names, root = expected[site.path]
        assert {n.label.split()[0] for n in inside} == names and len(inside) == len(names)
        assert one([n.label.split()[0] for n in inside if f"[{site.pattern}]" in n.label]) == root
    assert len(with_status(pic, FUSED)) == 7


def test_after_draws_each_fused_site_as_one_node(nested_report):
    pic = nested_report.graph("after")
    assert_well_formed(pic.dot)
    fused = with_status(pic, FUSED)
    assert len(fused) == len(nested_report.fused) == 3
    assert sorted(n.primitive for n in fused) == ["jaxfuse_add_relu"] * 2 + ["jaxfuse_epilogue"]
    scan_body = one([c.id for c in pic.clusters.values() if c.path == "scan/body"])
    assert [n.primitive for n in pic.nodes.values() if n.cluster == scan_body] == ["jaxfuse_add_relu"]


def test_after_draws_a_rule_site_as_its_jit_call():
    def my_bias_gelu(y, b):
        return jax.nn.gelu(y + b)

    rule = jaxfuse.rule(lambda y, b: jax.nn.gelu(y + b), my_bias_gelu, name="bias_gelu",
                        example_args=(jnp.ones((8, 32)), jnp.ones(32)))
    report = jaxfuse.explain(jaxfuse.optimize(lambda x, w, b: jax.nn.gelu(x @ w + b),
                                              patterns=[rule]),
                             jnp.ones((8, 32)), jnp.ones((32, 32)), jnp.ones(32), policy="always")
    assert [s.pattern for s in report.fused] == ["bias_gelu"]
    before, after = report.graph("before"), report.graph("after")
    assert "tanh" in {n.label.split()[0] for n in with_status(before, FUSED)}
    call = one(with_status(after, FUSED))
    assert call.kind == "call" and call.label.split("\n")[0] == "jit[bias_gelu]"
    assert not labelled(after, "tanh") and labelled(after, "dot_general")
    assert (one(labelled(after, "dot_general")), call.id) in dot_edges(after.dot)


def test_a_reason_naming_no_edge_goes_in_a_note_by_the_site(nested_report):
    (site,) = nested_report.rejected
    assert "int32" in site.reason
    pic = nested_report.graph("before")
    note = one([n for n in pic.nodes.values() if n.kind == "note"])
    assert note.label == textwrap.fill(site.reason, 38)
    (tie,) = [e for e in pic.edges if e.dst == note.id]
    assert tie.status == "note" and pic.nodes[tie.src].status == DECLINED
    assert "[add_relu]" in pic.nodes[tie.src].label
    assert dot_nodes(pic.dot)[note.id]["shape"] == "note"


def test_hops_fold_what_lies_far_from_every_site():
    report = jaxfuse.explain(long_chain, X, X, policy="always")
    # relu(sin(...) * 2.0 + y): the site takes the last mul too
    assert [s.pattern for s in report.fused] == ["scale_shift_relu"]
    full = report.graph("before")
    assert len(labelled(full, "sin")) == 6 and len(labelled(full, "mul")) == 6
    for hops in (0, 1, 3):
        pic = report.graph("before", hops=hops)
        assert_well_formed(pic.dot)
        more = [n for n in pic.nodes.values() if n.kind == "more"]
        # sin i (0..5) lies 2 * (5 - i) + 1 edges above the site, mul i (i < 5) 2 * (5 - i)
        assert len(labelled(pic, "sin")) == sum(2 * (5 - i) + 1 <= hops for i in range(6))
        assert len(labelled(pic, "mul")) == 1 + sum(2 * (5 - i) <= hops for i in range(5))
        folded = sum(int(re.search(r"(\d+) more", n.label)[1]) for n in more)
        assert folded == len(full.nodes) - (len(pic.nodes) - len(more))
        for n in more:  # a folded run still connects to what is drawn
            assert any(n.id in (e.src, e.dst) for e in pic.edges)
    # the chain above the site is one run, folded into one node joined to the first kept node
    pic = report.graph("before", hops=1)
    (chain,) = [n for n in pic.nodes.values() if n.kind == "more" and n.label == "... 11 more"]
    (sin,) = labelled(pic, "sin")
    assert [(e.src, e.dst) for e in pic.edges if chain.id in (e.src, e.dst)] == [(chain.id, sin)]
    assert not [n for n in report.graph("before", hops=20).nodes.values() if n.kind == "more"]


def test_graph_checks_its_arguments(fused_report):
    with pytest.raises(ValueError, match="kind must be one of"):
        fused_report.graph("sideways")
    with pytest.raises(ValueError, match="hops"):
        fused_report.graph("both", hops=-1)
    # a report made by `rewrite` itself holds no traced program: "after" only
    closed = jax.make_jaxpr(add_relu)(X, X)
    _, report = rewrite(closed, registered_patterns())
    with pytest.raises(ValueError, match="kind='after'"):
        report.graph("before")
    assert labelled(report.graph("after"), "jaxfuse_add_relu")


# --------------------------------------------------------------------- save
@pytest.fixture
def no_graphviz(monkeypatch):
    """The pure-Python renderer, whatever this machine has installed."""
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def svg_size(root) -> tuple[float, float]:
    return tuple(float(re.match(r"[\d.]+", root.get(k))[0]) for k in ("width", "height"))


def test_save_dot(fused_report, tmp_path):
    path = fused_report.save(tmp_path / "g.dot", kind="after", hops=2)
    assert path == str(tmp_path / "g.dot")
    with open(path) as f:
        assert f.read() == fused_report.graph("after", hops=2).dot


def test_save_svg_without_graphviz(declined_report, tmp_path, no_graphviz):
    path = declined_report.save(tmp_path / "g.svg")
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    width, height = svg_size(root)
    assert 200 < width < 3000 and 200 < height < 3000
    text = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    assert "custom_jvp_call[relu]" in text and "2 uses" in text and "before: as traced" in text
    with open(path) as f:
        svg = f.read()
    assert DECLINED_FILL in svg and DECLINED_LINE in svg


def test_save_png_without_graphviz(nested_report, tmp_path, no_graphviz):
    path = nested_report.save(tmp_path / "g.png", kind="after")
    with open(path, "rb") as f:
        data = f.read()
    width, height = png_size(data)
    assert 200 < width < 4000 and 200 < height < 4000 and len(data) > 5000
    import matplotlib.image

    pixels = (matplotlib.image.imread(path)[..., :3] * 255).round().astype(int)
    fill = np.array([int(FUSED_FILL[i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(pixels - fill).max(axis=-1) <= 2).sum() > 500  # the fused boxes are there


def test_save_html_is_one_page_with_the_table_and_the_picture(declined_report, tmp_path,
                                                              no_graphviz):
    path = declined_report.save(tmp_path / "report.html", hops=1)
    with open(path) as f:
        page = f.read()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    table = re.search(r"<pre>(.*?)</pre>", page, re.S)[1]
    assert "add_relu  rejected" in table and "the `add` result has 2 uses" in table
    svg = re.search(r"<svg.*</svg>", page, re.S)[0]
    ET.fromstring(svg)  # well-formed, inline
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page
    # self-contained: nothing is fetched from anywhere
    assert not re.search(r"""(src|href)=["'](?!#)""", page)


def test_save_rejects_an_unknown_extension(fused_report, tmp_path):
    with pytest.raises(ValueError, match=r"\.dot, \.svg, \.png, \.html"):
        fused_report.save(tmp_path / "g.jpg")
    assert not os.listdir(tmp_path)


def test_graphviz_is_used_where_it_is_installed(fused_report, tmp_path, monkeypatch):
    # A stand-in `dot` that records how it was called and answers with an SVG.
    fake = tmp_path / "dot"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        called = open({str(tmp_path / "called")!r}, "w")
        called.write(" ".join(sys.argv[1:]) + "\\n" + sys.stdin.read())
        sys.stdout.write('<svg xmlns="http://www.w3.org/2000/svg" width="10pt" height="10pt"/>')
        """))
    fake.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: str(fake) if name == "dot" else None)
    path = fused_report.save(tmp_path / "g.svg", kind="after")
    with open(path) as f:
        assert f.read().startswith("<svg")
    with open(tmp_path / "called") as f:
        args, dot = f.read().split("\n", 1)
    assert args == "-Tsvg" and dot == fused_report.graph("after").dot
    # a failing dot is an error saying so, not a silent empty file
    fake.write_text(f"#!{sys.executable}\nimport sys\n"
                    "sys.stderr.write('syntax error')\nsys.exit(1)\n")
    with pytest.raises(picture_save.RenderError, match="syntax error"):
        fused_report.save(tmp_path / "h.png")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_real_graphviz_draws_the_picture(nested_report, tmp_path):
    png = nested_report.save(tmp_path / "g.png", renderer="graphviz")
    with open(png, "rb") as f:
        width, height = png_size(f.read())
    assert 100 < width < 10000 and 100 < height < 10000
    root = ET.parse(nested_report.save(tmp_path / "g.svg", renderer="graphviz")).getroot()
    assert root.tag.endswith("svg")


def test_no_renderer_is_a_clear_error(fused_report, tmp_path, no_graphviz, monkeypatch):
    monkeypatch.setitem(sys.modules, "networkx", None)  # `import networkx` fails
    for ext in (".svg", ".png", ".html"):
        with pytest.raises(picture_save.MissingRendererError) as info:
            fused_report.save(tmp_path / f"g{ext}")
        message = str(info.value)
        assert "pip install 'jaxfuse[plot]'" in message and "networkx" in message
        assert "Graphviz" in message and info.value.__cause__ is None
    assert not os.listdir(tmp_path)
    fused_report.save(tmp_path / "g.dot")  # needs nothing
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "networkx")
    with pytest.raises(picture_save.MissingRendererError, match="matplotlib"):
        fused_report.save(tmp_path / "g.png")
    with pytest.raises(picture_save.MissingRendererError, match="renderer='graphviz'.*dot"):
        fused_report.save(tmp_path / "g.svg", renderer="graphviz")


# ---------------------------------------------------------------------- CLI
def cli_namespace():
    """The command line's module's names."""
    from jaxfuse.cli import explain as cli

    return vars(cli)


def test_cli_in_a_subprocess(tmp_path):
    out = tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "jaxfuse.cli.explain", "picture_example:block",
         "--shapes", "x=f32[8,128], w=f32[128,128], b=f32[128]", "--policy", "always",
         "--out", str(out)],
        cwd=TESTS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["pattern", "status", "location"]
    assert re.search(r"add_relu\s+fused\s+picture_example\.py:8", done.stdout)
    assert "1 fused, 0 rejected (policy 'always'" in done.stdout
    assert lines[-1] == f"wrote {out}"
    with open(out) as f:
        page = f.read()
    assert "<svg" in page and "jaxfuse_add_relu" in page


def test_cli_in_process_keeps_jaxfuse_explain_the_function(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the cwd on it, as -m does
    monkeypatch.chdir(TESTS)
    assert jaxfuse.explain is api.explain
    dot = tmp_path / "g.dot"
    from jaxfuse.cli import explain as cli

    code = cli.main(["picture_example:add_read_twice", "--shapes", "x=f32[4,8],y=f32[4,8]",
                     "--out", str(dot), "--kind", "before"])
    assert code == 0
    assert "the `add` result has 2 uses" in capsys.readouterr().out
    with open(dot) as f:
        assert "cluster_" not in f.read().replace("cluster_legend", "")  # one program, flat
    assert jaxfuse.explain is api.explain and callable(jaxfuse.explain)
    report = jaxfuse.explain(add_relu, X, X, policy="always")
    assert len(report.fused) == 1


def test_cli_shapes():
    cli = cli_namespace()
    shapes = cli["parse_shapes"]("x=f32[8,128], w=bf16[128,4],n=i32[],m=bool[2],q=float16[3]")
    assert {k: (v.shape, str(v.dtype)) for k, v in shapes.items()} == {
        "x": ((8, 128), "float32"), "w": ((128, 4), "bfloat16"), "n": ((), "int32"),
        "m": ((2,), "bool"), "q": ((3,), "float16")}
    for bad, why in (("x=f32[8,128", "cannot read"), ("x=q8[3]", "unknown dtype 'q8'"),
                     ("x=f32[a]", "whole numbers"), ("x=f32[1],x=f32[2]", "twice")):
        with pytest.raises(cli["UsageError"], match=re.escape(why)):
            cli["parse_shapes"](bad)
    # parameters by name, in the function's order
    args, kwargs = cli["bind"](lambda b, x, *, k=1: None, {"x": 1, "b": 2})
    assert args == (2, 1) and kwargs == {}
    with pytest.raises(cli["UsageError"], match="give --shapes for x"):
        cli["bind"](lambda b, x: None, {"b": 2})
    with pytest.raises(cli["UsageError"], match="does not take"):
        cli["bind"](lambda b: None, {"b": 2, "zz": 1})


def test_cli_errors_are_messages_not_tracebacks(tmp_path, monkeypatch, capsys, no_graphviz):
    cli = cli_namespace()
    monkeypatch.chdir(TESTS)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for argv, why in ((["picture_example:nope"], "has no 'nope'"),
                      (["no_such_module_here:f"], "cannot import"),
                      (["picture_example:block", "--shapes", "x=f32[2,2]"], "give --shapes for w, b"),
                      (["picture_example:block", "--out", "g.jpg"], "--out must end in")):
        with pytest.raises(SystemExit) as done:
            cli["main"](argv)
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "networkx", None)
    status = cli["main"](["picture_example:add_read_twice", "--shapes", "x=f32[2],y=f32[2]",
                          "--out", str(tmp_path / "g.png")])
    captured = capsys.readouterr()
    assert status == 1 and "add_relu" in captured.out
    assert "pip install 'jaxfuse[plot]'" in captured.err and "Traceback" not in captured.err
    assert not os.path.exists(tmp_path / "g.png")


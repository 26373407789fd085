"""``kiln view``: the page's data against the graph, its self-containment and escaping, the command, and the
page itself in a real headless browser (Debian's chromium driven by playwright; skipped where either is
missing: .ci/run installs both).

The model has what the page must show: module paths and source lines, weights, a kiln.Guard, an If and a
Loop (whose bodies read outer values), and, with ``--fuse``, a FusedEpilogue at the top level and
FusedElementwise groups inside the If/Loop bodies."""
from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import kiln
from cli_helpers import run_cli
from kiln.ir import Graph
from kiln.serializer.view import attr_text, fuse_as_gpu, graph_data, render_html
from sample_graphs import if_block, loop_block

HOSTILE = "</script><script>window.pwned = 1</script>&<b>"


def viewed_graph(name: str = "viewed") -> Graph:
    rng = np.random.default_rng(0)
    g = Graph(name)
    x = g.add_input("x", "float32", ("batch", 8))
    w = g.add_initializer("fc.weight", rng.standard_normal((8, 8)).astype(np.float32))
    b = g.add_initializer("fc.bias", rng.standard_normal(8).astype(np.float32))
    h = g.op("MatMul", x, w)
    h.producer.meta.update({"scope": "fc", "source": "model.py:3"})
    h = g.op("Add", h, b)
    h = g.op("Relu", h)
    h = g.op("Mul", h, h)
    pos = g.op("Greater", g.op("ReduceSum", x, keepdims=0), g.add_constant(np.array(0, np.float32), "zero"))
    g.add_node("Guard", [pos], {"expected": np.array(True), "read": "bool", "what": "bool(tensor)",
                                "location": "model.py:7 in forward", "code": "if x.sum() > 0:"},
               domain="kiln", num_outputs=0)
    y = if_block(g, h, x)
    g.outputs = [loop_block(g, y, 3), h]
    return g


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("view") / "m.kiln"
    kiln.save(viewed_graph(), path)
    return path


def walk_data(g: dict):
    for n in g["nodes"]:
        yield n
        for s in n["subs"]:
            yield from walk_data(s["graph"])


def embedded(page: str) -> dict:
    m = re.search(r'<script id="kiln-data" type="application/json">(.*?)</script>', page, re.S)
    assert m, "no data element"
    return json.loads(m.group(1))


# ---- the data

def test_data_has_every_node_with_its_details():
    g = viewed_graph()
    fuse_as_gpu(g)
    data = graph_data(g, source="m.kiln")
    nodes = list(walk_data(data["graph"]))
    assert sorted(n["name"] for n in nodes) == sorted(n.name for n in g.walk())
    assert len({n["id"] for n in nodes}) == len(nodes)
    by_op = {}
    for n in nodes:
        by_op.setdefault(n["qop"], []).append(n)
    # the fused group at the top level: its body, its module path (the anchor's) and all the weights it reads
    (epi,) = [n for n in data["graph"]["nodes"] if n["qop"] == "kiln.FusedEpilogue"]
    body_ops = sorted(m["qop"] for m in walk_data(epi["subs"][0]["graph"]))
    assert body_ops == ["Add", "MatMul", "Mul", "Relu"]
    assert epi["meta"] == {"scope": "fc", "source": "model.py:3"}
    assert epi["wt"] == 8 * 8 * 4 + 8 * 4 and epi["size"] == 4 and epi["cat"] == "fused"
    assert epi["w"] == 8 * 8 * 4  # fc.weight, an input of the node; the bias went into the body
    # as stored (no fusion): each node with the bytes of the initializers it reads
    plain = {n["qop"]: n for n in graph_data(viewed_graph())["graph"]["nodes"]}
    assert plain["MatMul"]["w"] == 8 * 8 * 4 and plain["Add"]["w"] == 8 * 4 and plain["Relu"]["w"] == 0
    # If/Loop: bodies, and the outer values the If's branches read drawn as inputs of the node
    (top_if,) = [n for n in data["graph"]["nodes"] if n["op"] == "If"]
    assert [s["attr"] for s in top_if["subs"]] == ["else_branch", "then_branch"]
    assert set(top_if["caps"]) == {"x", "mul"} and top_if["cat"] == "control"
    assert len(by_op["Loop"]) == 1 and by_op["Loop"][0]["cat"] == "control"
    # the guard, with what it requires and where
    (guard,) = by_op["kiln.Guard"]
    assert guard["guard"] == {"what": "bool(tensor)", "read": "bool", "expected": "True",
                              "location": "model.py:7 in forward", "code": "if x.sum() > 0:", "input": "greater"}
    assert guard["w"] == 0 and guard["cat"] == "guard"
    assert [x["id"] for x in data["model"]["guards"]] == [guard["id"]]
    # types and the summary
    assert data["values"]["x"] == {"t": "float32[batch,8]", "k": "input", "g": "g0"}
    model = data["model"]
    assert model["nodes"] == len(nodes) and model["top_level"] == len(g.nodes)
    # as kiln inspect counts them: each tensor once (the fused bodies' copies share their data), the guard's
    # expected value (one bool) included
    assert model["parameter_bytes"] == 256 + 32 + 4 + 8 + 4 + 1
    assert graph_data(viewed_graph())["model"]["parameter_bytes"] == 256 + 32 + 4 * 4 + 8 + 1
    assert "kiln.optimized" not in model["props"] and model["optimized"]


def test_attribute_text_is_short():
    assert attr_text(3) == "3" and attr_text("tanh") == '"tanh"'
    assert attr_text(tuple(range(40))).endswith(", ... (40 items)]")
    text = attr_text(np.arange(1000, dtype=np.float32).reshape(10, 100))
    assert "float32" in text and "[10, 100]" in text and "(3.9 KiB)" in text and len(text) < 240
    assert len(attr_text("y" * 5000)) == 240


def test_page_is_self_contained_and_escapes_the_model():
    g = viewed_graph(HOSTILE)
    node = next(iter(g.nodes))
    node.meta["scope"] = HOSTILE
    page = render_html(g, source=HOSTILE + ".kiln")
    # nothing to fetch: no external script, style, font or image; a policy that forbids any
    assert re.findall(r'\b(?:src|href)="(?!data:)', page) == []
    assert "@import" not in page and "url(http" not in page
    assert "default-src 'none'" in page
    assert [u for u in re.findall(r"https?://[^\"' )]+", page) if u != "http://www.w3.org/2000/svg"] == []
    # the model's strings stay data: one data element, and they come back out of it unchanged
    assert HOSTILE not in page and page.count("</script>") == 2
    assert f"<title>{html.escape(HOSTILE)}.kiln - kiln view</title>" in page
    data = embedded(page)
    assert data["graph"]["name"] == HOSTILE and data["model"]["source"] == HOSTILE + ".kiln"
    assert data["graph"]["nodes"][0]["meta"]["scope"] == HOSTILE


# ---- the command

def test_view_command_writes_the_page(model, tmp_path):
    out = tmp_path / "page.html"
    r = run_cli("view", model, "-o", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"wrote {out}: 23 nodes (12 inside subgraphs), 3 If/Loops, 1 guard; "
                                "open it in a browser (it needs no network)")
    data = embedded(out.read_text(encoding="utf-8"))
    assert not any(n["cat"] == "fused" for n in walk_data(data["graph"]))  # as stored: no --fuse
    fused = tmp_path / "fused.html"
    r = run_cli("view", model, "--fuse", "-o", fused)
    assert r.returncode == 0, r.stderr
    assert "4 fused groups" in r.stdout
    ops = {n["qop"] for n in walk_data(embedded(fused.read_text(encoding="utf-8"))["graph"])}
    assert {"kiln.FusedEpilogue", "kiln.FusedElementwise", "If", "Loop", "kiln.Guard"} <= ops


def test_view_command_default_output_and_errors(model, tmp_path):
    copy = tmp_path / "net.kiln"
    shutil.copy(model, copy)
    r = run_cli("view", copy)
    assert r.returncode == 0 and (tmp_path / "net.html").is_file(), r.stderr
    r = run_cli("view", copy, "-o", tmp_path / "other.kiln")
    assert r.returncode == 1
    assert "would overwrite a model: the page is HTML, e.g. -o" in r.stderr and "other.html" in r.stderr
    r = run_cli("view", tmp_path / "missing.kiln")
    assert r.returncode == 1 and f"no such file: {tmp_path / 'missing.kiln'}" in r.stderr
    r = run_cli("view", "--help")
    assert r.returncode == 0 and "--fuse" in r.stdout and "loads nothing from the network" in " ".join(r.stdout.split())


# ---- the page in a real browser

def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no chromium to run the page in (apt-get install chromium)")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    exe = _chromium()
    with sync_api.sync_playwright() as p:
        try:
            # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start
            b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        except Exception as e:  # noqa: BLE001 - a chromium that playwright cannot drive: say which, skip
            pytest.skip(f"{exe} did not start under playwright: {str(e).splitlines()[0]}")
        yield b
        b.close()


def open_page(browser, path: Path):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(5_000)  # a missing element fails in seconds, not playwright's 30
    problems, requests = [], []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready]", timeout=10_000)
    return page, problems, requests


def drawn_names(page) -> list:
    return sorted(page.eval_on_selector_all("g.node", "gs => gs.map(g => g.getAttribute('data-name'))"))


def test_page_in_a_browser(browser, model, tmp_path):
    out = tmp_path / "m.html"
    assert run_cli("view", model, "--fuse", "-o", out).returncode == 0
    g = kiln.load_graph(model)
    fuse_as_gpu(g)
    top = sorted(n.name for n in g.nodes)
    every = sorted(n.name for n in g.walk())
    page, problems, requests = open_page(browser, out)
    try:
        # loads offline: no request but the file itself, no console error, every top-level node drawn
        assert requests == [out.as_uri()]
        assert drawn_names(page) == top
        assert page.locator("g.io.input[data-value='x']").count() == 1
        # expanding the fused group shows its body, in place
        fused = page.locator("g.node[data-op='kiln.FusedEpilogue']")
        assert fused.count() == 1
        fused.locator("[data-toggle]").click()
        assert drawn_names(page) == sorted(top + ["add", "matmul", "mul", "relu"])
        body = sorted(page.eval_on_selector_all(
            "g.node[data-op='kiln.FusedEpilogue'] g.node", "gs => gs.map(g => g.getAttribute('data-op'))"))
        assert body == ["Add", "MatMul", "Mul", "Relu"]
        # everything opened: every node of every depth, each once
        page.click("#expand-all")
        assert drawn_names(page) == every
        page.click("#collapse-all")
        assert drawn_names(page) == top
        # find the guard by op: it is selected and described; the If's body opens for a match inside it
        page.fill("#search", "op:Guard")
        assert page.inner_text("#count") == "1 match"
        page.press("#search", "Enter")
        panel = page.inner_text("#panel")
        assert "kiln.Guard" in panel and "model.py:7 in forward" in panel and "if x.sum() > 0:" in panel
        page.fill("#search", "op:Neg")
        assert page.inner_text("#count") == "2 matches"
        # both are in bodies: the collapsed If and Loop holding them are marked, and Enter opens the first
        assert page.locator("g.node.match-inside").evaluate_all("gs => gs.map(g => g.dataset.op)") == ["If", "Loop"]
        page.press("#search", "Enter")
        assert page.locator("g.node.selected[data-op='Neg']").count() == 1
        # a click on a node shows its module path, inputs with weight sizes, and its readers
        page.fill("#search", "")
        page.click("#collapse-all")
        page.click("#fit")
        page.locator("g.node[data-op='kiln.FusedEpilogue']").click()
        panel = page.inner_text("#panel")
        words = " ".join(panel.split())
        assert "module fc" in words and "source model.py:3" in words and "weight 256 B" in words
        assert "reducesum_1 (ReduceSum)" in words and "if (If)" in words  # the readers of its output
        assert problems == []
    finally:
        page.close()


def test_hostile_strings_stay_text_in_the_browser(browser, tmp_path):
    g = viewed_graph(HOSTILE)
    next(iter(g.nodes)).meta["scope"] = HOSTILE
    out = tmp_path / "hostile.html"
    out.write_text(render_html(g, source=HOSTILE), encoding="utf-8")
    page, problems, _ = open_page(browser, out)
    try:
        assert page.evaluate("window.pwned") is None
        assert page.title() == HOSTILE + " - kiln view"
        assert HOSTILE in page.inner_text("#panel")  # the graph's name, shown as text
        assert problems == []
    finally:
        page.close()

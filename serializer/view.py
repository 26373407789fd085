"""``kiln view MODEL -o m.html``: a model's graph as one self-contained, interactive HTML page.

Why a page and not a picture: a graph of a few hundred ops is read by moving around it -- finding
the op a message named, following a value to its readers, opening a fused group to see what it
runs -- which a static image cannot do, and a page opens anywhere without installing a viewer.

Why self-contained: the page is often opened where the model is (a server, an air-gapped box) or
sent on to someone, so it loads nothing: the graph is embedded as JSON, the layout and the drawing
are a small inline script (serializer/view_page.py; no library), and a Content-Security-Policy
of ``default-src 'none'`` makes sure nothing is fetched even by mistake. The file's strings (names,
attributes, source lines) are data to the script, never markup: a hostile .kiln file cannot put
script into the page.

What it shows (``graph_data`` builds it): every node with its op, output types, module path and
source line (the ``scope``/``source`` meta the tracer records), attributes, the bytes of the
weights it reads; ``kiln.Guard`` checks with what they require; the bodies of If/Loop and of the
fused ops (``kiln.FusedElementwise``/``FusedEpilogue``/``FusedAttention``), collapsed until
clicked. ``--fuse`` first groups the graph as the GPU backend does at load (``CudaProgram``:
attention, then elementwise groups, then epilogues), so the page shows what a GPU launches.

The layout is computed in the page (layered, top-down: longest-path ranks, long edges through
dummy points, barycentric ordering, Brandes-Koepf positions), so that expanding a group lays the
graph out again around its body.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import re
from pathlib import Path
from typing import Union

import numpy as np

from kiln.errors import KilnError
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.types import format_shape
from kiln.serializer.inspect import format_bytes
from kiln.version import __version__

PathLike = Union[str, os.PathLike]

# Attribute text longer than this is cut (a 10k-element ints attribute would bury the panel).
MAX_ATTR_CHARS = 240
MAX_LIST_ITEMS = 16

CONTROL_OPS = frozenset({"If", "Loop", "Scan"})


# ---- the command

def add_view_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the model to draw: a .kiln file (or a .onnx file, with the onnx extra)")
    p.add_argument("-o", "--output", metavar="HTML",
                   help="the page to write (default: the model's path with .html instead of its suffix)")
    p.add_argument("--fuse", action="store_true",
                   help="group the graph as the GPU backend runs it (fused attention, elementwise groups and "
                        "Conv/MatMul epilogues), so the page shows each fused kernel with its body")
    p.add_argument("--open", action="store_true", help="open the page in the default web browser once written")
    p.epilog = ("The page is one file that loads nothing from the network: open it in any browser, offline. "
                "Click a node for its details, click + on a fused group, If or Loop to open its body, type in "
                "the search box to find nodes by name, op (op:Conv) or module path.")


def cmd_view(args: argparse.Namespace) -> int:
    src = Path(args.model)
    out = Path(args.output) if args.output else src.with_suffix(".html")
    if out.suffix.lower() in (".kiln", ".onnx"):
        raise KilnError(f"-o {out} would overwrite a model: the page is HTML, e.g. -o {out.with_suffix('.html')}")
    if out.resolve() == src.resolve():
        raise KilnError(f"-o {out} is the model itself: name the page, e.g. -o {src.with_suffix('.html')}")
    graph = load_for_view(src, fuse=args.fuse)
    stats = write_html(graph, out, source=src.name)
    print(f"wrote {out}: {stats_line(stats)}; open it in a browser (it needs no network)")
    if args.open:
        import webbrowser
        webbrowser.open(out.resolve().as_uri())
    return 0


def load_for_view(path: PathLike, *, fuse: bool = False) -> Graph:
    """The graph of a .kiln (or .onnx) file, as stored; ``fuse``: optimized and fused as ``CudaProgram``
    does at load, so that the page shows the GPU's kernels."""
    path = Path(path)
    if not path.is_file():
        raise KilnError(f"no such file: {path}" if not path.exists() else f"{path} is not a file")
    if path.suffix.lower() == ".onnx":
        from kiln.errors import optional_module
        graph = optional_module("kiln.serializer.onnx_import", "viewing .onnx files").import_onnx(path)
    else:
        from kiln.serializer.reader import load_graph
        graph = load_graph(path)
    if fuse:
        fuse_as_gpu(graph)
    return graph


def fuse_as_gpu(graph: Graph) -> dict:
    """Optimize (a no-op on a file exported optimized) and fuse ``graph`` in place, in the order the GPU
    backend does; returns how many of each fused op were made."""
    from kiln.ir.passes import optimize
    from kiln.ir.passes.fuse import fuse_attention, fuse_elementwise, fuse_epilogues
    optimize(graph)
    return {"attention": fuse_attention(graph), "elementwise": fuse_elementwise(graph),
            "epilogues": fuse_epilogues(graph)}


def write_html(graph: Graph, path: PathLike, *, source: str = "") -> dict:
    """Write the page of ``graph`` to ``path``; returns the counts of ``graph_stats``."""
    text = render_html(graph, source=source)
    path = Path(path)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise KilnError(f"cannot write {path}: {e.strerror or e}") from None
    return graph_stats(graph)


def render_html(graph: Graph, *, source: str = "") -> str:
    """The page of ``graph`` as one HTML string (``source``: the file name shown in its title)."""
    from kiln.serializer.view_page import PAGE
    data = graph_data(graph, source=source)
    # JSON inside <script>: "<" escaped so that no string of the model can close the element.
    blob = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    blob = blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = html.escape(f"{source or graph.name} - kiln view")
    # One pass, so that a title or a string of the model that spells a placeholder stays as it is.
    return re.sub(r"\{\{(TITLE|DATA)\}\}", lambda m: title if m.group(1) == "TITLE" else blob, PAGE)


# ---- what the page shows

def graph_stats(graph: Graph) -> dict:
    nodes = list(graph.walk())
    return {"nodes": len(nodes), "top_level": len(graph.nodes),
            "fused": sum(1 for n in nodes if _category(n) == "fused"),
            "control": sum(1 for n in nodes if _category(n) == "control"),
            "guards": sum(1 for n in nodes if _category(n) == "guard")}


def stats_line(s: dict) -> str:
    parts = [f"{s['nodes']} nodes" + (f" ({s['nodes'] - s['top_level']} inside subgraphs)"
                                      if s["nodes"] != s["top_level"] else "")]
    for key, one, many in (("fused", "fused group", "fused groups"), ("control", "If/Loop", "If/Loops"),
                           ("guards", "guard", "guards")):
        if s[key]:
            parts.append(f"{s[key]} {one if s[key] == 1 else many}")
    return ", ".join(parts)


def graph_data(graph: Graph, *, source: str = "") -> dict:
    """Everything the page draws, as JSON-ready values: ``graph`` (nested: nodes hold their subgraphs),
    ``values`` (every value by name: type, kind, producer, initializer bytes) and ``model`` (the summary)."""
    values: dict[str, dict] = {}
    ids = {"graph": 0, "node": 0}
    guards: list[dict] = []

    def graph_entry(g: Graph) -> dict:
        gid = f"g{ids['graph']}"
        ids["graph"] += 1
        for v in g.inputs:
            values[v.name] = {"t": type_text(v), "k": "input", "g": gid}
        for v in g.initializers.values():
            values[v.name] = {"t": type_text(v), "k": "init", "g": gid, "bytes": int(v.const.nbytes)}
        nodes = [node_entry(n) for n in g.nodes]
        return {"id": gid, "name": g.name, "inputs": [v.name for v in g.inputs],
                "outputs": [v.name for v in g.outputs], "inits": list(g.initializers), "nodes": nodes}

    def node_entry(n: Node) -> dict:
        nid = f"n{ids['node']}"
        ids["node"] += 1
        for o in n.outputs:
            values[o.name] = {"t": type_text(o), "k": "node", "p": nid}
        cat = _category(n)
        entry = {"id": nid, "name": n.name, "op": n.op, "qop": n.qualified_op, "cat": cat,
                 "in": [None if v is None else v.name for v in n.inputs], "out": [o.name for o in n.outputs],
                 "attrs": [[k, attr_text(a)] for k, a in sorted(n.attrs.items()) if not isinstance(a, Graph)],
                 "meta": {str(k): str(v) for k, v in sorted(n.meta.items())},
                 "w": _weight_bytes([n]), "subs": []}
        subs = [(k, a) for k, a in sorted(n.attrs.items()) if isinstance(a, Graph)]
        if subs:
            entry["subs"] = [{"attr": k, "graph": graph_entry(a)} for k, a in subs]
            inner = [m for _, a in subs for m in a.walk()]
            entry["wt"] = _weight_bytes([n] + inner)
            entry["size"] = len(inner)
            entry["caps"] = captures(n)
        if cat == "guard":
            entry["guard"] = _guard_entry(n)
            guards.append({"id": nid, **entry["guard"]})
        return entry

    root = graph_entry(graph)
    from kiln.ir.passes.pipeline import OPTIMIZED_PROP
    from kiln.serializer.inspect import _parameter_totals
    params, param_bytes, _ = _parameter_totals(graph)
    counts = graph.op_counts()
    meta = graph.metadata
    model = {"source": source, "name": graph.name, "producer": f"{meta.producer_name} {meta.producer_version}".strip(),
             "doc": meta.doc_string, "optimized": OPTIMIZED_PROP in meta.props,
             # the optimizer's own bookkeeping is not the model's metadata (as for a loaded program's)
             "props": {str(k): str(v) for k, v in sorted(meta.props.items()) if k != OPTIMIZED_PROP},
             "ir_version": graph.ir_version, "opset": graph.opset_version, "kiln": __version__,
             "nodes": sum(counts.values()), "top_level": len(graph.nodes),
             "ops": sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])),
             "parameters": params, "parameter_bytes": param_bytes, "guards": guards}
    return {"model": model, "graph": root, "values": values}


def captures(node: Node) -> list[str]:
    """The values a node's subgraphs read from enclosing graphs (If/Loop bodies may; fused bodies are
    closed), initializers left out: drawn as dashed edges into the node, since they are inputs too."""
    inner = [g for _, a in sorted(node.attrs.items()) if isinstance(a, Graph) for g in a.all_graphs()]
    defined = {id(v) for g in inner for v in g.values()}
    seen: dict[str, None] = {}
    for g in inner:
        read = [v for m in g.nodes for v in m.inputs] + list(g.outputs)
        for v in read:
            if v is not None and id(v) not in defined and v.const is None:
                seen.setdefault(v.name)
    return list(seen)


def type_text(v: Value) -> str:
    """``float32[batch,3,224,224]``; ``?`` where the type is unknown."""
    if v.type is None:
        return "?"
    return v.type.dtype.short + format_shape(v.type.shape)


def attr_text(a) -> str:
    """An attribute as a short line: numbers and strings as written, lists cut after 16 items,
    tensors by dtype, shape, first values and bytes."""
    if isinstance(a, np.ndarray):
        from kiln.checks import describe
        text = describe(a) + (f" ({format_bytes(a.nbytes)})" if a.ndim else "")
    elif isinstance(a, str):
        text = json.dumps(a, ensure_ascii=False)
    elif isinstance(a, (tuple, list)):
        items = [json.dumps(x, ensure_ascii=False) if isinstance(x, str) else repr(x) for x in a[:MAX_LIST_ITEMS]]
        more = f", ... ({len(a)} items)" if len(a) > MAX_LIST_ITEMS else ""
        text = "[" + ", ".join(items) + more + "]"
    else:
        text = repr(a)
    return text if len(text) <= MAX_ATTR_CHARS else text[:MAX_ATTR_CHARS - 3] + "..."


def _category(n: Node) -> str:
    """The colour class of a node: guard, fused, control (If/Loop), anchor (Conv/MatMul/...), elementwise, other."""
    from kiln.ir.ops.fused import ANCHOR_OPS, ELEMENTWISE_OPS
    if n.domain == "kiln":
        if n.op == "Guard":
            return "guard"
        if n.op.startswith("Fused"):
            return "fused"
    elif n.domain == "":
        if n.op in CONTROL_OPS:
            return "control"
        if n.op in ANCHOR_OPS:
            return "anchor"
        if n.op in ELEMENTWISE_OPS:
            return "elementwise"
    return "other"


def _weight_bytes(nodes: list) -> int:
    """Bytes of the initializers these nodes read and of their tensor attributes (a Constant's value),
    each tensor once; a guard's ``expected`` is a check, not a weight."""
    seen: set = set()
    total = 0
    for n in nodes:
        arrays = [v.const for v in n.inputs if v is not None and v.const is not None]
        if _category(n) != "guard":
            arrays += [a for a in n.attrs.values() if isinstance(a, np.ndarray)]
        for arr in arrays:
            if id(arr) not in seen:
                seen.add(id(arr))
                total += int(arr.nbytes)
    return total


def _guard_entry(n: Node) -> dict:
    from kiln.checks import describe
    a = n.schema.fill_attrs(n.attrs)
    return {"what": a["what"], "read": a["read"], "expected": describe(np.asarray(a["expected"])),
            "location": a["location"], "code": a["code"], "input": n.inputs[0].name if n.inputs else None}


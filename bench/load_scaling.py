"""Loader scaling (issue 16): the issue's hostile files -- one Sum reading a value 10k..80k times,
80k nodes reading one value, million-node chains and fans -- loaded with the default limits and
with the limits raised; optionally the same files against an older kiln (``--baseline DIR``: a
folder holding that version as ``DIR/kiln``, e.g. ``git archive <commit> | tar -x -C DIR/kiln``)
and against ONNX (``onnx.load`` + ``onnx.checker.check_model``, onnxruntime session creation)
on the equivalent ONNX graph.

Every measurement runs in a fresh process: wall and CPU seconds of the load call, and the peak
RSS the load added (VmHWM after - VmRSS before; the file is read through a mapping, so its
touched pages count). Files come from ``kiln.serializer.attack_files``.

Run: .venv/bin/python bench/load_scaling.py [--quick] [--baseline DIR] [--peers] [--results FILE|-]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from results_md import RESULTS, cpu_name, replace_section

SECTION = "## Loader scaling (issue 16)"

# (label, attack builder name, size, limits: "default" | "raised", loader: "load_graph" | "kiln.load")
CASES = [
    ("Sum of one value x10k", "many_uses", 10_000, "default", "load_graph"),
    ("Sum of one value x20k", "many_uses", 20_000, "default", "load_graph"),
    ("Sum of one value x40k", "many_uses", 40_000, "default", "load_graph"),
    ("Sum of one value x80k", "many_uses", 80_000, "default", "load_graph"),
    ("Sum of one value x80k", "many_uses", 80_000, "default", "kiln.load"),
    ("80k nodes reading one value", "readers", 80_000, "default", "load_graph"),
    ("80k nodes reading one value", "readers", 80_000, "default", "kiln.load"),
    ("chain of 100k nodes", "chain", 100_000, "default", "load_graph"),
    ("chain of 100k nodes", "chain", 100_000, "default", "kiln.load"),
    ("chain of 1M nodes", "chain", 1_000_000, "default", "load_graph"),
    ("chain of 1M nodes", "chain", 1_000_000, "raised", "load_graph"),
    ("1M nodes reading one value", "readers", 1_000_000, "default", "load_graph"),
    ("1M nodes reading one value", "readers", 1_000_000, "raised", "load_graph"),
]
QUICK = {"many_uses": 20_000, "readers": 20_000, "chain": 20_000}

CHILD = r"""
import json, resource, sys, time, inspect
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0
path, limits, loader = sys.argv[1], sys.argv[2], sys.argv[3]
import kiln
from kiln.serializer import reader
kw = {}
if "limits" in inspect.signature(reader.load_graph).parameters and limits == "raised":
    kw["limits"] = reader.LoadLimits.unlimited()
fn = kiln.load if loader == "kiln.load" else reader.load_graph
before = rss("VmRSS:")
w, c = time.perf_counter(), time.process_time()
try:
    fn(path, **kw)
    outcome = "loaded"
except kiln.KilnError as e:
    msg = str(e).splitlines()[0]
    limit = msg[msg.find("LoadLimits."):].split(")")[0] if "LoadLimits." in msg else ""
    outcome = type(e).__name__ + ": " + (f"refused by {limit}" if limit else msg[-110:])
w, c = time.perf_counter() - w, time.process_time() - c
print(json.dumps({"wall": w, "cpu": c, "peak_added": rss("VmHWM:") - before, "outcome": outcome}))
"""

PEER = r"""
import json, sys, time
import onnx
from onnx import TensorProto, helper
kind, n, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
vi = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])
if kind == "many_uses":
    nodes, out = [helper.make_node("Sum", ["x"] * n, ["y"])], "y"
elif kind == "readers":
    nodes, out = [helper.make_node("Relu", ["x"], [f"v{i}"]) for i in range(n)], f"v{n - 1}"
else:
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"v{i - 1}"], [f"v{i}"]) for i in range(n)]
    out = f"v{n - 1}"
model = helper.make_model(helper.make_graph(nodes, "g", [vi("x")], [vi(out)]),
                          opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
data = model.SerializeToString()
path = sys.argv[4]
open(path, "wb").write(data)
del model, nodes
w = time.perf_counter()
if what == "onnx":
    m = onnx.load(path)
    onnx.checker.check_model(m)
else:
    import onnxruntime as ort
    ort.InferenceSession(path, providers=["CPUExecutionProvider"])
print(json.dumps({"wall": time.perf_counter() - w, "bytes": len(data)}))
"""


def run_child(code: str, args: list, timeout: float, pythonpath: str | None = None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    try:
        out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt_time(r: dict) -> str:
    if "timeout" in r:
        return f"> {r['timeout']:.0f} (stopped)"
    if "error" in r:
        return "error"
    return f"{r['wall']:.2f} / {r['cpu']:.2f}" if "cpu" in r else f"{r['wall']:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    ap.add_argument("--baseline", help="folder holding an older kiln as <folder>/kiln")
    ap.add_argument("--baseline-timeout", type=float, default=150.0)
    ap.add_argument("--peers", action="store_true", help="also time onnx.load+check_model and onnxruntime")
    ap.add_argument("--peer-timeout", type=float, default=300.0)
    ap.add_argument("--only", default="", help="comma-separated case numbers (1-based)")
    ap.add_argument("--results", default=str(RESULTS), help="markdown file to update, '-' to skip")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
    from kiln.serializer import attack_files as af

    cases = CASES
    if args.quick:
        cases = [(f"{lbl} (quick: {QUICK[kind]:,})", kind, QUICK[kind], lim, ld)
                 for lbl, kind, n, lim, ld in CASES if n <= 100_000 or lim == "raised"]
    if args.only:
        keep = {int(x) for x in args.only.split(",")}
        cases = [c for i, c in enumerate(cases, 1) if i in keep]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files: dict = {}
        for label, kind, n, limits, loader in cases:
            key = (kind, n)
            if key not in files:
                files[key] = Path(tmp) / f"{kind}_{n}.kiln"
                files[key].write_bytes(af.ATTACKS[kind].build(n))
            path = files[key]
            size = path.stat().st_size
            after = run_child(CHILD, [path, limits, loader], 600)
            before = {}
            if args.baseline and limits == "default":
                before = run_child(CHILD, [path, limits, loader], args.baseline_timeout, args.baseline)
            peer = {}
            if args.peers and loader == "load_graph" and limits == "default":
                peer = {w: run_child(PEER, [kind, n, w, Path(tmp) / "peer.onnx"], args.peer_timeout)
                        for w in ("onnx", "ort")}
            row = dict(label=label, loader=loader, limits=limits, size=size, after=after, before=before, peer=peer)
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
    table = ["| file | size MB | loader, limits | before: wall / CPU s | after: wall / CPU s | after: peak RSS added, × file | outcome | onnx.load+check s | ORT session s |",
             "|---|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        a = r["after"]
        mem = f"{a['peak_added'] / 2**20:.0f} MiB, {a['peak_added'] / r['size']:.1f}×" if "peak_added" in a else "–"
        outcome = a.get("outcome", a.get("error", "stopped")).replace("|", "/")
        before = fmt_time(r["before"]) if r["before"] else "–"
        onnx_s = fmt_time(r["peer"]["onnx"]) if r["peer"] else "–"
        ort_s = fmt_time(r["peer"]["ort"]) if r["peer"] else "–"
        table.append(f"| {r['label']} | {r['size'] / 1e6:.1f} | {r['loader']}, {r['limits']} | {before} | "
                     f"{fmt_time(a)} | {mem} | {outcome} | {onnx_s} | {ort_s} |")
    text = "\n".join(table)
    print(text)
    if args.results != "-":
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        body = (f"{SECTION}\n\nMachine: {cpu_name()}, {os.cpu_count()} cores, load average {load} (at the end), "
                f"Python {platform.python_version()}; produced by `bench/load_scaling.py"
                f"{' --baseline DIR' if args.baseline else ''}{' --peers' if args.peers else ''}`. Each load in a "
                "fresh process; 'before' is the kiln before issue 16 on the same file (stopped after "
                f"{args.baseline_timeout:.0f} s), 'default' the default `LoadLimits()` (250k nodes), 'raised' "
                "`LoadLimits.unlimited()`. Peak RSS added: VmHWM after − VmRSS before the call (mapped file "
                "pages it touched included). The ONNX peers load the equivalent ONNX graph (Relu/Sum nodes, "
                "opset 18).\n\n" + text + "\n")
        replace_section(Path(args.results), SECTION, body)


if __name__ == "__main__":
    main()

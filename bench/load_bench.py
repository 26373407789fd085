"""Load time and memory of a model file: kiln (mmap) against onnx, onnxruntime and numpy.

Builds a 16-layer Gemm+Relu MLP with SIZE MiB of float32 weights (the same arrays as .kiln, .onnx,
.npz and .npy files) and times each loader in a fresh Python process: the load call (imports timed
apart), resident memory it adds (VmRSS, anon part) and its peak (VmHWM). Writes bench/RESULTS.md.

Run: .venv/bin/python bench/load_bench.py [--sizes 32,64,256,1024] [--repeat 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

from results_md import replace_section

LAYERS = 16
SEED = 0
SECTION = "## Model file loading (issue 3)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
GOAL_MS = 20.0
GOAL_MIB = 20.0
ONNX_OPSET = 18
ONNX_IR_VERSION = 10  # opset 18 needs IR >= 8; 10 is read by every onnxruntime of the last years


# ----------------------------------------------------------------------------- loaders (child side)
# Each factory does the imports (timed as "import") and returns the load call (timed as "load").
# The result is returned so the loaded model stays alive while memory is read.

def _kiln(check_data: Optional[bool]) -> Callable:
    import kiln
    return lambda folder: kiln.load_graph(folder / "model.kiln", check_data=check_data)


def _onnx() -> Callable:
    import onnx
    return lambda folder: onnx.load(str(folder / "model.onnx"))


def _ort() -> Callable:
    import onnxruntime
    return lambda folder: onnxruntime.InferenceSession(str(folder / "model.onnx"),
                                                       providers=["CPUExecutionProvider"])


def _npz() -> Callable:
    import numpy as np
    # np.load of an .npz is lazy; reading every array is what a user of the weights gets.
    return lambda folder: dict(np.load(folder / "weights.npz"))


def _npy_mmap() -> Callable:
    import numpy as np
    return lambda folder: {p.stem: np.load(p, mmap_mode="r") for p in sorted((folder / "npy").glob("*.npy"))}


# name -> (factory, modules it needs, the call as shown in the table)
LOADERS: dict[str, tuple[Callable[[], Callable], tuple[str, ...], str]] = {
    "kiln": (lambda: _kiln(None), ("numpy", "flatbuffers"), "kiln.load_graph(path)"),
    "kiln-check": (lambda: _kiln(True), ("numpy", "flatbuffers"), "kiln.load_graph(path, check_data=True)"),
    "onnx": (_onnx, ("onnx",), "onnx.load(path)"),
    "ort": (_ort, ("onnx", "onnxruntime"), "onnxruntime.InferenceSession(path) (CPU)"),
    "npz": (_npz, ("numpy",), "np.load(.npz), every array read"),
    "npy-mmap": (_npy_mmap, ("numpy",), "np.load(.npy, mmap_mode='r') per array"),
}


def _status_mib() -> dict[str, float]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(rest.split()[0]) / 1024
    return fields


def _reset_peak() -> bool:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0), so the peak
    # measured is the load's own, not the imports'.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(loader: str, folder: Path) -> None:
    t0 = time.perf_counter()
    load = LOADERS[loader][0]()
    t1 = time.perf_counter()
    peak_reset = _reset_peak()
    before = _status_mib()
    t2 = time.perf_counter()
    model = load(folder)
    t3 = time.perf_counter()
    after = _status_mib()
    del model
    print(json.dumps({"import_ms": 1e3 * (t1 - t0), "load_ms": 1e3 * (t3 - t2),
                      "rss": after["VmRSS"] - before["VmRSS"], "anon": after["RssAnon"] - before["RssAnon"],
                      "peak": after["VmHWM"] - before["VmRSS"] if peak_reset else float("nan")}))


# ----------------------------------------------------------------------------- building the model files

def width_for(size_mib: int) -> int:
    """Square layers: LAYERS * width**2 float32 weights ~ size_mib MiB."""
    return max(8, round(math.sqrt(size_mib * 2**20 / 4 / LAYERS)))


def make_weights(width: int, seed: int) -> dict:
    import numpy as np
    rng = np.random.default_rng(seed)
    # Scaled by 1/sqrt(width) so activations stay finite through 16 layers (outputs are compared).
    scale = np.float32(1 / math.sqrt(width))
    weights = {}
    for i in range(LAYERS):
        weights[f"layer{i}.weight"] = rng.standard_normal((width, width), dtype=np.float32) * scale
        weights[f"layer{i}.bias"] = rng.standard_normal(width, dtype=np.float32) * np.float32(0.1)
    return weights


def kiln_graph(weights: dict, width: int):
    from kiln.ir import Graph
    g = Graph("mlp")
    h = g.add_input("x", "float32", ("batch", width))
    for i in range(LAYERS):
        w = g.add_initializer(f"layer{i}.weight", weights[f"layer{i}.weight"])
        b = g.add_initializer(f"layer{i}.bias", weights[f"layer{i}.bias"])
        h = g.op("Gemm", h, w, b)
        if i < LAYERS - 1:
            h = g.op("Relu", h)
    g.outputs = [h]
    return g


def onnx_model(weights: dict, width: int):
    """The same MLP written directly with onnx.helper (no kiln code involved)."""
    from onnx import TensorProto, helper, numpy_helper
    inits = [numpy_helper.from_array(a, name) for name, a in weights.items()]
    nodes, h = [], "x"
    for i in range(LAYERS):
        out = f"gemm{i}" if i < LAYERS - 1 else "y"
        nodes.append(helper.make_node("Gemm", [h, f"layer{i}.weight", f"layer{i}.bias"], [out]))
        h = out
        if i < LAYERS - 1:
            h = f"relu{i}"
            nodes.append(helper.make_node("Relu", [out], [h]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)], ir_version=ONNX_IR_VERSION)


def build(folder: Path, size_mib: int, have_onnx: bool) -> dict:
    """Write the model files into ``folder`` unless a matching set is already there."""
    import numpy as np
    import kiln
    width = width_for(size_mib)
    meta = {"size_mib": size_mib, "layers": LAYERS, "width": width, "seed": SEED, "onnx": have_onnx}
    marker = folder / "built.json"
    if marker.exists() and json.loads(marker.read_text()) == meta:
        return meta
    print(f"building {size_mib} MiB model ({LAYERS} x {width}x{width}) in {folder}", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "npy").mkdir(parents=True)
    weights = make_weights(width, SEED)
    graph = kiln_graph(weights, width)
    kiln.save(graph, folder / "model.kiln")
    np.savez(folder / "weights.npz", **weights)
    for name, arr in weights.items():
        np.save(folder / "npy" / f"{name}.npy", arr)
    if have_onnx:
        import onnx
        onnx.save(onnx_model(weights, width), str(folder / "model.onnx"))
    _check_files(folder, graph, weights)
    marker.write_text(json.dumps(meta))
    return meta


def _check_files(folder: Path, graph, weights: dict) -> None:
    """The .kiln file gives back the saved arrays, and onnxruntime on the .onnx file agrees with
    kiln's reference evaluator: every file holds the same model."""
    import numpy as np
    import kiln
    loaded = kiln.load_graph(folder / "model.kiln", check_data=True)
    for name, arr in weights.items():
        if not np.array_equal(loaded.initializers[name].const, arr):
            raise SystemExit(f"{folder}/model.kiln: weight {name} differs from what was saved")
    if not (folder / "model.onnx").exists() or importlib.util.find_spec("onnxruntime") is None:
        return
    import onnxruntime
    x = np.random.default_rng(1).standard_normal((2, graph.inputs[0].shape[1]), dtype=np.float32)
    (want,) = kiln.evaluate(graph, {"x": x})
    sess = onnxruntime.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"x": x})
    if not np.allclose(got, want, rtol=1e-3, atol=1e-4 * (float(np.max(np.abs(want))) or 1.0)):
        raise SystemExit(f"{folder}: onnxruntime and kiln disagree on the model output")


# ----------------------------------------------------------------------------- measuring (parent side)

def run_child(loader: str, folder: Path) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", loader, str(folder)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{loader} on {folder} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def drop_caches() -> bool:
    """Empty the page cache (root only; not allowed in many containers)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def measure(loader: str, folder: Path, repeat: int, cold_repeat: int) -> dict:
    run_child(loader, folder)  # untimed warm-up: the timed runs read from the page cache
    warm = [run_child(loader, folder) for _ in range(repeat)]
    cold = []
    for _ in range(cold_repeat):
        if not drop_caches():
            break
        cold.append(run_child(loader, folder)["load_ms"])
    med = {k: statistics.median(r[k] for r in warm) for k in ("import_ms", "load_ms", "rss", "anon", "peak")}
    med["min_ms"], med["max_ms"] = min(r["load_ms"] for r in warm), max(r["load_ms"] for r in warm)
    med["cold_ms"] = statistics.median(cold) if cold else None
    return med


def available_loaders(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        raise SystemExit(f"unknown loaders {unknown}; choose from {list(LOADERS)}")
    kept = []
    for name in names:
        missing = [m for m in LOADERS[name][1] if importlib.util.find_spec(m) is None]
        if missing:
            print(f"skipping {name} ({LOADERS[name][2]}): {', '.join(missing)} not installed "
                  f"(.venv/bin/pip install {' '.join(missing)})", flush=True)
        else:
            kept.append(name)
    return kept


# ----------------------------------------------------------------------------- reporting

def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def machine() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
               platform.machine())
    with open("/proc/meminfo") as f:
        ram_gib = int(f.readline().split()[1]) / 2**20
    versions = [f"{pkg} {_version(pkg)}" for pkg in ("kiln", "numpy", "flatbuffers", "onnx", "onnxruntime")]
    return (f"{cpu}, nproc {os.cpu_count()}, {ram_gib:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}; {', '.join(versions)}; "
            f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")


def table(rows: list[tuple[dict, str, dict]]) -> str:
    head = ("| model weights | loader | load ms (median) | min..max ms | cold ms | import ms "
            "| RSS added MiB | of it anon MiB | peak added MiB |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for meta, loader, m in rows:
        cold = "n/a" if m["cold_ms"] is None else f"{m['cold_ms']:.1f}"
        lines.append(f"| {meta['mib']:.0f} MiB ({LAYERS}x{meta['width']}²) | `{LOADERS[loader][2]}` "
                     f"| {m['load_ms']:.1f} | {m['min_ms']:.1f}..{m['max_ms']:.1f} | {cold} | {m['import_ms']:.0f} "
                     f"| {m['rss']:.1f} | {m['anon']:.1f} | {m['peak']:.1f} |")
    return "\n".join(lines)


def verdict(rows: list[tuple[dict, str, dict]]) -> str:
    """Goal of issue 3: the default load under 20 ms and under 20 MiB resident added, at every size."""
    kiln_rows = [(meta, m) for meta, loader, m in rows if loader == "kiln"]
    if not kiln_rows:
        return "kiln was not measured."
    from kiln.serializer.reader import AUTO_CHECK_DATA_BYTES
    lines = [f"Goal (issue 3): `kiln.load_graph(path)` under {GOAL_MS:.0f} ms and under {GOAL_MIB:.0f} MiB "
             f"resident added (RSS and peak), at every size:"]
    for meta, m in kiln_rows:
        fails = []
        if m["load_ms"] >= GOAL_MS:
            fails.append(f"load {m['load_ms']:.1f} ms")
        if max(m["rss"], m["peak"]) >= GOAL_MIB:
            fails.append(f"RSS +{max(m['rss'], m['peak']):.1f} MiB, of it anon +{m['anon']:.1f} MiB")
        state = "NOT met (" + "; ".join(fails) + ")" if fails else "met"
        checked = "checksummed" if meta["mib"] * 2**20 <= AUTO_CHECK_DATA_BYTES else "not checksummed"
        lines.append(f"- {meta['mib']:.2f} MiB ({checked}): {m['load_ms']:.1f} ms, +{m['rss']:.1f} MiB: {state}")
    if len(kiln_rows) > 1:
        ms = [m["load_ms"] for _, m in kiln_rows]
        mib = [max(m["rss"], m["peak"]) for _, m in kiln_rows]
        flat = max(ms) <= 1.5 * min(ms) + 1.0 and max(mib) <= min(mib) + 1.0
        lines.append(f"- across sizes: {min(ms):.1f}..{max(ms):.1f} ms, +{min(mib):.1f}..+{max(mib):.1f} MiB: "
                     f"{'independent of model size' if flat else 'NOT independent of model size'}.")
    lines.append(f"(By default kiln checksums the data segment only when it is at most "
                 f"{AUTO_CHECK_DATA_BYTES / 2**20:.0f} MiB, so smaller models pay a full read of their weights.)")
    return "\n".join(lines)


def section(rows, env: str, repeat: int, cold_repeat: int) -> str:
    cold = (f'"cold ms": median of {cold_repeat} run(s) right after emptying the page cache (`echo 3 > '
            f'/proc/sys/vm/drop_caches`; this also evicts Python and its libraries; on a VM the host may still '
            f'cache the disk).' if cold_repeat else '"cold ms": n/a (emptying the page cache was not allowed).')
    notes = (f"`bench/load_bench.py`: a {LAYERS}-layer Gemm+Relu MLP, float32 weights from a seeded generator, "
             f"the same arrays as .kiln, .onnx, .npz and one .npy per array. Each number comes from a fresh "
             f"Python process: median of {repeat} runs after one untimed warm-up run, so every file is read "
             f'from the page cache ("warm"). "load ms" times the load call only; "import ms" is the '
             f"loader's imports in that process. RSS added = VmRSS after - before the load (pages of a "
             f'mapped file count once touched; "anon" is the private part); peak added = VmHWM (reset '
             f"before the load) - VmRSS before. {cold} kiln and npy-mmap map the file and read weight "
             f"pages lazily, when a tensor is first used; the others have every weight in memory when the "
             f"call returns.")
    return f"{SECTION}\n\n{textwrap.fill(notes, 100)}\n\nMachine: {env}\n\n{table(rows)}\n\n{verdict(rows)}\n"


def write_results(text: str, path: Path) -> None:
    """Replace this benchmark's section of RESULTS.md (other sections are kept as they are)."""
    replace_section(path, SECTION, text)


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="32,64,256,1024", help="weight sizes in MiB, comma separated")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per loader and size; the median is reported")
    p.add_argument("--cold-repeat", type=int, default=3,
                   help="runs after emptying the page cache (needs root; 0 to skip)")
    p.add_argument("--loaders", default=",".join(LOADERS), help=f"subset of {','.join(LOADERS)}")
    p.add_argument("--out", type=Path, help="folder for the model files, kept and reused (default: a temp folder)")
    p.add_argument("--results", type=Path, default=RESULTS, help="markdown file to update ('-' to skip)")
    p.add_argument("--child", nargs=2, metavar=("LOADER", "FOLDER"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def check_disk(root: Path, need_gb: float) -> None:
    existing = next(d for d in (root, *root.parents) if d.exists())
    if shutil.disk_usage(existing).free < need_gb * 2**30:
        raise SystemExit(f"not enough free disk for {need_gb:.1f} GB of model files under {root}")


def measure_all(root: Path, sizes: list[int], loaders: list[str], repeat: int, cold_repeat: int,
                have_onnx: bool) -> list[tuple[dict, str, dict]]:
    metas = [build(root / f"mlp_{size}mib", size, have_onnx) for size in sizes]
    os.sync()  # freshly written files are still being written back: let that not disturb the timings
    rows = []
    for size, meta in zip(sizes, metas):
        meta["mib"] = LAYERS * (meta["width"] ** 2 + meta["width"]) * 4 / 2**20
        for loader in loaders:
            if loader in ("onnx", "ort") and not meta["onnx"]:
                continue
            m = measure(loader, root / f"mlp_{size}mib", repeat, cold_repeat)
            rows.append((meta, loader, m))
            cold = "n/a" if m["cold_ms"] is None else f"{m['cold_ms']:.1f} ms"
            print(f"{size:>5} MiB  {loader:<10} load {m['load_ms']:9.1f} ms  import {m['import_ms']:6.0f} ms  "
                  f"RSS +{m['rss']:8.1f} MiB  anon +{m['anon']:8.1f}  peak +{m['peak']:8.1f}  cold {cold}", flush=True)
    return rows


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    sizes = [int(s) for s in args.sizes.split(",") if s]
    loaders = available_loaders(args.loaders.split(","))
    have_onnx = importlib.util.find_spec("onnx") is not None
    root = args.out or Path(tempfile.mkdtemp(prefix="kiln-load-bench-"))
    check_disk(root, 4.2 * sum(sizes) / 1024)
    cold_ok = args.cold_repeat > 0 and drop_caches()
    try:
        rows = measure_all(root, sizes, loaders, args.repeat, args.cold_repeat if cold_ok else 0, have_onnx)
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    text = section(rows, machine(), args.repeat, args.cold_repeat if cold_ok else 0)
    print("\n" + text)
    if str(args.results) != "-":
        write_results(text, args.results)
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main(sys.argv[1:])

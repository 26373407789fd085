"""Export time: kiln.trace + optimize + kiln.save against torch.jit.trace + torch.jit.save and
torch.onnx.export, on the same eager model (fp32, CPU, random weights, no downloads).

Models (built by tests/zoo.py, the code the acceptance tests check):
- resnet50: full-width ResNet-50 (torchvision layout, 25.6 M parameters), input 1x3x224x224;
- bert: a BERT-base-shaped encoder: 12 nn.TransformerEncoderLayer (d_model 768, 12 heads,
  feed-forward 3072, GELU, batch first) + LayerNorm, input 1x128x768 (85 M parameters).

Every exporter writes a real file (in a temporary folder) and runs in this one process,
median of ``--repeat`` runs after one untimed warm-up; the runs are interleaved (kiln, jit,
onnx, kiln, ...) so that load from elsewhere on the machine hits every exporter alike.
kiln runs with ``check=False`` (the check re-runs the model and the graph on fresh inputs;
``--check`` adds a row with it) and torch.jit.trace with ``check_trace=False``;
torch.onnx.export is the legacy TorchScript exporter (``dynamo=False``); the dynamo exporter
runs when onnxscript is installed. A breakdown of kiln's time by step follows the table, and
``--profile`` prints cProfile listings of kiln's export.

Run: .venv/bin/python bench/trace_bench.py [--models resnet50,bert] [--repeat 3] [--threads N] [--check]
     [--profile] [--results FILE|-]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from results_md import replace_section
from typing import Callable, Optional

import torch

import kiln
from kiln.ir.passes import optimize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # noqa: E402

SECTION = "## Export time (issue 4)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
MODELS: dict[str, tuple[str, Callable[[], zoo.Example]]] = {
    "resnet50": ("ResNet-50, 1x3x224x224",
                 lambda: zoo.resnet50(batch=1, width=64, image=224, num_classes=1000)),
    "bert": ("BERT-base-shaped encoder (12 layers, d 768, seq 128)",
             lambda: zoo.transformer_encoder(batch=1, seq=128, d_model=768, nhead=12, dim_ff=3072, layers=12)),
}


# ---------------------------------------------------------------------------- exporters
def kiln_export(model, inputs, path: Path, check: bool = False) -> None:
    graph = kiln.trace(model, inputs, check=check, optimize=False)
    optimize(graph)
    kiln.save(graph, path)


def jit_export(model, inputs, path: Path) -> None:
    # Without its check, like kiln here (the check fails on nn.TransformerEncoder: "Graphs
    # differed across invocations").
    traced = torch.jit.trace(model, inputs, check_trace=False)
    torch.jit.save(traced, str(path))


def onnx_legacy_export(model, inputs, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "legacy TorchScript-based ONNX export"
        torch.onnx.export(model, inputs, str(path), dynamo=False)


def onnx_dynamo_export(model, inputs, path: Path) -> None:
    torch.onnx.export(model, inputs, str(path), dynamo=True)


def exporters(check: bool) -> list[tuple[str, str, Optional[Callable]]]:
    """(label, file suffix, function or None when unavailable with the reason in the label)."""
    rows = [("kiln.trace + optimize + kiln.save", "kiln", kiln_export)]
    if check:
        rows.append(("kiln.trace(check=True) + optimize + kiln.save", "kiln",
                     lambda m, i, p: kiln_export(m, i, p, check=True)))
    rows += [("torch.jit.trace + torch.jit.save", "pt", jit_export),
             ("torch.onnx.export(dynamo=False)", "onnx", onnx_legacy_export)]
    if importlib.util.find_spec("onnxscript") is not None:
        rows.append(("torch.onnx.export(dynamo=True)", "onnx", onnx_dynamo_export))
    else:
        rows.append(("torch.onnx.export(dynamo=True): not run, needs onnxscript (not installed)", "onnx", None))
    return rows


# ---------------------------------------------------------------------------- timing
def bench_model(key: str, repeat: int, check: bool, folder: Path) -> list[dict]:
    """Time every exporter on one model. The runs are interleaved (round k runs each exporter
    once), so a burst of load from elsewhere on the machine hits them alike."""
    label, factory = MODELS[key]
    model, inputs, _ = factory()
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for name, suffix, fn in exporters(check):
        row = {"model": label, "params": params, "exporter": name, "fn": fn, "path": folder / f"{key}.{suffix}"}
        if fn is not None:
            fn(model, inputs, row["path"])  # warm-up: lazy imports, allocator, first-call caches
            row["times"] = []
        rows.append(row)
    for _ in range(repeat):
        for row in rows:
            if row["fn"] is not None:
                start = time.perf_counter()
                row["fn"](model, inputs, row["path"])
                row["times"].append(time.perf_counter() - start)
                row["size"] = row["path"].stat().st_size
    for row in rows:
        print(_fmt_console(row), flush=True)
    return rows


def kiln_steps(key: str, repeat: int, folder: Path) -> str:
    """Where kiln's time goes: median seconds of one eager forward, trace, optimize and save."""
    label, factory = MODELS[key]
    model, inputs, _ = factory()
    steps: dict[str, list[float]] = {"eager forward (torch.no_grad)": [], "kiln.trace": [], "optimize": [],
                                     "kiln.save": []}
    for _ in range(repeat):
        start = time.perf_counter()
        with torch.no_grad():
            model(*inputs)
        t1 = time.perf_counter()
        graph = kiln.trace(model, inputs, check=False, optimize=False)
        t2 = time.perf_counter()
        optimize(graph)
        t3 = time.perf_counter()
        kiln.save(graph, folder / f"{key}-steps.kiln")
        t4 = time.perf_counter()
        for name, dt in zip(steps, (t1 - start, t2 - t1, t3 - t2, t4 - t3)):
            steps[name].append(dt)
    parts = ", ".join(f"{name} {statistics.median(v):.3f} s" for name, v in steps.items())
    return f"- {label}: {parts}"


def profile_kiln(key: str, top: int = 25) -> None:
    import cProfile
    import pstats

    model, inputs, _ = MODELS[key][1]()
    kiln.trace(model, inputs, check=False, optimize=False)  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    with tempfile.TemporaryDirectory() as d:
        kiln_export(model, inputs, Path(d) / "m.kiln")
    prof.disable()
    print(f"\ncProfile of kiln.trace + optimize + save, {key}:")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


# ---------------------------------------------------------------------------- report
def _fmt_console(row: dict) -> str:
    if "times" not in row:
        return f"{row['model']}: {row['exporter']}"
    t = row["times"]
    runs = ", ".join(f"{x:.3f}" for x in t)
    return f"{row['model']}: {row['exporter']}: median {statistics.median(t):.3f} s ({runs})"


def table(rows: list[dict]) -> str:
    lines = ["| model | exporter | median s | min..max s | speed vs torch.onnx.export | file MiB |",
             "|---|---|---:|---:|---:|---:|"]
    onnx = {r["model"]: statistics.median(r["times"]) for r in rows
            if r["exporter"] == "torch.onnx.export(dynamo=False)" and "times" in r}
    for r in rows:
        if "times" not in r:
            lines.append(f"| {r['model']} | {r['exporter']} | n/a | n/a | n/a | n/a |")
            continue
        med = statistics.median(r["times"])
        ratio = f"{onnx[r['model']] / med:.2f}x" if r["model"] in onnx else "n/a"
        lines.append(f"| {r['model']} | `{r['exporter']}` | {med:.3f} | {min(r['times']):.3f}..{max(r['times']):.3f} "
                     f"| {ratio} | {r['size'] / 2 ** 20:.1f} |")
    return "\n".join(lines)


def goal_lines(rows: list[dict]) -> str:
    lines = ["Goal (issue 4): kiln (trace + optimize + save) at least 2x faster than `torch.onnx.export`:"]
    by = {(r["model"], r["exporter"]): statistics.median(r["times"]) for r in rows if "times" in r}
    for model in dict.fromkeys(r["model"] for r in rows):
        k = by.get((model, "kiln.trace + optimize + kiln.save"))
        o = by.get((model, "torch.onnx.export(dynamo=False)"))
        if k is None or o is None:
            continue
        verdict = "met" if o / k >= 2 else "not met"
        lines.append(f"- {model}: kiln {k:.3f} s, torch.onnx.export {o:.3f} s: {o / k:.2f}x: {verdict}")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu}, {os.cpu_count()} cores (load average {load} at the end), torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


def write_section(path: Path, body_table: str, goals: str, repeat: int) -> None:
    body = (f"{SECTION}\n\nOne process, median of {repeat} runs after a warm-up, the exporters' runs interleaved; "
            f"{machine()}; produced by "
            "`bench/trace_bench.py`. Each exporter writes its file; kiln traces with `check=False` (the check "
            "re-runs the model and the graph on fresh inputs) and `torch.jit.trace` with `check_trace=False`, "
            "`torch.onnx.export` is the legacy TorchScript exporter. Random weights (each encoder layer its own), "
            "fp32, static shapes; the models are `tests/zoo.py`'s `resnet50` and `transformer_encoder` at full size."
            "\n\n"
            f"{body_table}\n\n{goals}\n")
    replace_section(path, SECTION, body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="also time kiln.trace with check=True")
    ap.add_argument("--profile", action="store_true", help="cProfile kiln's export of each model after timing")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--results", default=str(RESULTS), help="markdown file to update, '-' to skip")
    args = ap.parse_args()
    keys = [k for k in args.models.split(",") if k]
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    steps = ["kiln's time by step (median of the same number of runs; the eager forward is for reference):"]
    with tempfile.TemporaryDirectory() as d:
        for key in keys:
            rows += bench_model(key, args.repeat, args.check, Path(d))
            steps.append(kiln_steps(key, args.repeat, Path(d)))
    text = table(rows)
    goals = goal_lines(rows) + "\n\n" + "\n".join(steps)
    print(f"\n{machine()}\n{text}\n\n{goals}")
    if args.profile:
        for key in keys:
            profile_kiln(key)
    if args.results != "-":
        write_section(Path(args.results), text, goals, args.repeat)


if __name__ == "__main__":
    main()

"""What guards cost: ResNet-50 with the checks a traced model carries, against the same trace without them.

The model is tests/zoo.py's ResNet-50 (torchvision's layout, 224x224, 1000 classes) behind an input
check of the kind real models have, written as plain Python the tracer cannot keep as control flow:

    if x.abs().amax() > 1e4:        # a Python bool read from the input's data -> one kiln.Guard
        x = x.clamp(-1e4, 1e4)
    if x.size(0) > 64: ...          # a symbolic batch compared in Python -> one guard on the host

Both graphs come from one ``kiln.trace(..., dynamic_batch=True)`` call each, with ``guards=True`` and
``guards=False``; without guards the reduction that feeds the first check is dead code and goes, so
the difference is the whole price of guarding: the reduction over the input, the comparison and
the guard itself. Runs are interleaved (A, B, A, B, ...) and the median of each is reported.

    .venv/bin/python bench/guard_bench.py                 # CPU runtime, batch 1; writes RESULTS.md
    python bench/guard_bench.py --device cuda --batch 1,32  # on the GPU machine (CUDA graphs: auto)
    ... --results -                                       # print only

The section written is "Guards (issue 15)"; a run on another device replaces only its own rows.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # noqa: E402

import kiln  # noqa: E402
from results_md import RESULTS, cpu_name, replace_section, utc_now  # noqa: E402

TITLE = "## Guards (issue 15)"


class Guarded(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        if x.abs().amax() > 1e4:
            x = x.clamp(-1e4, 1e4)
        if x.size(0) > 64:
            raise ValueError("at most 64 images a batch")
        return self.net(x)


def build(guards: bool, batch: int):
    net, (x,), _ = zoo.resnet50(batch=batch, width=64, image=224, num_classes=1000)
    model = Guarded(net).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kiln.TraceWarning)
        graph = kiln.trace(model, (x,), dynamic_batch=True, guards=guards, check=False)
    return graph, x.numpy()


def guard_count(graph) -> int:
    return sum(1 for n in graph.walk() if n.domain == "kiln" and n.op == "Guard")


def timed(run, x, repeat: int, sync=None) -> list:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        run(x)
        if sync is not None:
            sync()
        out.append(time.perf_counter() - t)
    return out


def without_guards_keeping_checks(graph):
    """The guarded graph with each Guard removed and the value it checked made an output: the
    model's check is still computed, only the guard mechanism is gone."""
    g = graph.copy()
    for node in [n for n in g.nodes if n.domain == "kiln" and n.op == "Guard"]:
        checked = node.inputs[0]
        g.remove_node(node, force=True)
        if checked.const is None and checked not in g.inputs:
            g.outputs = list(g.outputs) + [g.op("Identity", checked)]
    return g


def measure(device: str, batch: int, repeat: int, output: str = "cupy") -> dict:
    g_on, x = build(True, batch)
    g_off, _ = build(False, batch)
    g_kept = without_guards_keeping_checks(g_on)
    if device == "cpu":
        progs = {"on": kiln.load(g_on), "off": kiln.load(g_off), "kept": kiln.load(g_kept)}
        runs = {k: (lambda a, p=p: p.run([a])) for k, p in progs.items()}
        sync, arg = None, x
        backend = "kiln CPU runtime"
    else:
        import cupy as cp
        from kiln.runtime.cuda_program import CudaProgram
        progs = {k: CudaProgram(g, output=output) for k, g in (("on", g_on), ("off", g_off), ("kept", g_kept))}
        arg = cp.asarray(x)
        runs = {k: (lambda a, p=p: p.run([a])) for k, p in progs.items()}
        sync = cp.cuda.Device().synchronize
        backend = f"kiln CUDA ({cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, CUDA graphs: " \
                  f"{progs['on'].cuda_graphs}, outputs as {output} arrays)"
    want = progs["off"].run([arg], as_list=True)[0]
    got = progs["on"].run([arg], as_list=True)[0]
    diff = float(np.max(np.abs(np.asarray(got.get() if hasattr(got, "get") else got) -
                               np.asarray(want.get() if hasattr(want, "get") else want))))
    for k in runs:  # warm-up (captures graphs on the GPU)
        timed(runs[k], arg, 3, sync)
    # Blocks of runs, the programs taking turns: interleaving single runs made each program start
    # where another left the GPU, which moved the medians by more than the guards cost (60-250 us).
    samples = {"on": [], "off": [], "kept": []}
    block = 10
    for i in range(max(1, repeat // block)):
        for k in (("off", "on", "kept") if i % 2 == 0 else ("kept", "on", "off")):
            samples[k] += timed(runs[k], arg, block, sync)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    extra = extra_node_ms(progs, arg, repeat) if device == "cpu" else None
    return {"device": device, "backend": backend, "batch": batch, "guards": guard_count(g_on),
            "ms_on": med["on"], "ms_off": med["off"], "ms_kept": med["kept"],
            "overhead": med["on"] / med["off"] - 1, "mechanism": (med["on"] - med["kept"]) / med["off"],
            "max_diff": diff, "repeat": repeat, "extra_ms": extra}


def extra_node_ms(progs: dict, x, runs: int) -> float:
    """The time per run of the instructions only the guarded plan has (the check's reduction, the
    comparisons, the guards), from kiln's per-op profile of both plans: a figure a busy machine
    disturbs far less than the difference of two whole-model medians."""
    from kiln.runtime.profile import profile_program

    on, off = (profile_program(progs[k], [x], runs=runs) for k in ("on", "off"))
    calls_off = {s.op: s.calls for s in off.ops}
    total = 0.0
    for s in on.ops:
        more = s.calls - calls_off.get(s.op, 0)
        if more > 0:
            total += s.seconds * more / s.calls
    return total / on.runs * 1e3


def table(rows: list) -> str:
    lines = ["| device | backend | batch | guards | with guards (ms) | without (ms) | cost: check + guards | "
             "cost: guards alone | guard path's own time (profile) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        own = "n/a" if r["extra_ms"] is None else \
            f"{r['extra_ms'] * 1e3:.0f} us ({100 * r['extra_ms'] / r['ms_off']:.3f}%)"
        lines.append(f"| {r['device']} | {r['backend']} | {r['batch']} | {r['guards']} | {r['ms_on']:.3f} | "
                     f"{r['ms_off']:.3f} | {100 * r['overhead']:+.2f}% | {100 * r['mechanism']:+.2f}% | {own} |")
    return "\n".join(lines)


def write(rows: list, machine: str, path: Path = RESULTS) -> None:
    old = path.read_text() if path.exists() else ""
    start = old.find(TITLE)
    kept = []
    if start >= 0:  # rows of other devices stay
        end = old.find("\n## ", start + len(TITLE))
        for line in old[start:end if end >= 0 else None].splitlines():
            if line.startswith("| ") and not line.startswith("| device") and \
                    line.split("|")[1].strip() not in {r["device"] for r in rows}:
                kept.append(line)
    body = [TITLE, "",
            "`bench/guard_bench.py`: ResNet-50 (tests/zoo.py, torchvision's layout, 224x224) behind an input "
            "check traced as two guards (a `bool` read of `x.abs().amax() > 1e4` and a symbolic batch compared "
            "in Python), against the same model traced with `guards=False` (whose check is then dead code). "
            "'check + guards' counts the model's own check (the reduction over the input) too, since "
            "without guards it is dead code; 'guards alone' compares with the same graph whose guards are "
            "removed and whose checked values are kept as outputs. Medians of interleaved runs; on the CPU "
            "also the time of the instructions only the guarded plan has, from kiln's per-op profile.",
            "", table(rows).split("\n")[0], table(rows).split("\n")[1], *kept,
            *table(rows).split("\n")[2:], "", f"Last run: {machine}, {utc_now()}.", ""]
    replace_section(path, TITLE, "\n".join(body))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--repeat", type=int, default=30, help="timed runs of each graph per batch (default 30)")
    p.add_argument("--outputs", default="cupy", help="with --device cuda: cupy, numpy or both (comma-separated)")
    p.add_argument("--results", default=str(RESULTS), help="the results file whose section to replace "
                                                           "(default bench/RESULTS.md); '-' to print only")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    cases = [(int(b), o) for b in args.batch.split(",")
             for o in (args.outputs.split(",") if args.device == "cuda" else ["numpy"])]
    for b, output in cases:
        r = measure(args.device, b, args.repeat, output)
        print(f"{r['backend']}, batch {b}: {r['ms_on']:.3f} ms with {r['guards']} guards, {r['ms_off']:.3f} ms "
              f"without: {100 * r['overhead']:+.2f}%; guards alone {100 * r['mechanism']:+.2f}% (outputs differ by "
              f"{r['max_diff']:.2g})", flush=True)
        rows.append(r)
    print(table(rows))
    if args.results != "-":
        import os
        machine = f"{cpu_name()}, load average {os.getloadavg()[0]:.1f} (the A/B column is noise where it is " \
                  "not near 0: the profile column is the figure)" if args.device == "cpu" else rows[0]["backend"]
        write(rows, machine, Path(args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

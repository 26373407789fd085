"""Which GPU kernels a model's CUDA-graph replay runs, and for how long: kiln fp16 against torch.compile fp16.

    PYTHONPATH=/tmp/pkg:bench python3 bench/gpu_kernel_profile.py --model bert --batch 32 --json out.json

bench/gpu_profile.py brackets each kiln instruction with CUDA events on an eager program: right at large
batches, but it cannot see inside a CUDA graph, and it says nothing about the peer. This records the
kernels themselves with CUPTI (through torch.profiler, which sees every kernel of the process, CuPy's,
cuBLAS's and cuDNN's included, also inside graph replays): ``--runs`` replays of kiln's program
(``kiln.load(..., precision="fp16")``, CUDA graphs) and of ``torch.compile(mode="reduce-overhead")`` of the
half model, each kernel's device time summed by name (names shortened), with the share of the total and
the count per run. The totals are device time only, not the wall time between launches.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def short(name: str) -> str:
    name = re.sub(r"\(.*", "", name)           # argument lists of demangled names
    name = re.sub(r"<.*>", "<>", name)          # template arguments
    return name[:90]


def kernels(fn, runs: int, sync) -> dict:
    """{short kernel name: [total us, calls]} over ``runs`` calls of ``fn`` (after warm-up)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        sync()
    out: dict = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        dur = getattr(e, "device_time", None)
        if dur is None:
            dur = getattr(e, "cuda_time", 0.0)
        k = short(e.name)
        t = out.setdefault(k, [0.0, 0])
        t[0] += dur
        t[1] += 1
    return {k: [v[0] / runs, v[1] / runs] for k, v in out.items()}


def table(title: str, ks: dict, top: int) -> str:
    total = sum(v[0] for v in ks.values())
    lines = [f"{title}: {total:.1f} us of kernels a run, {sum(v[1] for v in ks.values()):.0f} kernels",
             "| kernel | us/run | share | calls/run |", "|---|---:|---:|---:|"]
    for k, (us, n) in sorted(ks.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {k} | {us:.1f} | {us / max(total, 1e-9):.1%} | {n:.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import tempfile

    import cupy as cp
    import torch

    import kiln
    from gpu_half_bench import build
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, in_name, make = build(args.model)
    x = make(args.batch)
    with torch.inference_mode():
        g = kiln.trace(model, {in_name: torch.from_numpy(make(1))}, dynamic={in_name: {0: "batch"}})
    path = kiln.save(g, Path(tempfile.mkdtemp()) / "m.kiln")
    k16 = kiln.load(path, device="cuda", precision="fp16")
    feed = {in_name: cp.asarray(x)}
    result = {"model": args.model, "batch": args.batch, "device": torch.cuda.get_device_name()}
    result["kiln"] = kernels(lambda: k16.run(feed), args.runs, cp.cuda.runtime.deviceSynchronize)
    result["kiln_attention_paths"] = k16.attention_paths
    result["kiln_epilogues"] = dict(k16.epilogues) if hasattr(k16, "epilogues") else None
    result["kiln_graph_failures"] = {str(k): v for k, v in k16.graph_failures.items()}
    result["kiln_fallback_ops"] = dict(k16.fallback_ops)
    print({k: result[k] for k in ("kiln_attention_paths", "kiln_graph_failures", "kiln_fallback_ops")}, flush=True)
    print(table(f"kiln fp16 {args.model} b{args.batch}", result["kiln"], args.top), flush=True)
    if not args.no_compile:
        half = model.half().cuda()
        xt = torch.from_numpy(x).cuda()
        if xt.is_floating_point():
            xt = xt.half()
        cf = torch.compile(half, mode="reduce-overhead", dynamic=False)
        with torch.inference_mode():
            result["torch_compile"] = kernels(lambda: cf(xt), args.runs, torch.cuda.synchronize)
        print(table(f"torch.compile fp16 {args.model} b{args.batch}", result["torch_compile"], args.top), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Trace real models with the torch a GPU machine has (torch 2.11 there), then run them on its GPU.

Issue 15 asks that the tracer depend on no hook only the newest torch has, and names torchvision's
``vit_b_16`` and ``nn.TransformerEncoderLayer`` as the models that failed on the GPU machine's torch.
This script traces them (with kiln's check) and a few more with whatever torch is installed,
runs each graph with kiln's CUDA runtime, and compares with torch on the GPU (fp32, TF32 off) and
with the model in float64 on the CPU. One row per model; ``--results FILE`` replaces the section
"Tracing on the GPU machine's torch (issue 15)" of FILE (default bench/RESULTS.md), ``-`` prints.

    mkdir -p /tmp/pkg && ln -sfn $PWD /tmp/pkg/kiln && PYTHONPATH=/tmp/pkg:bench python3 bench/gpu_trace_check.py
"""
from __future__ import annotations

import argparse
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

import kiln
from results_md import RESULTS, replace_section, utc_now

TITLE = "## Tracing on the GPU machine's torch (issue 15)"


def models():
    import torchvision

    torch.manual_seed(0)
    vit = torchvision.models.vit_b_16(weights=None)
    nn.init.normal_(vit.heads.head.weight, std=0.02)  # torchvision zeroes the head: outputs would all be 0
    yield "torchvision vit_b_16", vit, (torch.randn(2, 3, 224, 224),)
    yield "nn.TransformerEncoderLayer (batch_first, key padding mask)", \
        _EncoderLayer(), (torch.randn(2, 16, 64), torch.arange(16)[None, :].repeat(2, 1) >= torch.tensor([[16], [11]]))
    yield "nn.TransformerEncoder (2 layers, norm_first)", \
        nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, norm_first=True),
                              2, enable_nested_tensor=False), (torch.randn(2, 16, 64),)
    yield "torchvision resnet50", torchvision.models.resnet50(weights=None), (torch.randn(2, 3, 224, 224),)
    yield "torchvision deeplabv3_mobilenet_v3_large (Resize)", \
        torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None), \
        (torch.randn(1, 3, 128, 128),)
    yield "nn.LSTM (2 layers, bidirectional)", nn.LSTM(32, 64, 2, batch_first=True, bidirectional=True), \
        (torch.randn(2, 12, 32),)


class _EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)

    def forward(self, x, pad):
        return self.layer(x, src_key_padding_mask=pad)


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _outputs(v)]
    return [t for v in out for t in _outputs(v)]


def check(name, model, inputs) -> dict:
    import cupy as cp

    from kiln.runtime.cuda_program import CudaProgram

    row = {"model": name}
    model = model.eval()
    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kiln.TraceWarning)
            graph = kiln.trace(model, inputs, dynamic_batch=True)
    except Exception as e:  # noqa: BLE001 - reported in the row
        row["trace"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        traceback.print_exc()
        return row
    row["trace"] = f"ok ({time.perf_counter() - t:.1f} s, {len(graph.nodes)} nodes, " \
                   f"{sum(1 for n in graph.walk() if n.op == 'Guard')} guards)"
    prog = CudaProgram(graph, output="numpy")
    got = prog.run([x.numpy() for x in inputs], as_list=True)
    with torch.no_grad():
        gpu = [o.float().cpu().numpy() for o in _outputs(model.cuda()(*[x.cuda() for x in inputs]))]
        model.cpu()
        f64 = [o.numpy() for o in _outputs(model.double()(*[x.double() if x.is_floating_point() else x
                                                              for x in inputs]))]
        model.float()
    rel = lambda a, b: float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))  # noqa: E731
    row["kiln_vs_torch_gpu"] = max(rel(g, w) for g, w in zip(got, gpu))
    row["kiln_vs_f64"] = max(rel(g, w) for g, w in zip(got, f64))
    row["torch_gpu_vs_f64"] = max(rel(g, w) for g, w in zip(gpu, f64))
    row["fallbacks"] = sum(prog.fallback_ops.values())
    cp.get_default_memory_pool().free_all_blocks()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import torchvision

    rows = []
    for name, model, inputs in models():
        rows.append(check(name, model, inputs))
        print(rows[-1], flush=True)
    lines = ["| model | kiln.trace (with check) | kiln CUDA vs torch GPU | kiln vs float64 | torch GPU vs float64 "
             "| host fallbacks |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "kiln_vs_torch_gpu" not in r:
            lines.append(f"| {r['model']} | {r['trace']} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['trace']} | {r['kiln_vs_torch_gpu']:.1e} | {r['kiln_vs_f64']:.1e} | "
                     f"{r['torch_gpu_vs_f64']:.1e} | {r['fallbacks']} |")
    import cupy as cp
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    body = "\n".join([TITLE, "", "`bench/gpu_trace_check.py`: models traced by kiln with the GPU machine's own "
                      "torch (not the CI box's), then run by kiln's CUDA runtime. Errors are max|a - b| / max|b| "
                      "over the outputs; fp32, TF32 off.", "", *lines, "",
                      f"Last run: {gpu}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
                      f"{utc_now()}.", ""])
    print(body)
    if args.results != "-":
        replace_section(Path(args.results), TITLE, body)
    return 0 if all("kiln_vs_torch_gpu" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

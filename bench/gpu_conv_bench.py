"""Convolution per shape class on the GPU: kiln's cuDNN path vs its im2col + cuBLAS path (and torch's
cuDNN, TF32 off, as the reference), in one process, float32.

Why: the Conv kernel (runtime/kernels/cuda/nn.py) picks cuDNN or im2col per shape by timing both
at first use; this shows what each costs on ResNet-50's shape classes (1x1, 3x3, strided 3x3,
strided 1x1 downsample, 7x7 stem) at batch 1 and 32, what "auto" picks, and the error of each
against torch's float32 cuDNN convolution. Each kernel is the Conv factory's function called
directly (no program around it), bias included; times are the median of 7 CUDA-event-timed
batches of back-to-back calls (about 10 ms each) after warm-up, the paths interleaved.

    python3 bench/gpu_conv_bench.py            # on the device; JSON to $OUT/gpu_conv_bench.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import cupy as cp
import numpy as np

from kiln.ir import Graph
from kiln.ir.passes.shape_inference import infer_shapes
from kiln.runtime.kernels.cuda import choose, cudnn, nn

# (class, C, H=W, M, k, stride, pad): ResNet-50 layers of each class.
SHAPES = [
    ("1x1 (layer1 expand)", 64, 56, 256, 1, 1, 0),
    ("1x1 (layer3 reduce)", 1024, 14, 256, 1, 1, 0),
    ("3x3 (layer1)", 64, 56, 64, 3, 1, 1),
    ("3x3 (layer3)", 256, 14, 256, 3, 1, 1),
    ("3x3 stride 2 (layer2 first)", 128, 56, 128, 3, 2, 1),
    ("1x1 stride 2 (layer2 downsample)", 256, 56, 512, 1, 2, 0),
    ("7x7 stride 2 stem", 3, 224, 64, 7, 2, 3),
]
BATCHES = (1, 32)


def make_kernel(c, m, k, stride, pad, rng):
    g = Graph("conv")
    x = g.add_input("x", "float32", ["batch", c, "h", "w"])
    w = (rng.standard_normal((m, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    y = g.op("Conv", x, g.add_initializer("w", w), g.add_initializer("b", b),
             pads=[pad] * 4, strides=[stride] * 2)
    g.outputs = [y]
    infer_shapes(g)
    node = g.nodes[0]
    return choose(node, node.schema.fill_attrs(node.attrs)), w, b


def time_ms(fns: dict, target_ms: float = 10.0, batches: int = 7) -> dict:
    for fn in fns.values():
        fn()
    cp.cuda.Device().synchronize()
    reps = {}
    for name, fn in fns.items():  # calls per batch for about target_ms
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        fn()
        e.record()
        e.synchronize()
        reps[name] = max(1, min(500, int(target_ms / max(cp.cuda.get_elapsed_time(s, e), 1e-3))))
    times = {k: [] for k in fns}
    for _ in range(batches):
        for name, fn in fns.items():
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record()
            for _ in range(reps[name]):
                fn()
            e.record()
            e.synchronize()
            times[name].append(cp.cuda.get_elapsed_time(s, e) / reps[name])
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    out_dir = Path(os.environ.get("OUT", "."))
    rng = np.random.default_rng(0)
    try:
        import torch
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    except ImportError:
        torch = None
    res = {"cudnn_available": cudnn.available(), "why_unavailable": cudnn.why_unavailable(),
           "capture_ok": cudnn.capture_ok() if cudnn.available() else None,
           "capture_failure": cudnn.capture_failure(), "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "rows": []}
    if cudnn.available():
        import cudnn as frontend
        res["cudnn_backend"] = frontend.backend_version()
        res["frontend"] = getattr(frontend, "__version__", "?")
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    for label, c, hw, m, k, stride, pad in SHAPES:
        for n in BATCHES:
            row = {"class": label, "batch": n, "x": [n, c, hw, hw], "w": [m, c, k, k], "stride": stride, "pad": pad}
            x = cp.asarray(rng.standard_normal((n, c, hw, hw)).astype(np.float32))
            kernels, ws = {}, None
            for mode in ("im2col", "cudnn", "auto"):
                if mode != "im2col" and not cudnn.available():
                    continue
                cudnn.set_mode(mode)
                nn.CONV_CHOICES.clear()
                kern, w, b = make_kernel(c, m, k, stride, pad, np.random.default_rng(len(res["rows"])))
                kernels[mode] = kern
                ws = (w, b)
                try:
                    kern(x, None, None)
                except Exception as e:  # noqa: BLE001
                    row[f"{mode}_error"] = f"{type(e).__name__}: {e}"
                    kernels.pop(mode)
                    continue
                if mode != "im2col":
                    row[f"{mode}_choice"] = dict(next(iter(nn.CONV_CHOICES.values())))
            w, b = ws
            fns = {mode: (lambda kern=kern: kern(x, None, None)) for mode, kern in kernels.items() if mode != "auto"}
            if torch is not None:
                tx = torch.as_tensor(x, device="cuda")
                tw, tb = torch.as_tensor(w, device="cuda"), torch.as_tensor(b, device="cuda")
                conv = torch.nn.functional.conv2d
                with torch.no_grad():
                    fns["torch"] = lambda: conv(tx, tw, tb, stride, pad)
                    ref = cp.asarray(conv(tx.double(), tw.double(), tb.double(), stride, pad).float())
                for mode, kern in kernels.items():
                    got = kern(x, None, None)
                    row[f"{mode}_rel_err"] = float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))
            with (torch.no_grad() if torch is not None else _null()):
                row.update({f"{kk}_ms": v for kk, v in time_ms(fns).items()})
            if "cudnn_ms" in row:
                row["im2col_over_cudnn"] = row["im2col_ms"] / row["cudnn_ms"]
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out_dir / "gpu_conv_bench.json").write_text(json.dumps(res, indent=1))
    cudnn.set_mode("auto")
    print(render(res))
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def render(res: dict) -> str:
    lines = [f"Conv per shape class on {res['device']} (fp32, TF32 off; ms, median): cuDNN available: "
             f"{res['cudnn_available']} {res.get('why_unavailable') or ''}; capture ok: {res.get('capture_ok')} "
             f"{res.get('capture_failure') or ''}", "",
             "| class | batch | x | im2col | kiln cuDNN | torch cuDNN | im2col / cuDNN | auto picks | fused bias | "
             "rel. err im2col, cuDNN (vs torch fp64) |",
             "|---|---:|---|---:|---:|---:|---:|---|---|---|"]
    for r in res["rows"]:
        def f(k):
            v = r.get(k)
            return "" if v is None else f"{v:.4f}" if k.endswith("ms") else f"{v:.2f}" if k.startswith("im2col_over") \
                else f"{v:.1e}"
        pick = (r.get("auto_choice") or {}).get("path", "")
        lines.append(f"| {r['class']} | {r['batch']} | {'x'.join(map(str, r['x']))} | {f('im2col_ms')} | {f('cudnn_ms')} | "
                     f"{f('torch_ms')} | {f('im2col_over_cudnn')} | {pick} | "
                     f"{(r.get('cudnn_choice') or {}).get('fused_bias', (r.get('cudnn_choice') or {}).get('why', ''))} | {f('im2col_rel_err')}, {f('cudnn_rel_err')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--render":
        print(render(json.loads(Path(sys.argv[2]).read_text())))
    else:
        sys.exit(main())

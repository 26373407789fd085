"""The GPU runtime's acceptance benchmark (issue 8): kiln's CUDA backend against torch eager and
torch.compile on the same card, in one process, in one device-machine call.

    mkdir -p /tmp/pkg && ln -sfn $PWD /tmp/pkg/kiln && \
        PYTHONPATH=/tmp/pkg:bench python3 bench/gpu_bench.py        # on the GPU machine, writes $OUT
    .venv/bin/python bench/gpu_bench.py --render gpu_bench.json     # here: the section of RESULTS.md
    .venv/bin/python bench/gpu_bench.py --dry-run --no-compile      # here, no GPU: checks the logic

The zoo section needs the test-zoo models traced, and the device's torch (2.11) cannot trace
``transformer_encoder`` (nor, with transformers 5.x, ``hf_gpt2``). So export them here first and
carry the folder along (``bench/zoo_traced`` is git-ignored; the run's ``carry`` option copies it,
about 6 MiB, within the 64 MiB the device copy allows):

    PYTHONPATH=/tmp/hf452 .venv/bin/python bench/gpu_zoo_export.py  # here (transformers: its docstring)
    # run(carry=["bench/zoo_traced"], command="mkdir -p /tmp/pkg && ln -sfn $PWD /tmp/pkg/kiln && \
    #     PYTHONPATH=/tmp/pkg:bench python3 bench/gpu_bench.py --zoo-dir bench/zoo_traced")
    .venv/bin/python bench/gpu_bench.py --dry-run --sections zoo --zoo-dir bench/zoo_traced --zoo-prefer-dir

``--zoo-dir`` uses a file only where the device's trace fails; ``--zoo-prefer-dir`` uses it for
every model it holds (the dry run above: every exported model through the file path).

Why one script: device time is scarce and timings are only comparable on one card in one run, so
the bandwidth floor, every baseline and kiln are measured together. Sections, in this order (the
cheap, required numbers first; torch.compile of the big models last, each compile only while the
``--budget`` allows, since one can take a minute):

1. **chain**: ``sigmoid(relu((x + 1) * 2) - 0.5)`` on 2048^2 and 8192^2 float32. kiln: the
   function traced by ``kiln.trace`` and loaded as a CudaProgram (default ``cuda_graphs="auto"``,
   and forced CUDA graphs), plus the bare generated kernel; torch eager, ``torch.compile``
   (default mode and ``mode="reduce-overhead"``), a plain CuPy ElementwiseKernel, and the
   bandwidth floor (one read + one write of the tensor at the rate of a 1 GiB device-to-device
   copy measured here, counting bytes read and written).
2. **models** (bench/gpu_models.py): ResNet-50 (tests/zoo.py ``resnet50(width=64, image=224,
   num_classes=1000)``) and a BERT-base encoder in plain torch (12 layers, hidden 768, 12 heads,
   feed-forward 3072; no embeddings; seq 128) at batch 1 and 32, fp32 with TF32 off everywhere. Traced once on the CPU with a dynamic batch, then
   ``kiln.load(graph, device="cuda")``. Rows: kiln without and with CUDA graphs, torch eager,
   then torch.compile (default, reduce-overhead; static shapes, one compile per batch and mode).
   Each row: rel. error ||out - ref|| / ||ref|| against torch eager on the GPU, and peak device
   memory (weights + activations + output) of kiln and torch eager for the same model.
3. **zoo**: every tests/zoo.py model (those needing a missing package skipped) through
   CudaProgram, with and without CUDA graphs, on the example inputs and on fresh inputs at other
   sizes, against torch eager on the GPU at rtol 1e-4, atol 1e-5 (the test suite's tolerance).
   A model that does not trace on the device is taken from ``--zoo-dir`` (bench/gpu_zoo_export.py:
   the .kiln file traced on the CPU box plus the model's state_dict, both sha256-checked against
   the manifest); the weights are loaded into the model built here with ``strict=True``, so the
   torch reference on the GPU has exactly the traced weights. Each row says where it was traced.
4. **compile**: torch.compile of the models, most important first (batch 1 reduce-overhead, the
   goal's reference), each skipped once the budget would be overrun.

Timing: every variant is warmed up, then timed with CUDA events (CuPy's for kiln and CuPy, torch's
for torch, all on the legacy default stream) around back-to-back calls, in batches of about 25 ms;
2 rounds x 7 batches, interleaved across the variants of a row; the median per call is reported.
Inputs are random normal (never zeros). After every section the results so far are written to
``$OUT/gpu_bench.json`` and ``$OUT/gpu_bench.md``, so a run cut short still leaves its numbers.

Peak memory: kiln's is read off CuPy's memory pools through a MemoryHook that adds up the blocks
taken from any pool (default or a CUDA graph's private one) during load + one run, less those given
back (peak in use); with CUDA graphs also what the pools hold afterwards (reserved: a captured
graph keeps its private pool). torch's is ``torch.cuda.max_memory_allocated`` over ``.cuda()`` +
one run. Both count weights, activations and the output, not the input.
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

TITLE = "## GPU runtime (issue 8)"
MIB = 2.0 ** 20
RTOL, ATOL = 1e-4, 1e-5
COMPILE_MODES = ("default", "reduce-overhead")


def log(*args) -> None:
    print(*args, flush=True)


def chain_fn(x):
    import torch
    return torch.sigmoid(torch.relu((x + 1) * 2) - 0.5)


# ---------------------------------------------------------------------------- where things run
class Dev:
    """The device layer: ``cuda`` on the GPU machine (CuPy + torch CUDA, CUDA-event timings) or,
    with ``--dry-run``, the CPU (kiln's CPU runtime, torch on the CPU, host-clock timings) so that
    this script's logic can be checked where there is no GPU."""

    def __init__(self, dry: bool):
        import torch
        self.dry = dry
        self.torch = torch
        self.tdev = "cpu" if dry else "cuda"
        self.cp = None
        if not dry:
            import cupy
            self.cp = cupy

    def kiln_array(self, a: np.ndarray):
        return a if self.dry else self.cp.asarray(a)

    def load(self, graph, **options):
        import kiln
        if self.dry:
            return kiln.load(graph.copy())
        return kiln.load(graph.copy(), device="cuda", **options)

    def sync(self) -> None:
        if not self.dry:
            self.cp.cuda.Device().synchronize()
            self.torch.cuda.synchronize()

    def host(self, a) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        if self.cp is not None and isinstance(a, self.cp.ndarray):
            return a.get()
        if isinstance(a, self.torch.Tensor):
            from kiln.frontend.tracer import to_numpy
            return to_numpy(a)
        return np.asarray(a)

    def _time_batch(self, fn: Callable, iters: int, lib: str) -> float:
        """Mean ms per call of ``iters`` back-to-back calls."""
        if self.dry:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t) * 1e3 / iters
        if lib == "torch":
            torch = self.torch
            s = torch.cuda.current_stream()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            for _ in range(iters):
                fn()
            b.record(s)
            b.synchronize()
            return a.elapsed_time(b) / iters
        cp = self.cp
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) / iters

    def bench(self, variants: dict, rounds: int = 2, reps: int = 7, target_ms: float = 25.0) -> dict:
        """``{name: (fn, lib)}`` -> ``{name: {"ms": median per call, ...}}`` or ``{"error": ...}``.
        Warm-up, then batch sizes chosen for about ``target_ms`` a batch; the rounds interleave the
        variants so that drift hits each alike."""
        iters, out = {}, {}
        for name, (fn, lib) in variants.items():
            try:
                for _ in range(3):
                    fn()
                self.sync()
                est = self._time_batch(fn, 3, lib)
                iters[name] = max(1, min(2000, int(target_ms / max(est, 1e-4))))
            except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        times: dict = {k: [] for k in iters}
        for _ in range(rounds):
            for name in iters:
                fn, lib = variants[name]
                for _ in range(reps):
                    times[name].append(self._time_batch(fn, iters[name], lib))
        for name, ts in times.items():
            out[name] = {"ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts),
                         "iters": iters[name], "batches": len(ts)}
        return out

    # ---------------------------------------------------------------- memory
    def kiln_memory(self, graph, x: np.ndarray, graphs: bool) -> dict:
        """Peak device memory of a fresh CudaProgram over load + one run (see the module doc)."""
        if self.dry:
            return {}
        cp = self.cp
        xd = cp.asarray(x)
        gc.collect()
        pool = cp.get_default_memory_pool()
        pool.free_all_blocks()
        total0 = pool.total_bytes()

        res: dict = {}
        try:
            class Peak(cp.cuda.MemoryHook):
                name = "gpu_bench_peak"

                def __init__(self):
                    self.live: dict = {}
                    self.cur = self.peak = 0

                def malloc_postprocess(self, **kw):
                    self.live[kw["mem_ptr"]] = kw["mem_size"]
                    self.cur += kw["mem_size"]
                    self.peak = max(self.peak, self.cur)

                def free_postprocess(self, **kw):
                    self.cur -= self.live.pop(kw["mem_ptr"], 0)

            hook = Peak()
            with hook:
                p = self.load(graph, cuda_graphs=graphs)
                out = p.run([xd], as_list=True)
                cp.cuda.Device().synchronize()
            res["peak_in_use_MiB"] = hook.peak / MIB
        except Exception as e:  # noqa: BLE001 - the pool figures below still stand
            res["hook_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            p = self.load(graph, cuda_graphs=graphs)
            out = p.run([xd], as_list=True)
            cp.cuda.Device().synchronize()
        private = sum(_graph_pool(entry).total_bytes() for entry in getattr(p, "_graphs", {}).values())
        res["reserved_MiB"] = (pool.total_bytes() - total0 + private) / MIB
        res["graph_pool_MiB"] = private / MIB
        del p, out, xd
        gc.collect()
        pool.free_all_blocks()
        return res

    def torch_memory(self, model, weights_bytes: int, x: np.ndarray) -> dict:
        """torch eager: weights + max_memory_allocated over one run beyond what was there before."""
        if self.dry:
            return {}
        torch = self.torch
        xt = torch.from_numpy(x).to("cuda")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        a0 = torch.cuda.memory_allocated()
        out = model(xt)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - a0 + weights_bytes
        del out, xt
        return {"peak_MiB": peak / MIB, "weights_MiB": weights_bytes / MIB}


# ---------------------------------------------------------------------------- helpers
def _graph_pool(entry):
    """The private memory pool of a CudaProgram graph entry (the first item it keeps alive)."""
    return entry._keep[0]


def rel_err(got: np.ndarray, want: np.ndarray) -> dict:
    g, w = got.astype(np.float64), want.astype(np.float64)
    if g.shape != w.shape:
        return {"shape_mismatch": f"{g.shape} vs {w.shape}"}
    d = np.abs(g - w)
    return {"rel_l2": float(np.linalg.norm(g - w) / (np.linalg.norm(w) + 1e-30)),
            "max_abs": float(d.max()) if d.size else 0.0,
            # assert_allclose's criterion: pass iff every element has ratio <= 1
            "tol_ratio": float((d / (ATOL + RTOL * np.abs(w))).max()) if d.size else 0.0,
            "finite": bool(np.isfinite(g).all())}


def flat_outputs(out, torch) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [a for v in out.values() for a in flat_outputs(v, torch)]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [a for v in out for a in flat_outputs(v, torch)]


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def program_info(p) -> dict:
    info = {}
    for key in ("fused_groups", "cuda_graphs", "fallback_ops", "host_ops", "graph_failures"):
        if hasattr(p, key):
            v = getattr(p, key)
            info[key] = {str(k): str(x) for k, x in v.items()} if isinstance(v, dict) else v
    plan = getattr(p, "plan", None)
    if plan is not None:
        info["instructions"] = len(plan.instructions)
    return info


def find_launcher(p):
    """The generated kernel's launcher inside a CudaProgram's plan (the fused chain)."""
    for ins in p.plan.instructions:
        k = getattr(ins, "kernel", None)
        while k is not None:
            if hasattr(k, "launcher"):
                return k.launcher
            k = getattr(k, "inner", None)
    return None


def set_no_tf32(torch) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


# ---------------------------------------------------------------------------- 0. environment
def environment(dev: Dev) -> dict:
    import torch

    import kiln
    env = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "kiln": getattr(kiln, "__version__", "?"), "host": platform.node(), "cpus": os.cpu_count(),
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "dry_run": dev.dry}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        env["tf32"] = {"matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                       "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                       "float32_matmul_precision": torch.get_float32_matmul_precision()}
    except Exception as e:  # noqa: BLE001 - informative only
        env["tf32"] = err_text(e)
    if dev.dry:
        env["device"] = f"CPU ({platform.processor() or platform.machine()}), dry run"
        return env
    cp = dev.cp
    props = cp.cuda.runtime.getDeviceProperties(0)
    env.update(device=props["name"].decode(), sm_count=props["multiProcessorCount"],
               memory_GiB=props["totalGlobalMem"] / 2 ** 30, cupy=cp.__version__,
               cuda_runtime=cp.cuda.runtime.runtimeGetVersion(), cuda_driver=cp.cuda.runtime.driverGetVersion(),
               torch_cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        env["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        env["nvidia_smi"] = err_text(e)
    return env


def copy_bandwidth(dev: Dev) -> float:
    """GB/s of a 1 GiB device-to-device copy, bytes read + written (64 MiB host copy if dry)."""
    if dev.dry:
        src = np.ones(1 << 24, np.float32)
        dst = np.empty_like(src)
        ms = dev.bench({"copy": (lambda: np.copyto(dst, src), "")}, rounds=1)["copy"]["ms"]
        return 2 * src.nbytes / (ms * 1e-3) / 1e9
    cp = dev.cp
    src = cp.random.standard_normal(1 << 28, dtype=cp.float32)
    dst = cp.empty_like(src)
    ms = dev.bench({"copy": (lambda: cp.copyto(dst, src), "cupy")}, rounds=1)["copy"]["ms"]
    bw = 2 * src.nbytes / (ms * 1e-3) / 1e9
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return bw


# ---------------------------------------------------------------------------- 1. chain
def torch_compiled(dev: Dev, fn, mode: str, example) -> tuple:
    """(compiled fn, compile seconds: the first call's wall time) for static shapes."""
    torch = dev.torch
    torch._dynamo.reset()
    try:
        from torch._dynamo.utils import counters
        counters.clear()
    except ImportError:
        pass
    cf = torch.compile(fn, mode=None if mode == "default" else mode, dynamic=False)
    t = time.perf_counter()
    cf(example)
    dev.sync()
    return cf, time.perf_counter() - t


def dynamo_stats(torch) -> dict:
    """Graphs Dynamo made and graph breaks since the last reset (why a compile may equal eager)."""
    try:
        from torch._dynamo.utils import counters
        return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
                "graph_breaks": int(sum(counters["graph_break"].values()))}
    except Exception as e:  # noqa: BLE001 - informative only
        return {"error": err_text(e)}


def chain_section(dev: Dev, sizes: tuple, compile_: bool, results: dict) -> None:
    import kiln
    torch = dev.torch
    bw = copy_bandwidth(dev)
    results["copy_GBps"] = bw
    log(f"copy bandwidth {bw:.0f} GB/s (read + write)")
    cupy_ref = None
    if not dev.dry:
        cupy_ref = dev.cp.ElementwiseKernel(
            "float32 x", "float32 y", "float t = (x + 1.0f) * 2.0f; t = t > 0.0f ? t : 0.0f; t = t - 0.5f;"
            " y = 1.0f / (1.0f + expf(-t));", "chain_ref")
    rows = results.setdefault("rows", [])
    for n in sizes:
        row: dict = {"n": n, "floor_ms": 2 * n * n * 4 / (bw * 1e9) * 1e3}
        rows.append(row)
        x = np.random.default_rng(n).standard_normal((n, n), dtype=np.float32)
        graph = kiln.trace(chain_fn, (torch.from_numpy(x),), check=False)
        p_auto = dev.load(graph)
        row["kiln_auto"] = program_info(p_auto)
        xk = dev.kiln_array(x)
        xt = torch.from_numpy(x).to(dev.tdev)
        want = chain_fn(xt)
        variants = {"kiln_program": (lambda: p_auto.run([xk], as_list=True), "cupy")}
        if not dev.dry:
            p_graphs = dev.load(graph, cuda_graphs=True)
            variants["kiln_program_graphs"] = (lambda: p_graphs.run([xk], as_list=True), "cupy")
            launcher = find_launcher(p_auto)
            if launcher is not None:
                variants["kiln_kernel"] = (lambda: launcher(xk), "cupy")
            variants["cupy_elementwise"] = (lambda: cupy_ref(xk), "cupy")
        variants["torch_eager"] = (lambda: chain_fn(xt), "torch")
        errs = {"kiln_program": rel_err(dev.host(p_auto.run([xk], as_list=True)[0]), dev.host(want))}
        if "kiln_program_graphs" in variants:
            errs["kiln_program_graphs"] = rel_err(dev.host(p_graphs.run([xk], as_list=True)[0]), dev.host(want))
            errs["cupy_elementwise"] = rel_err(dev.host(cupy_ref(xk)), dev.host(want))
        timings = dev.bench(variants)
        if compile_:
            for mode in COMPILE_MODES:
                key = "torch_compile" if mode == "default" else "torch_compile_ro"
                try:
                    cf, secs = torch_compiled(dev, chain_fn, mode, xt)
                    row[key + "_compile_s"] = secs
                    errs[key] = rel_err(dev.host(cf(xt).clone()), dev.host(want))
                    timings.update(dev.bench({key: (lambda: cf(xt), "torch")}))
                    del cf
                except Exception as e:  # noqa: BLE001
                    timings[key] = {"error": err_text(e)}
                torch._dynamo.reset()
        row["timings"] = timings
        row["errors"] = errs
        log(f"chain {n}^2: floor {row['floor_ms']:.4f} ms; " +
            ", ".join(f"{k} {v['ms']:.4f}" if "ms" in v else f"{k} ERROR {v['error']}" for k, v in timings.items()))
        del p_auto, xk, xt, want
        variants.clear()
        if not dev.dry:
            del p_graphs
            gc.collect()
            dev.cp.get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- 2. models
def model_specs(dry: bool) -> list:
    import gpu_models
    if dry:
        return [("resnet50", "ResNet-50 (tiny: width 8, 3x64x64)",
                 lambda: gpu_models.resnet50(batch=1, width=8, image=64, num_classes=10)),
                ("bert_base", "BERT-style encoder (tiny: 2 layers, hidden 32), seq 16",
                 lambda: gpu_models.bert(batch=1, seq=16, d=32, heads=4, ff=64, layers=2))]
    return [("resnet50", "ResNet-50, 3x224x224", gpu_models.resnet50),
            ("bert_base", "BERT-base encoder (12 layers, hidden 768, 12 heads, ff 3072), seq 128", gpu_models.bert)]


class ModelState:
    """One model's GPU-side objects, kept for the compile section."""

    def __init__(self, key, label, model, graph, example_shape):
        self.key, self.label, self.model, self.graph = key, label, model, graph
        self.example_shape = example_shape
        self.inputs: dict = {}   # batch -> (numpy, torch tensor on the device)
        self.want: dict = {}     # batch -> torch eager output (host)


def model_section(dev: Dev, batches: tuple, results: dict) -> list:
    """Each model on its own: one that fails is recorded and the others still run."""
    states = []
    for key, label, factory in model_specs(dev.dry):
        try:
            states.append(one_model(dev, key, label, factory, batches, results))
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            results.setdefault(key, {"label": label, "rows": {}})["error"] = err_text(e)
            log(f"{key}: ERROR {err_text(e)}")
        write_outputs(_STATE.get("results", {}))
    return states


def one_model(dev: Dev, key: str, label: str, factory: Callable, batches: tuple, results: dict) -> "ModelState":
    import kiln
    torch = dev.torch
    t0 = time.perf_counter()
    model, inputs, spec = factory()
    graph = kiln.trace(model, inputs, dynamic=spec, check=False)
    trace_s = time.perf_counter() - t0
    st = ModelState(key, label, model, graph, tuple(inputs[0].shape[1:]))
    mres = results.setdefault(key, {"label": label, "trace_s": trace_s, "rows": {}})
    log(f"{key}: traced in {trace_s:.1f}s, {len(graph.nodes)} nodes")
    # kiln memory, fresh programs per batch, before anything else of this model is on the GPU
    xs = {b: np.random.default_rng(100 + b).standard_normal((b, *st.example_shape), dtype=np.float32)
          for b in batches}
    for b in batches:
        row = mres["rows"].setdefault(str(b), {"batch": b})
        for graphs in (False, True):
            try:
                row["kiln_graphs_memory" if graphs else "kiln_eager_memory"] = dev.kiln_memory(graph, xs[b], graphs)
            except Exception as e:  # noqa: BLE001
                row["kiln_graphs_memory" if graphs else "kiln_eager_memory"] = {"error": err_text(e)}
    pe = dev.load(graph, cuda_graphs=False)
    pg = dev.load(graph, cuda_graphs=True)
    pa = dev.load(graph)
    mres["kiln_auto"] = program_info(pa)
    del pa
    if not dev.dry:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        a0 = torch.cuda.memory_allocated()
    m = model.to(dev.tdev)
    weights = 0 if dev.dry else torch.cuda.memory_allocated() - a0
    for b in batches:
        row = mres["rows"][str(b)]
        x = xs[b]
        row["torch_eager_memory"] = dev.torch_memory(m, weights, x)
        xk = dev.kiln_array(x)
        xt = torch.from_numpy(x).to(dev.tdev)
        st.inputs[b] = (x, xt)
        want = dev.host(m(xt))
        st.want[b] = want
        errs = {}
        try:
            errs["kiln_eager"] = rel_err(dev.host(pe.run([xk], as_list=True)[0]), want)
            errs["kiln_graphs"] = rel_err(dev.host(pg.run([xk], as_list=True)[0]), want)
            errs["kiln_graphs_replay"] = rel_err(dev.host(pg.run([xk], as_list=True)[0]), want)
        except Exception as e:  # noqa: BLE001
            errs["error"] = err_text(e)
        row["errors"] = errs
        timings = dev.bench({"kiln_eager": (lambda: pe.run([xk], as_list=True), "cupy"),
                             "kiln_graphs": (lambda: pg.run([xk], as_list=True), "cupy"),
                             "torch_eager": (lambda: m(xt), "torch")})
        row.setdefault("timings", {}).update(timings)
        row["kiln_eager_program"] = program_info(pe)
        row["kiln_graphs_program"] = program_info(pg)
        log(f"{key} b{b}: " + ", ".join(f"{k} {v['ms']:.3f} ms" if "ms" in v else f"{k} ERROR {v['error']}"
                                       for k, v in timings.items()) +
            "; rel err " + ", ".join(f"{k} {v.get('rel_l2', float('nan')):.2e}" for k, v in errs.items()
                                     if isinstance(v, dict)) +
            f"; mem kiln {row['kiln_eager_memory']} / {row['kiln_graphs_memory']}, torch {row['torch_eager_memory']}")
        del xk
    st.model = m
    del pe, pg
    if not dev.dry:
        gc.collect()
        dev.cp.get_default_memory_pool().free_all_blocks()
    return st


def compile_section(dev: Dev, states: list, batches: tuple, results: dict, deadline: float) -> None:
    """torch.compile rows, most important first, each only if its predicted cost fits."""
    torch = dev.torch
    # batch 1 reduce-overhead (the goal's reference), batch 1 default, then the big batch
    # (reduce-overhead last: the first to go when time runs short)
    small, big = batches[0], batches[-1]
    order = [(small, "reduce-overhead"), (small, "default"), (big, "default"), (big, "reduce-overhead")]
    last_cost: dict = {}
    for b, mode in order:
        for st in states:
            row = results[st.key]["rows"][str(b)]
            key = "torch_compile" if mode == "default" else "torch_compile_ro"
            predicted = 1.3 * last_cost.get(st.key, 60.0)
            left = deadline - time.monotonic()
            if left < predicted:
                row.setdefault("timings", {})[key] = {"skipped": f"time budget: {left:.0f}s left, a compile of "
                                                                  f"{st.key} predicted {predicted:.0f}s"}
                log(f"{st.key} b{b} {mode}: skipped ({left:.0f}s left)")
                continue
            x, xt = st.inputs[b]
            try:
                cf, secs = torch_compiled(dev, st.model, mode, xt)
                last_cost[st.key] = secs + 5.0
                row[key + "_compile_s"] = secs
                row[key + "_dynamo"] = dynamo_stats(torch)
                row.setdefault("errors", {})[key] = rel_err(dev.host(cf(xt)), st.want[b])
                row["timings"].update(dev.bench({key: (lambda: cf(xt), "torch")}))
                del cf
                log(f"{st.key} b{b} {mode}: compile {secs:.0f}s, {row['timings'][key]}")
            except Exception as e:  # noqa: BLE001
                row.setdefault("timings", {})[key] = {"error": err_text(e)}
                log(f"{st.key} b{b} {mode}: ERROR {err_text(e)}")
            torch._dynamo.reset()
            if not dev.dry:
                torch.cuda.empty_cache()
            write_outputs(results)


# ---------------------------------------------------------------------------- 3. zoo
class ZooFileError(Exception):
    """A file of ``--zoo-dir`` that cannot stand in for a device trace (missing, changed since the
    export, weights or inputs that do not fit the model built here)."""


def zoo_manifest(zoo_dir: Path) -> dict:
    """``--zoo-dir``'s manifest.json, written by bench/gpu_zoo_export.py."""
    return json.loads((zoo_dir / "manifest.json").read_text())


def zoo_traced_label(torch_version: str, entry, package_version: Optional[str]) -> str:
    """'torch X' (', transformers Y' for an entry that needs that package): what a graph was traced with."""
    extra = f", {entry.needs} {package_version}" if entry.needs is not None and package_version else ""
    return f"torch {torch_version}{extra}"


def zoo_from_dir(dev: Dev, zoo_dir: Path, rec: dict, model, names: list):
    """The graph of ``DIR/<name>.kiln`` (traced on the CPU box by gpu_zoo_export.py), after loading
    ``DIR/<name>.pt`` into ``model`` with ``strict=True``, so the torch reference computed from
    ``model`` has exactly the weights baked into the graph. Both files are checked against the
    manifest's sha256 first; any problem raises ZooFileError."""
    import kiln
    from gpu_zoo_export import sha256
    for name, want in rec["sha256"].items():
        path = zoo_dir / name
        if not path.is_file():
            raise ZooFileError(f"{path} is missing")
        got = sha256(path)
        if got != want:
            raise ZooFileError(f"{path}: sha256 {got[:16]}... differs from the manifest's {want[:16]}...")
    pt = zoo_dir / rec["files"]["state_dict"]
    try:
        state = dev.torch.load(pt, map_location="cpu", weights_only=True)
        model.load_state_dict(state, strict=True)
    except Exception as e:  # noqa: BLE001 - RuntimeError (keys/shapes) or an unreadable file
        raise ZooFileError(f"the weights in {pt.name} do not fit the model built here "
                           f"(load_state_dict strict=True): {err_text(e)}") from e
    graph = kiln.load_graph(zoo_dir / rec["files"]["kiln"])
    graph_inputs = [v.name for v in graph.inputs]
    if graph_inputs != list(names):
        raise ZooFileError(f"{rec['files']['kiln']} takes inputs {graph_inputs}, the model built here {list(names)}")
    return graph


def zoo_section(dev: Dev, results: dict, zoo_dir: Optional[Path] = None, prefer_dir: bool = False,
                only: Optional[list] = None) -> None:
    """Every zoo entry (or the ``only`` ones) traced here, or, where that fails or ``prefer_dir``,
    loaded from ``zoo_dir`` (see bench/gpu_zoo_export.py), then compared with torch on the device."""
    import kiln
    import zoo
    torch = dev.torch
    rows = results.setdefault("rows", [])
    files: dict = {}
    if zoo_dir is not None:
        zoo_dir = Path(zoo_dir)
        try:
            manifest = zoo_manifest(zoo_dir)
            files = manifest.get("entries", {})
            results["zoo_dir"] = {"path": str(zoo_dir), "torch": manifest.get("torch_version"),
                                  "kiln": manifest.get("kiln_version"), "created": manifest.get("created"),
                                  "entries": sorted(files), "not_exported": manifest.get("skipped", {}),
                                  "prefer": prefer_dir}
        except (OSError, ValueError) as e:
            results["zoo_dir"] = {"path": str(zoo_dir), "error": err_text(e)}
        log(f"zoo dir: {results['zoo_dir']}")
    for entry in zoo.ZOO:
        if only and entry.name not in only:
            continue
        if entry.needs is not None and importlib.util.find_spec(entry.needs) is None:
            rows.append({"model": entry.name, "status": "skipped", "note": f"{entry.needs} is not installed"})
            continue
        here_label = "device (" + zoo_traced_label(
            torch.__version__, entry, None if entry.needs is None else _module_version(entry.needs)) + ")"
        model, inputs, spec = entry.factory()
        rec = files.get(entry.name)
        base: dict = {"model": entry.name}
        graph = None
        if rec is None or not prefer_dir:
            try:
                graph = kiln.trace(model, inputs, dynamic=spec)
                base["traced"] = here_label
            except Exception as e:  # noqa: BLE001 - a frontend failure, recorded as such
                log(f"zoo {entry.name}: trace failed: {err_text(e)}")
                if rec is None:
                    note = err_text(e) + ("" if zoo_dir is None else f" (no file for it in {zoo_dir})")
                    rows.append({**base, "status": "trace failed", "traced": "failed on " + here_label, "note": note})
                    continue
                base["device_trace_error"] = err_text(e)
        if graph is None:
            base["traced"] = "CPU box (" + zoo_traced_label(
                rec.get("torch_version", "?"), entry, rec.get(f"{entry.needs}_version")) + ")"
            if entry.needs is not None:  # the torch reference is this machine's version of the model
                base["reference"] = here_label.replace("device (", "device's model (")
            try:
                names, _ = zoo.input_list(model, inputs)
                graph = zoo_from_dir(dev, zoo_dir, rec, model, names)
            except ZooFileError as e:
                rows.append({**base, "status": "error", "note": str(e)})
                log(f"zoo {entry.name}: {zoo_dir} file not used: {e}")
                continue
            log(f"zoo {entry.name}: graph and weights from {zoo_dir} ({base['traced']})")
        zoo_compare(dev, entry, model, inputs, spec, graph, base, rows)


def _module_version(name: str) -> str:
    try:
        return getattr(importlib.import_module(name), "__version__", "?")
    except ImportError:
        return "?"


def zoo_compare(dev: Dev, entry, model, inputs, spec, graph, base: dict, rows: list) -> None:
    """Rows (CUDA graphs off, on) of ``graph`` through kiln against ``model`` in torch on the device,
    on the example inputs and on fresh ones at the entry's last other size."""
    import zoo
    from kiln.frontend.tracer import to_numpy
    torch = dev.torch
    names, tensors = zoo.input_list(model, inputs)
    sizes = dict(entry.other_sizes[-1])
    _, fresh = zoo.fresh_inputs(model, inputs, spec, sizes, seed=7)
    sets = [("example", tensors), ("fresh " + ",".join(f"{k}={v}" for k, v in sizes.items()
                                                         if any(k in d.values() for d in spec.values())), fresh)]
    def forward(mod, ts, device, double=False):
        tt = [t.to(device) for t in ts]
        if double:
            tt = [t.double() if t.is_floating_point() else t for t in tt]
        with torch.no_grad():
            out = mod(**dict(zip(names, tt))) if isinstance(inputs, dict) else mod(*tt)
        return [to_numpy(o) for o in flat_outputs(out, torch)]
    # float64 on the CPU: what both float32 GPU results are measured against (which one is off).
    m64 = copy.deepcopy(model).double()
    truth = {label: forward(m64, ts, "cpu", double=True) for label, ts in sets}
    del m64
    m = model.to(dev.tdev)
    # The reference is the module's own math: nn.MultiheadAttention's fused "fast path" (on by
    # default in eval under no_grad) is switched off for it, and measured on the side.
    mha = getattr(getattr(torch, "backends", None), "mha", None)
    fast_before = mha.get_fastpath_enabled() if mha is not None else None
    wants, fast = {}, {}
    try:
        if mha is not None:
            mha.set_fastpath_enabled(False)
        for label, ts in sets:
            wants[label] = forward(m, ts, dev.tdev)
        if mha is not None:
            mha.set_fastpath_enabled(True)
            for label, ts in sets:
                fast[label] = forward(m, ts, dev.tdev)
    finally:
        if mha is not None:
            mha.set_fastpath_enabled(fast_before)

    def vs_truth(outs, label):
        return max((rel_err(o, t).get("rel_l2", math.inf) for o, t in zip(outs, truth[label])), default=0.0)
    base = {**base, "vs_float64": {label: {"torch_gpu": vs_truth(wants[label], label),
                                           "torch_gpu_fastpath": vs_truth(fast[label], label) if fast else None}
                                   for label, _ in sets}}
    for graphs in (False, True):
        row = {**base, "cuda_graphs": graphs, "checks": []}
        try:
            p = dev.load(graph, cuda_graphs=graphs)
            for label, ts in sets:
                got = p.run([dev.kiln_array(to_numpy(t)) for t in ts], as_list=True)
                want = wants[label]
                errs = [rel_err(dev.host(g), w) for g, w in zip(got, want)]
                ok = len(got) == len(want) and all(e.get("finite") and e.get("tol_ratio", math.inf) <= 1.0
                                                   for e in errs)
                row["checks"].append({"inputs": label, "ok": ok, "outputs": len(got),
                                      "kiln_vs_float64": vs_truth([dev.host(g) for g in got], label),
                                      "max_abs": max((e.get("max_abs", math.inf) for e in errs), default=0.0),
                                      "rel_l2": max((e.get("rel_l2", math.inf) for e in errs), default=0.0),
                                      "tol_ratio": max((e.get("tol_ratio", math.inf) for e in errs), default=0.0)})
            row["program"] = program_info(p)
            row["status"] = "pass" if all(c["ok"] for c in row["checks"]) else "FAIL"
            del p
        except Exception as e:  # noqa: BLE001
            row["status"] = "error"
            row["note"] = err_text(e)
        rows.append(row)
        log(f"zoo {entry.name} graphs={graphs} ({row.get('traced')}): {row['status']} " +
            " ".join(f"[{c['inputs']}: tol_ratio {c['tol_ratio']:.3g} rel_l2 {c['rel_l2']:.2e}]"
                     for c in row["checks"]) + (f" {row.get('note', '')}" if "note" in row else ""))
    del m
    if not dev.dry:
        gc.collect()
        dev.cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- output
OUT = Path(os.environ.get("OUT") or "gpu_out")
_STATE: dict = {}


def write_outputs(results: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    try:
        (OUT / "gpu_bench.md").write_text(render(results))
    except Exception as e:  # noqa: BLE001 - the JSON is what matters; render again locally
        (OUT / "gpu_bench.md").write_text(f"render failed: {err_text(e)}\n")


def _ms(t: dict, key: str, digits: int = 3) -> str:
    v = t.get(key)
    if not v:
        return ""
    if "ms" in v:
        return f"{v['ms']:.{digits}f}"
    return "skipped" if "skipped" in v else "error"


def _get(t: dict, key: str) -> Optional[float]:
    v = t.get(key) or {}
    return v.get("ms")


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}" if a is not None and b else ""


def _mark(ok: Optional[bool]) -> str:
    return "not measured" if ok is None else ("met" if ok else "not met")


def render(res: dict) -> str:
    env = res.get("env", {})
    lines = [TITLE, ""]
    versions = ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "torch_cuda", "cudnn", "triton", "cupy", "numpy",
                                                   "kiln") if k in env)
    cuda = ""
    if "cuda_runtime" in env:
        cuda = f"; CUDA runtime {env['cuda_runtime']}, driver API {env['cuda_driver']} (nvidia-smi: {env.get('nvidia_smi', '')})"
    lines.append(
        f"`bench/gpu_bench.py`, one process on the device machine: **{env.get('device', '?')}** "
        f"({env.get('sm_count', '?')} SMs, {env.get('memory_GiB', 0):.0f} GiB){cuda}; {versions}; {env.get('date', '')}"
        f"{' — DRY RUN on the CPU, not GPU figures' if env.get('dry_run') else ''}. "
        "fp32 everywhere, TF32 off (`torch.backends.cuda.matmul.allow_tf32 = cudnn.allow_tf32 = False`, "
        "`set_float32_matmul_precision('highest')`; kiln's `tf32=False` default). Times: median per call of "
        "CUDA-event-timed batches of back-to-back calls (about 25 ms a batch, 2 rounds x 7 batches interleaved "
        "across a row's variants, after warm-up; CuPy's events for kiln and CuPy, torch's for torch, all on the "
        "default stream); inputs random normal. kiln: `kiln.trace` on the CPU (models: dynamic batch), then "
        "`kiln.load(graph, device=\"cuda\")` (CudaProgram: attention fused into one kernel from 1 block per SM, "
        "elementwise chains into generated kernels, Conv/MatMul/Gemm epilogues into cuDNN graphs, cublasLt bias "
        "epilogues or one generated pass; cuBLAS and cublasLt through ctypes; convolution by cuDNN from batch 8, "
        "im2col + cuBLAS below); \"CUDA graphs\" = `cuda_graphs=True` (each run copies the input into the "
        "captured buffers, replays, and copies the output out), \"eager\" = `cuda_graphs=False`. torch.compile: "
        "Inductor, `dynamic=False`, one compile per shape and mode (`torch._dynamo.reset()` between), compile time "
        "= the first call's wall time.")
    lines.append("")
    # ---- chain
    ch = res.get("chain", {})
    if ch.get("rows"):
        lines += ["### Elementwise chain `sigmoid(relu((x + 1) * 2) - 0.5)`, float32", "",
                  f"Bandwidth floor = one read + one write of the tensor at the {ch.get('copy_GBps', 0):.0f} GB/s "
                  "(bytes read + written) of a 1 GiB device-to-device copy (`cupy.copyto`) measured in this run. "
                  "kiln program = `CudaProgram` as loaded by default (`cuda_graphs=\"auto\"`: "
                  f"{'no graph for this one-kernel plan' if not ch['rows'][0].get('kiln_auto', {}).get('cuda_graphs') else 'graphs'}"
                  "); bare kernel = the generated kernel's launcher called directly (output allocation included); "
                  "CuPy = a plain `cupy.ElementwiseKernel` of the same chain. Times in ms.", "",
                  "| size | floor | kiln program | kiln + CUDA graphs | kiln bare kernel | CuPy ElementwiseKernel | "
                  "torch eager | torch.compile | torch.compile reduce-overhead | kiln / compile | kiln / floor | "
                  "kiln max abs diff vs torch |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in ch["rows"]:
            t = r.get("timings", {})
            k = _get(t, "kiln_program")
            lines.append(f"| {r['n']}^2 | {r['floor_ms']:.4f} | {_ms(t, 'kiln_program', 4)} | "
                         f"{_ms(t, 'kiln_program_graphs', 4)} | {_ms(t, 'kiln_kernel', 4)} | "
                         f"{_ms(t, 'cupy_elementwise', 4)} | {_ms(t, 'torch_eager', 4)} | {_ms(t, 'torch_compile', 4)} | "
                         f"{_ms(t, 'torch_compile_ro', 4)} | {_ratio(k, _get(t, 'torch_compile'))} | "
                         f"{_ratio(k, r['floor_ms'])} | "
                         f"{r.get('errors', {}).get('kiln_program', {}).get('max_abs', float('nan')):.1e} |")
        comp = [f"{r['n']}^2 default {r.get('torch_compile_compile_s', float('nan')):.0f} s, reduce-overhead "
                f"{r.get('torch_compile_ro_compile_s', float('nan')):.0f} s" for r in ch["rows"]]
        lines += ["", "torch.compile time (first call): " + "; ".join(comp) + ".", ""]
    # ---- models
    mres = res.get("models", {})
    model_rows = [(key, m, m["rows"][b]) for key, m in mres.items() if isinstance(m, dict) and "rows" in m
                  for b in sorted(m["rows"], key=int)]
    if model_rows:
        lines += ["### ResNet-50 and BERT-base, fp32, TF32 off", "",
                  "Models in `bench/gpu_models.py`, random weights. ResNet-50: tests/zoo.py `resnet50(width=64, "
                  "image=224, num_classes=1000)` (torchvision's layout; BN folded by kiln's optimizer). BERT-base: "
                  "BERT's encoder layer written in plain torch (QKV projection, `F.scaled_dot_product_attention` "
                  "without mask, output projection, residual + LayerNorm, 768 -> 3072 -> 768 with exact GELU, "
                  "residual + LayerNorm; the embeddings' LayerNorm first), 12 layers, hidden 768, 12 heads, "
                  "seq 128, input = hidden states (no token embeddings). (tests/zoo.py `transformer_encoder`, "
                  "`nn.TransformerEncoderLayer`, does not trace on the device's torch 2.11: its attention is the "
                  "Python function `F.multi_head_attention_forward`.) torch eager runs under `no_grad`. Times in ms; ratios < 1 mean kiln is faster. rel. err = "
                  "||out - torch eager|| / ||torch eager|| on the same GPU. Memory (MiB, weights + activations + "
                  "output): kiln eager = peak of the blocks in use in CuPy's pools over load + one run; kiln graphs = "
                  "what the pools hold after capture (the graph keeps its private pool); torch eager = "
                  "`max_memory_allocated` over `.cuda()` + one run.", "",
                  "| model | batch | kiln eager | kiln CUDA graphs | torch eager | torch.compile | "
                  "torch.compile reduce-overhead | kiln graphs / torch eager | kiln graphs / compile r-o | "
                  "rel. err kiln (eager, graphs) | rel. err compile (default, r-o) | memory kiln eager / kiln graphs / "
                  "torch eager |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for key, m, r in model_rows:
            t = r.get("timings", {})
            e = r.get("errors", {})
            kg = _get(t, "kiln_graphs")

            def err(k):
                v = e.get(k, {})
                return f"{v['rel_l2']:.1e}" if "rel_l2" in v else ""

            def mem(d, k):
                return f"{d[k]:.0f}" if isinstance(d, dict) and k in d else "?"
            lines.append(f"| {m['label']} | {r['batch']} | {_ms(t, 'kiln_eager')} | {_ms(t, 'kiln_graphs')} | "
                         f"{_ms(t, 'torch_eager')} | {_ms(t, 'torch_compile')} | {_ms(t, 'torch_compile_ro')} | "
                         f"{_ratio(kg, _get(t, 'torch_eager'))} | {_ratio(kg, _get(t, 'torch_compile_ro'))} | "
                         f"{err('kiln_eager')}, {err('kiln_graphs')} | {err('torch_compile')}, "
                         f"{err('torch_compile_ro')} | {mem(r.get('kiln_eager_memory'), 'peak_in_use_MiB')} / "
                         f"{mem(r.get('kiln_graphs_memory'), 'reserved_MiB')} / "
                         f"{mem(r.get('torch_eager_memory'), 'peak_MiB')} |")
        notes = []
        for key, m, r in model_rows:
            t = r.get("timings", {})
            for k in ("torch_compile", "torch_compile_ro"):
                v = t.get(k, {})
                if "skipped" in v or "error" in v:
                    notes.append(f"{m['label']} b{r['batch']} {k}: {v.get('skipped') or v.get('error')}")
            cs = [f"{k} {r[k + '_compile_s']:.0f} s" + (
                  f" ({r[k + '_dynamo'].get('graphs')} graphs, {r[k + '_dynamo'].get('graph_breaks')} graph breaks)"
                  if "graphs" in r.get(k + "_dynamo", {}) else "")
                  for k in ("torch_compile", "torch_compile_ro") if k + "_compile_s" in r]
            if cs:
                notes.append(f"{m['label']} b{r['batch']} compile time: {', '.join(cs)}")
            fb = r.get("kiln_graphs_program", {})
            if fb.get("fallback_ops") or fb.get("graph_failures"):
                notes.append(f"{m['label']} b{r['batch']} kiln: fallbacks {fb.get('fallback_ops')}, graph failures "
                             f"{fb.get('graph_failures')}")
        for key, m in mres.items():
            if isinstance(m, dict) and "error" in m:
                notes.append(f"{m.get('label', key)}: ERROR {m['error']}")
            if isinstance(m, dict) and "kiln_auto" in m:
                a = m["kiln_auto"]
                notes.append(f"{m['label']}: {a.get('instructions')} plan instructions, {a.get('fused_groups')} fused "
                             f"groups, default `cuda_graphs=\"auto\"` resolves to {a.get('cuda_graphs')}")
        ro = {m["label"]: _get(m["rows"]["1"].get("timings", {}), "torch_compile_ro") for m in mres.values()
              if isinstance(m, dict) and "1" in m.get("rows", {})}
        if ro and not env.get("dry_run"):
            notes.append("issue 8 quotes torch.compile reduce-overhead at batch 1 as 0.59 ms (ResNet-50) and 1.72 ms "
                         "(BERT-base; which module, not recorded) on an H200 with its TF32 setting unrecorded; this run, "
                         "TF32 off: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ro.items() if v is not None) +
                         ". The goals below are judged against this run's figures.")
        if notes:
            lines += [""] + [f"- {n}" for n in notes]
        lines.append("")
    # ---- zoo
    zres = res.get("zoo", {}).get("rows", [])
    if zres:
        lines += ["### Test-zoo models through CudaProgram vs torch eager on the GPU", "",
                  f"torch's reference runs under `no_grad` with `torch.backends.mha` fast path off (the module's own "
                  f"math; the fused fast path, nn.MultiheadAttention's default in eval, is measured on the side), and "
                  f"every result is also compared with the model in float64 on the CPU (the 'vs float64' column). "
                  f"Each tests/zoo.py model at its test size, traced with its dynamic dims, on the example inputs and on "
                  f"fresh random inputs at another size; pass = `assert_allclose(rtol={RTOL}, atol={ATOL})` on every "
                  "output (tol. ratio = max |kiln - torch| / (atol + rtol |torch|), pass iff <= 1). traced = where "
                  "`kiln.trace` ran: on the device machine, or on the CPU box (`bench/gpu_zoo_export.py`: the .kiln "
                  "file and the model's state_dict, sha256-checked; the weights are loaded into the model built on the "
                  "device with `strict=True`, so torch's reference on the GPU uses exactly the traced weights).", "",
                  "| model | traced | CUDA graphs | status | worst tol. ratio | worst rel. err | max abs err | "
                  "rel. err vs float64: kiln / torch GPU / torch GPU fast path | host fallbacks |",
                  "|---|---|---|---|---:|---:|---:|---:|---|"]
        for r in zres:
            checks = r.get("checks", [])
            traced = r.get("traced", "")
            if not checks:
                lines.append(f"| {r['model']} | {traced} | "
                             f"{'yes' if r.get('cuda_graphs') else 'no' if 'cuda_graphs' in r else ''}"
                             f" | {r['status']}: {r.get('note', '')[:120]} | | | | | |")
                continue
            prog = r.get("program", {})
            v64 = r.get("vs_float64", {})

            def worst(values):
                values = [v for v in values if v is not None]
                return f"{max(values):.1e}" if values else "-"
            truth = (f"{worst(c.get('kiln_vs_float64') for c in checks)} / "
                     f"{worst(v.get('torch_gpu') for v in v64.values())} / "
                     f"{worst(v.get('torch_gpu_fastpath') for v in v64.values())}")
            lines.append(f"| {r['model']} | {traced} | {'yes' if r['cuda_graphs'] else 'no'} | {r['status']} | "
                         f"{max(c['tol_ratio'] for c in checks):.3f} | {max(c['rel_l2'] for c in checks):.1e} | "
                         f"{max(c['max_abs'] for c in checks):.1e} | {truth} | {prog.get('fallback_ops') or '-'} |")
        notes, seen = [], set()
        for r in zres:
            if r["model"] in seen:
                continue
            if "device_trace_error" in r:
                seen.add(r["model"])
                notes.append(f"{r['model']}: `kiln.trace` fails on the device ({r['device_trace_error'][:160]}); "
                             f"the CPU box's trace ran instead")
            if "reference" in r:
                seen.add(r["model"])
                notes.append(f"{r['model']}: graph traced with {r['traced']}; torch reference = the "
                             f"{r['reference']} with the same state_dict loaded")
        zdir = res.get("zoo", {}).get("zoo_dir")
        if zdir and "error" in zdir:
            notes.append(f"--zoo-dir {zdir['path']}: unusable ({zdir['error']})")
        elif zdir and zdir.get("not_exported"):
            notes.append(f"not in --zoo-dir {zdir['path']}: " +
                         "; ".join(f"{k} ({v[:120]})" for k, v in zdir["not_exported"].items()))
        if notes:
            lines += [""] + [f"- {n}" for n in notes]
        lines.append("")
    # ---- goals
    lines += ["Goals (issue 8):"] + [f"- {g}" for g in goals(res)]
    return "\n".join(lines) + "\n"


def goals(res: dict) -> list:
    out = []
    rows = res.get("chain", {}).get("rows", [])
    if rows:
        parts, oks = [], []
        for r in rows:
            t = r.get("timings", {})
            k, c = _get(t, "kiln_program"), _get(t, "torch_compile")
            ok = None if k is None or c is None else k <= c
            oks.append(ok)
            parts.append(f"{r['n']}^2 kiln {k if k is None else f'{k:.4f}'} vs compile "
                         f"{c if c is None else f'{c:.4f}'} ms")
        ok = None if None in oks else all(oks)
        out.append(f"chain no slower than torch.compile at both sizes ({'; '.join(parts)}): {_mark(ok)}")
        big = max(rows, key=lambda r: r["n"])
        k = _get(big.get("timings", {}), "kiln_program")
        ok = None if k is None else k <= 1.15 * big["floor_ms"]
        out.append(f"chain at {big['n']}^2 within 15% of the bandwidth floor (kiln "
                   f"{k if k is None else f'{k:.4f}'} ms, floor {big['floor_ms']:.4f} ms, "
                   f"{_ratio(k, big['floor_ms'])}x): {_mark(ok)}")
    mres = res.get("models", {})
    mrows = [(m["label"], r) for m in mres.values() if isinstance(m, dict) and "rows" in m for r in m["rows"].values()]
    failed = [m.get("label", k) for k, m in mres.items() if isinstance(m, dict) and "error" in m]
    if failed:
        out.append(f"models that did not run through (see the error notes): {', '.join(failed)}: the goals below "
                   "are not measured for them")
    if mrows:
        slow, oks = [], [None] if failed else []
        for label, r in mrows:
            t = r.get("timings", {})
            k, e = _get(t, "kiln_graphs"), _get(t, "torch_eager")
            ok = None if k is None or e is None else k < e
            oks.append(ok)
            if ok is False:
                slow.append(f"{label} b{r['batch']} ({k / e:.2f}x)")
        ok = None if None in oks else all(oks)
        out.append("ResNet-50 / BERT-base: kiln (CUDA graphs, what `cuda_graphs=\"auto\"` picks for these plans) "
                   f"faster than torch eager on every row: {_mark(ok)}" + (f": slower on {', '.join(slow)}" if slow else ""))
        parts, oks = [], [None] if failed else []
        for label, r in mrows:
            if r["batch"] != 1:
                continue
            t = r.get("timings", {})
            k, c = _get(t, "kiln_graphs"), _get(t, "torch_compile_ro")
            ok = None if k is None or c is None else k <= 1.2 * c
            oks.append(ok)
            parts.append(f"{label}: kiln {k if k is None else f'{k:.3f}'} vs {c if c is None else f'{c:.3f}'} ms"
                         + (f" ({k / c:.2f}x)" if k is not None and c else ""))
        ok = None if None in oks or not oks else all(oks)
        out.append(f"batch 1 within 1.2x of torch.compile with CUDA graphs (reduce-overhead) ({'; '.join(parts)}): "
                   f"{_mark(ok)}")
    zrows = res.get("zoo", {}).get("rows", [])
    if zrows:
        ran = [r for r in zrows if r["status"] in ("pass", "FAIL", "error")]
        bad = [f"{r['model']}{' (graphs)' if r.get('cuda_graphs') else ''}: {r['status']}" for r in ran
               if r["status"] != "pass"]
        untraced = sorted({r["model"] for r in zrows if r["status"] == "trace failed"})
        skipped = sorted({r["model"] for r in zrows if r["status"] == "skipped"})
        text = (f"every test-zoo model matches torch on the GPU to rtol {RTOL} (fp32, TF32 off): "
                f"{_mark(not bad and not untraced)}: {len(ran) - len(bad)} of {len(ran)} CudaProgram runs "
                f"(models x with/without CUDA graphs) pass")
        if bad:
            text += f"; failing: {'; '.join(bad)}"
        if untraced:
            text += (f"; not run because kiln's tracer fails on them with the device's torch (a frontend "
                     f"gap, not the CUDA backend's): {', '.join(untraced)}")
        if skipped:
            text += f"; skipped, package missing: {', '.join(skipped)}"
        out.append(text)
    return out


def insert_into_results(md: str) -> None:
    from results_md import RESULTS, replace_section
    replace_section(RESULTS, TITLE, md)


# ---------------------------------------------------------------------------- main
def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: CPU runtime, tiny sizes (checks the logic)")
    ap.add_argument("--no-compile", action="store_true", help="skip every torch.compile variant")
    ap.add_argument("--budget", type=float, default=470.0,
                    help="seconds from start after which no further torch.compile is started (default 470)")
    ap.add_argument("--sections", default="chain,models,zoo,compile",
                    help="comma-separated subset of chain,models,zoo,compile")
    ap.add_argument("--zoo-dir", type=Path, metavar="DIR",
                    help="a folder written by bench/gpu_zoo_export.py (graphs traced on the CPU box + their "
                         "weights): used for the zoo models that do not trace here")
    ap.add_argument("--zoo-prefer-dir", action="store_true",
                    help="with --zoo-dir: use its file for every model it has, even those that trace here")
    ap.add_argument("--zoo-only", metavar="NAMES", help="comma-separated zoo entries to run (default: all)")
    ap.add_argument("--render", metavar="JSON", help="render a results JSON and put it into bench/RESULTS.md")
    ap.add_argument("--print-only", action="store_true", help="with --render: print the markdown, write nothing")
    args = ap.parse_args(argv)

    if args.render:
        res = json.loads(Path(args.render).read_text())
        md = render(res)
        if args.print_only:
            print(md)
        else:
            insert_into_results(md)
            print(md)
        return 0

    if args.zoo_prefer_dir and args.zoo_dir is None:
        ap.error("--zoo-prefer-dir needs --zoo-dir")
    zoo_only = [n.strip() for n in args.zoo_only.split(",") if n.strip()] if args.zoo_only else None
    if zoo_only:
        import zoo
        unknown = sorted(set(zoo_only) - {e.name for e in zoo.ZOO})
        if unknown:
            ap.error(f"--zoo-only: no zoo entries {', '.join(unknown)}")
    start = time.monotonic()
    deadline = start + args.budget
    sections = set(args.sections.split(","))
    unknown = sections - {"chain", "models", "zoo", "compile"}
    if unknown:
        ap.error(f"unknown sections: {', '.join(sorted(unknown))}")
    dev = Dev(args.dry_run)
    torch = dev.torch
    if not dev.dry:
        if not torch.cuda.is_available():
            log("no CUDA device visible to torch")
            return 2
        set_no_tf32(torch)
    results: dict = {"env": environment(dev), "args": vars(args)}
    _STATE["results"] = results
    log(json.dumps(results["env"]))
    write_outputs(results)
    compile_ = not args.no_compile
    sizes = (256, 512) if dev.dry else (2048, 8192)
    batches = (1, 4) if dev.dry else (1, 32)

    def step(name: str, fn: Callable) -> Any:
        t = time.monotonic()
        log(f"== {name} (t={t - start:.0f}s)")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - later sections still run; the error is recorded
            import traceback
            traceback.print_exc()
            results.setdefault("section_errors", {})[name] = err_text(e)
        finally:
            results.setdefault("section_s", {})[name] = time.monotonic() - t
            write_outputs(results)

    with torch.no_grad():
        if "chain" in sections:
            step("chain", lambda: chain_section(dev, sizes, compile_, results.setdefault("chain", {})))
        states = []
        if "models" in sections:
            states = step("models", lambda: model_section(dev, batches, results.setdefault("models", {}))) or []
        if "zoo" in sections:
            step("zoo", lambda: zoo_section(dev, results.setdefault("zoo", {}), args.zoo_dir, args.zoo_prefer_dir,
                                            zoo_only))
        if "compile" in sections and compile_ and states:
            step("compile", lambda: compile_section(dev, states, batches, results["models"], deadline))
    results["total_s"] = time.monotonic() - start
    write_outputs(results)
    log(f"total {results['total_s']:.0f}s")
    log(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

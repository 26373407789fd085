"""The public model suite: every torchvision classification, segmentation and video model, 30+ timm
families, 45+ transformers architectures and torch.nn's own recurrent/transformer layers, through
kiln and its peers, summarized in bench/COVERAGE.md.

Per model (bench/suite_models.py builds it, random weights, no downloads), each column answers
ok, refused (the tool raised: error class and first line), or WRONG (it answered, and the answer
differs from torch eager: a silent wrong answer):

- kiln_trace: ``kiln.trace(model, example, dynamic=...)`` with kiln's own check (the default);
- kiln_run: ``kiln.save`` + ``kiln.load`` (the CPU runtime) matches torch on every input set:
  the example, a second batch size (and, for text, another length and padding), another
  padding pattern at the example's shape, and batch 1;
- kiln_onnx: ``kiln.export_onnx`` run in onnxruntime matches torch on the same input sets;
- onnx_ts / onnx_dynamo: ``torch.onnx.export(dynamo=False / True)`` with the same dynamic axes,
  run in onnxruntime on the same input sets;
- jit: ``torch.jit.trace`` on the example, run on the same input sets.

"Match" is scale-aware, per output: max|a - b| <= atol + rtol * max|torch| (rtol 1e-4, atol
1e-5; float32), NaNs in the same places; integer and bool outputs exactly. Latency (batch 1,
one thread everywhere: ``torch.set_num_threads(1)``, ORT ``intra_op_num_threads=1``, kiln's
numpy BLAS at one thread through OPENBLAS/OMP/MKL_NUM_THREADS set before numpy loads): kiln's
CPU runtime, onnxruntime on kiln's ONNX export (else the best peer export that matched), and
torch eager under ``inference_mode``; median after a warm-up.

Each model runs in its own subprocess with a timeout and a memory cap, so a hang or a crash
costs only that model; a worker writes its columns as it finishes them, so a timeout keeps
what was done. Results go to bench/model_suite.jsonl (one line a model) and bench/COVERAGE.md.

Run (the suite's venv, see bench/suite-requirements.txt):
    .venv-suite/bin/python bench/model_suite.py                       # everything, ~N hours on 2 cores
    .venv-suite/bin/python bench/model_suite.py --subset ci           # the CI subset (prints only)
    .venv-suite/bin/python bench/model_suite.py --family timm --jobs 2
    .venv-suite/bin/python bench/model_suite.py --models resnet18,hf/bert --columns kiln
    .venv-suite/bin/python bench/model_suite.py --models resnet18 --merge   # rerun rows into the files
    .venv-suite/bin/python bench/model_suite.py --report-only          # rewrite COVERAGE.md from the JSONL
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

RESULTS = HERE / "model_suite.jsonl"
COVERAGE = HERE / "COVERAGE.md"
RTOL, ATOL = 1e-4, 1e-5
COLUMNS = ("kiln_trace", "kiln_run", "kiln_onnx", "onnx_ts", "onnx_dynamo", "jit", "onnx_ts_kiln", "onnx_dynamo_kiln")
COLUMN_TITLES = {"kiln_trace": "kiln trace (+check)", "kiln_run": "kiln run", "kiln_onnx": "kiln → ONNX → ORT",
                 "onnx_ts": "torch.onnx TorchScript → ORT", "onnx_dynamo": "torch.onnx dynamo → ORT",
                 "jit": "torch.jit.trace", "onnx_ts_kiln": "torch.onnx TorchScript → kiln",
                 "onnx_dynamo_kiln": "torch.onnx dynamo → kiln"}
COLUMN_GROUPS = {"kiln": ("kiln_trace", "kiln_run", "kiln_onnx"), "peers": ("onnx_ts", "onnx_dynamo", "jit"),
                 # issue 22: the peers' ONNX files that onnxruntime ran, imported into kiln (kiln.load of the .onnx)
                 "import": ("onnx_ts_kiln", "onnx_dynamo_kiln")}
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
DEFAULT_TIMEOUT = 900.0
DEFAULT_MEMORY_GIB = 10.0


# ---------------------------------------------------------------------------- comparing
def flat_tensors(out: Any) -> list:
    """A model's output tensors in kiln's output order (dicts and ModelOutputs by key, tuples in
    order, Nones skipped)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in flat_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in flat_tensors(v)]
    if out is None:
        return []
    raise TypeError(f"model output of type {type(out).__name__}")


def to_numpy(t: Any):
    import numpy as np
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        return t.float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()
    return np.asarray(t)


def compare(got: list, want: list, rtol: float = RTOL, atol: float = ATOL) -> Optional[str]:
    """None when ``got`` matches ``want`` (the torch outputs), else what differs."""
    import numpy as np

    if len(got) != len(want):
        return f"{len(got)} outputs, torch gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape}, torch {w.shape}"
        if w.dtype.kind in "fc" or g.dtype.kind in "fc":
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            gn, wn = np.isnan(g64), np.isnan(w64)
            if (gn != wn).any():
                return f"output {i}: NaN at {int((gn != wn).sum())} places where torch has none (or the reverse)"
            fin = ~wn
            if not fin.any():
                continue
            err = float(np.max(np.abs(np.where(fin, g64 - w64, 0.0))))
            if math.isnan(err) or any(np.isinf(g64[fin]) != np.isinf(w64[fin])):
                return f"output {i}: infinities differ"
            both_inf = np.isinf(w64) & fin
            if both_inf.any():
                if (g64[both_inf] != w64[both_inf]).any():
                    return f"output {i}: infinities differ"
                err = float(np.max(np.abs(np.where(fin & ~both_inf, g64 - w64, 0.0))))
            scale = float(np.max(np.abs(np.where(fin & ~both_inf, w64, 0.0))))
            if not err <= atol + rtol * scale:
                return f"output {i}: max |diff| {err:.3g} > {atol:g} + {rtol:g} x max|torch| {scale:.3g}"
        elif not np.array_equal(g, w):
            return f"output {i}: {int((g != w).sum())} of {g.size} values differ"
    return None


def err_text(e: BaseException, limit: int = 400) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(e).__name__}: {first}"[:limit]


# ---------------------------------------------------------------------------- the peers' wrapper
def positional(model, names: list[str]):
    """The model as a module whose forward takes its inputs by position, under their own names
    (so exporters name the graph inputs after them), and returns a flat tuple of tensors, as a
    user wraps a model for torch.jit.trace / torch.onnx.export."""
    import torch

    params = ", ".join(names)
    call = ", ".join(f"{n}={n}" for n in names)
    ns: dict = {"_flat": flat_tensors}
    exec(f"def forward(self, {params}):\n    return tuple(_flat(self.model({call})))\n", ns)  # noqa: S102
    cls = type("Positional", (torch.nn.Module,), {"forward": ns["forward"]})
    wrapper = cls()
    wrapper.model = model
    return wrapper.eval()


# ---------------------------------------------------------------------------- one model
class Worker:
    """Runs the columns of one case, storing each result as it is done (``self.record``)."""

    def __init__(self, case, columns: tuple[str, ...], workdir: Path, save: Optional[Callable[[dict], None]] = None,
                 latency: bool = True, latency_budget: float = 2.0):
        self.case, self.columns, self.workdir = case, columns, Path(workdir)
        self.save = save or (lambda rec: None)
        self.do_latency, self.latency_budget = latency, latency_budget
        self.record: dict = {"model": case.name, "family": case.family, "kind": case.kind, "note": case.note,
                             "columns": {}, "latency": {}, "phase": "build", "times": {}}

    # -- bookkeeping
    def _put(self, column: str, result: dict, seconds: float) -> None:
        result["seconds"] = round(seconds, 2)
        self.record["columns"][column] = result
        self.save(self.record)

    def _phase(self, name: str) -> None:
        self.record["phase"] = name
        self.save(self.record)

    def run(self) -> dict:
        import torch

        t0 = time.perf_counter()
        case = self.case
        self.model = case.build()
        self.record["params"] = sum(p.numel() for p in self.model.parameters())
        self.sets = ["example", "batch", *(["pad"] if case.has_mask else []), "latency"]
        self.inputs = {s: case.inputs(s) for s in self.sets}
        self.dynamic = dict(case.dynamic)
        self._name_single_input()
        self.names = list(self.inputs["example"])
        self._phase("torch eager")
        with torch.no_grad():
            self.want = {s: [to_numpy(t) for t in flat_tensors(self.model(**self.inputs[s]))] for s in self.sets}
        self.record["outputs"] = len(self.want["example"])
        self.record["times"]["build+eager"] = round(time.perf_counter() - t0, 2)
        self.graph = None
        self.kiln_onnx_path = None
        self.peer_onnx: dict[str, Path] = {}
        if "kiln_trace" in self.columns:
            self.col_kiln_trace()
        if "kiln_run" in self.columns:
            self.col_kiln_run()
        if "kiln_onnx" in self.columns:
            self.col_kiln_onnx()
        self.graph = None  # the big models need their memory back for the peers
        if self.do_latency and self.record["columns"].get("kiln_run", {}).get("status") == "ok":
            self.measure_latency(kiln_side=True)
        self.program = None
        gc.collect()
        for col in ("onnx_ts", "onnx_dynamo", "jit"):
            if col in self.columns:
                getattr(self, f"col_{col}")()
        if self.do_latency and self.record["latency"].get("ort_ms") is None:
            self.measure_latency(kiln_side=False)
        self.record["phase"] = "done"
        self.record["seconds"] = round(time.perf_counter() - t0, 1)
        self.save(self.record)
        return self.record

    def _name_single_input(self) -> None:
        """A one-input model gets its input under its forward's own parameter name (torchvision's
        LRASPP calls it ``input``, the others ``x``)."""
        import inspect

        (name,) = self.inputs["example"] if len(self.inputs["example"]) == 1 else (None,)
        params = list(inspect.signature(self.model.forward).parameters)
        if name is None or name in params or not params:
            return
        new = params[0]
        self.inputs = {s: {new: v[name]} for s, v in self.inputs.items()}
        self.dynamic = {new if k == name else k: d for k, d in self.dynamic.items()}

    def _sets_result(self, run: Callable[[str], list]) -> dict:
        """Run on every input set and compare with torch: ok, WRONG (first set that differs) or
        refused (it raised)."""
        per = {}
        for s in self.sets:
            try:
                got = run(s)
            except Exception as e:  # noqa: BLE001 - a peer or kiln refusing at run time
                per[s] = "refused: " + err_text(e)
                return {"status": "refused", "error": f"at the {s} inputs: {err_text(e)}", "inputs": per}
            diff = compare(got, self.want[s])
            per[s] = "ok" if diff is None else f"WRONG: {diff}"
        wrong = [s for s, v in per.items() if v != "ok"]
        if wrong:
            return {"status": "WRONG", "error": f"{wrong[0]} inputs: {per[wrong[0]][7:]}", "inputs": per}
        return {"status": "ok", "inputs": per}

    # -- kiln
    def col_kiln_trace(self) -> None:
        import kiln

        self._phase("kiln_trace")
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", kiln.TraceWarning)
            try:
                self.graph = kiln.trace(self.model, self.inputs["example"], dynamic=self.dynamic)
                res: dict = {"status": "ok", "nodes": len(self.graph.nodes)}
            except Exception as e:  # noqa: BLE001
                res = {"status": "refused", "error": err_text(e, 600), "error_class": type(e).__name__,
                       "where": _kiln_frame(e)}
        tw = [str(w.message) for w in caught if issubclass(w.category, kiln.TraceWarning)]
        if tw:
            res["trace_warnings"] = len(tw)
            res["first_warning"] = tw[0][:300]
        seconds = time.perf_counter() - t
        if res["status"] == "refused" and res["error_class"] == "TraceCheckError":
            res["diagnosis"] = self._diagnose_check()
        self._put("kiln_trace", res, seconds)

    def _diagnose_check(self) -> str:
        """For a TraceCheckError: trace again without the check and compare the graph with torch
        at the scale-aware tolerance, to tell a float32 false alarm from a real mismatch. The
        column stays refused: this only sorts the cause."""
        import kiln

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = kiln.trace(self.model, self.inputs["example"], dynamic=self.dynamic, check=False)
            prog = kiln.load(graph)
            diffs = {s: compare(prog.run({n: to_numpy(v) for n, v in self.inputs[s].items()}, as_list=True),
                                self.want[s]) for s in self.sets}
        except Exception as e:  # noqa: BLE001
            return f"unchecked graph fails: {err_text(e, 200)}"
        bad = {s: d for s, d in diffs.items() if d is not None}
        if not bad:
            return "false alarm: the unchecked graph matches torch on every input set at the scale-aware tolerance"
        s = next(iter(bad))
        return f"real: the unchecked graph differs on the {s} inputs ({bad[s]})"

    def col_kiln_run(self) -> None:
        import kiln

        if self.graph is None:
            self._put("kiln_run", {"status": "refused", "error": "not traced", "skipped": True}, 0.0)
            return
        self._phase("kiln_run")
        t = time.perf_counter()
        path = self.workdir / "model.kiln"
        try:
            kiln.save(self.graph, path)
            self.program = kiln.load(path)
        except Exception as e:  # noqa: BLE001
            self._put("kiln_run", {"status": "refused", "error": err_text(e, 600), "error_class": type(e).__name__,
                                   "where": _kiln_frame(e)}, time.perf_counter() - t)
            return
        res = self._sets_result(lambda s: self.program.run({n: to_numpy(v) for n, v in self.inputs[s].items()},
                                                           as_list=True))
        res["file_mib"] = round(path.stat().st_size / 2 ** 20, 2)
        self.kiln_path, self.program = path, None  # loaded again to time it: big models need the memory
        gc.collect()
        self._put("kiln_run", res, time.perf_counter() - t)

    def col_kiln_onnx(self) -> None:
        import kiln

        if self.graph is None:
            self._put("kiln_onnx", {"status": "refused", "error": "not traced", "skipped": True}, 0.0)
            return
        self._phase("kiln_onnx")
        t = time.perf_counter()
        path = self.workdir / "kiln.onnx"
        try:
            kiln.export_onnx(self.graph, path)
            sess = ort_session(path)
        except Exception as e:  # noqa: BLE001
            self._put("kiln_onnx", {"status": "refused", "error": err_text(e, 600), "error_class": type(e).__name__,
                                    "where": _kiln_frame(e)}, time.perf_counter() - t)
            return
        res = self._sets_result(lambda s: ort_run(sess, self.inputs[s]))
        if res["status"] == "ok":
            self.kiln_onnx_path = path
        self._put("kiln_onnx", res, time.perf_counter() - t)

    # -- peers
    def _peer(self, column: str, export: Callable[[Path], Path]) -> None:
        self._phase(column)
        t = time.perf_counter()
        path = self.workdir / f"{column}.onnx"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                export(path)
            sess = ort_session(path)
        except Exception as e:  # noqa: BLE001
            self._put(column, {"status": "refused", "error": err_text(e, 600), "error_class": type(e).__name__},
                      time.perf_counter() - t)
            return
        res = self._sets_result(lambda s: ort_run(sess, self.inputs[s]))
        sess = None  # its weights: the largest models cannot hold torch's, ORT's and kiln's at once
        gc.collect()
        if res["status"] == "ok":
            self.peer_onnx[column] = path
        self._put(column, res, time.perf_counter() - t)
        if f"{column}_kiln" in self.columns:
            self._peer_in_kiln(column, path if res["status"] == "ok" else None)

    def _peer_in_kiln(self, column: str, path: Optional[Path]) -> None:
        """The peer's ONNX file, which onnxruntime ran and matched, imported and run by kiln (issue 22)."""
        import kiln

        col = f"{column}_kiln"
        if path is None:
            self._put(col, {"status": "refused", "error": "no export that onnxruntime ran", "skipped": True}, 0.0)
            return
        self._phase(col)
        t = time.perf_counter()
        try:
            program = kiln.load(path)
        except Exception as e:  # noqa: BLE001
            self._put(col, {"status": "refused", "error": err_text(e, 600), "error_class": type(e).__name__},
                      time.perf_counter() - t)
            return
        names = [i.name for i in program.inputs]

        def run(s: str) -> list:
            given = self.inputs[s]
            feeds = ({n: to_numpy(given[n]) for n in names} if all(n in given for n in names)
                     else {n: to_numpy(v) for n, v in zip(names, given.values())})
            return program.run(feeds, as_list=True)
        self._put(col, self._sets_result(run), time.perf_counter() - t)

    def _wrapper(self):
        return positional(self.model, self.names)

    def _example_args(self) -> tuple:
        return tuple(self.inputs["example"][n] for n in self.names)

    def col_onnx_ts(self) -> None:
        import torch

        def export(path: Path) -> None:
            torch.onnx.export(self._wrapper(), self._example_args(), str(path), dynamo=False,
                              input_names=self.names, dynamic_axes={n: dict(d) for n, d in self.dynamic.items()})
        self._peer("onnx_ts", export)

    def col_onnx_dynamo(self) -> None:
        import torch
        from torch.export import Dim

        def export(path: Path) -> None:
            shapes = {n: {d: Dim.DYNAMIC for d in self.dynamic.get(n, {})} for n in self.names}
            prog = torch.onnx.export(self._wrapper(), self._example_args(), dynamo=True, dynamic_shapes=shapes)
            prog.save(str(path))
        self._peer("onnx_dynamo", export)

    def col_jit(self) -> None:
        import torch

        self._phase("jit")
        t = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                traced = torch.jit.trace(self._wrapper(), self._example_args())
        except Exception as e:  # noqa: BLE001
            self._put("jit", {"status": "refused", "error": err_text(e, 600), "error_class": type(e).__name__},
                      time.perf_counter() - t)
            return

        def run(s: str) -> list:
            with torch.no_grad():
                return [to_numpy(x) for x in flat_tensors(traced(*(self.inputs[s][n] for n in self.names)))]
        self._put("jit", self._sets_result(run), time.perf_counter() - t)

    # -- latency
    def measure_latency(self, kiln_side: bool) -> None:
        """Batch 1, one thread. kiln_side: kiln's runtime, ORT on kiln's ONNX export (when it
        matched) and torch eager; otherwise (kiln's ONNX export did not match) ORT on the best
        peer export that matched, and torch eager if not measured yet."""
        import torch

        self._phase("latency")
        lat = self.record["latency"]
        feeds = self.inputs["latency"]
        arrays = {n: to_numpy(v) for n, v in feeds.items()}
        budget = self.latency_budget
        try:
            if kiln_side:
                import kiln

                program = kiln.load(self.kiln_path)
                lat["kiln_ms"] = timeit(lambda: program.run(arrays), budget)
                del program  # the largest models cannot hold kiln's weights and ORT's at once
                gc.collect()
            onnx = self.kiln_onnx_path
            source = "kiln's ONNX export"
            if onnx is None and not kiln_side:
                for col in ("onnx_dynamo", "onnx_ts"):
                    if col in self.peer_onnx:
                        onnx, source = self.peer_onnx[col], f"the {COLUMN_TITLES[col].split(' →')[0]} export"
                        break
            if onnx is not None and lat.get("ort_ms") is None:
                sess = ort_session(onnx)
                lat["ort_ms"] = timeit(lambda: ort_run(sess, feeds), budget)
                lat["ort_of"] = source
                del sess
            if lat.get("eager_ms") is None:
                def eager() -> None:
                    with torch.inference_mode():
                        self.model(**feeds)
                lat["eager_ms"] = timeit(eager, budget)
        except Exception as e:  # noqa: BLE001
            lat["error"] = err_text(e)
        self.save(self.record)


def timeit(fn: Callable[[], Any], budget: float, min_runs: int = 3, max_runs: int = 25) -> float:
    """Median milliseconds of ``fn`` after one warm-up: at least ``min_runs`` runs, more until
    ``budget`` seconds are spent (at most ``max_runs``)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or (len(times) < max_runs and time.perf_counter() - start < budget):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 3)


def ort_session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def ort_run(sess, inputs: dict) -> list:
    """Feed the session the inputs it asks for (an exporter may drop an unused one)."""
    wanted = [i.name for i in sess.get_inputs()]
    if all(n in inputs for n in wanted):
        feeds = {n: to_numpy(inputs[n]) for n in wanted}
    elif len(wanted) == len(inputs):
        feeds = {w: to_numpy(v) for w, v in zip(wanted, inputs.values())}
    else:
        raise RuntimeError(f"the ONNX model wants inputs {wanted}; the model's are {list(inputs)}")
    return sess.run(None, feeds)


def _kiln_frame(e: BaseException) -> str:
    """The innermost kiln source line of a traceback (where kiln refused)."""
    tb = traceback.extract_tb(e.__traceback__)
    for fr in reversed(tb):
        if str(ROOT) in fr.filename and "/bench/" not in fr.filename:
            return f"{Path(fr.filename).relative_to(ROOT)}:{fr.lineno}"
    return ""


def evaluate_case(case, columns: tuple[str, ...] = COLUMNS, workdir: Optional[Path] = None,
                  latency: bool = False) -> dict:
    """Run one case in this process (the CI subset's entry point): its record."""
    with tempfile.TemporaryDirectory(prefix="kiln-suite-") as tmp:
        return Worker(case, columns, Path(workdir or tmp), latency=latency).run()


def worker_main(name: str, out: Path, columns: tuple[str, ...], latency: bool) -> None:
    """The subprocess side: run one model, writing its record to ``out`` after every step."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import suite_models

    def save(rec: dict) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, out)

    case = suite_models.by_name(name)
    with tempfile.TemporaryDirectory(prefix="kiln-suite-") as tmp:
        w = Worker(case, columns, Path(tmp), save=save, latency=latency)
        try:
            w.run()
        except Exception as e:  # noqa: BLE001 - the harness's own failure (building the model, eager)
            w.record["harness_error"] = err_text(e, 600)
            w.record["traceback"] = traceback.format_exc()[-3000:]
            save(w.record)
            raise


# ---------------------------------------------------------------------------- the parent
def _rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30
    except (OSError, ValueError, IndexError):
        return 0.0


class Job:
    """One model's subprocess. A second job (``parent`` set) runs the columns the first one did
    not reach after it was stopped: a model whose kiln trace blows the memory cap still gets its
    peer columns."""

    def __init__(self, case, args, logdir: Path, columns: Optional[tuple] = None, latency: Optional[bool] = None,
                 parent: Optional[dict] = None):
        self.case = case
        self.columns = tuple(columns or args.column_list)
        self.latency = args.latency if latency is None else latency
        self.parent = parent
        self.out = Path(tempfile.mkstemp(prefix="suite-", suffix=".json")[1])
        self.out.unlink()
        suffix = ".2.log" if parent else ".log"
        self.log = logdir / (case.name.replace("/", "__") + suffix)
        self.timeout = max(args.timeout_per_model, case.timeout or 0)
        self.memory = args.memory_gib
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{v: "1" for v in THREAD_VARS})
        env["CUDA_VISIBLE_DEVICES"] = ""  # the suite is about the CPU
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", case.name, "--worker-out", str(self.out),
               "--columns", ",".join(self.columns)]
        if not self.latency:
            cmd.append("--no-latency")
        self.start = time.time()
        self.peak = 0.0
        self.killed: Optional[str] = None
        with open(self.log, "w") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                         start_new_session=True)

    def poll(self) -> bool:
        """True when the job is over (finished, crashed or stopped here)."""
        if self.proc.poll() is not None:
            return True
        self.peak = max(self.peak, _rss_gib(self.proc.pid))
        if time.time() - self.start > self.timeout:
            self._kill(f"timeout after {self.timeout:.0f} s")
        elif self.peak > self.memory:
            self._kill(f"memory: over {self.memory:g} GiB resident")
        return self.proc.poll() is not None

    def _kill(self, why: str) -> None:
        self.killed = why
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def result(self) -> dict:
        rec: dict = {}
        if self.out.exists():
            rec = json.loads(self.out.read_text())
            self.out.unlink()
        rec.setdefault("model", self.case.name)
        rec.setdefault("family", self.case.family)
        rec.setdefault("kind", self.case.kind)
        rec.setdefault("note", self.case.note)
        rec.setdefault("columns", {})
        rec.setdefault("latency", {})
        rec["wall_s"] = round(time.time() - self.start, 1)
        rec["peak_rss_gib"] = round(self.peak, 2)
        rec["run_at"] = utc_now()
        rc = self.proc.returncode
        if self.killed or rec.get("phase") != "done":
            why = self.killed or (f"crashed (exit status {rc})" if rc != 0 else "stopped early")
            if rec.get("harness_error"):
                why = f"harness: {rec['harness_error']}"
            rec["stopped"] = why
            phase = rec.get("phase", "build")
            rec["stopped_phase"] = phase
            for col in self.columns:
                if col not in rec["columns"]:
                    rec["columns"][col] = {"status": "stopped", "error": f"{why} (during {phase})"
                                           if col == phase else f"not reached: {why} during {phase}"}
        if self.parent is not None:
            merged = self.parent
            merged["columns"].update({c: rec["columns"][c] for c in self.columns if c in rec["columns"]})
            for k, v in rec.get("latency", {}).items():
                merged["latency"].setdefault(k, v)
            merged["wall_s"] = round(merged["wall_s"] + rec["wall_s"], 1)
            merged["peak_rss_gib"] = max(merged["peak_rss_gib"], rec["peak_rss_gib"])
            merged["continued"] = (f"{', '.join(self.columns)} ran in a second process after the first was stopped"
                                   + (f"; it was stopped too: {rec['stopped']}" if rec.get("stopped") else ""))
            return merged
        return rec

    def continuation(self, rec: dict, args, logdir: Path) -> Optional["Job"]:
        """A job for the columns a stopped first job did not reach (not the one it was stopped in)."""
        if self.parent is not None or not rec.get("stopped") or rec.get("harness_error"):
            return None
        left = tuple(c for c in self.columns if rec["columns"][c]["status"] == "stopped"
                     and rec["columns"][c]["error"].startswith("not reached"))
        if rec.get("stopped_phase") in COLUMN_GROUPS["kiln"]:
            left = tuple(c for c in left if c not in COLUMN_GROUPS["kiln"])  # they need the kiln columns before
        if not left:
            return None
        for c in left:
            del rec["columns"][c]
        return Job(self.case, args, logdir, columns=left,
                   latency=self.latency and rec.get("stopped_phase") != "latency", parent=rec)


def run_suite(cases: list, args, partial: Optional[Path] = None) -> list[dict]:
    """Run every case in its own subprocess, ``args.jobs`` at once; each finished row is also
    appended to ``partial`` (if given), so a long run can be read while it goes."""
    logdir = Path(args.logs)
    logdir.mkdir(parents=True, exist_ok=True)
    pending: list = list(cases)
    running: list[Job] = []
    done: list[dict] = []
    n = len(cases)
    while pending or running:
        while pending and len(running) < args.jobs:
            nxt = pending.pop(0)
            running.append(nxt if isinstance(nxt, Job) else Job(nxt, args, logdir))
        time.sleep(0.25)
        for job in list(running):
            if job.poll():
                running.remove(job)
                rec = job.result()
                again = job.continuation(rec, args, logdir)
                if again is not None:
                    pending.insert(0, again)
                    print(f"      {rec['model']}: stopped ({rec['stopped']} during {rec['stopped_phase']}); "
                          f"running {', '.join(again.columns)} in a second process", flush=True)
                    continue
                rec["run_id"] = args.run_id
                done.append(rec)
                if partial is not None:
                    with open(partial, "a") as f:
                        f.write(json.dumps(rec, sort_keys=True) + "\n")
                print(f"[{len(done)}/{n}] {progress_line(rec)}", flush=True)
    return done


def progress_line(rec: dict) -> str:
    cols = rec["columns"]

    def c(k: str) -> str:
        r = cols.get(k)
        if r is None:
            return "-"
        s = r["status"]
        return s if s in ("ok", "WRONG") else f"{s} ({r.get('error', '')[:60]})" if s != "refused" or k == "kiln_trace" else s

    lat = rec.get("latency", {})
    timing = ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in lat.items() if k.endswith("_ms") and v is not None)
    line = (f"{rec['model']}: trace {c('kiln_trace')} | run {c('kiln_run')} | onnx {c('kiln_onnx')} || "
            f"ts {c('onnx_ts')} | dynamo {c('onnx_dynamo')} | jit {c('jit')}")
    if timing:
        line += f" || {timing}"
    return line + f" ({rec['wall_s']:.0f} s)"


# ---------------------------------------------------------------------------- report
def utc_now() -> str:
    from results_md import utc_now as now
    return now()


def machine_line(wall: Optional[float], jobs: int) -> str:
    from results_md import cpu_name

    vers = []
    for mod in ("torch", "torchvision", "timm", "transformers", "onnx", "onnxruntime", "onnxscript", "numpy"):
        try:
            vers.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001
            vers.append(f"{mod} (not installed)")
    import kiln

    commit = START_COMMIT or git_commit()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    w = f"wall time {wall / 60:.0f} min with --jobs {jobs}; " if wall else ""
    return (f"{cpu_name()}, nproc {os.cpu_count()} (load average {load} at the end), Python "
            f"{platform.python_version()}; kiln {kiln.__version__} (git {commit}), {', '.join(vers)}; {w}{utc_now()}")


def git_commit() -> str:
    """The checkout's commit, with the number of uncommitted tracked files."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.splitlines()
        if dirty:
            commit += f" + {len(dirty)} uncommitted files"
    except OSError:
        commit = "?"
    return commit


#: The commit a run started at (set by main before any model runs; the report names it, not the commit at
#: the end of a two-hour run during which the checkout may move on).
START_COMMIT = None

_UNSUPPORTED = re.compile(r"op '([^']+)' is not supported")
_MAPPING = re.compile(r"kiln's mapping of '([^']+)' gives")
_SCOPE = re.compile(r"^[\w.\[\]<>-]+ \([^)]*\): ")
_WHERE = re.compile(r"\(([\w./-]+\.py):\d+\)")

BLOCKERS = (  # (pattern in the cause, what it waits for): the other engineers' parts of issue 15
    (re.compile(r"upsample|interpolate|grid_sampler|Resize", re.I), "Resize (another engineer)"),
    (re.compile(r"lstm|gru|rnn_tanh|rnn_relu|_VF\.|torch\.rnn", re.I), "recurrent layers (another engineer)"),
    (re.compile(r"redispatch hook|torch \d+\.\d+ lacks", re.I), "torch versions: tracer _redispatch (another engineer)"),
    (re.compile(r"TraceCheckError|TraceWarning|data-dependent|Guard", re.I), "guards / trace check (another engineer)"),
)

# Causes found by reading the failures (bench/COVERAGE.md explains each): (pattern in the error,
# the cause in words, what it waits for). Checked before the generic grouping.
KNOWN_CAUSES = (
    (re.compile(r"has no attribute 'get_seq_length'"),
     "kiln.trace binds a dict of example inputs by position (frontend/trace.py `_record`: `model(*tensors)`): "
     "attention_mask lands in the parameter before it (past_key_values)",
     "trace.py: dict inputs bound by position (another engineer's file)"),
    (re.compile(r"shares memory with one (filled|written) in place"),
     "an in-place write through a view (torchvision Swin-V2: `qkv_bias[n:2n].zero_()` on a clone)",
     "tracer.py: writes through views"),
    (re.compile(r"ceil\(\): argument 'input'"),
     "`torch.jit.is_tracing()` answers True under kiln.trace, so transformers takes its jit-only branch and calls "
     "`torch.ceil` on a Python float (MobileViT)",
     "guards / trace check (another engineer)"),
    (re.compile(r"'unbind' of dim \d+, which is symbolic"),
     "symbolic shape inference loses static dims: a Reshape to sizes computed from a lost batch symbol comes out "
     "all-unknown, so a later unbind of its static dim 0 (size 3) is refused (timm Hiera)",
     "kiln IR shape inference"),
    (re.compile(r"memory: over .* during kiln_trace"),
     "kiln's trace check runs the reference evaluator (ir/evaluator.py keeps every intermediate) at several batch "
     "sizes: over the memory cap on 16x224x224 video transformers",
     "guards / trace check (another engineer)"),
)


def kiln_cause(res: dict) -> tuple[str, str]:
    """(root cause, what it is blocked on) of one kiln refusal."""
    err = res.get("error", "")
    cls = err.split(":", 1)[0]
    for pat, cause, owner in KNOWN_CAUSES:
        if pat.search(err):
            return cause, owner
    m = _UNSUPPORTED.search(err)
    if m:
        cause = f"unsupported op `{m.group(1)}`"
    elif _MAPPING.search(err):
        cause = f"mapping gives the wrong type: `{_MAPPING.search(err).group(1)}`"
    elif cls == "TraceCheckError":
        diag = res.get("diagnosis", "")
        kind = ("false alarm (float32 tolerance)" if diag.startswith("false alarm") else
                "the graph really differs (a value baked without a guard)" if diag.startswith("real") else
                "undiagnosed")
        cause = f"TraceCheckError: {kind}"
    else:
        msg = err.split(":", 1)[1].strip() if ":" in err else err
        msg = _SCOPE.sub("", msg)
        where = _WHERE.search(err)
        msg = re.sub(r"\d+", "N", msg)[:110]
        cause = f"{cls}: {msg}" + (f" ({where.group(1)})" if where and where.group(1) not in msg else "")
    for pat, owner in BLOCKERS:
        if pat.search(cause) or (pat.search(err) and cls != "UnsupportedOpError"):
            return cause, owner
    if m:
        return cause, "missing mapping in kiln/frontend/torch_ops/"
    if res.get("where", "").startswith("frontend/torch_ops/"):
        return cause, f"a mapping in kiln/frontend/torch_ops/ ({res['where']})"
    return cause, "kiln" + (f" ({res['where']})" if res.get("where") else "")


def kiln_outcome(rec: dict) -> tuple[str, Optional[dict]]:
    """The model's end-to-end kiln result: ok (traced and matched on every input set), WRONG,
    refused or stopped; with the column result that decided it."""
    cols = rec["columns"]
    for col in ("kiln_trace", "kiln_run"):
        r = cols.get(col)
        if r is None:
            return "n/a", None
        if r["status"] != "ok":
            return r["status"], r
    return "ok", None


def _status(r: dict, col: str) -> Optional[str]:
    """A column's status; a kiln column skipped because the trace was stopped counts as stopped."""
    res = r["columns"].get(col, {})
    s = res.get("status")
    if s == "refused" and res.get("skipped") and r["columns"].get("kiln_trace", {}).get("status") == "stopped":
        return "stopped"
    return s


def _count(rows: list[dict], col: str) -> dict[str, int]:
    out = {"ok": 0, "refused": 0, "WRONG": 0, "stopped": 0}
    for r in rows:
        s = _status(r, col)
        if s in out:
            out[s] += 1
    return out


def _cell(r: Optional[dict]) -> str:
    if r is None:
        return "–"
    s = r["status"]
    if s == "ok":
        return "ok"
    if s == "WRONG":
        return f"**WRONG** ({r.get('error', '').split(' inputs')[0]})"
    if s == "stopped":
        return "stopped" + (" (timeout)" if "timeout" in r.get("error", "") else " (memory)" if "memory" in
                            r.get("error", "") else "")
    if r.get("skipped"):
        return "–"
    cls = r.get("error_class") or r.get("error", "").split(":", 1)[0]
    if r.get("error", "").startswith("at the "):
        where = r["error"].split(" inputs")[0].replace("at the ", "")
        return f"refused at {where}"
    return f"refused ({cls})" if cls else "refused"


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def write_coverage(rows: list[dict], path: Path, wall: Optional[float], jobs: int, command: str) -> str:
    order = {f: i for i, f in enumerate(("torchvision", "timm", "transformers", "torch"))}
    rows = sorted(rows, key=lambda r: (order.get(r["family"], 9), r["model"]))
    fams = [f for f in order if any(r["family"] == f for r in rows)]
    L: list[str] = ["# Public model suite: coverage", ""]
    L.append(f"Produced by `{command}` (bench/model_suite.py; models in bench/suite_models.py); "
             f"{machine_line(wall, jobs)}.")
    by_run: dict[str, list] = {}
    for r in rows:
        by_run.setdefault(r.get("run_id", "?"), []).append(r["model"])
    if len(by_run) > 1:
        main_run = max(by_run, key=lambda k: len(by_run[k]))
        L.append("")
        L.append(f"Rows come from {len(by_run)} runs: {len(by_run[main_run])} from `{main_run}`; " + "; ".join(
            f"{', '.join(ms)} from `{k}`" for k, ms in by_run.items() if k != main_run) + ".")
    L.append("")
    sizes = ", ".join(f"{f} {sum(r['family'] == f for r in rows)}" for f in fams)
    L.append(f"**{len(rows)} models**: {sizes}. Random weights, float32, CPU; no downloads.")
    L.append("")
    L.append("Each column is ok (answered and matched torch eager on every input set), refused (raised: a loud "
             "failure), **WRONG** (answered, and differs from torch eager: a silent wrong answer) or stopped "
             "(the model's subprocess hit its timeout or memory cap). Input sets: the example (batch 2, or 1 for "
             "the heaviest models), a second batch size (3 / 2; text models also at length 11 with another "
             "padding), another padding pattern at the example's shape (models with an attention mask), and "
             "batch 1. Match: max|a − b| ≤ 1e-5 + 1e-4 · max|torch| per output (float32), NaNs in the same "
             "places, integer outputs exact. Peers export with the same dynamic axes (batch, and sequence "
             "for text) and run in onnxruntime; `torch.jit.trace` runs its traced module. A kiln column after "
             "a refused trace counts as refused.")
    L.append("")
    # -- summary
    L.append("## Summary")
    L.append("")
    L.append("| column | ok | refused | WRONG | stopped |")
    L.append("|---|---:|---:|---:|---:|")
    e2e = {"ok": 0, "refused": 0, "WRONG": 0, "stopped": 0}
    for r in rows:
        s, _ = kiln_outcome(r)
        if s in e2e:
            e2e[s] += 1
    for col in COLUMNS:
        c = _count(rows, col)
        L.append(f"| {COLUMN_TITLES[col]} | {c['ok']} | {c['refused']} | {c['WRONG']} | {c['stopped']} |")
    L.append(f"| **kiln: traces and matches (trace + run)** | {e2e['ok']} | {e2e['refused']} | {e2e['WRONG']} | "
             f"{e2e['stopped']} |")
    L.append("")
    L.append("Per family, ok / refused / WRONG / stopped:")
    L.append("")
    L.append("| family | models | " + " | ".join(COLUMN_TITLES[c] for c in COLUMNS) + " |")
    L.append("|---|---:|" + "---|" * len(COLUMNS))
    for f in fams:
        fr = [r for r in rows if r["family"] == f]
        cells = []
        for col in COLUMNS:
            c = _count(fr, col)
            cells.append(f"{c['ok']} / {c['refused']} / {c['WRONG']} / {c['stopped']}")
        L.append(f"| {f} | {len(fr)} | " + " | ".join(cells) + " |")
    L.append("")
    # -- goals
    peers = {col: _count(rows, col)["ok"] for col in COLUMN_GROUPS["peers"]}
    best = max(peers, key=peers.get)
    kiln_wrong = [r["model"] for r in rows if any(r["columns"].get(c, {}).get("status") == "WRONG"
                                                  for c in COLUMN_GROUPS["kiln"])]
    L.append("Goals (issue 15):")
    L.append(f"- kiln traces and matches more models than any peer column: kiln {e2e['ok']}, best peer "
             f"{COLUMN_TITLES[best]} {peers[best]}: " + ("met" if e2e["ok"] > peers[best] else "**not met**"))
    kiln_ok = {r["model"] for r in rows if kiln_outcome(r)[0] == "ok"}
    for col in COLUMN_GROUPS["peers"]:
        only = sorted(r["model"] for r in rows if r["columns"].get(col, {}).get("status") == "ok"
                      and r["model"] not in kiln_ok)
        if only:
            L.append(f"  - {COLUMN_TITLES[col]} handles {len(only)} that kiln does not: {', '.join(only)}")
    L.append(f"- 0 silent wrong answers from kiln: {len(kiln_wrong)}" + (" (" + ", ".join(kiln_wrong) + ")" if
                                                                          kiln_wrong else "") +
             (": met" if not kiln_wrong else ": **not met**"))
    L.append("")
    if any(r["columns"].get(c) for r in rows for c in COLUMN_GROUPS["import"]):
        L.append("Goal (issue 22): every torch-exported ONNX file that onnxruntime runs also runs in kiln and matches:")
        for col in COLUMN_GROUPS["import"]:
            peer = col[:-len("_kiln")]
            ran = [r for r in rows if _status(r, peer) == "ok" and r["columns"].get(col)]
            ok = [r for r in ran if _status(r, col) == "ok"]
            left = [f"{r['model']} ({_status(r, col)}: {r['columns'][col].get('error', '')[:140]})"
                    for r in ran if _status(r, col) != "ok"]
            L.append(f"- {COLUMN_TITLES[col]}: {len(ok)} of {len(ran)}" + (": met" if len(ok) == len(ran) else
                                                                            ": **not met**; " + "; ".join(left)))
        L.append("")
    # -- kiln refusals by cause
    causes: dict[str, dict] = {}
    for r in rows:
        for col in COLUMN_GROUPS["kiln"]:
            res = r["columns"].get(col)
            if res is None or res.get("skipped") or res["status"] not in ("refused", "stopped"):
                continue
            if res["status"] == "stopped" and res.get("error", "").startswith("not reached"):
                continue
            cause, owner = kiln_cause(res)
            slot = causes.setdefault(cause, {"owner": owner, "models": [], "example": res.get("error", ""),
                                             "column": col, "where": res.get("where", "")})
            slot["models"].append(r["model"])
    stopped = [r for r in rows if r.get("stopped")]
    L.append("## kiln's refusals by root cause")
    L.append("")
    if causes:
        L.append("Every refusal of a kiln column, grouped by its cause (the op kiln lacks, or the error's "
                 "class and message); 'blocked on' says whose part of issue 15 it waits for.")
        L.append("")
        L.append("| cause | models | blocked on | column | models affected | first message |")
        L.append("|---|---:|---|---|---|---|")
        for cause, slot in sorted(causes.items(), key=lambda kv: (-len(kv[1]["models"]), kv[0])):
            ms = ", ".join(slot["models"][:12]) + (f", … (+{len(slot['models']) - 12})" if len(slot["models"]) > 12
                                                   else "")
            msg = slot["example"].replace("|", "\\|")[:260]
            L.append(f"| {cause} | {len(slot['models'])} | {slot['owner']} | {slot['column']} | {ms} | {msg} |")
        L.append("")
        by_owner: dict[str, set] = {}
        for slot in causes.values():
            by_owner.setdefault(slot["owner"], set()).update(slot["models"])
        L.append("Models blocked, by what they wait for (a model may wait for several):")
        L.append("")
        for owner, ms in sorted(by_owner.items(), key=lambda kv: -len(kv[1])):
            L.append(f"- {owner}: {len(ms)}: {', '.join(sorted(ms))}")
        L.append("")
    else:
        L.append("None.")
        L.append("")
    if stopped:
        L.append("Stopped by the harness (timeout or memory cap; a column it stopped in counts as stopped, not "
                 "refused; the columns it had not reached ran in a second process): " +
                 "; ".join(f"{r['model']} ({r['stopped']} during {r.get('stopped_phase', '?')}"
                           + (f"; {r['continued']}" if r.get("continued") else "") + ")" for r in stopped) + ".")
        L.append("")
    # -- trace warnings
    warned = [(r["model"], r["columns"]["kiln_trace"]) for r in rows
              if r["columns"].get("kiln_trace", {}).get("trace_warnings")]
    if warned:
        by_line: dict[str, list] = {}
        for m, c in warned:
            src = re.search(r"\(([^()]*:\d+)\)", c["first_warning"])
            kind = c["first_warning"].split("): ", 1)[-1].split(";")[0]
            by_line.setdefault(f"{src.group(1) if src else '?'}: {kind}", []).append(m)
        L.append(f"{len(warned)} kiln traces gave TraceWarnings (a value read from the inputs' data or sizes in "
                 "Python, baked into the trace and checked at run time by a kiln.Guard); by the first warning's "
                 "line: " + "; ".join(f"`{k}` ({len(v)}: {', '.join(v[:6])}{', …' if len(v) > 6 else ''})"
                                      for k, v in sorted(by_line.items(), key=lambda kv: -len(kv[1]))) + ".")
        L.append("")
    # -- peers' wrong answers
    L.append("## Peers' silent wrong answers")
    L.append("")
    any_wrong = False
    for col in COLUMN_GROUPS["peers"]:
        wr = [(r["model"], r["columns"][col]) for r in rows if r["columns"].get(col, {}).get("status") == "WRONG"]
        if wr:
            any_wrong = True
            L.append(f"- {COLUMN_TITLES[col]} ({len(wr)}): " + "; ".join(f"{m} ({c['error'][:120]})" for m, c in wr))
    if not any_wrong:
        L.append("None.")
    L.append("")
    L.append("Peers' refusals, most common first messages:")
    L.append("")
    for col in COLUMN_GROUPS["peers"]:
        msgs: dict[str, list] = {}
        for r in rows:
            res = r["columns"].get(col, {})
            if res.get("status") == "refused":
                key = re.sub(r"\d+", "N", res.get("error", ""))[:120]
                msgs.setdefault(key, []).append(r["model"])
        if msgs:
            top = sorted(msgs.items(), key=lambda kv: -len(kv[1]))[:6]
            L.append(f"- {COLUMN_TITLES[col]}: " + "; ".join(f"{len(ms)}× `{k}` ({', '.join(ms[:4])}"
                                                             f"{', …' if len(ms) > 4 else ''})" for k, ms in top))
    L.append("")
    # -- latency
    L.append("## Latency (batch 1, one thread)")
    L.append("")
    trio = [r["latency"] for r in rows if all(r["latency"].get(k) for k in ("kiln_ms", "ort_ms", "eager_ms"))]
    both = [r["latency"] for r in rows if r["latency"].get("kiln_ms") and r["latency"].get("eager_ms")]
    if both:
        L.append(f"Geometric mean of kiln / torch eager over the {len(both)} models kiln runs: "
                 f"{_geomean([x['kiln_ms'] / x['eager_ms'] for x in both]):.2f}")
    if trio:
        L.append(f"; of kiln / onnxruntime over the {len(trio)} with an ORT time: "
                 f"{_geomean([x['kiln_ms'] / x['ort_ms'] for x in trio]):.2f} (ORT runs kiln's own ONNX export "
                 "where it matched, else the best peer export). Per model in the tables below.")
    L.append("Timed in each model's subprocess after its columns: median after a warm-up, ≥ 3 runs and up to "
             "2 s each; with `--jobs 2` two models are timed at once on the 2 cores, so numbers carry that noise.")
    L.append("")
    # -- per model
    for f in fams:
        L.append(f"## {f}")
        L.append("")
        L.append("| model | kind | input / notes | " + " | ".join(COLUMN_TITLES[c] for c in COLUMNS) +
                 " | kiln ms | ORT ms | eager ms |")
        L.append("|---|---|---|" + "---|" * len(COLUMNS) + "---:|---:|---:|")
        for r in (r for r in rows if r["family"] == f):
            lat = r.get("latency", {})

            def ms(k: str) -> str:
                v = lat.get(k)
                return f"{v:.2f}" if v else "–"
            ort_ms = ms("ort_ms") + ("*" if lat.get("ort_of") and lat["ort_of"] != "kiln's ONNX export" else "")
            cells = " | ".join("stopped" if _status(r, c) == "stopped" and r["columns"][c].get("skipped")
                               else _cell(r["columns"].get(c)) for c in COLUMNS)
            L.append(f"| {r['model']} | {r['kind']} | {r['note']} | {cells} | {ms('kiln_ms')} | {ort_ms} | "
                     f"{ms('eager_ms')} |")
        L.append("")
    L.append("ORT ms marked * ran a peer's export (kiln's ONNX export did not match). The full record of each "
             "model (every error message, per input set) is in bench/model_suite.jsonl.")
    text = "\n".join(L) + "\n"
    path.write_text(text)
    return text


# ---------------------------------------------------------------------------- main
def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Run (" + __doc__.split("Run (", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", help="comma-separated: torchvision, timm, transformers, torch")
    ap.add_argument("--models", help="comma-separated suite names (e.g. resnet18,timm/convnext_atto,hf/bert)")
    ap.add_argument("--subset", choices=["ci"], help="the CI subset (suite_models.CI_SUBSET)")
    ap.add_argument("--columns", default="all",
                    help="'all', 'kiln' (kiln's columns only), 'peers', or comma-separated of " + ", ".join(COLUMNS))
    ap.add_argument("--jobs", type=int, default=1, help="models run at once (each one thread); 1-2 on this box")
    ap.add_argument("--timeout-per-model", type=float, default=DEFAULT_TIMEOUT,
                    help=f"seconds (default {DEFAULT_TIMEOUT:g}; the heaviest models have their own, longer)")
    ap.add_argument("--memory-gib", type=float, default=DEFAULT_MEMORY_GIB,
                    help="a model's subprocess is stopped past this resident size")
    ap.add_argument("--no-latency", dest="latency", action="store_false", help="skip the latency timings")
    ap.add_argument("--list", action="store_true", help="list the selected models and exit")
    ap.add_argument("--merge", action="store_true",
                    help="a filtered run replaces its models' rows in --out and rewrites --coverage")
    ap.add_argument("--out", help=f"JSON lines (default {RESULTS.relative_to(ROOT)} for a full run or --merge)")
    ap.add_argument("--coverage", help=f"markdown summary (default {COVERAGE.relative_to(ROOT)} likewise)")
    ap.add_argument("--report-only", action="store_true", help="rewrite --coverage from --out without running")
    ap.add_argument("--logs", default=str(Path(tempfile.gettempdir()) / "kiln-suite-logs"),
                    help="each model's subprocess output goes to LOGS/<model>.log")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global START_COMMIT
    if not args.report_only:
        START_COMMIT = git_commit()
    if args.columns == "all":
        args.column_list = COLUMNS
    elif args.columns in COLUMN_GROUPS:
        args.column_list = COLUMN_GROUPS[args.columns]
    else:
        args.column_list = tuple(c for c in args.columns.split(",") if c)
        bad = set(args.column_list) - set(COLUMNS)
        if bad:
            ap.error(f"unknown columns {sorted(bad)}")
    if args.worker:
        worker_main(args.worker, Path(args.worker_out), args.column_list, args.latency)
        return
    filtered = bool(args.family or args.models or args.subset)
    out = Path(args.out) if args.out else (RESULTS if (not filtered or args.merge) else None)
    cov = Path(args.coverage) if args.coverage else (COVERAGE if (not filtered or args.merge) else None)
    command = "python bench/model_suite.py" + ("" if argv is None and len(sys.argv) == 1 else
                                               " " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.report_only:
        rows = read_rows(out or RESULTS)
        write_coverage(rows, cov or COVERAGE, None, args.jobs, command)
        print(f"wrote {cov or COVERAGE} from {len(rows)} rows")
        return
    import suite_models

    fams = tuple(args.family.split(",")) if args.family else suite_models.FAMILIES
    cases = suite_models.all_cases(fams)
    if args.subset == "ci":
        cases = [c for c in cases if c.name in suite_models.CI_SUBSET]
    if args.models:
        want = [m for m in args.models.split(",") if m]
        known = {c.name for c in cases}
        missing = [m for m in want if m not in known]
        if missing:
            ap.error(f"unknown models {missing}; see --list")
        cases = [c for c in cases if c.name in want]
    if args.list:
        for c in cases:
            print(f"{c.name:40s} {c.family:13s} {c.kind:16s} {c.note}")
        print(f"{len(cases)} models")
        return
    print(f"{len(cases)} models, columns {', '.join(args.column_list)}, --jobs {args.jobs}, logs in {args.logs}",
          flush=True)
    t0 = time.time()
    args.run_id = f"{utc_now()}: {command}"
    partial = Path(tempfile.gettempdir()) / "kiln-suite-partial.jsonl"
    partial.unlink(missing_ok=True)
    print(f"rows are appended to {partial} as they finish", flush=True)
    rows = run_suite(cases, args, partial)
    wall = time.time() - t0
    print(f"wall time {wall / 60:.1f} min")
    if out is not None:
        if filtered:
            names = {r["model"] for r in rows}
            rows = [r for r in read_rows(out) if r["model"] not in names] + rows
            wall = None
        write_rows(out, rows)
        print(f"wrote {out}")
    if cov is not None:
        write_coverage(rows, cov, wall, args.jobs, command)
        print(f"wrote {cov}")
    else:
        e2e = {}
        for r in rows:
            s, _ = kiln_outcome(r)
            e2e[s] = e2e.get(s, 0) + 1
        print("kiln end to end:", e2e)
        for col in args.column_list:
            print(f"{COLUMN_TITLES[col]}: {_count(rows, col)}")


if __name__ == "__main__":
    main()

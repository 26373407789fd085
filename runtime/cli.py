"""``kiln run`` / ``python -m kiln.runtime`` and ``kiln bench``: run a .kiln file from the shell.

Only numpy and kiln's runtime are imported, never torch or onnx: this is the deployed path. The
optional paths load onnx/onnxruntime when asked for: a .onnx model (imported into kiln's runtime on
the fly) and ``--backend onnxruntime`` (the same commands through ONNX Runtime, to compare).

Inputs are taken as they are (no casts): a .npy array of the wrong dtype is an InputError naming
the input, the expected type and the actual one. JSON is the one exception, because JSON numbers
have no dtype: they take the input's dtype where nothing is lost (booleans into bool, integers
into any number type, other numbers into float types).

``kiln bench --threads T`` runs the benchmark in a child process whose OMP/OpenBLAS/MKL/vecLib
thread variables are T: BLAS reads them once, when numpy is imported, so a fresh process is the
one way that works for every BLAS numpy may be built with, with no optional dependency.

``kiln bench --trace FILE.json`` writes the instrumented (``--profile``) runs as a Chrome trace
(runtime/profile.py); with ``--device cuda`` the instrumented runs are eager (CUDA events around each
kernel, on a "GPU stream" track of the trace) while the timed runs replay a CUDA graph where the
model can be captured. On a terminal, ``kiln bench`` shows its progress (loading, warm-up, timed and
instrumented runs) on one line of stderr, rewritten in place between runs, outside the timed code,
and erased before anything is printed; piped or redirected, it shows nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.ir.types import format_shape

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
_BENCH_SECONDS = 2.0  # what `kiln bench` spends on timed runs when --repeat is not given
_PROFILE_RUNS = 200   # instrumented runs of `kiln bench --profile` at most (fewer when --repeat is smaller)
_TRACE_RUNS = 10      # of those, how many `--trace` writes by default: each run is an event per instruction


# ---------------------------------------------------------------------------- loading and inputs
BACKENDS = ("kiln", "onnxruntime")  # runtime.program.BACKENDS, repeated so --help imports nothing


def load_program(path: str, backend: str = "kiln", threads: Optional[int] = None, device: str = "cpu"):
    """``kiln.load`` with a one-line error for a missing file."""
    from kiln.runtime.program import load

    if not os.path.isfile(path):
        raise KilnError(f"no such file: {path}")
    return load(path, device, backend=backend, threads=threads)


def read_inputs(specs: Sequence[str], program, sources: Optional[dict] = None) -> dict:
    """``--input`` entries -> arrays by input name; ``sources`` (if given) gets the entry each came from."""
    dtypes = {s.name: s.type.dtype for s in program.inputs}
    given: dict = {}
    for spec in specs:
        for name, array in _read_spec(spec, dtypes):
            if name in given:
                raise KilnError(f"input '{name}' is given twice")
            given[name] = array
            if sources is not None:
                sources[name] = spec
    return given


def check_input_names(given: dict, sources: dict, program, random_fill: bool) -> None:
    """Refuse, before anything runs, data for an input the model does not have, naming it, the --input
    entry it came from and the inputs the model has with their types (a misspelt name otherwise shows
    only as the right input missing); then any input left without data."""
    expected = {s.name: f"{s.name}: {s.type}" for s in program.inputs}
    extra = [n for n in given if n not in expected]
    missing = [n for n in expected if n not in given]
    if extra:
        def origin(name: str) -> str:
            spec = sources.get(name, "")
            return f"--input {spec}" if "=" in spec else f"an array of {spec}"
        which = ", ".join(f"'{n}' ({origin(n)})" for n in extra)
        hint = ""
        whole = sorted({sources[n] for n in extra if "=" not in sources.get(n, "=")})
        if whole:  # a FILE.npz passes every array: name the ones the model takes instead
            hint = f". Pick arrays by name from {', '.join(whole)}: --input NAME=FILE.npz"
        elif len(extra) == 1 and len(missing) == 1:
            hint = f". Did you mean --input {missing[0]}={sources[extra[0]].partition('=')[2]}?"
        raise KilnError(f"the model has no input{'s' if len(extra) > 1 else ''} {which}; it takes "
                        f"{', '.join(expected.values()) or 'no inputs'}{hint}")
    if missing and not random_fill:
        raise KilnError(f"no data for input(s) {', '.join(expected[n] for n in missing)}: give each with --input "
                        "NAME=... (or fill float inputs with --random-inputs BATCH)")


def onnxruntime_hint(command: str, error: BaseException, path: str, backend: Optional[str]) -> str:
    """A sentence suggesting ``--backend onnxruntime`` when kiln's ONNX importer refused ``path`` (an
    UnsupportedOpError in ``error`` or its causes) and onnxruntime imports here; '' otherwise. ONNX Runtime
    implements every ai.onnx op and Microsoft's contrib ops, so it may run what kiln refuses; "may": it
    is not asked (loading a large model there would slow every refusal)."""
    import importlib

    from kiln.errors import UnsupportedOpError

    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if backend not in (None, "kiln") or not any(isinstance(x, UnsupportedOpError) for x in chain):
        return ""
    folder = command == "serve" and os.path.isdir(path)
    if not (str(path).lower().endswith(".onnx") or folder):
        return ""
    try:
        importlib.import_module("onnxruntime")
    except Exception:  # noqa: BLE001 - not installed, or broken: then it is no way out
        return ""
    if command == "convert":
        return (f"ONNX Runtime is installed and may run this file as it is: kiln run {shlex.quote(path)} "
                "--backend onnxruntime (kiln bench and kiln serve take --backend onnxruntime too)")
    if folder:
        return ("ONNX Runtime is installed and may run the refused model: add --backend onnxruntime (every model), "
                "or set \"backend\": \"onnxruntime\" in that model's config.json")
    return "ONNX Runtime is installed and may run this file: add --backend onnxruntime to the command"


def _read_spec(spec: str, dtypes: dict) -> list:
    name, sep, source = spec.partition("=")
    if not sep:
        if spec.endswith(".npz"):
            return list(_load_arrays(spec).items())  # every array of the file, by name
        raise KilnError(f"bad --input '{spec}': expected NAME=FILE.npy, NAME=FILE.npz, NAME=@FILE.json, "
                        "NAME=JSON (e.g. 'x=[[1,2],[3,4]]') or FILE.npz (all arrays by name)")
    if not name:
        raise KilnError(f"bad --input '{spec}': the input name before '=' is empty")
    if source.startswith("@"):
        return [(name, _json_array(name, _read_json_file(source[1:]), dtypes.get(name)))]
    if source.endswith(".npy"):
        return [(name, _load_arrays(source))]
    if source.endswith(".npz"):
        return [(name, _pick(name, _load_arrays(source), source))]
    if source.endswith(".json"):
        return [(name, _json_array(name, _read_json_file(source), dtypes.get(name)))]
    try:
        value = json.loads(source)
    except json.JSONDecodeError:
        raise KilnError(f"bad --input '{spec}': '{source}' is not a .npy/.npz/.json file name nor valid JSON") from None
    return [(name, _json_array(name, value, dtypes.get(name)))]


def _load_arrays(path: str):
    if not os.path.isfile(path):
        raise KilnError(f"no such file: {path}")
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                return {k: loaded[k] for k in loaded.files}
        return loaded
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise KilnError(f"cannot read {path}: {e}") from None


def _pick(name: str, arrays: dict, path: str) -> np.ndarray:
    """The array ``name`` of an .npz file, or its only array."""
    if name in arrays:
        return arrays[name]
    if len(arrays) == 1:
        return next(iter(arrays.values()))
    raise KilnError(f"{path} has no array '{name}' (it holds {', '.join(arrays) or 'nothing'})")


def _read_json_file(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise KilnError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise KilnError(f"{path} is not valid JSON: {e}") from None


def _json_array(name: str, value, want) -> np.ndarray:
    """A JSON value as an array of the input's dtype ``want`` where no value changes."""
    try:
        a = np.asarray(value)
    except (ValueError, OverflowError):
        a = np.empty(0, object)  # ragged lists, ints beyond int64
    if a.dtype.kind not in "biuf":
        raise KilnError(f"input '{name}': the JSON is not a rectangular array of numbers or booleans")
    if want is None:
        return a  # not an input of the model: Program.run names it
    target = want.numpy
    fits = {"b": target.kind == "b", "i": target.kind in "iuf", "u": target.kind in "iuf", "f": target.kind == "f"}
    if not fits[a.dtype.kind]:
        return a  # left as is: Program.run reports expected and actual dtypes
    cast = a.astype(target)
    if target.kind in "iu" and not np.array_equal(cast, a):
        raise KilnError(f"input '{name}': JSON values do not fit in {target}")
    return cast


def parse_dims(specs: Sequence[str]) -> dict:
    """``--dim NAME=SIZE`` entries -> {symbol: size}."""
    dims = {}
    for spec in specs:
        name, _, size = spec.partition("=")
        if not name or not size.isdigit():
            raise KilnError(f"bad --dim '{spec}': expected NAME=SIZE, e.g. 'seq=128'")
        dims[name] = int(size)
    return dims


def random_inputs(specs: Sequence, batch: int, dims: dict, *, floats_only: bool, seed: int = 0) -> dict:
    """Random data for ``specs``: the symbol 'batch' and symbols at dim 0 are ``batch``, other
    symbols come from ``dims``. Floats are standard normal, integers in [0, 100), booleans fair."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in specs:
        dt = spec.type.dtype
        if floats_only and not dt.is_float:
            raise KilnError(f"--random-inputs fills float inputs only: give input '{spec.name}' ({spec.type}) "
                            "with --input")
        shape = _concrete_shape(spec, batch, dims)
        if dt.is_float:
            arrays[spec.name] = rng.standard_normal(shape).astype(dt.numpy)
        elif dt.numpy.kind == "b":
            arrays[spec.name] = rng.random(shape) < 0.5
        else:
            arrays[spec.name] = rng.integers(0, 100, shape).astype(dt.numpy)
    return arrays


def _concrete_shape(spec, batch: int, dims: dict) -> tuple:
    if spec.shape is None:
        raise KilnError(f"input '{spec.name}' has an unknown rank: give it with --input")
    shape = []
    for i, d in enumerate(spec.shape):
        if isinstance(d, int):
            shape.append(d)
        elif isinstance(d, str) and d in dims:
            shape.append(dims[d])
        elif isinstance(d, str) and (d == "batch" or i == 0):
            shape.append(batch)
        else:
            what = f"the symbolic dim '{d}'" if d else f"an unknown dim {i}"
            hint = f"--dim {d}=SIZE" if d else "--input"
            raise KilnError(f"input '{spec.name}' ({spec.type}) has {what}: give its size with {hint}")
    return tuple(shape)


# ---------------------------------------------------------------------------- outputs
def write_outputs(outputs: dict, path: str) -> None:
    """All outputs by name to .npz, or the single output to .npy."""
    suffix = Path(path).suffix
    if suffix not in (".npz", ".npy"):
        raise KilnError(f"cannot write {path}: -o takes a .npz file (all outputs) or a .npy file (one output)")
    if suffix == ".npy" and len(outputs) != 1:
        raise KilnError(f"the model has {len(outputs)} outputs ({', '.join(outputs)}): write them with -o FILE.npz")
    try:
        if suffix == ".npy":
            np.save(path, next(iter(outputs.values())))
        else:
            _save_npz(path, outputs)
    except OSError as e:
        raise KilnError(f"cannot write {path}: {e.strerror or e}") from None


def _save_npz(path: str, arrays: dict) -> None:
    # Written by hand rather than np.savez(path, **arrays): an output may be called 'file'.
    with zipfile.ZipFile(path, "w") as z:
        for name, a in arrays.items():
            with z.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, np.asarray(a), allow_pickle=False)


def summarize(outputs: dict) -> str:
    """One line per output: name, dtype and shape, min/mean/max."""
    width = max((len(n) for n in outputs), default=0)
    lines = []
    for name, a in outputs.items():
        head = f"{name:<{width}}  {a.dtype}{format_shape(a.shape)}"
        if a.size == 0 or a.dtype.kind not in "biuf":
            lines.append(head + ("  (empty)" if a.size == 0 else ""))
            continue
        v = a.astype(np.float64)
        lines.append(f"{head}  min {v.min():.6g}  mean {v.mean():.6g}  max {v.max():.6g}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- timing
def time_runs(run: Callable[[], object], repeat: int, warmup: int,
              progress: Optional[Callable[[int, int], None]] = None) -> np.ndarray:
    """Seconds per call of ``run``, after ``warmup`` untimed calls. ``progress(done, warmup + repeat)``
    is called after each call, outside the timed code."""
    total = warmup + repeat
    for i in range(warmup):
        run()
        if progress is not None:
            progress(i + 1, total)
    times = np.empty(repeat)
    for i in range(repeat):
        start = time.perf_counter()
        run()
        times[i] = time.perf_counter() - start
        if progress is not None:
            progress(warmup + i + 1, total)
    return times


def format_latency(times: np.ndarray, warmup: int) -> str:
    """One line; the max shows how spread the runs were (examples/demo_check.py parses this line)."""
    ms = times * 1e3
    return (f"latency over {len(ms)} runs (after {warmup} warm-up): median {np.median(ms):.4f} ms, "
            f"p90 {np.percentile(ms, 90):.4f} ms, min {ms.min():.4f} ms, mean {ms.mean():.4f} ms, "
            f"max {ms.max():.4f} ms")


# ---------------------------------------------------------------------------- kiln run
def _add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="kiln",
                   help="what runs the model: kiln's CPU runtime (default) or ONNX Runtime (needs "
                        "pip install 'kiln-compiler[onnx]'; a .kiln model is converted to ONNX in memory)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the .kiln file, or a .onnx file (imported on the fly; needs "
                                 "pip install 'kiln-compiler[onnx]')")
    p.add_argument("--input", "-i", action="append", default=[], metavar="SPEC",
                   help="NAME=FILE.npy, NAME=FILE.npz (its array NAME, or its only array), NAME=@FILE.json, "
                        "NAME=JSON (e.g. 'x=[[1,2],[3,4]]'), or FILE.npz (every array, by name); repeatable. "
                        "Arrays are used as they are: a dtype or shape the model does not take is an error")
    p.add_argument("-o", "--output", help="write all outputs to FILE.npz (by name) or the single output to FILE.npy "
                                          "(default: print name, dtype, shape, min/mean/max per output)")
    p.add_argument("--random-inputs", type=int, metavar="BATCH",
                   help="fill inputs not given with random normal data (float inputs only), batch size BATCH")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                   help="size of a symbolic dim other than the batch, for --random-inputs")
    p.add_argument("--repeat", type=int, default=0, metavar="N", help="also time N runs and print latency stats")
    p.add_argument("--warmup", type=int, default=3, metavar="W", help="untimed runs before --repeat (default 3)")
    _add_backend_arg(p)


def cmd_run(args: argparse.Namespace) -> int:
    program = load_program(args.model, args.backend)
    sources: dict = {}
    inputs = read_inputs(args.input, program, sources)
    check_input_names(inputs, sources, program, random_fill=args.random_inputs is not None)
    if args.random_inputs is not None:
        missing = [s for s in program.inputs if s.name not in inputs]
        inputs.update(random_inputs(missing, args.random_inputs, parse_dims(args.dim), floats_only=True))
    outputs = program.run(inputs)
    if args.output:
        write_outputs(outputs, args.output)
        print(f"wrote {len(outputs)} output(s) to {args.output}: {', '.join(outputs)}")
    else:
        print(summarize(outputs))
    if args.repeat > 0:
        times = time_runs(lambda: program.run(inputs), args.repeat, args.warmup)
        print(format_latency(times, args.warmup))
    return 0


# ---------------------------------------------------------------------------- kiln bench
def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the .kiln or .onnx file")
    p.add_argument("--batch", type=int, default=1, metavar="N", help="size of symbolic batch dims (default 1)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                   help="size of another symbolic dim (e.g. 'seq=128'); repeatable")
    p.add_argument("--threads", type=int, metavar="T",
                   help="BLAS threads: the benchmark runs in a child process with OMP/OPENBLAS/MKL/VECLIB thread "
                        "variables set to T (BLAS reads them when numpy is imported); with --backend onnxruntime, "
                        "ONNX Runtime's intra-op threads")
    p.add_argument("--warmup", type=int, default=10, metavar="W", help="untimed runs first (default 10)")
    p.add_argument("--repeat", type=int, metavar="N",
                   help=f"timed runs (default: as many as fit in {_BENCH_SECONDS:g} s, 10 to 10000)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model runs: the CPU (default) or the GPU (cuda: kiln's CUDA runtime through "
                        "CuPy, pip install 'kiln-compiler[gpu]'; with --backend onnxruntime, its CUDA provider). "
                        "On the GPU the inputs are uploaded once, outputs stay on the device and each timed run "
                        "is waited for; timed runs replay a CUDA graph where the model can be captured")
    p.add_argument("--profile", action="store_true",
                   help=f"also time every instruction over up to {_PROFILE_RUNS} more runs and print a per-op "
                        "table (total, share, calls, mean); kiln backend only. With --device cuda these runs are "
                        "eager (each kernel launched on its own, not a replay of a CUDA graph) and the table's times "
                        "are GPU times from a pair of CUDA events around each instruction")
    p.add_argument("--trace", metavar="FILE.json",
                   help="write the instrumented runs as a Chrome trace (the JSON that torch.profiler and "
                        "onnxruntime's profiler write; open it at https://ui.perfetto.dev or chrome://tracing): "
                        "an event per run and, inside it, one per instruction named by its op, with the node, "
                        "module path, input/output shapes and dtypes; If/Loop and fused bodies as nested events. "
                        "With --device cuda, a second track (GPU stream) holds each instruction's GPU time from "
                        "CUDA events, beside the host's launch spans, over eager runs. "
                        "Implies --profile; kiln backend only")
    p.add_argument("--trace-runs", type=_positive_int, metavar="N",
                   help=f"how many instrumented runs --trace writes (default {_TRACE_RUNS}; each adds an "
                        "event per executed instruction)")
    _add_backend_arg(p)
    p.epilog = ("On a terminal, progress (loading, warm-up, timed and instrumented runs) is shown on one line of "
                "stderr, between runs and outside the timed code; piped or redirected, nothing is.")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return n


def cmd_bench(args: argparse.Namespace) -> int:
    ort = args.backend == "onnxruntime"
    if args.trace_runs is not None and args.trace is None:
        raise KilnError("--trace-runs sets how many runs --trace writes: give --trace FILE.json too")
    if ort and (args.profile or args.trace):
        flag = "--trace" if args.trace else "--profile"
        raise KilnError(f"{flag} times kiln's own instructions: it works with --backend kiln only "
                        "(ONNX Runtime has its own profiler: SessionOptions.enable_profiling, which writes "
                        "the same trace format)")
    if args.device == "cuda" and not ort:
        if args.threads is not None:
            raise KilnError("--threads sets the CPU runtime's BLAS threads: --device cuda does not take it")
        _check_cuda()  # before the model is read
    if args.trace:
        _check_writable(args.trace)  # before the benchmark, not after it
    if not ort and args.threads is not None and not _threads_already(args.threads):
        return _bench_in_child(args)
    status = StatusLine()
    try:
        return _bench(args, ort, status)
    finally:
        status.clear()


def _check_cuda() -> None:
    """``kiln bench --device cuda`` (kiln backend): CuPy and a visible GPU, or an error naming what is missing."""
    try:
        import cupy as cp
    except ImportError as e:
        raise KilnError(f"--device cuda needs CuPy (pip install 'kiln-compiler[gpu]'): {e}") from None
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, a broken CUDA install: said as it is
        raise KilnError(f"--device cuda: no usable CUDA GPU ({type(e).__name__}: {e}); bench on the CPU "
                        "without --device") from None
    if count == 0:
        raise KilnError("--device cuda: no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); bench on the CPU without --device")


def _check_writable(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise KilnError(f"cannot write the trace to {path}: it is a directory (give a file name, e.g. "
                        f"{os.path.join(path, 'trace.json')})")
    if not os.path.isdir(folder):
        raise KilnError(f"cannot write the trace to {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise KilnError(f"cannot write the trace to {path}: the directory {folder} is not writable")


def _bench(args: argparse.Namespace, ort: bool, status: "StatusLine") -> int:
    status.show(f"loading {args.model}", force=True)
    program = load_program(args.model, args.backend, args.threads if ort else None, args.device)
    inputs = random_inputs(program.inputs, args.batch, parse_dims(args.dim), floats_only=False)
    status.clear()
    gpu = args.device == "cuda" and not ort  # kiln's CudaProgram
    if ort:
        print(f"model    {args.model} (onnxruntime, {', '.join(program.providers)})")
        threads = "ORT default" if args.threads is None else f"{args.threads} (ORT intra-op threads)"
    else:
        print(f"model    {args.model} ({len(program.graph.nodes)} nodes, "
              f"{len(program.plan.instructions)} instructions)")
        threads = "BLAS default" if args.threads is None else f"{args.threads} (BLAS thread variables of this process)"
    print("inputs   " + ", ".join(f"{n}: {a.dtype}{format_shape(a.shape)}" for n, a in inputs.items()))
    if gpu:
        import cupy as cp
        device = cp.cuda.Device()
        name = cp.cuda.runtime.getDeviceProperties(device.id)["name"]
        print(f"device   {name.decode() if isinstance(name, bytes) else name} (cuda:{device.id}); inputs uploaded "
              "once, outputs left on the device, each run waited for")
        feeds = {n: cp.asarray(a) for n, a in inputs.items()}
        stream = cp.cuda.get_current_stream()

        def run() -> object:
            out = program.run(feeds)
            stream.synchronize()
            return out
    else:
        print(f"threads  {threads}")

        def run() -> object:
            return program.run(inputs)

    warm = time_runs(run, max(args.warmup, 1), 0, status.counter("warm-up"))
    repeat = args.repeat or int(np.clip(_BENCH_SECONDS / max(np.median(warm), 1e-7), 10, 10000))
    times = time_runs(run, repeat, 0, status.counter("timed runs"))
    status.clear()
    print(format_latency(times, len(warm)))
    if gpu:
        print(f"runs     {_cuda_runs(program)}")
    elif not ort:
        plan = _specialized_plan(program, inputs)
        if plan:
            print(plan)
    if args.profile or args.trace:
        from kiln.runtime.profile import format_profile, profile_program, write_trace

        trace_runs = (args.trace_runs or _TRACE_RUNS) if args.trace else 0
        runs = max(min(repeat, _PROFILE_RUNS), trace_runs)
        p = profile_program(program, feeds if gpu else inputs, runs=runs, trace_runs=trace_runs,
                            progress=status.counter("instrumented runs"))
        status.clear()
        print()
        print(format_profile(p))
        if args.trace:
            status.show(f"writing {args.trace}", force=True)
            shapes = ", ".join(f"{n}: {a.dtype}{format_shape(a.shape)}" for n, a in inputs.items())
            n = write_trace(p, args.trace, process_name=f"kiln bench {os.path.basename(args.model)}",
                            metadata={"model": args.model, "inputs": shapes,
                                      "instructions": len(program.plan.instructions)})
            status.clear()
            print(f"\ntrace    {args.trace}: {trace_runs} runs, {n} events; open it at https://ui.perfetto.dev "
                  "or chrome://tracing" + ("; the GPU's CUDA-event times are on the 'GPU stream' track" if gpu else ""))
    return 0


def _specialized_plan(program, inputs: dict) -> str:
    """A 'plan' line when the timed runs took a plan specialized to these input shapes (runtime/specialize.py)."""
    special = program._specialized(program._check_inputs(inputs)) if hasattr(program, "_specialized") else None
    if special is None:
        return ""
    return (f"plan     specialized to these input shapes from the second run: {len(special.plan.instructions)} "
            f"instructions, {special.folded} folded (shape computations and constants), {special.views} views "
            f"made from their source directly")


def _cuda_runs(program) -> str:
    """How a CudaProgram's timed runs ran: a CUDA-graph replay, or eager and why."""
    if program.captured_graphs():
        return "CUDA-graph replay (one launch per run)"
    if not program.cuda_graphs:
        from kiln.runtime.cuda_program import GRAPH_MIN_INSTRUCTIONS
        return (f"eager (CUDA graphs off: cuda_graphs='auto' captures plans of at least {GRAPH_MIN_INSTRUCTIONS} "
                f"instructions, this one has {len(program.plan.instructions)})"
                if program.options.cuda_graphs == "auto" else "eager (CUDA graphs off)")
    why = next(iter(program.graph_failures.values()), "not captured")
    return f"eager (the plan could not be captured into a CUDA graph: {why})"


class StatusLine:
    """Progress on one line of stderr, rewritten in place (a carriage return, then padding over what
    was there), at most ``interval`` apart; nothing at all unless stderr is a terminal, so piped or
    redirected output stays clean. Callers ``clear`` it before printing to stdout, which may be the
    same terminal."""

    def __init__(self, stream=None, interval: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.on = bool(self.stream.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            self.on = False
        self.interval = interval
        self._shown = 0    # characters on the line now
        self._at = -1e9    # time.monotonic() of the last write

    def show(self, text: str, force: bool = False) -> None:
        if not self.on:
            return
        now = time.monotonic()
        if not force and now - self._at < self.interval:
            return
        self._at = now
        import shutil
        text = text[:max(shutil.get_terminal_size().columns - 1, 10)]  # a wrapped line cannot be rewritten
        self.stream.write("\r" + text + " " * max(self._shown - len(text), 0))
        self.stream.flush()
        self._shown = len(text)

    def counter(self, what: str) -> Optional[Callable[[int, int], None]]:
        """A ``progress(done, total)`` callback showing '``what`` done/total', or None when off (so a
        timing loop skips even the call)."""
        if not self.on:
            return None
        return lambda done, total: self.show(f"{what} {done}/{total}", force=done == total)

    def clear(self) -> None:
        if self.on and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0


def _threads_already(threads: int) -> bool:
    """Whether this process started with every BLAS thread variable at ``threads``."""
    return all(os.environ.get(v) == str(threads) for v in _THREAD_VARS)


def _bench_in_child(args: argparse.Namespace) -> int:
    env = dict(os.environ, **{v: str(args.threads) for v in _THREAD_VARS})
    argv = [sys.executable, "-m", "kiln", "bench", args.model, "--batch", str(args.batch),
            "--threads", str(args.threads), "--warmup", str(args.warmup)]
    argv += [f"--dim={d}" for d in args.dim]
    if args.repeat:
        argv += ["--repeat", str(args.repeat)]
    if args.profile:
        argv.append("--profile")
    if args.trace:
        argv += ["--trace", args.trace]
    if args.trace_runs:
        argv += ["--trace-runs", str(args.trace_runs)]
    sys.stdout.flush()
    return subprocess.call(argv, env=env)


# ---------------------------------------------------------------------------- python -m kiln.runtime
def main(argv: Optional[Sequence[str]] = None) -> int:
    """The standalone runner: the same arguments and behaviour as ``kiln run``."""
    parser = argparse.ArgumentParser(
        prog="python -m kiln.runtime",
        description="Run a .kiln model on inputs from .npy/.npz/JSON (the same as `kiln run`).")
    add_run_args(parser)
    args = parser.parse_args(argv)
    from kiln.errors import run_command
    return run_command("run", with_hints("run", cmd_run), args)


def with_hints(command: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` with :func:`onnxruntime_hint` appended to the error of a command given a model file
    (run, bench, serve, convert): kiln's own entry points (``kiln``, ``python -m kiln.runtime``) wrap them."""
    def call(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except KilnError as e:
            path = next((getattr(args, a) for a in ("model", "path", "input")
                         if isinstance(getattr(args, a, None), str)), None)  # run/bench, serve, convert
            hint = onnxruntime_hint(command, e, path, getattr(args, "backend", None)) if path else ""
            if hint:
                e.args = (f"{e}\nhint: {hint}",)
            raise
    return call

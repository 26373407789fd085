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
"""
from __future__ import annotations

import argparse
import json
import os
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


# ---------------------------------------------------------------------------- loading and inputs
BACKENDS = ("kiln", "onnxruntime")  # runtime.program.BACKENDS, repeated so --help imports nothing


def load_program(path: str, backend: str = "kiln", threads: Optional[int] = None):
    """``kiln.load`` with a one-line error for a missing file."""
    from kiln.runtime.program import load

    if not os.path.isfile(path):
        raise KilnError(f"no such file: {path}")
    return load(path, backend=backend, threads=threads)


def read_inputs(specs: Sequence[str], program) -> dict:
    """``--input`` entries -> arrays by input name."""
    dtypes = {s.name: s.type.dtype for s in program.inputs}
    given: dict = {}
    for spec in specs:
        for name, array in _read_spec(spec, dtypes):
            if name in given:
                raise KilnError(f"input '{name}' is given twice")
            given[name] = array
    return given


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
def time_runs(run: Callable[[], object], repeat: int, warmup: int) -> np.ndarray:
    """Seconds per call of ``run``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    times = np.empty(repeat)
    for i in range(repeat):
        start = time.perf_counter()
        run()
        times[i] = time.perf_counter() - start
    return times


def format_latency(times: np.ndarray, warmup: int) -> str:
    ms = times * 1e3
    return (f"latency over {len(ms)} runs (after {warmup} warm-up): median {np.median(ms):.4f} ms, "
            f"p90 {np.percentile(ms, 90):.4f} ms, min {ms.min():.4f} ms, mean {ms.mean():.4f} ms")


# ---------------------------------------------------------------------------- kiln run
def _add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="kiln",
                   help="what runs the model: kiln's CPU runtime (default) or ONNX Runtime (needs "
                        "pip install 'kiln-compiler[onnx]'; a .kiln model is converted to ONNX in memory)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the .kiln file, or a .onnx file (imported on the fly; needs pip install 'kiln-compiler[onnx]')")
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
    inputs = read_inputs(args.input, program)
    if args.random_inputs is not None:
        missing = [s for s in program.inputs if s.name not in inputs]
        inputs.update(random_inputs(missing, args.random_inputs, parse_dims(args.dim), floats_only=True))
    missing = [f"{s.name}: {s.type}" for s in program.inputs if s.name not in inputs]
    if missing:
        raise KilnError(f"no data for input(s) {', '.join(missing)}: give each with --input "
                        "(or fill float inputs with --random-inputs BATCH)")
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
    p.add_argument("--profile", action="store_true",
                   help="also time every instruction and print a per-op table (total, share, calls, mean); "
                        "kiln backend only")
    _add_backend_arg(p)


def cmd_bench(args: argparse.Namespace) -> int:
    ort = args.backend == "onnxruntime"
    if ort and args.profile:
        raise KilnError("--profile times kiln's own instructions: it works with --backend kiln only "
                        "(ONNX Runtime has its own profiler: SessionOptions.enable_profiling)")
    if not ort and args.threads is not None and not _threads_already(args.threads):
        return _bench_in_child(args)
    program = load_program(args.model, args.backend, args.threads if ort else None)
    inputs = random_inputs(program.inputs, args.batch, parse_dims(args.dim), floats_only=False)
    if ort:
        print(f"model    {args.model} (onnxruntime, {', '.join(program.providers)})")
        threads = "ORT default" if args.threads is None else f"{args.threads} (ORT intra-op threads)"
    else:
        print(f"model    {args.model} ({len(program.graph.nodes)} nodes, "
              f"{len(program.plan.instructions)} instructions)")
        threads = "BLAS default" if args.threads is None else f"{args.threads} (BLAS thread variables of this process)"
    print("inputs   " + ", ".join(f"{n}: {a.dtype}{format_shape(a.shape)}" for n, a in inputs.items()))
    print(f"threads  {threads}")

    def run() -> object:
        return program.run(inputs)

    warm = time_runs(run, max(args.warmup, 1), 0)
    repeat = args.repeat or int(np.clip(_BENCH_SECONDS / max(np.median(warm), 1e-7), 10, 10000))
    print(format_latency(time_runs(run, repeat, 0), len(warm)))
    if args.profile:
        from kiln.runtime.profile import format_profile, profile_program

        print()
        print(format_profile(profile_program(program, inputs, runs=min(repeat, 200))))
    return 0


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
    return run_command("run", cmd_run, args)

"""``kiln export``: trace a PyTorch model named on the command line and write a .kiln file, an ONNX
file (``--onnx``, through kiln's exporter: the same traced, checked and optimized graph), or both.
``--script`` compiles it with kiln.script instead (data-dependent ``if``/``for``/``while`` become
If/Loop nodes rather than the one path the random example inputs take); the steps are the same.

Imports nothing heavy at module level (``kiln --help`` must not import torch); torch and the
tracer are imported when the command runs.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import threading
import time
import warnings
from typing import Optional, Sequence

from kiln.errors import KilnError

_EXPORT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
_CHECK_TRIALS = 3  # fresh random inputs the check runs besides the examples


_SLOW_CHECK_S = 10.0  # past this, the check's line says that --no-check skips it
_TICK_S = 0.5  # how often a live progress line is redrawn


class _Progress:
    """Where the export is. Each step ends with one stderr line, ``tracing ... 1.23 s`` (``failed`` when it
    raises), piped or not. On a terminal (stderr a TTY) the line is live while the step runs: the elapsed
    seconds tick, it says what the step is at (the check: which input set of how many) and, once the check
    has taken ``_SLOW_CHECK_S``, that ``--no-check`` skips it. BERT-base spent 132 s checking with nothing
    shown; a log file or a pipe still gets the same lines as before and no carriage returns."""

    def __init__(self, stream=None, live: Optional[bool] = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = _is_terminal(self.stream) if live is None else live
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._label, self._detail, self._slow, self._start = "", "", None, 0.0

    @contextlib.contextmanager
    def step(self, label: str, slow: Optional[tuple[float, str]] = None):
        """A step called ``label``; ``slow`` = (seconds, note): the note is shown once the step takes longer."""
        self._label, self._detail, self._slow = label, "", slow
        self._start = time.perf_counter()
        stop = threading.Event()
        ticker, shown = None, warnings.showwarning
        if self.live:
            self._draw()
            ticker = threading.Thread(target=self._tick, args=(stop,), name="kiln-export-progress", daemon=True)
            ticker.start()
            warnings.showwarning = self._clearing(shown)  # a warning the model prints starts on a clean line
        else:
            print(f"{label} ...", end="", file=self.stream, flush=True)
        try:
            yield self
        except BaseException:
            self._end(stop, ticker, "failed")
            raise
        finally:
            warnings.showwarning = shown
        seconds = self.seconds[label] = time.perf_counter() - self._start
        note = f" ({slow[1]})" if slow and seconds > slow[0] else ""
        self._end(stop, ticker, f"{seconds:.2f} s{note}")

    def detail(self, text: str) -> None:
        """What the running step is at; shown at once on a terminal, not at all elsewhere."""
        self._detail = text
        if self.live:
            self._draw()

    def _clearing(self, show):
        def clear_then_show(*args, **kwargs):
            with self._lock:
                self.stream.write("\r\x1b[K")
            show(*args, **kwargs)
        return clear_then_show

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(_TICK_S):
            self._draw()

    def _draw(self) -> None:
        elapsed = time.perf_counter() - self._start
        line = f"{self._label} ... {elapsed:.0f} s" + (f", {self._detail}" if self._detail else "")
        if self._slow and elapsed > self._slow[0]:
            line += f" ({self._slow[1]})"
        width = shutil.get_terminal_size((80, 24)).columns - 1  # a wrapped line could not be redrawn in place
        with self._lock:
            self.stream.write("\r" + line[:width] + "\x1b[K")
            self.stream.flush()

    def _end(self, stop: threading.Event, ticker, result: str) -> None:
        stop.set()
        if ticker is not None:
            ticker.join()
            with self._lock:
                self.stream.write(f"\r{self._label} ... {result}\x1b[K\n")
                self.stream.flush()
        else:
            print(f" {result}", file=self.stream, flush=True)


def _is_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal that redraws a line (not TERM=dumb)."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _require_torch() -> None:
    """kiln export traces PyTorch models: say how to install torch before any step runs, not with a
    ModuleNotFoundError from deep inside (as kiln serve and the ONNX paths name their extras)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch") is not None
    except ValueError:  # sys.modules['torch'] is None, or has no __spec__
        found = sys.modules.get("torch") is not None
    if not found:
        raise KilnError("kiln export traces PyTorch models and needs torch, which is not installed: "
                        "pip install 'kiln-compiler[torch]' (or install torch for your platform and CUDA "
                        "version as pytorch.org describes; a CPU-only build is enough). Models already in ONNX "
                        "need no torch: kiln convert MODEL.onnx MODEL.kiln")


@contextlib.contextmanager
def _user_code(step: str):
    """Errors raised by the model's own code (import, construction, forward) become one clear
    line; kiln's errors pass through unchanged."""
    try:
        yield
    except KilnError:
        raise
    except Exception as e:
        raise KilnError(f"{step} failed: {type(e).__name__}: {e}") from e


def _parse_input_spec(spec: str) -> tuple[str, tuple[int, ...], str, Optional[tuple[float, float]]]:
    """``name:1x3x224x224[:dtype[:low:high]]`` -> (name, shape, dtype, range or None)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3, 5) or not parts[0].isidentifier():
        raise KilnError(f"bad --input '{spec}': expected NAME:SHAPE[:DTYPE[:LOW:HIGH]], e.g. 'x:1x3x224x224:float32'")
    dims = parts[1].lower().split("x") if parts[1] else []
    if not all(d.isdigit() for d in dims):
        raise KilnError(f"bad --input '{spec}': the shape '{parts[1]}' must be sizes joined by 'x', e.g. 1x3x224x224")
    dtype = parts[2] if len(parts) > 2 else "float32"
    if dtype not in _EXPORT_DTYPES:
        raise KilnError(f"bad --input '{spec}': unknown dtype '{dtype}' (one of {', '.join(_EXPORT_DTYPES)})")
    value_range = None
    if len(parts) == 5:
        try:
            value_range = (float(parts[3]), float(parts[4]))
        except ValueError:
            raise KilnError(f"bad --input '{spec}': the range '{parts[3]}:{parts[4]}' must be two numbers") from None
        if not value_range[0] < value_range[1]:
            raise KilnError(f"bad --input '{spec}': the range needs LOW < HIGH")
    return parts[0], tuple(int(d) for d in dims), dtype, value_range


def _parse_dynamic(specs: Sequence[str], ranks: dict[str, int], dynamic_batch: bool) -> dict[str, dict[int, str]]:
    """``--dynamic NAME:DIM:SYMBOL`` entries (and ``--dynamic-batch``) -> kiln.trace's ``dynamic``."""
    dynamic: dict[str, dict[int, str]] = {n: {0: "batch"} for n, rank in ranks.items() if dynamic_batch and rank}
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 3 or not parts[2].isidentifier():
            raise KilnError(f"bad --dynamic '{spec}': expected NAME:DIM:SYMBOL, e.g. 'ids:1:seq'")
        try:
            dim = int(parts[1])
        except ValueError:
            raise KilnError(f"bad --dynamic '{spec}': DIM '{parts[1]}' must be an integer") from None
        dynamic.setdefault(parts[0], {})[dim] = parts[2]
    return dynamic


def _example_input(shape: tuple[int, ...], dtype: str, value_range, gen):
    """Random example data: normal floats (uniform in a given range), ints in [0, 100) or the range."""
    import torch

    tdtype = getattr(torch, dtype)
    if tdtype is torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if tdtype.is_floating_point:
        if value_range is None:
            return torch.randn(shape, generator=gen).to(tdtype)
        low, high = value_range
        return (torch.rand(shape, generator=gen) * (high - low) + low).to(tdtype)
    low, high = value_range or (0, 100)
    return torch.randint(int(low), int(high), shape, generator=gen).to(tdtype)


def _import_target(module: str):
    """A .py file (by path) or a dotted module name (importable from the current folder)."""
    import importlib.util
    from pathlib import Path

    path = Path(module)
    if module.endswith(".py") or path.is_file():
        if not path.is_file():
            raise KilnError(f"no such file: {module}")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # so the file can import its neighbours
        name = f"_kiln_export_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise KilnError(f"no module named '{module}' (give a .py path or a dotted module name)") from None
        raise


def _load_model(target: str, command: Sequence[str] = ()):
    """``MODULE:ATTR`` -> an nn.Module: ATTR is an instance, a class built with no arguments (then
    put in eval mode, as the user had no chance to), or a factory function returning a module.

    A file in its place (``model.pt``: TorchScript, a state_dict, a pickled module; an ONNX file; the .py
    file without ATTR) is named for what it is, with what to run instead (frontend/model_files.py);
    ``command`` (the rest of the user's arguments) is repeated in those suggestions."""
    import torch

    from kiln.frontend import model_files

    module, sep, attr = target.rpartition(":")
    if not sep or not module or not attr:
        described = model_files.describe(target, command)
        if described:
            raise KilnError(described)
        if os.sep in target or "/" in target or os.path.splitext(target)[1] in _MODEL_SUFFIXES:
            raise KilnError(f"no such file: {target} (kiln export takes MODULE:ATTR, e.g. 'models.py:Net')")
        raise KilnError(f"bad model '{target}': expected MODULE:ATTR, e.g. 'examples/models.py:SmallCNN'")
    if os.path.isfile(module) and not module.endswith(".py"):
        raise KilnError(model_files.describe(module, command))
    obj = _import_target(module)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KilnError(f"{module} has no attribute '{attr}'")
        obj = getattr(obj, part)
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        return obj().eval()
    called = callable(obj) and not isinstance(obj, torch.nn.Module)
    if called:
        obj = obj()  # a factory
    if not isinstance(obj, torch.nn.Module):
        got = f"it returned {type(obj).__name__}" if called else f"got {type(obj).__name__}"
        raise KilnError(f"{target} is not an nn.Module, an nn.Module class or a factory returning one ({got})")
    return obj


# Suffixes of files people give in place of MODULE:ATTR (a missing one is then "no such file").
_MODEL_SUFFIXES = (".py", ".pt", ".pth", ".ckpt", ".bin", ".onnx", ".kiln", ".safetensors", ".pkl")


def _rest_of_command(args: argparse.Namespace) -> list:
    """The user's arguments other than the model, for the commands error messages suggest."""
    rest = [a for spec in args.input for a in ("--input", spec)]
    rest += [a for spec in args.dynamic for a in ("--dynamic", spec)]
    rest += ["--dynamic-batch"] if args.dynamic_batch else []
    rest += ["-o", args.output] if args.output else []
    rest += ["--onnx", args.onnx] if args.onnx else []
    return rest


def _trace_step(model, inputs: dict, dynamic: dict, progress: _Progress, script: bool = False,
                guards: bool = True):
    """Trace, or script with ``script`` (no check, no optimize: they are steps of their own);
    TraceWarnings go to stderr."""
    from kiln.errors import TraceWarning

    if script:
        from kiln.frontend.script import script as compile_model
        label = "scripting"
    else:
        from kiln.frontend.trace import trace as compile_model
        label = "tracing"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceWarning)
        with progress.step(label), _user_code(label):
            graph = compile_model(model, inputs, dynamic=dynamic, check=False, optimize=False, guards=guards)
    warned = [w for w in caught if issubclass(w.category, TraceWarning)]
    for w in warned:
        print(f"warning: {w.message}", file=sys.stderr)
    return graph, len(warned)


def _check_step(graph, model, inputs: dict, ranges: dict, progress: _Progress) -> str:
    """Run the model and the graph on the examples and on fresh inputs (slow on a large model: the graph
    runs in the reference evaluator); the live line counts the input sets."""
    from kiln.frontend.trace import check_trace

    def on_trial(k: int, total: int, label: str) -> None:
        progress.detail(f"input set {k} of {total}: {label}")

    names = [v.name for v in graph.inputs]
    dims = [{i: d for i, d in enumerate(v.type.shape) if isinstance(d, str)} for v in graph.inputs]
    with progress.step("checking", slow=(_SLOW_CHECK_S, "--no-check skips this step")), _user_code("checking"):
        check_trace(graph, model, names, [inputs[n] for n in names], dims, rtol=1e-4, atol=1e-5,
                    trials=_CHECK_TRIALS, ranges=ranges, on_trial=on_trial)
    others = ", at other sizes" if any(dims) else ""
    return f"passed (the example inputs and {_CHECK_TRIALS} fresh random ones{others})"


def cmd_export(args: argparse.Namespace) -> int:
    from kiln.serializer.convert_cli import check_precision_args
    check_precision_args(args)  # a bad OP=... fails now, not after tracing
    specs = [_parse_input_spec(s) for s in args.input]
    ranks = {name: len(shape) for name, shape, _, _ in specs}
    if len(ranks) != len(specs):
        raise KilnError(f"an input is given twice: {', '.join(s[0] for s in specs)}")
    dynamic = _parse_dynamic(args.dynamic, ranks, args.dynamic_batch)
    _check_outputs(args)
    if args.onnx:
        from kiln.errors import optional_module
        optional_module("kiln.serializer.onnx", "--onnx")  # before the slow steps: a missing onnx fails at once
    _require_torch()
    progress = _Progress()
    with progress.step(f"loading {args.model}"):
        try:
            import torch  # importing torch is most of the time here
        except ImportError as e:  # installed but broken (a missing shared library, a mismatched build)
            raise KilnError(f"importing torch failed: {type(e).__name__}: {e} (reinstall torch: "
                            "pip install --force-reinstall 'kiln-compiler[torch]')") from e

        with _user_code("loading the model"):
            model = _load_model(args.model, _rest_of_command(args))
    gen = torch.Generator().manual_seed(0)
    inputs = {name: _example_input(shape, dt, rng, gen) for name, shape, dt, rng in specs}
    graph, warned = _trace_step(model, inputs, dynamic, progress, script=args.script, guards=not args.no_guards)
    ranges = {name: rng for name, _, _, rng in specs if rng is not None}
    check = "skipped (--no-check)" if args.no_check else _check_step(graph, model, inputs, ranges, progress)
    nodes_traced = len(graph.nodes)
    if not args.no_optimize:
        from kiln.ir.passes import optimize
        from kiln.ir.verifier import verify

        with progress.step("optimizing"):
            optimize(graph)
            verify(graph)
    if args.precision != "fp32" or getattr(args, "weights", None):  # after the check (float32 trace vs model)
        from kiln.ir.passes import optimize
        from kiln.ir.verifier import verify
        from kiln.serializer.convert_cli import apply_precision

        what = " + ".join(x for x in (args.precision if args.precision != "fp32" else "",
                                      f"{args.weights} weights" if getattr(args, "weights", None) else "") if x)
        with progress.step(f"converting to {what}"):
            summary = apply_precision(graph, args)
            if not args.no_optimize:
                optimize(graph)
            verify(graph)
        print(f"  precision   {summary}")
    graph.metadata.props["source"] = args.model
    if args.output:
        path = _save_step(graph, args.output, progress)
        _print_export_summary(path, nodes_traced, check, warned, progress)
    if args.onnx:
        _onnx_step(graph, args.onnx, args.opset, progress)
        if not args.output:
            print(f"  nodes       {len(graph.nodes)} in kiln's IR (traced {nodes_traced})")
            print(f"  check       {check}")
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """The files to write (-o and/or --onnx), checked before any slow step."""
    if not args.output and not args.onnx:
        raise KilnError("nothing to write: give -o FILE.kiln, --onnx FILE.onnx, or both")
    if args.opset is not None and not args.onnx:
        raise KilnError("--opset is the ONNX opset of the --onnx file: give --onnx too")
    if args.onnx and not args.onnx.lower().endswith(".onnx"):
        raise KilnError(f"--onnx {args.onnx}: the file name must end in .onnx")
    for target in filter(None, (args.output, args.onnx)):
        folder = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(folder):
            raise KilnError(f"cannot write {target}: the folder {folder} does not exist")


def _onnx_step(graph, output: str, opset: Optional[int], progress: _Progress) -> None:
    """Write the ONNX file and a one-line summary of it (read back without its external data)."""
    from kiln.serializer.convert_cli import onnx_summary
    from kiln.serializer.onnx import export_onnx

    with progress.step(f"writing {output}"):
        try:
            export_onnx(graph, output, opset=opset)
        except OSError as e:
            raise KilnError(f"cannot write {output}: {e.strerror or e}") from None
    print(onnx_summary(output))


def _save_step(graph, output: str, progress: _Progress):
    from kiln.serializer import save

    with progress.step(f"saving {output}"):
        try:
            return save(graph, output)
        except OSError as e:
            raise KilnError(f"cannot write {output}: {e.strerror or e}") from None


def _print_export_summary(path, nodes_traced: int, check: str, warned: int, progress: _Progress) -> None:
    """What the file holds, read back from it as ``kiln inspect`` reads it."""
    from kiln.ir.types import format_shape
    from kiln.serializer.inspect import read_summary

    s = read_summary(path)

    def types(values: list) -> str:
        return ", ".join(f"{v['name']}: {v['dtype']}{format_shape(tuple(v['shape']))}" for v in values)

    top = list(s["ops"].items())[:8]
    more = len(s["ops"]) - len(top)
    ops = ", ".join(f"{op} {n}" for op, n in top) + (f", ... {more} more kinds" if more > 0 else "")
    size = s["file_size"]
    print(f"wrote {s['path']} ({size / 2 ** 20:.2f} MiB, {size:,} bytes) in {sum(progress.seconds.values()):.2f} s")
    print(f"  inputs      {types(s['inputs'])}")
    print(f"  outputs     {types(s['outputs'])}")
    print(f"  nodes       {s['nodes']} (traced {nodes_traced})")
    print(f"  ops         {ops}")
    print(f"  parameters  {s['parameters']:,} ({s['parameter_bytes'] / 2 ** 20:.2f} MiB)")
    print(f"  check       {check}")
    if warned:
        print(f"  warnings    {warned} TraceWarning(s), printed above: the trace may be specific to the example inputs")
    guards = s.get("guards", [])
    if guards:
        print(f"  guards      {len(guards)}: the file refuses inputs that change a value the model read while "
              "traced (kiln inspect lists them)")
        for g in guards[:5]:
            print(f"              {g['location'] or '?'}: {g['what']} must be {g['expected']}")
        if len(guards) > 5:
            print(f"              ... {len(guards) - 5} more")


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODULE:ATTR",
                   help="a .py file or dotted module name, and the name in it of an nn.Module instance, an nn.Module "
                        "class (built with no arguments, in eval mode) or a factory function returning a module. "
                        "Given a saved file instead (TorchScript, a state_dict, a pickled module, ONNX), the error "
                        "says what it is and what to run")
    p.add_argument("-o", "--output", help="the .kiln file to write (may be left out when --onnx is given)")
    p.add_argument("--onnx", metavar="FILE.onnx",
                   help="also (or, without -o, only) write the graph as ONNX, through kiln's exporter "
                        "(needs pip install 'kiln-compiler[onnx]')")
    p.add_argument("--opset", type=int, metavar="N", help="the ai.onnx opset of the --onnx file (default: the "
                                                          "exporter's)")
    p.add_argument("--input", action="append", required=True, metavar="NAME:SHAPE[:DTYPE[:LOW:HIGH]]",
                   help="an example input, by forward() argument name: shape as sizes joined by 'x', dtype "
                        f"(default float32; one of {', '.join(_EXPORT_DTYPES)}); random data: normal floats, ints "
                        "in [0, 100) unless LOW:HIGH is given (e.g. 'ids:1x16:int64:0:1000'; the check then draws from "
                        "[LOW, HIGH) too, instead of the range the model accepts). Repeat per input")
    p.add_argument("--dynamic-batch", action="store_true", help="make dim 0 of every input the symbol 'batch'")
    p.add_argument("--dynamic", action="append", default=[], metavar="NAME:DIM:SYMBOL",
                   help="make dim DIM of input NAME symbolic (e.g. 'ids:1:seq'); repeatable")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing the graph with the model on the example and fresh random inputs (on a "
                        "large model the slowest step: BERT-base spends minutes in it)")
    p.add_argument("--no-optimize", action="store_true", help="save the graph as traced, without the pass pipeline")
    from kiln.serializer.convert_cli import add_precision_args
    add_precision_args(p)
    p.add_argument("--no-guards", action="store_true",
                   help="leave no kiln.Guard where the model reads a Python value from tensor data (bool(t), "
                        "t.item(), a symbolic size compared in Python): the file then answers as the trace did "
                        "for every input, which is wrong for inputs that would change that value. Without it, "
                        "the file refuses such inputs with an error naming the line")
    p.add_argument("--script", action="store_true",
                   help="compile with kiln.script instead of kiln.trace: forward's source (and that of the user "
                        "submodules and helpers it calls) is rewritten so that if/for/while on tensor data become "
                        "If/Loop nodes instead of the one path the example inputs take; constructs outside the "
                        "subset are errors naming the line. Without it, parts marked with @kiln.script still keep "
                        "their control flow inside the trace")
    p.epilog = ("Give -o, --onnx or both: both files hold the same traced (or, with --script, scripted), checked "
                "and (unless --no-optimize) optimized graph. Progress goes to stderr, a line per step with its "
                "seconds; on a terminal the line is live (elapsed time, the check's input sets).")

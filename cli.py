"""The ``kiln`` command. Each sub-command imports what it needs only when it runs, so
``kiln --help`` stays fast and works with the core install alone.

Sub-commands are registered in ``COMMANDS`` (name -> (help, add_arguments, run)); later
stages add export, run, serve, ... the same way.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys
from typing import Callable, Optional, Sequence

from kiln.errors import run_command
from kiln.version import __version__

# Optional packages kiln can use, and what each enables.
OPTIONAL_BACKENDS = [
    ("torch", "torch", "frontend: trace/script PyTorch models"),
    ("onnx", "onnx", "ONNX import/export"),
    ("onnxruntime", "onnxruntime", "ONNX Runtime execution backend"),
    ("fastapi", "fastapi", "HTTP server"),
    ("uvicorn", "uvicorn", "HTTP server"),
    ("cupy", "cupy-cuda12x", "GPU runtime"),
    ("ml_dtypes", "ml_dtypes", "bfloat16 tensors"),
]


def _dist_version(module: str, dist: str) -> Optional[str]:
    if importlib.util.find_spec(module) is None:
        return None
    for name in (dist, module):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed"


def cmd_info(args: argparse.Namespace) -> int:
    import numpy as np

    from kiln.ir import IR_VERSION, ONNX_OPSET_BASE, OPSET_VERSION, all_schemas

    schemas = all_schemas()
    if args.ops:  # a pattern: the matching ops only, the answer to "does kiln have X?"
        return _print_ops(schemas, args.ops)
    print(f"kiln {__version__}")
    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"numpy {np.__version__}, flatbuffers {_dist_version('flatbuffers', 'flatbuffers') or 'missing'}")
    print(f"IR version {IR_VERSION}, opset {OPSET_VERSION} (ONNX-named ops follow ai.onnx opset {ONNX_OPSET_BASE})")
    print(f"registered ops: {len(schemas)}")
    from kiln.runtime.kernels.cpu import native
    if native.available():
        gemm = "its own AVX-512 sgemm for the products" if native.has_sgemm() else "numpy's BLAS for the products"
        threads = "a run's threads" if native.MAX_THREADS >= 64 else f"{native.MAX_THREADS} thread(s)"
        print(f"native CPU kernels: yes ({native._native.isa}; convolutions, Gelu, LayerNorm and Softmax rows, fused "
              f"elementwise chains; {gemm}; {threads} a convolution)")
    else:
        print(f"native CPU kernels: no ({native.UNAVAILABLE}; the numpy kernels run)")
    from kiln import blas_env
    from kiln.runtime import threads
    kernels = threads.blas_kernels()
    if kernels is not None:
        wanted = blas_env.wanted_coretype(blas_env.first_cpu())
        hint = (f"; this CPU runs OpenBLAS's {wanted} kernels, which OPENBLAS_CORETYPE={wanted} set before numpy "
                f"loads selects (kiln's import does, unless the variable is already set: it is "
                f"{os.environ.get('OPENBLAS_CORETYPE')!r} here)" if wanted and wanted != kernels else "")
        print(f"BLAS: OpenBLAS, {kernels} kernels, {threads.blas().default} thread(s){hint}")
    print("optional backends:")
    for module, dist, purpose in OPTIONAL_BACKENDS:
        ver = _dist_version(module, dist)
        state = f"yes ({ver})" if ver else "no"
        print(f"  {module:<12} {state:<22} {purpose}")
    if args.ops is not None:
        return _print_ops(schemas, args.ops)
    return 0


def _print_ops(schemas: list, pattern: str) -> int:
    """The registered ops by domain, with their inputs (``?`` optional, ``...`` variadic) and attributes;
    ``pattern`` keeps the ops whose name contains it (or matches it, with ``*``/``?``), case-insensitively.
    Error messages about an op kiln lacks point here rather than at a Python function."""
    import fnmatch

    def matches(s) -> bool:
        if not pattern:
            return True
        name = s.qualified_name.lower()
        if any(c in pattern for c in "*?["):
            return fnmatch.fnmatchcase(name, pattern.lower()) or fnmatch.fnmatchcase(s.name.lower(), pattern.lower())
        return pattern.lower() in name

    chosen = [s for s in schemas if matches(s)]
    if not chosen:
        import difflib
        names = {s.qualified_name.lower(): s.qualified_name for s in schemas}
        close = [names[n] for n in difflib.get_close_matches(pattern.lower(), list(names), n=3, cutoff=0.6)]
        print(f"no registered op matches '{pattern}'" + (f" (close: {', '.join(close)})" if close else ""))
        return 1
    domains: dict[str, list] = {}
    for s in chosen:
        domains.setdefault(s.domain or "ai.onnx", []).append(s)
    print(f"ops matching '{pattern}': {len(chosen)} of {len(schemas)}" if pattern else f"ops: {len(schemas)}")
    for domain, group in sorted(domains.items(), key=lambda kv: kv[0] != "ai.onnx"):
        print(f"domain {domain} ({len(group)} ops):")
        for s in group:
            ins = ", ".join(p.name + ("?" if p.optional else "") + ("..." if p.variadic else "") for p in s.inputs)
            attrs = ", ".join(s.attrs)
            print(f"  {s.qualified_name}({ins})" + (f" [{attrs}]" if attrs else ""))
    return 0


def _add_info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", nargs="?", const="", metavar="PATTERN",
                   help="also list the registered ops by domain (ai.onnx, kiln) with their inputs (? optional, "
                        "... variadic) and attributes; with PATTERN, only the ops whose name contains it (or "
                        "matches it, with * and ?), case-insensitively, e.g. --ops conv (exit 1 if none does)")


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from kiln.serializer.inspect import format_summary, inspect_file

    summary, graph = inspect_file(args.model, verify=args.verify)
    if args.json:
        if args.graph:
            summary["ir"] = str(graph)
        print(json.dumps(summary, indent=2))
        return 0
    text = format_summary(summary)
    if args.graph:
        text += "\n\n" + str(graph)
    print(text)
    return 0


def _add_inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the .kiln file")
    p.add_argument("--graph", action="store_true", help="also print the graph (IR) after the summary")
    p.add_argument("--json", action="store_true",
                   help="print the summary as JSON (with --graph, the printed IR is its 'ir' key)")
    p.add_argument("--verify", action="store_true",
                   help="checksum the whole data segment even when it is large "
                        "(by default only segments up to 16 MiB are checked, so big models load in constant time)")


def _lazy(module: str, name: str) -> Callable:
    """``module.name``, imported on the first call: each sub-command's arguments and runner live with its layer
    (export with the frontend, run with the runtime, ...), and ``kiln info`` imports none of them (nor torch)."""
    def call(arg):
        import importlib
        return getattr(importlib.import_module(module), name)(arg)
    call.__name__ = call.__qualname__ = f"{module}.{name}"
    return call


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {
    "info": ("print versions, IR/opset versions and which optional backends are installed",
             _add_info_args, cmd_info),
    "inspect": ("summarize a .kiln file: header, versions, producer, inputs/outputs, op histogram, parameters",
                _add_inspect_args, cmd_inspect),
    "view": ("draw a .kiln file's graph as one self-contained interactive HTML page (ops, shapes, module paths, "
             "fused groups, If/Loop bodies, weights, guards) that opens offline in any browser",
             _lazy("kiln.serializer.view", "add_view_args"), _lazy("kiln.serializer.view", "cmd_view")),
    "export": ("trace a PyTorch model on example inputs and write it as a .kiln file and/or an ONNX file",
               _lazy("kiln.frontend.export_cli", "add_export_args"),
               _lazy("kiln.frontend.export_cli", "cmd_export")),
    "convert": ("convert a .kiln file to ONNX or an ONNX file to .kiln (by the files' suffixes)",
                _lazy("kiln.serializer.convert_cli", "add_convert_args"),
                _lazy("kiln.serializer.convert_cli", "cmd_convert")),
    "run": ("run a .kiln or .onnx file on inputs from .npy/.npz/JSON; write outputs to .npz/.npy or print a "
            "summary (same as python -m kiln.runtime); --backend onnxruntime runs it in ONNX Runtime",
            _lazy("kiln.runtime.cli", "add_run_args"), _lazy("kiln.runtime.cli", "cmd_run")),
    "bench": ("time a .kiln or .onnx file on random inputs (median/p90), optionally per op with --profile or "
              "as a Chrome/Perfetto trace with --trace FILE.json; --backend onnxruntime times ONNX Runtime",
              _lazy("kiln.runtime.cli", "add_bench_args"), _lazy("kiln.runtime.cli", "cmd_bench")),
    "serve": ("serve a .kiln file or a model repository over HTTP (KServe/Triton V2 inference protocol) with "
              "dynamic batching, worker processes and Prometheus metrics", _lazy("kiln.server.cli", "add_serve_args"),
              _lazy("kiln.server.cli", "cmd_serve")),
    "deploy": ("write what it takes to run a model elsewhere: `kserve` (a ServingRuntime, an InferenceService, "
               "Dockerfiles and the model repository to upload) or `ray` (a Ray Serve config for serve deploy)",
               _lazy("kiln.server.deploy", "add_deploy_args"), _lazy("kiln.server.deploy", "cmd_deploy")),
    "mobile": ("the mobile path: `check` a model against the mobile op set, `pack` it ahead of time (static "
               "memory plan, optional int8 weights), `bundle` it into a numpy-only zipapp",
               _lazy("kiln.mobile_stub.cli", "add_mobile_args"), _lazy("kiln.mobile_stub.cli", "cmd_mobile")),
}


# Commands given a model file whose errors may end with a hint (a .onnx file kiln refuses: --backend onnxruntime).
_MODEL_FILE_COMMANDS = ("run", "bench", "serve", "convert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="Compile neural networks to .kiln files and run them without PyTorch.")
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    run = args._run
    if args.command in _MODEL_FILE_COMMANDS:
        from kiln.runtime.cli import with_hints
        run = with_hints(args.command, run)
    return run_command(args.command, run, args)


if __name__ == "__main__":
    sys.exit(main())

"""``kiln convert IN OUT``: a .kiln file to ONNX, or an ONNX file to .kiln, decided by the suffixes; with
``--precision fp16|bf16`` also a .kiln file to a half-precision .kiln file (issue 18).

Why a command of its own: ``kiln export`` starts from PyTorch, but a model may arrive as ONNX (from
any framework) and need compiling to .kiln for the runtime, or exist as .kiln and need ONNX for a
viewer, ONNX Runtime or TensorRT. The work is the serializers' (serializer/onnx.py exports,
serializer/onnx_import.py imports); this module checks the arguments before anything slow runs,
optimizes imported graphs as ``kiln export`` does, and prints one summary line.

onnx is optional (the ``onnx`` extra): it is imported when the command runs, never by ``kiln --help``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from kiln.errors import KilnError


def add_convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="IN", help="the model to read: a .kiln or .onnx file")
    p.add_argument("output", metavar="OUT", help="the file to write: .onnx for a .kiln input, .kiln for a .onnx input")
    p.add_argument("--opset", type=int, metavar="N",
                   help="(.kiln -> .onnx) the ai.onnx opset to write (default: the exporter's)")
    p.add_argument("--no-optimize", action="store_true",
                   help="(.onnx -> .kiln) save the graph as imported, without kiln's pass pipeline")
    add_precision_args(p)
    p.epilog = ("Converting between .kiln and .onnx needs the onnx package: pip install 'kiln-compiler[onnx]'. "
                "'kiln convert m.kiln m16.kiln --precision fp16' needs nothing more.")


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--precision``, ``--op-precision``, ``--half-io`` (kiln convert and kiln export)."""
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="store the model in half precision: weights cast once (the file about halves), "
                        "activations in half, a few ops kept in float32 (default fp32: as it is)")
    p.add_argument("--op-precision", action="append", default=[], metavar="OP=half|float32",
                   help="override the op policy for one op type (repeatable), e.g. Softmax=float32")
    p.add_argument("--half-io", action="store_true",
                   help="make the model's float32 inputs and outputs half too (default: they stay float32)")
    p.add_argument("--weights", choices=("int8",), default=None,
                   help="weight-only int8: store MatMul/Gemm weights as int8 with a scale per output channel "
                        "(about half an fp16 file's GEMM bytes; activations keep --precision)")


def check_precision_args(args: argparse.Namespace) -> None:
    """Refuse contradictory or malformed precision arguments before any slow step."""
    if args.precision == "fp32" and (args.op_precision or args.half_io):
        raise KilnError("--op-precision and --half-io go with --precision fp16 or bf16")
    from kiln.ir.passes.precision import parse_policy
    parse_policy(args.op_precision)


def apply_precision(graph, args: argparse.Namespace) -> str:
    """Convert ``graph`` as the precision arguments ask (then int8 weights with ``--weights int8``); returns a
    summary ('' for fp32 with float weights)."""
    weights = getattr(args, "weights", None)
    summary = ""
    if args.precision == "fp32":
        if args.op_precision or args.half_io:
            raise KilnError("--op-precision and --half-io go with --precision fp16 or bf16")
    else:
        from kiln.ir.passes.precision import convert_precision, parse_policy
        report = convert_precision(graph, args.precision, policy=parse_policy(args.op_precision),
                                   io="half" if args.half_io else "float32")
        summary = report.summary()
    if weights == "int8":
        from kiln.ir.passes.precision import quantize_gemm_weights
        summary = "; ".join(x for x in (summary, quantize_gemm_weights(graph)) if x)
    return summary


def cmd_convert(args: argparse.Namespace) -> int:
    src, dst = Path(args.input), Path(args.output)
    direction = (src.suffix.lower(), dst.suffix.lower())
    check_precision_args(args)
    half = args.precision != "fp32" or getattr(args, "weights", None) is not None
    allowed = ((".kiln", ".onnx"), (".onnx", ".kiln")) + (((".kiln", ".kiln"),) if half else ())
    if direction not in allowed:
        also = "" if half else ", or (with --precision fp16|bf16) a .kiln file into a half-precision .kiln file"
        raise KilnError(f"cannot convert {src} to {dst}: kiln convert turns a .kiln file into .onnx or a .onnx file "
                        f"into .kiln{also} (got '{src.suffix or 'no suffix'}' -> '{dst.suffix or 'no suffix'}')")
    to_onnx = direction[1] == ".onnx"
    if direction == (".kiln", ".kiln") and args.no_optimize:
        raise KilnError("--no-optimize applies to .onnx -> .kiln")
    if to_onnx and args.no_optimize:
        raise KilnError("--no-optimize applies to .onnx -> .kiln (a .kiln file is exported as it is stored)")
    if not to_onnx and args.opset is not None:
        raise KilnError("--opset applies to .kiln -> .onnx (an imported model keeps kiln's opset)")
    if not src.is_file():
        raise KilnError(f"no such file: {src}")
    folder = dst.resolve().parent
    if not folder.is_dir():
        raise KilnError(f"cannot write {dst}: the folder {folder} does not exist")
    if src.resolve() == dst.resolve():
        raise KilnError(f"{src}: the input and the output are the same file")
    if direction == (".kiln", ".kiln"):
        print(_kiln_to_kiln(src, dst, args))
    else:
        print(_to_onnx(src, dst, args.opset, args) if to_onnx else _to_kiln(src, dst, optimize=not args.no_optimize,
                                                                            args=args))
    return 0


def _kiln_to_kiln(src: Path, dst: Path, args: argparse.Namespace) -> str:
    from kiln.ir.passes import optimize as run_optimize
    from kiln.ir.verifier import verify
    from kiln.serializer import save
    from kiln.serializer.reader import load_graph

    graph = load_graph(src)
    summary = apply_precision(graph, args)
    run_optimize(graph)  # folds what the conversion made foldable (a Cast of a constant)
    verify(graph)
    try:
        save(graph, dst)
    except OSError as e:
        raise KilnError(f"cannot write {dst}: {e.strerror or e}") from None
    return f"wrote {dst} ({_size(dst)}, from {src}: {_size(src)}): {len(graph.nodes)} nodes; {summary}"


def _onnx_module(name: str):
    from kiln.errors import optional_module
    return optional_module(name, "kiln convert")


def _to_onnx(src: Path, dst: Path, opset, args: argparse.Namespace = None) -> str:
    from kiln.serializer.reader import load_graph

    graph = load_graph(src)
    summary = apply_precision(graph, args) if args is not None else ""
    try:
        _onnx_module("kiln.serializer.onnx").export_onnx(graph, dst, opset=opset)
    except OSError as e:
        raise KilnError(f"cannot write {dst}: {e.strerror or e}") from None
    return onnx_summary(dst) + f", from {src} ({len(graph.nodes)} nodes)" + (f"; {summary}" if summary else "")


def _to_kiln(src: Path, dst: Path, *, optimize: bool, args: argparse.Namespace = None) -> str:
    from kiln.ir.verifier import verify
    from kiln.serializer import save

    graph = _onnx_module("kiln.serializer.onnx_import").import_onnx(src)
    imported = len(graph.nodes)
    summary = apply_precision(graph, args) if args is not None else ""
    if optimize:
        from kiln.ir.passes import optimize as run_optimize
        run_optimize(graph)
        verify(graph)
    try:
        save(graph, dst)
    except OSError as e:
        raise KilnError(f"cannot write {dst}: {e.strerror or e}") from None
    return (f"wrote {dst} ({_size(dst)}): {len(graph.nodes)} nodes"
            + (f" ({imported} imported, optimized)" if optimize else " (not optimized)") + f", from {src}"
            + (f"; {summary}" if summary else ""))


def onnx_summary(path: os.PathLike | str) -> str:
    """``wrote m.onnx (1.23 MiB, 1,289,000 bytes): 57 nodes, opset 18``: what the file holds, read back
    without its external data (whose files the size then includes)."""
    onnx = _onnx_module("onnx")
    model = onnx.load_model(os.fspath(path), load_external_data=False)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    external = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    folder = Path(path).resolve().parent
    extra = sum((folder / f).stat().st_size for f in external if (folder / f).is_file())
    data = f" + {len(external)} external data file(s)" if external else ""
    return (f"wrote {path} ({_size(path, extra)}{data}): {len(model.graph.node)} nodes, "
            f"opset {opset if opset is not None else 'unknown'}")


def _size(path: os.PathLike | str, extra: int = 0) -> str:
    size = os.path.getsize(path) + extra
    return f"{size / 2 ** 20:.2f} MiB, {size:,} bytes"

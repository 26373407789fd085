"""``kiln convert IN OUT``: a .kiln file to ONNX, or an ONNX file to .kiln, decided by the suffixes.

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
    p.epilog = "Needs the onnx package: pip install kiln[onnx]."


def cmd_convert(args: argparse.Namespace) -> int:
    src, dst = Path(args.input), Path(args.output)
    direction = (src.suffix.lower(), dst.suffix.lower())
    if direction not in ((".kiln", ".onnx"), (".onnx", ".kiln")):
        raise KilnError(f"cannot convert {src} to {dst}: kiln convert turns a .kiln file into .onnx or a .onnx file "
                        f"into .kiln (got '{src.suffix or 'no suffix'}' -> '{dst.suffix or 'no suffix'}')")
    to_onnx = direction[1] == ".onnx"
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
    print(_to_onnx(src, dst, args.opset) if to_onnx else _to_kiln(src, dst, optimize=not args.no_optimize))
    return 0


def _onnx_module(name: str):
    from kiln.runtime.onnxruntime_backend import optional_module
    return optional_module(name, "kiln convert")


def _to_onnx(src: Path, dst: Path, opset) -> str:
    from kiln.serializer.reader import load_graph

    graph = load_graph(src)
    try:
        _onnx_module("kiln.serializer.onnx").export_onnx(graph, dst, opset=opset)
    except OSError as e:
        raise KilnError(f"cannot write {dst}: {e.strerror or e}") from None
    return onnx_summary(dst) + f", from {src} ({len(graph.nodes)} nodes)"


def _to_kiln(src: Path, dst: Path, *, optimize: bool) -> str:
    from kiln.ir.verifier import verify
    from kiln.serializer import save

    graph = _onnx_module("kiln.serializer.onnx_import").import_onnx(src)
    imported = len(graph.nodes)
    if optimize:
        from kiln.ir.passes import optimize as run_optimize
        run_optimize(graph)
        verify(graph)
    try:
        save(graph, dst)
    except OSError as e:
        raise KilnError(f"cannot write {dst}: {e.strerror or e}") from None
    return (f"wrote {dst} ({_size(dst)}): {len(graph.nodes)} nodes"
            + (f" ({imported} imported, optimized)" if optimize else " (not optimized)") + f", from {src}")


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

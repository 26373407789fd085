"""Crafted ONNX files that must each be refused with a kiln error (issue 16), kept in the repository.

Each :class:`Attack` writes one malicious model (and any side file it needs) into a folder and says
which error ``import_onnx`` (and so ``kiln convert``) must raise and what the message must name.
``tests/serializer/test_onnx_attacks.py`` runs every one in bounded time and memory; the same list
can be run by hand, with files kept for other tools (onnxruntime, netron) to be tried on:

    python -m kiln.serializer.onnx_attacks OUT_DIR          write every attack, import each, report

What is covered: tensor sizes that disagree with the data present (raw, typed fields, external),
negative and huge dims, sparse tensors (huge dense size, indices out of range or malformed), external
data locations (NUL byte, absolute, ``..``, symlink out, missing file, bad offset/length), element
types kiln lacks, empty and truncated files, graphs without outputs, undefined and duplicate names,
subgraph nesting past the .kiln limit, absurd opset versions and attribute type confusion.
``nested_ifs(depth)`` also builds the legitimate deep-If model the round-trip tests use.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import TensorProto as T, helper as h, numpy_helper

from kiln.errors import FormatError, KilnError, UnsupportedOpError

OPSET = 18


# ---------------------------------------------------------------------------- small builders
def _model(nodes, inputs, outputs, initializers=(), sparse=(), opset: int = OPSET) -> onnx.ModelProto:
    g = h.make_graph(list(nodes), "g", list(inputs), list(outputs), initializer=list(initializers),
                     sparse_initializer=list(sparse))
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def _vi(name: str, elem: int = T.FLOAT, shape=None):
    return h.make_tensor_value_info(name, elem, shape)


def _reads_w(initializers=(), sparse=(), **kw) -> onnx.ModelProto:
    """y = Identity(w): a model whose only content is the constant ``w`` under attack."""
    return _model([h.make_node("Identity", ["w"], ["y"])], [], [_vi("y")], initializers, sparse, **kw)


def _external(dims, location: str, **fields) -> T:
    t = T()
    t.name, t.data_type, t.data_location = "w", T.FLOAT, T.EXTERNAL
    t.dims.extend(dims)
    for k, v in {"location": location, **fields}.items():
        e = t.external_data.add()
        e.key, e.value = k, str(v)
    return t


def _sparse(dims, indices, values=None) -> "onnx.SparseTensorProto":
    indices = np.asarray(indices, np.int64)
    values = np.ones(len(indices), np.float32) if values is None else np.asarray(values, np.float32)
    return h.make_sparse_tensor(numpy_helper.from_array(values, "w"), numpy_helper.from_array(indices, "w_i"),
                                list(dims))


def _raw(dims, raw: bytes, dtype: int = T.FLOAT) -> T:
    t = T()
    t.name, t.data_type, t.raw_data = "w", dtype, raw
    t.dims.extend(dims)
    return t


def nested_ifs(depth: int) -> onnx.ModelProto:
    """A legitimate model with If bodies nested ``depth`` levels: ``y = If(cond)`` whose then branch
    holds the next If, down to ``depth`` levels; every else branch, and the innermost then branch,
    compute ``x + c`` with a constant of their own (so a wrong branch shows in the result: with
    ``cond`` true, y = x + 1; false, y = x + 2).

    Built top-down in place: protobuf's upb refuses to copy a message nested past its depth limit
    (100), which ``helper.make_attribute`` would do for about 32 levels and more."""
    if depth < 1:
        raise ValueError("depth must be >= 1")
    model = onnx.ModelProto()
    model.ir_version = onnx.IR_VERSION
    model.opset_import.add(domain="", version=OPSET)
    g = model.graph
    g.name = "nested"
    g.input.extend([_vi("cond", T.BOOL, []), _vi("x", T.FLOAT, [1])])
    out = "y"
    g.output.append(_vi(out, T.FLOAT, [1]))
    for level in range(1, depth + 1):
        node = g.node.add(op_type="If", input=["cond"], output=[out], name=f"if_{level}")
        then = node.attribute.add(name="then_branch", type=onnx.AttributeProto.GRAPH).g
        other = node.attribute.add(name="else_branch", type=onnx.AttributeProto.GRAPH).g
        then.name, other.name = f"then_{level}", f"else_{level}"
        _leaf(other, f"ye{level}", 2.0)
        other.output.append(_vi(f"ye{level}", T.FLOAT, [1]))
        g, out = then, f"y{level}"
        g.output.append(_vi(out, T.FLOAT, [1]))
    _leaf(g, out, 1.0)
    return model


def _leaf(g, out: str, c: float) -> None:
    """Add ``out = x + c`` to branch body ``g``."""
    g.initializer.append(numpy_helper.from_array(np.array([c], np.float32), f"c_{out}"))
    g.node.add(op_type="Add", input=["x", f"c_{out}"], output=[out])


# ---------------------------------------------------------------------------- the attacks
@dataclass(frozen=True)
class Attack:
    name: str
    build: Callable[[Path], object]  # (folder) -> ModelProto or bytes; side files go in the folder
    error: type  # the kiln error import_onnx must raise
    match: str  # a regex its message must match (the field named)

    def write(self, folder: Path) -> Path:
        """Write the model as ``folder/<name>.onnx`` (side files next to it); returns its path."""
        folder.mkdir(parents=True, exist_ok=True)
        model = self.build(folder)
        data = model if isinstance(model, bytes) else model.SerializeToString()
        path = folder / f"{self.name}.onnx"
        path.write_bytes(data)
        return path


def _w_bin(folder: Path, nbytes: int = 16) -> None:
    (folder / "w.bin").write_bytes(b"\0" * nbytes)


def _outside(folder: Path) -> str:
    """A file outside ``folder`` (its parent's secret.bin) for traversal attacks."""
    secret = folder.parent / "secret.bin"
    secret.write_bytes(b"\x01" * 16)
    return str(secret)


def _symlink_out(folder: Path):
    link = folder / "link.bin"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(_outside(folder))
    return _reads_w([_external([4], "link.bin")])


def _type_confusion(folder: Path):
    node = h.make_node("Transpose", ["x"], ["y"])
    node.attribute.append(h.make_attribute("perm", 1.5))  # FLOAT where INTS belongs
    return _model([node], [_vi("x", T.FLOAT, [2, 3])], [_vi("y")])


def _graph_attr_on_relu(folder: Path):
    node = h.make_node("LeakyRelu", ["x"], ["y"])
    node.attribute.append(h.make_attribute("alpha", h.make_graph([], "empty", [], [])))
    return _model([node], [_vi("x", T.FLOAT, [2])], [_vi("y")])


def _huge_axis(folder: Path):
    return _model([h.make_node("Concat", ["x", "x"], ["y"], axis=2 ** 62)], [_vi("x", T.FLOAT, [2])], [_vi("y")])


def _cycle(folder: Path):
    return _model([h.make_node("Relu", ["b"], ["a"]), h.make_node("Relu", ["a"], ["b"])],
                  [_vi("x", T.FLOAT, [2])], [_vi("b")])


def _duplicate(folder: Path):
    return _model([h.make_node("Relu", ["x"], ["y"]), h.make_node("Neg", ["x"], ["y"])],
                  [_vi("x", T.FLOAT, [2])], [_vi("y")])


def _string_input(folder: Path):
    return _model([h.make_node("Identity", ["x"], ["y"])], [_vi("x", T.STRING, [2])], [_vi("y", T.STRING)])


def _sequence_input(folder: Path):
    seq = h.make_tensor_sequence_value_info("x", T.FLOAT, [2])
    return _model([h.make_node("Identity", ["x"], ["y"])], [seq], [_vi("y")])


def _constant_sparse_oob(folder: Path):
    node = h.make_node("Constant", [], ["y"], sparse_value=_sparse([4], [9]))
    return _model([node], [], [_vi("y")])


def _tensor_attr_huge(folder: Path):
    t = T()
    t.name, t.data_type = "v", T.FLOAT
    t.dims.extend([1 << 30, 1 << 30])
    t.float_data.append(1.0)
    return _model([h.make_node("Constant", [], ["y"], value=t)], [], [_vi("y")])


def _truncated(folder: Path) -> bytes:
    data = nested_ifs(3).SerializeToString()
    return data[: len(data) // 2]


ATTACKS: list[Attack] = [
    # tensor data vs declared dims
    Attack("ext_dims_negative", lambda f: (_w_bin(f), _reads_w([_external([-2, -2], "w.bin")]))[1],
           FormatError, r"dims\[0\] is -2"),
    Attack("ext_dims_huge", lambda f: (_w_bin(f), _reads_w([_external([1 << 20, 1 << 20], "w.bin")]))[1],
           FormatError, r"external data holds 16 bytes.* needs 4398046511104"),
    Attack("ext_dims_overflow", lambda f: (_w_bin(f), _reads_w([_external([1 << 40, 1 << 40], "w.bin")]))[1],
           FormatError, r"too large for any array"),
    Attack("ext_length_mismatch", lambda f: (_w_bin(f), _reads_w([_external([8], "w.bin")]))[1],
           FormatError, r"holds 16 bytes.*needs 32"),
    Attack("ext_offset_past_end", lambda f: (_w_bin(f), _reads_w([_external([4], "w.bin", offset=1 << 40)]))[1],
           FormatError, r"lies outside"),
    Attack("ext_offset_negative", lambda f: (_w_bin(f), _reads_w([_external([4], "w.bin", offset=-16)]))[1],
           FormatError, r"lies outside"),
    Attack("ext_offset_not_int", lambda f: (_w_bin(f), _reads_w([_external([4], "w.bin", offset="1e3")]))[1],
           FormatError, r"offset/length must be integers"),
    Attack("ext_no_location", lambda f: _reads_w([_no_location()]),
           FormatError, r"without a 'location'"),
    # external data locations
    Attack("ext_location_nul", lambda f: (_w_bin(f), _reads_w([_external([4], "w.bin\0")]))[1],
           FormatError, r"control character"),
    Attack("ext_location_absolute", lambda f: _reads_w([_external([4], _outside(f))]),
           FormatError, r"must be a relative path"),
    Attack("ext_location_dotdot", lambda f: (_outside(f), _reads_w([_external([4], "../secret.bin")]))[1],
           FormatError, r"leaves the model's folder"),
    Attack("ext_location_dotdot_backslash", lambda f: (_outside(f), _reads_w([_external([4], "..\\secret.bin")]))[1],
           FormatError, r"leaves the model's folder"),
    Attack("ext_location_symlink_out", _symlink_out, FormatError, r"outside the model's folder"),
    Attack("ext_location_missing", lambda f: _reads_w([_external([4], "nowhere.bin")]),
           FormatError, r"does not exist"),
    Attack("ext_location_folder", lambda f: ((f / "sub").mkdir(exist_ok=True), _reads_w([_external([4], "sub")]))[1],
           FormatError, r"does not exist"),
    Attack("ext_location_long", lambda f: _reads_w([_external([4], "a" * 100_000)]),
           FormatError, r"characters long"),
    # inline data
    Attack("raw_size_mismatch", lambda f: _reads_w([_raw([1000, 1000], b"\0" * 4)]),
           FormatError, r"raw_data holds 4 bytes"),
    Attack("raw_dims_negative", lambda f: _reads_w([_raw([-4], b"\0" * 16)]), FormatError, r"dims\[0\] is -4"),
    Attack("raw_dims_overflow", lambda f: _reads_w([_raw([1 << 62, 1 << 62, 0], b"")]),
           FormatError, r"too large for any array"),  # 0 elements, but no array can have that shape
    Attack("typed_count_mismatch", lambda f: _reads_w([_typed_huge()]), FormatError, r"float_data holds 1 values"),
    Attack("typed_wrong_field", lambda f: _reads_w([_typed_wrong_field()]), FormatError, r"int64_data is set"),
    Attack("unknown_element_type", lambda f: _reads_w([_raw([1], b"\0" * 4, dtype=99)]),
           UnsupportedOpError, r"element type 99"),
    Attack("string_initializer", lambda f: _reads_w([h.make_tensor("w", T.STRING, [1], [b"x"])]),
           UnsupportedOpError, r"element type STRING"),
    Attack("tensor_attribute_huge", _tensor_attr_huge, FormatError, r"float_data holds 1 values"),
    # sparse tensors
    Attack("sparse_dims_huge", lambda f: _reads_w(sparse=[_sparse([1 << 31], [0])]),
           FormatError, r"dense float32 tensor of 8,589,934,592 bytes"),
    Attack("sparse_dims_negative", lambda f: _reads_w(sparse=[_sparse([-4], [0])]), FormatError, r"dims\[0\] is -4"),
    Attack("sparse_index_out_of_range", lambda f: _reads_w(sparse=[_sparse([4], [7])]),
           FormatError, r"outside \[0, 4\)"),
    Attack("sparse_index_negative", lambda f: _reads_w(sparse=[_sparse([4], [-1])]), FormatError, r"outside"),
    Attack("sparse_coo_out_of_range", lambda f: _reads_w(sparse=[_sparse([2, 2], [[0, 5]])]),
           FormatError, r"outside dims \[2, 2\]"),
    Attack("sparse_indices_count", lambda f: _reads_w(sparse=[_sparse([8], [0, 1, 2], [1.0])]),
           FormatError, r"do not fit 1 values"),
    Attack("sparse_indices_float", lambda f: _reads_w(sparse=[_sparse_float_indices()]),
           FormatError, r"indices must be int64"),
    Attack("constant_sparse_out_of_range", _constant_sparse_oob, FormatError, r"outside \[0, 4\)"),
    # files and graphs
    Attack("empty_file", lambda f: b"", FormatError, r"empty \(0 bytes\)"),
    Attack("garbage", lambda f: b"\xff" * 64, FormatError, r"not a valid ONNX model"),
    Attack("truncated", _truncated, FormatError, r"not a valid ONNX model"),
    Attack("no_outputs", lambda f: _model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", T.FLOAT, [2])], []),
           FormatError, r"has no outputs"),
    Attack("undefined_output", lambda f: _model([], [_vi("x", T.FLOAT, [2])], [_vi("nowhere")]),
           FormatError, r"'nowhere' .* not defined"),
    Attack("cycle", _cycle, FormatError, r"not defined before it"),
    Attack("duplicate_definition", _duplicate, FormatError, r"defined (twice|more than once)"),
    # proto: kiln's own limit; file: protobuf's parser (7 names its depth limit; 6, which tritonclient[grpc] pins,
    # reports only that the message did not parse).
    Attack("nesting_too_deep", lambda f: nested_ifs(40), FormatError,
           r"nested 33 levels deep|Exceeded upb_DecodeOptions_MaxDepth|Error parsing message with type 'onnx.ModelProto'"),
    Attack("opset_huge", lambda f: _model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", T.FLOAT, [2])], [_vi("y")],
                                          opset=1 << 40), FormatError, r"opset_import .* version"),
    Attack("opset_negative", lambda f: _model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", T.FLOAT, [2])],
                                              [_vi("y")], opset=-3), FormatError, r"opset_import .* version"),
    Attack("string_input", _string_input, UnsupportedOpError, r"element type STRING"),
    Attack("sequence_input", _sequence_input, UnsupportedOpError, r"ONNX type sequence"),
    Attack("unknown_op", lambda f: _model([h.make_node("Frobnicate", ["x"], ["y"])], [_vi("x", T.FLOAT, [2])],
                                          [_vi("y")]), UnsupportedOpError, r"Frobnicate"),
    Attack("attribute_type_confusion", _type_confusion, KilnError, r"perm"),
    Attack("graph_attribute_on_relu", _graph_attr_on_relu, KilnError, r"alpha"),
    Attack("huge_axis", _huge_axis, KilnError, r"axis"),
]


def _no_location() -> T:
    t = _external([4], "w.bin")
    del t.external_data[0]
    return t


def _typed_huge() -> T:
    t = T()
    t.name, t.data_type = "w", T.FLOAT
    t.dims.extend([1 << 30, 1 << 30])
    t.float_data.append(1.0)
    return t


def _typed_wrong_field() -> T:
    t = T()
    t.name, t.data_type = "w", T.FLOAT
    t.dims.append(1)
    t.float_data.append(1.0)
    t.int64_data.append(7)
    return t


def _sparse_float_indices():
    return h.make_sparse_tensor(numpy_helper.from_array(np.ones(1, np.float32), "w"),
                                numpy_helper.from_array(np.zeros(1, np.float32), "w_i"), [4])


BY_NAME = {a.name: a for a in ATTACKS}


def run_attack(attack: Attack, folder: Path) -> Optional[BaseException]:
    """Write and import one attack; returns what import_onnx raised (None if it imported)."""
    from kiln.serializer.onnx_import import import_onnx

    path = attack.write(folder)
    try:
        import_onnx(path)
    except BaseException as e:  # noqa: BLE001 - the caller judges it
        return e
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.serializer.onnx_attacks",
                                description="Write every crafted ONNX file and import it; report each outcome.")
    p.add_argument("out", help="folder to write the attack files into (kept)")
    args = p.parse_args(argv)
    folder = Path(args.out)
    bad = 0
    for a in ATTACKS:
        start = time.perf_counter()
        err = run_attack(a, folder / a.name)
        ms = (time.perf_counter() - start) * 1e3
        ok = (err is None) if a.error is None else isinstance(err, a.error)
        bad += not ok
        what = "imported" if err is None else f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        print(f"{'ok ' if ok else 'BAD'} {a.name:32s} {ms:7.1f} ms  {what}")
    print(f"{len(ATTACKS)} attacks, {bad} not refused as expected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

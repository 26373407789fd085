"""Hand-made malicious .kiln files (issue 16): the loader's attack corpus, kept with the fuzzer.

Each file is written straight from a small description (values, nodes, attributes, subgraphs)
by a bare FlatBuffer encoder, not through ``kiln.save``: the writer refuses most of these shapes
(too deep, wrong attribute kinds, unknown ops), and it costs ~0.1 ms a node, where a million-node
file here takes seconds. Checksums are valid, so every file reaches the structural checks, the
decoder and the verifier -- where the bugs would be.

``ATTACKS`` maps a name to ``(builder, expectation)``; the expectation says what the loader must
do with the default limits: ``"reject"`` (FormatError from ``kiln.load_graph``), ``"load"`` (the
graph loads), ``"refuse_run"`` (loads, but ``kiln.load(..., memory_budget=)`` refuses it with
ResourceError) or ``"run_error"`` (loads; a run fails with a kiln error, never a crash). Sizes
are parameters, so the tests use small ones and ``bench/load_scaling.py`` the issue's.

    python -m kiln.serializer.attack_files OUT_DIR [--scale small|issue]   # writes every file
"""
from __future__ import annotations

import argparse
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import flatbuffers
import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.versions import IR_VERSION, OPSET_VERSION
from kiln.serializer.fb import (Attribute, Graph as FbGraph, Initializer, Model, Node as FbNode, TensorData,
                                TensorType as FbTensorType, ValueInfo)
from kiln.serializer.format import (FILE_IDENTIFIER, HEADER_SIZE, SEGMENT_ALIGNMENT, TENSOR_ALIGNMENT, Header,
                                    align)

# Attribute kind codes of kiln.fbs (serializer/fb/AttrKind.py).
from kiln.serializer.fb.AttrKind import AttrKind as K

_SYMBOLIC = -2


@dataclass
class N:
    """A node: op, input and output value indices, attributes ``(name, kind code, payload)``
    (payload: int, float, str, list of ints, or a ``G`` for a graph attribute)."""

    op: str
    inputs: Sequence[int]
    outputs: Sequence[int]
    attrs: Sequence[tuple] = ()
    name: str = ""
    domain: str = ""


@dataclass
class G:
    name: str
    inputs: Sequence[int]
    outputs: Sequence[int]
    nodes: Sequence[N] = ()
    initializers: Sequence[tuple] = ()  # (value index, np.ndarray)


@dataclass
class Spec:
    """A whole file: value descriptions ``(name, dtype code, shape)`` (shape None: unknown rank;
    str dims are symbols) and the main graph."""

    values: list
    graph: G
    opset: int = OPSET_VERSION
    doc: str = ""
    arrays: list = field(default_factory=list)


class _Encoder:
    def __init__(self, size_hint: int = 1 << 16):
        self.b = flatbuffers.Builder(size_hint)
        self.strings: dict = {}
        self.data = bytearray()

    def string(self, s: str, share: bool = True) -> int:
        if not share:
            return self.b.CreateString(s)
        off = self.strings.get(s)
        if off is None:
            off = self.strings[s] = self.b.CreateString(s)
        return off

    def ints(self, values, dtype) -> int:
        return self.b.CreateNumpyVector(np.asarray(list(values), dtype=dtype))

    def tables(self, offsets: list) -> int:
        b = self.b
        b.StartVector(4, len(offsets), 4)
        for off in reversed(offsets):
            b.PrependUOffsetTRelative(off)
        return b.EndVector()

    def tensor_data(self, arr: np.ndarray) -> int:
        arr = np.ascontiguousarray(arr)
        offset = align(len(self.data), TENSOR_ALIGNMENT)
        self.data.extend(b"\0" * (offset - len(self.data)))
        self.data.extend(arr.astype(arr.dtype.newbyteorder("<")).tobytes())
        shape = self.ints(arr.shape, np.int64)
        TensorData.Start(self.b)
        TensorData.AddDtype(self.b, _dtype_code(arr.dtype))
        TensorData.AddShape(self.b, shape)
        TensorData.AddOffset(self.b, offset)
        TensorData.AddNbytes(self.b, arr.nbytes)
        return TensorData.End(self.b)

    def attribute(self, name: str, kind: int, payload) -> int:
        b = self.b
        name_off = self.string(name)
        ref = None
        if kind == K.STRING:
            ref = self.string(payload)
        elif kind in (K.INTS, K.FLOATS):
            ref = self.ints(payload, np.int64 if kind == K.INTS else np.float64)
        elif kind == K.STRINGS:
            ref = self.tables([self.string(s) for s in payload])
        elif kind == K.TENSOR:
            ref = self.tensor_data(payload)
        elif kind == K.GRAPH:
            ref = self.graph(payload)
        Attribute.Start(b)
        Attribute.AddName(b, name_off)
        Attribute.AddKind(b, kind)
        if kind == K.INT:
            Attribute.AddI(b, payload)
        elif kind == K.FLOAT:
            Attribute.AddF(b, payload)
        elif kind == K.STRING:
            Attribute.AddS(b, ref)
        elif kind == K.INTS:
            Attribute.AddInts(b, ref)
        elif kind == K.FLOATS:
            Attribute.AddFloats(b, ref)
        elif kind == K.STRINGS:
            Attribute.AddStrings(b, ref)
        elif kind == K.TENSOR:
            Attribute.AddTensor(b, ref)
        elif kind == K.GRAPH:
            Attribute.AddGraph(b, ref)
        return Attribute.End(b)

    def node(self, n: N) -> int:
        b = self.b
        attrs = self.tables([self.attribute(*a) for a in n.attrs]) if n.attrs else None
        op, domain = self.string(n.op), self.string(n.domain)
        name = self.string(n.name, share=False) if n.name else None
        inputs, outputs = self.ints(n.inputs, np.int32), self.ints(n.outputs, np.int32)
        FbNode.Start(b)
        FbNode.AddOp(b, op)
        FbNode.AddDomain(b, domain)
        if name is not None:
            FbNode.AddName(b, name)
        FbNode.AddInputs(b, inputs)
        FbNode.AddOutputs(b, outputs)
        if attrs is not None:
            FbNode.AddAttributes(b, attrs)
        return FbNode.End(b)

    def graph(self, g: G) -> int:
        b = self.b
        inits = []
        for vi, arr in g.initializers:
            data = self.tensor_data(arr)
            Initializer.Start(b)
            Initializer.AddValue(b, vi)
            Initializer.AddData(b, data)
            inits.append(Initializer.End(b))
        inits_vec = self.tables(inits)
        nodes_vec = self.tables([self.node(n) for n in g.nodes])
        name = self.string(g.name)
        inputs, outputs = self.ints(g.inputs, np.int32), self.ints(g.outputs, np.int32)
        FbGraph.Start(b)
        FbGraph.AddName(b, name)
        FbGraph.AddInputs(b, inputs)
        FbGraph.AddOutputs(b, outputs)
        FbGraph.AddInitializers(b, inits_vec)
        FbGraph.AddNodes(b, nodes_vec)
        return FbGraph.End(b)

    def tensor_type(self, dtype: int, shape) -> int:
        b = self.b
        if shape is None:
            FbTensorType.Start(b)
            FbTensorType.AddDtype(b, dtype)
            FbTensorType.AddUnknownRank(b, True)
            return FbTensorType.End(b)
        symbols = [d for d in shape if isinstance(d, str)]
        sym = self.tables([self.string(s) for s in symbols]) if symbols else None
        dims = self.ints([_SYMBOLIC if isinstance(d, str) else -1 if d is None else d for d in shape], np.int64)
        FbTensorType.Start(b)
        FbTensorType.AddDtype(b, dtype)
        FbTensorType.AddShape(b, dims)
        if sym is not None:
            FbTensorType.AddSymbols(b, sym)
        return FbTensorType.End(b)

    def model(self, spec: Spec) -> bytes:
        b = self.b
        root = self.graph(spec.graph)
        types: dict = {}
        infos = []
        for name, dtype, shape in spec.values:
            key = (dtype, None if shape is None else tuple(shape))
            if key not in types:  # one TensorType table per distinct type, shared (legal FlatBuffers)
                types[key] = self.tensor_type(dtype, shape)
            name_off = self.string(name, share=False)
            ValueInfo.Start(b)
            ValueInfo.AddName(b, name_off)
            ValueInfo.AddType(b, types[key])
            infos.append(ValueInfo.End(b))
        values = self.tables(infos)
        pname, doc = self.string("kiln.serializer.attack_files"), self.string(spec.doc)
        Model.Start(b)
        Model.AddIrVersion(b, IR_VERSION)
        Model.AddOpsetVersion(b, spec.opset)
        Model.AddProducerName(b, pname)
        Model.AddDocString(b, doc)
        Model.AddValues(b, values)
        Model.AddGraph(b, root)
        b.Finish(Model.End(b), file_identifier=FILE_IDENTIFIER)
        return bytes(b.Output())


def _dtype_code(dt: np.dtype) -> int:
    for d in DType:
        try:
            if np.dtype(d.numpy) == dt:
                return d.value
        except Exception:  # noqa: BLE001 - dtypes numpy lacks
            continue
    raise ValueError(f"no kiln dtype for {dt}")


def encode(spec: Spec) -> bytes:
    """The bytes of a .kiln file for ``spec``, with valid checksums."""
    enc = _Encoder()
    fb = enc.model(spec)
    data = bytes(enc.data)
    d_off = align(HEADER_SIZE + len(fb), SEGMENT_ALIGNMENT)
    header = Header(HEADER_SIZE, len(fb), d_off, len(data), zlib.crc32(fb), zlib.crc32(data)).pack()
    return header + fb + b"\0" * (d_off - HEADER_SIZE - len(fb)) + data


F32, I64, BOOL = DType.FLOAT32.value, DType.INT64.value, DType.BOOL.value


# --------------------------------------------------------------------------- the attacks

def chain(n: int) -> bytes:
    """A chain of ``n`` Relu nodes (the issue's million-node chain: 38.7 s, 2.3 GB before)."""
    values = [("x", F32, [4])] + [(f"v{i}", F32, [4]) for i in range(n)]
    nodes = [N("Relu", [i], [i + 1], name=f"relu{i}") for i in range(n)]
    return encode(Spec(values, G("main", [0], [n], nodes)))


def readers(n: int) -> bytes:
    """``n`` nodes reading one value (the issue's 80k readers: 60 s; at 1M, > 300 s)."""
    values = [("x", F32, [4])] + [(f"v{i}", F32, [4]) for i in range(n)]
    nodes = [N("Relu", [0], [i + 1], name=f"relu{i}") for i in range(n)]
    return encode(Spec(values, G("main", [0], [n], nodes)))


def many_uses(n: int) -> bytes:
    """One Sum listing the same input ``n`` times (10k..80k: 1.95..115.8 s before)."""
    values = [("x", F32, [4]), ("y", F32, [4])]
    return encode(Spec(values, G("main", [0], [1], [N("Sum", [0] * n, [1], name="sum")])))


def deep_nesting(depth: int) -> bytes:
    """If bodies nested ``depth`` deep (each then-branch holds the next If)."""
    values = [("c", BOOL, []), ("x", F32, [4])]

    def level(d: int) -> G:
        out = len(values)
        values.append((f"o{d}", F32, [4]))
        if d == depth:
            return G(f"b{d}", [], [out], [N("Identity", [1], [out], name=f"id{d}")])
        inner, other = level(d + 1), len(values)
        values.append((f"e{d}", F32, [4]))
        else_g = G(f"e{d}", [], [other], [N("Identity", [1], [other], name=f"eid{d}")])
        return G(f"b{d}", [], [out], [N("If", [0], [out], [("else_branch", K.GRAPH, else_g),
                                                          ("then_branch", K.GRAPH, inner)], name=f"if{d}")])
    top = level(0)
    return encode(Spec(values, G("main", [0, 1], top.outputs, top.nodes)))


def cycle() -> bytes:
    """Two nodes reading each other's outputs (no topological order)."""
    values = [("x", F32, [4]), ("a", F32, [4]), ("b", F32, [4])]
    nodes = [N("Add", [0, 2], [1], name="n1"), N("Add", [0, 1], [2], name="n2")]
    return encode(Spec(values, G("main", [0], [2], nodes)))


def self_loop() -> bytes:
    values = [("x", F32, [4]), ("a", F32, [4])]
    return encode(Spec(values, G("main", [0], [1], [N("Add", [0, 1], [1], name="n1")])))


def huge_shape() -> bytes:
    """Values declared with 2^40 elements (4 TiB each): loads, but no run fits a memory budget."""
    values = [("x", F32, [1 << 40]), ("y", F32, [1 << 40])]
    return encode(Spec(values, G("main", [0], [1], [N("Relu", [0], [1], name="r")])))


def inconsistent_huge_type() -> bytes:
    """An output typed [2^62, 2^62] that inference says is [4]."""
    values = [("x", F32, [4]), ("y", F32, [1 << 62, 1 << 62])]
    return encode(Spec(values, G("main", [0], [1], [N("Relu", [0], [1], name="r")])))


def huge_initializer_claim() -> bytes:
    """An initializer whose data claims 2^61 float32 elements in a 64-byte segment: the decoder
    must compare the claimed size with the bytes present before touching anything."""
    enc = _Encoder()
    b = enc.b
    shape = enc.ints([1 << 61], np.int64)
    TensorData.Start(b)
    TensorData.AddDtype(b, F32)
    TensorData.AddShape(b, shape)
    TensorData.AddOffset(b, 0)
    TensorData.AddNbytes(b, 16)
    td = TensorData.End(b)
    Initializer.Start(b)
    Initializer.AddValue(b, 0)
    Initializer.AddData(b, td)
    init = Initializer.End(b)
    inits = enc.tables([init])
    nodes = enc.tables([])
    name = enc.string("main")
    ins, outs = enc.ints([], np.int32), enc.ints([0], np.int32)
    FbGraph.Start(b)
    FbGraph.AddName(b, name)
    FbGraph.AddInputs(b, ins)
    FbGraph.AddOutputs(b, outs)
    FbGraph.AddInitializers(b, inits)
    FbGraph.AddNodes(b, nodes)
    root = FbGraph.End(b)
    tt = enc.tensor_type(F32, [1 << 61])
    vname = enc.string("w")
    ValueInfo.Start(b)
    ValueInfo.AddName(b, vname)
    ValueInfo.AddType(b, tt)
    vals = enc.tables([ValueInfo.End(b)])
    Model.Start(b)
    Model.AddIrVersion(b, IR_VERSION)
    Model.AddOpsetVersion(b, OPSET_VERSION)
    Model.AddValues(b, vals)
    Model.AddGraph(b, root)
    b.Finish(Model.End(b), file_identifier=FILE_IDENTIFIER)
    fb = bytes(b.Output())
    data = b"\0" * 64
    d_off = align(HEADER_SIZE + len(fb), SEGMENT_ALIGNMENT)
    header = Header(HEADER_SIZE, len(fb), d_off, len(data), zlib.crc32(fb), zlib.crc32(data)).pack()
    return header + fb + b"\0" * (d_off - HEADER_SIZE - len(fb)) + data


def attr_type_confusion() -> bytes:
    """Transpose's ``perm`` (ints) stored as a string."""
    values = [("x", F32, [2, 3]), ("y", F32, [3, 2])]
    return encode(Spec(values, G("main", [0], [1], [N("Transpose", [0], [1], [("perm", K.STRING, "1,0")], "t")])))


def attr_int_for_graph() -> bytes:
    """An If whose then_branch is an int."""
    values = [("c", BOOL, []), ("y", F32, [4])]
    return encode(Spec(values, G("main", [0], [1], [N("If", [0], [1], [("then_branch", K.INT, 7),
                                                                       ("else_branch", K.INT, 8)], "if")])))


def unknown_attr() -> bytes:
    values = [("x", F32, [4]), ("y", F32, [4])]
    return encode(Spec(values, G("main", [0], [1], [N("Relu", [0], [1], [("gain", K.FLOAT, 2.0)], "r")])))


def unknown_op() -> bytes:
    values = [("x", F32, [4]), ("y", F32, [4])]
    return encode(Spec(values, G("main", [0], [1], [N("os.system", [0], [1], name="evil")])))


def unknown_domain() -> bytes:
    values = [("x", F32, [4]), ("y", F32, [4])]
    return encode(Spec(values, G("main", [0], [1], [N("Relu", [0], [1], name="r", domain="com.evil")])))


def reshape_2d_shape() -> bytes:
    """Reshape whose constant shape is 2-D ``[[2, 2]]`` (kiln.load raised TypeError before)."""
    values = [("x", F32, [4]), ("s", I64, [1, 2]), ("y", F32, [2, 2])]
    return encode(Spec(values, G("main", [0], [2], [N("Reshape", [0, 1], [2], name="reshape")],
                               initializers=[(1, np.array([[2, 2]], np.int64))])))


def expand_2d_shape() -> bytes:
    values = [("x", F32, [1]), ("s", I64, [1, 1]), ("y", F32, None)]
    return encode(Spec(values, G("main", [0], [2], [N("Expand", [0, 1], [2], name="expand")],
                               initializers=[(1, np.array([[4]], np.int64))])))


def axes_out_of_range() -> bytes:
    """Softmax over axis 7 of a 2-D tensor, Transpose with a perm naming axis 5."""
    values = [("x", F32, [2, 3]), ("y", F32, [2, 3]), ("z", F32, [3, 2])]
    nodes = [N("Softmax", [0], [1], [("axis", K.INT, 7)], "sm"),
             N("Transpose", [1], [2], [("perm", K.INTS, [5, 0])], "t")]
    return encode(Spec(values, G("main", [0], [2], nodes)))


def gather_blowup(rows: int = 1 << 16) -> bytes:
    """A small file whose Gather makes a huge output: ``x[batch, 65536]`` float32 gathered with a
    constant index vector of ``rows`` entries -> [rows, 65536] (2^16 rows: 16 GiB) per request."""
    values = [("x", F32, ["batch", 1 << 16]), ("i", I64, [rows]), ("y", F32, [rows, 1 << 16])]
    return encode(Spec(values, G("main", [0], [2], [N("Gather", [0, 1], [2], [("axis", K.INT, 0)], "g")],
                               initializers=[(1, np.zeros(rows, np.int64))])))


def gather_blowup_per_request(rows: int = 1 << 16) -> bytes:
    """The same index vector gathered along axis 1 of ``x[batch, 64]``: [batch, rows] float32, a
    size only a request's batch decides (2^16 rows: 256 KiB a row, 16 GiB at batch 65,536)."""
    values = [("x", F32, ["batch", 64]), ("i", I64, [rows]), ("y", F32, ["batch", rows])]
    return encode(Spec(values, G("main", [0], [2], [N("Gather", [0, 1], [2], [("axis", K.INT, 1)], "g")],
                               initializers=[(1, np.zeros(rows, np.int64))])))


def many_values_declared(n: int) -> bytes:
    """``n`` value descriptions, none of them used."""
    values = [("x", F32, [4])] + [(f"u{i}", F32, [4]) for i in range(n)]
    return encode(Spec(values, G("main", [0], [0])))


def duplicate_names(n: int = 3) -> bytes:
    values = [("x", F32, [4])] + [("same", F32, [4]) for _ in range(n)]
    nodes = [N("Relu", [0], [i + 1], name=f"r{i}") for i in range(n)]
    return encode(Spec(values, G("main", [0], [n], nodes)))


def wide_fan_in_subgraphs(n: int) -> bytes:
    """``n`` If nodes, each with two one-node bodies, after ``n`` values: a scope copied per
    subgraph would make verification quadratic."""
    values = [("c", BOOL, []), ("x", F32, [4])]
    nodes = []
    h = 1
    for i in range(n):
        t, e, out = len(values), len(values) + 1, len(values) + 2
        values += [(f"t{i}", F32, [4]), (f"e{i}", F32, [4]), (f"o{i}", F32, [4])]
        nodes.append(N("If", [0], [out], [
            ("else_branch", K.GRAPH, G(f"else{i}", [], [e], [N("Identity", [h], [e], name=f"ei{i}")])),
            ("then_branch", K.GRAPH, G(f"then{i}", [], [t], [N("Relu", [h], [t], name=f"ti{i}")]))], f"if{i}"))
        h = out
    return encode(Spec(values, G("main", [0, 1], [h], nodes)))


@dataclass(frozen=True)
class Attack:
    build: Callable[..., bytes]
    expect: str            # reject | load | refuse_run | run_error
    small: tuple = ()      # arguments for the test-sized file
    issue: tuple = ()      # arguments for the issue-sized file (bench/load_scaling.py)
    slow: bool = False     # the issue-sized file takes seconds to build or load
    doc: str = ""


ATTACKS: dict[str, Attack] = {
    "chain": Attack(chain, "load", (2_000,), (1_000_000,), slow=True),
    "readers": Attack(readers, "load", (2_000,), (1_000_000,), slow=True),
    "many_uses": Attack(many_uses, "load", (20_000,), (80_000,)),
    "deep_nesting_ok": Attack(deep_nesting, "load", (8,), (30,)),
    "deep_nesting": Attack(deep_nesting, "reject", (60,), (200,)),
    "cycle": Attack(cycle, "reject"),
    "self_loop": Attack(self_loop, "reject"),
    "huge_shape": Attack(huge_shape, "refuse_run"),
    "inconsistent_huge_type": Attack(inconsistent_huge_type, "reject"),
    "huge_initializer_claim": Attack(huge_initializer_claim, "reject"),
    "attr_type_confusion": Attack(attr_type_confusion, "reject"),
    "attr_int_for_graph": Attack(attr_int_for_graph, "reject"),
    "unknown_attr": Attack(unknown_attr, "reject"),
    "unknown_op": Attack(unknown_op, "reject"),
    "unknown_domain": Attack(unknown_domain, "reject"),
    "reshape_2d_shape": Attack(reshape_2d_shape, "reject"),
    "expand_2d_shape": Attack(expand_2d_shape, "reject"),
    "axes_out_of_range": Attack(axes_out_of_range, "reject"),
    "gather_blowup": Attack(gather_blowup, "refuse_run"),
    "gather_blowup_per_request": Attack(gather_blowup_per_request, "refuse_run"),
    "many_values_declared": Attack(many_values_declared, "load", (5_000,), (2_000_000,), slow=True),
    "duplicate_names": Attack(duplicate_names, "reject"),
    "wide_subgraphs": Attack(wide_fan_in_subgraphs, "load", (500,), (20_000,)),
}


def build(name: str, scale: str = "small") -> bytes:
    attack = ATTACKS[name]
    return attack.build(*(attack.small if scale == "small" else attack.issue))


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description="write the hand-made malicious .kiln files")
    ap.add_argument("out", type=Path)
    ap.add_argument("--scale", choices=("small", "issue"), default="small")
    ap.add_argument("--only", default="", help="comma-separated attack names")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in (args.only.split(",") if args.only else ATTACKS):
        data = build(name, args.scale)
        path = args.out / f"{name}.kiln"
        path.write_bytes(data)
        print(f"{path}  {len(data):,} bytes  expect {ATTACKS[name].expect}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

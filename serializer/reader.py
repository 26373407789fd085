"""Read a .kiln file into a Graph: map it, check it, decode it.

Constants come back as read-only numpy views into the mapped file (no copy). Nothing taken
from the file is executed or imported: op names are looked up in the registry, and every
offset, size, index and code is checked first (header: format.parse_header; FlatBuffer:
fbverify.verify_flatbuffer; values, dtypes, shapes and data ranges: here), so a bad file
raises FormatError saying what and where.
"""
from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path
from typing import Optional, Union

import numpy as np

from kiln.errors import FormatError, KilnError
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Value, normalize_attrs
from kiln.ir.registry import AttrKind, get_schema
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify
from kiln.ir.versions import IR_VERSION, OPSET_VERSION, upgrade_graph
from kiln.serializer.fb.Model import Model
from kiln.serializer.fbverify import verify_flatbuffer
from kiln.serializer.format import TENSOR_ALIGNMENT, Header, parse_header

# Data segments at most this large are checksummed on every load; bigger ones only when
# asked (check_data=True), so loading a multi-GB model stays O(graph), not O(weights).
AUTO_CHECK_DATA_BYTES = 64 << 20
MAX_GRAPH_DEPTH = 32
_CODES = {d.value: d for d in DType}
_ATTR_KINDS = {i: k for i, k in enumerate(
    [AttrKind.INT, AttrKind.FLOAT, AttrKind.STRING, AttrKind.INTS, AttrKind.FLOATS, AttrKind.STRINGS,
     AttrKind.TENSOR, AttrKind.GRAPH], start=1)}


def load_graph(path: Union[str, os.PathLike], *, check_data: Optional[bool] = None, upgrade: bool = True) -> Graph:
    """Load a .kiln file. ``check_data``: verify the data checksum (default: when the data
    segment is at most 64 MiB). Older opsets are upgraded unless ``upgrade=False``."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise FormatError(f"{path}: empty file, not a .kiln model")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise KilnError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        return _decode(memoryview(mapped), size, check_data, upgrade)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None


def load_graph_from_bytes(data: Union[bytes, bytearray, memoryview], *, check_data: Optional[bool] = None,
                          upgrade: bool = True) -> Graph:
    """Like load_graph, from bytes in memory (constants are views into ``data``)."""
    view = memoryview(data).toreadonly()
    return _decode(view, len(view), check_data, upgrade)


def _decode(buf: memoryview, size: int, check_data: Optional[bool], upgrade: bool) -> Graph:
    header = parse_header(buf, size)
    # The graph section is small: copy it to bytes (the FlatBuffers runtime wants bytes); the
    # weights stay a view into the mapping.
    fb = bytes(buf[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size])
    if zlib.crc32(fb) != header.flatbuffer_crc32:
        raise FormatError(f"graph section is corrupt: checksum mismatch over bytes "
                          f"{header.flatbuffer_offset}..{header.flatbuffer_offset + header.flatbuffer_size}")
    data = buf[header.data_offset:header.data_offset + header.data_size]
    if check_data if check_data is not None else header.data_size <= AUTO_CHECK_DATA_BYTES:
        if zlib.crc32(data) != header.data_crc32:
            raise FormatError(f"weights are corrupt: data segment checksum mismatch over bytes "
                              f"{header.data_offset}..{header.data_offset + header.data_size}")
    verify_flatbuffer(fb, base=header.flatbuffer_offset)
    try:
        graph = _Decoder(fb, data, header).model()
    except FormatError:
        raise
    except (KilnError, ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"invalid model: {e}") from None
    try:
        verify(graph)
    except KilnError as e:
        raise FormatError(f"the file holds an invalid graph: {e}") from None
    if upgrade:
        upgrade_graph(graph)
    return graph


class _Decoder:
    def __init__(self, fb: bytes, data: memoryview, header: Header):
        self.fb = fb
        self.data = data
        self.header = header
        self.values: list[Optional[Value]] = []
        self.infos: list[tuple[str, TensorType]] = []

    def model(self) -> Graph:
        m = Model.GetRootAs(self.fb, 0)
        ir, opset = m.IrVersion(), m.OpsetVersion()
        if ir > IR_VERSION or opset > OPSET_VERSION:
            raise FormatError(
                f"the file was written by a newer kiln ({_text(m.ProducerName())} {_text(m.ProducerVersion())}) "
                f"with IR version {ir} and opset {opset}; this kiln reads IR version <= {IR_VERSION} and "
                f"opset <= {OPSET_VERSION}: upgrade kiln (pip install -U kiln) to load it")
        if ir < 1 or opset < 1:
            raise FormatError(f"bad versions in file: IR version {ir}, opset {opset}")
        self.infos = [self.value_info(m.Values(i), i) for i in range(m.ValuesLength())]
        self.values = [None] * len(self.infos)
        fg = m.Graph()
        graph = Graph(_text(fg.Name()) or "main", opset_version=opset)
        graph.ir_version = ir
        graph.metadata.producer_name = _text(m.ProducerName())
        graph.metadata.producer_version = _text(m.ProducerVersion())
        graph.metadata.doc_string = _text(m.DocString())
        graph.metadata.props = {_text(kv.Key()): _text(kv.Value()) for kv in
                                (m.Metadata(i) for i in range(m.MetadataLength()))}
        self.graph_body(fg, graph, "graph", 0)
        return graph

    def value_info(self, vi, i: int) -> tuple[str, TensorType]:
        where = f"values[{i}]"
        t = vi.Type()
        if t is None:
            raise FormatError(f"{where} has no type")
        dt = self.dtype(t.Dtype(), where)
        if t.UnknownRank():
            return _text(vi.Name()), TensorType(dt, None)
        dims = []
        for j in range(t.ShapeLength()):
            d = t.Shape(j)
            sym = d.Symbol()
            if sym is not None:
                dims.append(_text(sym))
            elif d.Size() >= 0:
                dims.append(d.Size())
            elif d.Size() == -1:
                dims.append(None)
            else:
                raise FormatError(f"{where}.type.shape[{j}] has size {d.Size()}")
        return _text(vi.Name()), TensorType(dt, dims)

    def dtype(self, code: int, where: str) -> DType:
        if code not in _CODES:
            raise FormatError(f"{where}: unknown dtype code {code}")
        return _CODES[code]

    def value(self, i: int, where: str) -> Value:
        if not 0 <= i < len(self.values):
            raise FormatError(f"{where}: value index {i} is out of range (the file has {len(self.values)} values)")
        v = self.values[i]
        if v is None:
            raise FormatError(f"{where}: value {i} ('{self.infos[i][0]}') is used before it is defined")
        return v

    def define(self, i: int, v: Value, where: str) -> None:
        if self.values[i] is not None:
            raise FormatError(f"{where}: value {i} ('{v.name}') is defined twice")
        if v.type is None:
            v.type = self.infos[i][1]
        self.values[i] = v

    def index(self, i: int, where: str) -> int:
        if not 0 <= i < len(self.infos):
            raise FormatError(f"{where}: value index {i} is out of range (the file has {len(self.infos)} values)")
        return i

    def tensor(self, td, where: str) -> np.ndarray:
        dt = self.dtype(td.Dtype(), where)
        shape = [int(d) for d in td.ShapeAsNumpy()] if td.ShapeLength() else []
        if any(d < 0 for d in shape):
            raise FormatError(f"{where}: negative dim in shape {shape}")
        count = 1
        for d in shape:
            count *= d
        offset, nbytes = td.Offset(), td.Nbytes()
        if count * dt.itemsize != nbytes:
            raise FormatError(f"{where}: shape {shape} of {dt} needs {count * dt.itemsize} bytes, "
                              f"the file says {nbytes}")
        if offset % TENSOR_ALIGNMENT or offset + nbytes > len(self.data):
            raise FormatError(f"{where}: bytes {offset}..{offset + nbytes} are not a 64-aligned range inside "
                              f"the {len(self.data)}-byte data segment (file offset {self.header.data_offset})")
        arr = np.frombuffer(self.data, dtype=dt.numpy.newbyteorder("<"), count=count, offset=offset)
        return arr.reshape(shape)

    def graph_body(self, fg, graph: Graph, where: str, depth: int) -> None:
        if depth > MAX_GRAPH_DEPTH:
            raise FormatError(f"{where}: subgraphs nested deeper than {MAX_GRAPH_DEPTH}")
        for k in range(fg.InputsLength()):
            i = self.index(int(fg.Inputs(k)), f"{where}.inputs[{k}]")
            name, t = self.infos[i]
            self.define(i, graph.add_input(name, t.dtype, t.shape), f"{where}.inputs[{k}]")
        for k in range(fg.InitializersLength()):
            init = fg.Initializers(k)
            w = f"{where}.initializers[{k}]"
            i = self.index(init.Value(), w)
            v = graph.add_initializer(self.infos[i][0], self.tensor(init.Data(), w))
            self.define(i, v, w)
        for k in range(fg.NodesLength()):
            self.node(fg.Nodes(k), graph, f"{where}.nodes[{k}]", depth)
        graph.outputs = [self.value(int(fg.Outputs(k)), f"{where}.outputs[{k}]") for k in range(fg.OutputsLength())]

    def node(self, fn, graph: Graph, where: str, depth: int) -> None:
        op, domain = _text(fn.Op()), _text(fn.Domain())
        where = f"{where} ({op})"
        schema = get_schema(op, domain, graph.opset_version)
        inputs = [None if int(fn.Inputs(k)) == -1 else self.value(int(fn.Inputs(k)), f"{where}.inputs[{k}]")
                  for k in range(fn.InputsLength())]
        outs = [self.index(int(fn.Outputs(k)), f"{where}.outputs[{k}]") for k in range(fn.OutputsLength())]
        attrs = {}
        for k in range(fn.AttributesLength()):
            a = fn.Attributes(k)
            name = _text(a.Name())
            attrs[name] = self.attribute(a, graph, f"{where}.attributes[{k}] '{name}'", depth)
        spec_kinds = {k: s.kind for k, s in schema.attrs.items()}
        for name, value in attrs.items():
            if name in spec_kinds and spec_kinds[name] is not value[0]:
                raise FormatError(f"{where}: attribute '{name}' is {value[0].value}, op {op} wants "
                                  f"{spec_kinds[name].value}")
        node = graph.add_node(op, inputs, normalize_attrs(schema, {k: v for k, (_, v) in attrs.items()}, op),
                              domain=domain, name=_text(fn.Name()) or None,
                              output_names=[self.infos[i][0] for i in outs],
                              output_types=[self.infos[i][1] for i in outs])
        node.meta = {_text(kv.Key()): _text(kv.Value()) for kv in (fn.Meta(i) for i in range(fn.MetaLength()))}
        for i, v in zip(outs, node.outputs):
            self.define(i, v, where)

    def attribute(self, a, graph: Graph, where: str, depth: int) -> tuple:
        code = a.Kind()
        if code not in _ATTR_KINDS:
            raise FormatError(f"{where}: unknown attribute kind {code}")
        kind = _ATTR_KINDS[code]
        if kind is AttrKind.INT:
            return kind, a.I()
        if kind is AttrKind.FLOAT:
            return kind, a.F()
        if kind is AttrKind.STRING:
            return kind, _text(a.S())
        if kind is AttrKind.INTS:
            return kind, tuple(int(x) for x in a.IntsAsNumpy()) if a.IntsLength() else ()
        if kind is AttrKind.FLOATS:
            return kind, tuple(float(x) for x in a.FloatsAsNumpy()) if a.FloatsLength() else ()
        if kind is AttrKind.STRINGS:
            return kind, tuple(_text(a.Strings(i)) for i in range(a.StringsLength()))
        if kind is AttrKind.TENSOR:
            if a.Tensor() is None:
                raise FormatError(f"{where}: tensor attribute without data")
            return kind, self.tensor(a.Tensor(), where)
        sub = a.Graph()
        if sub is None:
            raise FormatError(f"{where}: graph attribute without a graph")
        g = Graph(_text(sub.Name()) or "body", parent=graph)
        graph._node_names.used.add(g.name)
        self.graph_body(sub, g, where, depth + 1)
        return kind, g


def _text(b: Optional[bytes]) -> str:
    if b is None:
        return ""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"a string in the file is not valid UTF-8: {bytes(b[:40])!r}") from e

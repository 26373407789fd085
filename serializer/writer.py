"""Write a Graph as a .kiln file: header, FlatBuffer, aligned data segment.

Deterministic (the same graph gives the same bytes: attributes and metadata are written in
sorted order, constants in graph order) and atomic (written to a temporary file in the same
folder, flushed, then renamed over the target, so a reader never sees half a file).
"""
from __future__ import annotations

import math
import os
import tempfile
import zlib
from pathlib import Path
from typing import Optional, Union

import flatbuffers
import numpy as np

from kiln.ir.dtypes import dtype as as_dtype
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.registry import AttrKind
from kiln.serializer.fb.layout import TABLES
from kiln.serializer.fb import (Attribute, Graph as FbGraph, Initializer, KeyValue, Model, Node as FbNode,
                                TensorData, TensorType, ValueInfo)
from kiln.errors import FormatError
from kiln.serializer.format import (ATTR_KIND_CODES, FILE_IDENTIFIER, HEADER_SIZE, MAX_SUBGRAPH_NESTING,
                                    SEGMENT_ALIGNMENT, TENSOR_ALIGNMENT, Header, align)

_CHUNK = 64 << 20  # write and checksum big tensors in 64 MiB pieces
_UNKNOWN, _SYMBOLIC = -1, -2  # TensorType.shape entries for an unknown dim and a named symbolic dim


class _Constants:
    """The data segment being planned, 64-byte aligned. Arrays that are views of the same memory
    (same address, dtype, shape and strides, e.g. one weight shared by two initializers, or a
    graph loaded from a file) are stored once, so they stay shared after a round trip."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.offsets: list[int] = []
        self._by_id: dict[tuple, int] = {}
        self.size = 0

    def add(self, arr: np.ndarray) -> tuple[int, int]:
        key = (arr.__array_interface__["data"][0], arr.dtype.str, arr.shape, arr.strides)
        if key not in self._by_id:
            data = _little_endian(arr)
            offset = align(self.size, TENSOR_ALIGNMENT)
            self._by_id[key] = len(self.arrays)
            self.arrays.append(data)
            self.offsets.append(offset)
            self.size = offset + data.nbytes
        i = self._by_id[key]
        return self.offsets[i], self.arrays[i].nbytes


def _little_endian(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


class _Encoder:
    def __init__(self, graph: Graph):
        self.b = flatbuffers.Builder(4096)
        self.constants = _Constants()
        self.index: dict[Value, int] = {}
        self.values: list[Value] = []
        for g in graph.all_graphs():
            for v in g.values():
                self.index[v] = len(self.values)
                self.values.append(v)

    # ---- small helpers
    def string(self, s: Optional[str]) -> Optional[int]:
        return None if s is None else self.b.CreateString(s)

    def table_vector(self, start, offsets: list[int]) -> int:
        start(self.b, len(offsets))
        for off in reversed(offsets):
            self.b.PrependUOffsetTRelative(off)
        return self.b.EndVector()

    def string_vector(self, start, items) -> int:
        return self.table_vector(start, [self.b.CreateString(s) for s in items])

    def key_values(self, start, pairs: dict) -> int:
        offsets = []
        for k in sorted(pairs):
            key, val = self.b.CreateString(str(k)), self.b.CreateString(str(pairs[k]))
            KeyValue.Start(self.b)
            KeyValue.AddKey(self.b, key)
            KeyValue.AddValue(self.b, val)
            offsets.append(KeyValue.End(self.b))
        return self.table_vector(start, offsets)

    def ints(self, values, dtype=np.int32) -> int:
        return self.b.CreateNumpyVector(np.asarray(values, dtype=dtype).reshape(-1))

    # ---- types and tensors
    def tensor_type(self, t, name: str = "") -> int:
        dims = t.shape or ()
        for d in dims:
            if isinstance(d, int) and not 0 <= d < 1 << 63:
                raise FormatError(f"cannot save: value '{name}' has shape {list(dims)}; a dim must be an integer "
                                  f"in [0, 2^63) (the file stores int64)")
        symbols = [d for d in dims if isinstance(d, str)]
        sym_vec = self.string_vector(TensorType.StartSymbolsVector, symbols) if symbols else None
        shape = self.ints([d if isinstance(d, int) else _SYMBOLIC if isinstance(d, str) else _UNKNOWN
                           for d in dims], np.int64)
        TensorType.Start(self.b)
        TensorType.AddDtype(self.b, t.dtype.value)
        TensorType.AddShape(self.b, shape)
        if sym_vec is not None:
            TensorType.AddSymbols(self.b, sym_vec)
        if t.shape is None:
            TensorType.AddUnknownRank(self.b, True)
        return TensorType.End(self.b)

    def tensor_data(self, arr: np.ndarray) -> int:
        offset, nbytes = self.constants.add(arr)
        shape = self.ints(arr.shape, np.int64)
        TensorData.Start(self.b)
        TensorData.AddDtype(self.b, as_dtype(arr.dtype).value)
        TensorData.AddShape(self.b, shape)
        TensorData.AddOffset(self.b, offset)
        TensorData.AddNbytes(self.b, nbytes)
        return TensorData.End(self.b)

    # ---- graph structure
    def attribute(self, name: str, kind: AttrKind, value) -> int:
        b = self.b
        name_off = b.CreateString(name)
        payload = None
        if kind is AttrKind.STRING:
            payload = b.CreateString(value)
        elif kind is AttrKind.INTS:
            payload = self.ints(value, np.int64)
        elif kind is AttrKind.FLOATS:
            payload = b.CreateNumpyVector(np.asarray(value, dtype=np.float64).reshape(-1))
        elif kind is AttrKind.STRINGS:
            payload = self.string_vector(Attribute.StartStringsVector, value)
        elif kind is AttrKind.TENSOR:
            payload = self.tensor_data(value)
        elif kind is AttrKind.GRAPH:
            payload = self.graph(value)
        Attribute.Start(b)
        Attribute.AddName(b, name_off)
        Attribute.AddKind(b, ATTR_KIND_CODES[kind])
        if kind is AttrKind.INT:
            Attribute.AddI(b, value)
        elif kind is AttrKind.FLOAT:
            if value == 0.0 and math.copysign(1.0, value) < 0:
                # -0.0 == 0.0, the field's default, which the builder would leave out: force it.
                b.PrependFloat64Slot(Attribute_F_SLOT, value, None)
            else:
                Attribute.AddF(b, value)
        elif payload is not None:
            _ATTR_ADDERS[kind](b, payload)
        return Attribute.End(b)

    def node(self, node: Node) -> int:
        b = self.b
        schema = node.schema
        attrs = [self.attribute(k, schema.attrs[k].kind, node.attrs[k]) for k in sorted(node.attrs)]
        attrs_vec = self.table_vector(FbNode.StartAttributesVector, attrs)
        meta = self.key_values(FbNode.StartMetaVector, node.meta) if node.meta else None
        op, domain, name = b.CreateString(node.op), b.CreateString(node.domain), b.CreateString(node.name)
        inputs = self.ints([-1 if v is None else self.index[v] for v in node.inputs])
        outputs = self.ints([self.index[v] for v in node.outputs])
        FbNode.Start(b)
        FbNode.AddOp(b, op)
        FbNode.AddDomain(b, domain)
        FbNode.AddName(b, name)
        FbNode.AddInputs(b, inputs)
        FbNode.AddOutputs(b, outputs)
        FbNode.AddAttributes(b, attrs_vec)
        if meta is not None:
            FbNode.AddMeta(b, meta)
        return FbNode.End(b)

    def graph(self, g: Graph) -> int:
        b = self.b
        inits = []
        for v in g.initializers.values():
            data = self.tensor_data(v.const)
            Initializer.Start(b)
            Initializer.AddValue(b, self.index[v])
            Initializer.AddData(b, data)
            inits.append(Initializer.End(b))
        inits_vec = self.table_vector(FbGraph.StartInitializersVector, inits)
        nodes_vec = self.table_vector(FbGraph.StartNodesVector, [self.node(n) for n in g.nodes])
        name = b.CreateString(g.name)
        inputs = self.ints([self.index[v] for v in g.inputs])
        outputs = self.ints([self.index[v] for v in g.outputs])
        FbGraph.Start(b)
        FbGraph.AddName(b, name)
        FbGraph.AddInputs(b, inputs)
        FbGraph.AddOutputs(b, outputs)
        FbGraph.AddInitializers(b, inits_vec)
        FbGraph.AddNodes(b, nodes_vec)
        return FbGraph.End(b)

    def value_infos(self) -> int:
        offsets = []
        for v in self.values:
            if v.type is None:
                raise ValueError(f"value '{v.name}' has no type; run shape inference before saving")
            t = self.tensor_type(v.type, v.name)
            name = self.b.CreateString(v.name)
            ValueInfo.Start(self.b)
            ValueInfo.AddName(self.b, name)
            ValueInfo.AddType(self.b, t)
            offsets.append(ValueInfo.End(self.b))
        return self.table_vector(Model.StartValuesVector, offsets)

    def model(self, graph: Graph) -> bytes:
        b = self.b
        root = self.graph(graph)
        values = self.value_infos()
        md = graph.metadata
        meta = self.key_values(Model.StartMetadataVector, md.props)
        pname, pver, doc = b.CreateString(md.producer_name), b.CreateString(md.producer_version), \
            b.CreateString(md.doc_string)
        Model.Start(b)
        Model.AddIrVersion(b, graph.ir_version)
        Model.AddOpsetVersion(b, graph.opset_version)
        Model.AddProducerName(b, pname)
        Model.AddProducerVersion(b, pver)
        Model.AddDocString(b, doc)
        Model.AddMetadata(b, meta)
        Model.AddValues(b, values)
        Model.AddGraph(b, root)
        b.Finish(Model.End(b), file_identifier=FILE_IDENTIFIER)
        return bytes(b.Output())


# Slot number of Attribute.f, from the layout generated out of kiln.fbs.
Attribute_F_SLOT = next(slot for field, slot, *_ in TABLES['Attribute'] if field == 'f')
_ATTR_ADDERS = {AttrKind.STRING: Attribute.AddS, AttrKind.INTS: Attribute.AddInts,
                AttrKind.FLOATS: Attribute.AddFloats, AttrKind.STRINGS: Attribute.AddStrings,
                AttrKind.TENSOR: Attribute.AddTensor, AttrKind.GRAPH: Attribute.AddGraph}


def check_nesting(graph: Graph) -> int:
    """The deepest subgraph nesting of ``graph`` (0: no If/Loop bodies). Raises FormatError naming the
    chain of nodes when it exceeds MAX_SUBGRAPH_NESTING, the level the reader accepts (one rule for both,
    in serializer/format.py), so a graph that saves always loads back."""
    deepest = 0
    stack = [(graph, 0, ())]
    while stack:
        g, depth, chain = stack.pop()
        deepest = max(deepest, depth)
        for n in g.nodes:
            for sg in n.subgraphs():
                if depth + 1 > MAX_SUBGRAPH_NESTING:
                    path = " > ".join((chain + (f"{n.name} ({n.op})",))[-3:])
                    raise FormatError(
                        f"cannot save: subgraphs nested {depth + 1} levels deep (at {path}); a .kiln file holds "
                        f"at most {MAX_SUBGRAPH_NESTING} levels of nested If/Loop bodies")
                stack.append((sg, depth + 1, chain + (f"{n.name} ({n.op})",)))
    return deepest


def save(graph: Graph, path: Union[str, os.PathLike]) -> Path:
    """Write ``graph`` to ``path`` as a .kiln file (atomically, deterministically). Returns the path.

    Every value must have a type (run ``kiln.ir.passes.infer_shapes`` first if needed)."""
    path = Path(path)
    check_nesting(graph)
    enc = _Encoder(graph)
    fb = enc.model(graph)
    data_offset = align(HEADER_SIZE + len(fb), SEGMENT_ALIGNMENT)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * HEADER_SIZE)
            f.write(fb)
            f.write(b"\0" * (data_offset - HEADER_SIZE - len(fb)))
            data_crc = _write_segment(f, enc.constants)
            header = Header(HEADER_SIZE, len(fb), data_offset, enc.constants.size, zlib.crc32(fb), data_crc)
            f.seek(0)
            f.write(header.pack())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _write_segment(f, constants: _Constants) -> int:
    crc = 0
    pos = 0
    for arr, offset in zip(constants.arrays, constants.offsets):
        pad = b"\0" * (offset - pos)
        f.write(pad)
        crc = zlib.crc32(pad, crc)
        flat = arr.reshape(-1).view(np.uint8)
        for start in range(0, flat.nbytes, _CHUNK):
            chunk = memoryview(flat[start:start + _CHUNK])
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
        pos = offset + arr.nbytes
    return crc


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

"""Read a .kiln file into a Graph: map it, check it, decode it.

Constants come back as read-only numpy views into the mapped file (no copy). Nothing taken
from the file is executed or imported: op names are looked up in the registry, and every
offset, size, index and code is checked first (header: format.parse_header; FlatBuffer:
fbread.read_flatbuffer; values, dtypes, shapes and data ranges: here), so a bad file
raises FormatError saying what and where.
"""
from __future__ import annotations

import contextlib
import gc
import mmap
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from kiln.errors import FormatError, KilnError
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Value
from kiln.ir.registry import AttrKind, get_schema
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify
from kiln.ir.versions import IR_VERSION, OPSET_VERSION, upgrade_graph
from kiln.serializer.fbread import read_flatbuffer
from kiln.serializer.format import (ATTR_KINDS_BY_CODE, MAX_SUBGRAPH_NESTING, TENSOR_ALIGNMENT, Header,
                                    parse_header)

# Data segments at most this large are checksummed on every load; bigger ones only when
# asked (check_data=True), so loading a multi-GB model stays O(graph), not O(weights).
AUTO_CHECK_DATA_BYTES = 16 << 20
MAX_GRAPH_DEPTH = MAX_SUBGRAPH_NESTING  # one nesting rule with the writer (serializer/format.py)
_CODES = {d.value: d for d in DType}


@dataclass(frozen=True)
class LoadLimits:
    """What one load of an untrusted file may cost (issue 16). A file past any limit is refused
    with FormatError naming the limit; time and memory of a load are linear in the file, so these
    bound them. ``None`` turns a limit off. The defaults admit any realistic model (the largest
    exported transformers have tens of thousands of nodes) and refuse a million-node file at once.

    - ``max_nodes``: nodes, subgraph nodes included (checked on each node vector's length,
      before decoding it: a million-node file fails in well under a second);
    - ``max_values``: value descriptions (ValueInfo tables) in the file;
    - ``max_depth``: If/Loop bodies nested below the main graph (one rule with the writer:
      ``serializer.format.MAX_SUBGRAPH_NESTING``; at most ``MAX_DEPTH_CEILING``);
    - ``max_graph_bytes``: size of the graph section (the FlatBuffer; weights are mapped, not read);
    - ``max_memory_bytes``: the memory decoding may take, estimated as it goes at
      ``BYTES_PER_UNIT`` bytes per decoded object (measured peaks, see docs/NOTES.md);
    - ``max_seconds``: wall time of reading, decoding and verifying (checked every 1024 nodes).
    """

    max_nodes: Optional[int] = 250_000
    max_values: Optional[int] = 1_000_000
    max_depth: int = MAX_SUBGRAPH_NESTING
    max_graph_bytes: Optional[int] = 256 << 20
    max_memory_bytes: Optional[int] = 2 << 30
    max_seconds: Optional[float] = 60.0

    # Peak bytes a load takes per FlatBuffer unit (one decoded object or 4 payload bytes; see
    # fbread.py), rounded up from tracemalloc peaks: 70-80 for chains, fans, many subgraphs or
    # values; 180 for one node reading a value 20k times (each 4-byte input becomes a use entry).
    BYTES_PER_UNIT = 200
    MAX_DEPTH_CEILING = 100  # Python recursion: a few frames per level in reader and verifier

    def __post_init__(self) -> None:
        if not 0 <= self.max_depth <= self.MAX_DEPTH_CEILING:
            raise ValueError(f"LoadLimits.max_depth must be in 0..{self.MAX_DEPTH_CEILING}, not {self.max_depth}")

    @classmethod
    def unlimited(cls) -> "LoadLimits":
        """Only the structural checks (and the deepest nesting the reader can walk)."""
        return cls(None, None, cls.MAX_DEPTH_CEILING, None, None, None)


DEFAULT_LIMITS = LoadLimits()


def load_graph(path: Union[str, os.PathLike], *, check_data: Optional[bool] = None, upgrade: bool = True,
               limits: Optional[LoadLimits] = None) -> Graph:
    """Load a .kiln file. ``check_data``: verify the data checksum (default: when the data
    segment is at most 16 MiB). Older opsets are upgraded unless ``upgrade=False``. ``limits``:
    what the load may cost (default ``LoadLimits()``; see its docstring)."""
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
        return _decode(memoryview(mapped), size, check_data, upgrade, limits)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None


def load_graph_from_bytes(data: Union[bytes, bytearray, memoryview], *, check_data: Optional[bool] = None,
                          upgrade: bool = True, limits: Optional[LoadLimits] = None) -> Graph:
    """Like load_graph, from bytes in memory (constants are views into ``data``)."""
    view = memoryview(data).toreadonly()
    return _decode(view, len(view), check_data, upgrade, limits)


_gc_lock = threading.Lock()
_gc_pauses = [0, False]  # loads in progress, whether the collector was on when the first began


@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector off while a load builds its graph: every few hundred new
    objects it would walk the young generation, and ever more often the older ones, which cost
    a third of the decoding time of a node-heavy file. Loads in several threads share one pause;
    the last one out restores the state the first one found."""
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


def _decode(buf: memoryview, size: int, check_data: Optional[bool], upgrade: bool,
            limits: Optional[LoadLimits] = None) -> Graph:
    with collector_paused():
        return _decode_unpaused(buf, size, check_data, upgrade, limits)


def _decode_unpaused(buf: memoryview, size: int, check_data: Optional[bool], upgrade: bool,
                     limits: Optional[LoadLimits] = None) -> Graph:
    limits = DEFAULT_LIMITS if limits is None else limits
    deadline = None if limits.max_seconds is None else time.monotonic() + limits.max_seconds
    header = parse_header(buf, size)
    if limits.max_graph_bytes is not None and header.flatbuffer_size > limits.max_graph_bytes:
        raise FormatError(f"the graph section is {header.flatbuffer_size:,} bytes, more than this load allows "
                          f"(LoadLimits.max_graph_bytes = {limits.max_graph_bytes:,})")
    # The graph section is read in place, a view into the mapping like the weights (fbread.py
    # needs no bytes copy: a million-node file's copy was a file's size of memory more).
    fb = buf[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size]
    if zlib.crc32(fb) != header.flatbuffer_crc32:
        raise FormatError(f"graph section is corrupt: checksum mismatch over bytes "
                          f"{header.flatbuffer_offset}..{header.flatbuffer_offset + header.flatbuffer_size}")
    data = buf[header.data_offset:header.data_offset + header.data_size]
    if check_data if check_data is not None else header.data_size <= AUTO_CHECK_DATA_BYTES:
        if zlib.crc32(data) != header.data_crc32:
            raise FormatError(f"weights are corrupt: data segment checksum mismatch over bytes "
                              f"{header.data_offset}..{header.data_offset + header.data_size}")
    max_tables = {}
    if limits.max_nodes is not None:
        max_tables["Node"] = limits.max_nodes
    if limits.max_values is not None:
        max_tables["ValueInfo"] = limits.max_values
    max_units = None if limits.max_memory_bytes is None else limits.max_memory_bytes // limits.BYTES_PER_UNIT
    model = read_flatbuffer(fb, base=header.flatbuffer_offset, max_depth=1 + 3 * limits.max_depth + 3,
                            max_tables=max_tables, max_units=max_units, deadline=deadline)
    del fb
    try:
        graph = _Decoder(model, data, header, limits.max_depth, deadline).model()
    except FormatError:
        raise
    except (KilnError, ValueError) as e:
        raise FormatError(f"invalid model: {e}") from None
    del model  # the decoded tables: the graph holds what it needs
    try:
        verify(graph, deadline=deadline)
    except KilnError as e:
        raise FormatError(f"the file holds an invalid graph: {e}") from None
    if upgrade:
        upgrade_graph(graph)
    return graph


class _Decoder:
    """Builds the Graph from the checked, decoded FlatBuffer (plain dicts, see fbread.py)."""

    def __init__(self, model: dict, data: memoryview, header: Header, max_depth: int = MAX_GRAPH_DEPTH,
                 deadline: Optional[float] = None):
        self.m = model
        self.data = data
        self.header = header
        self.max_depth = max_depth
        self.deadline = deadline
        self.values: list[Optional[Value]] = []
        self.infos: list[tuple[str, TensorType]] = []

    def model(self) -> Graph:
        m = self.m
        ir, opset = m["ir_version"], m["opset_version"]
        if ir > IR_VERSION or opset > OPSET_VERSION:
            raise FormatError(
                f"the file was written by a newer kiln ({m['producer_name'] or '?'} {m['producer_version'] or '?'}) "
                f"with IR version {ir} and opset {opset}; this kiln reads IR version <= {IR_VERSION} and "
                f"opset <= {OPSET_VERSION}: upgrade kiln (pip install -U kiln) to load it")
        if ir < 1 or opset < 1:
            raise FormatError(f"bad versions in file: IR version {ir}, opset {opset}")
        self.types: dict = {}  # one TensorType object per distinct type (they are immutable)
        self.infos = [self.value_info(vi, i) for i, vi in enumerate(m["values"] or ())]
        m["values"] = None  # decoded tables are dropped as soon as they are used (peak memory)
        self.values = [None] * len(self.infos)
        fg = m["graph"]
        graph = Graph(fg["name"] or "main", opset_version=opset)
        graph.ir_version = ir
        graph.metadata.producer_name = m["producer_name"] or ""
        graph.metadata.producer_version = m["producer_version"] or ""
        graph.metadata.doc_string = m["doc_string"] or ""
        graph.metadata.props = _key_values(m["metadata"])
        self.graph_body(fg, graph, "graph", 0)
        return graph

    def value_info(self, vi: dict, i: int) -> tuple[str, TensorType]:
        t = vi["type"]
        if t is None:
            raise FormatError(f"values[{i}] ('{vi['name']}') has no type")
        dt = self.dtype(t["dtype"], f"values[{i}]")
        if t["unknown_rank"]:
            return vi["name"], TensorType(dt, None)
        symbols = iter(t["symbols"] or ())
        dims = []
        for j, d in enumerate(t["shape"] or ()):
            if d >= 0:
                dims.append(d)
            elif d == -1:
                dims.append(None)
            elif d == -2:
                dims.append(next(symbols, None))
                if dims[-1] is None:
                    raise FormatError(f"values[{i}].type.shape[{j}] is symbolic but has no name in symbols")
            else:
                raise FormatError(f"values[{i}].type.shape[{j}] has size {d}")
        key = (dt, tuple(dims))
        t = self.types.get(key)
        if t is None:
            t = self.types[key] = TensorType(dt, dims)
        return vi["name"], t

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
        self.values[i] = v

    def index(self, i: int, where: str) -> int:
        if not 0 <= i < len(self.infos):
            raise FormatError(f"{where}: value index {i} is out of range (the file has {len(self.infos)} values)")
        return i

    def tensor(self, td: dict, where: str) -> np.ndarray:
        dt = self.dtype(td["dtype"], where)
        shape = list(td["shape"] or ())
        if any(d < 0 for d in shape):
            raise FormatError(f"{where}: negative dim in shape {shape}")
        count = 1
        for d in shape:
            count *= d
        offset, nbytes = td["offset"], td["nbytes"]
        if count * dt.itemsize != nbytes:
            raise FormatError(f"{where}: shape {shape} of {dt} needs {count * dt.itemsize} bytes, "
                              f"the file says {nbytes}")
        if offset % TENSOR_ALIGNMENT or offset + nbytes > len(self.data):
            raise FormatError(f"{where}: bytes {offset}..{offset + nbytes} are not a 64-aligned range inside "
                              f"the {len(self.data)}-byte data segment (file offset {self.header.data_offset})")
        arr = np.frombuffer(self.data, dtype=dt.numpy.newbyteorder("<"), count=count, offset=offset)
        return arr.reshape(shape)

    def graph_body(self, fg: dict, graph: Graph, where: str, depth: int) -> None:
        if depth > self.max_depth:
            raise FormatError(f"{where}: subgraphs nested deeper than {self.max_depth}")
        for k, i in enumerate(fg["inputs"] or ()):
            w = f"{where}.inputs[{k}]"
            name, t = self.infos[self.index(i, w)]
            self.define(i, graph.add_input(name, t.dtype, t.shape), w)
        for k, init in enumerate(fg["initializers"] or ()):
            w = f"{where}.initializers[{k}]"
            i = self.index(init["value"], w)
            arr = self.tensor(init["data"], w)
            if TensorType.of(arr) != self.infos[i][1]:
                raise FormatError(f"{w}: '{self.infos[i][0]}' is typed {self.infos[i][1]} but its data is "
                                  f"{TensorType.of(arr)}")
            self.define(i, graph.add_initializer(self.infos[i][0], arr), w)
        deadline = self.deadline
        nodes = fg["nodes"] or []
        for k, fn in enumerate(nodes):
            nodes[k] = None  # drop each decoded node once built (peak memory)
            self.node(fn, graph, where, k, depth)
            if deadline is not None and not k & 1023 and time.monotonic() > deadline:
                raise FormatError(f"{where}.nodes[{k}]: building the graph ran past the load's time budget "
                                  f"(LoadLimits.max_seconds)")
        graph.outputs = [self.value(i, f"{where}.outputs[{k}]") for k, i in enumerate(fg["outputs"] or ())]

    def node(self, fn: dict, graph: Graph, parent: str, k: int, depth: int) -> None:
        op, domain = fn["op"], fn["domain"] or ""
        where = f"{parent}.nodes[{k}] ({op})"
        schema = get_schema(op, domain, graph.opset_version)
        values, n_values = self.values, len(self.values)
        inputs = []
        for j, i in enumerate(fn["inputs"] or ()):
            # The usual case inline (a defined value); value() words the error otherwise.
            v = values[i] if 0 <= i < n_values else None
            if v is None and i != -1:
                v = self.value(i, f"{where}.inputs[{j}]")
            inputs.append(v)
        outs = [self.index(i, f"{where}.outputs[{j}]") for j, i in enumerate(fn["outputs"] or ())]
        attrs = {}
        for j, a in enumerate(fn["attributes"] or ()):
            name = a["name"]
            kind, value = self.attribute(a, graph, f"{where}.attributes[{j}] '{name}'", depth)
            spec = schema.attrs.get(name)
            if spec is not None and spec.kind is not kind:
                raise FormatError(f"{where}: attribute '{name}' is {kind.value}, op {op} wants {spec.kind.value}")
            attrs[name] = value
        infos = self.infos
        node = graph._append_decoded(op, domain, fn["name"] or None, attrs, inputs, [infos[i] for i in outs])
        if fn["meta"]:
            node.meta = _key_values(fn["meta"])
        for i, v in zip(outs, node.outputs):
            self.define(i, v, where)

    def attribute(self, a: dict, graph: Graph, where: str, depth: int) -> tuple:
        kind = ATTR_KINDS_BY_CODE.get(a["kind"])
        if kind is None:
            raise FormatError(f"{where}: unknown attribute kind {a['kind']}")
        if kind in _SIMPLE_ATTRS:
            value = a[_SIMPLE_ATTRS[kind]]
            if value is None:
                raise FormatError(f"{where}: {kind.value} attribute without a value")
            return kind, tuple(value) if isinstance(value, (list, tuple)) else value
        if kind is AttrKind.TENSOR:
            if a["tensor"] is None:
                raise FormatError(f"{where}: tensor attribute without data")
            return kind, self.tensor(a["tensor"], where)
        sub = a["graph"]
        if sub is None:
            raise FormatError(f"{where}: graph attribute without a graph")
        g = Graph(sub["name"] or "body", parent=graph)
        graph._node_names.used.add(g.name)
        self.graph_body(sub, g, where, depth + 1)
        return kind, g


_SIMPLE_ATTRS = {AttrKind.INT: "i", AttrKind.FLOAT: "f", AttrKind.STRING: "s", AttrKind.INTS: "ints",
                 AttrKind.FLOATS: "floats", AttrKind.STRINGS: "strings"}


def _key_values(pairs: Optional[list]) -> dict:
    return {kv["key"]: kv["value"] or "" for kv in pairs or ()}

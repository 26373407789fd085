"""The seed corpus of the .kiln loader fuzzer (tools/fuzz.py): small graphs that cover
every part of the schema, saved with kiln.save, and a map of each FlatBuffer's structure so
that mutators can hit the integers and strings the loader actually reads."""
from __future__ import annotations

import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

import kiln
from kiln.serializer.fb.layout import ROOT, TABLES
from kiln.serializer.format import HEADER_SIZE

def _cnn() -> kiln.Graph:
    """The quickstart CNN (examples/quickstart.py), with fewer channels: conv-bn-relu, residual,
    pooling, classifier. Built here because examples/ is not part of the installed package."""
    rng = np.random.default_rng(0)
    g = kiln.Graph("tiny_cnn")
    g.metadata.doc_string = "quickstart-style CNN"
    x = g.add_input("image", "float32", ("batch", 3, 8, 8))
    w = g.add_initializer("stem.weight", rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    bn = [g.add_initializer(f"bn.{p}", rng.uniform(0.5, 1.5, 4).astype(np.float32))
          for p in ("weight", "bias", "mean", "var")]
    h = g.op("Relu", g.op("BatchNormalization", g.op("Conv", x, w, pads=[1, 1, 1, 1]), *bn, epsilon=1e-5))
    h = g.op("Add", h, g.op("Relu", h))
    h = g.op("Flatten", g.op("GlobalAveragePool", h))
    fc = g.add_initializer("fc.weight", rng.standard_normal((3, 4)).astype(np.float32))
    fb = g.add_initializer("fc.bias", np.zeros(3, np.float32))
    g.outputs = [g.op("Softmax", g.op("Gemm", h, fc, fb, transB=1), axis=-1)]
    return g


def _control_flow() -> kiln.Graph:
    """If inside a Loop body, both reading outer values; symbolic dims; node meta."""
    g = kiln.Graph("control")
    acc0 = g.add_input("acc0", "float32", ["batch", "width"])
    switch = g.add_input("switch", "int64", [])
    body = g.subgraph("body")
    i = body.add_input("i", "int64", [])
    cond = body.add_input("cond", "bool", [])
    acc = body.add_input("acc", "float32", ["batch", "width"])
    then_g = body.subgraph("then")
    then_g.outputs = [then_g.op("Add", acc, then_g.add_initializer("one", np.array(1, np.float32)))]
    else_g = body.subgraph("else")
    else_g.outputs = [else_g.op("Mul", acc, else_g.add_initializer("two", np.array(2, np.float32)))]
    picked = body.op("If", body.op("Less", i, switch), then_branch=then_g, else_branch=else_g)
    body.outputs = [cond, picked, body.op("Cast", i, to=1)]
    m = g.add_initializer("m", np.array(3, np.int64))
    final, iters = g.op("Loop", m, None, acc0, body=body, outputs=2)
    final.producer.meta = {"scope": "model.loop", "source": "model.py:12"}
    g.outputs = [final, iters]
    return g


def _tensor_attrs() -> kiln.Graph:
    """Constant with a tensor attribute, list attributes, metadata props, node meta."""
    g = kiln.Graph("attrs")
    g.metadata.producer_name = "fuzz"
    g.metadata.props = {"license": "apache-2.0", "task": "classification", "ünïcode": "ok"}
    x = g.add_input("x", "float32", [2, "n"])
    c = g.op("Constant", value=np.arange(6, dtype=np.float32).reshape(2, 3))
    k = g.op("Constant", value_ints=[1, 2, 3])
    y = g.op("Concat", x, c, axis=1)
    y.producer.meta = {"scope": "net.cat"}
    g.outputs = [g.op("Transpose", y, perm=[1, 0]), k, g.op("Constant", value_float=0.5)]
    return g


def _dtypes() -> kiln.Graph:
    """Initializers of every width: bfloat16, float16, bool, int8, int32, int64, uint8, float64."""
    import ml_dtypes  # noqa: F401  (a dev dependency; bfloat16 arrays need it)

    g = kiln.Graph("dtypes")
    arrays = {"bf16": np.array([1.5, -2.0, 3.25], ml_dtypes.bfloat16), "f16": np.array([[0.5, 1.0]], np.float16),
              "flags": np.array([True, False, True]), "i8": np.array([-3, 4], np.int8),
              "i32": np.array([7], np.int32), "i64": np.array([[1, 2], [3, 4]], np.int64),
              "u8": np.array([255, 0], np.uint8), "f64": np.array(2.5, np.float64)}
    g.outputs = [g.op("Cast", g.add_initializer(name, a), to=1) for name, a in arrays.items()]
    return g


def _tiny() -> kiln.Graph:
    """Almost empty: one input passed straight through."""
    g = kiln.Graph("tiny")
    g.outputs = [g.op("Identity", g.add_input("x", "float32", []))]
    return g


SEED_GRAPHS: dict[str, Callable[[], kiln.Graph]] = {
    "cnn": _cnn, "control_flow": _control_flow, "tensor_attrs": _tensor_attrs, "dtypes": _dtypes, "tiny": _tiny}


@dataclass
class Seed:
    """A valid file and where its FlatBuffer keeps things (positions are FlatBuffer offsets)."""

    name: str
    data: bytes
    sites: list = field(default_factory=list)    # (pos, size, kind) of every integer the loader reads
    offsets: list = field(default_factory=list)  # (pos, type) of every uoffset and the type it points at
    objects: dict = field(default_factory=dict)  # type -> positions of the tables, vectors, strings of it
    strings: list = field(default_factory=list)  # (pos, length, field) of string bytes

    @property
    def fb_end(self) -> int:
        return HEADER_SIZE + struct.unpack_from("<Q", self.data, 24)[0]


def build_corpus() -> list[Seed]:
    """Every seed graph saved with kiln.save, with the structure of its FlatBuffer mapped."""
    seeds = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in SEED_GRAPHS.items():
            path = kiln.save(build(), Path(tmp) / f"{name}.kiln")
            seed = Seed(name, path.read_bytes())
            _SiteMap(seed).walk()
            seeds.append(seed)
    return seeds


class _SiteMap:
    """Walks a valid FlatBuffer with the generated layout (as fbread does) and records where
    each offset, vtable entry, length, scalar field, vector element and string lives."""

    def __init__(self, seed: Seed):
        self.seed = seed
        self.fb = seed.data[HEADER_SIZE:seed.fb_end]
        self.seen: set = set()

    def add(self, pos: int, size: int, kind: str) -> None:
        if (pos, size) not in self.seen:
            self.seen.add((pos, size))
            self.seed.sites.append((pos, size, kind))

    def u(self, fmt: str, pos: int) -> int:
        return struct.unpack_from(fmt, self.fb, pos)[0]

    def walk(self) -> None:
        self.offset(0, "table", ROOT, ROOT)

    def offset(self, pos: int, kind: str, detail, fld: str) -> None:
        """The uoffset at ``pos`` and what it points at."""
        self.add(pos, 4, "uoffset")
        type_name = detail if kind == "table" else f"{kind}:{detail}"
        self.seed.offsets.append((pos, type_name))
        at = pos + self.u("<I", pos)
        self.seed.objects.setdefault(type_name, []).append(at)
        if kind == "table":
            self.table(at, detail)
            return
        n = self.u("<I", at)
        self.add(at, 4, "length")
        if kind == "string":
            self.seed.strings.append((at + 4, n, fld))
        elif kind == "vector_scalar":
            for i in range(n):
                self.add(at + 4 + i * detail, detail, "element")
        else:
            for i in range(n):
                self.offset(at + 4 + 4 * i, "table" if kind == "vector_table" else "string", detail, fld)

    def table(self, pos: int, name: str) -> None:
        self.add(pos, 4, "soffset")
        vt = pos - self.u("<i", pos)
        self.add(vt, 2, "vtable")
        self.add(vt + 2, 2, "vtable")
        vt_size = self.u("<H", vt)
        for fld, slot, kind, detail, _required in TABLES[name]:
            entry = vt + 4 + 2 * slot
            if 4 + 2 * slot + 2 > vt_size:
                continue
            self.add(entry, 2, "vtable")
            off = self.u("<H", entry)
            if off == 0:
                continue
            if kind == "scalar":
                self.add(pos + off, detail, "scalar")
            else:
                self.offset(pos + off, kind, detail, f"{name}.{fld}")

"""The mobile stub runtime: run a packed .kiln file with numpy and nothing else.

Everything a full runtime decides at load or run time was decided by ``kiln mobile pack``: passes
have run, shapes are static, nodes are stored in execution order, and the file's metadata holds a
memory plan (``kiln.mobile.arena``: one offset per intermediate value in a single arena). So this
interpreter only has to

1. read the file through kiln's checked reader (format.parse_header + fbread.read_flatbuffer: plain
   dicts, no kiln.ir; weights stay views of the mmap'd data segment),
2. look every node's ``Op:dtype`` up in the kernel table and refuse the file at load time, naming
   the node, if one is missing (a device never discovers a missing op mid-inference),
3. allocate ONE uint8 arena and give every value its view at the planned offset,
4. run the nodes in order, each kernel writing into its outputs' views.

A DequantizeLinear of int8 weights feeding only Conv/Gemm/MatMul weight inputs is fused at load: the
consumers receive a QWeight (int8 + per-channel scale) and dequantize in their kernel, so the
float32 weights never exist as a whole.

Only numpy and the reader pieces (errors.py, serializer/format.py, serializer/fbread.py,
serializer/fb/layout.py) are imported, so ``kiln mobile bundle`` can ship this file on its own.
"""
from __future__ import annotations

import mmap
import os
import zlib

import numpy as np

from kiln.errors import ExecutionError, FormatError, InputError, KilnError, UnsupportedOpError
from kiln.mobile_stub import kernels as kernel_families
from kiln.mobile_stub import packed
from kiln.mobile_stub.kernels import QWeight
from kiln.serializer.fbread import read_flatbuffer
from kiln.serializer.format import TENSOR_ALIGNMENT, parse_header

# The schema's DataType codes (serializer/fb/DataType.py) as numpy dtypes.
DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
          10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
# The schema's AttrKind codes (serializer/fb/AttrKind.py) -> the decoded field holding the value.
ATTR_FIELDS = {1: "i", 2: "f", 3: "s", 4: "ints", 5: "floats", 6: "strings", 7: "tensor"}
QUANT_CONSUMERS = {"Conv", "Gemm", "MatMul"}  # ops whose kernels take a QWeight as input 1
MAX_VALUE_BYTES = 1 << 62  # a declared shape at least this big cannot be a real array


def _count(shape) -> int:
    """Elements of ``shape``, in Python ints (numpy's int64 product wraps around silently)."""
    n = 1
    for d in shape:
        n *= d
    return n


def _span(shape) -> int:
    """The product numpy checks a shape against (zero dims count as one): [0, 2^62] is no array either."""
    n = 1
    for d in shape:
        n *= max(d, 1)
    return n


# Ops run for their side effect, with no outputs: a guard's check refuses an input the trace does not cover.
_NO_OUTPUTS = frozenset({"kiln.Guard"})


class StubProgram:
    """A packed model, loaded and checked; ``run`` executes it in the preplanned arena."""

    def __init__(self, path: str, families=kernel_families.FAMILIES, max_arena_bytes=packed.MAX_ARENA_BYTES):
        self.path = str(path)
        self.max_arena_bytes = max_arena_bytes
        self.kernels, self.supports, _ = kernel_families.load(families)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise FormatError(f"{path}: empty file, not a packed model")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise KilnError(f"cannot read {path}: {e.strerror or e}") from None
        buf = memoryview(self._map)
        try:
            self._load(buf, len(buf))
        except FormatError as e:
            raise FormatError(f"{path}: {e}") from None

    # ------------------------------------------------------------------ loading
    def _load(self, buf: memoryview, size: int) -> None:
        header = parse_header(buf, size)
        fb = bytes(buf[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size])
        if zlib.crc32(fb) != header.flatbuffer_crc32:
            raise FormatError("graph section is corrupt: checksum mismatch")
        self._data = buf[header.data_offset:header.data_offset + header.data_size]
        model = read_flatbuffer(fb, base=header.flatbuffer_offset)
        props = {kv["key"]: kv["value"] or "" for kv in model["metadata"] or ()}
        if props.get(packed.PROP_VERSION) != packed.MOBILE_VERSION:
            raise FormatError("not a packed mobile model (no kiln.mobile.version = 1 in its metadata): "
                              "run `kiln mobile pack` on it first")
        self.manifest = packed.parse_manifest(props.get(packed.PROP_OPS))
        size, _, plan = packed.parse_arena(props.get(packed.PROP_ARENA), self.max_arena_bytes)
        self.infos = [(vi["name"], *self._type(vi)) for vi in model["values"] or ()]
        g = model["graph"]
        if any(n["attributes"] and any(a["kind"] == 8 for a in n["attributes"]) for n in g["nodes"] or ()):
            raise UnsupportedOpError("the mobile stub runs no subgraphs (If/Loop bodies)")
        consts = {}
        for k, init in enumerate(g["initializers"] or ()):
            i = self._index(init["value"])
            arr = self._tensor(init["data"], f"initializers[{k}]")
            if (arr.dtype, arr.shape) != self.infos[i][1:]:
                raise FormatError(f"initializers[{k}] ('{self.infos[i][0]}') holds {arr.dtype}{list(arr.shape)}, "
                                  f"its value is typed {self.infos[i][1]}{list(self.infos[i][2])}")
            if i in consts:
                raise FormatError(f"initializers[{k}]: value '{self.infos[i][0]}' is initialized twice")
            consts[i] = arr
        nodes = [self._node(n, k) for k, n in enumerate(g["nodes"] or ())]
        self.inputs = [self._index(i) for i in g["inputs"] or ()]
        self.outputs = [self._index(i) for i in g["outputs"] or ()]
        last = self._check_order(nodes, consts)
        self._check_kernels(nodes)
        fused, skipped = self._fuse_dequantize(nodes, consts)
        # Every planned value is a node's output, its slot is exactly its type's size, and no two live
        # values share a byte: all checked before the arena is allocated.
        produced = {o: node["index"] for node in nodes for o in node["outputs"]}
        slots, planned = [], {}
        for name, (offset, nbytes) in plan.items():
            i = self._by_name(name)
            _, dtype, shape = self.infos[i]
            if i not in produced:
                raise FormatError(f"the arena plan gives a slot to '{name}', which no node writes (a graph input "
                                  f"or a constant)")
            if offset % TENSOR_ALIGNMENT and nbytes or \
                    nbytes != np.dtype(dtype).itemsize * _count(shape):
                raise FormatError(f"arena slot of '{name}' ({offset}, {nbytes}) does not fit its type "
                                  f"{dtype}{list(shape)}")
            planned[i] = (offset, nbytes)
            slots.append((name, offset, nbytes, produced[i], last.get(i, produced[i])))
        packed.check_overlaps(slots)
        # The arena: one buffer, a view per planned value.
        self.arena = np.empty(size, np.uint8)
        views = dict(consts)
        for i, (offset, nbytes) in planned.items():
            _, dtype, shape = self.infos[i]
            views[i] = self.arena[offset:offset + nbytes].view(dtype).reshape(shape)
        self.steps = []
        for node in nodes:
            if node["index"] in skipped:
                continue
            missing = [self.infos[o][0] for o in node["outputs"] if o not in views]
            if missing:
                raise FormatError(f"node '{node['name']}' ({node['op']}): outputs {missing} have no arena slot")
            # Per input: an array (constant or arena view), a QWeight, None, or a graph input's index.
            ins = [None if i == -1 else fused[i] if i in fused else views.get(i, i) for i in node["inputs"]]
            self.steps.append((node, self.kernels[node["op"]], ins, [views[o] for o in node["outputs"]]))
        for i in self.outputs:
            if i not in views and i not in self.inputs:
                raise FormatError(f"graph output '{self.infos[i][0]}' has no arena slot")
        self.views = views

    def _type(self, vi: dict) -> tuple:
        t = vi["type"]
        if t is None or t["dtype"] not in DTYPES:
            raise FormatError(f"value '{vi['name']}' has no type or an unknown dtype")
        shape = tuple(t["shape"] or ())
        if t["unknown_rank"] or any(d < 0 for d in shape):
            raise FormatError(f"value '{vi['name']}' has a non-static shape: the packed file must fix every dim")
        if _span(shape) * DTYPES[t["dtype"]]().itemsize >= MAX_VALUE_BYTES:
            raise FormatError(f"value '{vi['name']}' has shape {list(shape)}: too large for any array")
        return np.dtype(DTYPES[t["dtype"]]), shape

    def _index(self, i: int) -> int:
        if not 0 <= i < len(self.infos):
            raise FormatError(f"value index {i} is out of range ({len(self.infos)} values)")
        return i

    def _check_order(self, nodes: list, consts: dict) -> dict:
        """SSA in execution order: each value written once (never a graph input or constant), read only
        after it is written; graph outputs defined. Returns each value's last node (the liveness rule of
        pack.lifetimes: a graph output lives past the last node)."""
        defined = set(consts)
        for i in self.inputs:
            if i in defined:
                raise FormatError(f"graph input '{self.infos[i][0]}' is also a constant or listed twice")
            defined.add(i)
        last = {}
        for node in nodes:
            for i in node["inputs"]:
                if i == -1:
                    continue
                if i not in defined:
                    raise FormatError(f"node '{node['name']}' ({node['op']}) reads '{self.infos[i][0]}' before any "
                                      f"node writes it")
                last[i] = node["index"]
            for o in node["outputs"]:
                if o in defined:
                    raise FormatError(f"node '{node['name']}' ({node['op']}) writes '{self.infos[o][0]}', which is "
                                      f"already defined")
                defined.add(o)
        for i in self.outputs:
            if i not in defined:
                raise FormatError(f"graph output '{self.infos[i][0]}' is never written")
            last[i] = len(nodes)
        return last

    def _by_name(self, name: str) -> int:
        if not hasattr(self, "_names"):
            self._names = {}
            for i, info in enumerate(self.infos):
                if info[0] in self._names:
                    raise FormatError(f"two values are named '{info[0]}'")
                self._names[info[0]] = i
        if name not in self._names:
            raise FormatError(f"the arena plan names an unknown value '{name}'")
        return self._names[name]

    def _tensor(self, td: dict, where: str) -> np.ndarray:
        dtype = np.dtype(DTYPES.get(td["dtype"], np.void)).newbyteorder("<")
        shape = tuple(td["shape"] or ())
        count = _count(shape)
        offset, nbytes = td["offset"], td["nbytes"]
        if dtype.kind == "V" or any(d < 0 for d in shape) or count * dtype.itemsize != nbytes or \
                _span(shape) * dtype.itemsize >= MAX_VALUE_BYTES or \
                offset % TENSOR_ALIGNMENT or offset + nbytes > len(self._data):
            raise FormatError(f"{where}: bad tensor data (dtype {td['dtype']}, shape {shape}, bytes {offset}+{nbytes})")
        return np.frombuffer(self._data, dtype, count, offset).reshape(shape)

    def _node(self, n: dict, k: int) -> dict:
        attrs = {}
        for a in n["attributes"] or ():
            field = ATTR_FIELDS.get(a["kind"])
            if field is None:
                raise FormatError(f"nodes[{k}]: attribute '{a['name']}' has unknown kind {a['kind']}")
            v = a[field]
            if v is None:
                raise FormatError(f"nodes[{k}]: attribute '{a['name']}' has no value")
            attrs[a["name"]] = (self._tensor(v, f"nodes[{k}].{a['name']}") if field == "tensor"
                                else tuple(v) if isinstance(v, (list, tuple)) else v)
        op = f"{n['domain']}.{n['op']}" if n["domain"] else n["op"]
        ins = [i if i == -1 else self._index(i) for i in n["inputs"] or ()]
        outs = [self._index(i) for i in n["outputs"] or ()]
        if not outs and op not in _NO_OUTPUTS:
            raise FormatError(f"nodes[{k}] ({op}) has no outputs")
        first = next((i for i in ins if i != -1), outs[0] if outs else None)
        dtype = self.infos[first][1].name if first is not None else "?"
        return {"index": k, "op": op, "name": n["name"] or f"nodes[{k}]", "inputs": ins, "outputs": outs,
                "attrs": attrs, "key": f"{op}:{dtype}"}

    def _check_kernels(self, nodes: list) -> None:
        """Refuse, at load time, a file with any op:dtype this stub has no kernel for."""
        missing = [f"node '{n['name']}' needs {n['key']}" for n in nodes
                   if n["key"].rpartition(":")[2] not in self.supports.get(n["op"], ())]
        if missing:
            raise UnsupportedOpError(f"{self.path}: the mobile runtime cannot run this model, it has no kernel "
                                     f"for: " + "; ".join(missing))

    def _fuse_dequantize(self, nodes: list, consts: dict) -> tuple[dict, set]:
        """({value: QWeight}, {indices of the fused nodes}) for each DequantizeLinear of constant per-axis int8 data (zero point absent or
        zero) whose output feeds only Conv/Gemm/MatMul as their weight (input 1)."""
        uses = {}
        for n in nodes:
            for pos, i in enumerate(n["inputs"]):
                uses.setdefault(i, []).append((n["op"], pos))
        fused, skipped = {}, set()
        for n in nodes:
            ins = n["inputs"]
            if n["op"] != "DequantizeLinear" or len(ins) < 2 or -1 in ins[:2] or \
                    not all(i in consts for i in ins if i != -1):
                continue
            q, scale = consts[ins[0]], consts[ins[1]]
            zero = consts.get(ins[2]) if len(ins) > 2 and ins[2] != -1 else None
            out = n["outputs"][0]
            if out in self.outputs:
                continue  # a graph output must be a real array in the arena
            axis = n["attrs"].get("axis", 1)
            if q.dtype != np.int8 or scale.ndim != 1 or (zero is not None and zero.any()) or \
                    not all(op in QUANT_CONSUMERS and pos == 1 for op, pos in uses.get(out, [("?", 0)])):
                continue
            if type(axis) is not int or not -q.ndim <= axis < q.ndim or scale.shape[0] != q.shape[axis] or \
                    scale.dtype.kind != "f" or (self.infos[out][1], self.infos[out][2]) != (scale.dtype, q.shape):
                raise FormatError(f"node '{n['name']}' (DequantizeLinear): int8 weight {list(q.shape)} with "
                                  f"{list(scale.shape)} {scale.dtype} scales along axis {axis} does not make its "
                                  f"output {self.infos[out][1]}{list(self.infos[out][2])}")
            fused[out] = QWeight(q, scale, axis)
            skipped.add(n["index"])
        return fused, skipped

    # ------------------------------------------------------------------ running
    def run(self, *args, **named) -> list:
        """Run on inputs given in order or by name; returns the outputs (copies out of the arena)."""
        names = [self.infos[i][0] for i in self.inputs]
        given = dict(zip(names, args), **named)
        if set(given) != set(names):
            raise InputError(f"expected inputs {names}, got {sorted(given)}")
        for i in self.inputs:
            name, dtype, shape = self.infos[i]
            x = np.asarray(given[name])
            if x.shape != shape or x.dtype != dtype:
                raise InputError(f"input '{name}' must be {dtype}{list(shape)}, got {x.dtype}{list(x.shape)}")
            self.views[i] = x
        for node, kernel, ins, outs in self.steps:
            args = [self.views[x] if isinstance(x, int) else x for x in ins]
            try:
                kernel(args, outs, node["attrs"])
            except KilnError:
                raise
            except Exception as e:  # noqa: BLE001 - a kernel meeting attributes or shapes it cannot take
                shapes = ", ".join("none" if x is None else f"{x.dtype}{list(x.shape)}" for x in args)
                raise ExecutionError(f"while running node '{node['name']}' ({node['op']}) on inputs ({shapes}): "
                                     f"{type(e).__name__}: {e}") from e
        return [np.array(self.views[i]) for i in self.outputs]


def load(path: str, families=kernel_families.FAMILIES, max_arena_bytes=packed.MAX_ARENA_BYTES) -> StubProgram:
    """Load and check a packed .kiln file (raises UnsupportedOpError / FormatError). The arena plan is
    checked before it is allocated (mobile_stub/packed.py), up to ``max_arena_bytes`` (None: no limit)."""
    return StubProgram(path, families, max_arena_bytes)

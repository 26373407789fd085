"""Checked FlatBuffer reading, driven by the layout generated from kiln.fbs.

The Python FlatBuffers runtime trusts its input: a bad offset reads garbage or raises from
deep inside it, and its accessors cost a few function calls per field. ``read_flatbuffer``
instead walks the buffer once, checking as it goes that every table, vtable, field, vector
and string lies inside the buffer, that required fields are present, and that the walk stays
bounded (nesting depth, and a cap on objects visited that also defeats shared-subtree
"billion laughs" buffers); it returns plain Python values: a table becomes a dict of its
fields (absent scalars take their schema default, absent references None), a vector a list,
a string a str. Errors are FormatError naming the file offset and the field path.

Limits a service sets (issue 16; ``kiln.serializer.reader.LoadLimits`` passes them): ``max_tables``
caps how many tables of a kind the buffer may hold (Node, ValueInfo), checked on each vector's
length before any of its items is decoded, so a million-node file is refused in microseconds;
``max_units`` caps the objects decoded (the memory budget: each unit is one decoded object or
4 bytes of payload); ``max_depth`` the table nesting; ``deadline`` (``time.monotonic()``) the time.
"""
from __future__ import annotations

import struct
import time
from typing import Any, Mapping, Optional

from kiln.errors import FormatError
from kiln.serializer.fb.layout import ROOT, SCALARS, TABLES
from kiln.serializer.format import MAX_TABLE_DEPTH

MAX_DEPTH = MAX_TABLE_DEPTH  # what MAX_SUBGRAPH_NESTING levels of If/Loop bodies take (format.py)
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_VT_HEAD = struct.Struct("<HH")


_EARLY = {("Model", "graph"), ("Graph", "nodes")}
_LIMIT_NAMES = {"Node": "nodes (Node tables)", "ValueInfo": "values (ValueInfo tables)"}


def _compile() -> dict:
    """Per table: (field, vtable slot, kind, detail, required, default, struct) tuples."""
    plan = {}
    for name, fields in TABLES.items():
        rows = []
        for field, slot, kind, detail, required in fields:
            fmt, default = SCALARS[name].get(field, (None, None))
            packer = struct.Struct("<" + fmt) if kind == "scalar" else None
            rows.append((field, slot, kind, fmt if kind == "vector_scalar" else detail, required,
                         default, packer))
        # The node vectors first (Model.graph before Model.values, Graph.nodes before the rest):
        # their lengths are what LoadLimits.max_nodes checks, so a million-node file is refused
        # before anything else in it is decoded. Only the order of the walk changes.
        rows.sort(key=lambda row: (name, row[0]) not in _EARLY)
        plan[name] = tuple(rows)
    return plan


_PLAN = _compile()
_NSLOTS = {name: 1 + max((row[1] for row in rows), default=-1) for name, rows in _PLAN.items()}


class _Reader:
    def __init__(self, buf: bytes, base: int, *, max_depth: int = MAX_DEPTH,
                 max_tables: Optional[Mapping[str, int]] = None, max_units: Optional[int] = None,
                 deadline: Optional[float] = None):
        self.buf = buf
        self.size = len(buf)
        self.base = base  # file offset of the buffer, for messages
        # A unit is an object or 4 bytes of a string's or scalar vector's payload: each takes at
        # least 4 bytes of its own, so a sound buffer needs at most size/4 units, while a shared
        # object or payload is charged again on every path that reaches it.
        self.budget = self.size // 4 + 64
        self.units_limited = max_units is not None and max_units < self.budget
        if self.units_limited:
            self.budget = max_units
        self.max_depth = max_depth
        self.max_tables = dict(max_tables or {})
        self.tables_seen = dict.fromkeys(self.max_tables, 0)
        self.deadline = deadline

    # Paths are (parent, step) pairs, formatted only when an error is raised.
    def fail(self, pos: int, path: Any, what: str) -> None:
        raise FormatError(f"corrupt model structure at file offset {self.base + pos} ({_path(path)}): {what}")

    def need(self, pos: int, n: int, path: Any, what: str) -> None:
        if pos < 0 or pos + n > self.size:
            self.fail(pos, path, f"{what} ({n} bytes) runs past the end of the FlatBuffer ({self.size} bytes)")

    def spend(self, pos: int, path: Any, units: int = 1) -> None:
        self.budget -= units
        if self.budget < 0:
            self.over_budget(pos, path)

    def over_budget(self, pos: int, path: Any) -> None:
        if self.units_limited:
            self.fail(pos, path, "decoding the model structure would pass the loader's memory budget "
                      "(LoadLimits.max_memory_bytes)")
        self.fail(pos, path, "more objects than the buffer can hold (shared or looping references)")

    def count(self, name: str, n: int, pos: int, path: Any) -> None:
        """Charge ``n`` tables of kind ``name`` against its limit, before decoding any."""
        seen = self.tables_seen[name] + n
        self.tables_seen[name] = seen
        if seen > self.max_tables[name]:
            what = _LIMIT_NAMES.get(name, f"{name} tables")
            raise FormatError(f"the model has more than {self.max_tables[name]:,} {what} (found at file offset "
                              f"{self.base + pos}, {_path(path)}): refused by a limit of this load "
                              f"(LoadLimits.max_{'nodes' if name == 'Node' else 'values'})")

    def table(self, pos: int, name: str, path: Any, depth: int) -> dict:
        if depth > self.max_depth:
            self.fail(pos, path, f"nesting deeper than {self.max_depth}")
        self.budget -= 1
        if self.budget < 0:
            self.over_budget(pos, path)
        buf, size = self.buf, self.size
        # The bounds checks are inlined here: this loop runs once per table of the model.
        if pos < 0 or pos + 4 > size:
            self.need(pos, 4, path, "table")
        vt = pos - _I32.unpack_from(buf, pos)[0]
        if vt < 0 or vt + 4 > size:
            self.need(vt, 4, path, "vtable")
        vt_size, t_size = _VT_HEAD.unpack_from(buf, vt)
        if vt_size < 4 or vt_size % 2:
            self.fail(vt, path, f"bad vtable size {vt_size}")
        if vt + vt_size > size or pos + t_size > size:
            self.need(vt, vt_size, path, "vtable")
            self.need(pos, t_size, path, "table body")
        plan = _PLAN[name]
        # The vtable's field offsets in one unpack (as many as the schema has fields).
        n_entries = min((vt_size - 4) >> 1, _NSLOTS[name])
        entries = _vector_struct(n_entries, "H").unpack_from(buf, vt + 4)
        out = {}
        for field, slot, kind, detail, required, default, packer in plan:
            off = entries[slot] if slot < n_entries else 0
            if off == 0:
                if required:
                    self.fail(pos, (path, field), "required field is missing")
                out[field] = default
                continue
            size = packer.size if packer is not None else 4
            if off + size > t_size:
                self.fail(pos + off, (path, field), f"field lies outside its table ({t_size} bytes)")
            at = pos + off
            if packer is not None:
                out[field] = packer.unpack_from(buf, at)[0]
                continue
            target = at + _U32.unpack_from(buf, at)[0]
            if kind == "table":
                out[field] = self.table(target, detail, (path, field), depth + 1)
            elif kind == "string":
                out[field] = self.string(target, (path, field))
            elif kind == "vector_scalar":
                out[field] = self.scalars(target, detail, (path, field))
            else:
                out[field] = self.references(target, kind, detail, (path, field), depth)
        return out

    def string(self, pos: int, path: Any) -> str:
        buf, size = self.buf, self.size
        if pos < 0 or pos + 4 > size:
            self.need(pos, 4, path, "string length")
        n = _U32.unpack_from(buf, pos)[0]
        if pos + 5 + n > size:
            self.need(pos + 4, n + 1, path, f"string of {n} bytes")
        self.budget -= 1 + (n >> 2)
        if self.budget < 0:
            self.over_budget(pos, path)
        try:
            return str(buf[pos + 4:pos + 4 + n], "utf-8")  # bytes or a memoryview (no copy of the file)
        except UnicodeDecodeError:
            self.fail(pos, path, "string is not valid UTF-8")

    def scalars(self, pos: int, fmt: str, path: Any) -> tuple:
        buf, size = self.buf, self.size
        if pos < 0 or pos + 4 > size:
            self.need(pos, 4, path, "vector length")
        n = _U32.unpack_from(buf, pos)[0]
        item = _ITEM_SIZE[fmt]
        if pos + 4 + n * item > size:
            self.need(pos + 4, n * item, path, f"vector of {n} elements")
        self.budget -= 1 + (n * item >> 2)
        if self.budget < 0:
            self.over_budget(pos, path)
        return _vector_struct(n, fmt).unpack_from(buf, pos + 4)

    def references(self, pos: int, kind: str, detail: Optional[str], path: Any, depth: int) -> list:
        buf, size = self.buf, self.size
        self.budget -= 1
        if self.budget < 0:
            self.over_budget(pos, path)
        if pos < 0 or pos + 4 > size:
            self.need(pos, 4, path, "vector length")
        n = _U32.unpack_from(buf, pos)[0]
        if not n:
            return []
        if pos + 4 + n * 4 > size:
            self.need(pos + 4, n * 4, path, f"vector of {n} elements")
        if detail in self.max_tables:
            self.count(detail, n, pos, path)
        offsets = _vector_struct(n, "I").unpack_from(buf, pos + 4)
        if kind != "vector_table":
            string = self.string
            return [string(pos + 4 + 4 * i + off, (path, i)) for i, off in enumerate(offsets)]
        out = []
        deadline = self.deadline
        table = self.table
        for i, off in enumerate(offsets):
            out.append(table(pos + 4 + 4 * i + off, detail, (path, i), depth + 1))
            if deadline is not None and not i & 1023 and time.monotonic() > deadline:
                self.fail(pos, path, "reading the model structure ran past the load's time budget "
                          "(LoadLimits.max_seconds)")
        return out


_ITEM_SIZE = {c: struct.calcsize("<" + c) for c in "bBhHiIqQfd?"}
_STRUCTS: dict = {}


def _vector_struct(n: int, fmt: str) -> struct.Struct:
    """A compiled ``<{n}{fmt}`` (kept for short vectors, the many shapes and input lists)."""
    key = (n, fmt)
    st = _STRUCTS.get(key)
    if st is None:
        st = struct.Struct(f"<{n}{fmt}")
        if n <= 64:
            _STRUCTS[key] = st
    return st


def _path(path: Any) -> str:
    parts = []
    while isinstance(path, tuple):
        path, step = path
        parts.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return str(path) + "".join(reversed(parts))


def read_flatbuffer(buf: bytes, base: int = 0, identifier: bytes = b"KILN", *, max_depth: int = MAX_DEPTH,
                    max_tables: Optional[Mapping[str, int]] = None, max_units: Optional[int] = None,
                    deadline: Optional[float] = None) -> dict:
    """Check and decode a FlatBuffer of kiln.fbs's root table (raises FormatError). The keyword
    limits are described in the module docstring."""
    reader = _Reader(buf, base, max_depth=max_depth, max_tables=max_tables, max_units=max_units,
                     deadline=deadline)
    reader.need(0, 8, ROOT, "root offset and file identifier")
    if bytes(buf[4:8]) != identifier:
        reader.fail(4, ROOT, f"file identifier is {bytes(buf[4:8])!r}, expected {identifier!r}")
    return reader.table(_U32.unpack_from(buf, 0)[0], ROOT, ROOT, 0)

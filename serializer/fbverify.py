"""A FlatBuffer verifier driven by the schema layout generated from kiln.fbs.

The Python FlatBuffers runtime trusts its input: a bad offset reads garbage or raises from
deep inside it. Before decoding anything, ``verify_flatbuffer`` walks every table, vector and
string reachable from the root and checks that each lies inside the buffer, that required
fields are present, and that the walk stays bounded (nesting depth, and a cap on objects
visited that also defeats shared-subtree "billion laughs" files). After it passes, the
generated accessors can only read inside the buffer.
"""
from __future__ import annotations

import struct

from kiln.errors import FormatError
from kiln.serializer.fb.layout import ROOT, TABLES

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")

MAX_DEPTH = 64


class _Walk:
    def __init__(self, buf, base: int):
        self.buf = buf
        self.size = len(buf)
        self.base = base  # file offset of the buffer, for messages
        self.budget = self.size // 4 + 64  # no legitimate buffer holds more objects than this

    def fail(self, pos: int, path: str, what: str) -> None:
        raise FormatError(f"corrupt model structure at file offset {self.base + pos} ({path}): {what}")

    def need(self, pos: int, n: int, path: str, what: str) -> None:
        if pos < 0 or pos + n > self.size:
            self.fail(pos, path, f"{what} ({n} bytes) runs past the end of the FlatBuffer ({self.size} bytes)")

    def spend(self, pos: int, path: str) -> None:
        self.budget -= 1
        if self.budget < 0:
            self.fail(pos, path, "more objects than the buffer can hold (shared or looping references)")

    def table(self, pos: int, name: str, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            self.fail(pos, path, f"nesting deeper than {MAX_DEPTH}")
        self.spend(pos, path)
        self.need(pos, 4, path, "table")
        vt = pos - _I32.unpack_from(self.buf, pos)[0]
        self.need(vt, 4, path, "vtable")
        vt_size, t_size = _U16.unpack_from(self.buf, vt)[0], _U16.unpack_from(self.buf, vt + 2)[0]
        if vt_size < 4 or vt_size % 2:
            self.fail(vt, path, f"bad vtable size {vt_size}")
        self.need(vt, vt_size, path, "vtable")
        self.need(pos, t_size, path, "table body")
        for field, slot, kind, detail, required in TABLES[name]:
            entry = 4 + 2 * slot
            off = _U16.unpack_from(self.buf, vt + entry)[0] if entry + 2 <= vt_size else 0
            fpath = f"{path}.{field}"
            if off == 0:
                if required:
                    self.fail(pos, fpath, "required field is missing")
                continue
            size = detail if kind == "scalar" else 4
            if off + size > t_size:
                self.fail(pos + off, fpath, f"field lies outside its table ({t_size} bytes)")
            if kind != "scalar":
                self.reference(pos + off, kind, detail, fpath, depth)

    def target(self, pos: int, path: str) -> int:
        return pos + _U32.unpack_from(self.buf, pos)[0]

    def reference(self, pos: int, kind: str, detail, path: str, depth: int) -> None:
        at = self.target(pos, path)
        if kind == "table":
            self.table(at, detail, path, depth + 1)
        elif kind == "string":
            self.string(at, path)
        else:
            self.vector(at, kind, detail, path, depth)

    def string(self, pos: int, path: str) -> None:
        self.spend(pos, path)
        self.need(pos, 4, path, "string length")
        n = _U32.unpack_from(self.buf, pos)[0]
        self.need(pos + 4, n + 1, path, f"string of {n} bytes")

    def vector(self, pos: int, kind: str, detail, path: str, depth: int) -> None:
        self.spend(pos, path)
        self.need(pos, 4, path, "vector length")
        n = _U32.unpack_from(self.buf, pos)[0]
        elem = detail if kind == "vector_scalar" else 4
        self.need(pos + 4, n * elem, path, f"vector of {n} elements")
        if kind == "vector_scalar":
            return
        for i in range(n):
            at = pos + 4 + 4 * i
            self.reference(at, "table" if kind == "vector_table" else "string", detail, f"{path}[{i}]", depth)


def verify_flatbuffer(buf, base: int = 0, identifier: bytes = b"KILN") -> None:
    """Raise FormatError unless ``buf`` is a structurally sound FlatBuffer of kiln.fbs's root table."""
    walk = _Walk(buf, base)
    walk.need(0, 8, ROOT, "root offset and file identifier")
    if bytes(buf[4:8]) != identifier:
        walk.fail(4, ROOT, f"file identifier is {bytes(buf[4:8])!r}, expected {identifier!r}")
    walk.table(walk.target(0, ROOT), ROOT, ROOT, 0)

"""The fixed header of a .kiln file and the constants of its layout.

    offset size  field
    0      8     magic  b"KILN\\x89\\r\\n\\x1a"  (high bit and CR/LF catch text-mode and 7-bit mangling)
    8      4     header_version (u32)      version of this header layout
    12     4     header_size (u32)         64
    16     8     flatbuffer_offset (u64)   64
    24     8     flatbuffer_size (u64)
    32     8     data_offset (u64)         multiple of 4096, >= end of the FlatBuffer
    40     8     data_size (u64)
    48     4     flatbuffer_crc32 (u32)    zlib.crc32 of the FlatBuffer bytes
    52     4     data_crc32 (u32)          zlib.crc32 of the data segment bytes
    56     4     flags (u32)               reserved, 0
    60     4     header_crc32 (u32)        zlib.crc32 of bytes 0..60

All integers little-endian. The FlatBuffer (kiln.fbs, identifier "KILN") follows the header;
the data segment (every constant tensor, each 64-byte aligned) starts at a 4096-byte boundary.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from kiln.errors import FormatError

MAGIC = b"KILN\x89\r\n\x1a"
HEADER_VERSION = 1
HEADER_SIZE = 64
FILE_IDENTIFIER = b"KILN"
TENSOR_ALIGNMENT = 64
SEGMENT_ALIGNMENT = 4096

# Subgraph nesting (If/Loop bodies inside bodies), one rule for every path that makes or reads a
# graph: the writer refuses a deeper graph at save time, the reader and the FlatBuffer walk refuse a
# deeper file, the ONNX importer a deeper model. The main graph is level 0; MAX_SUBGRAPH_NESTING
# levels may nest below it. ONNX cannot carry much more: protobuf's default recursion limit (100
# messages, 3 per If level: Node > Attribute > Graph) stops a parsed ModelProto at about 32 levels.
MAX_SUBGRAPH_NESTING = 32
# The FlatBuffer table depth that nesting takes: Model > Graph is 1, each level adds Node > Attribute
# > Graph (3), and the deepest tables of a graph are Node > Attribute > TensorData (3 more).
MAX_TABLE_DEPTH = 1 + 3 * MAX_SUBGRAPH_NESTING + 3


def __getattr__(name: str):
    """ATTR_KIND_CODES / ATTR_KINDS_BY_CODE: kiln.ir's attribute kinds <-> the schema's AttrKind codes
    (the generated enum is the contract). Built on first use, so that the header code above imports
    without kiln.ir: the mobile stub's self-contained bundle reads files through this module."""
    if name in ("ATTR_KIND_CODES", "ATTR_KINDS_BY_CODE"):
        from kiln.ir.registry import AttrKind
        from kiln.serializer.fb.AttrKind import AttrKind as FbAttrKind

        codes = {k: getattr(FbAttrKind, k.name) for k in AttrKind}
        globals().update(ATTR_KIND_CODES=codes, ATTR_KINDS_BY_CODE={c: k for k, c in codes.items()})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_STRUCT = struct.Struct("<8sIIQQQQIII")  # everything but the trailing header crc
assert _STRUCT.size == HEADER_SIZE - 4


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Header:
    flatbuffer_offset: int
    flatbuffer_size: int
    data_offset: int
    data_size: int
    flatbuffer_crc32: int
    data_crc32: int
    header_version: int = HEADER_VERSION
    flags: int = 0

    def pack(self) -> bytes:
        body = _STRUCT.pack(MAGIC, self.header_version, HEADER_SIZE, self.flatbuffer_offset,
                            self.flatbuffer_size, self.data_offset, self.data_size, self.flatbuffer_crc32,
                            self.data_crc32, self.flags)
        return body + struct.pack("<I", zlib.crc32(body))


def parse_header(buf, file_size: int) -> Header:
    """Read and bounds-check the header of a file of ``file_size`` bytes held in ``buf``."""
    if file_size < HEADER_SIZE:
        raise FormatError(f"not a .kiln file: {file_size} bytes is shorter than the {HEADER_SIZE}-byte header")
    raw = bytes(buf[:HEADER_SIZE])
    magic, version, hsize, fb_off, fb_size, d_off, d_size, fb_crc, d_crc, flags = _STRUCT.unpack_from(raw)
    if magic != MAGIC:
        if magic[:4] == MAGIC[:4]:
            raise FormatError("bad magic at offset 0: the file looks like a .kiln file mangled by a text-mode "
                              "transfer (line endings or the high bit changed)")
        raise FormatError(f"not a .kiln file: magic at offset 0 is {magic!r}, expected {MAGIC!r}")
    if version > HEADER_VERSION:
        raise FormatError(f"file header version {version} is newer than this kiln reads ({HEADER_VERSION}); "
                          "upgrade kiln to load it")
    (stored_crc,) = struct.unpack_from("<I", raw, HEADER_SIZE - 4)
    if zlib.crc32(raw[:HEADER_SIZE - 4]) != stored_crc:
        raise FormatError("header checksum mismatch (bytes 0..64): the header is corrupt")
    if version < 1 or hsize != HEADER_SIZE:
        raise FormatError(f"bad header: version {version}, size {hsize} (offset 8)")
    if fb_off != HEADER_SIZE or fb_size < 8:
        raise FormatError(f"bad header: FlatBuffer at offset {fb_off} with size {fb_size} (offset 16)")
    if d_off % SEGMENT_ALIGNMENT or d_off < fb_off + fb_size:
        raise FormatError(f"bad header: data segment offset {d_off} is not 4096-aligned after the FlatBuffer "
                          f"(which ends at {fb_off + fb_size})")
    if d_off + d_size > file_size or fb_off + fb_size > file_size:
        raise FormatError(f"file is truncated: the header says it needs {max(d_off + d_size, fb_off + fb_size)} "
                          f"bytes, it has {file_size}")
    return Header(fb_off, fb_size, d_off, d_size, fb_crc, d_crc, version, flags)

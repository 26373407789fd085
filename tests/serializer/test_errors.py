"""Bad files fail with FormatError saying what is wrong and where; versions are enforced;
saving is atomic."""
from __future__ import annotations

import struct

import numpy as np
import pytest

import kiln
from kiln import FormatError, KilnError
from kiln.ir import Graph, versions
from kiln.ir.ops._common import infer_same
from kiln.ir.registry import Attr, AttrKind, In, op
from kiln.serializer import writer
from kiln.serializer.format import HEADER_SIZE, parse_header
from kiln.tools.fuzz import fix_checksums


def small_graph(**graph_kw) -> Graph:
    g = Graph("small", **graph_kw)
    x = g.add_input("x", "float32", ("batch", 4))
    w = g.add_initializer("w", np.arange(16, dtype=np.float32).reshape(4, 4))
    g.outputs = [g.op("Relu", g.op("MatMul", x, w))]
    return g


@pytest.fixture
def model(tmp_path):
    path = kiln.save(small_graph(), tmp_path / "m.kiln")
    return path, bytearray(path.read_bytes())


def load(data) -> Graph:
    return kiln.load_graph_from_bytes(bytes(data))


def test_empty_short_and_foreign_files(tmp_path):
    (tmp_path / "empty.kiln").write_bytes(b"")
    with pytest.raises(FormatError, match="empty file"):
        kiln.load_graph(tmp_path / "empty.kiln")
    with pytest.raises(FormatError, match="shorter than the 64-byte header"):
        load(b"KILN")
    with pytest.raises(FormatError, match="not a .kiln file: magic at offset 0"):
        load(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(KilnError, match="cannot read"):
        kiln.load_graph(tmp_path / "missing.kiln")


def test_text_mode_mangling_is_recognised(model):
    _, data = model
    mangled = data[:4] + data[4:8].replace(b"\r\n", b"\n") + data[8:]
    with pytest.raises(FormatError, match="text-mode"):
        load(mangled)


def test_header_corruption(model):
    _, data = model
    data[20] ^= 1
    with pytest.raises(FormatError, match="header checksum mismatch"):
        load(data)


def test_newer_header_version_names_both(model):
    _, data = model
    data[8:12] = struct.pack("<I", 7)
    with pytest.raises(FormatError, match="header version 7 is newer than this kiln reads \\(1\\)"):
        load(data)


def test_truncated_file_says_so(model):
    path, data = model
    path.write_bytes(data[:-10])
    with pytest.raises(FormatError, match=rf"{path.name}: file is truncated"):
        kiln.load_graph(path)


def test_graph_section_corruption_is_located(model):
    _, data = model
    data[HEADER_SIZE + 40] ^= 0xFF
    with pytest.raises(FormatError, match=r"graph section is corrupt: checksum mismatch over bytes 64\.\."):
        load(data)


def test_data_corruption_checked_or_skipped(model):
    _, data = model
    h = parse_header(data, len(data))
    data[h.data_offset + 5] ^= 0xFF
    with pytest.raises(FormatError, match="weights are corrupt: data segment checksum mismatch"):
        load(data)
    g = kiln.load_graph_from_bytes(bytes(data), check_data=False)
    assert g.initializers["w"].const.shape == (4, 4)


def test_structural_damage_behind_valid_checksums(model):
    _, data = model
    h = parse_header(data, len(data))
    root = struct.unpack_from("<I", data, h.flatbuffer_offset)[0]
    data[h.flatbuffer_offset:h.flatbuffer_offset + 4] = struct.pack("<I", root + 10_000_000)
    with pytest.raises(FormatError, match=r"corrupt model structure at file offset \d+ \(Model\)"):
        load(fix_checksums(data))


def test_newer_opset_and_ir_name_both_versions(tmp_path):
    newer = small_graph(opset_version=versions.OPSET_VERSION + 1)
    path = kiln.save(newer, tmp_path / "new.kiln")
    with pytest.raises(FormatError, match=rf"opset {versions.OPSET_VERSION + 1}.*opset <= {versions.OPSET_VERSION}: "
                                          "upgrade kiln"):
        kiln.load_graph(path)
    g = small_graph()
    g.ir_version = versions.IR_VERSION + 1
    with pytest.raises(FormatError, match=rf"IR version {versions.IR_VERSION + 1}"):
        kiln.load_graph(kiln.save(g, tmp_path / "ir.kiln"))


DOMAIN = "kiln.test_serializer_upgrade"


@op("Shift", domain=DOMAIN, since_version=1, inputs=[In("X")], attrs=[Attr("by", AttrKind.FLOAT, 0.0)],
    infer=infer_same)
def _shift_v1(x, by):
    return (x + by).astype(x.dtype)


@op("Shift", domain=DOMAIN, since_version=2, inputs=[In("X")], attrs=[Attr("minus", AttrKind.FLOAT, 0.0)],
    infer=infer_same)
def _shift_v2(x, minus):
    return (x - minus).astype(x.dtype)


@versions.register_upgrader("Shift", domain=DOMAIN, from_version=1)
def _upgrade_shift(graph, node):
    node.attrs = {"minus": -node.attrs.get("by", 0.0)}


def test_older_file_is_upgraded_on_load(tmp_path, monkeypatch):
    g = Graph(opset_version=1)
    x = g.add_input("x", "float32", (2,))
    g.outputs = [g.op("Shift", x, domain=DOMAIN, by=3.0)]
    path = kiln.save(g, tmp_path / "old.kiln")
    monkeypatch.setattr(versions, "OPSET_VERSION", 2)
    import kiln.serializer.reader as reader
    monkeypatch.setattr(reader, "OPSET_VERSION", 2)
    loaded = kiln.load_graph(path)
    assert loaded.opset_version == 2 and loaded.nodes[0].attrs == {"minus": -3.0}
    kept = kiln.load_graph(path, upgrade=False)
    assert kept.opset_version == 1 and kept.nodes[0].attrs == {"by": 3.0}


def test_unknown_op_in_file_is_a_format_error(model):
    path, data = model
    i = data.find(b"Relu")
    data[i:i + 4] = b"Rulu"
    with pytest.raises(FormatError, match="op 'Rulu' is not registered"):
        load(fix_checksums(data))


def test_save_is_atomic(tmp_path, monkeypatch):
    path = kiln.save(small_graph(), tmp_path / "m.kiln")
    before = path.read_bytes()

    def boom(f, constants):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(writer, "_write_segment", boom)
    with pytest.raises(OSError, match="disk full"):
        kiln.save(small_graph(), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.kiln"]


def test_untyped_value_cannot_be_saved(tmp_path):
    g = small_graph()
    g.nodes[0].outputs[0].type = None
    with pytest.raises(ValueError, match="has no type; run shape inference"):
        kiln.save(g, tmp_path / "m.kiln")

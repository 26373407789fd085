"""``kiln inspect``, run as a real process on files written by kiln.save; numbers are checked
against values computed here from the graph and the raw file bytes, not from the summary."""
from __future__ import annotations

import importlib.util
import json
import re
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.ir import Graph
from kiln.serializer import reader
from kiln.serializer.inspect import format_summary, read_summary

EXAMPLES = Path(kiln.__file__).resolve().parent / "examples"


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", "inspect", *map(str, args)], capture_output=True,
                          text=True, timeout=120, **kwargs)


def quickstart_graph() -> Graph:
    spec = importlib.util.spec_from_file_location("kiln_quickstart_example", EXAMPLES / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    g = module.build_model()
    g.metadata.props = {"license": "MIT", "task": "classification"}
    return g


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Graph]:
    g = quickstart_graph()
    path = tmp_path_factory.mktemp("inspect") / "tiny_cnn.kiln"
    kiln.save(g, path)
    return path, g


def raw_header(path: Path) -> dict:
    """The header fields read with struct, independently of kiln.serializer.format."""
    fields = struct.unpack_from("<8sIIQQQQIII", path.read_bytes()[:64])
    names = ["magic", "header_version", "header_size", "flatbuffer_offset", "flatbuffer_size", "data_offset",
             "data_size", "flatbuffer_crc32", "data_crc32", "flags"]
    return dict(zip(names, fields))


def flipped(src: Path, dst: Path, offset: int) -> Path:
    data = bytearray(src.read_bytes())
    data[offset] ^= 0xFF
    dst.write_bytes(bytes(data))
    return dst


# ---- the summary


def test_text_output_has_every_field(model):
    path, g = model
    r = run(path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    h = raw_header(path)
    params = sum(v.const.size for v in g.initializers.values())
    assert f"{path}: " in out and f"({path.stat().st_size:,} bytes)" in out
    assert f"version {h['header_version']}" in out
    assert f"bytes {h['flatbuffer_offset']}..{h['flatbuffer_offset'] + h['flatbuffer_size']}" in out
    assert f"crc32 {h['flatbuffer_crc32']:08x}" in out and f"crc32 {h['data_crc32']:08x} verified" in out
    assert f"IR version {kiln.IR_VERSION}, opset {kiln.OPSET_VERSION}" in out
    assert f"producer   kiln {kiln.__version__}" in out
    assert g.metadata.doc_string in out and "license = MIT" in out and "task = classification" in out
    assert "image  float32[batch,3,32,32]" in out and "softmax  float32[batch,10]" in out
    assert f"{len(g.nodes)} nodes" in out and "  Conv                3" in out
    assert f"parameters: {params:,} elements" in out and "float32" in out
    assert r.stderr == ""


def test_json_counts_match_the_graph_and_the_file(model):
    path, g = model
    r = run(path, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    inits = list(g.initializers.values())
    assert s["parameters"] == sum(v.const.size for v in inits) > 0
    assert s["parameter_bytes"] == sum(v.const.nbytes for v in inits)
    assert s["parameter_bytes_by_dtype"] == {"float32": s["parameter_bytes"]}
    counts = Counter(n.op for n in g.nodes)
    assert s["ops"] == dict(counts) and s["nodes"] == len(g.nodes) and s["subgraphs"] == 0
    assert list(s["ops"]) == sorted(counts, key=lambda op: (-counts[op], op))
    assert s["inputs"] == [{"name": "image", "dtype": "float32", "shape": ["batch", 3, 32, 32]}]
    assert s["outputs"] == [{"name": g.outputs[0].name, "dtype": "float32", "shape": ["batch", 10]}]
    h = raw_header(path)
    assert s["header"] == {k: v for k, v in h.items() if k not in ("magic", "header_size")}
    assert s["file_size"] == path.stat().st_size == h["data_offset"] + h["data_size"]
    assert s["data_checksum_verified"] is True
    assert (s["ir_version"], s["opset_version"]) == (kiln.IR_VERSION, kiln.OPSET_VERSION)
    assert s["producer"] == {"name": "kiln", "version": kiln.__version__}
    assert s["doc_string"] == g.metadata.doc_string and s["metadata"] == g.metadata.props
    assert s["graph_name"] == "tiny_cnn" and "ir" not in s


def test_graph_option_prints_the_ir_after_the_summary(model):
    path, _ = model
    ir = str(kiln.load_graph(path))
    r = run(path, "--graph", "--verify")
    assert r.returncode == 0, r.stderr
    summary, _, printed = r.stdout.partition("\n\n")
    assert "parameters:" in summary and printed.rstrip("\n") == ir
    assert "graph tiny_cnn(%image: float32[batch,3,32,32]) opset=1 {" in printed
    r = run(path, "--graph", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ir"] == ir


def branchy_graph() -> Graph:
    """If with a Constant (tensor attribute) in one branch and an initializer in the other, a
    weight shared by two initializers, a symbolic + unknown dim and an unknown-rank input."""
    g = Graph("branchy")
    c = g.add_input("c", "bool", [])
    x = g.add_input("x", "float32", ["batch", None])
    g.add_input("extra", "int64", None)
    shared = np.arange(6, dtype=np.float64).reshape(2, 3)
    w1 = g.add_initializer("w1", shared)
    w2 = g.add_initializer("w2", shared)  # the same array: stored once, counted once
    then_g = g.subgraph("then")
    k = then_g.op("Constant", value=np.full((2, 2), 2, np.float32))
    then_g.outputs = [then_g.op("Mul", x, then_g.op("ReduceMax", k, keepdims=0))]
    else_g = g.subgraph("else")
    one = else_g.add_initializer("one", np.ones((), np.float32))
    else_g.outputs = [else_g.op("Sub", x, one)]
    g.outputs = [g.op("If", c, then_branch=then_g, else_branch=else_g), g.op("Add", w1, w2)]
    return g


def test_subgraphs_tensor_attributes_and_shared_weights(tmp_path):
    g = branchy_graph()
    kiln.verify(g)
    path = tmp_path / "branchy.kiln"
    kiln.save(g, path)
    s = read_summary(path)
    # 6 float64 (stored once) + 4 float32 in the Constant + 1 float32 initializer in the else branch
    assert s["parameters"] == 6 + 4 + 1
    assert s["parameter_bytes_by_dtype"] == {"float64": 48, "float32": 20}
    assert s["parameter_bytes"] == 68
    assert s["ops"] == {"Add": 1, "Constant": 1, "If": 1, "Mul": 1, "ReduceMax": 1, "Sub": 1}
    assert s["nodes"] == 6 and s["subgraphs"] == 2
    assert [(v["name"], v["dtype"], v["shape"]) for v in s["inputs"]] == [
        ("c", "bool", []), ("x", "float32", ["batch", None]), ("extra", "int64", None)]
    text = format_summary(s)
    assert "x      float32[batch,?]" in text and "extra  int64[*]" in text and "(2 subgraphs)" in text
    assert json.loads(json.dumps(s)) == s


def test_large_data_is_checked_only_with_verify(tmp_path, monkeypatch):
    path = tmp_path / "m.kiln"
    kiln.save(quickstart_graph(), path)
    bad = flipped(path, tmp_path / "bad.kiln", raw_header(path)["data_offset"] + 100)
    # Pretend every data segment is "large": load_graph then skips the data checksum unless asked.
    monkeypatch.setattr(reader, "AUTO_CHECK_DATA_BYTES", 0)
    s = read_summary(bad)
    assert s["data_checksum_verified"] is False
    assert "not verified (use --verify)" in format_summary(s)
    with pytest.raises(kiln.FormatError, match="weights are corrupt"):
        read_summary(bad, verify=True)
    assert read_summary(path, verify=True)["data_checksum_verified"] is True


# ---- errors: one line on stderr, exit 1, no traceback


def _corrupt_files(tmp_path: Path, good: Path) -> dict:
    h = raw_header(good)
    text = tmp_path / "notes.kiln"
    text.write_text("just some text, long enough to fill a whole 64-byte header and then some more\n")
    truncated = tmp_path / "truncated.kiln"
    truncated.write_bytes(good.read_bytes()[:3000])
    return {
        "missing": (tmp_path / "missing.kiln", "cannot read .*missing.kiln: No such file or directory"),
        "folder": (tmp_path, "cannot read .*: Is a directory"),
        "empty": (_write(tmp_path / "empty.kiln", b""), "not a .kiln file: 0 bytes"),
        "text": (text, "not a .kiln file: magic at offset 0"),
        "truncated": (truncated, "file is truncated"),
        "header": (flipped(good, tmp_path / "hdr.kiln", 20), "header checksum mismatch"),
        "graph": (flipped(good, tmp_path / "fb.kiln", 64 + h["flatbuffer_size"] // 2), "graph section is corrupt"),
        "data": (flipped(good, tmp_path / "data.kiln", h["data_offset"] + 8), "weights are corrupt"),
    }


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", ["missing", "folder", "empty", "text", "truncated", "header", "graph", "data"])
def test_bad_files_fail_with_one_clean_message(model, tmp_path, case):
    path, expected = _corrupt_files(tmp_path, model[0])[case]
    r = run(path)
    assert r.returncode == 1, r.stdout
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith("kiln inspect: error: ") and r.stderr.count("\n") == 1
    assert re.search(expected, r.stderr), r.stderr


def test_closed_pipe_is_not_a_traceback(model):
    # The reader closes its end before the command prints (it needs ~0.1 s to start).
    p = subprocess.Popen([sys.executable, "-m", "kiln", "inspect", str(model[0]), "--graph"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_help_lists_inspect():
    r = subprocess.run([sys.executable, "-m", "kiln", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "inspect" in r.stdout

"""Untrusted ONNX (issue 16, items 5 and 6): every crafted file of serializer/onnx_attacks.py is refused
with a kiln error naming the field, in bounded time and memory, by import_onnx and by ``kiln convert``;
If bodies nested as deep as ONNX allows convert and load back; deeper nesting is refused when the
.kiln file would be written (one rule, serializer/format.py), not when it is read."""
from __future__ import annotations

import re
import time
import tracemalloc

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

import kiln  # noqa: E402
from kiln.cli import main  # noqa: E402
from kiln.errors import FormatError, KilnError  # noqa: E402
from kiln.ir import Graph  # noqa: E402
from kiln.serializer import format as fmt  # noqa: E402
from kiln.serializer import writer  # noqa: E402
from kiln.serializer.onnx_attacks import ATTACKS, BY_NAME, nested_ifs  # noqa: E402
from kiln.serializer.onnx_import import import_onnx  # noqa: E402

TIME_LIMIT_S = 2.0
MEMORY_LIMIT = 64 << 20


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_gives_a_kiln_error_in_bounded_time_and_memory(attack, tmp_path):
    path = attack.write(tmp_path / "case")
    tracemalloc.start()
    start = time.perf_counter()
    try:
        try:
            graph = import_onnx(path)
            err = None
        except BaseException as e:  # noqa: BLE001 - judged below
            err = e
    finally:
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert seconds < TIME_LIMIT_S and peak < MEMORY_LIMIT, (seconds, peak)
    if attack.error is None:
        assert err is None, err
        kiln.verify(graph)
        return
    assert isinstance(err, attack.error), f"{type(err).__name__}: {err}"
    assert re.search(attack.match, str(err)), str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize("name", ["ext_dims_negative", "ext_location_nul", "sparse_dims_huge",
                                  "sparse_index_out_of_range", "sparse_dims_negative", "ext_location_dotdot",
                                  "ext_location_symlink_out", "empty_file", "no_outputs", "nesting_too_deep"])
def test_convert_refuses_with_one_line_and_writes_nothing(name, tmp_path, capsys):
    path = BY_NAME[name].write(tmp_path / "case")
    out = tmp_path / "out.kiln"
    assert main(["convert", str(path), str(out)]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("kiln convert: error:") or err.startswith("kiln: error:"), err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_the_five_reported_cases_name_their_field(tmp_path):
    """Issue 16 item 5, as reported: each now a FormatError saying what was wrong."""
    expect = {"ext_dims_negative": "dims[0] is -2", "ext_location_nul": "control character",
              "sparse_dims_huge": "8,589,934,592 bytes", "sparse_index_out_of_range": "outside [0, 4)",
              "sparse_dims_negative": "dims[0] is -4"}
    for name, words in expect.items():
        with pytest.raises(FormatError) as info:
            import_onnx(BY_NAME[name].write(tmp_path / name))
        assert words in str(info.value) and "'w'" in str(info.value)


def test_external_data_inside_the_folder_still_loads(tmp_path):
    """The checks refuse the attacks, not external data done right (a tensor at an offset in a side file)."""
    from onnx import TensorProto as T, helper as h

    data = np.arange(8, dtype=np.float32)
    (tmp_path / "w.bin").write_bytes(b"\0" * 64 + data.tobytes())
    t = T()
    t.name, t.data_type, t.data_location = "w", T.FLOAT, T.EXTERNAL
    t.dims.extend([2, 4])
    for k, v in (("location", "w.bin"), ("offset", "64"), ("length", "32")):
        t.external_data.add(key=k, value=v)
    g = h.make_graph([h.make_node("Identity", ["w"], ["y"])], "g", [], [h.make_tensor_value_info("y", T.FLOAT, None)],
                     initializer=[t])
    path = tmp_path / "m.onnx"
    path.write_bytes(h.make_model(g, opset_imports=[h.make_opsetid("", 18)]).SerializeToString())
    graph = import_onnx(path)
    np.testing.assert_array_equal(graph.initializers["w"].const, data.reshape(2, 4))


def test_sparse_initializer_within_limits_densifies(tmp_path):
    from onnx import TensorProto as T, helper as h, numpy_helper

    sp = h.make_sparse_tensor(numpy_helper.from_array(np.array([5.0, 6.0], np.float32), "w"),
                              numpy_helper.from_array(np.array([[0, 1], [1, 2]], np.int64), "w_i"), [2, 3])
    g = h.make_graph([h.make_node("Identity", ["w"], ["y"])], "g", [], [h.make_tensor_value_info("y", T.FLOAT, None)],
                     sparse_initializer=[sp])
    graph = import_onnx(h.make_model(g, opset_imports=[h.make_opsetid("", 18)]))
    np.testing.assert_array_equal(graph.initializers["w"].const, [[0, 5, 0], [0, 0, 6]])


# ---------------------------------------------------------------------------- nesting: one rule
def _run(path, cond: bool) -> float:
    return float(kiln.load(path).run({"cond": np.array(cond), "x": np.array([5.0], np.float32)}, as_list=True)[0][0])


@pytest.mark.parametrize("depth", [30, 31])
def test_deep_if_converts_and_the_kiln_file_loads_and_runs(depth, tmp_path, capsys):
    """31 is the deepest nesting an ONNX file can hold (protobuf's parse depth); it must round-trip."""
    src, dst = tmp_path / "deep.onnx", tmp_path / "deep.kiln"
    src.write_bytes(nested_ifs(depth).SerializeToString())
    assert main(["convert", str(src), str(dst)]) == 0
    graph = kiln.load_graph(dst)
    assert writer.check_nesting(graph) == depth
    assert (_run(dst, True), _run(dst, False)) == (6.0, 7.0)


def test_nesting_limit_in_if_levels_matches_the_flatbuffer_depth(tmp_path):
    """At exactly MAX_SUBGRAPH_NESTING levels the file saves and loads (fbread's table depth is derived
    from it); one level more is refused by the importer and by the writer."""
    top = fmt.MAX_SUBGRAPH_NESTING
    graph = import_onnx(nested_ifs(top))
    path = kiln.save(graph, tmp_path / "max.kiln")
    assert writer.check_nesting(kiln.load_graph(path)) == top
    with pytest.raises(FormatError, match=f"nested {top + 1} levels deep"):
        import_onnx(nested_ifs(top + 1))


def _kiln_nested(depth: int) -> Graph:
    g = Graph("nested")
    cond = g.add_input("cond", "bool", [])
    x = g.add_input("x", "float32", [1])
    graph, outer = g, None
    for level in range(depth):
        then_b, else_b = graph.subgraph("then"), graph.subgraph("else")
        else_b.outputs = [else_b.op("Neg", x)]
        node = graph.add_node("If", [cond], {"then_branch": then_b, "else_branch": else_b}, num_outputs=1)
        if outer is None:
            g.outputs = [node.outputs[0]]
        else:
            outer.outputs = [node.outputs[0]]
        outer, graph = then_b, then_b
    graph.outputs = [graph.op("Relu", x)]
    kiln.ir.passes.infer_shapes(g)
    return g


def test_writer_refuses_what_the_reader_would_refuse(tmp_path):
    top = fmt.MAX_SUBGRAPH_NESTING
    ok = kiln.save(_kiln_nested(top), tmp_path / "ok.kiln")
    kiln.load_graph(ok)
    path = tmp_path / "deep.kiln"
    with pytest.raises(FormatError, match=f"cannot save: subgraphs nested {top + 1} levels deep"):
        kiln.save(_kiln_nested(top + 1), path)
    assert not path.exists() and [p.name for p in tmp_path.iterdir()] == ["ok.kiln"]


def test_reader_still_refuses_a_deeper_file(tmp_path, monkeypatch):
    """A file written past the limit (the writer's check switched off) is refused on load, by the
    FlatBuffer walk or the graph decoder: a FormatError either way."""
    monkeypatch.setattr(writer, "MAX_SUBGRAPH_NESTING", fmt.MAX_SUBGRAPH_NESTING + 5)
    path = kiln.save(_kiln_nested(fmt.MAX_SUBGRAPH_NESTING + 1), tmp_path / "deep.kiln")
    with pytest.raises(FormatError, match="nest"):
        kiln.load_graph(path)


def test_zero_byte_onnx_and_empty_proto_are_refused(tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(FormatError, match="empty"):
        import_onnx(tmp_path / "empty.onnx")
    with pytest.raises(FormatError, match="0 bytes"):
        import_onnx(b"")
    with pytest.raises(FormatError, match="no graph"):
        import_onnx(onnx.ModelProto())


def test_invalid_utf8_names_are_format_errors():
    from onnx import TensorProto as T, helper as h

    m = h.make_model(h.make_graph([h.make_node("Relu", ["x"], ["zz"])], "g",
                                  [h.make_tensor_value_info("x", T.FLOAT, [2])],
                                  [h.make_tensor_value_info("zz", T.FLOAT, [2])]),
                     opset_imports=[h.make_opsetid("", 18)])
    data = m.SerializeToString().replace(b"zz", b"\xff\xfe")
    with pytest.raises(FormatError, match="not valid UTF-8"):
        import_onnx(data)


def test_huge_inferred_dims_are_refused_by_the_writer(tmp_path):
    from onnx import TensorProto as T, helper as h

    m = h.make_model(h.make_graph([h.make_node("Concat", ["x", "x"], ["y"], axis=0)], "g",
                                  [h.make_tensor_value_info("x", T.FLOAT, [(1 << 63) - 1])],
                                  [h.make_tensor_value_info("y", T.FLOAT, None)]),
                     opset_imports=[h.make_opsetid("", 18)])
    graph = import_onnx(m)
    with pytest.raises(KilnError, match=r"a dim must be an integer in \[0, 2\^63\)"):
        kiln.save(graph, tmp_path / "m.kiln")


def test_export_refuses_nesting_an_onnx_reader_cannot_parse(tmp_path, capsys):
    """.kiln -> .onnx: 31 levels is the most protobuf parses back; 32 would be written and then be
    unreadable by onnx.load and onnxruntime, so it is refused before writing."""
    for depth, code in ((31, 0), (32, 1)):
        src, dst = tmp_path / f"n{depth}.kiln", tmp_path / f"n{depth}.onnx"
        kiln.save(_kiln_nested(depth), src)
        assert main(["convert", str(src), str(dst)]) == code
        if code == 0:
            assert len(onnx.load(str(dst)).graph.node) == 1
        else:
            assert "nested 32 levels deep" in capsys.readouterr().err and not dst.exists()

"""ONNX import (issue 6): ``kiln.serializer.onnx_import.import_onnx``.

The oracle is onnxruntime running the very same .onnx file: torch-exported zoo models (opset 17
and 18, dynamic batch) go import -> optimize -> save -> load -> run and must match it, as must
hand-built models exercising If/Loop with outer-scope reads, omitted optional inputs/outputs,
initializers listed as inputs, model-local functions and old opsets (version conversion).
External data must round-trip and every path-traversal trick must be refused; ops, domains and
opset versions kiln does not implement must be refused with an error naming op, node and opset.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T, helper as h, numpy_helper  # noqa: E402

import kiln  # noqa: E402
from kiln.errors import FormatError, UnsupportedOpError  # noqa: E402
from kiln.ir.passes import optimize  # noqa: E402
from kiln.ir.registry import has_op  # noqa: E402
from kiln.serializer import onnx_import  # noqa: E402
from kiln.serializer.onnx_import import import_onnx  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5


def model(nodes, inputs, outputs, *, opset=18, initializers=(), functions=(), ir_version=None, name="g"):
    m = h.make_model(h.make_graph(nodes, name, inputs, outputs, initializer=list(initializers)),
                     opset_imports=[h.make_opsetid("", opset)], functions=list(functions))
    if ir_version is not None:
        m.ir_version = ir_version
    return m


def vi(name, elem=T.FLOAT, shape=None):
    return h.make_tensor_value_info(name, elem, shape)


def run_ort(m, feeds: dict) -> list:
    sess = ort.InferenceSession(m.SerializeToString() if not isinstance(m, str) else m,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_kiln(graph: kiln.Graph, feeds: dict) -> list:
    return kiln.load(graph).run(feeds, as_list=True)


def assert_matches_ort(m, feeds: dict, graph=None) -> kiln.Graph:
    graph = import_onnx(m) if graph is None else graph
    want = run_ort(m, feeds)
    got = run_kiln(graph, feeds)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"output {i}"
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"output {i}")
    return graph


# ----------------------------------------------------------------------------- torch zoo

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import zoo  # noqa: E402


@functools.lru_cache(maxsize=None)
def _torch_export(name: str, opset: int, folder: str, dynamo: bool = False):
    model, inputs, spec = zoo.by_name(name).factory()
    names, tensors = zoo.input_list(model, inputs)
    path = os.path.join(folder, f"{name}-{opset}{'-dynamo' if dynamo else ''}.onnx")
    if dynamo:
        dyn = {n: {d: torch.export.Dim(s, min=1) for d, s in spec.get(n, {}).items()} for n in names}
        torch.onnx.export(model, tuple(tensors), path, input_names=names, dynamic_shapes=dyn, opset_version=opset,
                          dynamo=True)
    else:
        dyn = {n: dict(spec[n]) for n in names if n in spec}
        torch.onnx.export(model, tuple(tensors), path, input_names=names, dynamic_axes=dyn, opset_version=opset,
                          dynamo=False)
    return model, inputs, spec, path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("onnx_import"))


def _check_zoo_model(entry, model, inputs, spec, path, folder):
    try:
        graph = import_onnx(path)
    except UnsupportedOpError as e:
        # Acceptable only for an op kiln really lacks, and the message must name it.
        op = str(e).split("'")[1]
        assert not has_op(op), f"kiln has {op}, yet import refused it: {e}"
        pytest.skip(f"the export uses an op kiln lacks: {e}")
    names, examples = zoo.input_list(model, inputs)
    assert [v.name for v in graph.inputs] == names
    for n, dims in spec.items():  # dynamic axes stay symbolic
        v = next(v for v in graph.inputs if v.name == n)
        for d, sym in dims.items():
            assert v.shape[d] == sym
    optimize(graph)
    saved = kiln.save(graph, os.path.join(folder, os.path.basename(path) + ".kiln"))
    program = kiln.load(saved)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    ort_names = [i.name for i in sess.get_inputs()]
    example_sizes = {sym: examples[names.index(n)].shape[d] for n, dims in spec.items() for d, sym in dims.items()}
    for k, sizes in enumerate([example_sizes, *entry.other_sizes]):
        names, tensors = zoo.fresh_inputs(model, inputs, spec, sizes, seed=30 + k)
        feeds = {n: t.numpy() for n, t in zip(names, tensors) if n in ort_names}
        try:
            want = sess.run(None, feeds)
        except Exception as e:  # noqa: BLE001 - onnxruntime's own error types
            # The exporter baked example sizes into the file (the TorchScript exporter does for
            # nn.MultiheadAttention's head split): kiln must refuse these sizes too, not guess.
            assert k > 0, f"onnxruntime cannot run {entry.name} at its example sizes: {e}"
            with pytest.raises(kiln.KilnError):
                program.run(feeds)
            continue
        got = program.run(feeds, as_list=True)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            label = f"{entry.name} at {sizes}: output {i}"
            assert (g.shape, g.dtype) == (w.shape, w.dtype), label
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=label)


@pytest.mark.parametrize("entry,opset", zoo.params(zoo.ZOO, (17, 18)))
def test_torchscript_export_imports_and_matches_onnxruntime(entry, opset, folder):
    model, inputs, spec, path = _torch_export(entry.name, opset, folder)
    _check_zoo_model(entry, model, inputs, spec, path, folder)


@pytest.mark.parametrize("name", ["mlp", "resnet18"])
def test_dynamo_export_imports_and_matches_onnxruntime(name, folder):
    if importlib.util.find_spec("onnxscript") is None:
        pytest.skip("torch.onnx.export(dynamo=True) needs onnxscript, which is not installed")
    entry = zoo.by_name(name)
    model, inputs, spec, path = _torch_export(name, 18, folder, dynamo=True)
    _check_zoo_model(entry, model, inputs, spec, path, folder)


# ----------------------------------------------------------------------------- control flow

def _if_model():
    """y = If(sum(x) > 0) then Relu(x) * s else Neg(x) - s; both branches read outer x and s and
    define the same inner name 't' (allowed in ONNX: sibling scopes)."""
    then_g = h.make_graph([h.make_node("Relu", ["x"], ["t"]), h.make_node("Mul", ["t", "s"], ["then_out"])],
                          "then", [], [vi("then_out", T.FLOAT, ["n", 3])])
    else_g = h.make_graph([h.make_node("Neg", ["x"], ["t"]), h.make_node("Sub", ["t", "s"], ["else_out"])],
                          "else", [], [vi("else_out", T.FLOAT, ["n", 3])])
    nodes = [h.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             h.make_node("Greater", ["total", "zero"], ["cond"]),
             h.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g, name="branch")]
    inits = [numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "s")]
    return model(nodes, [vi("x", T.FLOAT, ["n", 3])], [vi("y", T.FLOAT, ["n", 3])], initializers=inits)


def test_if_with_outer_scope_reads_matches_onnxruntime(rng):
    m = _if_model()
    graph = import_onnx(m)
    if_node = next(n for n in graph.nodes if n.op == "If")
    inner = [v.name for sg in if_node.subgraphs() for n in sg.nodes for v in n.outputs]
    assert len(set(inner)) == len(inner)  # the reused ONNX name 't' became unique kiln names
    x = rng.standard_normal((4, 3)).astype(np.float32)
    assert_matches_ort(m, {"x": x}, graph)
    assert_matches_ort(m, {"x": -np.abs(x)}, graph)


def _loop_model():
    """acc_{i+1} = acc_i * 0.5 + x * i (x read from the outer scope), plus a scan output of
    each acc and an If inside the body; trip count from an input, cond passed through."""
    then_g = h.make_graph([h.make_node("Identity", ["acc_new"], ["t_out"])], "then", [], [vi("t_out", T.FLOAT)])
    else_g = h.make_graph([h.make_node("Neg", ["acc_new"], ["e_out"])], "else", [], [vi("e_out", T.FLOAT)])
    body = h.make_graph(
        [h.make_node("Cast", ["i"], ["i_f"], to=T.FLOAT),
         h.make_node("Mul", ["acc", "half"], ["scaled"]),
         h.make_node("Mul", ["x", "i_f"], ["xi"]),
         h.make_node("Add", ["scaled", "xi"], ["acc_new"]),
         h.make_node("Less", ["i", "two"], ["small"]),
         h.make_node("If", ["small"], ["picked"], then_branch=then_g, else_branch=else_g),
         h.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [vi("i", T.INT64, []), vi("cond_in", T.BOOL, []), vi("acc", T.FLOAT, ["n", 3])],
        [vi("cond_out", T.BOOL, []), vi("picked", T.FLOAT, ["n", 3]), vi("acc_new", T.FLOAT, ["n", 3])],
        initializer=[numpy_helper.from_array(np.array(0.5, np.float32), "half"),
                     numpy_helper.from_array(np.array(2, np.int64), "two")])
    nodes = [h.make_node("Loop", ["trips", "", "x"], ["final", "scans"], body=body, name="loop")]
    return model(nodes, [vi("x", T.FLOAT, ["n", 3]), vi("trips", T.INT64, [])],
                 [vi("final", T.FLOAT, ["n", 3]), vi("scans", T.FLOAT, [None, "n", 3])])


def test_loop_with_nested_if_and_outer_reads_matches_onnxruntime(rng):
    m = _loop_model()
    graph = import_onnx(m)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    for trips in (0, 1, 4):
        assert_matches_ort(m, {"x": x, "trips": np.array(trips, np.int64)}, graph)


def test_untyped_loop_body_inputs_take_the_fed_types(rng):
    m = _loop_model()
    untyped = onnx.ModelProto()
    untyped.CopyFrom(m)
    for v in untyped.graph.node[0].attribute[0].g.input:
        v.ClearField("type")  # onnxruntime refuses this, so the typed model is the oracle
    graph = import_onnx(untyped)
    assert [v.dtype for v in graph.nodes[-1].attrs["body"].inputs] == [kiln.DType.INT64, kiln.DType.BOOL,
                                                                       kiln.DType.FLOAT32]
    x = rng.standard_normal((2, 3)).astype(np.float32)
    assert_matches_ort(m, {"x": x, "trips": np.array(3, np.int64)}, graph)


# ----------------------------------------------------------------------------- graph features

def test_dim_params_become_symbols_and_names_are_kept():
    nodes = [h.make_node("MatMul", ["input x", "w"], ["h"]), h.make_node("Relu", ["h"], ["out:0"])]
    w = numpy_helper.from_array(np.ones((3, 5), np.float32), "layer.0/weight")
    nodes[0].input[1] = "layer.0/weight"
    m = model(nodes, [vi("input x", T.FLOAT, ["batch", None, 3])], [vi("out:0", T.FLOAT, ["batch", "seq", 5])],
              initializers=[w])
    graph = import_onnx(m)
    assert [(v.name, v.shape) for v in graph.inputs] == [("input x", ("batch", None, 3))]
    assert [(v.name, v.shape) for v in graph.outputs] == [("out:0", ("batch", "seq", 5))]
    assert list(graph.initializers) == ["layer.0/weight"]
    x = np.ones((2, 4, 3), np.float32)
    assert_matches_ort(m, {"input x": x}, graph)


def test_initializers_listed_as_inputs_are_constants(rng):
    w = rng.standard_normal((3, 3)).astype(np.float32)
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"])]
    m = model(nodes, [vi("x", T.FLOAT, ["b", 3]), vi("w", T.FLOAT, [3, 3])], [vi("y", T.FLOAT, ["b", 3])],
              initializers=[numpy_helper.from_array(w, "w")], ir_version=3, opset=8)
    graph = import_onnx(m)
    assert [v.name for v in graph.inputs] == ["x"]
    np.testing.assert_array_equal(graph.initializers["w"].const, w)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(run_kiln(graph, {"x": x})[0], x @ w, rtol=RTOL)


def test_constants_fold_into_initializers_and_resolve_shapes(rng):
    nodes = [h.make_node("Constant", [], ["shape"], value_ints=[0, -1]),
             h.make_node("Reshape", ["x", "shape"], ["y"]),
             h.make_node("Constant", [], ["k"], value_float=2.0),
             h.make_node("Mul", ["y", "k"], ["z"])]
    m = model(nodes, [vi("x", T.FLOAT, ["b", 2, 3])], [vi("z", T.FLOAT)])
    graph = import_onnx(m)
    assert [n.op for n in graph.nodes] == ["Reshape", "Mul"]
    assert graph.outputs[0].shape == ("b", 6)  # the Constant shape was visible to inference
    assert_matches_ort(m, {"x": rng.standard_normal((2, 2, 3)).astype(np.float32)}, graph)


def test_omitted_optional_inputs_and_unused_optional_outputs(rng):
    nodes = [h.make_node("Clip", ["x", "", "hi"], ["c"]),
             h.make_node("MaxPool", ["c"], ["p", ""], kernel_shape=[2, 2]),
             h.make_node("Dropout", ["p"], ["d", ""])]
    m = model(nodes, [vi("x", T.FLOAT, [1, 1, 4, 4])], [vi("d", T.FLOAT)],
              initializers=[numpy_helper.from_array(np.array(0.5, np.float32), "hi")])
    graph = import_onnx(m)
    clip = next(n for n in graph.nodes if n.op == "Clip")
    assert clip.inputs[1] is None
    assert_matches_ort(m, {"x": rng.standard_normal((1, 1, 4, 4)).astype(np.float32)}, graph)


def test_input_as_bytes_proto_and_path_agree(tmp_path, rng):
    m = _if_model()
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    texts = {str(import_onnx(src)) for src in (m, m.SerializeToString(), str(path), path)}
    assert len(texts) == 1
    with pytest.raises(FormatError, match="not a valid ONNX model"):
        import_onnx(b"\x08\x07garbage\xff\xff")
    with pytest.raises(FormatError, match="does not exist"):
        import_onnx(tmp_path / "missing.onnx")


def test_model_local_functions_are_inlined(rng):
    fn = h.make_function("custom", "ScaledRelu", ["a"], ["b"],
                         [h.make_node("Relu", ["a"], ["r"]), h.make_node("Add", ["r", "r"], ["b"])],
                         [h.make_opsetid("", 18)])
    m = model([h.make_node("ScaledRelu", ["x"], ["y"], domain="custom")], [vi("x", T.FLOAT, [2, 3])],
              [vi("y", T.FLOAT, [2, 3])], functions=[fn])
    m.opset_import.append(h.make_opsetid("custom", 1))
    graph = import_onnx(m)
    assert sorted(n.op for n in graph.nodes) == ["Add", "Relu"]
    assert_matches_ort(m, {"x": rng.standard_normal((2, 3)).astype(np.float32)}, graph)


def test_undefined_names_are_format_errors():
    m = model([h.make_node("Relu", ["nowhere"], ["y"], name="r")], [vi("x", T.FLOAT, [2])], [vi("y", T.FLOAT)])
    with pytest.raises(FormatError, match=r"node 'r'.*'nowhere'"):
        import_onnx(m)


# ----------------------------------------------------------------------------- opsets

def test_old_opset_is_converted_and_matches_onnxruntime(rng):
    """Squeeze-11 and ReduceSum-11 take axes as attributes; kiln's (13) take inputs."""
    nodes = [h.make_node("ReduceSum", ["x"], ["s"], axes=[2], keepdims=1),
             h.make_node("Squeeze", ["s"], ["y"], axes=[2])]
    m = model(nodes, [vi("x", T.FLOAT, [2, 3, 4])], [vi("y", T.FLOAT, [2, 3])], opset=11)
    graph = import_onnx(m)
    squeeze = next(n for n in graph.nodes if n.op == "Squeeze")
    assert squeeze.inputs[1] is not None and not squeeze.attrs
    assert_matches_ort(m, {"x": rng.standard_normal((2, 3, 4)).astype(np.float32)}, graph)


def test_old_opset_without_changed_ops_is_not_converted(monkeypatch, rng):
    from onnx import version_converter

    def fail(*a, **k):
        raise AssertionError("converted a model that needs no conversion")

    monkeypatch.setattr(version_converter, "convert_version", fail)
    m = model([h.make_node("Relu", ["x"], ["y"])], [vi("x", T.FLOAT, [3])], [vi("y", T.FLOAT, [3])], opset=14)
    assert_matches_ort(m, {"x": rng.standard_normal(3).astype(np.float32)})


def test_converter_failure_is_reported(monkeypatch):
    from onnx import version_converter

    def fail(*a, **k):
        raise RuntimeError("No Adapter For Squeeze")

    monkeypatch.setattr(version_converter, "convert_version", fail)
    m = model([h.make_node("Squeeze", ["x"], ["y"], axes=[0])], [vi("x", T.FLOAT, [1, 3])], [vi("y", T.FLOAT)],
              opset=11)
    with pytest.raises(UnsupportedOpError, match=r"opset 11.*version_converter.*Squeeze"):
        import_onnx(m)


def test_newer_opset_with_same_semantics_is_accepted(rng):
    nodes = [h.make_node("Cast", ["x"], ["c"], to=T.FLOAT16), h.make_node("Reshape", ["c", "shape"], ["r"]),
             h.make_node("Cast", ["r"], ["y"], to=T.FLOAT)]
    m = model(nodes, [vi("x", T.FLOAT, [2, 3])], [vi("y", T.FLOAT, [3, 2])], opset=21,
              initializers=[numpy_helper.from_array(np.array([3, 2], np.int64), "shape")])
    assert_matches_ort(m, {"x": rng.standard_normal((2, 3)).astype(np.float32)})


def test_op_whose_semantics_changed_after_18_is_refused(monkeypatch):
    """An op whose newer version changed meaning is refused unless kiln implements that version: with Mod's entry
    removed (kiln implements Mod-28, whose fmod modes 13 lacks), Mod at opset 28 must be refused by name. (Every
    kiln op's post-18 versions are reviewed now, so the case is made by taking one entry out.)"""
    monkeypatch.delitem(onnx_import.KILN_ONNX_VERSION, "Mod")
    monkeypatch.setitem(onnx_import.IMPORTED_AS_IS, "Mod", ())
    m = model([h.make_node("Mod", ["a", "b"], ["y"], name="changed")], [vi("a", T.FLOAT, [2]), vi("b", T.FLOAT, [2])],
              [vi("y", T.FLOAT)], opset=28)
    with pytest.raises(UnsupportedOpError) as err:
        import_onnx(m)
    msg = str(err.value)
    assert "'Mod'" in msg and "'changed'" in msg and "opset 28" in msg and "Mod-28" in msg and "Mod-13" in msg


def test_every_newer_version_of_a_kiln_op_is_reviewed():
    """No kiln op has an ai.onnx version after 18 that the importer neither implements nor lists as the same
    semantics: each such version is a decision recorded in the tables (or a refusal with its reason)."""
    unreviewed = []
    for s in onnx.defs.get_all_schemas_with_history():
        if (s.domain == "" and s.since_version > 18 and has_op(s.name) and s.name != "Gelu"
                and s.since_version > onnx_import.SAME_SEMANTICS_AS_18.get(s.name, 0)
                and s.since_version > onnx_import.KILN_ONNX_VERSION.get(s.name, 18)):
            unreviewed.append(f"{s.name}-{s.since_version}")
    assert unreviewed == [], sorted(unreviewed)


def test_allow_listed_op_needs_its_entry(monkeypatch):
    """Without the Cast entry, Cast at opset 21 (Cast-21) must be refused: the list is what lets it in."""
    m = model([h.make_node("Cast", ["x"], ["y"], to=T.FLOAT, name="cast")], [vi("x", T.FLOAT16, [2])],
              [vi("y", T.FLOAT, [2])], opset=21)
    import_onnx(m)
    monkeypatch.delitem(onnx_import.SAME_SEMANTICS_AS_18, "Cast")
    with pytest.raises(UnsupportedOpError, match=r"'Cast'.*'cast'.*opset 21.*Cast-21.*Cast-13"):
        import_onnx(m)


def test_allow_list_names_real_versions_of_kiln_ops():
    for op, newest in onnx_import.SAME_SEMANTICS_AS_18.items():
        assert has_op(op) or op == "Scan", op  # Scan is built as a Loop (serializer/onnx_scan.py)
        assert onnx.defs.get_schema(op, newest).since_version == newest, op
        assert newest > 18, op


def test_pad_wrap_mode_added_in_19_imports():
    m = model([h.make_node("Pad", ["x", "pads"], ["y"], mode="wrap", name="pad")], [vi("x", T.FLOAT, [3])],
              [vi("y", T.FLOAT)], opset=19, initializers=[numpy_helper.from_array(np.array([1, 2], np.int64), "pads")])
    got = kiln.load(import_onnx(m)).run([np.array([1, 2, 3], np.float32)], as_list=True)[0]
    np.testing.assert_array_equal(got, [3, 1, 2, 3, 1, 2])


# ----------------------------------------------------------------------------- unsupported things

def test_unknown_op_names_op_node_domain_and_opset():
    m = model([h.make_node("Frobnicate", ["x"], ["y"], name="frob1")], [vi("x", T.FLOAT, [2])], [vi("y", T.FLOAT)],
              opset=20)
    with pytest.raises(UnsupportedOpError, match=r"'Frobnicate'.*ai\.onnx.*opset 20.*'frob1'"):
        import_onnx(m)


def test_real_onnx_op_kiln_lacks_is_refused():
    op = next(o for o in ("Hardmax", "Mod", "BitShift", "Det", "Round", "StringNormalizer", "SequenceEmpty")
              if not has_op(o))
    m = model([h.make_node(op, ["x"], ["y"], name="n7")], [vi("x", T.FLOAT, [2, 2])], [vi("y", T.FLOAT)])
    with pytest.raises(UnsupportedOpError, match=rf"'{op}'.*opset 18.*'n7'"):
        import_onnx(m)


def test_other_domain_op_is_refused():
    m = model([h.make_node("FusedMatMul", ["x", "x"], ["y"], domain="com.microsoft", name="fmm")],
              [vi("x", T.FLOAT, [2, 2])], [vi("y", T.FLOAT)])
    m.opset_import.append(h.make_opsetid("com.microsoft", 1))
    with pytest.raises(UnsupportedOpError, match=r"'FusedMatMul'.*'com\.microsoft'.*opset 1.*'fmm'"):
        import_onnx(m)


def test_unknown_op_inside_a_branch_names_where():
    then_g = h.make_graph([h.make_node("Frobnicate", ["x"], ["t"], name="deep")], "then", [], [vi("t", T.FLOAT)])
    else_g = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [], [vi("e", T.FLOAT)])
    m = model([h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="top_if")],
              [vi("c", T.BOOL, []), vi("x", T.FLOAT, [2])], [vi("y", T.FLOAT)])
    with pytest.raises(UnsupportedOpError, match=r"'deep' in subgraph 'then_branch' of node 'top_if'"):
        import_onnx(m)


def test_unsupported_attribute_and_types_are_refused():
    m = model([h.make_node("Relu", ["x"], ["y"], name="r", bogus=3)], [vi("x", T.FLOAT, [2])], [vi("y", T.FLOAT)])
    with pytest.raises(UnsupportedOpError, match=r"node 'r'.*attribute 'bogus'"):
        import_onnx(m)
    m = model([h.make_node("Relu", ["x"], ["y"])], [vi("x", T.COMPLEX64, [2])], [vi("y", T.COMPLEX64)])
    with pytest.raises(UnsupportedOpError, match="COMPLEX64, which kiln does not support"):
        import_onnx(m)
    seq = h.make_tensor_sequence_value_info("x", T.FLOAT, [2])
    m = model([h.make_node("Identity", ["x"], ["y"])], [seq], [seq])
    with pytest.raises(UnsupportedOpError, match="sequence"):
        import_onnx(m)
    m = model([h.make_node("Not", ["x"], ["y"], name="not")], [vi("x", T.FLOAT, [2])], [vi("y", T.BOOL)])
    with pytest.raises(UnsupportedOpError, match=r"node 'not'.*float32"):
        import_onnx(m)


# ----------------------------------------------------------------------------- external data

def _external_model(tmp_path, rng):
    w = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8,)).astype(np.float32)
    nodes = [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Add", ["m", "b"], ["y"])]
    m = model(nodes, [vi("x", T.FLOAT, ["batch", 16])], [vi("y", T.FLOAT, ["batch", 8])],
              initializers=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    path = tmp_path / "ext.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
              size_threshold=0)
    return path, w, b


def test_external_data_round_trip(tmp_path, rng):
    path, w, b = _external_model(tmp_path, rng)
    graph = import_onnx(path)
    np.testing.assert_array_equal(graph.initializers["w"].const, w)
    np.testing.assert_array_equal(graph.initializers["b"].const, b)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_allclose(run_kiln(graph, {"x": x})[0], run_ort(str(path), {"x": x})[0], rtol=RTOL, atol=ATOL)
    # A proto without its data needs base_dir to find it.
    proto = onnx.load(str(path), load_external_data=False)
    with pytest.raises(FormatError, match="base_dir"):
        import_onnx(proto)
    np.testing.assert_array_equal(import_onnx(proto, base_dir=tmp_path).initializers["w"].const, w)


def _set_location(path, tensor: str, **fields):
    m = onnx.load(str(path), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.name == tensor)
    for entry in t.external_data:
        if entry.key in fields:
            entry.value = str(fields.pop(entry.key))
    for k, v in fields.items():
        t.external_data.add(key=k, value=str(v))
    onnx.save(m, str(path))


@pytest.mark.parametrize("location", ["../outside.bin", "sub/../../outside.bin", "/etc/passwd", "..\\outside.bin"])
def test_external_data_outside_the_folder_is_refused(tmp_path, rng, location):
    inner = tmp_path / "model"
    inner.mkdir()
    (tmp_path / "outside.bin").write_bytes(b"\0" * 1024)
    path, _, _ = _external_model(inner, rng)
    _set_location(path, "w", location=location)
    with pytest.raises(FormatError) as err:
        import_onnx(path)
    assert "'w'" in str(err.value) and location in str(err.value)


def test_external_data_symlink_leading_out_is_refused(tmp_path, rng):
    inner = tmp_path / "model"
    inner.mkdir()
    path, _, _ = _external_model(inner, rng)
    secret = tmp_path / "secret.bin"
    secret.write_bytes((inner / "weights.bin").read_bytes())
    (inner / "link.bin").symlink_to(secret)
    _set_location(path, "w", location="link.bin")
    with pytest.raises(FormatError, match=r"'w'.*link\.bin.*outside"):
        import_onnx(path)


def test_external_data_offsets_are_checked(tmp_path, rng):
    path, _, _ = _external_model(tmp_path, rng)
    size = (tmp_path / "weights.bin").stat().st_size
    _set_location(path, "b", offset=size - 8)
    with pytest.raises(FormatError, match=r"'b'.*outside 'weights\.bin'"):
        import_onnx(path)
    _set_location(path, "b", offset=0, length=4)
    with pytest.raises(FormatError, match=r"'b'.*holds 4 bytes"):
        import_onnx(path)
    _set_location(path, "b", length=32, location="missing.bin")
    with pytest.raises(FormatError, match=r"'b'.*missing\.bin.*does not exist"):
        import_onnx(path)


# --------------------------------------------------------------------------- training-only modes
def test_training_modes_are_refused_by_name():
    x = vi("x", T.FLOAT, [2, 3, 4, 4])
    flag = vi("training", T.BOOL, [])
    dropout = model([h.make_node("Dropout", ["x", "", "training"], ["y"], name="drop")], [x, flag], [vi("y")])
    # A computed training_mode imports; a run that meets True (with the default ratio 0.5) is refused by name.
    program = kiln.load(import_onnx(dropout))
    xs = np.ones((2, 3, 4, 4), np.float32)
    np.testing.assert_array_equal(program.run([xs, np.array(False)], as_list=True)[0], xs)
    with pytest.raises(UnsupportedOpError, match=r"Dropout met training_mode=True with ratio 0.5 at run time"):
        program.run([xs, np.array(True)])
    on = numpy_helper.from_array(np.array(True), "on")
    fixed = model([h.make_node("Dropout", ["x", "", "on"], ["y"], name="drop")], [x], [vi("y")], initializers=[on])
    with pytest.raises(UnsupportedOpError, match=r"drop.*Dropout.*training_mode is True with ratio 0.5"):
        import_onnx(fixed)
    zero = numpy_helper.from_array(np.array(0, np.float32), "zero")
    exact = model([h.make_node("Dropout", ["x", "zero", "on"], ["y"], name="drop")], [x], [vi("y")],
                  initializers=[on, zero])
    assert [n.op for n in import_onnx(exact).nodes] == ["Dropout"]  # training with ratio 0: the identity
    off = numpy_helper.from_array(np.array(False), "on")
    ok = model([h.make_node("Dropout", ["x", "", "on"], ["y"], name="drop")], [x], [vi("y")], initializers=[off])
    assert [n.op for n in import_onnx(ok).nodes] == ["Dropout"]

    pool = model([h.make_node("MaxPool", ["x"], ["y", "idx"], kernel_shape=[2, 2], name="pool")], [x],
                 [vi("y"), vi("idx", T.INT64)])
    assert [v.type.dtype.short for v in import_onnx(pool).outputs] == ["float32", "int64"]  # Indices: test_pool.py
    stats = [numpy_helper.from_array(np.ones(3, np.float32), n) for n in ("s", "b", "m", "v")]
    bn = model([h.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], training_mode=1, name="bn")],
               [vi("x", T.FLOAT, [2, 3, 4])], [vi("y")], initializers=stats)
    # BatchNormalization's training mode (batch statistics) is implemented: tests/ops/test_normalization.py
    assert import_onnx(bn).nodes[0].attrs["training_mode"] == 1

"""Resize/Upsample through ONNX: every version imports with its own meaning (checked against
onnxruntime and onnx.reference), old forms survive version_converter runs, and export writes
opset 18/19 files that onnxruntime runs to the same answers."""
import numpy as np
import pytest

import kiln
from kiln.errors import UnsupportedOpError
from kiln.ir import Graph, evaluate
from kiln.ir.passes.shape_inference import infer_shapes

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from kiln.serializer.onnx import default_opset, to_onnx_model  # noqa: E402
from kiln.serializer.onnx_import import import_onnx  # noqa: E402

RNG = np.random.default_rng(0)
X = RNG.standard_normal((1, 2, 4, 5)).astype(np.float32)


def model(nodes, opset: int, inits=(), x=X, extra_inputs=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x.shape),
                                           *extra_inputs],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def f32(name, values):
    values = np.asarray(values, np.float32)
    return helper.make_tensor(name, TensorProto.FLOAT, values.shape, values.reshape(-1).tolist())


def i64(name, values):
    values = np.asarray(values, np.int64)
    return helper.make_tensor(name, TensorProto.INT64, values.shape, values.reshape(-1).tolist())


def ort_run(proto, feeds):
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def kiln_run(proto, feeds):
    g = import_onnx(proto)
    return kiln.load(g).run(feeds, as_list=True)[0], g


def check_vs_ort(proto, x=X, rtol=1e-5):
    got, g = kiln_run(proto, {"X": x})
    want = ort_run(proto, {"X": x})
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    return g


# ---------------------------------------------------------------------------- import, every version
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_7_attribute_scales(mode):
    node = helper.make_node("Upsample", ["X"], ["Y"], mode=mode, scales=[1.0, 1.0, 2.0, 3.0])
    g = check_vs_ort(model([node], 7))
    (r,) = [n for n in g.nodes if n.op == "Resize"]
    assert r.attrs["coordinate_transformation_mode"] == "asymmetric"


@pytest.mark.parametrize("op,opset", [("Upsample", 9), ("Resize", 10)])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_scales_input_forms_before_11(op, opset, mode):
    node = helper.make_node(op, ["X", "S"], ["Y"], mode=mode)
    check_vs_ort(model([node], opset, [f32("S", [1, 1, 2.5, 1.5])]))


def test_resize_10_nearest_downsample_is_refused():
    node = helper.make_node("Resize", ["X", "S"], ["Y"], mode="nearest")
    with pytest.raises(UnsupportedOpError, match="not settled"):
        import_onnx(model([node], 10, [f32("S", [1, 1, 0.5, 0.5])]))


def test_resize_10_keeps_its_meaning_when_the_model_is_converted():
    # Unsqueeze-1 (axes attribute) makes the importer run version_converter on the whole model;
    # the converter's own Resize 10->11 adapter would switch to half_pixel coordinates.
    nodes = [helper.make_node("Resize", ["X", "S"], ["R"], mode="linear"),
             helper.make_node("Unsqueeze", ["R"], ["U"], axes=[0]),
             helper.make_node("Squeeze", ["U"], ["Y"], axes=[0])]
    proto = model(nodes, 10, [f32("S", [1, 1, 2, 2])])
    g = check_vs_ort(proto)
    assert [n.op for n in g.nodes if n.op == "Resize"] == ["Resize"]
    assert proto.graph.node[0].domain == ""  # the caller's model is left as it was


@pytest.mark.parametrize("rule", ["floor", "round_prefer_floor"])
def test_resize_11_tf_half_pixel_for_nn(rule):
    node = helper.make_node("Resize", ["X", "roi", "S"], ["Y"], mode="nearest", nearest_mode=rule,
                            coordinate_transformation_mode="tf_half_pixel_for_nn")
    check_vs_ort(model([node], 11, [f32("roi", []), f32("S", [1, 1, 1.7, 0.6])]))


def test_resize_11_tf_half_pixel_for_nn_other_rules_refused():
    node = helper.make_node("Resize", ["X", "roi", "S"], ["Y"], mode="linear",
                            coordinate_transformation_mode="tf_half_pixel_for_nn")
    with pytest.raises(UnsupportedOpError, match="tf_half_pixel_for_nn"):
        import_onnx(model([node], 11, [f32("roi", []), f32("S", [1, 1, 2, 2])]))


@pytest.mark.parametrize("opset", [11, 13])
def test_empty_scales_and_sizes_forms(opset):
    node = helper.make_node("Resize", ["X", "roi", "S", "sizes"], ["Y"], mode="cubic",
                            coordinate_transformation_mode="align_corners")
    g = check_vs_ort(model([node], opset, [f32("roi", []), f32("S", []), i64("sizes", [1, 2, 7, 3])]))
    (r,) = [n for n in g.nodes if n.op == "Resize"]
    assert r.inputs[1] is None and r.inputs[2] is None  # the empty constants are dropped


def test_resize_13_tf_crop_and_resize():
    node = helper.make_node("Resize", ["X", "roi", "", "sizes"], ["Y"], mode="linear",
                            coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=5.0)
    check_vs_ort(model([node], 13, [f32("roi", [0, 0, -0.25, 0.1, 1, 1, 0.75, 1.3]), i64("sizes", [1, 2, 6, 6])]))


def test_resize_18_axes_antialias_and_policy():
    node = helper.make_node("Resize", ["X", "", "", "sizes"], ["Y"], mode="linear", antialias=1,
                            axes=[2, 3], keep_aspect_ratio_policy="not_larger")
    g = check_vs_ort(model([node], 18, [i64("sizes", [2, 4])]))
    assert g.outputs[0].type.shape == (1, 2, 2, 3)  # scale min(2/4, 4/5) on both axes, sizes rounded


def test_resize_18_refuses_a_19_mode():
    node = helper.make_node("Resize", ["X", "", "S"], ["Y"], coordinate_transformation_mode="half_pixel_symmetric")
    with pytest.raises(UnsupportedOpError, match="Resize-19"):
        import_onnx(model([node], 18, [f32("S", [1, 1, 2, 2])]))


def test_resize_19_half_pixel_symmetric_and_a_computed_sizes_input():
    from onnx.reference import ReferenceEvaluator
    nodes = [helper.make_node("Shape", ["Z"], ["hw"], start=2),
             helper.make_node("Resize", ["X", "", "", "hw"], ["Y"], mode="linear", axes=[2, 3],
                              coordinate_transformation_mode="half_pixel_symmetric")]
    z = helper.make_tensor_value_info("Z", TensorProto.FLOAT, [1, 1, "H", "W"])
    proto = model(nodes, 19, extra_inputs=[z])
    feeds = {"X": X, "Z": np.zeros((1, 1, 7, 3), np.float32)}
    got, g = kiln_run(proto, feeds)
    assert g.outputs[0].type.shape == (1, 2, "H", "W")
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, ort_run(proto, feeds), rtol=1e-5, atol=1e-5)


def test_unknown_attribute_of_an_old_version_is_refused():
    node = helper.make_node("Resize", ["X", "roi", "S"], ["Y"], antialias=1)
    with pytest.raises(UnsupportedOpError, match="antialias"):
        import_onnx(model([node], 13, [f32("roi", []), f32("S", [1, 1, 2, 2])]))


# ---------------------------------------------------------------------------- export
def _graph(attrs, scales=None, sizes=None, shape=("n", 2, 4, 5)):
    g = Graph("resize")
    x = g.add_input("x", "float32", list(shape))
    s = None if scales is None else g.add_initializer("scales", np.array(scales, np.float32))
    z = None if sizes is None else g.add_initializer("sizes", np.array(sizes, np.int64))
    node = g.add_node("Resize", [x, None, s, z], attrs)
    g.outputs = list(node.outputs)
    infer_shapes(g)
    return g


@pytest.mark.parametrize("attrs,scales,sizes", [
    ({"mode": "linear"}, [1, 1, 2, 2], None),
    ({"mode": "cubic", "coordinate_transformation_mode": "align_corners", "axes": [2, 3]}, None, [7, 9]),
    ({"mode": "nearest", "nearest_mode": "ceil", "axes": [3]}, [0.6], None),
    ({"mode": "linear", "antialias": 1, "axes": [2, 3]}, None, [2, 3]),
])
def test_export_runs_in_onnxruntime(attrs, scales, sizes):
    g = _graph(attrs, scales, sizes)
    x = RNG.standard_normal((3, 2, 4, 5)).astype(np.float32)
    want = evaluate(g, [x])[0]
    assert default_opset(g) == 18
    for opset in (18, 19, 22):
        proto = to_onnx_model(g, opset=opset)
        onnx.checker.check_model(proto, full_check=True)
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
        back = import_onnx(proto)
        np.testing.assert_allclose(evaluate(back, [x])[0], want, rtol=1e-6, atol=1e-6)


def test_half_pixel_symmetric_exports_at_19_and_refuses_18():
    g = _graph({"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}, [1, 1, 1.5, 0.7])
    assert default_opset(g) == 19
    proto = to_onnx_model(g)
    onnx.checker.check_model(proto, full_check=True)
    x = RNG.standard_normal((1, 2, 4, 5)).astype(np.float32)
    np.testing.assert_allclose(ort_run_named(proto, {"x": x}), evaluate(g, [x])[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(UnsupportedOpError, match="opset 19"):
        to_onnx_model(g, opset=18)


def ort_run_named(proto, feeds):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_length_reading_modes_with_fractional_scales_warn():
    # ONNX's node tests read align_corners' length as scale * size (2.4 here), onnxruntime as the
    # rounded output size (2): kiln follows ONNX and says so at import.
    node = helper.make_node("Resize", ["X", "", "S"], ["Y"], mode="linear", coordinate_transformation_mode="align_corners")
    with pytest.warns(UserWarning, match="fractional length"):
        import_onnx(model([node], 19, [f32("S", [1, 1, 0.6, 0.6])]))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import_onnx(model([node], 19, [f32("S", [1, 1, 0.5, 2])]))  # whole lengths: one meaning


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("opset", [11, 13, 17])
def test_torch_onnx_exports_import_and_match_torch(opset):
    # torch.onnx's TorchScript exporter at dynamic sizes: Resize with computed scales/sizes inputs.
    torch = pytest.importorskip("torch")
    import io
    F = torch.nn.functional

    class M(torch.nn.Module):
        def forward(self, x, s):
            return (F.interpolate(x, scale_factor=2, mode="nearest"),
                    F.interpolate(x, size=s.shape[2:], mode="bilinear", align_corners=False),
                    F.interpolate(x, size=s.shape[2:], mode="bicubic", align_corners=True))

    buf = io.BytesIO()
    torch.onnx.export(M(), (torch.randn(1, 3, 8, 10), torch.randn(1, 1, 13, 7)), buf, opset_version=opset,
                      dynamo=False, input_names=["x", "s"],
                      dynamic_axes={"x": {0: "b", 2: "h", 3: "w"}, "s": {2: "H", 3: "W"}})
    prog = kiln.load(import_onnx(buf.getvalue()))
    for xs, ss in [((1, 3, 8, 10), (1, 1, 13, 7)), ((2, 3, 5, 6), (1, 1, 9, 11))]:
        x, s = torch.randn(*xs), torch.randn(*ss)
        with torch.no_grad():
            want = [t.numpy() for t in M()(x, s)]
        got = prog.run([x.numpy(), s.numpy()], as_list=True)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)

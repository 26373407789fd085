"""GlobalLpPool and MaxRoiPool (kiln.ir.ops.pool). Neither is in ONNX's backend node suite nor in its reference
evaluator: GlobalLpPool is checked against ONNX Runtime and against the reference's LpPool with the whole map as its
window; MaxRoiPool against ONNX Runtime's CPU kernel (Caffe's ROIPool) on RoIs that reach its rules' edges (halves
in the scaled coordinates, inverted and out-of-map RoIs, bins that overlap or fall outside, fractional batch
indices). Also dtypes, empty inputs, named inference and run-time errors, import (ONNX opset 18 and the bfloat16
version 22) and export at the opsets kiln writes."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import KilnError, ShapeInferenceError, UnsupportedOpError
from kiln.ir import evaluate
from op_harness import build_single, check_op, inferred, onnx_reference

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import helper  # noqa: E402

RNG = np.random.default_rng(2025)
F32 = np.float32


def _model(op: str, inputs: list, attrs: dict, opset: int = 18) -> "onnx.ModelProto":
    names = [f"i{k}" for k in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], **attrs)], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in zip(names, inputs)],
        [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(inputs[0].dtype), None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def ort_run(op: str, inputs: list, attrs: dict) -> np.ndarray:
    """ONNX Runtime's CPU kernel on a one-node opset-18 model."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(_model(op, inputs, attrs).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, {f"i{k}": a for k, a in enumerate(inputs)})[0]


# --------------------------------------------------------------------------- GlobalLpPool


@pytest.mark.parametrize("shape", [(2, 3, 7), (1, 2, 4, 6), (2, 1, 3, 2, 4)])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_global_lp_pool_matches_lp_pool_over_the_whole_map_in_onnx_reference(shape, p):
    x = RNG.standard_normal(shape).astype(F32)
    want = onnx_reference("LpPool", [x], {"kernel_shape": list(shape[2:]), "p": p})
    (got,) = check_op("GlobalLpPool", [x], want, {"p": p}, rtol=1e-5, atol=1e-6, symbolic_batch=True)
    assert got.shape == shape[:2] + (1,) * (len(shape) - 2)


@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 2, 4, 6), (3, 2, 1, 1), (2, 1, 3, 2, 4)])
@pytest.mark.parametrize("p", [1, 2, 3, 4, -1])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-3)])
def test_global_lp_pool_matches_onnx_runtime(shape, p, dtype, tol):
    x = RNG.standard_normal(shape).astype(dtype)
    want = ort_run("GlobalLpPool", [x], {"p": p})
    check_op("GlobalLpPool", [x], want, {"p": p}, rtol=tol, atol=tol)


def test_global_lp_pool_default_p_is_2():
    x = RNG.standard_normal((2, 3, 4, 5)).astype(F32)
    want = np.sqrt((x.astype(np.float64) ** 2).sum(axis=(2, 3), keepdims=True))
    check_op("GlobalLpPool", [x], want.astype(F32), {}, rtol=1e-6, atol=1e-7)


def test_global_lp_pool_float64_and_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = RNG.standard_normal((2, 3, 5, 4))
    want = ((np.abs(x) ** 3).sum(axis=(2, 3), keepdims=True)) ** (1 / 3)
    check_op("GlobalLpPool", [x], want, {"p": 3}, rtol=1e-13, atol=1e-14)
    xb = x.astype(ml_dtypes.bfloat16)
    (got,) = check_op("GlobalLpPool", [xb], None, {"p": 3})
    assert got.dtype == ml_dtypes.bfloat16
    # Computed in float32 and rounded once.
    wb = ((np.abs(xb.astype(F32)) ** 3).sum(axis=(2, 3), keepdims=True) ** F32(1 / 3)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.astype(F32), wb.astype(F32))


def test_global_lp_pool_float16_does_not_overflow_in_float16():
    x = np.full((1, 1, 8, 8), 200, np.float16)  # 200^2 * 64 overflows float16, the norm (1600) does not
    (got,) = check_op("GlobalLpPool", [x], np.full((1, 1, 1, 1), 1600, np.float16), {"p": 2})
    assert np.isfinite(got).all()


def test_global_lp_pool_empty_inputs():
    (got,) = check_op("GlobalLpPool", [np.zeros((0, 3, 4, 4), F32)], None, {"p": 3})
    assert got.shape == (0, 3, 1, 1)
    (got,) = check_op("GlobalLpPool", [np.zeros((2, 0, 4), F32)], None, {})
    assert got.shape == (2, 0, 1)
    # An empty map: the sum is 0, and so is its p-th root.
    check_op("GlobalLpPool", [np.zeros((2, 3, 0, 4), F32)], np.zeros((2, 3, 1, 1), F32), {"p": 2})


def test_global_lp_pool_keeps_symbolic_dims():
    assert inferred("GlobalLpPool", [np.zeros((2, 3, 4, 5), F32)], {"p": 1}) == [("batch", 3, 1, 1)]


@pytest.mark.parametrize("op,attrs", [("GlobalLpPool", {}), ("LpPool", {"kernel_shape": [2, 2]})])
def test_lp_pools_refuse_p_0(op, attrs):
    with pytest.raises(ShapeInferenceError, match=r"p must not be 0: the result is \(sum of \|x\|\^p\)\^\(1/p\)"):
        build_single(op, [np.zeros((1, 2, 3, 3), F32)], {**attrs, "p": 0})


def test_global_lp_pool_inference_names_what_is_wrong():
    with pytest.raises(ShapeInferenceError, match=r"X must have rank >= 3 \(\[N, C, \*spatial\]\), got shape \[2, 3\]"):
        build_single("GlobalLpPool", [np.zeros((2, 3), F32)])
    with pytest.raises(KilnError, match=r"input 0 \('X'\) is int32; allowed: bfloat16, float16, float32, float64"):
        build_single("GlobalLpPool", [np.zeros((1, 2, 3), np.int32)])


# --------------------------------------------------------------------------- MaxRoiPool


def roi_case(seed: int, n: int = 2, c: int = 3, h: int = 9, w: int = 11, r: int = 7, scale: float = 1.0,
             halves: bool = False) -> tuple:
    """X and rois whose boxes lie in any corner order, partly or wholly outside the map, with fractional batch
    indices (truncated) and, with ``halves``, scaled coordinates that are exact halves (rounded away from 0)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(F32)
    coords = rng.uniform(-4, max(h, w) + 4, (r, 4)) / scale
    if halves:
        coords = np.round(coords * scale * 2) / 2 / scale
    batch = rng.integers(0, n, (r, 1)) + rng.uniform(0, 0.99, (r, 1))
    return x, np.concatenate([batch, coords], axis=1).astype(F32)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pooled,scale", [([2, 2], 1.0), ([3, 4], 0.5), ([1, 1], 0.25), ([5, 2], 2.0),
                                          ([4, 3], 0.3), ([7, 7], 1 / 16)])
def test_max_roi_pool_matches_onnx_runtime(seed, pooled, scale):
    x, rois = roi_case(seed, scale=scale, halves=seed % 2 == 0)
    attrs = {"pooled_shape": pooled, "spatial_scale": scale}
    check_op("MaxRoiPool", [x, rois], ort_run("MaxRoiPool", [x, rois], attrs), attrs, rtol=0, atol=0)


def test_max_roi_pool_by_hand():
    """RoI [x1=1, y1=0, x2=3, y2=2] of a 4x5 map: 3 rows, 3 columns; 2x2 bins of 1.5 cover rows [0, 2) and
    [1, 3) (floor/ceil: they overlap), columns 1 + [0, 2) and 1 + [1, 3). Scaled halves round away from 0:
    x1 = 0.5 * 1 -> 1 (not 0, as round-half-even would), a RoI outside the map is empty (0), an inverted one 1x1."""
    x = np.arange(20, dtype=F32).reshape(1, 1, 4, 5)
    rois = np.array([[0, 1, 0, 3, 2], [0, 10, 10, 12, 12], [0, 3, 2, 1, 0], [0, 1, 1, 1, 1]], F32)
    want = np.array([[[[7, 8], [12, 13]]], [[[0, 0], [0, 0]]], [[[13, 13], [13, 13]]], [[[6, 6], [6, 6]]]], F32)
    check_op("MaxRoiPool", [x, rois], want, {"pooled_shape": [2, 2]}, rtol=0, atol=0)
    half = np.array([[0, 1, 1, 5, 5]], F32)  # * 0.5: [0.5, 0.5, 2.5, 2.5] -> [1, 1, 3, 3]
    check_op("MaxRoiPool", [x, half], np.array([[[[18]]]], F32), {"pooled_shape": [1, 1], "spatial_scale": 0.5},
             rtol=0, atol=0)
    np.testing.assert_array_equal(ort_run("MaxRoiPool", [x, half], {"pooled_shape": [1, 1], "spatial_scale": 0.5}),
                                  [[[[18]]]])


def test_max_roi_pool_negative_values_are_the_max_not_clipped_at_0():
    x = -np.arange(1, 41, dtype=F32).reshape(2, 1, 4, 5)
    rois = np.array([[0, 0, 0, 2, 2], [1.7, 1, 1, 3, 3], [0, 4, 3, 1, 1]], F32)
    attrs = {"pooled_shape": [2, 2]}
    want = ort_run("MaxRoiPool", [x, rois], attrs)
    assert (want < 0).all()
    check_op("MaxRoiPool", [x, rois], want, attrs, rtol=0, atol=0)


def test_max_roi_pool_many_rois_over_several_images():
    """RoIs in any order over three images, of every size from inside one bin to past the whole map."""
    x, rois = roi_case(7, n=3, c=4, h=13, w=10, r=60, scale=0.5, halves=True)
    rois[:5, 1:] = [[-30, -30, 60, 60], [3, 3, 3, 3], [0, 0, 19, 25], [19, 25, 0, 0], [8, 8, 9, 9]]
    attrs = {"pooled_shape": [3, 2], "spatial_scale": 0.5}
    check_op("MaxRoiPool", [x, rois], ort_run("MaxRoiPool", [x, rois], attrs), attrs, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_max_roi_pool_other_float_types(dtype):
    x, rois = roi_case(3, halves=True)
    attrs = {"pooled_shape": [3, 3], "spatial_scale": 1.0}
    (got,) = check_op("MaxRoiPool", [x.astype(dtype), rois.astype(dtype)], None, attrs)
    assert got.dtype == dtype
    # The max is exact in any type: the same elements as in float32 (these RoIs are exact in float16).
    np.testing.assert_array_equal(got, ort_run("MaxRoiPool", [x, rois], attrs).astype(dtype))
    if dtype == np.float16:
        np.testing.assert_array_equal(got, ort_run("MaxRoiPool", [x.astype(dtype), rois.astype(dtype)], attrs))


def test_max_roi_pool_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = ml_dtypes.bfloat16
    x, rois = roi_case(4, halves=True)
    attrs = {"pooled_shape": [2, 3]}
    (got,) = check_op("MaxRoiPool", [x.astype(bf), rois.astype(bf)], None, attrs)
    assert got.dtype == bf
    want = ort_run("MaxRoiPool", [x.astype(bf).astype(F32), rois.astype(bf).astype(F32)], attrs)
    np.testing.assert_array_equal(got.astype(F32), want)


def test_max_roi_pool_propagates_nan():
    x = np.arange(36, dtype=F32).reshape(1, 1, 6, 6)
    x[0, 0, 1, 1] = np.nan
    rois = np.array([[0, 0, 0, 5, 5], [0, 2, 2, 5, 5]], F32)
    (got,) = check_op("MaxRoiPool", [x, rois], None, {"pooled_shape": [2, 2]})
    assert np.isnan(got[0, 0, 0, 0]) and not np.isnan(got[0, 0, 0, 1]) and not np.isnan(got[1]).any()


def test_max_roi_pool_empty_inputs():
    x, rois = roi_case(5)
    (got,) = check_op("MaxRoiPool", [x, rois[:0]], None, {"pooled_shape": [2, 3]})
    assert got.shape == (0, 3, 2, 3)
    (got,) = check_op("MaxRoiPool", [x[:, :0], rois], None, {"pooled_shape": [2, 3]})
    assert got.shape == (7, 0, 2, 3)
    # An empty map: every bin is empty, so 0.
    check_op("MaxRoiPool", [x[:, :, :0], rois], np.zeros((7, 3, 2, 3), F32), {"pooled_shape": [2, 3]})


def test_max_roi_pool_output_shape_with_symbolic_dims():
    x, rois = roi_case(6, r=4)
    assert inferred("MaxRoiPool", [x, rois], {"pooled_shape": [3, 2]}) == [(4, 3, 3, 2)]


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_max_roi_pool_non_finite_roi_is_an_error(bad):
    x, rois = roi_case(8, r=3)
    rois[1, 2] = bad
    g, feeds = build_single("MaxRoiPool", [x, rois], {"pooled_shape": [2, 2]})
    with pytest.raises(KilnError, match=r"rois \[1\] have non-finite values"):
        evaluate(g, feeds)
    with pytest.raises(ShapeInferenceError, match=r"rois \[1\] have non-finite values"):
        build_single("MaxRoiPool", [x, rois], {"pooled_shape": [2, 2]}, const_inputs=(1,))


def test_max_roi_pool_coordinates_past_int32_are_an_error():
    x, rois = roi_case(9, r=3)
    rois[2, 3] = 3e9
    g, feeds = build_single("MaxRoiPool", [x, rois], {"pooled_shape": [2, 2]})
    with pytest.raises(KilnError, match=r"rois \[2\] have coordinates that, scaled by spatial_scale 1.0 and rounded, "
                                        r"lie outside the int32 range"):
        evaluate(g, feeds)


def test_max_roi_pool_batch_index_out_of_range():
    x, rois = roi_case(10, r=3)
    rois[:, 0] = [0, 2, -0.5]  # -0.5 truncates to 0: valid
    g, feeds = build_single("MaxRoiPool", [x, rois], {"pooled_shape": [2, 2]})
    with pytest.raises(KilnError, match=r"IndexError: rois \[1\] have batch indices \[2.0\] outside \[0, 2\)"):
        evaluate(g, feeds)
    rois[1, 0] = -1
    with pytest.raises(ShapeInferenceError, match=r"rois \[1\] have batch indices \[-1.0\] outside \[0, 2\)"):
        build_single("MaxRoiPool", [x, rois], {"pooled_shape": [2, 2]}, const_inputs=(1,))


@pytest.mark.parametrize("x,rois,attrs,match", [
    ((1, 2, 4), (1, 5), {}, r"X must have rank 4 \(\[N, C, H, W\]\), got shape \[1, 2, 4\]"),
    ((1, 2, 4, 4), (5,), {}, r"rois must have rank 2 \(\[num_rois, 5\]\)"),
    ((1, 2, 4, 4), (3, 4), {}, r"rois' last dim must be 5 \(\[batch_index, x1, y1, x2, y2\]\), got shape \[3, 4\]"),
    ((1, 2, 4, 4), (1, 5), {"pooled_shape": [2]}, r"pooled_shape must be 2 ints >= 1 \(pooled height, width\)"),
    ((1, 2, 4, 4), (1, 5), {"pooled_shape": [2, 0]}, r"pooled_shape must be 2 ints >= 1"),
    ((1, 2, 4, 4), (1, 5), {"spatial_scale": 0.0}, r"spatial_scale must be a positive finite number, got 0.0"),
    ((1, 2, 4, 4), (1, 5), {"spatial_scale": -0.5}, r"spatial_scale must be a positive finite number"),
])
def test_max_roi_pool_inference_names_what_is_wrong(x, rois, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("MaxRoiPool", [np.zeros(x, F32), np.zeros(rois, F32)], {"pooled_shape": [2, 2], **attrs})


def test_max_roi_pool_needs_pooled_shape_and_one_float_type():
    with pytest.raises(KilnError, match="pooled_shape"):
        build_single("MaxRoiPool", [np.zeros((1, 1, 4, 4), F32), np.zeros((1, 5), F32)])
    with pytest.raises(ShapeInferenceError, match="rois is float64 but X is float32"):
        build_single("MaxRoiPool", [np.zeros((1, 1, 4, 4), F32), np.zeros((1, 5))], {"pooled_shape": [1, 1]})


# --------------------------------------------------------------------------- import and export


@pytest.mark.parametrize("opset", [1, 18, 22])
def test_import_max_roi_pool(opset):
    import kiln
    from kiln.serializer.onnx_import import import_onnx
    x, rois = roi_case(11, halves=True, scale=0.5)
    attrs = {"pooled_shape": [3, 2], "spatial_scale": 0.5}
    g = import_onnx(_model("MaxRoiPool", [x, rois], attrs, opset))
    assert g.nodes[0].op == "MaxRoiPool"
    np.testing.assert_array_equal(kiln.load(g).run([x, rois], as_list=True)[0], ort_run("MaxRoiPool", [x, rois], attrs))


@pytest.mark.parametrize("opset", [2, 18, 22])
def test_import_global_lp_pool(opset):
    import kiln
    from kiln.serializer.onnx_import import import_onnx
    x = RNG.standard_normal((2, 3, 4, 5)).astype(F32)
    g = import_onnx(_model("GlobalLpPool", [x], {"p": 3}, opset))
    assert g.nodes[0].op == "GlobalLpPool" and g.nodes[0].attrs["p"] == 3
    np.testing.assert_allclose(kiln.load(g).run([x], as_list=True)[0], ort_run("GlobalLpPool", [x], {"p": 3}),
                               rtol=1e-5, atol=1e-6)


def test_import_global_lp_pool_1_is_refused_by_name():
    """GlobalLpPool-1 took p as a float; onnx's version converter has no adapter to 2, so the model is refused."""
    from kiln.serializer.onnx_import import import_onnx
    x = RNG.standard_normal((1, 2, 3, 3)).astype(F32)
    with pytest.raises(UnsupportedOpError, match="GlobalLpPool"):
        import_onnx(_model("GlobalLpPool", [x], {"p": 3.0}, 1))


def test_global_lp_and_max_roi_pool_export_runs_at_opset_18_and_checks_at_22():
    """Both export as themselves. ONNX Runtime has no GlobalLpPool-22 or MaxRoiPool-22 kernel (its CPU kernels stop
    at 2 and 1) and ONNX's reference evaluator has neither op, so the opset-18 model is run by ONNX Runtime and the
    opset-22 one is checked with onnx.checker and compared node for node with it."""
    from kiln.serializer import onnx as kx
    x, rois = roi_case(12, halves=True, scale=0.25)
    cases = [("GlobalLpPool", [RNG.standard_normal((2, 3, 4, 5)).astype(F32)], {"p": 3}),
             ("GlobalLpPool", [RNG.standard_normal((1, 2, 6)).astype(np.float16)], {}),
             ("MaxRoiPool", [x, rois], {"pooled_shape": [3, 2], "spatial_scale": 0.25}),
             ("MaxRoiPool", [x, rois], {"pooled_shape": [1, 4]})]
    for op, inputs, attrs in cases:
        g, feeds = build_single(op, inputs, attrs, symbolic_batch=True)
        want = evaluate(g, feeds)[0]
        assert kx.default_opset(g) == 18
        m18, m22 = (kx.to_onnx_model(g, opset=o) for o in (18, 22))
        for m in (m18, m22):
            onnx.checker.check_model(m, full_check=True)
            assert [n.op_type for n in m.graph.node] == [op]
        n18, n22 = m18.graph.node[0], m22.graph.node[0]
        assert (n18.input, n18.output, n18.attribute) == (n22.input, n22.output, n22.attribute)
        assert {a.name for a in n18.attribute} == set(attrs)
        sess = ort.InferenceSession(m18.SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), feeds)})[0]
        tol = 1e-5 if want.dtype == F32 else 2e-3
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{op} {attrs}")


def test_bfloat16_exports_through_float32_before_opset_22():
    """GlobalLpPool-22 and MaxRoiPool-22 add bfloat16: before 22 a bfloat16 node is written on its inputs cast to
    float32 and its output cast back, which is how kiln computes it, so ONNX Runtime (at opset 18) gives kiln's
    bits. ORT's Python binding takes no bfloat16, so the graph takes and gives float32 around bfloat16 Casts."""
    from kiln.ir import Graph
    from kiln.serializer import onnx as kx
    x, rois = roi_case(13, halves=True)
    for op, inputs, attrs in [("GlobalLpPool", [x], {"p": 3}), ("MaxRoiPool", [x, rois], {"pooled_shape": [3, 2]})]:
        g = Graph("t")
        values = [g.add_input(f"x{k}", "float32", list(a.shape)) for k, a in enumerate(inputs)]
        y = g.op(op, *[g.op("Cast", v, to=onnx.TensorProto.BFLOAT16) for v in values], **attrs)
        g.outputs = [g.op("Cast", y, to=onnx.TensorProto.FLOAT, name="y")]
        want = evaluate(g, inputs)[0]
        assert kx.default_opset(g) == 18
        m18 = kx.to_onnx_model(g, opset=18)
        onnx.checker.check_model(m18, full_check=True)
        assert [n.op_type for n in m18.graph.node if n.op_type != "Cast"] == [op]
        assert len(m18.graph.node) == 2 * len(inputs) + 3  # bfloat16 and back to float32 around the op
        got = ort.InferenceSession(m18.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {f"x{k}": a for k, a in enumerate(inputs)})[0]
        np.testing.assert_array_equal(got, want)
        m22 = kx.to_onnx_model(g, opset=22)
        onnx.checker.check_model(m22, full_check=True)
        assert [n.op_type for n in m22.graph.node] == ["Cast"] * len(inputs) + [op, "Cast"]

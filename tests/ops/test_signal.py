"""ai.onnx signal ops (kiln.ir.ops.signal): "DFT" (kiln implements DFT-20; DFT-17 imports with its axis attribute
made an input and exports at opsets 18/19), "STFT", "HannWindow", "HammingWindow", "BlackmanWindow" and
"MelWeightMatrix", each against ONNX's reference evaluator over its modes, dtypes and edge cases, plus the
inference errors by name."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.errors import KilnError, ShapeInferenceError, UnsupportedOpError
from kiln.ir import evaluate
from op_harness import build_single, check_op, inferred, onnx_reference

RNG = np.random.default_rng(17)
I64 = np.int64


def signal(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def tol(dtype):
    return {"rtol": 1e-2, "atol": 1e-2} if np.dtype(dtype).itemsize == 2 else {"rtol": 1e-4, "atol": 1e-4}


# --------------------------------------------------------------------------- DFT

# (onesided, inverse, last dim of the input)
DFT_MODES = [(0, 0, 1), (0, 0, 2), (0, 1, 1), (0, 1, 2), (1, 0, 1), (1, 1, 2)]


@pytest.mark.parametrize("onesided,inverse,last", DFT_MODES)
@pytest.mark.parametrize("axis", [None, 0, 1, 2, -3, -4])
def test_dft_matches_onnx_reference(onesided, inverse, last, axis):
    x = signal(3, 5, 6, last)
    inputs = [x, None] + ([] if axis is None else [np.array(axis, I64)])
    attrs = {"onesided": onesided, "inverse": inverse}
    want = onnx_reference("DFT", inputs, attrs, opset=20)
    check_op("DFT", inputs, want, attrs, const_inputs=(2,), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("onesided,inverse,last", DFT_MODES)
@pytest.mark.parametrize("n", [1, 3, 6, 11])
def test_dft_length_pads_and_truncates(onesided, inverse, last, n):
    x = signal(2, 6, last)
    inputs = [x, np.array(n, I64), np.array(1, I64)]
    attrs = {"onesided": onesided, "inverse": inverse}
    want = onnx_reference("DFT", inputs, attrs, opset=20)
    check_op("DFT", inputs, want, attrs, const_inputs=(1, 2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dft_dtypes_round_once(dtype):
    x = signal(2, 8, 2, dtype=dtype)
    want = np.fft.fft(x[..., 0].astype(np.float64) + 1j * x[..., 1].astype(np.float64), axis=1)
    (got,) = check_op("DFT", [x, None, np.array(1, I64)], None, {}, const_inputs=(2,))
    assert got.dtype == dtype
    np.testing.assert_allclose(got[..., 0], want.real, **tol(dtype))
    np.testing.assert_allclose(got[..., 1], want.imag, **tol(dtype))


def test_dft_inverse_undoes_the_forward_transform():
    x = signal(2, 7, 2, dtype=np.float64)
    (y,) = check_op("DFT", [x], None, {})
    (back,) = check_op("DFT", [y], None, {"inverse": 1})
    np.testing.assert_allclose(back, x, atol=1e-12)
    (spec,) = check_op("DFT", [x[..., :1]], None, {"onesided": 1})  # RFFT of a real signal of odd length 7
    (real,) = check_op("DFT", [spec, np.array(7, I64)], None, {"onesided": 1, "inverse": 1}, const_inputs=(1,))
    np.testing.assert_allclose(real, x[..., :1], atol=1e-12)


def test_dft_run_time_axis_and_length():
    x = signal(3, 4, 5, 1)
    for axis, n in [(1, 6), (-2, 3), (0, 2)]:
        inputs = [x, np.array(n, I64), np.array(axis, I64)]
        want = onnx_reference("DFT", inputs, {"onesided": 1}, opset=20)
        check_op("DFT", inputs, want, {"onesided": 1}, rtol=1e-4, atol=1e-4)
    assert inferred("DFT", [x, None, np.array(1, I64)], symbolic_batch=False) == [(None, None, None, 2)]


def test_dft_inferred_shapes():
    x = signal(2, 6, 4, 1)
    assert inferred("DFT", [x], {"onesided": 1}) == [("batch", 6, 3, 2)]  # default axis -2
    assert inferred("DFT", [x, np.array(9, I64), np.array(1, I64)], const_inputs=(1, 2)) == [("batch", 9, 4, 2)]
    assert inferred("DFT", [x, np.array(9, I64), np.array(1, I64)], {"onesided": 1}, const_inputs=(1, 2)) == \
        [("batch", 5, 4, 2)]
    c = signal(2, 5, 4, 2)
    assert inferred("DFT", [c, None, np.array(1, I64)], {"onesided": 1, "inverse": 1}, const_inputs=(2,)) == \
        [("batch", 8, 4, 1)]
    assert inferred("DFT", [c, None, np.array(0, I64)], const_inputs=(2,)) == [("batch", 5, 4, 2)]  # symbol kept
    assert inferred("DFT", [c, np.array(3, I64)], const_inputs=()) == [("batch", 5, None, 2)]  # run-time length


def test_dft_empty_tensors():
    x = np.zeros((0, 4, 1), np.float32)
    (y,) = check_op("DFT", [x, None, np.array(1, I64)], None, {"onesided": 1}, const_inputs=(2,))
    assert y.shape == (0, 3, 2)
    z = np.zeros((2, 0, 2), np.float32)  # an empty signal zero-padded to dft_length
    (y,) = check_op("DFT", [z, np.array(4, I64), np.array(1, I64)], np.zeros((2, 4, 2), np.float32), {},
                    const_inputs=(1, 2))


@pytest.mark.parametrize("shape,inputs,attrs,match", [
    ((2, 5, 3), [], {}, "last dim of input must be 1"),
    ((5,), [], {}, "rank >= 2"),
    ((2, 5, 2), [], {"onesided": 1}, "takes a real input"),
    ((2, 5, 1), [], {"onesided": 1, "inverse": 1}, "takes a one-sided complex input"),
    ((2, 5, 1), [None, np.array(-1, I64)], {}, "axis -1 is out of range"),
    ((2, 5, 1), [None, np.array(2, I64)], {}, r"axis 2 is out of range .* \[-3, -2\] or \[0, 1\]"),
    ((2, 5, 1), [None, np.array(-4, I64)], {}, "axis -4 is out of range"),
    ((2, 5, 1), [np.array(0, I64)], {}, "dft_length must be >= 1"),
    ((2, 5, 1), [np.array([2, 3], I64)], {}, "dft_length must be a scalar"),
    ((2, 1, 2), [], {"onesided": 1, "inverse": 1}, r"default dft_length 2 \* \(size - 1\) is 0"),
    ((2, 0, 2), [], {}, "has size 0"),
    ((2, 5, 1), [], {"inverse": 2}, "inverse must be 0 or 1"),
])
def test_dft_inference_names_what_is_wrong(shape, inputs, attrs, match):
    consts = tuple(range(1, 1 + len(inputs)))
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("DFT", [np.zeros(shape, np.float32), *inputs], attrs, const_inputs=consts)


def test_dft_run_time_errors_name_the_problem():
    g, feeds = build_single("DFT", [signal(2, 5, 1), None, np.array(1, I64)], {})
    with pytest.raises(KilnError, match="axis 3 is out of range"):
        evaluate(g, [feeds[0], np.array(3, I64)])
    g, feeds = build_single("DFT", [signal(2, 5, 1), np.array(4, I64)], {})
    with pytest.raises(KilnError, match="length must be >= 1"):
        evaluate(g, [feeds[0], np.array(0, I64)])


# ---- DFT-17 (axis attribute): import and export

def _onnx_dft(opset, attrs, shape, dft_length=None, axis_input=None):
    from onnx import TensorProto, helper
    names = ["x"] + (["n"] if dft_length is not None or axis_input is not None else [])
    inits = []
    if dft_length is not None:
        inits.append(helper.make_tensor("n", TensorProto.INT64, [], [dft_length]))
    elif axis_input is not None:
        names[-1] = ""
    if axis_input is not None:
        names.append("a")
        inits.append(helper.make_tensor("a", TensorProto.INT64, [], [axis_input]))
    node = helper.make_node("DFT", names, ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [17, 18, 19])
@pytest.mark.parametrize("attrs,dft_length", [({}, None), ({"axis": 2}, None), ({"axis": -3, "inverse": 1}, 7),
                                              ({"axis": 1, "onesided": 1}, 6), ({"axis": 0}, None)])
def test_dft17_imports_with_its_axis_attribute(opset, attrs, dft_length):
    pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    from kiln.serializer.onnx_import import import_onnx
    x = signal(3, 5, 4, 1 if attrs.get("onesided") or not attrs.get("inverse") else 2)
    model = _onnx_dft(opset, attrs, x.shape, dft_length)
    g = import_onnx(model)
    (node,) = g.nodes
    assert "axis" not in node.attrs and node.inputs[2].const == attrs.get("axis", 1)  # DFT-17's default axis 1
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(evaluate(g, [x])[0], want, rtol=1e-4, atol=1e-4)


def test_dft20_imports_with_axis_input():
    pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    from kiln.serializer.onnx_import import import_onnx
    x = signal(3, 5, 4, 2)
    for model in (_onnx_dft(20, {"inverse": 1}, x.shape, 8, axis_input=1), _onnx_dft(22, {}, x.shape)):
        g = import_onnx(model)
        want = ReferenceEvaluator(model).run(None, {"x": x})[0]
        np.testing.assert_allclose(evaluate(g, [x])[0], want, rtol=1e-4, atol=1e-4)


def test_dft_exports_as_dft17_before_opset_20():
    onnx = pytest.importorskip("onnx")
    import kiln.serializer.onnx as kx
    g, _ = build_single("DFT", [signal(2, 6, 4, 1), None, np.array(-3, I64)], {"onesided": 1}, const_inputs=(2,))
    assert kx.default_opset(g) == 18
    for opset, inputs, axis in [(18, 1, [1]), (19, 1, [1]), (20, 3, []), (22, 3, [])]:
        model = kx.to_onnx_model(g, opset=opset)
        onnx.checker.check_model(model, full_check=True)
        (node,) = model.graph.node
        assert len(node.input) == inputs
        assert [a.i for a in node.attribute if a.name == "axis"] == axis  # -3 made non-negative for DFT-17


def test_dft_export_refuses_a_run_time_axis_before_opset_20():
    pytest.importorskip("onnx")
    import kiln.serializer.onnx as kx
    g, _ = build_single("DFT", [signal(2, 6, 4, 1), None, np.array(1, I64)], {})
    assert kx.default_opset(g) == 20
    kx.to_onnx_model(g, opset=20)
    with pytest.raises(UnsupportedOpError, match="DFT axis computed at run time needs ai.onnx opset 20"):
        kx.to_onnx_model(g, opset=19)


# --------------------------------------------------------------------------- STFT


@pytest.mark.parametrize("window,frame_length,step,onesided", [
    (True, True, 4, 1), (True, False, 3, 1), (False, True, 5, 1), (False, False, 1, 1),
    (True, True, 4, 0), (False, True, 7, 0), (True, False, 16, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stft_matches_onnx_reference(window, frame_length, step, onesided, dtype):
    x = signal(2, 40, 1, dtype=dtype)
    w = np.hanning(12).astype(dtype) if window else None
    inputs = [x, np.array(step, I64), w, np.array(12, I64) if frame_length else None]
    attrs = {"onesided": onesided}
    want = onnx_reference("STFT", inputs, attrs, opset=17)
    check_op("STFT", inputs, want, attrs, const_inputs=(1, 3), rtol=1e-4, atol=1e-4)


def test_stft_complex_signal_and_int32_sizes():
    x = signal(1, 30, 2)
    inputs = [x, np.array(4, np.int32), signal(10), np.array(10, np.int32)]
    want = onnx_reference("STFT", inputs, {"onesided": 0}, opset=17)
    check_op("STFT", inputs, want, {"onesided": 0}, rtol=1e-4, atol=1e-4)


def test_stft_half_computes_in_float32():
    x = signal(1, 32, 1, dtype=np.float16)
    (got,) = check_op("STFT", [x, np.array(8, I64), None, np.array(16, I64)], None, {}, const_inputs=(1, 3))
    frames = np.stack([x[0, s:s + 16, 0].astype(np.float64) for s in range(0, 17, 8)])
    want = np.fft.rfft(frames, axis=-1)
    assert got.dtype == np.float16 and got.shape == (1, 3, 9, 2)
    np.testing.assert_allclose(got[0, ..., 0], want.real, rtol=1e-2, atol=2e-2)


def test_stft_inferred_shapes():
    x = signal(2, 40, 1)
    assert inferred("STFT", [x, np.array(4, I64), None, np.array(12, I64)], const_inputs=(1, 3)) == \
        [("batch", 8, 7, 2)]
    assert inferred("STFT", [x, np.array(4, I64), np.hanning(8).astype(np.float32)], {"onesided": 0},
                    const_inputs=(1,)) == [("batch", 9, 8, 2)]
    assert inferred("STFT", [x, np.array(4, I64)], const_inputs=(1,)) == [("batch", 1, 21, 2)]  # one whole frame
    assert inferred("STFT", [x, np.array(4, I64), None, np.array(12, I64)], const_inputs=()) == \
        [("batch", None, None, 2)]
    (y,) = check_op("STFT", [np.zeros((0, 20, 1), np.float32), np.array(5, I64), None, np.array(8, I64)], None, {},
                    const_inputs=(1, 3))
    assert y.shape == (0, 3, 5, 2)


@pytest.mark.parametrize("shape,inputs,attrs,match", [
    ((2, 20, 2), [np.array(4, I64)], {}, "takes a real signal"),
    ((2, 20), [np.array(4, I64)], {}, "signal must have rank 3"),
    ((2, 20, 3), [np.array(4, I64)], {"onesided": 0}, "last dim of signal must be 1"),
    ((2, 20, 1), [np.array(0, I64)], {}, "frame_step must be >= 1"),
    ((2, 20, 1), [np.array(4, I64), None, np.array(0, I64)], {}, "frame_length must be >= 1"),
    ((2, 20, 1), [np.array(4, I64), None, np.array(21, I64)], {}, "longer than the signal"),
    ((2, 20, 1), [np.array(4, I64), np.ones(6, np.float32), np.array(8, I64)], {}, "the window has 6 values"),
    ((2, 20, 1), [np.array(4, I64), np.ones(6, np.float64)], {}, "window is float64 but signal is float32"),
    ((2, 20, 1), [np.array(4, I64), None, np.array(8, np.int32)], {}, "must share a dtype"),
    ((2, 20, 1), [np.array([4, 4], I64)], {}, "frame_step must be a scalar"),
    ((2, 20, 1), [np.array(4, I64)], {"onesided": 3}, "onesided must be 0 or 1"),
])
def test_stft_inference_names_what_is_wrong(shape, inputs, attrs, match):
    consts = tuple(i + 1 for i, a in enumerate(inputs) if a is not None)
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("STFT", [np.zeros(shape, np.float32), *inputs], attrs, const_inputs=consts)


def test_stft_run_time_frame_checks():
    g, feeds = build_single("STFT", [signal(1, 10, 1), np.array(2, I64), None, np.array(4, I64)], {})
    with pytest.raises(KilnError, match="frame_length 12 is longer than the signal"):
        evaluate(g, [feeds[0], np.array(2, I64), np.array(12, I64)])


# --------------------------------------------------------------------------- windows

WINDOWS = ["HannWindow", "HammingWindow", "BlackmanWindow"]
# output_datatype code -> numpy dtype (kiln's T2: every int and float type)
OUT_TYPES = {1: np.float32, 11: np.float64, 10: np.float16, 6: np.int32, 7: np.int64, 2: np.uint8, 3: np.int8}


@pytest.mark.parametrize("op,periodic,size", list(itertools.product(WINDOWS, [0, 1], [0, 2, 5, 10, 64])) +
                         [(w, 1, 1) for w in WINDOWS])
def test_windows_match_onnx_reference(op, periodic, size):
    inputs = [np.array(size, I64)]
    attrs = {"periodic": periodic}
    check_op(op, inputs, onnx_reference(op, inputs, attrs, opset=17), attrs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("op,code", list(itertools.product(WINDOWS, OUT_TYPES)))
def test_windows_output_datatypes(op, code):
    inputs = [np.array(9, np.int32)]
    attrs = {"periodic": 0, "output_datatype": code}
    (got,) = check_op(op, inputs, None, attrs, const_inputs=(0,))
    assert got.dtype == OUT_TYPES[code]
    want = onnx_reference(op, inputs, attrs, opset=17)
    if np.dtype(OUT_TYPES[code]).kind == "f":
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **tol(OUT_TYPES[code]))
    else:
        np.testing.assert_array_equal(got, want)  # values in [0, 1] truncate: the peak of a symmetric window


@pytest.mark.parametrize("op", WINDOWS)
def test_symmetric_window_of_one_is_nan_as_onnx_defines_it(op):
    attrs = {"periodic": 0}
    (got,) = check_op(op, [np.array(1, I64)], None, attrs)
    assert np.isnan(got).all() and np.isnan(onnx_reference(op, [np.array(1, I64)], attrs, opset=17)).all()
    g, feeds = build_single(op, [np.array(1, I64)], {"periodic": 0, "output_datatype": 6})
    with pytest.raises(KilnError, match="integer output_datatype int32 cannot hold"):
        evaluate(g, feeds)


def test_window_shape_from_constant_or_symbolic_size():
    assert inferred("HannWindow", [np.array(12, I64)], const_inputs=(0,)) == [(12,)]
    assert inferred("HannWindow", [np.array(12, I64)]) == [(None,)]
    from kiln.ir import Graph
    from kiln.ir.passes.shape_inference import infer_shapes
    g = Graph("g")
    x = g.add_input("x", "float32", ["batch", "n"])
    n = g.op("Gather", g.op("Shape", x), g.add_initializer("one", np.array(1, I64)), axis=0)
    w = g.op("BlackmanWindow", n, output_datatype=11)
    g.outputs = [w]
    infer_shapes(g)  # symbolic values flow through the pass's symbol table
    assert w.type.shape == ("n",) and w.type.dtype.short == "float64"


@pytest.mark.parametrize("inputs,attrs,match", [
    ([np.array(-3, I64)], {}, "size must be >= 0, got -3"),
    ([np.array([3, 4], I64)], {}, "size must be a scalar"),
    ([np.array(4, I64)], {"output_datatype": 9}, "output_datatype=9 is not an element type"),
    ([np.array(4, I64)], {"output_datatype": 8}, "output_datatype=8 is not an element type"),
    ([np.array(4, I64)], {"periodic": 2}, "periodic must be 0 or 1"),
])
@pytest.mark.parametrize("op", WINDOWS)
def test_window_inference_names_what_is_wrong(op, inputs, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single(op, inputs, attrs, const_inputs=(0,))


# --------------------------------------------------------------------------- MelWeightMatrix


def mel_inputs(mels, dft, rate, lo, hi, int_type=np.int32, float_type=np.float32):
    return [np.array(mels, int_type), np.array(dft, int_type), np.array(rate, int_type), np.array(lo, float_type),
            np.array(hi, float_type)]


@pytest.mark.parametrize("mels,dft,rate,lo,hi", [
    (8, 16, 8192, 0, 4096), (10, 64, 16000, 100, 7000), (40, 512, 16000, 0, 8000), (3, 31, 1000, 20, 450),
    (5, 16, 100, 0, 10), (1, 8, 8, 0, 4), (20, 128, 22050, 300, 300)])
def test_mel_weight_matrix_matches_onnx_reference(mels, dft, rate, lo, hi):
    inputs = mel_inputs(mels, dft, rate, lo, hi)
    want = onnx_reference("MelWeightMatrix", inputs, {}, opset=17)
    check_op("MelWeightMatrix", inputs, want, {}, const_inputs=(0, 1, 2, 3, 4), rtol=0, atol=0)
    check_op("MelWeightMatrix", inputs, want, {}, rtol=0, atol=0)  # run-time sizes: shape known at run time


@pytest.mark.parametrize("code", OUT_TYPES)
def test_mel_weight_matrix_output_datatypes_and_double_edges(code):
    inputs = mel_inputs(6, 40, 16000, 50.0, 6000.0, int_type=np.int64, float_type=np.float64)
    attrs = {"output_datatype": code}
    (got,) = check_op("MelWeightMatrix", inputs, None, attrs, const_inputs=(0, 1, 2))
    assert got.dtype == OUT_TYPES[code] and got.shape == (21, 6)
    want = onnx_reference("MelWeightMatrix", inputs, attrs, opset=17)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **tol(OUT_TYPES[code]))


def test_mel_weight_matrix_no_bins_and_inferred_shape():
    (got,) = check_op("MelWeightMatrix", mel_inputs(0, 16, 8000, 0, 4000), None, {}, const_inputs=(0, 1, 2))
    assert got.shape == (9, 0)
    assert inferred("MelWeightMatrix", mel_inputs(8, 17, 8000, 0, 4000), const_inputs=(0, 1, 2)) == [(9, 8)]
    assert inferred("MelWeightMatrix", mel_inputs(8, 17, 8000, 0, 4000)) == [(None, None)]


def test_mel_weight_matrix_refuses_bands_outside_the_spectrogram():
    # the top edge past Nyquist (bin 10 of 9) and a negative lower edge (bins below 0: the reference wraps around)
    for lo, hi in [(0, 8000), (-300, 2000)]:
        g, feeds = build_single("MelWeightMatrix", mel_inputs(4, 16, 8000, lo, hi), {})
        with pytest.raises(KilnError, match="outside the 9 bins of a 16-point DFT"):
            evaluate(g, feeds)


@pytest.mark.parametrize("inputs,attrs,match", [
    (mel_inputs(8, 0, 8000, 0, 4000), {}, "dft_length must be >= 1"),
    (mel_inputs(-1, 16, 8000, 0, 4000), {}, "num_mel_bins must be >= 0"),
    (mel_inputs(8, 16, 0, 0, 4000), {}, "sample_rate must be >= 1"),
    (mel_inputs(8, 16, 8000, 0, 4000)[:2] + [np.array(8000, I64)] + mel_inputs(8, 16, 8000, 0, 4000)[3:], {},
     "must share an integer dtype"),
    (mel_inputs(8, 16, 8000, 0, 4000)[:4] + [np.array(4000, np.float64)], {}, "must share a float dtype"),
    (mel_inputs(8, 16, 8000, 0, 4000), {"output_datatype": 9}, "output_datatype=9"),
])
def test_mel_weight_matrix_inference_names_what_is_wrong(inputs, attrs, match):
    with pytest.raises(ShapeInferenceError, match=match):
        build_single("MelWeightMatrix", inputs, attrs, const_inputs=(0, 1, 2))

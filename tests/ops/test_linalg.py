"""MatMul, Gemm and Einsum: references against torch (float64) or numpy written another way,
inference on symbolic shapes, and inference failures."""
import numpy as np
import pytest
from op_harness import build_single, check_op

from kiln.errors import ShapeInferenceError

torch = pytest.importorskip("torch")

TOL = {np.float16: dict(rtol=2e-2, atol=2e-2), np.float32: dict(rtol=1e-5, atol=1e-5),
       np.float64: dict(rtol=1e-12, atol=1e-12)}


def rand(rng, shape, dtype=np.float32):
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-5, 6, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def t64(a):
    return torch.from_numpy(np.asarray(a, np.float64))


def out_types(op, inputs, attrs=None, **kw):
    g, _ = build_single(op, inputs, attrs, **kw)
    return [v.type for v in g.outputs]


# --------------------------------------------------------------------------- MatMul

MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4,)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((2, 3, 4), (4, 5)),
    ((4,), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 6)),
    ((2, 4, 8, 16), (2, 4, 16, 8)),  # attention scores [b,h,s,d] x [b,h,d,s]
]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_matmul_matches_torch(rng, sa, sb, dtype):
    a, b = rand(rng, sa, dtype), rand(rng, sb, dtype)
    check_op("MatMul", [a, b], torch.matmul(t64(a), t64(b)).numpy(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_matmul_int_matches_explicit_sum(rng, dtype):
    a, b = rand(rng, (2, 3, 4), dtype), rand(rng, (4, 5), dtype)
    expected = (a[..., :, :, None] * b[None, None, :, :]).sum(axis=-2).astype(dtype)
    check_op("MatMul", [a, b], expected)


def test_matmul_bfloat16(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = rand(rng, (3, 8)).astype(ml_dtypes.bfloat16)
    b = rand(rng, (8, 2)).astype(ml_dtypes.bfloat16)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    # op_harness compares non-"f"-kind dtypes exactly, so compare the bfloat16 result here.
    [y] = check_op("MatMul", [a, b])
    np.testing.assert_allclose(y.astype(np.float64), expected, rtol=2e-2, atol=2e-2)


def test_matmul_symbolic_batch_flows_through(rng):
    a, b = rand(rng, (2, 4, 3, 8)), rand(rng, (2, 4, 8, 3))
    check_op("MatMul", [a, b], torch.matmul(t64(a), t64(b)).numpy(), symbolic_batch=True)
    [t] = out_types("MatMul", [a, b], symbolic_batch=True)
    assert t.shape == ("batch", 4, 3, 3)
    [t] = out_types("MatMul", [a, rand(rng, (8, 5))], symbolic_batch=True)
    assert t.shape == ("batch", 4, 3, 5)


@pytest.mark.parametrize("sa,sb,match", [
    ((3, 4), (5, 6), "inner dims differ"),
    ((2, 3, 4), (3, 4, 5), "do not broadcast"),
    ((), (4,), "rank >= 1"),
])
def test_matmul_bad_shapes_fail_naming_the_node(sa, sb, match):
    a, b = np.zeros(sa, np.float32), np.zeros(sb, np.float32)
    with pytest.raises(ShapeInferenceError, match=rf"'matmul' \(MatMul\).*{match}"):
        build_single("MatMul", [a, b])


def test_matmul_mixed_dtypes_fail():
    with pytest.raises(ShapeInferenceError, match="one dtype"):
        build_single("MatMul", [np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float64)])


# --------------------------------------------------------------------------- Gemm

@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (), (5,), (3, 1), (1, 5), (3, 5)])
def test_gemm_matches_torch(rng, trans_a, trans_b, c_shape):
    a = rand(rng, (4, 3) if trans_a else (3, 4))
    b = rand(rng, (5, 4) if trans_b else (4, 5))
    c = None if c_shape is None else rand(rng, c_shape)
    alpha, beta = 0.5, 2.0
    at, bt = t64(a), t64(b)
    expected = alpha * ((at.T if trans_a else at) @ (bt.T if trans_b else bt))
    if c is not None:
        expected = expected + beta * t64(c)
    attrs = dict(alpha=alpha, beta=beta, transA=trans_a, transB=trans_b)
    check_op("Gemm", [a, b, c], expected.numpy(), attrs, const_inputs=[1, 2], symbolic_batch=True)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_gemm_dtypes_with_bias(rng, dtype):
    a, b, c = rand(rng, (6, 8), dtype), rand(rng, (3, 8), dtype), rand(rng, (3,), dtype)
    expected = torch.nn.functional.linear(t64(a), t64(b), t64(c)).numpy()
    check_op("Gemm", [a, b, c], expected, dict(transB=1), **TOL[dtype])


def test_gemm_int_hand_computed():
    a = np.array([[1, 2], [3, 4]], np.int32)
    b = np.array([[5, 6], [7, 8]], np.int32)
    c = np.array([10, 20], np.int32)
    check_op("Gemm", [a, b, c], np.array([[29, 42], [53, 70]], np.int32))


def test_gemm_keeps_symbolic_rows(rng):
    a, b = rand(rng, (3, 4)), rand(rng, (5, 4))
    [t] = out_types("Gemm", [a, b, rand(rng, (5,))], dict(transB=1), const_inputs=[1, 2], symbolic_batch=True)
    assert t.shape == ("batch", 5)


@pytest.mark.parametrize("sa,sb,sc,attrs,match", [
    ((3, 4), (5, 6), None, {}, "inner dims differ"),
    ((3, 4), (5, 4), None, {}, "inner dims differ"),
    ((2, 3, 4), (4, 5), None, {}, "must be 2-D"),
    ((3, 4), (4, 5), (4, 5), {}, "does not broadcast"),
    ((3, 4), (4, 5), (1, 3, 5), {}, "rank <= 2"),
])
def test_gemm_bad_shapes_fail(sa, sb, sc, attrs, match):
    inputs = [np.zeros(sa, np.float32), np.zeros(sb, np.float32), None if sc is None else np.zeros(sc, np.float32)]
    with pytest.raises(ShapeInferenceError, match=rf"\(Gemm\).*{match}"):
        build_single("Gemm", inputs, attrs)


# --------------------------------------------------------------------------- Einsum

EQUATIONS = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 8), (2, 3, 5, 8)]),
    ("...ij,...jk->...ik", [(2, 3, 4, 5), (3, 5, 2)]),
    ("...ij,jk", [(2, 3, 4), (4, 6)]),
    ("ii->i", [(4, 4)]),
    ("ij->", [(3, 4)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("i,i", [(7,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("bij->bji", [(2, 3, 4)]),
    ("...i,...i->...", [(2, 1, 5), (3, 5)]),
    ("b i d, b j d -> b i j", [(2, 3, 4), (2, 5, 4)]),
]


@pytest.mark.parametrize("equation,shapes", EQUATIONS)
def test_einsum_matches_torch(rng, equation, shapes):
    inputs = [rand(rng, s) for s in shapes]
    if equation == "i,i":
        inputs = inputs * 2
    expected = torch.einsum(equation.replace(" ", ""), *[t64(x) for x in inputs]).numpy()
    check_op("Einsum", inputs, expected, dict(equation=equation))


@pytest.mark.parametrize("dtype", [np.float16, np.int64])
def test_einsum_dtypes(rng, dtype):
    a, b = rand(rng, (2, 3, 4), dtype), rand(rng, (2, 4, 5), dtype)
    expected = np.stack([a[i].astype(np.float64) @ b[i].astype(np.float64) for i in range(2)])
    check_op("Einsum", [a, b], expected.astype(dtype), dict(equation="bij,bjk->bik"), **TOL.get(dtype, {}))


def test_einsum_symbolic_batch_and_ellipsis(rng):
    a, b = rand(rng, (2, 3, 4)), rand(rng, (2, 4, 5))
    [t] = out_types("Einsum", [a, b], dict(equation="bij,bjk->bik"), symbolic_batch=True)
    assert t.shape == ("batch", 3, 5)
    [t] = out_types("Einsum", [a, b], dict(equation="...ij,...jk->...ik"), symbolic_batch=True)
    assert t.shape == ("batch", 3, 5)
    [t] = out_types("Einsum", [a, b], dict(equation="bij,bjk->kb"), symbolic_batch=True)
    assert t.shape == (5, "batch")


@pytest.mark.parametrize("equation,shapes,match", [
    ("ij,jk->ik", [(3, 4)], "has 2 operands"),
    ("ij,jk->ik", [(3, 4), (5, 6)], "subscript 'j' has size 4 and 5"),
    ("ijk->i", [(3, 4)], "rank 2 but 3 subscripts"),
    ("ij->z", [(3, 4)], "'z' does not appear"),
    ("ij->ii", [(3, 3)], "appears twice"),
    ("...i,...i", [(2, 5), (3, 5)], "do not broadcast"),
    ("i1->i", [(3,)], "invalid character"),
])
def test_einsum_bad_equations_fail(equation, shapes, match):
    inputs = [np.zeros(s, np.float32) for s in shapes]
    with pytest.raises(ShapeInferenceError, match=rf"\(Einsum\).*{match}"):
        build_single("Einsum", inputs, dict(equation=equation))


# --------------------------------------------------------------------------- Det


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (5, 5), (3, 2, 2), (2, 3, 4, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_det_matches_torch_and_onnx_reference(rng, shape, dtype):
    from op_harness import onnx_reference
    x = rand(rng, shape, dtype)
    expected = torch.linalg.det(t64(x)).numpy()
    outs = check_op("Det", [x], expected, symbolic_batch=len(shape) > 2, **TOL[dtype])
    assert outs[0].shape == shape[:-2] and outs[0].dtype == dtype
    np.testing.assert_allclose(outs[0], onnx_reference("Det", [x], {}, opset=22), **TOL[dtype])


def test_det_of_singular_and_known_matrices():
    diagonal = [[2, 0, 0], [0, 3, 0], [0, 0, 4]]
    singular = [[1, 2, 3], [2, 4, 6], [0, 1, 1]]  # row 2 = 2 * row 1
    swap = [[0, 1, 0], [1, 0, 0], [0, 0, 1]]
    x = np.array([diagonal, singular, swap], np.float64)
    check_op("Det", [x], np.array([24.0, 0.0, -1.0]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_det_of_half_types_computes_in_float32_and_rounds_once(rng, dtype):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = rand(rng, (4, 3, 3)).astype(dt)
    expected = np.linalg.det(x.astype(np.float32)).astype(dt)
    (y,) = check_op("Det", [x], None)
    assert y.dtype == dt
    np.testing.assert_array_equal(y.astype(np.float32), expected.astype(np.float32))


def test_det_of_empty_batches_and_empty_matrices():
    (y,) = check_op("Det", [np.zeros((0, 2, 2), np.float32)], np.zeros(0, np.float32))
    assert y.shape == (0,)
    check_op("Det", [np.zeros((3, 0, 0), np.float32)], np.ones(3, np.float32))  # a 0x0 matrix: determinant 1


def test_det_keeps_symbolic_batch_dims(rng):
    [t] = out_types("Det", [rand(rng, (2, 5, 3, 3))], symbolic_batch=True)
    assert t.shape == ("batch", 5)
    [t] = out_types("Det", [rand(rng, (3, 3))])
    assert t.shape == ()


@pytest.mark.parametrize("shape,match", [((3,), r"rank >= 2 \(\[\*, M, M\]\)"), ((2, 3, 4), "square matrices")])
def test_det_bad_inputs_fail(shape, match):
    with pytest.raises(ShapeInferenceError, match=rf"\(Det\).*{match}"):
        build_single("Det", [np.zeros(shape, np.float32)])


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_det_of_half_types_exports_through_float32(rng, dtype):
    """Det-22 only adds bfloat16, and onnxruntime has Det for float32 only: a 16-bit float Det is written as kiln
    computes it, Cast to float32, Det, Cast back."""
    import ml_dtypes
    onnx = pytest.importorskip("onnx")
    from kiln.ir import evaluate
    from kiln.serializer import onnx as kx
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = rand(rng, (2, 3, 3)).astype(dt)
    g, feeds = build_single("Det", [x])
    for opset in (18, 22):
        proto = kx.to_onnx_model(g, opset=opset)
        onnx.checker.check_model(proto, full_check=True)
        assert [n.op_type for n in proto.graph.node] == ["Cast", "Det", "Cast"]
    if dt == np.float16:  # onnxruntime's Python binding takes no bfloat16
        ort = pytest.importorskip("onnxruntime")
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(sess.run(None, {"x0": x})[0], evaluate(g, feeds)[0])

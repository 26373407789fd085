"""SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss: the references against a plain float64 loop over the
ONNX formula and against ONNX's own reference evaluator (every reduction, weights, ignore_index, N-D inputs, both
SCE outputs), narrow floats, inference (shapes, symbols) and its failures, and ONNX import of each version."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from op_harness import build_single, check_op, inferred

import kiln
from kiln.errors import KilnError, ShapeInferenceError, VerifyError
from kiln.ir import Graph, evaluate
from kiln.ir.passes.shape_inference import infer_shapes

SCE, NLL = "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"
RNG = np.random.default_rng(12)
SHAPES = [(3, 5), (3, 5, 2), (2, 4, 3, 2, 2)]  # [N, C], [N, C, d1], [N, C, d1, d2, d3]


def formula(x, labels, weight=None, reduction="mean", ignore_index=None, softmax=False):
    """(loss, log_prob) in float64, one label at a time, as ONNX's documentation writes it."""
    x = np.asarray(x, np.float64)
    if softmax:
        e = np.exp(x - x.max(axis=1, keepdims=True))
        log_p = np.log(e / e.sum(axis=1, keepdims=True))
    else:
        log_p = x
    n, c = x.shape[:2]
    lp, lab = log_p.reshape(n, c, -1), labels.reshape(n, -1)
    loss, weight_sum = np.zeros(lab.shape), 0.0
    for i, d in itertools.product(range(n), range(lab.shape[1])):
        k = int(lab[i, d])
        if ignore_index is not None and k == ignore_index:
            continue
        w = 1.0 if weight is None else float(weight[k])
        loss[i, d] = -lp[i, k, d] * w
        weight_sum += w
    loss = loss.reshape(labels.shape)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / weight_sum if weight_sum else np.nan
    return np.asarray(loss), log_p


def case(shape, *, dtype=np.float32, label_dtype=np.int64, weighted=False, ignore_index=None, log_probs=False):
    """Inputs: scores (log-probabilities for NLL when ``log_probs``), labels with some set to ignore_index."""
    n, c = shape[:2]
    x = RNG.standard_normal(shape).astype(np.float64)
    if log_probs:
        x = formula(x, np.zeros((n,) + shape[2:], np.int64), softmax=True)[1]
    labels = RNG.integers(0, c, (n,) + shape[2:])
    if ignore_index is not None:
        labels.reshape(-1)[::3] = ignore_index
    weight = (RNG.random(c) + 0.25).astype(dtype) if weighted else None
    return x.astype(dtype), labels.astype(label_dtype), weight


def run(op, x, labels, weight, attrs, num_outputs=None, **tol):
    return check_op(op, [x, labels, weight], None, attrs, num_outputs=num_outputs, **tol)


TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-12),
       np.float16: dict(rtol=2e-3, atol=2e-3)}


# --------------------------------------------------------------------------- against the formula

OPTIONS = list(itertools.product(SHAPES, ["none", "sum", "mean"], [False, True], [None, 1, -3, 9]))


@pytest.mark.parametrize("shape,reduction,weighted,ignore_index", OPTIONS)
def test_nll_matches_formula(shape, reduction, weighted, ignore_index):
    x, labels, w = case(shape, weighted=weighted, ignore_index=ignore_index, log_probs=True)
    attrs = {"reduction": reduction} if ignore_index is None else {"reduction": reduction, "ignore_index": ignore_index}
    want, _ = formula(x, labels, w, reduction, ignore_index)
    check_op(NLL, [x, labels, w], want.astype(np.float32), attrs, **TOL[np.float32])


@pytest.mark.parametrize("shape,reduction,weighted,ignore_index", OPTIONS)
def test_sce_matches_formula_both_outputs(shape, reduction, weighted, ignore_index):
    x, labels, w = case(shape, weighted=weighted, ignore_index=ignore_index)
    attrs = {"reduction": reduction} if ignore_index is None else {"reduction": reduction, "ignore_index": ignore_index}
    loss, log_p = formula(x, labels, w, reduction, ignore_index, softmax=True)
    outs = check_op(SCE, [x, labels, w], [loss, log_p], attrs, num_outputs=2, **TOL[np.float32])
    assert outs[0].shape == (() if reduction != "none" else labels.shape) and outs[1].shape == x.shape
    (only,) = check_op(SCE, [x, labels, w], [loss], attrs, **TOL[np.float32])  # log_prob omitted
    np.testing.assert_array_equal(only, outs[0])


def test_mean_is_the_default_and_divides_by_the_weights_used():
    x, labels, w = case((4, 3), weighted=True, ignore_index=2, log_probs=True)
    (got,) = check_op(NLL, [x, labels, w], None, {"ignore_index": 2})
    kept = labels != 2
    want = -(x[np.arange(4), np.where(kept, labels, 0)] * w[np.where(kept, labels, 0)] * kept).sum() / \
        (w[np.where(kept, labels, 0)] * kept).sum()
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("op", [SCE, NLL])
@pytest.mark.parametrize("weighted", [False, True])
def test_every_label_ignored(op, weighted):
    """none: zeros; sum: 0; mean: 0 / 0 = NaN (ONNX's definition, PyTorch's answer)."""
    x, labels, w = case((3, 4, 2), weighted=weighted)
    labels[...] = 7
    for reduction, want in (("none", np.zeros(labels.shape, np.float32)), ("sum", np.float32(0)),
                            ("mean", np.float32(np.nan))):
        (got,) = check_op(op, [x, labels, w], want, {"reduction": reduction, "ignore_index": 7})
        np.testing.assert_array_equal(got, want)


def test_ignored_labels_do_not_index_the_classes():
    """ignore_index beyond C or negative is never looked up (nor is its weight)."""
    x, _, w = case((3, 4), weighted=True, log_probs=True)
    for ii in (-100, 4, 1000):
        labels = np.array([ii, 1, ii], np.int32)
        (got,) = check_op(NLL, [x, labels, w], None, {"reduction": "none", "ignore_index": ii})
        np.testing.assert_allclose(got, [0, -x[1, 1] * w[1], 0], rtol=1e-6)


@pytest.mark.parametrize("op", [SCE, NLL])
def test_a_label_outside_the_classes_is_refused(op):
    x, labels, _ = case((3, 4))
    labels[1] = 4
    g, feeds = build_single(op, [x, labels])
    with pytest.raises(KilnError, match=r"label 4 is outside \[0, 4\)"):
        evaluate(g, feeds)


@pytest.mark.parametrize("label_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_dtypes(dtype, label_dtype):
    x, labels, w = case((3, 5, 4), dtype=dtype, label_dtype=label_dtype, weighted=True, ignore_index=0)
    loss, log_p = formula(x, labels, w, "mean", 0, softmax=True)
    outs = check_op(SCE, [x, labels, w], [loss, log_p], {"ignore_index": 0}, num_outputs=2, **TOL[dtype])
    assert [o.dtype for o in outs] == [dtype, dtype]
    want, _ = formula(x, labels, w, "none", 0)
    (got,) = check_op(NLL, [x, labels, w], want, {"reduction": "none", "ignore_index": 0}, **TOL[dtype])
    assert got.dtype == dtype


def test_bfloat16_computes_in_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, labels, w = case((3, 5), weighted=True)
    xb, wb = x.astype(ml_dtypes.bfloat16), w.astype(ml_dtypes.bfloat16)
    loss, log_p = formula(xb.astype(np.float64), labels, wb.astype(np.float64), "mean", softmax=True)
    outs = check_op(SCE, [xb, labels, wb], [loss, log_p], {}, num_outputs=2, rtol=1e-2, atol=1e-2)
    assert outs[0].dtype == ml_dtypes.bfloat16


# --------------------------------------------------------------------------- against ONNX's reference

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402


def onnx_model(op, inputs, attrs, num_outputs=1, opset=13):
    names = ["x", "labels", "w"][:len(inputs)]
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
           for n, a in zip(names, inputs)]
    outs = [helper.make_tensor_value_info(f"y{i}", TensorProto.UNDEFINED, None) for i in range(num_outputs)]
    node = helper.make_node(op, names, [o.name for o in outs], **attrs)
    return helper.make_model(helper.make_graph([node], "loss", ins, outs),
                             opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("op,num_outputs", [(NLL, 1), (SCE, 1), (SCE, 2)])
@pytest.mark.parametrize("shape,reduction,weighted,ignore_index", OPTIONS)
def test_matches_onnx_reference_evaluator(op, num_outputs, shape, reduction, weighted, ignore_index):
    x, labels, w = case(shape, weighted=weighted, ignore_index=ignore_index, log_probs=op == NLL)
    attrs = {"reduction": reduction} if ignore_index is None else {"reduction": reduction, "ignore_index": ignore_index}
    inputs = [x, labels] + ([w] if weighted else [])
    want = ReferenceEvaluator(onnx_model(op, inputs, attrs, num_outputs)).run(None, dict(zip(["x", "labels", "w"],
                                                                                               inputs)))
    check_op(op, inputs, [np.asarray(v) for v in want], attrs, num_outputs=num_outputs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op,opset", [(SCE, 12), (SCE, 13), (NLL, 12), (NLL, 13), (NLL, 22)])
def test_every_version_imports_and_runs(op, opset):
    x, labels, w = case((3, 5, 2), weighted=True, ignore_index=1, log_probs=op == NLL)
    attrs = {"reduction": "mean", "ignore_index": 1}
    model = onnx_model(op, [x, labels, w], attrs, opset=opset)
    want = ReferenceEvaluator(model).run(None, {"x": x, "labels": labels, "w": w})[0]
    got = kiln.load(kiln.import_onnx(model)).run({"x": x, "labels": labels, "w": w}, as_list=True)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- inference


def test_inferred_shapes_keep_the_batch_symbol():
    x, labels, w = case((3, 5, 2, 4), weighted=True)
    assert inferred(SCE, [x, labels, w], {"reduction": "none"}, num_outputs=2) == [(3, 2, 4), ("batch", 5, 2, 4)]
    assert inferred(SCE, [x, labels, w], {"reduction": "sum"}, num_outputs=2) == [(), ("batch", 5, 2, 4)]
    assert inferred(NLL, [x, labels], {"reduction": "mean"}) == [()]
    # Each output dim is the more precise of the labels' and the scores' dims.
    g = Graph("g")
    scores = g.add_input("scores", "float32", ["n", 5, None, 4])
    labels = g.add_input("labels", "int64", [None, 2, "k"])
    g.outputs = list(g.add_node(NLL, [scores, labels], {"reduction": "none"}).outputs)
    infer_shapes(g)
    assert g.outputs[0].type.shape == ("n", 2, 4)


@pytest.mark.parametrize("op", [SCE, NLL])
@pytest.mark.parametrize("shapes,attrs,match", [
    ([(5,), (5,)], {}, r"must have rank >= 2 \(\[N, C, d1..dk\]\), got shape \[5\]"),
    ([(3, 5), (4,)], {}, r"of shape \[4\] does not match .* of shape \[3, 5\]"),
    ([(3, 5, 2), (3,)], {}, r"of shape \[3\] does not match .* must be .* \[3, 2\]"),
    ([(3, 5, 2), (3, 5, 2)], {}, r"does not match"),
    ([(3, 5), (3,), (4,)], {}, r"must have shape \[5\] \(one weight per class\), got \[4\]"),
    ([(3, 5), (3,), (5, 1)], {}, r"must have shape \[5\]"),
    ([(3, 5), (3,)], {"reduction": "avg"}, r"reduction must be 'none', 'sum' or 'mean', not 'avg'"),
])
def test_inference_names_what_is_wrong(op, shapes, attrs, match):
    inputs = [np.zeros(shapes[0], np.float32), np.zeros(shapes[1], np.int64)] + \
        [np.ones(s, np.float32) for s in shapes[2:]]
    with pytest.raises(ShapeInferenceError, match=rf"\({op}\).*{match}"):
        build_single(op, inputs, attrs)


@pytest.mark.parametrize("op", [SCE, NLL])
def test_dtype_errors(op):
    x = np.zeros((3, 5), np.float32)
    with pytest.raises(ShapeInferenceError, match="is float64 but .* is float32; they must match"):
        build_single(op, [x, np.zeros(3, np.int64), np.ones(5, np.float64)])
    with pytest.raises(VerifyError, match="is float32; allowed: int32, int64"):
        build_single(op, [x, np.zeros(3, np.float32)])


def test_output_counts():
    x, labels = np.zeros((3, 5), np.float32), np.zeros(3, np.int64)
    with pytest.raises(ShapeInferenceError, match="has 2 outputs .*asks for 3"):
        build_single(SCE, [x, labels], num_outputs=3)
    with pytest.raises(ShapeInferenceError, match="has 1 output .*asks for 2"):
        build_single(NLL, [x, labels], num_outputs=2)

"""ai.onnx ``TfIdfVectorizer`` (9): TF, IDF and TFIDF with and without weights, 1-D and batched int32/int64 tokens,
skip counts, gram-length ranges (1- to 3-grams), an empty gram level and empty input against ONNX's reference
evaluator; permuted and shared output columns with weights (the weights of n-grams, as the spec says, where ONNX's
reference evaluator reads them by column) against ONNX Runtime and a plain loop over the definition; random pools;
refusals (an n-gram listed twice, IDF columns shared) and inference errors by name."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.errors import ShapeInferenceError
from op_harness import build_single, check_op, onnx_reference

TOKENS = np.array([1, 1, 3, 3, 3, 7, 8, 6, 7, 5, 6, 8], np.int32)  # the ONNX backend tests' input
POOL = {"ngram_counts": [0, 4], "ngram_indexes": [0, 1, 2, 3, 4, 5, 6], "pool_int64s": [2, 3, 5, 4, 5, 6, 7, 8, 6, 7]}


def attrs_of(mode="TF", min_gram=1, max_gram=2, skip=0, pool=None, **extra):
    return {"mode": mode, "min_gram_length": min_gram, "max_gram_length": max_gram, "max_skip_count": skip,
            **(pool or POOL), **extra}


def by_definition(x, attrs):
    """TfIdfVectorizer by its ONNX definition: plain loops over rows, n-grams, start positions and skips."""
    pool, starts = list(attrs["pool_int64s"]), list(attrs["ngram_counts"])
    grams = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(pool)
        grams += [tuple(pool[k:k + i + 1]) for k in range(start, end, i + 1)]
    weights = attrs.get("weights") or [1.0] * len(grams)
    rows = np.atleast_2d(x)
    y = np.zeros((len(rows), max(attrs["ngram_indexes"]) + 1))
    for r, row in enumerate(rows):
        for i, gram in enumerate(grams):
            n = len(gram)
            if not attrs["min_gram_length"] <= n <= attrs["max_gram_length"]:
                continue
            skips = range(1, attrs["max_skip_count"] + 2) if n > 1 else [1]
            count = sum(all(row[s + k * d] == gram[k] for k in range(n))
                        for d in skips for s in range(len(row) - (n - 1) * d))
            value = {"TF": count, "IDF": weights[i] * (count > 0), "TFIDF": weights[i] * count}[attrs["mode"]]
            y[r, attrs["ngram_indexes"][i]] += value
    return y.astype(np.float32).reshape(y.shape[1:] if x.ndim == 1 else y.shape)


def onnxruntime_output(x, attrs):
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)
    x_info = helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
    graph = helper.make_graph([node], "g", [x_info], [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    # IR 8: what every onnxruntime reads (onnx 1.23's default, 14, is past onnxruntime 1.30's 13)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=8)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def check(x, attrs):
    """kiln against ONNX's reference evaluator (where ngram_indexes is 0, 1, 2, ...: it reads weights by column)
    and the definition."""
    oracle = dict(attrs)
    if attrs["mode"] != "TF" and not attrs.get("weights"):
        # ONNX's reference evaluator fails on IDF/TFIDF without weights (len(None)); no weights means weights of 1
        oracle["weights"] = [1.0] * len(attrs["ngram_indexes"])
    want = onnx_reference("TfIdfVectorizer", [x], oracle, opset=9)
    np.testing.assert_array_equal(want, by_definition(x, attrs))
    return check_op("TfIdfVectorizer", [x], want, attrs, rtol=0, atol=0)


@pytest.mark.parametrize("min_gram,max_gram,skip", list(itertools.product([1, 2], [2], [0, 1, 5])) + [(1, 1, 3)])
@pytest.mark.parametrize("batched", [False, True])
def test_tf_counts(min_gram, max_gram, skip, batched):
    x = TOKENS.reshape(2, 6) if batched else TOKENS
    check(x, attrs_of("TF", min_gram, max_gram, skip))


@pytest.mark.parametrize("mode", ["IDF", "TFIDF"])
@pytest.mark.parametrize("weights", [None, [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 0.25]])
def test_idf_and_tfidf_weighting(mode, weights):
    extra = {} if weights is None else {"weights": weights}
    for x in (TOKENS, TOKENS.reshape(3, 4).astype(np.int64)):
        check(x, attrs_of(mode, 1, 2, 2, **extra))


def test_trigrams_permuted_and_shared_columns():
    # 1-grams [4, 9], 2-grams [4 9], [9 4], 3-grams [4 9 4]: columns permuted, two n-grams in column 1
    pool = {"ngram_counts": [0, 2, 6], "ngram_indexes": [3, 1, 0, 1, 2], "pool_int64s": [4, 9, 4, 9, 9, 4, 4, 9, 4]}
    x = np.array([[4, 9, 4, 9, 4, 4], [9, 9, 4, 0, 9, 4]], np.int64)
    for min_gram, max_gram, skip in [(1, 3, 0), (2, 3, 1), (3, 3, 2), (1, 1, 0)]:
        check(x, attrs_of("TF", min_gram, max_gram, skip, pool=pool))
    attrs = attrs_of("TFIDF", 1, 3, 1, pool=pool, weights=[1.0, 2.0, 3.0, 4.0, 0.5])
    want = by_definition(x, attrs)
    check_op("TfIdfVectorizer", [x], want, attrs, rtol=0, atol=0)
    np.testing.assert_array_equal(onnxruntime_output(x, attrs), want)


@pytest.mark.parametrize("mode", ["IDF", "TFIDF"])
def test_weights_belong_to_ngrams_not_columns(mode):
    """The spec: "the i-th element in weights is the weight of the i-th n-gram in pool" (as ONNX Runtime reads
    them); ONNX's reference evaluator reads weights[column] instead, which differs once the columns are permuted."""
    attrs = attrs_of(mode, 1, 2, 1, ngram_indexes=[6, 2, 0, 4, 1, 5, 3], weights=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    for x in (TOKENS.astype(np.int64), TOKENS.reshape(2, 6).astype(np.int64)):
        want = by_definition(x, attrs)
        check_op("TfIdfVectorizer", [x], want, attrs, rtol=0, atol=0)
        np.testing.assert_array_equal(onnxruntime_output(x, attrs), want)
    assert not np.array_equal(onnx_reference("TfIdfVectorizer", [TOKENS], attrs, opset=9), by_definition(TOKENS, attrs))


def test_empty_gram_level_and_empty_input():
    pool = {"ngram_counts": [0, 0], "ngram_indexes": [0, 1, 2], "pool_int64s": [5, 6, 7, 8, 6, 7]}
    check(TOKENS, attrs_of("TF", 2, 2, 0, pool=pool))
    (y,) = check_op("TfIdfVectorizer", [np.zeros(0, np.int64)], None, attrs_of())
    np.testing.assert_array_equal(y, np.zeros(7, np.float32))
    (y,) = check_op("TfIdfVectorizer", [np.zeros((2, 0), np.int32)], None, attrs_of())
    assert y.shape == (2, 7) and not y.any()


def test_sizes_out_of_range_count_nothing():
    (y,) = check(TOKENS, attrs_of("IDF", 3, 4, 1))  # the pool has 1- and 2-grams only
    assert not y.any()


@pytest.mark.parametrize("seed", range(8))
def test_random_pools_match_the_definition_and_onnxruntime(seed):
    rng = np.random.default_rng(seed)
    grams = [np.unique(rng.integers(0, 4, (int(rng.integers(0, 5)), n + 1)), axis=0) for n in range(3)]
    total = sum(len(g) for g in grams)
    if not total:
        return
    mode = ["TF", "IDF", "TFIDF"][seed % 3]
    # permuted columns; outside IDF, some n-grams share one
    columns = rng.permutation(total) if mode == "IDF" else rng.integers(0, max(total - 1, 1), total)
    pool = {"ngram_counts": np.cumsum([0] + [g.size for g in grams[:-1]]).tolist(),
            "ngram_indexes": columns.tolist(), "pool_int64s": np.concatenate([g.reshape(-1) for g in grams]).tolist()}
    x = rng.integers(0, 4, (3, int(rng.integers(1, 10)))).astype(np.int64)
    min_gram = int(rng.integers(1, 4))
    weights = {"weights": rng.uniform(0.1, 2, total).astype(np.float32).tolist()} if seed % 2 else {}
    attrs = attrs_of(mode, min_gram, int(rng.integers(min_gram, 4)), int(rng.integers(0, 4)), pool=pool, **weights)
    want = by_definition(x, attrs)
    check_op("TfIdfVectorizer", [x], want, attrs, rtol=1e-6, atol=0)
    np.testing.assert_allclose(onnxruntime_output(x, attrs), want, rtol=1e-6)


def test_inference_shapes():
    g, _ = build_single("TfIdfVectorizer", [TOKENS.reshape(3, 4)], attrs_of(), symbolic_batch=True)
    assert g.outputs[0].type.shape == ("batch", 7) and str(g.outputs[0].type.dtype) == "float32"
    g, _ = build_single("TfIdfVectorizer", [TOKENS], attrs_of(ngram_indexes=[0, 1, 2, 3, 4, 5, 9]))
    assert g.outputs[0].type.shape == (10,)


@pytest.mark.parametrize("shape,attrs,match", [
    ((12,), attrs_of(mode="BM25"), "mode must be one of TF, IDF, TFIDF"),
    ((12,), attrs_of(ngram_counts=[0, 3]), "2-grams .* hold 7 tokens, not whole 2-grams"),
    ((12,), attrs_of(ngram_counts=[4, 0]), "ngram_counts .* must be non-decreasing"),
    ((12,), attrs_of(ngram_indexes=[0, 1, 2]), "ngram_indexes has 3 entries, but the pool holds 7 n-grams"),
    ((12,), attrs_of(ngram_indexes=[0, 1, 2, 3, 4, 5, -1]), "must be one or more columns >= 0"),
    ((12,), attrs_of(weights=[1.0, 2.0]), "weights has 2 entries; it needs one per n-gram of the pool, 7"),
    ((12,), attrs_of(pool={"ngram_counts": [0, 3], "ngram_indexes": [0, 1, 2, 3, 4],
                           "pool_int64s": [5, 6, 7, 5, 6, 5, 6]}), "the pool lists a 2-gram twice"),
    ((12,), attrs_of(pool={"ngram_counts": [0, 3], "ngram_indexes": [0, 1, 2, 3], "pool_int64s": [5, 6, 5, 1, 2]}),
     "the pool lists a 1-gram twice"),
    ((12,), attrs_of("IDF", ngram_indexes=[0, 1, 2, 3, 4, 5, 5]), "in IDF mode n-grams may not share an output column"),
    ((12,), attrs_of(min_gram=2, max_gram=1), "min_gram_length <= max_gram_length"),
    ((12,), attrs_of(skip=-1), "max_skip_count must be >= 0"),
    ((12,), {k: v for k, v in attrs_of().items() if k != "pool_int64s"}, "pool_int64s is required"),
    ((2, 3, 2), attrs_of(), r"X must be \[C\] or \[N, C\]"),
])
def test_inference_errors_name_the_problem(shape, attrs, match):
    with pytest.raises(ShapeInferenceError, match=rf"\(TfIdfVectorizer\).*{match}"):
        build_single("TfIdfVectorizer", [np.zeros(shape, np.int64)], attrs)

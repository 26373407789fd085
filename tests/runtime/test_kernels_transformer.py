"""The transformer path's CPU kernels: float32 erf/Gelu accuracy over the whole range (blocks and
the negative tail included), MatMul's folded stack-against-matrix product (permuted stacks too),
LayerNorm's row blocks, Softmax's block-max shift and its exact fallback."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from op_harness import check_op

import kiln
from kiln.ir import Graph
from kiln.runtime.kernels.cpu.activation import _BLOCK, _gelu_erf, erf_f32
from kiln.runtime.kernels.cpu.linalg import _matmul_folded
from kiln.runtime.kernels.cpu.norm import _BLOCK as _NORM_BLOCK
from kiln.runtime.kernels.cpu.norm import _by_row_blocks, _softmax_rows

RTOL, ATOL = 1e-5, 1e-6  # the conformance suite's float32 tolerance


def _erf64(x: np.ndarray) -> np.ndarray:
    return np.array([math.erf(v) for v in x.astype(np.float64).reshape(-1)]).reshape(x.shape)


def _grid() -> np.ndarray:
    # Denser than one block, so the blocked path and its last partial block run too.
    return np.linspace(-9.0, 9.0, 2 * _BLOCK + 12345).astype(np.float32)


def test_erf_f32_matches_float64_erf():
    x = _grid()
    got = erf_f32(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got.astype(np.float64), _erf64(x), rtol=RTOL, atol=ATOL)


def test_erf_f32_keeps_relative_accuracy_near_zero():
    x = np.array([1e-30, -1e-12, 1e-6, 3e-4], np.float32)
    np.testing.assert_allclose(erf_f32(x).astype(np.float64), _erf64(x), rtol=RTOL, atol=0)


def test_gelu_matches_float64_reference_including_negative_tail():
    x = _grid()
    x64 = x.astype(np.float64)
    want = x64 * 0.5 * (1.0 + _erf64(x64 / math.sqrt(2.0)))
    got = _gelu_erf(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=RTOL, atol=ATOL)
    # A float32 x * (1 + erf(x / sqrt 2)) / 2 cancels in the negative tail: its error reaches 1.2x
    # this tolerance near x = -5.5, so this check fails on that form.


def test_gelu_beyond_its_fit_and_at_extremes():
    # The fitted logit is used past |x| = 5.5 too, up to overflow: no warnings, right limits.
    x = np.concatenate([np.linspace(-80.0, -5.0, 3001), np.linspace(5.0, 80.0, 3001),
                        [-1e20, -3e38, 1e20, 3e38, np.inf, np.nan, 0.0, -1e-30]]).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _gelu_erf(x).astype(np.float64)
    x64 = x.astype(np.float64)
    finite = np.isfinite(x64)
    want = x64[finite] * 0.5 * np.array([math.erfc(-v / math.sqrt(2.0)) for v in x64[finite]])
    np.testing.assert_allclose(got[finite], want, rtol=RTOL, atol=ATOL)
    assert got[x64 == np.inf] == np.inf and np.isnan(got[np.isnan(x64)]).all()


@pytest.mark.parametrize("shape", [(), (5,), (3, 4, 7)], ids=str)
def test_gelu_small_shapes_stay_arrays(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 3
    got = _gelu_erf(x)
    assert isinstance(got, np.ndarray) and got.shape == x.shape


def test_matmul_folds_transposed_stack_against_matrix():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 6, 5)).astype(np.float32).transpose(1, 0, 2)  # [6, 2, 5], not contiguous
    b = rng.standard_normal((4, 5)).astype(np.float32).T                       # [5, 4], a transposed view
    got = _matmul_folded(a, b)
    assert got.shape == (6, 2, 4)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-6)


def test_matmul_folded_edge_shapes():
    assert _matmul_folded(np.zeros((0, 3, 5), np.float32), np.ones((5, 2), np.float32)).shape == (0, 3, 2)
    assert _matmul_folded(np.ones((2, 3, 0), np.float32), np.ones((0, 2), np.float32)).shape == (2, 3, 2)
    ints = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    np.testing.assert_array_equal(_matmul_folded(ints, np.eye(4, dtype=np.int32)), ints)
    with pytest.raises(ValueError):
        _matmul_folded(np.ones((2, 3, 4), np.float32), np.ones((5, 2), np.float32))


@pytest.mark.parametrize("perm", [(1, 0, 2), (2, 0, 1, 3), (0, 2, 1, 3)], ids=str)
def test_matmul_runs_permuted_stack_in_its_memory_order(perm):
    # A transposed activation: the product runs on its memory order and comes back permuted.
    rng = np.random.default_rng(5)
    shape = (3, 4, 5, 6)[:len(perm) - 1] + (7,)
    a = rng.standard_normal(shape).astype(np.float32).transpose(perm)
    b = rng.standard_normal((7, 2)).astype(np.float32)
    got = _matmul_folded(a, b)
    assert got.shape == a.shape[:-1] + (2,)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)
    # A strided slice is no permutation of contiguous memory: it takes the copying path.
    sliced = rng.standard_normal((4, 6, 7)).astype(np.float32)[:, ::2]
    np.testing.assert_allclose(_matmul_folded(sliced, b), sliced.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def _softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_softmax_block_shift_keeps_rows_far_below_the_block_max():
    # Several row blocks; some rows sit far below their block's max (their exp underflows under
    # the block shift: the exact fallback), one row is all -inf but one, one is all -inf (nan).
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((3, 700, 96)) * 4).astype(np.float32)
    x[0, 5] -= 300.0
    x[1, 40] -= 60.0
    x[2, 100] = -np.inf
    x[2, 100, 7] = 1.0
    x[2, 101] = -np.inf
    assert x.size > _NORM_BLOCK
    with np.errstate(invalid="ignore"):
        got = _by_row_blocks(x, _softmax_rows)
        want = _softmax64(x)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)
    assert np.isnan(got[2, 101]).all() and got[2, 100, 7] == 1.0


def test_softmax_block_with_inf_or_nan_takes_exact_path():
    x = np.random.default_rng(7).standard_normal((4, 5)).astype(np.float32)
    x[1, 2], x[3, 0] = np.inf, np.nan
    got = np.empty_like(x)
    with np.errstate(invalid="ignore"):
        _softmax_rows(x, got)
        want = _softmax64(x)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)
    assert np.isfinite(got[[0, 2]]).all()


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_through_runtime(axis):
    x = (np.random.default_rng(8).standard_normal((2, 600, 64)) * 5).astype(np.float32)
    check_op("Softmax", [x], attrs={"axis": axis})


def test_attention_block_runs_through_runtime():
    """Transpose-of-weight MatMul on a transposed activation, Softmax and Gelu, against numpy."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    g = Graph("block")
    x = g.add_input("x", "float32", ("batch", 3, 6))
    xt = g.op("Transpose", x, perm=(1, 0, 2))
    h = g.op("MatMul", xt, g.op("Transpose", g.add_initializer("w", w)))
    g.outputs = [g.op("Gelu", g.op("Softmax", h, axis=-1))]
    feed = rng.standard_normal((2, 3, 6)).astype(np.float32)
    (got,) = kiln.load(g).run([feed], as_list=True)
    logits = feed.transpose(1, 0, 2).astype(np.float64) @ w.T.astype(np.float64)
    sm = np.exp(logits - logits.max(-1, keepdims=True))
    sm /= sm.sum(-1, keepdims=True)
    want = sm * 0.5 * (1.0 + _erf64(sm / math.sqrt(2.0)))
    assert got.shape == (3, 2, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_row_blocks_match_reference(with_bias):
    # 3 * 200 * 300 elements: more than one row block, the last one partial.
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((3, 200, 300)).astype(np.float32) * 4 + 1,
              rng.standard_normal(300).astype(np.float32)]
    if with_bias:
        inputs.append(rng.standard_normal(300).astype(np.float32))
    assert inputs[0].size > _NORM_BLOCK
    check_op("LayerNormalization", inputs, attrs={"axis": -1, "epsilon": 1e-5})


def test_layer_norm_2d_scale_keeps_whole_path():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 200, 300)).astype(np.float32)
    scale = rng.standard_normal((200, 300)).astype(np.float32)
    check_op("LayerNormalization", [x, scale], attrs={"axis": -2})

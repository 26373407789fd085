"""The transformer path's CPU kernels: float32 erf/Gelu accuracy over the whole range (blocks and
the float64 tail included), MatMul's folded stack-against-matrix product, LayerNorm's row blocks."""
from __future__ import annotations

import math

import numpy as np
import pytest
from op_harness import check_op

import kiln
from kiln.ir import Graph
from kiln.runtime.kernels.cpu.activation import _BLOCK, _gelu_erf, erf_f32
from kiln.runtime.kernels.cpu.linalg import _matmul_folded
from kiln.runtime.kernels.cpu.norm import _BLOCK as _NORM_BLOCK

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
    # Without the float64 tail (x < -2), float32's 1 + erf cancels: the error reaches 1.2x this
    # tolerance near x = -5.5, so this check fails on a float32-only Gelu.


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

"""The shifted-slice im2col of the Conv and MaxPool kernels: stride phases, dilations that are
not multiples of the stride, windows that never reach the input's end (cropped rows), the flat
vs exact column layouts, batch chunks (a short last chunk included), and the bias added while
the result is copied out. Each case runs the fast kernel against the op's reference."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import evaluate
from kiln.ir.ops.nn import make_window
from kiln.runtime import Program
from kiln.runtime.kernels.cpu import nn
from op_harness import build_single, check_backends

RNG = np.random.default_rng(5)


def rand(*shape: int, dtype=np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def run_conv(x: np.ndarray, w: np.ndarray, attrs: dict, bias: bool) -> None:
    inputs = [x, w] + ([rand(w.shape[0])] if bias else [])
    g, feeds = build_single("Conv", inputs, attrs, const_inputs=(1, 2), symbolic_batch=True)
    run = Program(g).plan.instructions[0].kernel
    assert run.__qualname__.startswith("conv."), "Conv must take the fast kernel"
    check_backends(g, feeds, evaluate(g, feeds))


CONVS = [  # (x shape, w shape, attrs)
    ((3, 4, 13, 11), (5, 4, 3, 3), {"strides": [3, 2], "pads": [1, 2, 0, 1]}),
    ((2, 3, 15, 15), (4, 3, 3, 3), {"strides": [2, 2], "dilations": [3, 3], "pads": [2, 2, 2, 2]}),
    ((2, 3, 12, 12), (4, 3, 2, 2), {"strides": [3, 3]}),  # the last rows and columns are never read
    ((2, 2, 30, 30), (3, 2, 3, 3), {"pads": [1, 1, 1, 1]}),  # wide map: flat columns with garbage
    ((4, 6, 5, 5), (8, 3, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),  # small map: exact columns
    ((1, 2, 9, 9), (3, 2, 4, 4), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", CONVS)
@pytest.mark.parametrize("bias", [False, True])
def test_im2col_geometry(x_shape, w_shape, attrs, bias):
    run_conv(rand(*x_shape), rand(*w_shape), attrs, bias)


@pytest.mark.parametrize("min_cols,cols_bytes", [(1, 1), (60, 1 << 20)])
def test_im2col_batch_chunks(monkeypatch, min_cols, cols_bytes):
    # One sample per chunk, then chunks of 3 over a batch of 7 (a short last chunk).
    monkeypatch.setattr(nn, "MIN_COLS", min_cols)
    monkeypatch.setattr(nn, "COLS_BYTES", cols_bytes)
    run_conv(rand(7, 3, 5, 5), rand(4, 3, 3, 3), {"pads": [1, 1, 1, 1]}, bias=True)


def test_chunk_size_stays_within_budget():
    assert nn._chunk(32, 576, 56 * 58, 4) == 1            # one large map is already enough columns
    assert nn._chunk(32, 4608, 49, 4) == 9                 # small maps batch up to the byte budget
    assert nn._chunk(2, 64, 49, 4) == 2                    # never more than the batch


@pytest.mark.parametrize("strides,dilations", [([1, 1], [1, 1]), ([2, 2], [1, 1]), ([2, 1], [3, 2])])
def test_depthwise_phases(strides, dilations):
    attrs = {"group": 6, "strides": strides, "dilations": dilations, "pads": [2, 1, 1, 2]}
    run_conv(rand(3, 6, 11, 10), rand(6, 1, 3, 3), attrs, bias=True)


def test_tap_offsets_follow_the_phase_of_each_tap():
    window = make_window([3, 3], strides=[2, 2], dilations=[1, 1], pads=[1, 1, 1, 1])
    taps = nn.tap_offsets(window, (3, 3), 10)
    # Tap (2, 1): row phase 0 shifted one phase row (offset 10), column phase 1 unshifted.
    assert taps[7] == (0, 1, 10)
    assert taps[0] == (0, 0, 0)


def run_max_pool(x: np.ndarray, attrs: dict) -> None:
    g, feeds = build_single("MaxPool", [x], attrs, symbolic_batch=True)
    assert Program(g).plan.instructions[0].kernel.__qualname__.startswith("max_pool.")
    want = evaluate(g, feeds)
    check_backends(g, feeds, want)


POOLS = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 2], "strides": [3, 2], "ceil_mode": 1},
    {"kernel_shape": [2, 2], "strides": [2, 3], "dilations": [2, 3], "pads": [0, 1, 1, 0]},
    {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]},
]


@pytest.mark.parametrize("attrs", POOLS)
@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_max_pool_phases(attrs, dtype):
    x = (rand(3, 4, 11, 12) * 40).astype(dtype)
    run_max_pool(x, attrs)


def test_max_pool_padding_never_wins_over_negative_inputs():
    x = -np.abs(rand(2, 3, 6, 6)) - 1
    run_max_pool(x, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})

"""The shifted-slice im2col of the Conv kernel: stride phases, dilations that are not multiples
of the stride, windows that never reach the input's end (cropped rows), the flat vs exact
column layouts, batch chunks (a short last chunk included), the bias added while the result is
copied out or folded into the GEMM of the direct layout; and the separable MaxPool: row and
column taps clipped at the padding, plane blocks. Each case runs the fast kernel against the
op's reference. The native direct convolution is off here (its own tests: test_native.py)."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import evaluate
from kiln.ir.ops.nn import make_window
from kiln.runtime import Program
from kiln.runtime.kernels.cpu import native, nn, pool
from op_harness import build_single, check_backends

RNG = np.random.default_rng(5)


@pytest.fixture(autouse=True)
def numpy_kernels(monkeypatch):
    """These are the numpy kernels' tests (the reference and the fallback where the native extension is not
    built): the native direct convolution, which would take the depthwise and few-tap cases, is off here
    (tests/runtime/test_native.py tests it)."""
    monkeypatch.setattr(native, "_native", None)


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


DIRECT = [  # (x shape, w shape, attrs): one sample's columns feed a GEMM that writes the output
    ((2, 3, 40, 36), (10, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 3, 70, 67), (32, 3, 5, 5), {"strides": [2, 2], "pads": [2, 1, 2, 0]}),
    ((3, 4, 34, 34), (16, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),  # bias added after the GEMM
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", DIRECT)
@pytest.mark.parametrize("bias", [False, True])
def test_direct_layout(x_shape, w_shape, attrs, bias):
    window = make_window(w_shape[2:], strides=attrs.get("strides"), pads=attrs["pads"])
    _, out, hq, wq = nn.phase_geometry(window, x_shape[2:], w_shape[2:])
    group = attrs.get("group", 1)
    assert nn._direct(out, wq, w_shape[0] // group, w_shape[1] * w_shape[2] * w_shape[3])
    run_conv(rand(*x_shape), rand(*w_shape), attrs, bias)


def test_direct_layout_only_where_it_pays():
    assert nn._direct([112, 112], 115, 64, 147)            # ResNet stem: 3 channels, 7x7
    assert not nn._direct([56, 56], 58, 64, 576)           # 3x3 over 64 channels: flat columns
    assert not nn._direct([7, 7], 9, 512, 27)              # too few columns for one sample


def test_fill_phases_matches_pad_then_split():
    x = rand(2, 3, 9, 8)
    for strides, begin in [((2, 2), (1, 1)), ((3, 2), (2, 0)), ((1, 1), (1, 2)), ((2, 3), (0, 4))]:
        sh, sw = strides
        hq, wq = 5, 6                                      # crops the input's last rows/columns
        got = nn.fill_phases(np.zeros((sh, sw, 2, 3, hq, wq), np.float32), x, begin, strides, hq, wq)
        padded = np.zeros((2, 3, sh * hq + 8, sw * wq + 8), np.float32)
        padded[:, :, begin[0]:begin[0] + 9, begin[1]:begin[1] + 8] = x
        for a in range(sh):
            for b in range(sw):
                want = padded[:, :, a:a + sh * hq:sh, b:b + sw * wq:sw]
                np.testing.assert_array_equal(got[a, b].reshape(2, 3, hq, wq), want)


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


def test_max_pool_plane_blocks(monkeypatch):
    # One plane per block, then blocks of 5 planes over 3 x 4 planes (a short last block).
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    x = rand(3, 4, 11, 12)
    for block_bytes in (1, 5 * 11 * 12 * 4):
        monkeypatch.setattr(pool, "POOL_BLOCK_BYTES", block_bytes)
        run_max_pool(x, attrs)


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [1, 3], "strides": [1, 1]},                          # one row tap
    {"kernel_shape": [3, 1], "strides": [2, 3], "pads": [2, 0, 2, 0]},    # one column tap, deep pads
    {"kernel_shape": [2, 3], "strides": [4, 4], "dilations": [3, 2], "ceil_mode": 1},
    {"kernel_shape": [4, 4], "strides": [1, 1], "pads": [3, 3, 3, 3]},    # corner windows: one input value
])
def test_max_pool_clipped_taps(attrs):
    run_max_pool(rand(2, 3, 7, 9) - 5, attrs)


def test_tap_range_matches_brute_force():
    for n_out in (0, 1, 6):
        for stride in (1, 2, 3):
            for shift in range(-7, 9):
                inside = [o for o in range(n_out) if 0 <= o * stride + shift < 5]
                lo, hi = pool._tap_range(n_out, stride, shift, 5)
                assert list(range(lo, hi)) == inside


def test_max_pool_padding_never_wins_over_negative_inputs():
    x = -np.abs(rand(2, 3, 6, 6)) - 1
    run_max_pool(x, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})

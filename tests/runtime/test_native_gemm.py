"""The native extension's GEMM convolutions and its AVX-512 sgemm (runtime/kernels/cpu/_native.c, native.py): im2col
and the output pass against numpy, the sgemm's operand modes, bias modes, activations, batches and thread splits
against float64 products; the GEMM convolution over random geometries against a float64 sum over the taps (with the
sgemm and with numpy's BLAS for the product); and that programs take them (Conv + activation as one fused call,
MatMul against a weight kept as a Transpose node, attention's products, Gemm) and answer as the reference does."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import kiln
from kiln.ir import Graph, evaluate
from kiln.ir.ops.nn import make_window, static_pads, window_out_shape
from kiln.runtime.kernels.cpu import native

RNG = np.random.default_rng(2121)
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.UNAVAILABLE}")
needs_sgemm = pytest.mark.skipif(not native.has_sgemm(), reason="no AVX-512F here (or KILN_NATIVE_SGEMM=0)")


def conv_float64(x, w, b, window):
    """A float64 sum over the taps of a one-group Conv (independent of the kernels under test)."""
    n, c, h, wd = x.shape
    m, _, kh, kw = w.shape
    (sh, sw), (dh, dw) = window.strides, window.dilations
    oh, ow = window_out_shape(window, (h, wd))
    begin, end, _ = static_pads(window, (h, wd))
    xp = np.zeros((n, c, h + begin[0] + end[0] + kh * dh, wd + begin[1] + end[1] + kw * dw))
    xp[:, :, begin[0]:begin[0] + h, begin[1]:begin[1] + wd] = x
    y = np.zeros((n, m, oh, ow)) + (0 if b is None else b.astype(np.float64)[:, None, None])
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
            y += np.einsum("mc,nchw->nmhw", w[:, :, i, j].astype(np.float64), patch)
    return y


def random_window(kh, kw):
    auto = ["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"][int(RNG.integers(4))]
    pads = [int(v) for v in RNG.integers(0, 3, 4)] if auto == "NOTSET" else None
    return make_window((kh, kw), strides=tuple(int(v) for v in RNG.integers(1, 4, 2)),
                       dilations=tuple(int(v) for v in RNG.integers(1, 3, 2)), pads=pads, auto_pad=auto)


def random_geometry(channels: int, size: int):
    """(kh, kw, window, n, c, h, wd, oh, ow) of a random conv (kernel 1-5, under ``channels`` channels and ``size``
    pixels a side), or None where its window does not fit the padded input."""
    kh, kw = (int(v) for v in RNG.integers(1, 6, 2))
    window = random_window(kh, kw)
    n, c = int(RNG.integers(1, 4)), int(RNG.integers(1, channels))
    h, wd = int(RNG.integers(1, size)), int(RNG.integers(1, size))
    try:
        oh, ow = window_out_shape(window, (h, wd))
    except ValueError:
        return None
    return kh, kw, window, n, c, h, wd, oh, ow


@needs_native
def test_im2col_against_numpy_columns():
    ran = 0
    for _ in range(150):
        geometry = random_geometry(5, 16)
        if geometry is None:
            continue
        kh, kw, window, n, c, h, wd, oh, ow = geometry
        x = RNG.standard_normal((n, c, h, wd)).astype(np.float32)
        begin, end, _ = static_pads(window, (h, wd))
        (sh, sw), (dh, dw) = window.strides, window.dilations
        xp = np.zeros((n, c, h + begin[0] + end[0] + kh * dh, wd + begin[1] + end[1] + kw * dw), np.float32)
        xp[:, :, begin[0]:begin[0] + h, begin[1]:begin[1] + wd] = x
        want = np.stack([xp[:, ci, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
                         .reshape(n * oh * ow) for ci in range(c) for i in range(kh) for j in range(kw)])
        cols = np.full((c * kh * kw, n * oh * ow), np.nan, np.float32)
        native._native.im2col(x, cols, n, c, h, wd, kh, kw, sh, sw, dh, dw, begin[0], begin[1], oh, ow)
        np.testing.assert_array_equal(cols, want)
        ran += 1
    assert ran > 80


@needs_native
@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("act,alpha,beta", [(0, 0.0, 0.0), (1, 0.0, 0.0), (4, -0.5, 0.7)])
def test_gemm_out_adds_the_bias_and_applies_the_activation(size, act, alpha, beta):
    m, span = 5, 37
    acc = RNG.standard_normal((m, size * span)).astype(np.float32)
    bias = RNG.standard_normal(m).astype(np.float32)
    y = np.empty((size, m, span), np.float32)
    native._native.gemm_out(acc, y, bias, m, size, span, act, alpha, beta)
    want = acc.reshape(m, size, span).transpose(1, 0, 2) + bias[:, None]
    if act == 1:
        want = np.maximum(want, 0)
    if act == 4:
        want = np.minimum(np.maximum(want, np.float32(alpha)), np.float32(beta))
    np.testing.assert_array_equal(y, want)


def _operands(m, n, k, a_mode, b_mode, batch=1):
    a = RNG.standard_normal((batch, m, k)).astype(np.float32)
    b = RNG.standard_normal((batch, k, n)).astype(np.float32)
    a_arg = np.stack([native.pack_rows(ai) for ai in a]) if a_mode == 1 else a
    b_arg = (np.stack([native.pack_cols(bi) for bi in b]) if b_mode == 1
             else np.ascontiguousarray(b.transpose(0, 2, 1)) if b_mode == 2 else b)
    return a, b, a_arg, b_arg


@needs_sgemm
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 3, 5), (12, 32, 256), (13, 33, 257), (50, 70, 600), (3, 100, 40),
                                   (100, 3, 40), (17, 40, 30), (23, 64, 300), (6, 65, 257), (1, 96, 600)])
@pytest.mark.parametrize("a_mode,b_mode", [(0, 0), (1, 0), (0, 1), (0, 2), (1, 2)])
def test_sgemm_modes_against_float64(m, n, k, a_mode, b_mode):
    a, b, a_arg, b_arg = _operands(m, n, k, a_mode, b_mode)
    ref = a[0].astype(np.float64) @ b[0]
    scale = max(1.0, float(np.abs(ref).max()))
    for bias_mode, bias, added in ((0, None, 0.0), (1, RNG.standard_normal(m).astype(np.float32), "rows"),
                                   (2, RNG.standard_normal(n).astype(np.float32), "cols")):
        for act, alpha, beta in ((0, 0.0, 0.0), (1, 0.0, 0.0), (5, 0.1, 0.0)):
            for threads in (1, 2, 3):
                c = np.full((m, n), np.nan, np.float32)
                native._native.sgemm(a_arg[0], b_arg[0], c, bias, m, n, k, a_mode, b_mode, bias_mode, act, alpha,
                                     beta, threads)
                want = ref + (0.0 if bias is None else bias[:, None] if added == "rows" else bias[None, :])
                if act == 1:
                    want = np.maximum(want, 0)
                if act == 5:
                    want = np.where(want < 0, 0.1 * want, want)
                assert np.abs(c - want).max() <= 2e-6 * scale * np.sqrt(k), (bias_mode, act, threads)


@needs_sgemm
@pytest.mark.parametrize("share", ["none", "a", "b"])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_sgemm_batches_with_shared_operands(share, threads):
    batch, m, n, k = 4, 9, 20, 33
    a, b, a_arg, b_arg = _operands(m, n, k, 0, 2, batch)
    if share == "a":
        a, a_arg = a[:1].repeat(batch, 0), a_arg[:1]
    if share == "b":
        b, b_arg = b[:1].repeat(batch, 0), b_arg[:1]
    c = np.full((batch, m, n), np.nan, np.float32)
    native._native.sgemm(a_arg, b_arg, c, None, m, n, k, 0, 2, 0, 0, 0.0, 0.0, threads, batch,
                         0 if share == "a" else m * k, 0 if share == "b" else n * k)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


@needs_sgemm
def test_sgemm_refuses_what_does_not_match():
    sgemm = native._native.sgemm
    a, b, c = np.zeros((4, 5), np.float32), np.zeros((5, 6), np.float32), np.zeros((4, 6), np.float32)
    sgemm(a, b, c, None, 4, 6, 5, 0, 0, 0, 0, 0.0, 0.0, 1)
    with pytest.raises(ValueError, match="size does not match"):
        sgemm(a, b, c, None, 4, 6, 4, 0, 0, 0, 0, 0.0, 0.0, 1)  # k
    with pytest.raises(ValueError, match="size does not match"):
        sgemm(a, b, c, None, 4, 6, 5, 1, 0, 0, 0, 0.0, 0.0, 1)  # a is not packed
    with pytest.raises(ValueError, match="size does not match"):
        sgemm(a, b, c, np.zeros(6, np.float32), 4, 6, 5, 0, 0, 1, 0, 0.0, 0.0, 1)  # a row bias of n
    with pytest.raises(ValueError, match="bad arguments"):
        sgemm(a, b, c, None, 4, 6, 5, 0, 3, 0, 0, 0.0, 0.0, 1)  # no mode 3
    with pytest.raises(ValueError, match="bad arguments"):
        sgemm(a, b, c, np.zeros(4, np.float32), 4, 6, 5, 0, 0, 0, 0, 0.0, 0.0, 1)  # a bias with bias mode 0
    with pytest.raises(ValueError, match="batch stride"):
        sgemm(a, b, c, None, 4, 6, 5, 0, 0, 0, 0, 0.0, 0.0, 1, 2, 7, 0)
    with pytest.raises(TypeError, match="float32"):
        sgemm(a.astype(np.float64), b, c, None, 4, 6, 5, 0, 0, 0, 0, 0.0, 0.0, 1)


@needs_native
@pytest.mark.parametrize("own_sgemm", [True, False])
def test_gemm_conv_random_geometries_against_float64(monkeypatch, own_sgemm):
    if own_sgemm and not native.has_sgemm():
        pytest.skip("no AVX-512F here")
    monkeypatch.setattr(native, "SGEMM", own_sgemm)
    monkeypatch.setattr(native, "SGEMM_MACS_PER_THREAD", 1)  # both threads, however small
    ran = 0
    for trial in range(120):
        geometry = random_geometry(12, 18)
        if geometry is None:
            continue
        kh, kw, window, n, c, h, wd, _, _ = geometry
        m = int(RNG.integers(1, 30))
        x = RNG.standard_normal((n, c, h, wd)).astype(np.float32)
        w = RNG.standard_normal((m, c, kh, kw)).astype(np.float32)
        b = RNG.standard_normal(m).astype(np.float32) if trial % 2 else None
        relu = trial % 3 == 0
        got = native.gemm_conv2d(w, window, b, (1, 0.0, 0.0) if relu else (0, 0.0, 0.0))(x)
        want = conv_float64(x, w, b, window)
        np.testing.assert_allclose(got, np.maximum(want, 0) if relu else want, rtol=1e-4, atol=1e-4)
        ran += 1
    assert ran > 60


@needs_native
def test_gemm_conv_chunks_samples_of_small_maps(monkeypatch):
    """Small maps batch several samples into one product (its result copied out per sample); large ones are each
    their own product written in place."""
    window = make_window((3, 3), pads=(1, 1, 1, 1))
    w = RNG.standard_normal((16, 8, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(16).astype(np.float32)
    for shape in ((5, 8, 7, 7), (2, 8, 40, 40)):
        x = RNG.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(native.gemm_conv2d(w, window, b)(x), conv_float64(x, w, b, window),
                                   rtol=1e-4, atol=1e-4)


@needs_sgemm
@pytest.mark.parametrize("threads_per_mac", [1, 1 << 40])  # both threads however small, and one
def test_a_batch_of_1x1_convs_is_one_sgemm_answering_the_per_sample_bits(monkeypatch, threads_per_mac):
    """A 1x1 stride-1 conv of several samples is one batched sgemm (the weights shared, the samples split over the
    pool), and answers exactly what a product per sample answered: odd batches, K past one k block (GEMM_KC 256),
    with and without the bias and activation, before and after the weights are packed."""
    monkeypatch.setattr(native, "SGEMM_MACS_PER_THREAD", threads_per_mac)
    monkeypatch.setattr(native, "kernel_threads", lambda: 2)
    calls = []
    real = native._native.sgemm
    monkeypatch.setattr(native._native, "sgemm", lambda *a: calls.append(a[14] if len(a) > 14 else 1) or real(*a))
    window = make_window((1, 1))
    for n, c, m, hw, bias, act in ((3, 40, 24, 9, True, (1, 0.0, 0.0)), (5, 300, 17, 6, False, (0, 0.0, 0.0)),
                                   (2, 33, 70, 11, True, (4, -0.5, 0.5)), (4, 8, 5, 3, True, (1, 0.0, 0.0))):
        threads = native.gemm_threads(m * n, hw * hw, c)
        # as many samples as divide evenly among the threads in one call, the rest a call each
        whole = n - n % threads
        batched_calls = [whole] + [1] * (n - whole) if whole > 1 else [1] * n
        x = RNG.standard_normal((n, c, hw, hw)).astype(np.float32)
        w = RNG.standard_normal((m, c, 1, 1)).astype(np.float32)
        b = RNG.standard_normal(m).astype(np.float32) if bias else None
        answers = {}
        for batched in (False, True):
            monkeypatch.setattr(native, "BATCHED_POINTWISE", batched)
            kernel = native.gemm_conv2d(w, window, b, act)
            calls.clear()
            got = [kernel(x)]
            assert calls == (batched_calls if batched else [1] * n)
            got.append(kernel(x))
            assert native.wait_packed()
            got.append(kernel(x))
            answers[batched] = got
        for loop, batch in zip(answers[False], answers[True]):
            np.testing.assert_array_equal(batch, loop)
        want = conv_float64(x, w, b, window)
        code, lo, hi = act
        want = np.maximum(want, 0) if code == 1 else np.clip(want, lo, hi) if code == 4 else want
        np.testing.assert_allclose(answers[True][0], want, rtol=1e-4, atol=1e-4)


@needs_sgemm
def test_large_1x1_products_stay_a_call_per_sample(monkeypatch):
    monkeypatch.setattr(native, "BATCHED_POINTWISE_MACS", 24 * 40 * 81 - 1)  # one pixel's worth under the sample's
    calls = []
    real = native._native.sgemm
    monkeypatch.setattr(native._native, "sgemm", lambda *a: calls.append(a[14] if len(a) > 14 else 1) or real(*a))
    w = RNG.standard_normal((24, 40, 1, 1)).astype(np.float32)
    x = RNG.standard_normal((4, 40, 9, 9)).astype(np.float32)
    got = native.gemm_conv2d(w, make_window((1, 1)), None)(x)
    assert calls == [1, 1, 1, 1]
    np.testing.assert_allclose(got, conv_float64(x, w, None, make_window((1, 1))), rtol=1e-4, atol=1e-4)


@needs_sgemm
def test_a_1x1_conv_over_few_channels_runs_direct_for_one_sample_and_batched_for_several(monkeypatch):
    calls = []
    real_direct, real_sgemm = native._native.direct_conv2d_fast, native._native.sgemm
    monkeypatch.setattr(native._native, "direct_conv2d_fast", lambda *a: calls.append("direct") or real_direct(*a))
    monkeypatch.setattr(native._native, "sgemm", lambda *a: calls.append("sgemm") or real_sgemm(*a))
    w = RNG.standard_normal((32, 16, 1, 1)).astype(np.float32)
    b = RNG.standard_normal(32).astype(np.float32)
    window = make_window((1, 1))
    assert native.covers_conv(np.float32, w, window, 1)
    kernel = native.conv_kernel(w, window, 1, b, (1, 0.0, 0.0))
    for n, path in ((1, "direct"), (3, "sgemm"), (1, "direct")):
        x = RNG.standard_normal((n, 16, 10, 10)).astype(np.float32)
        calls.clear()
        got = kernel(x)
        assert calls == [path], n
        np.testing.assert_allclose(got, np.maximum(conv_float64(x, w, b, window), 0), rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(native, "BATCHED_POINTWISE_MACS", 32 * 16 * 100 - 1)  # a sample of 10x10 is over it
    calls.clear()
    kernel(RNG.standard_normal((3, 16, 10, 10)).astype(np.float32))
    assert calls == ["direct"]
    monkeypatch.setattr(native, "BATCHED_POINTWISE_MACS", 1 << 30)
    monkeypatch.setattr(native, "BATCHED_POINTWISE", False)
    calls.clear()
    native.conv_kernel(w, window, 1, b, (1, 0.0, 0.0))(RNG.standard_normal((3, 16, 10, 10)).astype(np.float32))
    assert calls == ["direct"]
    # a strided or padded 1x1 is not a plain product of the input: direct at any batch
    for strided in (make_window((1, 1), strides=(2, 2)), make_window((1, 1), pads=(1, 1, 1, 1))):
        monkeypatch.setattr(native, "BATCHED_POINTWISE", True)
        calls.clear()
        native.conv_kernel(w, strided, 1, b, (1, 0.0, 0.0))(RNG.standard_normal((3, 16, 10, 10)).astype(np.float32))
        assert calls == ["direct"]


def conv_relu_graph(c=32, m=24):  # 288 taps: past the direct kernels, a GEMM convolution
    g = Graph("conv_relu")
    x = g.add_input("x", "float32", ["batch", c, 12, 12])
    w = g.add_initializer("w", RNG.standard_normal((m, c, 3, 3)).astype(np.float32))
    b = g.add_initializer("b", RNG.standard_normal(m).astype(np.float32))
    g.outputs = [g.op("Relu", g.op("Conv", x, w, b, pads=[1, 1, 1, 1]))]
    return g


@needs_native
def test_a_gemm_conv_and_its_activation_run_as_one_native_kernel(monkeypatch):
    calls = []
    real = native.gemm_conv2d

    def spy(w, window, bias, activation=(0, 0.0, 0.0)):
        calls.append(activation)
        return real(w, window, bias, activation)
    monkeypatch.setattr(native, "gemm_conv2d", spy)
    g = conv_relu_graph()
    p = kiln.load(g)
    assert [n.op for n in p.graph.nodes] == ["FusedEpilogue"] and calls == [(1, 0.0, 0.0)]
    x = RNG.standard_normal((3, 32, 12, 12)).astype(np.float32)
    np.testing.assert_allclose(p.run({"x": x}, as_list=True)[0], evaluate(g, {"x": x})[0], rtol=1e-4, atol=1e-4)


def encoder_products_graph():
    """A Linear layer whose weight is kept as a Transpose node (as the passes keep a large weight's transpose),
    then attention's two products of computed operands (one a transposed view), then a Gemm with a bias."""
    g = Graph("products")
    x = g.add_input("x", "float32", ["batch", 16, 32])
    w = g.add_initializer("w", RNG.standard_normal((48, 32)).astype(np.float32))   # [out, in], like nn.Linear
    h = g.op("MatMul", x, g.op("Transpose", w, perm=[1, 0]))                       # [batch, 16, 48]
    q = g.op("Reshape", h, g.add_initializer("s", np.array([0, 16, 3, 16], np.int64)))
    q = g.op("Transpose", q, perm=[0, 2, 1, 3])                                     # [batch, 3, 16, 16]
    scores = g.op("MatMul", q, g.op("Transpose", q, perm=[0, 1, 3, 2]))
    ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), q)                       # [batch, 3, 16, 16]
    flat = g.op("Reshape", ctx, g.add_initializer("f", np.array([-1, 16], np.int64)))
    wg = g.add_initializer("wg", RNG.standard_normal((16, 8)).astype(np.float32))
    bg = g.add_initializer("bg", RNG.standard_normal(8).astype(np.float32))
    g.outputs = [g.op("Gemm", flat, wg, bg)]
    return g


@needs_sgemm
def test_programs_run_their_products_on_the_sgemm(monkeypatch):
    used = {"linear": 0, "matmul": 0}
    real_linear, real_matmul = native.linear, native.matmul

    def linear(weight, bias):
        kernel = real_linear(weight, bias)

        def run(x):
            used["linear"] += 1
            return kernel(x)
        return run

    def matmul(a, b):
        used["matmul"] += 1
        return real_matmul(a, b)
    monkeypatch.setattr(native, "linear", linear)
    monkeypatch.setattr(native, "matmul", matmul)
    g = encoder_products_graph()
    p = kiln.load(g)
    x = RNG.standard_normal((4, 16, 32)).astype(np.float32)
    np.testing.assert_allclose(p.run({"x": x}, as_list=True)[0], evaluate(g, {"x": x})[0], rtol=1e-4, atol=1e-4)
    assert used == {"linear": 2, "matmul": 2}  # the Linear (through its Transpose) and the Gemm; both products
    # one row (a batch-1 MLP's) and a panel and a bit: the sgemm too, its tiles of fewer rows computing only the
    # rows there are
    h = Graph("row")
    v = h.add_input("v", "float32", ["batch", 32])
    h.outputs = [h.op("MatMul", v, h.add_initializer("w", RNG.standard_normal((32, 8)).astype(np.float32)))]
    used.update(linear=0, matmul=0)
    q = kiln.load(h)
    for rows in (1, 9):
        v_in = RNG.standard_normal((rows, 32)).astype(np.float32)
        np.testing.assert_allclose(q.run({"v": v_in}, as_list=True)[0], evaluate(h, {"v": v_in})[0], rtol=1e-5,
                                   atol=1e-5)
    assert used == {"linear": 2, "matmul": 0}


@needs_sgemm
def test_native_matmul_takes_float32_and_leaves_the_rest():
    a = RNG.standard_normal((2, 3, 5, 7)).astype(np.float32)
    b = RNG.standard_normal((2, 3, 7, 4)).astype(np.float32)
    np.testing.assert_allclose(native.matmul(a, b), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    bt = np.ascontiguousarray(b.swapaxes(-1, -2)).swapaxes(-1, -2)  # a transposed view: read, not copied
    np.testing.assert_allclose(native.matmul(a, bt), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(native.matmul(a[0, 0], b), a[0, 0].astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    assert native.matmul(a.astype(np.float64), b) is None
    assert native.matmul(a[:1], b[:, :1]) is None       # broadcast leading dims: numpy's
    assert native.matmul(a[0, 0, 0], b[0, 0]) is None   # a vector: numpy's
    assert native.linear(np.zeros((4, 3), np.float64), None) is None


FORK_CHECK = """
import os, numpy as np
from kiln.runtime.kernels.cpu import native
a = np.ones((64, 64), np.float32); b = np.ones((64, 64), np.float32)
def product():
    c = np.empty((64, 64), np.float32)
    native._native.sgemm(a, b, c, None, 64, 64, 64, 0, 0, 0, 0, 0.0, 0.0, 2)
    return float(c[0, 0])
assert product() == 64.0   # the pool's threads exist now
pid = os.fork()
if pid == 0:  # the child has none of them: its pool starts over
    os._exit(0 if product() == 64.0 else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), product())
"""


@needs_sgemm
def test_the_thread_pool_starts_over_in_a_forked_child():
    """kiln serve's workers are forked: a child must not wait for pool threads only its parent has."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", FORK_CHECK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["child", "0", "64.0"]


@needs_sgemm
def test_products_from_several_python_threads_at_once():
    """One call has the pool at a time; the others make threads of their own. Every answer stays right."""
    from concurrent.futures import ThreadPoolExecutor
    a = RNG.standard_normal((8, 96, 80)).astype(np.float32)
    b = RNG.standard_normal((8, 80, 70)).astype(np.float32)

    def product(i):
        c = np.empty((96, 70), np.float32)
        for _ in range(20):
            native._native.sgemm(a[i], b[i], c, None, 96, 70, 80, 0, 0, 0, 0, 0.0, 0.0, 2)
        return c
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(product, range(8)))
    for i, c in enumerate(results):
        np.testing.assert_allclose(c, a[i].astype(np.float64) @ b[i], rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- Winograd F(2x2, 3x3)
@needs_sgemm
def test_a_winograd_chunk_takes_enough_samples_for_its_minimum_of_tiles(monkeypatch):
    """Chunks are sized for the cache (WINOGRAD_BYTES) but take at least WINOGRAD_MIN_TILES tiles where the batch
    has them: 7x7 maps (16 tiles a sample) at batch 4 run as Winograd in chunks of two, not as the GEMM conv."""
    monkeypatch.setattr(native, "WINOGRAD_BYTES", 1)
    monkeypatch.setattr(native, "gemm_conv2d", lambda *a, **k: pytest.fail("fell back to the GEMM convolution"))
    x = RNG.standard_normal((4, 8, 7, 7)).astype(np.float32)
    w = RNG.standard_normal((6, 8, 3, 3)).astype(np.float32)
    window = make_window((3, 3), pads=[1, 1, 1, 1])
    got = native.winograd_conv2d(w, window, None)(x)
    want = conv_float64(x, w, None, window)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@needs_sgemm
@pytest.mark.parametrize("chunk_bytes", [8 << 20, 1])  # one chunk of samples, or one sample per chunk
def test_winograd_against_float64(monkeypatch, chunk_bytes):
    monkeypatch.setattr(native, "WINOGRAD_BYTES", chunk_bytes)
    monkeypatch.setattr(native, "WINOGRAD_MIN_TILES", 1)  # every size through the transforms
    ran = 0
    for trial in range(60):
        n, c, m = int(RNG.integers(1, 4)), int(RNG.integers(1, 20)), int(RNG.integers(1, 20))
        h, wd = int(RNG.integers(1, 15)), int(RNG.integers(1, 15))
        pads = [int(v) for v in RNG.integers(0, 3, 4)]
        window = make_window((3, 3), pads=pads)
        try:
            window_out_shape(window, (h, wd))
        except ValueError:
            continue
        x = RNG.standard_normal((n, c, h, wd)).astype(np.float32)
        w = RNG.standard_normal((m, c, 3, 3)).astype(np.float32)
        b = RNG.standard_normal(m).astype(np.float32) if trial % 2 else None
        act = (4, -0.5, 0.75) if trial % 3 == 0 else (0, 0.0, 0.0)
        got = native.winograd_conv2d(w, window, b, act)(x)
        want = conv_float64(x, w, b, window)
        if act[0] == 4:
            want = np.clip(want, -0.5, 0.75)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())),
                                   err_msg=f"{x.shape} {w.shape} pads {pads}")
        ran += 1
    assert ran > 30


@needs_sgemm
@pytest.mark.parametrize("background", [True, False])
def test_weights_are_packed_on_the_second_call_and_every_call_answers_the_same_bits(monkeypatch, background):
    """Until PACK_AT_CALL a kernel reads its weights as they lie (a fresh process's first run makes no packed
    copies); from it on, packed ones, made on the packing thread (the calls read the weights as they lie until the
    copy is there) or on the caller's. The sums are the same in the same order: every call's bits agree."""
    monkeypatch.setattr(native, "PACK_IN_BACKGROUND", background)
    packs, transforms = [], []
    real_panels, real_transform = native._panels, native._native.winograd_weights
    monkeypatch.setattr(native, "_panels", lambda *a: packs.append(a[0].shape) or real_panels(*a))
    monkeypatch.setattr(native._native, "winograd_weights", lambda *a: transforms.append(1) or real_transform(*a))
    x = RNG.standard_normal((2, 24, 17, 17)).astype(np.float32)
    w = RNG.standard_normal((40, 24, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(40).astype(np.float32)
    weight = RNG.standard_normal((64, 300)).astype(np.float32)  # nn.Linear's [N, K]
    rows = RNG.standard_normal((37, 300)).astype(np.float32)
    kernels = {
        "gemm conv": (native.gemm_conv2d(w, make_window((3, 3), strides=(2, 2), pads=(1, 1, 1, 1)), b, (1, 0, 0)), x),
        "1x1 conv": (native.gemm_conv2d(w[:, :, :1, :1].copy(), make_window((1, 1)), None), x),
        "linear, transposed weight": (native.linear(weight.T, b[:1].repeat(64)), rows),
        "linear, weight by rows": (native.linear(np.ascontiguousarray(weight.T), None, (2, 0, 0)), rows[:3]),
    }
    for name, (kernel, arg) in kernels.items():
        packs.clear()
        first = kernel(arg)
        assert packs == [], name
        results = [kernel(arg)]
        assert native.wait_packed(), name
        results += [kernel(arg) for _ in range(2)]
        assert len(packs) == 1, name
        for r in results:
            np.testing.assert_array_equal(r, first, err_msg=name)
    monkeypatch.setattr(native, "WINOGRAD_MIN_TILES", 1)
    wide = RNG.standard_normal((70, 64, 3, 3)).astype(np.float32)
    xw = RNG.standard_normal((1, 64, 9, 9)).astype(np.float32)
    kernel = native.winograd_conv2d(wide, make_window((3, 3), pads=(1, 1, 1, 1)), None)
    first = kernel(xw)
    results = [kernel(xw)]
    assert native.wait_packed()
    results += [kernel(xw) for _ in range(2)]
    # a temporary on the first call; on the second the kept one, and made on the packing thread, another
    # temporary for that call itself
    assert len(transforms) == (3 if background else 2)
    for r in results:
        np.testing.assert_array_equal(r, first)


@needs_sgemm
def test_packing_that_fails_leaves_the_kernel_reading_its_weights_as_they_lie(monkeypatch):
    """A packed copy that cannot be made (out of memory, say) on the packing thread: the kernel goes on answering
    from the weights as they lie, the same bits."""
    monkeypatch.setattr(native, "PACK_IN_BACKGROUND", True)

    def no_memory(*a):
        raise MemoryError("no room for the packed copy")
    monkeypatch.setattr(native, "_panels", no_memory)
    weight = RNG.standard_normal((300, 64)).astype(np.float32)
    rows = RNG.standard_normal((37, 300)).astype(np.float32)
    kernel = native.linear(weight, None)
    first = kernel(rows)
    kernel(rows)
    assert native.wait_packed()
    for _ in range(3):
        np.testing.assert_array_equal(kernel(rows), first)
    np.testing.assert_allclose(first, rows @ weight, rtol=1e-4, atol=1e-4)


@needs_sgemm
def test_a_forked_child_packs_what_its_parent_had_not(monkeypatch):
    """What the parent had submitted but not made when it forked is submitted again by the child's next call (the
    packing thread does not survive fork): the child's kernels end up on packed weights."""
    monkeypatch.setattr(native, "PACK_IN_BACKGROUND", True)
    packer = native._Packer()
    monkeypatch.setattr(native, "_PACKER", packer)
    lazy = native._Lazy(lambda: np.ones(3, np.float32))
    lazy.calls = native.PACK_AT_CALL
    lazy.submitted = True                    # as if submitted to a packing thread the fork did not copy
    packer._pending.add(lazy)
    packer.after_fork_in_child()             # what os.register_at_fork runs in the child
    assert lazy.get() is None                # resubmitted, to this process's packing thread
    assert native.wait_packed() and lazy.get() is not None


def _g_rows(g: np.ndarray, axis: int) -> np.ndarray:
    """G (4x3) along ``axis``: the formula the transformed weights were made with in numpy before the native pass."""
    g0, g1, g2 = (np.take(g, i, axis=axis) for i in range(3))
    return np.stack([g0, (g0 + g1 + g2) * 0.5, (g0 - g1 + g2) * 0.5, g2], axis=axis)


@needs_native
@pytest.mark.parametrize("m,c", [(64, 64), (70, 3), (1, 1), (12, 5)])
def test_winograd_weights_are_numpys_float64_transform_bit_for_bit(m, c):
    w = RNG.standard_normal((m, c, 3, 3)).astype(np.float32) * 3
    u = _g_rows(_g_rows(w.astype(np.float64), 2), 3)  # [M, C, 4, 4]: G g, then (G g) G^T
    u = np.ascontiguousarray(u.transpose(2, 3, 0, 1), np.float32).reshape(16, m, c)
    want = np.stack([native.pack_rows(u[k]) for k in range(16)])
    got = np.full(want.shape, np.nan, np.float32)
    native._native.winograd_weights(w, got, m, c)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="size does not match"):
        native._native.winograd_weights(w, got[:15], m, c)


@needs_sgemm
def test_winograd_takes_wide_3x3_convs_and_leaves_small_maps_to_the_gemm(monkeypatch):
    k3 = make_window((3, 3), pads=(1, 1, 1, 1))
    wide = np.zeros((128, 128, 3, 3), np.float32)
    assert native.covers_winograd(wide, k3, 1)
    assert not native.covers_winograd(wide, make_window((3, 3), strides=(2, 2), pads=(1, 1, 1, 1)), 1)
    assert not native.covers_winograd(np.zeros((32, 32, 3, 3), np.float32), k3, 1)  # the transforms outweigh it
    assert not native.covers_winograd(np.zeros((128, 128, 5, 5), np.float32), make_window((5, 5)), 1)
    monkeypatch.setattr(native, "WINOGRAD", False)
    assert not native.covers_winograd(wide, k3, 1)
    monkeypatch.setattr(native, "WINOGRAD", True)
    calls = []
    real = native._native

    class Spy:  # the C entry points, their calls recorded
        def __getattr__(self, name):
            entry = getattr(real, name)
            if not callable(entry):
                return entry

            def call(*args):
                calls.append(name)
                return entry(*args)
            return call
    monkeypatch.setattr(native, "_native", Spy())
    w = RNG.standard_normal((128, 128, 3, 3)).astype(np.float32) * 0.05
    kernel = native.winograd_conv2d(w, k3, None)
    for hw, path in ((16, "winograd_input"), (4, "im2col")):  # 64 tiles at 16x16; 4 at 4x4: the GEMM's
        calls.clear()
        x = RNG.standard_normal((1, 128, hw, hw)).astype(np.float32)
        np.testing.assert_allclose(kernel(x), conv_float64(x, w, None, k3), rtol=1e-4, atol=1e-4)
        assert path in calls and ("winograd_input" in calls) == (path == "winograd_input"), calls


@needs_sgemm
def test_winograd_entry_points_refuse_what_does_not_match():
    x = np.zeros((1, 2, 4, 4), np.float32)
    with pytest.raises(ValueError, match="size does not match"):
        native._native.winograd_input(x, np.zeros((16, 2, 3), np.float32), 1, 2, 4, 4, 1, 1, 2, 2)
    with pytest.raises(ValueError, match="bad arguments"):  # tiles that do not cover the output
        native._native.winograd_output(np.zeros((16, 2, 4), np.float32), np.zeros((1, 2, 4, 4), np.float32), None,
                                       1, 2, 4, 4, 1, 2, 0, 0.0, 0.0)


@needs_native
@pytest.mark.parametrize("threads", [2, 3])
def test_row_kernels_on_several_threads_answer_bit_for_bit_as_on_one(monkeypatch, threads):
    """The rows (Gelu and activations: runs of 64 floats) split over the pool: every value computed as on one."""
    x = (RNG.standard_normal((37, 301)) * 4).astype(np.float32)
    scale, bias = RNG.standard_normal(301).astype(np.float32), RNG.standard_normal(301).astype(np.float32)
    from kiln.runtime.kernels.cpu import activation as act_kernels
    neg_h = act_kernels._GELU_NEG_H_ARRAY

    def all_kernels():
        return [native.layer_norm(x, scale, bias, 1e-5), native.softmax(x), native.activation(x, 2, 1 / 6, 0.5),
                native.mean_rows(x), native.gelu(x, neg_h)]
    monkeypatch.setattr(native, "kernel_threads", lambda: 1)
    one = all_kernels()
    monkeypatch.setattr(native, "kernel_threads", lambda: threads)
    monkeypatch.setattr(native, "ROW_FLOATS_PER_THREAD", 1)
    monkeypatch.setattr(native, "GELU_FLOATS_PER_THREAD", 1)
    for a, b in zip(one, all_kernels()):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- MaxPool
@needs_native
@pytest.mark.parametrize("threads", [1, 3])
def test_max_pool_against_the_reference(monkeypatch, threads):
    """Random 2-D MaxPools (kernel 1-4, stride 1-3, dilation 1-2, pads, ceil_mode; a NaN in some inputs) against
    the reference's window maxima, value for value."""
    from kiln.ir.ops.pool import max_pool_values
    monkeypatch.setattr(native, "kernel_threads", lambda: threads)
    monkeypatch.setattr(native, "ROW_FLOATS_PER_THREAD", 1)
    ran = 0
    for trial in range(200):
        kernel = [int(v) for v in RNG.integers(1, 5, 2)]
        strides = [int(v) for v in RNG.integers(1, 4, 2)]
        dilations = [int(v) for v in RNG.integers(1, 3, 2)]
        pads = [int(v) for v in RNG.integers(0, 2, 4)]
        ceil = int(trial % 2)
        x = RNG.standard_normal((int(RNG.integers(1, 3)), int(RNG.integers(1, 4)), int(RNG.integers(1, 13)),
                                 int(RNG.integers(1, 13)))).astype(np.float32)
        if trial % 5 == 0:
            x.flat[int(RNG.integers(0, x.size))] = np.nan
        try:
            want = max_pool_values(x, kernel_shape=kernel, strides=strides, dilations=dilations, pads=pads,
                                   auto_pad="NOTSET", ceil_mode=ceil)[0]
            window = make_window(kernel, strides=strides, dilations=dilations, pads=pads, ceil_mode=ceil)
        except ValueError:
            continue
        got = native.max_pool2d(window)(x)
        np.testing.assert_array_equal(got, want, err_msg=f"{x.shape} {kernel} {strides} {dilations} {pads} {ceil}")
        ran += 1
    assert ran > 100


@needs_native
def test_programs_take_the_native_max_pool(monkeypatch):
    calls = []
    real = native.max_pool2d
    monkeypatch.setattr(native, "max_pool2d", lambda window: calls.append(window) or real(window))
    g = Graph("pool")
    x = g.add_input("x", "float32", ["batch", 4, 15, 15])
    g.outputs = [g.op("MaxPool", x, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])]
    feeds = {"x": RNG.standard_normal((2, 4, 15, 15)).astype(np.float32)}
    np.testing.assert_array_equal(kiln.load(g).run(feeds, as_list=True)[0], evaluate(g, feeds)[0])
    assert len(calls) == 1


def test_when_the_extensions_sgemm_runs_the_products():
    """Wherever the CPU has AVX-512F unless KILN_NATIVE_SGEMM turns it off, whichever kernels numpy's OpenBLAS runs
    (measured model by model against OpenBLAS's own AVX-512 kernels: bench/sgemm_policy_bench.py)."""
    assert native.sgemm_wanted("", True) and native.sgemm_wanted("1", True) and native.sgemm_wanted(" ON ", True)
    assert not native.sgemm_wanted("", False) and not native.sgemm_wanted("1", False)  # no AVX-512F
    assert not native.sgemm_wanted("0", True) and not native.sgemm_wanted(" off ", True)


def test_the_products_stay_on_the_extension_under_openblas_avx512_kernels():
    """A process whose OpenBLAS runs its AVX-512 SkylakeX kernels (what OpenBLAS picks on the CPUs it knows, and
    what ``import kiln`` asks for on a Zen 5) still runs the products on the extension where the CPU has AVX-512F:
    deferring to that OpenBLAS had made the reference models 1.3-3.4x slower."""
    code = ("import kiln; from kiln.runtime.kernels.cpu import native; from kiln.runtime import threads; "
            "print(threads.blas_kernels(), bool(native._native is not None and native._native.has_sgemm), "
            "native.has_sgemm())")
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_NATIVE_SGEMM", "KILN_NATIVE")}
    env["OPENBLAS_CORETYPE"] = "SkylakeX"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    kernels, cpu_avx512, used = out.stdout.split()
    assert used == cpu_avx512, out.stdout  # on wherever the CPU can, whatever OpenBLAS runs


@needs_sgemm
def test_native_matmul_reads_strided_views_in_place(monkeypatch):
    """Attention's heads split from [batch, seq, heads, dim] memory, and K^T, are read in place through the arrays'
    own strides (no copy made), answering as float64 does, as are reversed rows and rows broadcast from one (stride
    0); views with neither last axis at unit stride are copied, still right."""
    copies = []
    real = np.ascontiguousarray
    monkeypatch.setattr(native.np, "ascontiguousarray",
                        lambda x, *a, **k: copies.append(x.shape) or real(x, *a, **k))
    mem = RNG.standard_normal((3, 10, 2, 8)).astype(np.float32)      # [batch, seq, heads, dim]
    q = mem.transpose(0, 2, 1, 3)                                      # [batch, heads, seq, dim], rows 16 apart
    kt = q.transpose(0, 1, 3, 2)                                       # K^T: unit stride down its rows
    v = mem[:, :, :, :5].transpose(0, 2, 1, 3)                         # a column slice too
    one_row = np.broadcast_to(mem[:1, :1, :1, :], (3, 2, 4, 8))        # every row the same memory (stride 0)
    cases = ((q, kt), (q @ kt, v), (q[0, 0], kt), (q, kt[0, 0]), (q[:, :, ::-1], kt), (q, kt[..., ::-1]),
             (one_row, kt), (q[:, 1:, 2:7], kt[:, 1:]))
    for a, b in cases:
        got = native.matmul(a, b)
        assert got.shape == np.matmul(a, b).shape
        np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    assert copies == []
    every_other = q[:, :, :, ::2]                                      # no unit-stride axis among the last two
    np.testing.assert_allclose(native.matmul(every_other, kt[:, :, ::2]),
                               every_other.astype(np.float64) @ kt[:, :, ::2], rtol=1e-5, atol=1e-5)
    assert copies


@needs_sgemm
def test_native_matmul_refuses_what_numpy_would_broadcast_otherwise():
    """Leading dims that differ (numpy would broadcast them) and k = 0 are left to numpy (None)."""
    a = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    assert native.matmul(a, RNG.standard_normal((1, 3, 5, 2)).astype(np.float32)) is None
    assert native.matmul(np.zeros((2, 0), np.float32), np.zeros((0, 3), np.float32)) is None
    assert native.matmul(a, RNG.standard_normal((2, 3, 5, 2))) is None  # float64 b
    with pytest.raises(ValueError, match="shapes do not match"):
        native._native.matmul(a, RNG.standard_normal((2, 3, 4, 2)).astype(np.float32),
                              np.empty((2, 3, 4, 2), np.float32), 1)


@needs_sgemm
def test_sgemm_refuses_offsets_outside_the_buffer():
    a = np.zeros(100, np.float32)
    b = np.zeros((5, 6), np.float32)
    c = np.zeros((2, 4, 6), np.float32)
    ok = np.array([0, 20], np.int64)
    native._native.sgemm(a, b, c, None, 4, 6, 5, 0, 0, 0, 0, 0.0, 0.0, 1, 2, 0, 0, 0, 5, 0, ok, None)
    with pytest.raises(ValueError, match="size does not match"):
        native._native.sgemm(a, b, c, None, 4, 6, 5, 0, 0, 0, 0, 0.0, 0.0, 1, 2, 0, 0, 0, 5, 0,
                             np.array([0, 90], np.int64), None)
    with pytest.raises(ValueError, match="batch int64s"):
        native._native.sgemm(a, b, c, None, 4, 6, 5, 0, 0, 0, 0, 0.0, 0.0, 1, 2, 0, 0, 0, 5, 0,
                             np.array([0], np.int64), None)
    with pytest.raises(ValueError, match="row strides"):
        native._native.sgemm(a, b, c, None, 4, 6, 5, 0, 0, 0, 0, 0.0, 0.0, 1, 2, 0, 0, 0, 3, 0, ok, None)


@needs_sgemm
def test_native_matmul_copies_views_whose_rows_overlap():
    """A row stride under the row's length (rows broadcast, stride 0; or overlapping rows) is no strided matrix the
    sgemm can read: such views are copied, and the answer is numpy's."""
    big = RNG.standard_normal(1000).astype(np.float32)
    broadcast = np.broadcast_to(big[:7], (3, 5, 7))                      # rows 0 floats apart, inside a larger root
    overlapping = np.lib.stride_tricks.as_strided(big, (4, 6), (8, 4))  # rows 2 floats apart, 6 long
    b = RNG.standard_normal((7, 4)).astype(np.float32)
    np.testing.assert_allclose(native.matmul(broadcast, b), broadcast.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    c = RNG.standard_normal((6, 3)).astype(np.float32)
    np.testing.assert_allclose(native.matmul(overlapping, c), overlapping.astype(np.float64) @ c, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(native.matmul(c.T.copy(), overlapping.T), c.T.astype(np.float64) @ overlapping.T,
                               rtol=1e-5, atol=1e-5)


def _product_epilogue_graph(kind: str):
    """One product and its consumer: the pairs kiln.load fuses into one sgemm, and pairs it must leave alone (the
    same weights on every call)."""
    rng = np.random.default_rng(7)
    g = Graph(kind)
    x = g.add_input("x", "float32", ["batch", 24] if kind.startswith("gemm") else ["batch", 5, 24])
    w = g.add_initializer("w", rng.standard_normal((24, 40)).astype(np.float32))
    wt = g.add_initializer("wt", rng.standard_normal((40, 24)).astype(np.float32))
    row = g.add_initializer("row", rng.standard_normal(40).astype(np.float32))
    if kind == "matmul+bias":
        y = g.op("Add", g.op("MatMul", x, w), row)
    elif kind == "bias+matmul(transposed weight)":
        y = g.op("Add", g.add_initializer("row3", rng.standard_normal((1, 1, 40)).astype(np.float32)),
                 g.op("MatMul", x, g.op("Transpose", wt, perm=[1, 0])))
    elif kind == "matmul+relu":
        y = g.op("Relu", g.op("MatMul", x, w))
    elif kind == "gemm+clip":
        y = g.op("Clip", g.op("Gemm", x, wt, row, transB=1), g.add_initializer("lo", np.array(-0.5, np.float32)),
                 g.add_initializer("hi", np.array(0.5, np.float32)))
    elif kind == "matmul+full-bias (not a row bias)":
        y = g.op("Add", g.op("MatMul", x, w), g.add_initializer("full", rng.standard_normal((5, 40)).astype(np.float32)))
    elif kind == "gemm beta 2 + relu (not fused)":
        y = g.op("Relu", g.op("Gemm", x, wt, row, transB=1, beta=2.0))
    g.outputs = [y]
    return g


@needs_sgemm
@pytest.mark.parametrize("kind,fused", [("matmul+bias", True), ("bias+matmul(transposed weight)", True),
                                        ("matmul+relu", True), ("gemm+clip", True),
                                        ("matmul+full-bias (not a row bias)", False),
                                        ("gemm beta 2 + relu (not fused)", False)])
def test_a_product_and_its_bias_or_activation_run_as_one_sgemm(kind, fused):
    """kiln.load fuses a float32 product against a constant weight with a constant row bias (MatMul then Add) or an
    activation into one sgemm whose output pass applies them: the same bits as the ops one by one (Program without
    the load's passes), and the reference's answer; other consumers stay separate ops."""
    from kiln.runtime import Program
    g = _product_epilogue_graph(kind)
    p = kiln.load(g)
    kernels = [getattr(i.kernel, "__qualname__", "") for i in p.plan.instructions]
    assert any("run_product" in k for k in kernels) == fused, kernels
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 24) if kind.startswith("gemm") else (batch, 5, 24)).astype(np.float32)
        got = p.run({"x": x}, as_list=True)[0]
        np.testing.assert_array_equal(got, Program(_product_epilogue_graph(kind)).run({"x": x}, as_list=True)[0])
        np.testing.assert_allclose(got, evaluate(g, {"x": x})[0], rtol=1e-5, atol=1e-5)

"""kiln's optional native CPU kernels (runtime/kernels/cpu/_native.c, native.py): the direct convolution
against the Conv reference over the geometry it covers (depthwise, few-tap dense, 1x1 over few channels;
strides, dilations, pads, auto_pad, groups, batches, no bias), one thread and several; which convs it
takes and which it leaves to the GEMM; KILN_NATIVE=0; the argument checks of the C entry point; and, where
a C compiler is installed, that the install built it (an optional extension fails silently otherwise)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kiln.ir import evaluate
from kiln.ir.ops.nn import make_window
from kiln.runtime import Program
from kiln.runtime.kernels.cpu import native
from op_harness import build_single

RNG = np.random.default_rng(21)
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.UNAVAILABLE}")


def test_the_install_built_the_extension_where_a_compiler_is():
    """The extension is optional (pyproject.toml): without this test a broken build would silently leave the numpy
    kernels running (correct, slower). Where a C compiler is on PATH and nothing turned it off, it must be
    there."""
    if os.name != "posix" or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the numpy kernels run")
    if os.environ.get("KILN_NATIVE", "1") == "0":
        pytest.skip("turned off in the environment")
    assert native.available(), f"the native extension is missing: {native.UNAVAILABLE} (pip install -e . again)"


def conv_case(x_shape, w_shape, attrs, bias=True):
    x = RNG.standard_normal(x_shape).astype(np.float32)
    w = RNG.standard_normal(w_shape).astype(np.float32)
    inputs = [x, w] + ([RNG.standard_normal(w_shape[0]).astype(np.float32)] if bias else [])
    return build_single("Conv", inputs, attrs, const_inputs=(1, 2), symbolic_batch=True)


CASES = [  # (x shape, w shape, attrs)
    ((1, 16, 112, 112), (16, 1, 3, 3), {"group": 16, "strides": [2, 2], "pads": [1, 1, 1, 1]}),  # MobileNet
    ((2, 8, 15, 13), (8, 1, 5, 5), {"group": 8, "pads": [2, 2, 2, 2]}),
    ((3, 6, 17, 19), (6, 1, 3, 3), {"group": 6, "strides": [3, 2], "dilations": [2, 3], "pads": [0, 1, 2, 3]}),
    ((1, 4, 9, 9), (4, 1, 4, 4), {"group": 4, "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 4, 9, 8), (4, 1, 3, 2), {"group": 4, "auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    ((2, 5, 7, 7), (5, 1, 7, 7), {"group": 5, "auto_pad": "VALID"}),
    ((1, 3, 1, 1), (3, 1, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}),  # every tap but the centre in padding
    ((2, 3, 32, 30), (16, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),  # the stem: dense, 27 taps
    ((2, 3, 20, 20), (6, 3, 3, 3), {"dilations": [2, 2], "pads": [2, 2, 2, 2]}),  # 6 outputs: a block of 4 + 2
    ((2, 4, 11, 11), (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),  # grouped, 18 taps
    ((2, 16, 14, 14), (24, 16, 1, 1), {}),  # 1x1 over 16 channels
    ((1, 24, 9, 7), (10, 24, 1, 1), {"strides": [2, 2]}),  # 1x1, strided
    ((1, 1, 5, 70), (3, 1, 1, 9), {"pads": [0, 4, 0, 4]}),  # a row filter wider than a register block
]


@needs_native
@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
@pytest.mark.parametrize("threads", [1, 3])
def test_direct_conv_equals_the_reference(monkeypatch, x_shape, w_shape, attrs, threads):
    g, feeds = conv_case(x_shape, w_shape, attrs, bias=threads == 1)
    monkeypatch.setattr(native, "kernel_threads", lambda: threads)
    monkeypatch.setattr(native, "MACS_PER_THREAD", 1)  # every thread asked for, however small the conv
    monkeypatch.setattr(native, "MAX_THREADS", 8)
    # the direct kernel at every batch (a 1x1 over few channels of several samples is otherwise one batched sgemm:
    # tests/runtime/test_native_gemm.py)
    monkeypatch.setattr(native, "BATCHED_POINTWISE", False)
    calls = []
    real = native._native

    class Spy:  # the C entry point, counted: the Program must take the native kernel for every case
        def direct_conv2d_fast(self, *args):
            calls.append(args[5])  # threads (after the geometry tuple; then the activation code and its parameters)
            return real.direct_conv2d_fast(*args)
    monkeypatch.setattr(native, "_native", Spy())
    got = Program(g).run(feeds, as_list=True)[0]
    want = evaluate(g, feeds)[0]
    assert calls == [threads]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_native
def test_random_geometries_against_float64(monkeypatch):
    """300 random convs (kernel 1-5, stride 1-3, dilation 1-2, pads 0-2 or auto_pad, groups) against a float64
    sum over the taps, so the check does not lean on the numpy kernels it replaces."""
    from kiln.ir.ops.nn import static_pads, window_out_shape
    ran = 0
    for trial in range(300):
        kh, kw = (int(v) for v in RNG.integers(1, 6, 2))
        sh, sw = (int(v) for v in RNG.integers(1, 4, 2))
        dh, dw = (int(v) for v in RNG.integers(1, 3, 2))
        n, h, wd = int(RNG.integers(1, 3)), int(RNG.integers(1, 20)), int(RNG.integers(1, 20))
        kind = trial % 3
        if kind == 0:
            c = m = group = int(RNG.integers(1, 9))
        elif kind == 1:
            group = int(RNG.integers(1, 4))
            c, m = group * int(RNG.integers(1, 3)), group * int(RNG.integers(1, 3))
        else:
            group, c, m = 1, 3, int(RNG.integers(1, 9))
        auto = ["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"][int(RNG.integers(4))]
        pads = [int(v) for v in RNG.integers(0, 3, 4)] if auto == "NOTSET" else None
        try:
            window = make_window((kh, kw), strides=(sh, sw), dilations=(dh, dw), pads=pads, auto_pad=auto)
            oh, ow = window_out_shape(window, (h, wd))
        except ValueError:  # the window does not fit the padded input
            continue
        x = RNG.standard_normal((n, c, h, wd)).astype(np.float32)
        w = RNG.standard_normal((m, c // group, kh, kw)).astype(np.float32)
        b = RNG.standard_normal(m).astype(np.float32) if trial % 2 else None
        got = native.direct_conv2d(w, window, group, b)(x)
        begin, end, _ = static_pads(window, (h, wd))
        want = conv_float64(x, w, b, group, (sh, sw), (dh, dw), (begin[0], begin[1], end[0], end[1]))
        assert want.shape == (n, m, oh, ow)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{(n, c, h, wd)} {w.shape} {window}")
        ran += 1
    assert ran > 200


def conv_float64(x, w, b, group, strides, dilations, pads):
    """The convolution as a float64 sum over the taps (pads: top, left, bottom, right)."""
    n, c, h, wd = x.shape
    m, cpg, kh, kw = w.shape
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = strides, dilations, pads
    oh, ow = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1, (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
    xp = np.zeros((n, c, h + pt + pb + kh * dh, wd + pl + pr + kw * dw))
    xp[:, :, pt:pt + h, pl:pl + wd] = x
    want = np.zeros((n, m, oh, ow)) + (0 if b is None else b.astype(np.float64)[:, None, None])
    mpg = m // group
    for mo in range(m):
        for ci in range(cpg):
            for i in range(kh):
                for j in range(kw):
                    want[:, mo] += float(w[mo, ci, i, j]) * xp[:, (mo // mpg) * cpg + ci,
                                                                i * dh: i * dh + sh * (oh - 1) + 1: sh,
                                                                j * dw: j * dw + sw * (ow - 1) + 1: sw]
    return want


ACTIVATIONS = {  # code, alpha, beta -> the activation in float64
    0: ((0, 0.0, 0.0), lambda t: t),
    1: ((1, 0.0, 0.0), lambda t: np.maximum(t, 0)),
    2: ((2, 1 / 6, 0.5), lambda t: t * np.clip(t / 6 + 0.5, 0, 1)),
    3: ((3, 0.2, 0.5), lambda t: np.clip(0.2 * t + 0.5, 0, 1)),
    4: ((4, -0.5, 0.75), lambda t: np.minimum(np.maximum(t, -0.5), 0.75)),
    5: ((5, 0.1, 0.0), lambda t: np.where(t < 0, 0.1 * t, t)),
}


@needs_native
@pytest.mark.parametrize("impl", [0, 1])
def test_every_tile_shape_against_float64(impl):
    """The kernels' register tiles, each at the edges that mask them: depthwise 3x3 and 5x5 at strides 1 and 2 (the
    tiles that load each input row once) and other depthwise shapes, over map widths that give 1, 2 and 4 vectors a
    strip and ragged ends; dense convs over few channels (blocks of 4, 8 and 16 channels, a partial last block);
    pointwise convs whose planes are read flat (64, 32 or 16 wide) and ones that are not; every activation, with
    and without a bias, and several threads. impl 0 is the AVX-512 kernel where the CPU has it, impl 1 the
    8-float one; both must give the float64 answer."""
    from kiln.runtime.kernels.cpu import _native
    cases = []
    for k in (3, 5):
        for s in (1, 2):
            for wd in (7, 16, 20, 33, 70):
                cases.append(((2, 3, 9 + wd % 5, wd), (3, 1, k, k), 3, (s, s), (1, 1), (k // 2,) * 4))
    cases += [
        ((1, 4, 11, 12), (4, 1, 3, 3), 4, (2, 1), (1, 1), (1, 1, 1, 1)),  # unequal strides: the general tiles
        ((1, 2, 13, 40), (2, 1, 3, 3), 2, (1, 1), (2, 2), (2, 2, 2, 2)),  # dilated
        ((1, 2, 9, 35), (2, 1, 3, 3), 2, (3, 3), (1, 1), (0, 1, 2, 1)),  # stride 3: gathers
        ((1, 3, 1, 5), (3, 1, 3, 3), 3, (1, 1), (1, 1), (1, 1, 1, 1)),  # one row, every tap row but one padding
        ((2, 3, 30, 34), (16, 3, 3, 3), 1, (2, 2), (1, 1), (1, 1, 1, 1)),  # the stem: a block of 8 x 2 vectors
        ((1, 3, 12, 12), (16, 3, 3, 3), 1, (1, 1), (1, 1), (1, 1, 1, 1)),  # 16 channels x 1 vector
        ((1, 3, 12, 40), (13, 3, 3, 3), 1, (1, 1), (1, 1), (0, 2, 1, 0)),  # 8 + a partial block of 5
        ((1, 4, 10, 10), (6, 2, 3, 3), 2, (1, 1), (1, 1), (1, 1, 1, 1)),  # grouped: blocks of 4
        ((2, 16, 8, 8), (24, 16, 1, 1), 1, (1, 1), (1, 1), (0, 0, 0, 0)),  # pointwise, read as rows of 16
        ((1, 16, 16, 16), (8, 16, 1, 1), 1, (1, 1), (1, 1), (0, 0, 0, 0)),  # rows of 64
        ((1, 5, 6, 16), (8, 5, 1, 1), 1, (1, 1), (1, 1), (0, 0, 0, 0)),  # rows of 32
        ((1, 8, 7, 7), (8, 8, 1, 1), 1, (1, 1), (1, 1), (0, 0, 0, 0)),  # 49: not flat
        ((1, 8, 7, 9), (8, 8, 1, 1), 1, (2, 2), (1, 1), (0, 0, 0, 0)),  # strided: not flat
    ]
    for index, (x_shape, w_shape, group, strides, dilations, pads) in enumerate(cases):
        n, c, h, wd = x_shape
        m, _, kh, kw = w_shape
        x = RNG.standard_normal(x_shape).astype(np.float32)
        w = RNG.standard_normal(w_shape).astype(np.float32)
        b = RNG.standard_normal(m).astype(np.float32) if index % 2 else None
        (code, alpha, beta), act = ACTIVATIONS[index % len(ACTIVATIONS)]
        want = act(conv_float64(x, w, b, group, strides, dilations, pads))
        y = np.full(want.shape, np.nan, np.float32)
        _native.direct_conv2d(x, w, b, y, n, c, h, wd, m, *want.shape[2:], kh, kw, group, *strides, *dilations,
                              pads[0], pads[1], 1 + index % 3, code, alpha, beta, impl)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4, err_msg=f"case {index}: {x_shape} {w_shape}")


@needs_native
def test_which_convs_go_direct():
    w = np.zeros
    k3 = make_window((3, 3), pads=(1, 1, 1, 1))
    k1 = make_window((1, 1))
    assert native.covers_conv(np.float32, w((32, 1, 3, 3), np.float32), k3, 32)  # depthwise
    assert native.covers_conv(np.float32, w((16, 3, 3, 3), np.float32), k3, 1)  # the stem, 27 taps
    assert native.DIRECT_MAX_TAPS == (200 if native._native.has_sgemm else 27)  # AVX-512 tiles take more
    few = native.DIRECT_MAX_TAPS // 9
    assert native.covers_conv(np.float32, w((16, few, 3, 3), np.float32), k3, 1)
    assert not native.covers_conv(np.float32, w((16, few + 1, 3, 3), np.float32), k3, 1)  # the GEMM's
    k7 = make_window((7, 7), strides=(2, 2), pads=(3, 3, 3, 3))  # ResNet's stem: 147 taps
    assert native.covers_conv(np.float32, w((64, 3, 7, 7), np.float32), k7, 1) == bool(native._native.has_sgemm)
    assert native.covers_conv(np.float32, w((64, 24, 1, 1), np.float32), k1, 1)
    assert not native.covers_conv(np.float32, w((64, 48, 1, 1), np.float32), k1, 1)
    assert not native.covers_conv(np.float64, w((32, 1, 3, 3), np.float64), k3, 32)  # float32 only
    assert not native.covers_conv(np.float16, w((32, 1, 3, 3), np.float16), k3, 32)


@needs_native
def test_entry_point_refuses_what_does_not_match():
    from kiln.runtime.kernels.cpu import _native
    x, w, y = np.zeros((1, 2, 4, 4), np.float32), np.zeros((2, 1, 3, 3), np.float32), np.zeros((1, 2, 2, 2), np.float32)
    args = (1, 2, 4, 4, 2, 2, 2, 3, 3, 2, 1, 1, 1, 1, 0, 0, 1)
    _native.direct_conv2d(x, w, None, y, *args)
    with pytest.raises(TypeError, match="float32"):
        _native.direct_conv2d(x.astype(np.float64), w, None, y, *args)
    with pytest.raises(TypeError, match="float32"):
        _native.direct_conv2d(x.astype(">f4"), w, None, y, *args)
    with pytest.raises(ValueError, match="not C-contiguous"):
        _native.direct_conv2d(x[:, :, ::2], w, None, y, *args)
    with pytest.raises(ValueError, match="does not match"):
        _native.direct_conv2d(x, w, None, np.zeros((1, 2, 3, 3), np.float32), *args)
    with pytest.raises(ValueError, match="out of range"):
        _native.direct_conv2d(x, w, None, y, *args[:9], 3, *args[10:])  # 2 channels in 3 groups
    # the vectorcall entry: the same checks, its sizes as one tuple
    _native.direct_conv2d_fast(x, w, None, y, args[:16], 1, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="does not match"):
        _native.direct_conv2d_fast(x, w, None, np.zeros((1, 2, 3, 3), np.float32), args[:16], 1, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="out of range"):
        _native.direct_conv2d_fast(x, w, None, y, (*args[:9], 3, *args[10:16]), 1, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="unknown activation"):
        _native.direct_conv2d_fast(x, w, None, y, args[:16], 1, 99, 0.0, 0.0)
    with pytest.raises(TypeError, match="16 ints"):
        _native.direct_conv2d_fast(x, w, None, y, args[:15], 1, 0, 0.0, 0.0)


def test_kiln_native_0_turns_it_off_and_kiln_info_says_so():
    code = ("from kiln.runtime.kernels.cpu import native; import sys; "
            "print(native.available(), native.UNAVAILABLE)")
    env = {**os.environ, "KILN_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("False turned off by KILN_NATIVE"), out
    info = subprocess.run([sys.executable, "-m", "kiln", "info"], env=env, capture_output=True, text=True,
                          check=True).stdout
    assert "native CPU kernels: no (turned off by KILN_NATIVE; the numpy kernels run)" in info, info
    if native.available():
        info = subprocess.run([sys.executable, "-m", "kiln", "info"], capture_output=True, text=True,
                              check=True).stdout
        assert f"native CPU kernels: yes ({native._native.isa};" in info, info


# --------------------------------------------------------------------------- a Conv and its activation
def conv_act_graph(act: str, attrs=None, bounds=None, x_shape=(2, 4, 11, 11), w_shape=(4, 1, 3, 3), group=4,
                   dtype=np.float32):
    from kiln.ir.graph import Graph
    g = Graph("conv_act")
    x = g.add_input("x", dtype.__name__ if isinstance(dtype, type) else str(dtype), ["batch", *x_shape[1:]])
    w = g.add_initializer("w", RNG.standard_normal(w_shape).astype(dtype))
    b = g.add_initializer("b", RNG.standard_normal(w_shape[0]).astype(dtype))
    y = g.op("Conv", x, w, b, group=group, pads=[1, 1, 1, 1], strides=[2, 2])
    if act == "Clip":
        ins = [y] + [None if v is None else g.add_initializer(f"c{k}", np.array(v, dtype))
                     for k, v in enumerate(bounds)]
        while ins and ins[-1] is None:
            ins.pop()
        y = g.op("Clip", *ins)
    else:
        y = g.op(act, y, **(attrs or {}))
    g.outputs = [y]
    return g


ACTS = [("Relu", None, None), ("HardSwish", None, None), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, None),
        ("LeakyRelu", {"alpha": 0.07}, None), ("Clip", None, (-0.5, 0.75)), ("Clip", None, (None, 0.2)),
        ("Clip", None, (0.3,)), ("Clip", None, (0.5, -0.5))]  # min > max: max everywhere, as the reference


@needs_native
@pytest.mark.parametrize("act,attrs,bounds", ACTS)
@pytest.mark.parametrize("w_shape,group", [((4, 1, 3, 3), 4), ((6, 4, 1, 1), 1)])
def test_conv_and_activation_run_as_one_native_call(act, attrs, bounds, w_shape, group):
    """kiln.load fuses a covered Conv with its activation into a FusedEpilogue whose kernel is one native
    call; the answers are the unfused graph's reference (NaN inputs included: they stay NaN)."""
    import kiln
    g = conv_act_graph(act, attrs, bounds, w_shape=w_shape, group=group)
    x = RNG.standard_normal((3, 4, 11, 11)).astype(np.float32) * 2
    x[0, 0, 5, 5] = np.nan
    want = evaluate(g, [x])[0]
    program = kiln.load(g)
    assert [n.op for n in program.graph.nodes] == ["FusedEpilogue"]
    kernel = program.plan.instructions[0].kernel
    assert kernel.__qualname__.startswith("epilogue_kernel."), kernel.__qualname__
    got = program.run({"x": x})[program.outputs[0].name]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).any()
    assert [n.op for n in g.nodes] == ["Conv", act], "kiln.load(graph) must not change the caller's graph"


@needs_native
def test_what_is_not_fused():
    import kiln
    from kiln.ir.graph import Graph
    # the Conv's output is also a graph output: it must exist, so the activation stays a node of its own
    g = conv_act_graph("Relu")
    g.outputs = [g.nodes[0].outputs[0], *g.outputs]
    assert [n.op for n in kiln.load(g).graph.nodes] == ["Conv", "Relu"]
    # float64: the extension is float32 only
    assert [n.op for n in kiln.load(conv_act_graph("Relu", dtype=np.float64)).graph.nodes] == ["Conv", "Relu"]
    # a Clip bound computed at run time
    h = Graph("computed_bound")
    x = h.add_input("x", "float32", [1, 4, 8, 8])
    lo = h.add_input("lo", "float32", [])
    y = h.op("Conv", x, h.add_initializer("w", np.ones((4, 1, 3, 3), np.float32)), group=4)
    h.outputs = [h.op("Clip", y, lo)]
    assert [n.op for n in kiln.load(h).graph.nodes] == ["Conv", "Clip"]
    # a grouped conv past the direct kernel's taps stays numpy's GEMM's, unfused
    assert [n.op for n in kiln.load(conv_act_graph("Relu", x_shape=(2, 64, 11, 11), w_shape=(8, 32, 3, 3),
                                                   group=2)).graph.nodes] == \
        ["Conv", "Relu"]


# --------------------------------------------------------------------------- row kernels
def _tolerance_ratio(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / (1e-5 |want| + 1e-6): below 1 is within the op conformance tolerance."""
    return float(np.max(np.abs(got.astype(np.float64) - want) / (1e-5 * np.abs(want) + 1e-6)))


@needs_native
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 40, 63, 64, 65, 130, 65536 + 3])
def test_gelu_against_float64_and_the_numpy_kernel(n):
    from kiln.ir.ops.activation import _gelu64
    from kiln.runtime.kernels.cpu import activation
    x = (RNG.standard_normal(n) * 4).astype(np.float32)
    got = native.gelu(x, activation._GELU_NEG_H_ARRAY)
    assert _tolerance_ratio(got, _gelu64(x.astype(np.float64), "none")) < 0.1
    edge = np.array([0.0, -0.0, 1e-30, -1e-30, 5, -5, 10, -10, 100, -100, np.inf, -np.inf, np.nan, 3e38, -3e38],
                    np.float32)
    real = native._native
    try:
        native._native = None
        with np.errstate(invalid="ignore"):
            numpy_kernel = activation._gelu_erf(edge)
    finally:
        native._native = real
    np.testing.assert_array_equal(native.gelu(edge, activation._GELU_NEG_H_ARRAY), numpy_kernel)


@needs_native
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (5, 8), (4, 17), (64, 128), (2, 1000)])
def test_softmax_rows_against_float64(rows, n):
    x = (RNG.standard_normal((rows, n)) * 6).astype(np.float32)
    x64 = x.astype(np.float64)
    want = np.exp(x64 - x64.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    got = native.softmax(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@needs_native
def test_softmax_rows_with_infinities_and_nan_follow_the_reference_steps():
    from kiln.runtime.kernels.cpu import norm
    x = np.array([[0, 1, np.inf, 2, 0, 1, 2, 3, 4],          # +inf: inf - inf is NaN, so is the whole row
                  [0, -np.inf, 1, 2, 0, 1, 2, 3, 4],          # -inf: exp gives 0 there
                  [-np.inf] * 9,                              # all -inf: NaN
                  [np.nan, 1, 2, 3, 0, 1, 2, 3, 4],           # NaN first, in the vector part
                  [1, 2, 3, 4, 0, 1, 2, 3, np.nan],           # NaN in the tail
                  [-200, -150, 0, 1, 2, -90, 3, 4, 5]],       # exps below FLT_MIN come out 0
                 np.float32)
    with np.errstate(invalid="ignore"):
        want = norm._softmax_exact(x.copy(), -1)
    np.testing.assert_allclose(native.softmax(x), want, rtol=1e-6, atol=1e-30, equal_nan=True)


@needs_native
@pytest.mark.parametrize("n,bias,scalar_scale", [(1, True, False), (7, False, False), (16, True, False),
                                                  (33, True, True), (768, True, False)])
def test_layer_norm_rows_against_float64(n, bias, scalar_scale):
    x = (RNG.standard_normal((9, n)) * 3 + 2).astype(np.float32)
    scale = np.float32(1.7) * np.ones(1, np.float32) if scalar_scale else RNG.standard_normal(n).astype(np.float32)
    b = RNG.standard_normal(n).astype(np.float32) if bias else None
    x64 = x.astype(np.float64)
    mean = x64.mean(1, keepdims=True)
    want = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(1, keepdims=True) + 1e-5) * scale + (0 if b is None else b)
    np.testing.assert_allclose(native.layer_norm(x, scale, b, 1e-5), want, rtol=1e-5, atol=2e-6)


@needs_native
def test_the_programs_take_the_row_kernels(monkeypatch):
    """Gelu, LayerNormalization and Softmax over the last axis run natively in a loaded model, and equal the
    reference; a Softmax over another axis keeps the numpy kernel."""
    from kiln.ir.graph import Graph
    g = Graph("rows")
    x = g.add_input("x", "float32", ["batch", 5, 24])
    ln = g.op("LayerNormalization", x, g.add_initializer("s", RNG.standard_normal(24).astype(np.float32)),
              g.add_initializer("b", RNG.standard_normal(24).astype(np.float32)), axis=-1, epsilon=1e-5)
    sm = g.op("Softmax", g.op("Gelu", ln), axis=-1)
    g.outputs = [sm, g.op("Softmax", sm, axis=1)]
    calls = []
    real = native._native

    class Spy:
        def __getattr__(self, name):
            fn = getattr(real, name)
            return lambda *a: (calls.append(name), fn(*a))[1]
    monkeypatch.setattr(native, "_native", Spy())
    feeds = [RNG.standard_normal((3, 5, 24)).astype(np.float32)]
    got = Program(g).run(feeds, as_list=True)
    assert sorted(calls) == ["gelu", "layer_norm", "softmax"]
    for a, b in zip(got, evaluate(g, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- fused elementwise chains
def _load_both(g):
    """(native program, numpy program) of ``g``: kiln.load with the extension, and with it off."""
    import kiln
    real = native._native
    fused = kiln.load(g)
    native._native = None
    try:
        plain = kiln.load(g)
    finally:
        native._native = real
    return fused, plain


def _special(shape):
    x = (RNG.standard_normal(shape) * 3).astype(np.float32)
    flat = x.reshape(-1)
    flat[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40][:flat.size] if flat.size >= 6 else flat[:6]
    return x


@needs_native
@pytest.mark.parametrize("shape,const_shapes", [
    ((3, 5, 40), [(), (40,), (1, 1, 40), (1, 5, 40), (5, 40)]),   # scalar, bias, periodic
    ((2, 2050), [(1,), (2050,), (1, 2050)]),                        # across a chunk boundary
    ((1, 8), [(1, 8), ()]),
    ((3, 5003), [(), (5003,), (1, 5003)]),                          # several chunks, a part of one at the end
])
@pytest.mark.parametrize("threads", [1, 3])
def test_fused_chains_answer_bit_for_bit_as_the_numpy_kernels(monkeypatch, shape, const_shapes, threads):
    """A chain of every op the extension runs (Add, Sub, Mul, Div, Max, Min, Neg, Abs, Relu, Sqrt) over
    full-size, scalar and periodic operands, NaN, infinities and signed zeros included: kiln.load fuses it
    into one FusedElementwise run natively, and every output bit equals the unfused numpy kernels', on one thread
    and with the chunks split over three."""
    monkeypatch.setattr(native, "kernel_threads", lambda: threads)
    monkeypatch.setattr(native, "ROW_FLOATS_PER_THREAD", 1)
    from kiln.ir.graph import Graph
    g = Graph("chain")
    x = g.add_input("x", "float32", ["batch", *shape[1:]])
    y = g.add_input("y", "float32", ["batch", *shape[1:]])
    consts = [g.add_initializer(f"c{k}", (RNG.standard_normal(s) + 0.5).astype(np.float32))
              for k, s in enumerate(const_shapes)]
    h = g.op("Add", x, consts[0])
    h = g.op("Mul", h, y)
    h = g.op("Sub", h, consts[1 % len(consts)])
    side = g.op("Relu", h)                      # a second output from the middle of the chain
    h = g.op("Div", side, consts[-1])
    h = g.op("Max", h, g.op("Neg", y))
    h = g.op("Min", h, consts[0])
    h = g.op("Sqrt", g.op("Abs", h))
    g.outputs = [h, side]
    fused, plain = _load_both(g)
    assert [n.op for n in fused.graph.nodes] == ["FusedElementwise"]
    assert fused.plan.instructions[0].kernel.__qualname__.startswith("elementwise_kernel.")
    feeds = {"x": _special(shape), "y": (RNG.standard_normal(shape)).astype(np.float32)}
    got, want = fused.run(feeds), plain.run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
        assert np.array_equal(np.signbit(got[name]), np.signbit(want[name])), name


@needs_native
@pytest.mark.parametrize("bounds", [(0.0, 6.0), (-0.0, None), (None, 0.5), (2.0, -1.0), (np.nan, 1.0),
                                    (-1.0, np.nan), ((1,), (1,))])
def test_clip_joins_the_native_chains_bit_for_bit(bounds):
    """Clip with constant or omitted bounds (0-d or [1]; min above max; NaN bounds) joins a chain of the
    extension's ops and runs as its Max then Min: every output bit equals the unfused numpy kernels' (the IR's
    Clip is np.maximum then np.minimum), NaN, infinities and signed zeros included."""
    from kiln.ir.graph import Graph
    g = Graph("clip_chain")
    shape = (3, 2050)
    x = g.add_input("x", "float32", ["batch", shape[1]])
    args = []
    for k, b in enumerate(bounds):
        if b is None:
            args.append(None)
        elif isinstance(b, tuple):  # a one-element [1] bound, as exporters write them
            args.append(g.add_initializer(f"b{k}", np.array([0.25 if k == 0 else 0.75], np.float32)))
        else:
            args.append(g.add_initializer(f"b{k}", np.array(b, np.float32)))
    while args and args[-1] is None:
        args.pop()
    h = g.op("Mul", x, g.add_initializer("s", np.array(1.5, np.float32)))
    h = g.op("Clip", h, *args)
    g.outputs = [g.op("Add", h, x)]
    fused, plain = _load_both(g)
    assert [n.op for n in fused.graph.nodes] == ["FusedElementwise"]
    assert fused.plan.instructions[0].kernel.__qualname__.startswith("elementwise_kernel.")
    feeds = {"x": _special(shape)}
    got, want = fused.run(feeds), plain.run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
        assert np.array_equal(np.signbit(got[name]), np.signbit(want[name])), name


@needs_native
@pytest.mark.parametrize("op,ulps", [("Exp", 5), ("Sigmoid", 5), ("Tanh", 8)])
def test_transcendental_chain_ops_within_a_few_ulp_of_numpy(op, ulps):
    """Exp, Sigmoid and Tanh in a native chain (x * op(x), as SiLU is written, and op(-x)): NaN where the unfused
    numpy kernels give NaN, the same infinities, tanh's signed zeros kept, and within a few float32 ulp of the IR's
    reference (float64, rounded once) over every class of value, a tail shorter than the vectors and arguments up
    to exp's overflow bound included (tanh: onnxruntime's rational approximation, 6 ulp, and the product's)."""
    from kiln.ir.graph import Graph
    g = Graph("transcendental")
    x = g.add_input("x", "float32", ["n"])
    g.outputs = [g.op("Mul", x, g.op(op, x)), g.op(op, g.op("Neg", x))]
    fused, plain = _load_both(g)
    assert {n.op for n in fused.graph.nodes} == {"FusedElementwise"}  # two chains: one per output
    assert all(i.kernel.__qualname__.startswith("elementwise_kernel.") for i in fused.plan.instructions)
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1e-8, -1e-8, 0.6249, 0.625, -0.625, 44.0, -44.0,
               88.5, 88.7, 88.72, -88.7, 89.0, -87.5, -104.0, 200.0, -200.0, 1.0, -1.0]
    grid = np.concatenate([np.linspace(-30, 30, 4001), np.geomspace(1e-6, 88.7, 2000), -np.geomspace(1e-6, 88.7, 2000)])
    feeds = {"x": np.concatenate([special, grid, RNG.standard_normal(1003) * 4]).astype(np.float32)}
    got, numpy_kernels = fused.run(feeds, as_list=True), plain.run(feeds, as_list=True)
    for a, b, ref in zip(got, numpy_kernels, evaluate(g, feeds)):
        assert np.array_equal(np.isnan(a), np.isnan(b))
        inf = np.isinf(b)
        assert np.array_equal(a[inf], b[inf]) and np.array_equal(np.isinf(a), inf)  # the same infinities
        finite = np.isfinite(ref)
        err = np.abs(a[finite].astype(np.float64) - ref[finite].astype(np.float64))
        # a few ulp of the reference (the op's and the product's rounding), or 2e-36: exp flushes subnormal
        # results to 0, and x * exp(x) scales that by x (up to 104 here)
        allowed = np.maximum(ulps * np.spacing(np.abs(ref[finite]).astype(np.float32)), 2e-36)
        assert np.all(err <= allowed), (op, float((err / allowed).max()))
    if op == "Tanh":  # tanh(+-0) = +-0 inside the chain too
        z = fused.run({"x": np.array([0.0, -0.0], np.float32)}, as_list=True)[1]
        assert list(np.signbit(z)) == [True, False]


@needs_native
@pytest.mark.parametrize("op,reference,ulps", [("Exp", np.exp, 3), ("Sigmoid", lambda v: 1 / (1 + np.exp(-v)), 4),
                                               ("Tanh", np.tanh, 6)])
def test_transcendental_chain_ops_on_both_vector_widths(op, reference, ulps):
    """The chain's Exp, Sigmoid and Tanh on 8 lanes (what a CPU without AVX-512 runs: impl=1) and as this CPU runs
    them, each within a few ulp of float64 over every class of value, a tail shorter than a vector included."""
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 1e-8, -1e-8, 0.0004, 0.625, 7.9, 9.0, -9.0, 44.0, 88.5,
               88.72, 89.0, -87.0, -87.5, -104.0]
    x = np.concatenate([special, np.linspace(-20, 20, 8001), np.geomspace(1e-7, 88.7, 3001),
                        -np.geomspace(1e-7, 88.7, 3003)]).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = reference(x.astype(np.float64))
    prog = np.array([native.ELEMENTWISE[op][0], 1, 0, -1, 1], np.int32)
    for impl in (1, 0):
        out = np.empty_like(x)
        native._native.elementwise([x], [0], [x.size], [out], prog, 2, x.size, 1, impl)
        assert np.array_equal(np.isnan(out), np.isnan(ref)), impl
        finite = np.isfinite(ref) & (np.abs(ref) <= np.finfo(np.float32).max)
        assert np.array_equal(out[~finite & ~np.isnan(ref)], ref[~finite & ~np.isnan(ref)].astype(np.float32))
        err = np.abs(out[finite].astype(np.float64) - ref[finite])
        allowed = np.maximum(ulps * np.spacing(np.abs(ref[finite]).astype(np.float32)), 1.2e-38)
        assert np.all(err <= allowed), (impl, float((err / allowed).max()))


@needs_native
def test_fused_chains_with_a_per_channel_operand_take_the_nested_plan():
    """[1, C, 1, 1] under [N, C, H, W] is neither full, scalar nor a suffix: that call runs the nested plan,
    and answers as the unfused graph does."""
    from kiln.ir.graph import Graph
    g = Graph("per_channel")
    x = g.add_input("x", "float32", ["batch", 4, 5, 6])
    scale = g.add_initializer("s", RNG.standard_normal((1, 4, 1, 1)).astype(np.float32))
    g.outputs = [g.op("Relu", g.op("Mul", x, scale))]
    fused, plain = _load_both(g)
    assert [n.op for n in fused.graph.nodes] == ["FusedElementwise"]
    feeds = {"x": RNG.standard_normal((2, 4, 5, 6)).astype(np.float32)}
    np.testing.assert_array_equal(fused.run(feeds)[fused.outputs[0].name], plain.run(feeds)[plain.outputs[0].name])


@needs_native
def test_only_float32_chains_of_its_ops_are_fused_at_load():
    from kiln.ir.graph import Graph
    g = Graph("f64")
    x = g.add_input("x", "float64", [2, 3])
    g.outputs = [g.op("Relu", g.op("Add", x, x))]
    fused, _ = _load_both(g)
    assert [n.op for n in fused.graph.nodes] == ["FusedElementwise"]  # grouped, but not native: float64
    assert not fused.plan.instructions[0].kernel.__qualname__.startswith("elementwise_kernel.")
    np.testing.assert_array_equal(fused.run({"x": np.ones((2, 3))})[fused.outputs[0].name], np.full((2, 3), 2.0))
    h = Graph("exp")
    x = h.add_input("x", "float32", [2, 3])
    h.outputs = [h.op("Log", h.op("Add", x, x))]  # Log is not among the extension's ops: nothing fused
    assert [n.op for n in _load_both(h)[0].graph.nodes] == ["Add", "Log"]


@needs_native
@pytest.mark.parametrize("op,code,alpha,beta", [("HardSwish", 2, 1 / 6, 0.5), ("HardSigmoid", 3, 0.2, 0.5),
                                                ("HardSigmoid", 3, 0.3, 0.4)])
def test_standalone_activations_against_the_reference(op, code, alpha, beta):
    """HardSwish and HardSigmoid (not after a covered conv) in one native pass: within the op suite's tolerance of
    the float64 reference over every class of float32 value, NaN where the reference has NaN."""
    from kiln.ir.ops.activation import hard_sigmoid, hard_swish
    x = RNG.standard_normal(1000).astype(np.float32) * 5
    x[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3.0, -3.0, 1e-40]
    bits = RNG.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, bits])
    got = native.activation(x, code, alpha, beta)
    with np.errstate(invalid="ignore", over="ignore"):
        want = hard_swish(x) if op == "HardSwish" else hard_sigmoid(x, alpha=alpha, beta=beta)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])


@needs_native
@pytest.mark.parametrize("n,c,hw", [(1, 16, 56 * 56), (2, 3, 7), (4, 240, 196), (1, 1, 1)])
def test_global_average_pool_rows_against_float64(n, c, hw):
    x = (RNG.standard_normal((n, c, hw)) * 4 + 1).astype(np.float32)
    np.testing.assert_allclose(native.mean_rows(x.reshape(n * c, hw)), x.astype(np.float64).mean(2).reshape(-1),
                               rtol=1e-6, atol=1e-6)


@needs_native
def test_mul_by_a_factor_per_row_is_numpys_product():
    """Mul of [N, C, H, W] by [N, C, 1, 1] (either order; in place into the large operand) runs the native row
    scaling over threads: numpy's products bit for bit; other broadcasts, small tensors and other dtypes stay
    numpy's multiply."""
    from kiln.runtime.kernels.cpu import elementwise
    x = RNG.standard_normal((2, 24, 20, 36)).astype(np.float32)
    s = RNG.standard_normal((2, 24, 1, 1)).astype(np.float32)
    calls = []
    real = native._native

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def scale(self, *args):
            calls.append(args[3])
            return real.scale(*args)
    native._native, saved = Spy(), native._native
    try:
        want = x * s
        np.testing.assert_array_equal(elementwise._mul_scaling_rows(x, s), want)
        np.testing.assert_array_equal(elementwise._mul_scaling_rows(s, x), want)
        y = x.copy()
        assert elementwise._mul_scaling_rows(y, s, out=y) is y
        np.testing.assert_array_equal(y, want)
        assert calls == [720, 720, 720]  # a factor per row of 20 x 36
        s3 = RNG.standard_normal((2, 24, 20, 1)).astype(np.float32)  # a factor per row of 36
        np.testing.assert_array_equal(elementwise._mul_scaling_rows(x, s3), x * s3)
        assert calls[-1] == 36
        for other in (RNG.standard_normal((1, 24, 1, 1)).astype(np.float32),   # broadcast over the batch
                      RNG.standard_normal((24, 1, 1)).astype(np.float32),      # another rank
                      RNG.standard_normal((2, 24, 20, 36)).astype(np.float32)):  # no broadcast
            np.testing.assert_array_equal(elementwise._mul_scaling_rows(x, other), x * other)
        small = x[:1, :2, :4, :4].copy()
        np.testing.assert_array_equal(elementwise._mul_scaling_rows(small, s[:1, :2]), small * s[:1, :2])
        assert len(calls) == 4
    finally:
        native._native = saved
    g, feeds = build_single("Mul", [x, s], {}, symbolic_batch=True)
    np.testing.assert_array_equal(Program(g).run(feeds, as_list=True)[0], want)

"""The host side of the CUDA Resize kernels, without a GPU: runtime/kernels/cuda/resize.py is loaded
with CuPy replaced by numpy and each RawKernel by a numpy emulation of its CUDA source that also
checks every launch argument's C type (a Python int passed where the kernel takes an int32, or
arguments in the wrong order, would otherwise only show on the device). The kernels themselves are
compiled by NVRTC and run on a GPU by tests/runtime/test_cuda_resize.py."""
from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from kiln.ir.ops.resize import resize

ROOT = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(0)
I32, I64 = np.int32, np.int64


def _types(args, spec):
    assert len(args) == len(spec), f"{len(args)} arguments, the kernel takes {len(spec)}"
    for i, (a, want) in enumerate(zip(args, spec)):
        if want == "ptr":
            assert isinstance(a, np.ndarray), f"argument {i}: {type(a).__name__}, the kernel takes a pointer"
        else:
            assert type(a) is want, f"argument {i}: {type(a).__name__}, the kernel takes {want.__name__}"


class Kernel:
    """A numpy stand-in for one RawKernel, named as in the CUDA source."""

    def __init__(self, name: str, acc=None):
        self.name, self.acc = name, acc

    def __call__(self, grid, block, args):
        assert len(grid) == 1 and len(block) == 1 and grid[0] >= 1
        getattr(self, self.name)(*args)

    def kiln_resize_nearest(self, *args):
        word = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[args[0].dtype.itemsize]
        _types(args, ["ptr", "ptr", I64, I32, "ptr", "ptr", "ptr", "ptr", "ptr", I32, word])
        x, y, total, rank, out_shape, in_strides, table, offsets, outside, extrapolate, fill = args
        assert out_shape.dtype == np.int64 and in_strides.dtype == np.int64 and outside.dtype == np.uint8
        assert table.dtype == np.int32 and offsets.dtype == np.int32 and x.dtype == y.dtype == word
        coords = np.unravel_index(np.arange(total), tuple(out_shape))
        src = sum((c if offsets[d] < 0 else table[offsets[d] + c]) * in_strides[d] for d, c in enumerate(coords))
        out = np.zeros(total, bool)
        for d, c in enumerate(coords):
            if offsets[d] >= 0 and extrapolate:
                out |= outside[offsets[d] + c].astype(bool)
        y.reshape(-1)[:] = np.where(out, fill, x.reshape(-1)[src])

    def kiln_resize_2d(self, *args):
        _types(args, ["ptr", "ptr", I64] + [I32] * 6 + ["ptr"] * 6 + [I32, self.acc])
        x, y, total, h, w, oh, ow, th, tw, ih, wh, iw, ww, out_h, out_w, extrapolate, fill = args
        assert ih.dtype == iw.dtype == np.int32 and wh.dtype == ww.dtype == self.acc
        planes = x.reshape(-1, h, w).astype(self.acc)
        acc = np.zeros((len(planes), oh, ow), self.acc)
        for a in range(th):
            row = planes[:, ih.reshape(oh, th)[:, a], :]  # [p, oh, w]
            racc = np.zeros((len(planes), oh, ow), self.acc)
            for b in range(tw):
                racc += ww.reshape(ow, tw)[:, b] * row[:, :, iw.reshape(ow, tw)[:, b]]
            acc += wh.reshape(oh, th)[:, a][:, None] * racc
        if extrapolate:  # an axis without a mask gets a 1-element placeholder the kernel never reads
            if len(out_h) == oh:
                acc[:, out_h.astype(bool), :] = fill
            if len(out_w) == ow:
                acc[:, :, out_w.astype(bool)] = fill
        y.reshape(-1)[:] = acc.reshape(-1).astype(y.dtype)

    def kiln_resize_axis(self, *args):
        _types(args, ["ptr", "ptr", I64, I32, I32, I64, I32, "ptr", "ptr", "ptr", I32, self.acc])
        x, y, total, n_in, n_out, inner, taps, index, weight, outside, extrapolate, fill = args
        src = x.reshape(-1, n_in, int(inner)).astype(self.acc)
        idx, wt = index.reshape(n_out, taps), weight.reshape(n_out, taps)
        acc = sum(wt[:, t][None, :, None] * src[:, idx[:, t], :] for t in range(taps))
        if extrapolate:
            acc[:, outside.astype(bool)[:n_out], :] = fill
        assert acc.size == total
        y.reshape(-1)[:] = acc.reshape(-1).astype(y.dtype)


@pytest.fixture
def cuda_resize(monkeypatch):
    """runtime/kernels/cuda/resize.py on numpy: fake ``cupy`` and ``kiln.runtime.kernels.cuda``
    modules for the import, emulated kernels, everything restored afterwards."""
    fake = types.ModuleType("cupy")
    fake.asarray, fake.empty, fake.zeros = np.array, np.empty, np.zeros
    fake.ascontiguousarray = np.ascontiguousarray
    fake.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(attributes={"MultiProcessorCount": 4}))
    pkg = types.ModuleType("kiln.runtime.kernels.cuda")
    registry = {}

    def kernel(*ops, host=()):
        def deco(f):
            registry[ops[0]] = (f, host)
            return f
        return deco

    pkg.kernel = kernel
    pkg.host = lambda v: v
    pkg.in_dtype = lambda node, i=0: np.dtype(node.inputs[i].type.dtype.numpy)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "kiln.runtime.kernels.cuda", pkg)
    spec = importlib.util.spec_from_file_location("kiln_cuda_resize_on_numpy", ROOT / "runtime/kernels/cuda/resize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def compile_(source, name):
        acc = np.float64 if "#define ACC double" in source else np.float32
        assert f"void {name}(" in source
        return Kernel(name, acc)

    monkeypatch.setattr(mod, "_compile", compile_)
    assert registry["Resize"][1] == (1, 2, 3)
    return mod


def _node(x, attrs, roi, scales, sizes):
    from op_harness import build_single
    inputs = [x, roi, scales, sizes]
    while inputs[-1] is None:
        inputs.pop()
    g, _ = build_single("Resize", inputs, attrs, const_inputs=(1, 2, 3))
    return g.nodes[0]


CASES = [dict(mode="nearest", coordinate_transformation_mode=c, nearest_mode=r)
         for c, r in itertools.product(["asymmetric", "half_pixel"], ["floor", "round_prefer_ceil"])]
CASES += [dict(mode=m, antialias=a, exclude_outside=e) for m, a, e in itertools.product(["linear", "cubic"], [0, 1],
                                                                                        [0, 1])]


@pytest.mark.parametrize("attrs", CASES, ids=lambda a: "-".join(str(v) for v in a.values()))
@pytest.mark.parametrize("shape,scales", [((2, 3, 9, 7), [1, 1, 2, 0.6]), ((1, 2, 4, 5, 6), [1, 1, 2, 1.5, 0.5]),
                                          ((4, 3, 5), [0.5, 1, 3]), ((1, 1, 64, 40), [1, 1, 0.125, 0.2])])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_host_side_against_reference(cuda_resize, attrs, shape, scales, dtype):
    x = RNG.standard_normal(shape).astype(dtype)
    s = np.array(scales, np.float32)
    run = cuda_resize.resize(_node(x, attrs, None, s, None), dict(attrs))
    got = run(x, None, s, None)
    want = resize(x, None, s, None, **attrs)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


def test_paths_chosen(cuda_resize):
    x = RNG.standard_normal((1, 2, 8, 8)).astype(np.float32)
    for attrs, scales, path in [({"mode": "linear"}, [1, 1, 2, 2], "2d"), ({"mode": "nearest"}, [1, 1, 2, 2], "nearest"),
                                ({"mode": "cubic", "antialias": 1}, [1, 1, 0.125, 0.125], "axis")]:
        s = np.array(scales, np.float32)
        before = dict(cuda_resize.LAUNCHES)
        cuda_resize.resize(_node(x, attrs, None, s, None), dict(attrs))(x, None, s, None)
        assert cuda_resize.LAUNCHES[path] > before[path]


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_tf_crop_and_resize_and_sizes(cuda_resize, mode):
    x = RNG.standard_normal((1, 2, 9, 7)).astype(np.float32)
    roi = np.array([0, 0, -0.3, 0.2, 1, 1, 1.2, 0.9], np.float32)
    sizes = np.array([1, 2, 8, 5], np.int64)
    attrs = dict(mode=mode, coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=4.0)
    got = cuda_resize.resize(_node(x, attrs, roi, None, sizes), dict(attrs))(x, roi, None, sizes)
    np.testing.assert_allclose(got, resize(x, roi, None, sizes, **attrs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.uint8, np.int64])
def test_integer_nearest_and_integer_linear_falls_back(cuda_resize, dtype):
    x = RNG.integers(0, 100, (1, 2, 5, 6)).astype(dtype)
    s = np.array([1, 1, 2, 1.5], np.float32)
    run = cuda_resize.resize(_node(x, {"mode": "nearest"}, None, s, None), {"mode": "nearest"})
    np.testing.assert_array_equal(run(x, None, s, None), resize(x, None, s, None, mode="nearest"))
    assert cuda_resize.resize(_node(x, {"mode": "linear"}, None, s, None), {"mode": "linear"}) is None

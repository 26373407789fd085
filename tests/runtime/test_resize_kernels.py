"""The CPU Resize kernel (runtime/kernels/cpu/resize.py) against the op's reference: periodic
phases, gathered edges and non-periodic axes, blocks of planes, every mode, dtypes, parameters
computed at run time, and the shape cache."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

import kiln
from kiln.ir import Graph, evaluate
from kiln.ir.ops.resize import DEFAULTS, resize, resize_plan
from kiln.ir.passes.shape_inference import infer_shapes
from kiln.runtime.kernels.cpu import resize as cpu_resize

RNG = np.random.default_rng(0)


def run_kernel(x, roi=None, scales=None, sizes=None, **attrs):
    attrs = {**DEFAULTS, **attrs}
    prog = cpu_resize.compile_plan(resize_plan(x.shape, roi, scales, sizes, attrs), x.shape, x.dtype)
    return cpu_resize.run_program(prog, x, attrs["extrapolation_value"]), prog


def close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-2 if np.dtype(dtype).itemsize == 2 else 1e-5
    if np.dtype(dtype).kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


MODES = [dict(mode="nearest", coordinate_transformation_mode=c, nearest_mode=r)
         for c, r in itertools.product(["asymmetric", "half_pixel", "align_corners"], ["floor", "round_prefer_ceil"])]
MODES += [dict(mode=m, coordinate_transformation_mode=c, antialias=a, exclude_outside=e)
          for m, c, a, e in itertools.product(["linear", "cubic"], ["half_pixel", "align_corners", "pytorch_half_pixel"],
                                              [0, 1], [0, 1])]


@pytest.mark.parametrize("attrs", MODES, ids=["-".join(str(v) for v in m.values()) for m in MODES])
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 0.5, 0.5], [1, 1, 1.5, 3], [1, 1, 0.37, 1.13],
                                    [1, 2, 1, 1]])
def test_kernel_matches_reference(attrs, scales):
    x = RNG.standard_normal((2, 3, 24, 20)).astype(np.float32)
    s = np.array(scales, np.float32)
    got, _ = run_kernel(x, None, s, None, **attrs)
    close(got, resize(x, None, s, None, **attrs), np.float32)


def test_periodic_axes_use_phases_and_others_gather():
    x = RNG.standard_normal((1, 2, 16, 16)).astype(np.float32)
    _, prog = run_kernel(x, scales=np.array([1, 1, 2, 1.5], np.float32), mode="linear")
    for ax in prog.axes:
        assert ax.phases, "x2 and x1.5 repeat every 2 and 3 outputs"
        assert ax.rest is None  # the clamped edges are one-output phases too
        assert sum(p.count for p in ax.phases) == ax.out_size
    _, prog = run_kernel(x, sizes=np.array([1, 2, 16, 31], np.int64), mode="linear")
    assert not prog.axes[0].phases and len(prog.axes[0].rest) == 31  # 31/16 has no short period


def test_blocks_of_planes(monkeypatch):
    monkeypatch.setattr(cpu_resize, "BLOCK_BYTES", 512)
    x = RNG.standard_normal((3, 5, 8, 9)).astype(np.float32)
    for attrs in ({"mode": "linear"}, {"mode": "cubic", "antialias": 1}, {"mode": "nearest"}):
        s = np.array([1, 1, 1.75, 0.5], np.float32)
        got, prog = run_kernel(x, None, s, None, **attrs)
        assert prog.block < 15
        close(got, resize(x, None, s, None, **attrs), np.float32)


def test_leading_axis_resize_and_axes_attribute():
    x = RNG.standard_normal((4, 3, 5)).astype(np.float32)
    for attrs, s in (({"mode": "linear"}, np.array([2, 1, 0.5], np.float32)),
                     ({"mode": "nearest", "axes": [0, 2]}, np.array([0.5, 3], np.float32))):
        got, prog = run_kernel(x, None, s, None, **attrs)
        assert prog.lead == 0
        close(got, resize(x, None, s, None, **attrs), np.float32)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.uint8, np.int32])
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_dtypes_through_the_runtime(dtype, mode):
    x = (RNG.standard_normal((1, 2, 7, 6)) * 30 + 100).astype(dtype)
    g = Graph("t")
    xi = g.add_input("x", x.dtype, ["n", 2, 7, 6])
    s = g.add_initializer("s", np.array([1, 1, 1.5, 0.5], np.float32))
    g.outputs = list(g.add_node("Resize", [xi, None, s], {"mode": mode}).outputs)
    infer_shapes(g)
    close(kiln.load(g).run([x], as_list=True)[0], evaluate(g, [x])[0], dtype)


def test_computed_sizes_and_the_shape_cache():
    g = Graph("t")
    x = g.add_input("x", "float32", ["n", 2, "h", "w"])
    ref = g.add_input("ref", "float32", ["n", 1, "H", "W"])
    hw = g.add_node("Shape", [ref], {"start": 2}).outputs[0]
    g.outputs = list(g.add_node("Resize", [x, None, None, hw], {"mode": "linear", "axes": [2, 3]}).outputs)
    infer_shapes(g)
    prog = kiln.load(g)
    for shape, target in [((1, 2, 4, 5), (9, 3)), ((2, 2, 6, 6), (12, 12)), ((1, 2, 4, 5), (2, 11))]:
        xs = RNG.standard_normal(shape).astype(np.float32)
        rs = np.zeros((shape[0], 1) + target, np.float32)
        close(prog.run([xs, rs], as_list=True)[0], evaluate(g, [xs, rs])[0], np.float32)


def test_tf_crop_and_resize_extrapolates():
    x = RNG.standard_normal((1, 1, 6, 6)).astype(np.float32)
    roi = np.array([0, 0, -0.3, 0.2, 1, 1, 1.2, 0.9], np.float32)
    attrs = dict(mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=9.0)
    got, _ = run_kernel(x, roi, None, np.array([1, 1, 8, 7], np.int64), **attrs)
    close(got, resize(x, roi, None, np.array([1, 1, 8, 7], np.int64), **attrs), np.float32)
    assert (got == 9.0).any()


@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.sampled_from(["nearest", "linear", "cubic"]),
       st.sampled_from([0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0]), st.integers(0, 1), st.integers(0, 2**31 - 1))
def test_hypothesis(shape, mode, scale, aa, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    s = np.array([scale if int(scale * d) >= 1 else 1.0 for d in shape], np.float32)
    attrs = {"mode": mode, "antialias": aa if mode != "nearest" else 0}
    got, _ = run_kernel(x, None, s, None, **attrs)
    close(got, resize(x, None, s, None, **attrs), np.float32)

"""The CUDA Resize kernels (runtime/kernels/cuda/resize.py) against the op's reference, on a GPU.

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module): on the device machine,
``python -m pytest tests/runtime/test_cuda_resize.py``. The host side of the same kernels (tables,
launch arguments) is also checked without a GPU by tests/runtime/test_cuda_resize_host.py."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()

from kiln.ir import evaluate  # noqa: E402
from kiln.runtime.cuda_program import CudaProgram  # noqa: E402
from kiln.runtime.kernels.cuda import resize as cuda_resize  # noqa: E402
from op_harness import build_single  # noqa: E402

RNG = np.random.default_rng(0)
TOL = {np.float32: (2e-5, 2e-6), np.float64: (1e-12, 1e-12), np.float16: (2e-2, 2e-2)}


def _run(x, roi=None, scales=None, sizes=None, dtype=np.float32, cuda_graphs=False, **attrs):
    x = x.astype(dtype)
    inputs = [x, roi, scales, sizes]
    while inputs[-1] is None:
        inputs.pop()
    g, feeds = build_single("Resize", inputs, attrs, const_inputs=(1, 2, 3))
    want = evaluate(g, feeds)[0]
    p = CudaProgram(g, output="numpy", cuda_graphs=cuda_graphs)
    got = p.run(feeds, as_list=True)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind == "f":
        rtol, atol = TOL[np.dtype(dtype).type]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)
    else:
        np.testing.assert_array_equal(got, want)
    assert p.fallback_ops == {}, p.fallback_ops
    return p


NEAREST = [dict(mode="nearest", coordinate_transformation_mode=c, nearest_mode=r) for c, r in itertools.product(
    ["asymmetric", "half_pixel", "align_corners", "pytorch_half_pixel", "half_pixel_symmetric"],
    ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])]
INTERP = [dict(mode=m, coordinate_transformation_mode=c, antialias=a, exclude_outside=e) for m, c, a, e in
          itertools.product(["linear", "cubic"], ["half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"],
                            [0, 1], [0, 1])]


@pytest.mark.parametrize("attrs", NEAREST + INTERP, ids=lambda a: "-".join(str(v) for v in a.values()))
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 0.5, 0.6], [1, 1, 1.7, 3.0]])
def test_modes_float32(attrs, scales):
    _run(RNG.standard_normal((2, 3, 11, 9)), scales=np.array(scales, np.float32), **attrs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("attrs", [dict(mode="nearest"), dict(mode="linear"), dict(mode="cubic"),
                                   dict(mode="linear", antialias=1)])
def test_dtypes(dtype, attrs):
    _run(RNG.standard_normal((1, 4, 16, 12)), scales=np.array([1, 1, 0.75, 2.5], np.float32), dtype=dtype, **attrs)


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64])
def test_integer_nearest_moves_words(dtype):
    x = RNG.integers(0, 200, (1, 3, 5, 7))
    _run(x, scales=np.array([1, 1, 2, 1.5], np.float32), dtype=dtype, mode="nearest")


def test_paths_direct_2d_and_per_axis():
    before = dict(cuda_resize.LAUNCHES)
    _run(RNG.standard_normal((2, 3, 8, 8)), scales=np.array([1, 1, 2, 2], np.float32), mode="linear")
    assert cuda_resize.LAUNCHES["2d"] == before["2d"] + 1
    before = dict(cuda_resize.LAUNCHES)
    _run(RNG.standard_normal((1, 2, 4, 6, 8)), scales=np.array([1, 1, 2, 1.5, 0.5], np.float32), mode="linear")
    assert cuda_resize.LAUNCHES["axis"] == before["axis"] + 3  # trilinear: one pass per axis
    before = dict(cuda_resize.LAUNCHES)
    _run(RNG.standard_normal((1, 2, 64, 64)), scales=np.array([1, 1, 0.125, 0.125], np.float32), mode="cubic",
         antialias=1)  # 32 x 32 taps: too many for one pass
    assert cuda_resize.LAUNCHES["axis"] == before["axis"] + 2
    before = dict(cuda_resize.LAUNCHES)
    _run(RNG.standard_normal((4, 3, 5)), scales=np.array([0.5, 1, 3], np.float32), mode="linear")
    assert cuda_resize.LAUNCHES["axis"] == before["axis"] + 2


def test_sizes_axes_policy_and_tf_crop_and_resize():
    x = RNG.standard_normal((1, 2, 9, 7))
    _run(x, sizes=np.array([5, 12], np.int64), mode="linear", axes=[3, 2], keep_aspect_ratio_policy="not_smaller")
    roi = np.array([0, 0, -0.3, 0.2, 1, 1, 1.2, 0.9], np.float32)
    for mode in ("nearest", "linear", "cubic"):
        _run(x, roi=roi, sizes=np.array([1, 2, 8, 5], np.int64), mode=mode,
             coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=4.0)
    _run(RNG.standard_normal((1, 2, 4, 5, 6)), roi=roi[[0, 1, 2, 3, 3, 4, 5, 6, 7, 7]],
         sizes=np.array([1, 2, 6, 3, 4], np.int64), mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
         extrapolation_value=-1.0)


def test_computed_sizes_and_cuda_graphs():
    from kiln.ir import Graph
    from kiln.ir.passes.shape_inference import infer_shapes
    g = Graph("t")
    x = g.add_input("x", "float32", ["n", 3, "h", "w"])
    ref = g.add_input("ref", "float32", ["n", 1, "H", "W"])
    hw = g.add_node("Shape", [ref], {"start": 2}).outputs[0]
    y = g.add_node("Resize", [x, None, None, hw], {"mode": "linear", "axes": [2, 3]}).outputs[0]
    g.outputs = [g.add_node("Relu", [y]).outputs[0]]
    infer_shapes(g)
    p = CudaProgram(g, output="numpy", cuda_graphs=True)
    for shape, target in [((2, 3, 8, 8), (16, 16)), ((1, 3, 5, 7), (9, 4)), ((2, 3, 8, 8), (16, 16))]:
        xs = RNG.standard_normal(shape).astype(np.float32)
        rs = np.zeros((shape[0], 1) + target, np.float32)
        np.testing.assert_allclose(p.run([xs, rs], as_list=True)[0], evaluate(g, [xs, rs])[0], rtol=2e-5, atol=2e-6)
    assert p.fallback_ops == {}


def test_unet_like_model_on_the_gpu():
    torch = pytest.importorskip("torch")
    import kiln
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Upsample(scale_factor=2, mode="bilinear"),
                          nn.Conv2d(8, 4, 3, padding=1), nn.Upsample(scale_factor=2)).eval()
    x = torch.randn(2, 3, 16, 16)
    g = kiln.trace(model, x, dynamic_batch=True)
    got = kiln.load(g, device="cuda").run([x.numpy()], as_list=True)[0]
    got = got.get() if hasattr(got, "get") else got
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

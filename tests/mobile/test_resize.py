"""Resize in the mobile op set: the stub's kernel against kiln's CPU runtime mode by mode, and a
segmentation-style model (conv encoder, nn.Upsample decoder, skip concat) that `kiln mobile
check` accepts and `pack` + the stub run as the CPU runtime does."""
from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.ir.graph import Graph
from kiln.ir.passes import infer_shapes
from kiln.mobile_stub import check, opset, runtime
from kiln.mobile_stub.pack import pack

RNG = np.random.default_rng(0)


def _graph(attrs, x_shape, roi=None, scales=None, sizes=None, dtype="float32"):
    g = Graph("t")
    x = g.add_input("x", dtype, x_shape)
    ins = [x] + [None if a is None else g.add_initializer(f"c{k}", np.asarray(a))
                 for k, a in enumerate((roi, scales, sizes))]
    while ins[-1] is None:
        ins.pop()
    g.outputs = list(g.add_node("Resize", ins, attrs).outputs)
    infer_shapes(g)
    return g


def _compare(g, tmp_path, x):
    path = str(tmp_path / "m.kiln")
    kiln.save(pack(g), path)
    stub = runtime.load(path)
    got = stub.run(x)[0]
    want = kiln.load(path).run([x], as_list=True)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(got, want)


S = np.array([1, 1, 1.7, 0.6], np.float32)
CASES = [
    ({"mode": "nearest"}, dict(scales=np.array([1, 1, 2, 2], np.float32))),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, dict(scales=S)),
    ({"mode": "nearest", "nearest_mode": "ceil", "coordinate_transformation_mode": "align_corners"},
     dict(sizes=np.array([1, 2, 9, 4], np.int64))),
    ({"mode": "linear"}, dict(scales=S)),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, dict(sizes=np.array([1, 2, 9, 4]))),
    ({"mode": "linear", "antialias": 1, "axes": [2, 3]}, dict(sizes=np.array([3, 2]))),
    ({"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, dict(scales=S)),
    ({"mode": "cubic", "antialias": 1, "coordinate_transformation_mode": "pytorch_half_pixel"}, dict(scales=S)),
    ({"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}, dict(scales=S)),
    ({"mode": "linear", "keep_aspect_ratio_policy": "not_smaller", "axes": [2, 3]}, dict(sizes=np.array([8, 3]))),
    ({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 2.0},
     dict(roi=np.array([0, 0, -0.25, 0.1, 1, 1, 0.75, 1.3], np.float32), sizes=np.array([1, 2, 6, 6]))),
]


@pytest.mark.parametrize("attrs,inputs", CASES, ids=[str(c[0]) for c in CASES])
def test_stub_matches_cpu_runtime(attrs, inputs, tmp_path):
    inputs = {k: (np.asarray(v, np.int64) if k == "sizes" else v) for k, v in inputs.items()}
    g = _graph(attrs, (1, 2, 5, 7), **inputs)
    _compare(g, tmp_path, RNG.standard_normal((1, 2, 5, 7)).astype(np.float32))


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_uint8_images(mode, tmp_path):
    g = _graph({"mode": mode}, (1, 3, 6, 6), scales=np.array([1, 1, 1.5, 0.5], np.float32), dtype="uint8")
    _compare(g, tmp_path, RNG.integers(0, 256, (1, 3, 6, 6)).astype(np.uint8))


def test_resize_is_declared():
    assert {"Resize:float32", "Resize:uint8", "Resize:int8"} <= set(opset.declared())


def test_segmentation_model_checks_packs_and_runs(tmp_path):
    torch = pytest.importorskip("torch")
    nn, F = torch.nn, torch.nn.functional

    class Seg(nn.Module):  # an FCN/DeepLab-style head: downsample, classify, upsample to the input
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                                     nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            self.fuse = nn.Conv2d(16 + 8, 8, 1)
            self.cls = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            e1 = self.enc[1](self.enc[0](x))
            e2 = self.enc[3](self.enc[2](e1))
            d = self.fuse(torch.cat([self.up(e2), e1], 1))
            return F.interpolate(self.cls(d), size=x.shape[2:], mode="nearest")

    torch.manual_seed(0)
    # check=False: the model itself needs sizes divisible by 4 (its skip would not line up).
    g = kiln.trace(Seg().eval(), torch.randn(1, 3, 32, 32), dynamic={"x": {0: "batch", 2: "h", 3: "w"}},
                   check=False)
    path = str(tmp_path / "seg.kiln")
    kiln.save(g, path)
    assert check.check(path, {"batch": 1, "h": 32, "w": 48}) == []
    packed = str(tmp_path / "seg.mobile.kiln")
    kiln.save(pack(path, dims={"batch": 1, "h": 32, "w": 48}), packed)
    stub = runtime.load(packed)
    assert "Resize:float32" in stub.manifest
    x = RNG.standard_normal((1, 3, 32, 48)).astype(np.float32)
    np.testing.assert_allclose(stub.run(x)[0], kiln.load(path).run([x], as_list=True)[0], rtol=1e-5, atol=1e-5)


def test_bundle_ships_the_resize_family(tmp_path):
    from kiln.mobile_stub.bundle import bundle
    g = _graph({"mode": "cubic"}, (1, 3, 8, 8), scales=np.array([1, 1, 2, 1.5], np.float32))
    path = str(tmp_path / "m.kiln")
    kiln.save(pack(g), path)
    report = bundle(path, str(tmp_path / "m.pyz"))  # also loads the .pyz once in a child process
    assert "resize" in report.kernels

"""Tracing F.interpolate / nn.Upsample* against torch eager: every mode torch has, align_corners,
scale_factor or size, recompute_scale_factor, antialias; dynamic batch and spatial sizes at
several run-time sizes; symbolic sizes kept; a small U-Net traced, saved, loaded, run and
exported to ONNX."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from frontend_helpers import check_traced, op_types  # noqa: E402

import kiln  # noqa: E402
from kiln import UnsupportedOpError  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-5)
# torch maps coordinates in float32 (kiln in float64): at a few hundred pixels that alone moves
# an interpolated value by 1e-5.
TOL_BIG = dict(rtol=1e-4, atol=1e-4)
DYN = {"x": {0: "batch", 2: "h", 3: "w"}}


def _r(*shape):
    return torch.randn(*shape)


MODES_2D = [("nearest", None, False), ("nearest-exact", None, False), ("bilinear", False, False),
            ("bilinear", True, False), ("bicubic", False, False), ("bicubic", True, False),
            ("bilinear", False, True), ("bicubic", False, True), ("bilinear", True, True),
            ("bicubic", True, True), ("area", None, False)]
SIZES = [dict(scale_factor=2), dict(scale_factor=0.5), dict(scale_factor=1.5), dict(scale_factor=(0.7, 3)),
         dict(size=(5, 11)), dict(size=3), dict(scale_factor=0.4, recompute_scale_factor=True)]


@pytest.mark.parametrize("mode,align,aa", MODES_2D, ids=[f"{m}-ac{a}-aa{b}" for m, a, b in MODES_2D])
@pytest.mark.parametrize("how", SIZES, ids=[str(s) for s in SIZES])
def test_every_2d_mode_static(mode, align, aa, how):
    fn = lambda x: F.interpolate(x, mode=mode, align_corners=align, antialias=aa, **how)  # noqa: E731
    check_traced(fn, (_r(2, 3, 9, 10),), **TOL)


@pytest.mark.parametrize("mode,align", [("nearest", None), ("nearest-exact", None), ("linear", False),
                                        ("linear", True), ("area", None)])
@pytest.mark.parametrize("how", [dict(scale_factor=2.5), dict(size=4), dict(scale_factor=0.3)])
def test_1d_modes(mode, align, how):
    check_traced(lambda x: F.interpolate(x, mode=mode, align_corners=align, **how), (_r(2, 3, 13),), **TOL)


@pytest.mark.parametrize("mode,align", [("nearest", None), ("nearest-exact", None), ("trilinear", False),
                                        ("trilinear", True), ("area", None)])
@pytest.mark.parametrize("how", [dict(scale_factor=(2, 1.5, 0.5)), dict(size=(3, 4, 7))])
def test_3d_modes(mode, align, how):
    check_traced(lambda x: F.interpolate(x, mode=mode, align_corners=align, **how), (_r(1, 2, 4, 6, 8),), **TOL)


def test_lanczos_when_torch_has_it():
    if not hasattr(torch._C._nn, "_upsample_lanczos2d_aa"):
        pytest.skip("this torch has no lanczos mode")
    g = check_traced(lambda x: F.interpolate(x, size=(5, 13), mode="lanczos", antialias=True), (_r(1, 2, 9, 7),),
                     **TOL)
    assert "MatMul" in op_types(g)


def test_modules():
    m = nn.Sequential(nn.Upsample(scale_factor=2), nn.UpsamplingBilinear2d(scale_factor=1.5),
                      nn.UpsamplingNearest2d(size=(7, 5)), nn.Upsample(size=(9, 9), mode="bicubic"),
                      nn.Upsample(scale_factor=0.5, mode="bilinear", align_corners=True))
    g = check_traced(m, (_r(2, 3, 6, 4),), dynamic_batch=True, other_inputs=[(_r(1, 3, 6, 4),)], **TOL)
    assert op_types(g).count("Resize") == 5


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_deprecated_functional_forms():
    check_traced(lambda x: F.upsample(x, scale_factor=3, mode="bilinear"), (_r(1, 2, 4, 4),), **TOL)
    check_traced(lambda x: F.upsample_nearest(x, size=(6, 7)), (_r(1, 2, 4, 4),), **TOL)
    check_traced(lambda x: F.upsample_bilinear(x, scale_factor=2), (_r(1, 2, 4, 4),), **TOL)


def test_torch_kernels_called_directly():
    nn_ = torch._C._nn
    check_traced(lambda x: nn_.upsample_nearest2d(x, [7, 5]), (_r(1, 2, 4, 4),), **TOL)
    check_traced(lambda x: nn_.upsample_bilinear2d(x, None, True, [2.0, 1.5]), (_r(1, 2, 4, 4),), **TOL)
    check_traced(lambda x: nn_.upsample_bicubic2d(x, [6, 9], False), (_r(1, 2, 4, 4),), **TOL)


# ---------------------------------------------------------------------------- dynamic sizes
# (Not an output width of 1 with antialias: torch 2.13 then repeats the first row; see docs/NOTES.md.)
OTHERS = [(_r(1, 3, 13, 7),), (_r(3, 3, 5, 21),), (_r(2, 3, 3, 4),), (_r(1, 3, 64, 48),)]


@pytest.mark.parametrize("mode,align,aa", [("nearest", None, False), ("nearest-exact", None, False),
                                           ("bilinear", False, False), ("bilinear", True, False),
                                           ("bicubic", False, False), ("bilinear", False, True)])
@pytest.mark.parametrize("how", [dict(scale_factor=2), dict(scale_factor=0.5), dict(scale_factor=1.5),
                                 dict(scale_factor=0.7), dict(scale_factor=3, recompute_scale_factor=True)])
def test_scale_factor_on_symbolic_sizes(mode, align, aa, how):
    fn = lambda x: F.interpolate(x, mode=mode, align_corners=align, antialias=aa, **how)  # noqa: E731
    if mode.startswith("nearest") and how == dict(scale_factor=0.7):
        # torch's float32 index rule for 1/0.7 differs from Resize's at some sizes: refused, not wrong.
        with pytest.raises(UnsupportedOpError, match="index rule differs"):
            kiln.trace(fn, _r(2, 3, 9, 10), dynamic=DYN, check=False)
        return
    g = check_traced(fn, (_r(2, 3, 9, 10),), dynamic=DYN, other_inputs=OTHERS, **TOL_BIG)
    assert g.outputs[0].type.shape[:2] == ("batch", 3)


def test_non_float32_factor_slices_to_torchs_size():
    # floor(in * 0.7) in double; float32(0.7) < 0.7, so a rounded-up scale and a run-time slice.
    fn = lambda x: F.interpolate(x, scale_factor=0.7, mode="bilinear")  # noqa: E731
    sizes = [(_r(1, 3, n, n + 3),) for n in (10, 20, 30, 100)]
    g = check_traced(fn, (_r(2, 3, 9, 10),), dynamic=DYN, other_inputs=sizes, **TOL_BIG)
    assert "Slice" in op_types(g)


def test_size_from_another_tensor_stays_symbolic():
    fn = lambda x, skip: torch.cat([F.interpolate(x, size=skip.shape[2:], mode="bilinear"), skip], 1)  # noqa: E731
    dyn = {"x": {0: "b", 2: "h", 3: "w"}, "skip": {0: "b", 2: "H", 3: "W"}}
    g = check_traced(fn, (_r(2, 4, 5, 6), _r(2, 2, 10, 12)), dynamic=dyn,
                     other_inputs=[(_r(1, 4, 7, 3), _r(1, 2, 15, 5))], **TOL)
    assert g.outputs[0].type.shape == ("b", 6, "H", "W")


def test_size_arithmetic_on_symbolic_dims():
    fn = lambda x: F.interpolate(x, size=(x.shape[2] * 2, x.shape[3] + 3), mode="nearest")  # noqa: E731
    check_traced(fn, (_r(2, 3, 5, 6),), dynamic=DYN, other_inputs=OTHERS[:2], **TOL)


def test_area_and_lanczos_need_static_sizes():
    with pytest.raises(UnsupportedOpError, match="static spatial sizes"):
        kiln.trace(lambda x: F.interpolate(x, size=(3, 3), mode="area"), _r(1, 2, 6, 6), dynamic=DYN, check=False)
    with pytest.raises(UnsupportedOpError, match="static spatial sizes"):
        kiln.trace(lambda x: F.interpolate(x, size=(3, 3), mode="bilinear", antialias=True, align_corners=True),
                   _r(1, 2, 6, 6), dynamic=DYN, check=False)


def test_nearest_index_rule_mismatch_becomes_a_gather():
    # torch rounds 1/0.4 through float32 differently from Resize's float64 x / 0.4f.
    g = check_traced(lambda x: F.interpolate(x, scale_factor=0.4), (_r(1, 2, 12, 12),), **TOL)
    assert "Gather" in op_types(g) and "Resize" not in op_types(g)


def test_integer_linear_is_refused():
    x = (torch.rand(1, 1, 4, 4) * 255).to(torch.uint8)
    g = check_traced(lambda x: F.interpolate(x, scale_factor=2), (x,))
    assert "Resize" in op_types(g)
    with pytest.raises(UnsupportedOpError, match="fixed point"):
        kiln.trace(lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True), x, check=False)


# ---------------------------------------------------------------------------- a U-Net
class UNet(nn.Module):
    """Two down steps, two up steps: nearest and bilinear upsampling, skip concatenations, and an
    F.interpolate to the input's own (symbolic) size at the end."""

    def __init__(self, c: int = 8):
        super().__init__()
        block = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.ReLU())  # noqa: E731
        self.enc1, self.enc2, self.mid = block(3, c), block(c, 2 * c), block(2 * c, 2 * c)
        self.up1 = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec1 = block(4 * c, c)
        self.up2 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec2 = block(2 * c, c)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d1 = self.dec1(torch.cat([self.up1(m), e2], 1))
        d2 = self.dec2(torch.cat([self.up2(d1), e1], 1))
        return F.interpolate(self.head(d2), size=x.shape[2:], mode="bilinear", align_corners=True)


def test_unet_trace_save_load_run_and_onnx(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = UNet().eval()
    x = _r(2, 3, 16, 24)
    # The model itself needs sizes divisible by 4 (its skips would not line up): checked below.
    g = kiln.trace(model, x, dynamic=DYN, check=False)
    assert op_types(g).count("Resize") == 3
    path = tmp_path / "unet.kiln"
    kiln.save(g, path)
    prog = kiln.load(path)
    for shape in [(2, 3, 16, 24), (1, 3, 32, 8), (3, 3, 8, 40)]:
        xi = _r(*shape)
        with torch.no_grad():
            want = model(xi).numpy()
        got = prog.run({"x": xi.numpy()}, as_list=True)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert got.shape == want.shape
    onnx_path = tmp_path / "unet.onnx"
    kiln.export_onnx(g, onnx_path)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    for shape in [(2, 3, 16, 24), (1, 3, 32, 8)]:
        xi = _r(*shape)
        want = prog.run({"x": xi.numpy()}, as_list=True)[0]
        got = sess.run(None, {"x": xi.numpy()})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

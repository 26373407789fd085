"""Tracing conv / pool layers, F.pad and pixel shuffles against torch eager, with a dynamic batch
checked at a second batch size."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from frontend_helpers import check_traced, op_types  # noqa: E402
from kiln import UnsupportedOpError  # noqa: E402

import kiln  # noqa: E402


def _r(*shape):
    return torch.randn(*shape)


def _check_batches(m, shape, *, rtol=1e-5, atol=1e-5):
    """Trace ``m`` on a batch of 2 with a dynamic batch; compare at batch 2 and 3."""
    return check_traced(m.eval() if isinstance(m, nn.Module) else m, (_r(2, *shape),), dynamic_batch=True,
                        other_inputs=[(_r(3, *shape),)], rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- convolutions
@pytest.mark.parametrize("kwargs", [
    {}, {"stride": 2}, {"padding": 1}, {"padding": (1, 2), "stride": (2, 1)}, {"padding": "same"},
    {"padding": "same", "dilation": 2}, {"padding": "valid"}, {"dilation": (2, 1), "padding": 2},
    {"groups": 2}, {"bias": False}, {"padding": 1, "padding_mode": "reflect"},
    {"padding": 1, "padding_mode": "replicate"}, {"padding": 1, "padding_mode": "circular"},
])
def test_conv2d_module(kwargs):
    kernel = 4 if kwargs.get("padding") == "same" else 3  # an even kernel pads 'same' unevenly
    g = _check_batches(nn.Conv2d(4, 6, kernel, **kwargs), (4, 9, 8))
    assert "Conv" in op_types(g)


@pytest.mark.parametrize("kwargs", [{}, {"stride": 2, "padding": 2}, {"padding": "same"}, {"groups": 3},
                                    {"dilation": 2, "bias": False}])
def test_conv1d_module(kwargs):
    _check_batches(nn.Conv1d(3, 6, 3, **kwargs), (3, 11))


def test_conv3d_module():
    _check_batches(nn.Conv3d(2, 4, (3, 2, 2), stride=(1, 2, 1), padding=(1, 0, 1)), (2, 5, 6, 4))


def test_depthwise_conv_and_functional_forms():
    w, b = _r(8, 1, 3, 3), _r(8)
    _check_batches(lambda x: F.conv2d(x, w, b, 1, 1, 1, 8), (8, 6, 6))
    _check_batches(lambda x: torch.conv2d(x, w, groups=8, padding=(1, 1)), (8, 6, 6))


def test_unbatched_conv_input():
    m = nn.Conv2d(3, 4, 3).eval()
    check_traced(m, (_r(3, 7, 7),))


@pytest.mark.parametrize("kwargs", [{}, {"stride": 2}, {"stride": 2, "padding": 1, "output_padding": 1},
                                    {"groups": 2}, {"dilation": 2}, {"stride": 3, "output_padding": 2,
                                                                     "dilation": 2, "bias": False}])
def test_conv_transpose2d(kwargs):
    g = _check_batches(nn.ConvTranspose2d(4, 6, 3, **kwargs), (4, 5, 4))
    assert "ConvTranspose" in op_types(g)


def test_conv_transpose1d_and_output_size():
    m = nn.ConvTranspose1d(3, 2, 4, stride=2, padding=1).eval()
    _check_batches(m, (3, 7))
    # output_size picks output_padding in Python, before the functional call.
    check_traced(lambda x: m(x, output_size=[15]), (_r(2, 3, 7),))


# ---------------------------------------------------------------------------- pools
@pytest.mark.parametrize("kwargs", [
    {"kernel_size": 2}, {"kernel_size": 3, "stride": 2, "padding": 1}, {"kernel_size": 3, "stride": 2,
                                                                         "ceil_mode": True},
    {"kernel_size": (3, 2), "stride": (2, 1), "dilation": (1, 2)}, {"kernel_size": 2, "stride": 3,
                                                                     "ceil_mode": True, "padding": 1},
])
def test_max_pool2d(kwargs):
    _check_batches(nn.MaxPool2d(**kwargs), (3, 9, 8))


def test_max_pool_1d_3d_and_aliases():
    _check_batches(nn.MaxPool1d(3, stride=2, padding=1), (2, 10))
    _check_batches(nn.MaxPool3d(2), (2, 4, 6, 4))
    _check_batches(lambda x: torch.max_pool2d(x, 2) + F.max_pool2d(x, (2, 2), 2), (3, 6, 6))
    check_traced(lambda x: F.max_pool2d(x, 2), (_r(3, 6, 6),))  # unbatched


def test_max_pool_return_indices_is_unsupported():
    with pytest.raises(UnsupportedOpError, match="return_indices"):
        kiln.trace(nn.MaxPool2d(2, return_indices=True), _r(1, 2, 4, 4), check=False)


@pytest.mark.parametrize("kwargs", [
    {"kernel_size": 2}, {"kernel_size": 3, "stride": 2, "padding": 1},
    {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False},
    {"kernel_size": 3, "stride": 2, "ceil_mode": True}, {"kernel_size": 3, "stride": 2, "padding": 1,
                                                         "ceil_mode": True},
    {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True, "count_include_pad": False},
])
def test_avg_pool2d(kwargs):
    _check_batches(nn.AvgPool2d(**kwargs), (3, 8, 9))


def test_avg_pool_1d_3d_and_divisor_override():
    _check_batches(nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False), (2, 9))
    _check_batches(nn.AvgPool3d(2, stride=1), (2, 3, 4, 3))
    with pytest.raises(UnsupportedOpError, match="divisor_override"):
        kiln.trace(nn.AvgPool2d(2, divisor_override=3), _r(1, 2, 4, 4), check=False)


@pytest.mark.parametrize("size,want", [(1, "GlobalAveragePool"), ((1, 1), "GlobalAveragePool"),
                                       ((2, 3), "AveragePool"), ((None, 2), "AveragePool"),
                                       ((4, 6), "AveragePool")])
def test_adaptive_avg_pool2d(size, want):
    g = _check_batches(nn.AdaptiveAvgPool2d(size), (3, 4, 6))
    assert want in op_types(g)


def test_adaptive_pools_other_ranks_and_max():
    _check_batches(nn.AdaptiveAvgPool1d(1), (3, 7))
    _check_batches(nn.AdaptiveAvgPool1d(2), (3, 8))
    _check_batches(nn.AdaptiveAvgPool3d(1), (2, 3, 4, 5))
    assert "GlobalMaxPool" in op_types(_check_batches(nn.AdaptiveMaxPool2d(1), (3, 5, 5)))
    assert "MaxPool" in op_types(_check_batches(nn.AdaptiveMaxPool2d((2, 3)), (3, 4, 6)))
    _check_batches(nn.AdaptiveMaxPool1d(1), (3, 7))


def test_adaptive_pool_over_symbolic_spatial_dims():
    m = nn.AdaptiveAvgPool2d(1).eval()
    check_traced(m, (_r(2, 3, 5, 6),), dynamic={"input": {0: "batch", 2: "h", 3: "w"}},
                 other_inputs=[(_r(1, 3, 7, 4),)])


def test_adaptive_pool_uneven_windows_are_unsupported():
    with pytest.raises(UnsupportedOpError, match="adaptive_avg_pool2d"):
        kiln.trace(nn.AdaptiveAvgPool2d(3), _r(1, 2, 5, 5), check=False)
    with pytest.raises(UnsupportedOpError, match="return_indices"):
        kiln.trace(nn.AdaptiveMaxPool2d(1, return_indices=True), _r(1, 2, 4, 4), check=False)


# ---------------------------------------------------------------------------- padding
@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("pads", [(1, 2, 0, 0), (1, 0, 2, 1), (0, 1, 2, 0)])
def test_pad_modes(mode, pads):
    _check_batches(lambda x: F.pad(x, pads, mode=mode), (3, 5, 6))


def test_pad_value_negative_and_three_dims():
    _check_batches(lambda x: F.pad(x, (1, -1, 2, 2), value=-3.5), (3, 5, 6))
    _check_batches(lambda x: F.pad(x, (1, 1, 0, 2, 1, 0), mode="replicate"), (2, 3, 4, 5))
    _check_batches(lambda x: F.pad(x, [1, 1, 1, 1, 1, 1], value=2.0), (3, 4))  # pads the batch dim too
    check_traced(lambda x: F.pad(x, (2, 1)), (torch.arange(6).view(2, 3),))
    _check_batches(nn.ZeroPad2d((1, 2, 0, 1)), (2, 3, 3))
    _check_batches(nn.ReflectionPad1d(2), (2, 5))


# ---------------------------------------------------------------------------- pixel shuffles, resizing
def test_pixel_shuffle_and_unshuffle():
    g = _check_batches(nn.PixelShuffle(2), (12, 3, 4))
    assert "DepthToSpace" in op_types(g)
    _check_batches(nn.PixelUnshuffle(2), (3, 4, 6))
    check_traced(lambda x: F.pixel_shuffle(x, 3), (_r(18, 2, 2),))
    check_traced(lambda x: F.pixel_unshuffle(x, 2), (_r(2, 3, 2, 4, 6),),
                 dynamic={"x": {0: "batch", 3: "h"}}, other_inputs=[(_r(1, 3, 2, 6, 6),)])


# ---------------------------------------------------------------------------- unfold (im2col)
@pytest.mark.parametrize("kwargs", [
    {"kernel_size": 3}, {"kernel_size": (9, 1), "padding": (4, 0)}, {"kernel_size": 2, "stride": 2},
    {"kernel_size": (2, 3), "dilation": (2, 1), "padding": 1, "stride": (1, 2)},
])
def test_unfold(kwargs):
    """F.unfold / nn.Unfold (torch._C._nn.im2col): transformers' ConvBERT unfolds with a (9, 1) kernel."""
    _check_batches(nn.Unfold(**kwargs), (3, 7, 6))
    check_traced(lambda x: F.unfold(x, **kwargs), (_r(3, 7, 6),))  # unbatched [C, H, W]

"""The tracer on every torch of the supported window (frontend/compat.py, docs/NOTES.md "Torch
versions"): Python functions torch dispatches to the tracer (``torch._assert``,
``F.multi_head_attention_forward``, Tensor methods written in Python) trace through their own
body whether or not this torch has the redispatch hook. Each model is traced twice: on the
route this torch takes, and with the hook taken away (the route of torch 2.4 ... 2.11), so both
routes are tested on whichever torch runs the suite.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from frontend_helpers import check_traced, op_types  # noqa: E402

import kiln  # noqa: E402
from kiln import UnsupportedOpError  # noqa: E402
from kiln.frontend import compat  # noqa: E402

ROUTES = ["this-torch", "no-hook"]


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch):
    """``no-hook``: torch without ``redispatch_function`` and its C hook, as before torch had them."""
    if request.param == "no-hook":
        monkeypatch.delattr(torch.overrides, "redispatch_function", raising=False)
        monkeypatch.delattr(torch._C, "_skip_one_hop_torch_function", raising=False)
        assert compat.redispatch_hook() is None
    return request.param


def test_window_is_stated_and_this_torch_is_in_it():
    assert compat.MIN_TORCH <= (2, 4) and compat.NEXT_TORCH >= (2, 14)
    assert compat.SUPPORTED, f"CI runs torch {torch.__version__}, outside {compat.MIN_TORCH}..{compat.NEXT_TORCH}"


class PatchCheck(nn.Module):
    """vit_b_16's input check (torchvision's VisionTransformer._process_input) and a patch
    embedding: ``torch._assert`` on sizes, with a bool, an int comparison and a SymInt."""

    def __init__(self, image: int = 16, patch: int = 4, dim: int = 8):
        super().__init__()
        self.image, self.patch = image, patch
        self.proj = nn.Conv2d(3, dim, patch, patch)

    def forward(self, x):
        n, c, h, w = x.shape
        torch._assert(h == self.image, f"Wrong image height! Expected {self.image} but got {h}!")
        torch._assert(w == self.image, f"Wrong image width! Expected {self.image} but got {w}!")
        torch._assert(x.dim() == 4, "expected NCHW")
        x = self.proj(x).reshape(n, self.proj.out_channels, -1).permute(0, 2, 1)
        torch._assert(x.dim() == 3, f"Expected (batch_size, seq_length, hidden_dim) got {x.shape}")
        return x


def test_torch_assert_traces(route):
    g = check_traced(PatchCheck().eval(), (torch.randn(2, 3, 16, 16),), dynamic_batch=True,
                     other_inputs=[(torch.randn(3, 3, 16, 16),)])
    assert "Conv" in op_types(g)


def test_torch_assert_still_raises_in_eager_while_tracing(route):
    with pytest.raises(AssertionError, match="Wrong image height"):
        kiln.trace(PatchCheck(image=8).eval(), (torch.randn(1, 3, 16, 16),))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layer(route, norm_first, batch_first):
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    x = torch.randn(2, 5, 16) if batch_first else torch.randn(5, 2, 16)
    other = torch.randn(3, 7, 16) if batch_first else torch.randn(7, 3, 16)
    dims = {0: "batch", 1: "seq"} if batch_first else {1: "batch", 0: "seq"}
    g = check_traced(layer.eval(), (x,), dynamic={"src": dims}, other_inputs=[(other,)], rtol=1e-5, atol=1e-5)
    assert "Softmax" in op_types(g)


def test_transformer_encoder_layer_would_take_the_fast_path_in_eager(route):
    """An eval-mode, batch-first layer under no_grad is the case where torch's eager module takes
    the fused fast path (torch._transformer_encoder_layer_fwd, one opaque op): the tracer turns the
    fast path off, so the layer is recorded op by op, with a padding mask too."""
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def forward(self, x, pad):
            return self.enc(x, src_key_padding_mask=pad)

    def inputs(b, s):
        pad = torch.zeros(b, s, dtype=torch.bool)
        pad[0, -2:] = True
        return torch.randn(b, s, 16), pad

    with torch.no_grad():
        g = check_traced(Encoder().eval(), inputs(2, 6), dynamic={"x": {0: "batch", 1: "seq"}, "pad": {0: "batch", 1: "seq"}},
                         other_inputs=[inputs(3, 4)], rtol=1e-5, atol=1e-5)
    assert torch.backends.mha.get_fastpath_enabled()  # restored after the trace
    assert "Softmax" in op_types(g)


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_with_masks(route, need_weights):
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()

    def fn(x, pad):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return mha(x, x, x, key_padding_mask=pad, attn_mask=mask, need_weights=need_weights)[0]

    def inputs(b, s):
        pad = torch.zeros(b, s)  # float, like the causal mask (mixing bool and float is deprecated)
        pad[-1, -1] = float("-inf")
        return torch.randn(b, s, 16), pad

    check_traced(fn, inputs(2, 5), dynamic={"x": {0: "batch", 1: "seq"}, "pad": {0: "batch", 1: "seq"}},
                 other_inputs=[inputs(3, 6)], rtol=1e-5, atol=1e-5)


def test_python_tensor_methods_and_boolean_dispatch(route):
    """Tensor methods written in Python (``__rsub__``/``__rpow__``/``__rmatmul__``: their guard sits
    in a decorator's wrapper), torch.functional (``split``) and a boolean_dispatch function whose
    guard sits in a function of its closure (``F.max_pool2d``, here with return_indices=False)."""
    w = torch.randn(3, 4)

    def fn(x):
        a = x.__rsub__(1.0) + x.__rpow__(2.0)
        b = torch.Tensor.__rmatmul__(x, w)
        c, d = torch.functional.split(b, 3, dim=-1)
        return a.sum() + c.mean() + d.amax(), F.max_pool2d(a.unsqueeze(0), 2)

    check_traced(fn, (torch.randn(2, 4, 6),))


def test_nested_python_functions_keep_their_own_guards(route):
    """F.multi_head_attention_forward calls other Python functions (F.linear is C, but
    F._in_projection_packed, F.pad, F.dropout are Python): each is dispatched on its own."""
    mha = nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True, add_zero_attn=True).eval()
    check_traced(lambda x: mha(x, x, x, need_weights=False)[0], (torch.randn(2, 5, 8),), rtol=1e-5, atol=1e-5)


def _guard_elsewhere(x):
    return _checked(x) * 2  # its guard is in _checked, a module global the copy does not follow


def _checked(x):
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(_guard_elsewhere, (x,), x)
    return x + 1


def test_no_hook_route_refuses_a_function_without_a_guard(monkeypatch):
    """A Python function torch dispatches to the tracer but whose guard the copy cannot reach is
    refused by name; it is never run eagerly behind the tracer's back (a silently constant result)."""
    monkeypatch.delattr(torch.overrides, "redispatch_function", raising=False)
    monkeypatch.delattr(torch._C, "_skip_one_hop_torch_function", raising=False)
    with pytest.raises(UnsupportedOpError, match="_guard_elsewhere' on torch .*no redispatch hook"):
        kiln.trace(lambda x: _guard_elsewhere(x), (torch.randn(3),))


def test_no_hook_route_reads_module_globals_live(monkeypatch):
    """The copy of a function reads its module's globals as they are at the call, not as they
    were when first traced (an overlay, not a snapshot)."""
    monkeypatch.delattr(torch.overrides, "redispatch_function", raising=False)
    monkeypatch.delattr(torch._C, "_skip_one_hop_torch_function", raising=False)
    global _SCALE
    _SCALE = 2.0
    g = kiln.trace(_scaled, (torch.ones(3),))
    np.testing.assert_allclose(kiln.evaluate(g, [np.ones(3, np.float32)])[0], 2.0)
    _SCALE = 5.0
    g = kiln.trace(_scaled, (torch.ones(3),))
    np.testing.assert_allclose(kiln.evaluate(g, [np.ones(3, np.float32)])[0], 5.0)


_SCALE = 1.0


def _scaled(x):
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(_scaled, (x,), x)
    return x * _SCALE


def test_torchvision_vision_transformer(route):
    """torchvision's VisionTransformer (vit_b_16's class, small here): torch._assert on the image
    size, then nn.TransformerEncoder layers of nn.MultiheadAttention. On torch 2.11, without the
    redispatch hook, vit_b_16 failed at torch._assert (issue 15, case 6)."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                        mlp_dim=64, num_classes=10).eval()
    g = check_traced(model, (torch.randn(2, 3, 32, 32),), dynamic_batch=True,
                     other_inputs=[(torch.randn(1, 3, 32, 32),)], rtol=1e-5, atol=1e-5)
    assert "Softmax" in op_types(g)

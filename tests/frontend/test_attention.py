"""Tracing F.scaled_dot_product_attention, nn.MultiheadAttention and nn.TransformerEncoderLayer
against torch eager, with symbolic batch and sequence dims checked at other sizes."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from frontend_helpers import check_traced, op_types  # noqa: E402
from kiln import UnsupportedOpError  # noqa: E402
from kiln.frontend.compat import TORCH_VERSION  # noqa: E402

import kiln  # noqa: E402

DYNAMIC_QKV = {n: {0: "batch", 2: "seq"} for n in ("q", "k", "v")}


def _r(*shape):
    return torch.randn(*shape)


def _qkv(b, s, heads=2, e=4):
    return _r(b, heads, s, e), _r(b, heads, s, e), _r(b, heads, s, e)


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"scale": 0.3}, {"is_causal": True, "scale": 2.0}])
def test_sdpa_dynamic_batch_and_seq(kwargs):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    g = check_traced(fn, _qkv(2, 5), dynamic=DYNAMIC_QKV, other_inputs=[_qkv(3, 7), _qkv(1, 2)])
    assert "Softmax" in op_types(g)


def test_causal_mask_is_built_from_the_runtime_length():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    g = check_traced(fn, _qkv(2, 5), dynamic=DYNAMIC_QKV, other_inputs=[_qkv(2, 9)])
    assert "Range" in op_types(g)
    assert all(tuple(v.type.shape) != (5, 5) for v in g.initializers.values())


def test_sdpa_causal_with_fewer_keys_than_queries():
    q = _r(1, 2, 6, 4)
    k, v = _r(1, 2, 4, 4), _r(1, 2, 4, 4)
    check_traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v))


def test_sdpa_masks():
    bool_mask = torch.rand(5, 5) > 0.3
    bool_mask[:, 0] = True  # every query sees at least one key
    float_mask = _r(2, 1, 5, 5)
    check_traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), _qkv(2, 5))
    check_traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask), _qkv(2, 5))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the reference softmax's NaN row
def test_sdpa_fully_masked_rows_give_zeros_like_torch():
    bool_mask = torch.ones(5, 5, dtype=torch.bool)
    bool_mask[2] = False
    float_mask = torch.zeros(5, 5)
    float_mask[3] = float("-inf")
    check_traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), _qkv(2, 5))
    check_traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask), _qkv(2, 5))


def test_sdpa_mask_as_input_with_symbolic_seq():
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def inputs(b, s):
        mask = torch.rand(b, 1, s, s) > 0.3
        mask[..., 0] = True
        return (*_qkv(b, s), mask)

    dyn = dict(DYNAMIC_QKV, mask={0: "batch", 2: "seq", 3: "seq"})
    check_traced(fn, inputs(2, 5), dynamic=dyn, other_inputs=[inputs(3, 8)])


def test_sdpa_three_dim_inputs_and_other_value_width():
    q, k, v = _r(2, 5, 4), _r(2, 6, 4), _r(2, 6, 3)
    check_traced(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k, v), dynamic_batch=True,
                 other_inputs=[(_r(4, 5, 4), _r(4, 6, 4), _r(4, 6, 3))])


@pytest.mark.skipif(TORCH_VERSION < (2, 5), reason="scaled_dot_product_attention(enable_gqa=) came in torch 2.5")
def test_sdpa_grouped_query_attention():
    q, k, v = _r(2, 4, 5, 8), _r(2, 2, 5, 8), _r(2, 2, 5, 8)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    check_traced(fn, (q, k, v), dynamic=DYNAMIC_QKV, other_inputs=[(_r(1, 4, 3, 8), _r(1, 2, 3, 8), _r(1, 2, 3, 8))])


def test_sdpa_dropout_is_unsupported():
    with pytest.raises(UnsupportedOpError, match="dropout_p"):
        kiln.trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), _qkv(1, 3), check=False)


# ---------------------------------------------------------------------------- nn.MultiheadAttention
class SelfAttention(nn.Module):
    def __init__(self, batch_first: bool, need_weights: bool, **kwargs):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kwargs)
        self.need_weights = need_weights

    def forward(self, x, pad):
        out, weights = self.attn(x, x, x, key_padding_mask=pad, need_weights=self.need_weights)
        return (out, weights) if self.need_weights else out


def _mha_inputs(batch_first: bool, b: int, s: int):
    x = _r(b, s, 8) if batch_first else _r(s, b, 8)
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[0, -1] = True  # the first sequence is one shorter
    return x, pad


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention(batch_first, need_weights):
    m = SelfAttention(batch_first, need_weights).eval()
    batch_dim = 0 if batch_first else 1
    dyn = {"x": {batch_dim: "batch", 1 - batch_dim: "seq"}, "pad": {0: "batch", 1: "seq"}}
    check_traced(m, _mha_inputs(batch_first, 2, 5), dynamic=dyn,
                 other_inputs=[_mha_inputs(batch_first, 3, 4), _mha_inputs(batch_first, 1, 7)])


def test_multihead_attention_with_causal_attn_mask():
    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True, bias=False)

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
            return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]

    check_traced(Causal().eval(), (_r(2, 5, 8),), dynamic={"x": {0: "batch"}}, other_inputs=[(_r(3, 5, 8),)])


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer(norm_first):
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, norm_first=norm_first).eval()

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, pad):
            return self.layer(x, src_key_padding_mask=pad)

    dyn = {"x": {0: "batch", 1: "seq"}, "pad": {0: "batch", 1: "seq"}}
    check_traced(Encoder().eval(), _mha_inputs(True, 2, 5), dynamic=dyn,
                 other_inputs=[_mha_inputs(True, 3, 6)], rtol=1e-5, atol=1e-5)

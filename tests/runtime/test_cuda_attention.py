"""The fused attention kernel of the CUDA backend (issue 8): ``kiln.FusedAttention``.

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module). The kernel is checked
against softmax(q @ kt * scale + mask) @ v in float64 on the host, on shapes that exercise its
edges: rows and keys that do not fill a tile, head dims up to 64 (not only multiples of 4), a
value dim unlike the key dim, strided (transposed) inputs, masks that remove whole tiles or
whole rows, ranks 3 to 5; then through CudaProgram, eager and under CUDA graphs."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()

from kiln.ir import Graph, evaluate  # noqa: E402
from kiln.ir.passes import infer_shapes  # noqa: E402
from kiln.runtime.cuda_program import CudaProgram  # noqa: E402
from kiln.runtime.kernels.cuda.attention import attention  # noqa: E402

RNG = np.random.default_rng(5)


@pytest.fixture(autouse=True)
def _kernel_always():
    """The kernel even on the small shapes here (its auto mode leaves those to the unfused ops)."""
    from kiln.runtime.kernels.cuda import attention as mod
    before = mod.MODE["mode"]
    mod.MODE["mode"] = "kernel"
    yield
    mod.MODE["mode"] = before


def _r(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _reference(q, kt, v, mask, scale):
    s = np.matmul(q.astype(np.float64), kt.astype(np.float64)) * scale
    if mask is not None:
        s = s + mask
    with np.errstate(invalid="ignore"):
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p = p / p.sum(axis=-1, keepdims=True)
    return np.matmul(p, v.astype(np.float64))


def _check(got, want, tol=2e-6):
    got = got.get() if isinstance(got, cp.ndarray) else got
    assert got.shape == want.shape
    assert np.array_equal(np.isnan(got), np.isnan(want))
    g, w = np.nan_to_num(got.astype(np.float64)), np.nan_to_num(want)
    assert np.abs(g - w).max() <= tol * (1 + np.abs(w).max())


@pytest.mark.parametrize("b,h,lq,lk,d,dv", [
    (2, 3, 128, 128, 64, 64),    # BERT's head
    (1, 2, 45, 77, 64, 32),      # partial tiles; dv != d
    (2, 1, 7, 300, 48, 40),      # many key tiles, few rows
    (1, 2, 130, 40, 61, 64),     # a head dim not a multiple of 4; three row blocks
    (1, 1, 1, 1, 8, 8),
])
def test_kernel_matches_float64(b, h, lq, lk, d, dv):
    q, kt, v = _r(b, h, lq, d), _r(b, h, d, lk), _r(b, h, lk, dv)
    scale = 1 / np.sqrt(d)
    got = attention(cp.asarray(q), cp.asarray(kt), cp.asarray(v), None, scale)
    assert got is not None
    _check(got, _reference(q, kt, v, None, scale))


def test_strided_inputs_as_traced_bert_makes_them():
    # q, k, v are [B, T, H, D] projections viewed as [B, H, T, D]; kt is k's transpose: no copies.
    b, t, h, d = 2, 50, 4, 32
    proj = cp.asarray(_r(b, t, 3, h, d))
    q, k, v = proj[:, :, 0].transpose(0, 2, 1, 3), proj[:, :, 1].transpose(0, 2, 1, 3), proj[:, :, 2].transpose(0, 2, 1, 3)
    kt = k.transpose(0, 1, 3, 2)
    assert not q.flags.c_contiguous and not kt.flags.c_contiguous
    got = attention(q, kt, v, None, 0.25)
    _check(got, _reference(q.get(), kt.get(), v.get(), None, 0.25))


@pytest.mark.parametrize("kind", ["padding", "causal", "first_tile_masked", "row_fully_masked", "additive"])
def test_masks(kind):
    b, h, lq, lk, d = 2, 2, 40, 70, 16
    q, kt, v = _r(b, h, lq, d), _r(b, h, d, lk), _r(b, h, lk, d)
    if kind == "padding":
        mask = np.zeros((b, 1, 1, lk), np.float32)
        mask[1, ..., 50:] = -np.inf
    elif kind == "causal":
        mask = np.triu(np.full((lq, lk), -np.inf, np.float32), 1)
    elif kind == "first_tile_masked":  # keys 0..39 out: the running max starts at -inf
        mask = np.zeros((1, 1, 1, lk), np.float32)
        mask[..., :40] = -np.inf
    elif kind == "row_fully_masked":  # the reference's softmax gives NaN there, and so must this
        mask = np.zeros((b, h, lq, lk), np.float32)
        mask[0, 1, 3, :] = -np.inf
    else:
        mask = _r(1, h, lq, lk)
    got = attention(cp.asarray(q), cp.asarray(kt), cp.asarray(v), cp.asarray(mask), 0.5)
    _check(got, _reference(q, kt, v, mask, 0.5))


@pytest.mark.parametrize("shape", [(6, 20, 16), (2, 2, 3, 20, 16)])
def test_ranks_three_and_five(shape):
    *lead, lq, d = shape
    q, kt, v = _r(*shape), _r(*lead, d, 24), _r(*lead, 24, 8)
    got = attention(cp.asarray(q), cp.asarray(kt), cp.asarray(v), None, 1.0)
    _check(got, _reference(q, kt, v, None, 1.0))


def test_declines_what_it_does_not_cover():
    q, kt, v = _r(1, 1, 4, 8), _r(1, 1, 8, 4), _r(1, 1, 4, 8)
    assert attention(cp.asarray(q.astype(np.float64)), cp.asarray(kt.astype(np.float64)),
                     cp.asarray(v.astype(np.float64)), None, 1.0) is None
    wide = _r(1, 1, 4, 80)
    assert attention(cp.asarray(wide), cp.asarray(_r(1, 1, 80, 4)), cp.asarray(_r(1, 1, 4, 8)), None, 1.0) is None


def _attention_graph(scale_op: str, mask: bool, d: int = 32):
    g = Graph("attn")
    x = g.add_input("x", "float32", ["batch", 20, 4 * d])
    shape = g.add_constant(np.array([0, 20, 4, d], np.int64))
    heads = [g.op("Transpose", g.op("Reshape", g.op("MatMul", x, g.add_initializer(n, _r(4 * d, 4 * d) * 0.1)), shape),
                  perm=[0, 2, 1, 3]) for n in ("wq", "wk", "wv")]
    q, k, v = heads
    s = g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2]))
    c = g.add_constant(np.array(np.sqrt(d) if scale_op == "Div" else 1 / np.sqrt(d), np.float32))
    s = g.op(scale_op, s, c)
    if mask:
        m = g.add_input("m", "float32", ["batch", 1, 1, 20])
        s = g.op("Add", s, m)
    o = g.op("MatMul", g.op("Softmax", s, axis=-1), v)
    g.outputs = [g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]),
                      g.add_constant(np.array([0, 20, 4 * d], np.int64)))]
    infer_shapes(g)
    return g


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("scale_op,mask", [("Mul", False), ("Div", True)])
def test_program_fuses_and_matches(scale_op, mask, graphs):
    g = _attention_graph(scale_op, mask)
    p = CudaProgram(g.copy(), output="numpy", cuda_graphs=graphs)
    assert p.fused_attention == 1
    for batch in (3, 1):
        feeds = [_r(batch, 20, 128)]
        if mask:
            m = np.zeros((batch, 1, 1, 20), np.float32)
            m[0, ..., 15:] = -1e9
            feeds.append(m)
        got = p.run(feeds, as_list=True)[0]
        want = evaluate(g, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert p.fallback_ops == {}
    if graphs:
        assert p.graph_failures == {}


def test_wide_heads_run_the_body_on_the_device():
    g = _attention_graph("Mul", False, d=96)  # head dim 96 > 64: the body, op by op
    p = CudaProgram(g.copy(), output="numpy", cuda_graphs=False)
    assert p.fused_attention == 1
    feeds = [_r(2, 20, 384)]
    np.testing.assert_allclose(p.run(feeds, as_list=True)[0], evaluate(g, feeds)[0], rtol=1e-4, atol=1e-4)
    assert p.fallback_ops == {}

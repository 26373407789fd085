"""float16 on the GPU (issue 18): each kernel family in half, natively (no host fallback), against the float32
model on the CPU; and whole models converted with ``kiln.load(..., precision="fp16")`` against torch.

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module); on the device machine:
``python -m pytest tests/runtime/test_cuda_half.py``."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()

import kiln  # noqa: E402
from kiln.ir import Graph  # noqa: E402
from kiln.ir.passes.precision import convert_precision  # noqa: E402


def _rng(seed=0):
    return np.random.default_rng(seed)


def _check_half(g: Graph, feeds: dict, tol: float = 1e-2, **cuda):
    """Convert a float32 graph to fp16 and run it on the GPU: no host fallback, every output within ``tol``
    (of the output's largest magnitude) of the float32 graph on the CPU."""
    want = kiln.load(g.copy()).run(feeds)
    h = g.copy()
    convert_precision(h, "fp16")
    p = kiln.load(h, device="cuda", output="numpy", **cuda)
    got = p.run(feeds)
    assert p.fallback_ops == {}, f"fell back to the host: {p.fallback_ops}"
    for name, w in want.items():
        o = got[name]
        assert o.dtype == w.dtype and o.shape == w.shape, name
        err = float(np.abs(o.astype(np.float64) - w).max())
        assert err <= tol * max(float(np.abs(w).max()), 1e-3), (name, err)
    return p


def test_fused_elementwise_chain_in_half():
    g = Graph("ew")
    x = g.add_input("x", "float32", ("n", 64))
    y = g.op("Mul", g.op("Add", x, g.add_initializer("b", _rng(1).standard_normal(64).astype(np.float32))),
             g.add_initializer("k", np.array(0.5, np.float32)))
    y = g.op("Gelu", y)
    y = g.op("Tanh", g.op("Sigmoid", y))
    g.outputs = [g.op("Where", g.op("Greater", x, g.add_initializer("z", np.array(0, np.float32))), y, x, name="y")]
    _check_half(g, {"x": _rng().standard_normal((33, 64)).astype(np.float32)})


@pytest.mark.parametrize("batch_dims", [(), (3,), (2, 3)])
def test_matmul_and_linear_with_bias_on_tensor_cores(batch_dims):
    g = Graph("lin")
    x = g.add_input("x", "float32", (*batch_dims, 40, 96))
    w = g.add_initializer("w", (_rng(2).standard_normal((96, 80)) / 10).astype(np.float32))
    b = g.add_initializer("b", _rng(3).standard_normal(80).astype(np.float32))
    h = g.op("Relu", g.op("Add", g.op("MatMul", x, w), b))
    other = g.add_input("o", "float32", (*batch_dims, 80, 24))
    g.outputs = [g.op("MatMul", h, other, name="y")]
    _check_half(g, {"x": _rng(4).standard_normal((*batch_dims, 40, 96)).astype(np.float32),
                    "o": _rng(5).standard_normal((*batch_dims, 80, 24)).astype(np.float32)})


@pytest.mark.parametrize("conv", ["auto", "im2col"])
@pytest.mark.parametrize("batch", [1, 8])
def test_conv_block_with_residual_relu_and_pools(conv, batch):
    g = Graph("cnn")
    x = g.add_input("x", "float32", ("n", 8, 16, 16))
    w1 = g.add_initializer("w1", (_rng(6).standard_normal((8, 8, 3, 3)) / 8).astype(np.float32))
    b1 = g.add_initializer("b1", _rng(7).standard_normal(8).astype(np.float32))
    y = g.op("Relu", g.op("Add", g.op("Conv", x, w1, b1, pads=[1, 1, 1, 1]), x))
    dw = g.add_initializer("dw", (_rng(8).standard_normal((8, 1, 3, 3)) / 3).astype(np.float32))
    y = g.op("Conv", y, dw, pads=[1, 1, 1, 1], group=8)  # depthwise
    y = g.op("MaxPool", y, kernel_shape=[2, 2], strides=[2, 2])
    y = g.op("AveragePool", y, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    g.outputs = [g.op("GlobalAveragePool", y, name="y")]
    p = _check_half(g, {"x": _rng(9).standard_normal((batch, 8, 16, 16)).astype(np.float32)}, conv=conv)
    if conv == "auto":
        from kiln.runtime.kernels.cuda import cudnn as kcudnn
        if not kcudnn.available():
            pytest.skip(f"cuDNN unavailable: {kcudnn.why_unavailable()}")
        # Half convolutions run channels-last in cuDNN, at batch 1 too.
        assert p.conv_paths.get("cudnn", 0) >= 2, p.conv_paths


# ------------------------------------------------------------------------- whole models, traced from torch

def _flat(out) -> list:
    """A model's outputs as the tracer flattens them (a transformers ModelOutput: its tensors, in order)."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.fixture(scope="module")
def zoo():
    pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zoo as z
    return z


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3", "transformer_encoder", "gpt", "hf_bert"])
def test_zoo_models_in_fp16_on_the_gpu_close_to_torch(zoo, name, tmp_path):
    import torch
    entry = zoo.by_name(name)
    if entry.needs:
        pytest.importorskip(entry.needs)
    model, inputs, spec = entry.factory()
    path = kiln.save(kiln.trace(model, inputs, dynamic=spec), tmp_path / "m.kiln")
    names, tensors = zoo.input_list(model, inputs)
    feeds = dict(zip(names, [t.numpy() for t in tensors]))
    p = kiln.load(path, device="cuda", output="numpy", precision="fp16")
    got = list(p.run(feeds).values())
    assert p.fallback_ops == {}, f"{name} fell back to the host: {p.fallback_ops}"
    with torch.inference_mode():
        want = model(*tensors)
        half = model.half().cuda()(*[t.cuda() if t.is_floating_point() is False else t.half().cuda()
                                     for t in tensors])
    want, half = _flat(want), _flat(half)
    for w, o, h in zip(want, got, half):
        w = w.float().numpy()
        scale = max(float(np.abs(w).max()), 1e-3)
        err = float(np.abs(o.astype(np.float64) - w).max()) / scale
        torch_err = float(np.abs(h.float().cpu().numpy() - w).max()) / scale
        # kiln in fp16 is no worse than torch's own fp16 (a small margin for rounding luck), and close.
        assert err <= max(2 * torch_err, 1e-2), (name, err, torch_err)


@pytest.mark.parametrize("lq, lk, d, masked", [(128, 128, 64, True), (77, 50, 32, False), (1, 200, 64, True)])
def test_attention_kernel_in_half(lq, lk, d, masked):
    """The fused attention kernel reads and writes float16 (scores and softmax in float32) and agrees with the
    float32 kernel on the same (half-rounded) inputs."""
    from kiln.runtime.kernels.cuda.attention import attention
    rng = _rng(13)
    q = rng.standard_normal((2, 12, lq, d)).astype(np.float16)
    kt = rng.standard_normal((2, 12, d, lk)).astype(np.float16)
    v = rng.standard_normal((2, 12, lk, d)).astype(np.float16)
    mask = np.where(rng.random((2, 1, lq, lk)) < 0.2, -65504.0, 0.0).astype(np.float16) if masked else None
    args = [cp.asarray(a) for a in (q, kt, v)] + [None if mask is None else cp.asarray(mask)]
    half = attention(*args, 0.125, "kernel")
    full = attention(*[None if a is None else a.astype(cp.float32) for a in args], 0.125, "kernel")
    assert half is not None and half.dtype == cp.float16 and full is not None
    np.testing.assert_allclose(cp.asnumpy(half).astype(np.float32), cp.asnumpy(full), rtol=1e-2, atol=2e-3)


def test_float32_and_float16_programs_of_one_model_choose_their_conv_paths_apart():
    """At batch 1 float32 takes im2col (auto) and float16 cuDNN, whichever program runs first."""
    from kiln.runtime.kernels.cuda import cudnn as kcudnn
    if not kcudnn.available():
        pytest.skip(f"cuDNN unavailable: {kcudnn.why_unavailable()}")
    g = Graph("c")
    x = g.add_input("x", "float32", ("n", 8, 16, 16))
    w = g.add_initializer("w", (_rng(20).standard_normal((8, 8, 3, 3)) / 8).astype(np.float32))
    g.outputs = [g.op("Relu", g.op("Conv", x, w, pads=[1, 1, 1, 1]), name="y")]
    feed = {"x": _rng(21).standard_normal((1, 8, 16, 16)).astype(np.float32)}
    h = g.copy()
    convert_precision(h, "fp16")
    p16 = kiln.load(h, device="cuda", output="numpy", cuda_graphs=False)
    p16.run(feed)
    p32 = kiln.load(g, device="cuda", output="numpy", cuda_graphs=False)
    p32.run(feed)
    assert p16.conv_paths == {"cudnn": 1} and p32.conv_paths == {"im2col": 1}, (p16.conv_paths, p32.conv_paths)


def _attention_ref(q, kt, v, mask, scale):
    s = np.einsum("...id,...dj->...ij", q.astype(np.float64), kt.astype(np.float64)) * scale
    if mask is not None:
        s = s + mask.astype(np.float64)
    s = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("...ij,...jd->...id", s / s.sum(-1, keepdims=True), v.astype(np.float64))


def _projections(rng, b, lq, lk, h, d):
    """q, kt, v as the graph hands them over: [B, H, L, D] transposed views of [B, L, H*D] projections
    (one fused QKV buffer for q and v, a separate one for k, as GPT-2 and BERT do)."""
    qv = cp.asarray(rng.standard_normal((b, lq, 2, h, d)).astype(np.float16))
    k = cp.asarray(rng.standard_normal((b, lk, h, d)).astype(np.float16))
    return qv[:, :, 0].transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1), qv[:, :lk, 1].transpose(0, 2, 1, 3)


@pytest.mark.parametrize("lq, lk, h, d, mask", [
    (128, 128, 12, 64, "padding"),   # BERT: a [B, 1, 1, Lk] additive bias
    (128, 128, 12, 64, "causal"),    # GPT-2: a [Lq, Lk] bias
    (64, 40, 4, 128, None),          # a head dim the kernel does not take
    (77, 50, 6, 32, "full")])        # a [B, H, Lq, Lk] bias, odd lengths
def test_cudnn_attention_in_half_reads_views_and_writes_the_head_merge_layout(lq, lk, h, d, mask):
    from kiln.runtime.kernels.cuda import cudnn as kcudnn
    from kiln.runtime.kernels.cuda.attention import attention_path
    if not kcudnn.available():
        pytest.skip(f"cuDNN unavailable: {kcudnn.why_unavailable()}")
    rng = _rng(31)
    b = 3
    q, kt, v = _projections(rng, b, max(lq, lk), lk, h, d)
    q = q[:, :, :lq]
    m = None
    if mask == "padding":
        m = np.zeros((b, 1, 1, lk), np.float16)
        m[1, ..., lk // 2:] = -65504.0
    elif mask == "causal":
        m = np.triu(np.full((lq, lk), -65504.0, np.float16), 1)
    elif mask == "full":
        m = np.where(rng.random((b, h, lq, lk)) < 0.2, -65504.0, 0.0).astype(np.float16)
    scale = 1 / np.sqrt(d)
    out, path = attention_path(q, kt, v, None if m is None else cp.asarray(m), scale, "cudnn")
    assert path == "cudnn", path
    assert out.shape == (b, h, lq, d) and out.dtype == cp.float16
    assert out.transpose(0, 2, 1, 3).flags.c_contiguous  # the head merge after it is a view
    want = _attention_ref(*(cp.asnumpy(a) for a in (q, kt, v)), m, scale)
    np.testing.assert_allclose(cp.asnumpy(out).astype(np.float64), want, rtol=1e-2, atol=4e-3)


def test_attention_kernel_writes_the_head_merge_layout_too():
    from kiln.runtime.kernels.cuda.attention import attention_path
    q, kt, v = _projections(_rng(32), 2, 128, 128, 12, 64)
    for dtype in (cp.float16, cp.float32):
        args = [a.astype(dtype) for a in (q, kt, v)]
        out, path = attention_path(*args, None, 0.125, "kernel")
        assert path == "kernel" and out.transpose(0, 2, 1, 3).flags.c_contiguous
        want = _attention_ref(*(cp.asnumpy(a) for a in args), None, 0.125)
        np.testing.assert_allclose(cp.asnumpy(out).astype(np.float64), want, rtol=1e-2, atol=3e-3)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_attention_in_a_half_program_takes_cudnn_and_replays(graphs):
    """A whole program: FusedAttention in fp16 takes cuDNN (at batch 1 too, below a full GPU), captures
    into a CUDA graph and replays with new inputs; answers as the float32 model's on the CPU."""
    from kiln.runtime.kernels.cuda import cudnn as kcudnn
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_options import _attention_graph
    if not kcudnn.available():
        pytest.skip(f"cuDNN unavailable: {kcudnn.why_unavailable()}")
    g = _attention_graph(d=64)
    for batch in (1, 4):
        feeds = {"x": _rng(33 + batch).standard_normal((batch, 20, 256)).astype(np.float32)}
        p = _check_half(g, feeds, cuda_graphs=graphs)
        assert p.attention_paths["cudnn"] > 0 and p.attention_paths["ops"] == 0, p.attention_paths
        if graphs:
            assert p.graph_failures == {}, p.graph_failures
            feeds2 = {"x": _rng(50 + batch).standard_normal((batch, 20, 256)).astype(np.float32)}
            want = kiln.load(g.copy()).run(feeds2)
            got = p.run(feeds2)
            for name, w in want.items():
                assert float(np.abs(got[name] - w).max()) <= 1e-2 * float(np.abs(w).max()), name

"""The trace check: what it draws (the range the model accepts, not the example's) and how it
compares (a scale-aware bound that fits float32 yet still catches a wrong constant or axis)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import kiln  # noqa: E402
from kiln.frontend.trace import check_trace, index_bounds, input_domains, mismatch  # noqa: E402


def _trace_unchecked(model, inputs, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kiln.TraceWarning)
        return kiln.trace(model, inputs, check=False, optimize=False, **kw)


def _check(graph, model, inputs, **kw):
    names = [v.name for v in graph.inputs]
    dims = [{i: d for i, d in enumerate(v.type.shape) if isinstance(d, str)} for v in graph.inputs]
    check_trace(graph, model, names, list(inputs), dims, rtol=1e-4, atol=1e-5, **kw)


# ---------------------------------------------------------------------------- the tolerance
def test_case3_large_float32_outputs_pass():
    torch.manual_seed(0)
    model = nn.Linear(4096, 1000).eval()
    x = torch.randn(2, 4096) * 100  # logits ~1e2, like a random-init ResNet-50's
    kiln.trace(model, (x,))         # the elementwise check failed here on summation order


def test_wrong_constant_fails():
    model = nn.Sequential(nn.Linear(16, 8), nn.GELU()).eval()
    x = torch.randn(4, 16)
    graph = _trace_unchecked(model, (x,))
    _check(graph, model, (x,))
    w = next(v for v in graph.initializers.values() if v.const.shape == (8,))  # the bias
    w.const = w.const + np.float32(0.01)
    with pytest.raises(kiln.TraceCheckError, match=r"max abs difference .* > .*rtol"):
        _check(graph, model, (x,))


def test_wrong_axis_fails():
    model = nn.Softmax(dim=-1)
    x = torch.randn(3, 5)
    graph = _trace_unchecked(model, (x,))
    node = next(n for n in graph.nodes if n.op == "Softmax")
    node.attrs["axis"] = 0
    with pytest.raises(kiln.TraceCheckError, match="differs"):
        _check(graph, model, (x,))


def test_mismatch_rules():
    assert mismatch(np.array([1.0, 100.0]), np.array([1.004, 100.0]), rtol=1e-4, atol=1e-5) == ""
    assert "max abs difference" in mismatch(np.array([1.0, 2.0]), np.array([1.01, 2.0]), rtol=1e-4, atol=1e-5)
    assert mismatch(np.array([1, 2]), np.array([1, 3]), rtol=1, atol=1) == "1 of 2 elements differ"
    assert mismatch(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]), rtol=0, atol=0) == ""
    assert mismatch(np.array([np.nan, 1.0]), np.array([1.0, 1.0]), rtol=1, atol=1) == "NaN in different places"
    assert mismatch(np.array([np.inf]), np.array([-np.inf]), rtol=1, atol=1) == "infinities in different places"
    assert mismatch(np.zeros(2), np.zeros(3), rtol=1, atol=1).startswith("shape")
    half = np.array([1.0, 2.0], np.float16)
    assert mismatch(half + np.float16(0.001), half, rtol=1e-4, atol=1e-5) == ""


# ---------------------------------------------------------------------------- what it draws
class _SmallIdsOnly(nn.Module):
    """Right only for ids below 10: a branch the example (ids < 10) never leaves."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 4)

    def forward(self, ids):
        h = self.emb(ids)
        if ids.max() < 10:
            return h * 2
        return h


def test_ids_are_drawn_up_to_the_table_size():
    ids = torch.randint(0, 10, (2, 5))
    model = _SmallIdsOnly().eval()
    graph = _trace_unchecked(model, (ids,))
    assert index_bounds(graph) == {"ids": 1000}
    dom, = input_domains(graph, ["ids"], [ids], {})
    assert (dom.kind, dom.high) == ("index", 1000)
    with pytest.raises(kiln.TraceCheckError, match="refuses"):
        _check(graph, model, (ids,))
    # A user range wins: ids below 10 only, where the trace holds.
    _check(graph, model, (ids,), ranges={"ids": (0, 10)})


def test_binary_examples_draw_both_values_and_padding():
    from kiln.frontend.trace import _binary

    gen = torch.Generator().manual_seed(0)
    for k in range(4):
        m = _binary([3, 8], k, gen)
        assert set(m.unique().tolist()) == {0, 1}
    padded = _binary([3, 8], 1, gen)
    assert all(row.tolist() == sorted(row.tolist(), reverse=True) and row[0] == 1 for row in padded)


def test_scalars_take_several_values():
    def fn(n):
        return torch.arange(6) * int(n)  # baked: right for n == 6 only

    n = torch.tensor(6)
    with pytest.raises(kiln.TraceCheckError, match=r"refuses .*int\(tensor\).*gave 6 while the model was traced; this input gives 13"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kiln.TraceWarning)
            kiln.trace(fn, (n,))


def test_draws_the_model_rejects_fall_back_to_the_example_range():
    class Picky(nn.Module):
        def forward(self, k):
            if bool(k.max() > 20):
                raise ValueError("k must be at most 20")
            return k * 2

    kiln.trace(Picky(), (torch.tensor([3, 9, 14]),))  # the wide draw raises; the example range passes


def test_case3_torchvision_resnet50_passes_the_check():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.resnet50(weights=None).eval()
    graph = kiln.trace(model, (torch.randn(1, 3, 224, 224),))  # logits ~1e2: failed the elementwise check
    assert not [n for n in graph.walk() if n.op == "Guard"]

"""Tensor-creation mappings (frontend/torch_ops/creation.py): sizes and bounds taken from symbolic
dims stay symbolic (the graph runs at other batch sizes / sequence lengths), dtypes follow
torch's, Python data becomes constants (or shape ops when it holds sizes), random ops refuse."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
from kiln import UnsupportedOpError  # noqa: E402
from kiln.ir import evaluate  # noqa: E402

from frontend_helpers import check_traced, op_types  # noqa: E402

X = torch.randn(2, 3, 4)
OTHERS = [(torch.randn(1, 3, 4),), (torch.randn(5, 3, 4),)]
SEQ = {"x": {0: "batch", 1: "seq"}}
SEQ_OTHERS = [(torch.randn(1, 1, 4),), (torch.randn(4, 6, 4),)]


def dyn(fn, x=X, others=OTHERS):
    return check_traced(fn, (x,), dynamic_batch=True, other_inputs=others)


# ---------------------------------------------------------------------------- arange
@pytest.mark.parametrize("fn", [
    lambda x: torch.arange(x.size(1)), lambda x: torch.arange(x.size(0)), lambda x: torch.arange(1, x.size(1) + 1),
    lambda x: torch.arange(x.size(1) - 1, -1, -1), lambda x: torch.arange(0, x.size(1), 2),
    lambda x: torch.arange(end=x.size(1)), lambda x: torch.arange(x.size(1), dtype=torch.float32),
    lambda x: torch.arange(0, x.size(1), 0.5), lambda x: torch.arange(x.size(1)).float() / x.size(1),
    lambda x: torch.arange(5), lambda x: torch.arange(0, 1, 0.1), lambda x: torch.arange(-2.5, 3, 1.25),
    lambda x: torch.arange(4, dtype=torch.int32), lambda x: torch.arange(3.0), lambda x: torch.arange(0, 7, 3),
])
def test_arange(fn):
    check_traced(fn, (X,), dynamic=SEQ, other_inputs=SEQ_OTHERS)


def test_arange_of_a_symbolic_size_is_a_range_with_a_runtime_limit():
    g = check_traced(lambda x: x + torch.arange(x.size(1))[:, None], (X,), dynamic=SEQ, other_inputs=SEQ_OTHERS)
    assert "Range" in op_types(g) and g.outputs[0].type.shape == ("batch", "seq", 4)


# ---------------------------------------------------------------------------- filled tensors
@pytest.mark.parametrize("fn", [
    lambda x: torch.zeros(x.size(0), 4), lambda x: torch.zeros((x.size(0), 4)), lambda x: torch.ones(x.shape),
    lambda x: torch.ones(x.size()), lambda x: torch.zeros(size=(2, x.size(1))), lambda x: torch.ones(3, 2),
    lambda x: torch.full((x.size(0), 1), 2.5), lambda x: torch.full((2,), True), lambda x: torch.full((2, 2), 7),
    lambda x: torch.full((x.size(1), x.size(1)), float("-inf")).triu(1), lambda x: torch.full([x.size(0)], x.size(1)),
    lambda x: torch.zeros(x.size(0), 2, dtype=torch.int64), lambda x: torch.ones(x.size(1), dtype=torch.bool),
    lambda x: torch.empty(x.size(0), 3).zero_(), lambda x: torch.empty(2, x.size(1)).fill_(x.size(0)),
    lambda x: x.clone().fill_(x[0, 0, 0]), lambda x: x.new_empty(x.size(0), 2, dtype=torch.int64).fill_(3),
    lambda x: torch.zeros_like(x), lambda x: torch.ones_like(x, dtype=torch.int32), lambda x: torch.full_like(x, 7),
    lambda x: torch.full_like(x[:, 0], x.size(1)), lambda x: torch.zeros_like(x, dtype=torch.bool),
    lambda x: x.new_zeros(x.shape[0], 4), lambda x: x.new_zeros((x.size(1),)), lambda x: x.new_ones(2, 3),
    lambda x: x.new_ones(x.size(), dtype=torch.int64), lambda x: x.new_full((x.size(0), 2), -1.0),
    lambda x: x.new_full((3,), 1, dtype=torch.int32),
])
def test_filled(fn):
    check_traced(fn, (X,), dynamic=SEQ, other_inputs=SEQ_OTHERS)


def test_fill_through_a_view_is_written_back_to_the_base():
    """torchvision's swin_v2: ``qkv_bias = qkv_bias.clone(); qkv_bias[n:2 * n].zero_()``."""
    def f(x):
        y = x.clone()
        y[:, 0].fill_(1.0)
        n = y.size(1) // 3
        y[:, n:2 * n].zero_()
        return y

    check_traced(f, (X,), dynamic=SEQ, other_inputs=SEQ_OTHERS)


def test_fill_through_a_view_leaves_other_views_stale():
    def f(x):
        y = x.clone()
        other = y[:, 0]
        y[:, :2].fill_(1.0)
        return other  # eager sees the write through y; kiln's graph would not

    with pytest.raises(UnsupportedOpError, match="shares memory with one filled in place"):
        kiln.trace(f, X, check=False)


def test_empty_has_the_right_shape_and_dtype():
    def f(x):
        return torch.empty(x.size(0), 3), torch.empty_like(x, dtype=torch.int64), x.new_empty(x.size(0), 2)

    g = kiln.trace(f, X, dynamic_batch=True, check=False, optimize=False)
    outs = evaluate(g, {"x": torch.randn(5, 3, 4).numpy()})
    assert [o.shape for o in outs] == [(5, 3), (5, 3, 4), (5, 2)]
    assert [o.dtype for o in outs] == [np.float32, np.int64, np.float32]


def test_like_reads_the_input_shape():
    g = dyn(lambda x: torch.zeros_like(x))
    assert op_types(g)[:2] == ["Shape", "ConstantOfShape"]
    g = check_traced(lambda x: torch.zeros_like(x), (X,))
    assert "Shape" not in op_types(g)  # static: a constant shape


# ---------------------------------------------------------------------------- from Python data
@pytest.mark.parametrize("fn", [
    lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), lambda x: torch.tensor([[1, 2], [3, 4]]),
    lambda x: torch.tensor(3.5), lambda x: torch.tensor([x.size(0), 4]), lambda x: torch.tensor(x.size(0)),
    lambda x: torch.as_tensor([x.size(0), x.size(1)], dtype=torch.float32), lambda x: torch.as_tensor(x),
    lambda x: torch.as_tensor(x, dtype=torch.float64), lambda x: torch.tensor([[x.size(1)], [2]]),
    lambda x: torch.asarray([1, 2]), lambda x: torch.scalar_tensor(x.size(0)), lambda x: x.new_tensor([1, 2]),
    lambda x: x.new_tensor([x.size(0)]), lambda x: x + torch.from_numpy(np.arange(4, dtype=np.float32)),
    lambda x: torch.tensor([x[0, 0, 0], x[-1, -1, -1]]), lambda x: torch.tensor([True, False]),
])
def test_from_data(fn):
    check_traced(fn, (X,), dynamic=SEQ, other_inputs=SEQ_OTHERS)


# ---------------------------------------------------------------------------- eye
@pytest.mark.parametrize("fn", [
    lambda x: torch.eye(3), lambda x: torch.eye(2, 4), lambda x: torch.eye(x.size(1)),
    lambda x: torch.eye(x.size(1), 3, dtype=torch.bool), lambda x: x @ torch.eye(4),
])
def test_eye(fn):
    check_traced(fn, (X,), dynamic=SEQ, other_inputs=SEQ_OTHERS)


# ---------------------------------------------------------------------------- random: refused
@pytest.mark.parametrize("fn", [
    lambda x: torch.randn(2, 3), lambda x: torch.rand(x.size(0)), lambda x: torch.randint(0, 5, (2,)),
    lambda x: torch.rand_like(x), lambda x: torch.randn_like(x), lambda x: torch.randperm(4),
    lambda x: x.clone().uniform_(), lambda x: torch.bernoulli(x.sigmoid()),
])
def test_random_ops_are_refused(fn):
    with pytest.raises(UnsupportedOpError, match="draws random numbers.*pass them in as an input"):
        kiln.trace(fn, X, check=False)


@pytest.mark.parametrize("indexing", ["ij", "xy"])
def test_meshgrid(indexing):
    """transformers' BEiT (relative position index): torch.meshgrid of aranges; also sizes from a
    symbolic dim and a 0-D tensor among the inputs."""
    def f(x, y, s):
        a, b, c = torch.meshgrid(x, y, s, indexing=indexing)
        (d, e) = torch.meshgrid([torch.arange(x.size(0), dtype=y.dtype), y], indexing=indexing)
        return a * 2 + b - c, d * 3 + e

    check_traced(f, (torch.randn(3), torch.randn(4), torch.tensor(0.5)), dynamic={"x": {0: "n"}},
                 other_inputs=[(torch.randn(5), torch.randn(4), torch.tensor(-1.0))])

"""Tracing reductions (frontend/torch_ops/reduce.py): dim None / int / tuple / negative,
keepdim, the result dtype torch picks, (values, indices) pairs, var/std corrections over a
symbolic batch, compared with torch eager at two batch sizes; diff (n, dim, prepend/append,
bool xor, integer dtypes, a symbolic dim) through the evaluator and the CPU runtime."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from frontend_helpers import check_traced, op_types  # noqa: E402

import kiln  # noqa: E402

gen = torch.Generator().manual_seed(3)


def randn(*shape):
    return torch.randn(*shape, generator=gen)


def distinct(*shape):
    """A random permutation of distinct floats (max/argmax/topk have no ties to break)."""
    n = 1
    for s in shape:
        n *= s
    return (torch.randperm(n, generator=gen).float() - n / 2).reshape(shape) / 4


def ints(*shape, dtype=torch.int64):
    return torch.randint(-5, 6, shape, generator=gen).to(dtype)


def check_batched(fn, make, *, rtol=1e-5, atol=1e-6):
    return check_traced(fn, make(3), dynamic_batch=True, other_inputs=[make(5)], rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- sum, mean, prod
SUM_MEAN = {
    "sum_all": lambda x: (x.sum(), torch.sum(x), x.sum(dim=None, keepdim=True)),
    "sum_dim": lambda x: (x.sum(1), torch.sum(x, dim=-1), x.sum(0), torch.sum(x, 2, keepdim=True)),
    "sum_tuple": lambda x: (x.sum((0, 2), keepdim=True), x.sum(dim=[-1, 1]), x.sum(dim=())),
    "sum_dtype": lambda x: (x.sum(dtype=torch.float64), torch.sum(x, 1, dtype=torch.float64)),
    "mean_all": lambda x: (x.mean(), torch.mean(x), x.mean(dtype=torch.float64)),
    "mean_dim": lambda x: (x.mean(-1), torch.mean(x, (1, 2), keepdim=True), x.mean(dim=0)),
    "prod": lambda x: (x.prod(), torch.prod(x, 1), x.prod(-1, keepdim=True), x.prod(dtype=torch.float64)),
    "count_nonzero": lambda x: (torch.count_nonzero(x.round()), x.round().count_nonzero(1)),
}


@pytest.mark.parametrize("name", sorted(SUM_MEAN))
def test_sum_mean_prod(name):
    check_batched(SUM_MEAN[name], lambda b: (randn(b, 3, 4),), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_integer_sum_promotes_to_int64(dtype):
    check_batched(lambda a: (a.sum(), a.sum(1), torch.prod(a, 0), a.cumsum(1)),
                  lambda b: (ints(b, 4, dtype=torch.int64).abs().to(dtype),))


def test_int_mean_with_dtype():
    check_batched(lambda a: a.mean(1, dtype=torch.float32), lambda b: (ints(b, 4),))


def test_scalar_input_accepts_dim_zero():
    x = torch.tensor(2.5)
    check_traced(lambda x: (x.sum(0), x.mean(-1), x.amax(0), x.argmax(0), x.cumsum(0), x.max()), (x,))


# ---------------------------------------------------------------------------- max, min
MAX_MIN = {
    "amax_amin": lambda x: (x.amax(), torch.amax(x, 1), x.amin((0, 2)), torch.amin(x, -1, keepdim=True)),
    "global": lambda x: (x.max(), torch.min(x)),
    "with_dim": lambda x: (*x.max(1), *torch.min(x, -1), *x.max(dim=2, keepdim=True), *torch.max(x, 0)),
    "namedtuple": lambda x: (x.max(1).values, x.min(dim=1).indices, x.max(-1)[1]),
    "binary": lambda x: (torch.max(x, x * 0.5), x.min(x * 2),
                         torch.max(x, other=x - 1)),
    "argmax": lambda x: (x.argmax(), torch.argmax(x, 1), x.argmax(-1, keepdim=True), x.argmax(keepdim=True)),
    "argmin": lambda x: (x.argmin(), torch.argmin(x, 0), x.argmin(dim=2, keepdim=True)),
}


@pytest.mark.parametrize("name", sorted(MAX_MIN))
def test_max_min(name):
    check_batched(MAX_MIN[name], lambda b: (distinct(b, 3, 4),))


def test_max_along_dim_gives_values_and_indices():
    g = check_traced(lambda x: x.max(1), (distinct(2, 5),))
    assert {"ReduceMax", "ArgMax"} <= {n.op for n in g.nodes}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.uint8, torch.bool])
def test_max_min_of_other_dtypes(dtype):
    check_batched(lambda a: (a.max(), *a.min(1), a.amax(0), a.max(-1).indices, torch.max(a, a), a.min(a)),
                  lambda b: (ints(b, 4).abs().to(dtype),))


def test_max_propagates_nan_like_torch():
    x = torch.tensor([[1.0, float("nan"), 3.0], [2.0, 0.0, -1.0]])
    check_traced(lambda x: (*x.max(1), x.amin(1), x.argmin(1)), (x,))


# ---------------------------------------------------------------------------- var, std
VAR_STD = {
    "var_all": lambda x: (x.var(), torch.var(x), x.var(unbiased=False), torch.var(x, False)),
    "var_dim": lambda x: (x.var(1), x.var(-1, keepdim=True), torch.var(x, (1, 2)), x.var(1, False)),
    "var_correction": lambda x: (x.var(dim=1, correction=0), torch.var(x, 2, correction=2, keepdim=True)),
    "var_batch_dim": lambda x: (x.var(0), x.std((0, 1)), x.var(dim=None, correction=0)),
    "std": lambda x: (x.std(), x.std(-1), torch.std(x, 1, keepdim=True), x.std(2, unbiased=False)),
    "var_mean": lambda x: (*torch.var_mean(x, 1), *torch.var_mean(x, (0, 2), keepdim=True, correction=0)),
    "std_mean": lambda x: (*torch.std_mean(x), *torch.std_mean(x, -1, unbiased=False)),
}


@pytest.mark.parametrize("name", sorted(VAR_STD))
def test_var_std(name):
    check_batched(VAR_STD[name], lambda b: (randn(b, 3, 4),), rtol=1e-5, atol=1e-5)


class HandLayerNorm(torch.nn.Module):
    """The LayerNorm of many hand-written transformers: mean/var over the last dim."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.bias = torch.nn.Parameter(torch.linspace(-0.1, 0.1, d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.weight + self.bias


def test_hand_written_layer_norm():
    m = HandLayerNorm(8)
    check_batched(m, lambda b: (randn(b, 5, 8),), rtol=1e-5, atol=1e-5)
    ref = torch.nn.LayerNorm(8)
    with torch.no_grad():
        ref.weight.copy_(m.weight)
        ref.bias.copy_(m.bias)
    x = randn(4, 5, 8)
    torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-5)


def test_var_over_symbolic_batch_counts_at_run_time():
    # The divisor N - 1 comes from the batch size: a constant would be wrong at batch 5.
    g = check_batched(lambda x: x.var(0), lambda b: (randn(b, 4),))
    assert g.inputs[0].type.shape[0] == "batch"
    assert "Shape" in {n.op for n in g.nodes}


# ---------------------------------------------------------------------------- norms
NORMS = {
    "norm_default": lambda x: (x.norm(), torch.norm(x), torch.linalg.vector_norm(x)),
    "norm_dim": lambda x: (x.norm(dim=1), torch.norm(x, dim=-1, keepdim=True), x.norm(2, (1, 2))),
    "norm_p": lambda x: (x.norm(p=1, dim=1), torch.norm(x, 3, dim=2), x.norm(float("inf"), dim=1),
                         x.norm(float("-inf"), dim=1), x.norm(0, dim=2)),
    "vector_norm": lambda x: (torch.linalg.vector_norm(x, 2, -1), torch.linalg.vector_norm(x, ord=1, dim=(1, 2)),
                              torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True),
                              torch.linalg.vector_norm(x, 0.5, dim=2)),
    "fro": lambda x: (torch.norm(x, "fro", dim=(1, 2)), x.norm(p="fro")),
}


@pytest.mark.parametrize("name", sorted(NORMS))
def test_norms(name):
    check_batched(NORMS[name], lambda b: (randn(b, 3, 4),), rtol=1e-5, atol=1e-5)


def test_nuclear_norm_is_refused():
    with pytest.raises(kiln.UnsupportedOpError, match="norm with p='nuc'"):
        kiln.trace(lambda x: torch.norm(x, "nuc", dim=(0, 1)), randn(3, 3), check=False)


# ---------------------------------------------------------------------------- cumsum, topk, logsumexp
def test_cumsum():
    def fn(x):
        return x.cumsum(1), torch.cumsum(x, 0), torch.cumsum(x, -1, dtype=torch.float64), x.clone().cumsum_(1)

    check_batched(fn, lambda b: (randn(b, 4),))


# ---------------------------------------------------------------------------- diff
def check_diff(fn, inputs, *, dynamic=None, other_inputs=()):
    """check_traced (the reference evaluator) plus the CPU runtime: kiln.load(graph).run must
    agree with torch eager, values and dtypes, on every input set."""
    graph = check_traced(fn, inputs, dynamic=dynamic, other_inputs=other_inputs)
    program = kiln.load(graph)
    for xs in [inputs, *other_inputs]:
        want = fn(*xs)
        want = want if isinstance(want, tuple) else (want,)
        got = program.run([x.numpy() for x in xs], as_list=True)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.numpy().dtype and g.shape == tuple(w.shape)
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-6, atol=1e-6)
    return graph


DIFF = {
    "last_dim": lambda x: (torch.diff(x), x.diff(), torch.diff(x, dim=-1)),
    "dims": lambda x: (torch.diff(x, dim=0), x.diff(dim=1), torch.diff(x, 1, -3), x.diff(dim=-2)),
    "n": lambda x: (torch.diff(x, n=2), x.diff(3, 1), torch.diff(x, n=2, dim=0)),
    "n_beyond_size": lambda x: (torch.diff(x, n=6), x.diff(n=9, dim=1)),  # empty along dim, as torch
    "n_zero": lambda x: (torch.diff(x, n=0, prepend=x[..., :2]), x.int().diff(0, append=x)),  # x itself
    "prepend": lambda x: (torch.diff(x, prepend=x[..., :1] - 1), x.diff(dim=0, prepend=x[:2] * 2)),
    "append": lambda x: (torch.diff(x, dim=1, append=x[:, -1:] + 3), x.diff(2, -1, append=x)),
    "both": lambda x: torch.diff(x, n=2, dim=-2, prepend=x[:, :1], append=x[:, :3] - 1),
}


@pytest.mark.parametrize("name", sorted(DIFF))
def test_diff(name):
    check_diff(DIFF[name], (randn(2, 4, 5),))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.float64,
                                   torch.float16])
def test_diff_dtypes(dtype):
    """Integers subtract in their own dtype (uint8 wraps around, as torch); float16 stays float16."""
    x = ints(3, 6, dtype=torch.int64).mul(40).to(dtype)
    check_diff(lambda x: (torch.diff(x), x.diff(n=2, dim=0), torch.diff(x, prepend=x[:, :1], append=x)), (x,))


def test_diff_bool_is_xor():
    x = torch.rand(3, 7, generator=gen) > 0.5
    graph = check_diff(lambda x: (torch.diff(x), x.diff(n=3, dim=0), torch.diff(x, append=x[:, :2]),
                                  torch.diff(x, n=2, prepend=~x[:, -1:])), (x,))
    assert "Xor" in op_types(graph) and "Sub" not in op_types(graph)


def test_diff_promotes_prepend_append_like_cat():
    x, f = ints(2, 5), randn(2, 1)
    b = torch.rand(2, 3, generator=gen) > 0.5
    check_diff(lambda x, f, b: (torch.diff(x, prepend=f), x.diff(append=f.double()), torch.diff(b, append=x[:, :1]),
                                torch.diff(b, prepend=f)), (x, f, b))


def test_diff_dynamic_dim():
    """A symbolic size along dim (and off it) stays symbolic: the graph runs at other sizes,
    sizes 1 and 2 included (smaller than n: an empty result, as torch gives)."""
    def fn(x):
        return (torch.diff(x, prepend=x[:, :1] - 1, dim=-1), x.diff(n=2, dim=1), torch.diff(x, dim=0),
                torch.diff(x, n=3, dim=-1, append=x), (x > 0).diff(n=2, dim=1))

    graph = check_diff(fn, (ints(2, 7),), dynamic={"x": {0: "batch", 1: "seq"}},
                       other_inputs=[(ints(4, 12),), (ints(1, 1),), (ints(3, 2),)])
    assert graph.inputs[0].type.shape == ("batch", "seq")
    assert not any(n.op == "Shape" for n in graph.nodes)  # no size read: the bounds are end-relative


TOPK = {
    "largest": lambda x: (*x.topk(2), *torch.topk(x, 3, dim=1)),
    "smallest": lambda x: tuple(torch.topk(x, 2, largest=False)),
    "dim0": lambda x: tuple(torch.topk(x, 2, dim=0)),
    "namedtuple": lambda x: (x.topk(1, dim=-1).values, x.topk(2, 1, True, True).indices),
    "k_from_batch": lambda x: tuple(x.topk(x.size(0), dim=1)),
}


@pytest.mark.parametrize("name", sorted(TOPK))
def test_topk(name):
    check_batched(TOPK[name], lambda b: (distinct(b, 8),))


def test_topk_unsorted_gives_the_same_set():
    x = distinct(3, 8)
    g = kiln.trace(lambda x: torch.topk(x, 3, sorted=False), x, check=False, optimize=False)
    values, _ = kiln.ir.evaluate(g, [x.numpy()])
    want = torch.topk(x, 3, sorted=False).values
    torch.testing.assert_close(torch.from_numpy(values).sort(1).values, want.sort(1).values)


def test_logsumexp():
    def fn(x):
        return (x.logsumexp(1), torch.logsumexp(x, (0, 2), keepdim=True), torch.special.logsumexp(x, -1),
                x.logsumexp(dim=2, keepdim=True))

    check_batched(fn, lambda b: (randn(b, 3, 4) * 30,))


def test_logsumexp_of_infinities():
    inf = float("inf")
    x = torch.tensor([[-inf, -inf], [inf, 1.0], [0.0, -inf]])
    check_traced(lambda x: torch.logsumexp(x, 1), (x,))


# ---------------------------------------------------------------------------- all, any
ALL_ANY = {
    "bool": lambda x: ((x > 0).all(), (x > 0).any(), torch.all(x > 0, 1), torch.any(x > -1, dim=-1, keepdim=True)),
    "float_input": lambda x: (x.round().all(), torch.any(x.round(), 0)),
    "uint8_keeps_dtype": lambda x: ((x > 0).to(torch.uint8).all(1), (x > 0).byte().any()),
    "tuple_dims": lambda x: ((x > 0).all((0, 1)), (x > 0).any(dim=(1,)), (x > 0).all(dim=())),
}


@pytest.mark.parametrize("name", sorted(ALL_ANY))
def test_all_any(name):
    check_batched(ALL_ANY[name], lambda b: (randn(b, 4) + 0.8,))

"""Tracing matrix products: matmul and its aliases, addmm/baddbmm/addmv, einsum, outer, inner,
bilinear; each against torch eager, at a second batch size where the batch is dynamic."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from frontend_helpers import check_traced, op_types  # noqa: E402


def _r(*shape):
    return torch.randn(*shape)


def _ops(g) -> list:
    """The graph's ops less the Identity nodes that name its outputs."""
    return [o for o in op_types(g) if o != "Identity"]


@pytest.mark.parametrize("fn", [
    lambda a, b: a @ b,
    lambda a, b: torch.matmul(a, b),
    lambda a, b: a.matmul(b),
])
def test_matmul_aliases_batched(fn):
    w = _r(5, 3)
    g = check_traced(lambda a: fn(a, w), (_r(2, 4, 5),), dynamic_batch=True, other_inputs=[(_r(3, 4, 5),)])
    assert _ops(g) == ["MatMul"]


def test_rmatmul_with_a_non_tensor_left_operand():
    w = _r(3, 4)

    def fn(a):
        return torch.Tensor.__rmatmul__(a, w)

    check_traced(fn, (_r(2, 4, 5),), dynamic_batch=True, other_inputs=[(_r(1, 4, 5),)])


@pytest.mark.parametrize("shapes", [((3,), (3,)), ((3,), (3, 4)), ((2, 3), (3,)), ((2, 5, 3), (3,)),
                                    ((3,), (2, 3, 4))])
def test_matmul_one_dimensional_operands(shapes):
    a, b = (_r(*s) for s in shapes)
    check_traced(lambda x, y: torch.matmul(x, y), (a, b))


def test_mm_bmm_mv_dot():
    check_traced(lambda a, b: torch.mm(a, b) + a.mm(b), (_r(2, 3), _r(3, 4)), dynamic_batch=False)
    check_traced(lambda a, b: torch.bmm(a, b) + a.bmm(b), (_r(2, 3, 4), _r(2, 4, 5)), dynamic_batch=True,
                 other_inputs=[(_r(4, 3, 4), _r(4, 4, 5))])
    check_traced(lambda a, v: torch.mv(a, v) + a.mv(v), (_r(2, 3), _r(3)))
    check_traced(lambda a, b: torch.dot(a, b) + a.dot(b), (_r(5), _r(5)))


def test_inner_and_outer():
    check_traced(lambda a, b: torch.inner(a, b), (_r(2, 3, 4), _r(5, 4)))
    check_traced(lambda a, b: a.inner(b), (_r(4), _r(4)))
    check_traced(lambda a, b: torch.outer(a, b) + a.ger(b) + a.outer(b), (_r(3), _r(4)))


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1)])
def test_addmm_is_one_gemm(beta, alpha):
    bias = _r(4)

    def fn(x, w):
        return torch.addmm(bias, x, w, beta=beta, alpha=alpha)

    g = check_traced(fn, (_r(3, 5), _r(5, 4)), dynamic={"x": {0: "batch"}}, other_inputs=[(_r(6, 5), _r(5, 4))])
    assert _ops(g) == ["Gemm"]


def test_addmm_with_nan_input_and_beta_zero_ignores_it():
    bias = torch.full((4,), float("nan"))
    check_traced(lambda x, w: bias.addmm(x, w, beta=0), (_r(3, 5), _r(5, 4)))


def test_addmm_inplace():
    def fn(c, x, w):
        c = c.clone()
        c.addmm_(x, w, alpha=0.5)
        return c

    check_traced(fn, (_r(3, 4), _r(3, 5), _r(5, 4)))


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.25, 3.0), (0, 0.5)])
def test_baddbmm(beta, alpha):
    def fn(c, a, b):
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha) + c.baddbmm(a, b)

    check_traced(fn, (_r(2, 3, 4), _r(2, 3, 5), _r(2, 5, 4)), dynamic_batch=True,
                 other_inputs=[(_r(5, 3, 4), _r(5, 3, 5), _r(5, 5, 4))])


def test_baddbmm_broadcast_input():
    check_traced(lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.3), (_r(1, 4), _r(2, 3, 5), _r(2, 5, 4)))


def test_addmv():
    check_traced(lambda c, m, v: torch.addmv(c, m, v, beta=2, alpha=0.5), (_r(3), _r(3, 4), _r(4)))


@pytest.mark.parametrize("eq,shapes", [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("b h i d, b h j d -> b h i j", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,jk", [(2, 3, 4), (4, 5)]),
    ("ii->i", [(3, 3)]),
    ("i,i->", [(3,), (3,)]),
])
def test_einsum(eq, shapes):
    tensors = [_r(*s) for s in shapes]
    check_traced(lambda *xs: torch.einsum(eq, *xs), tensors)


def test_einsum_list_and_sublist_forms():
    a, b = _r(2, 3), _r(3, 4)
    check_traced(lambda x, y: torch.einsum("ij,jk->ik", [x, y]), (a, b))
    check_traced(lambda x, y: torch.einsum(x, [0, 1], y, [1, 2], [0, 2]), (a, b))
    check_traced(lambda x, y: torch.einsum(x, [Ellipsis, 1], y, [1, 2]), (a, b))


def test_einsum_dynamic_batch():
    w = _r(4, 5)
    check_traced(lambda x: torch.einsum("bij,jk->bik", x, w), (_r(2, 3, 4),), dynamic_batch=True,
                 other_inputs=[(_r(7, 3, 4),)])


@pytest.mark.parametrize("dims,shapes", [(2, [(2, 3, 4), (3, 4, 5)]), (0, [(2,), (3,)]), (1, [(2, 3), (3, 4)]),
                                         (([1, 0], [0, 1]), [(3, 4, 2), (4, 3, 5)]), (([-1], [0]), [(2, 3), (3,)])])
def test_tensordot(dims, shapes):
    check_traced(lambda a, b: torch.tensordot(a, b, dims=dims), [_r(*s) for s in shapes])


def test_linalg_matmul():
    check_traced(lambda a, b: torch.linalg.matmul(a, b), (_r(2, 3, 4), _r(4, 2)))


def test_bilinear():
    m = torch.nn.Bilinear(3, 4, 5).eval()
    check_traced(m, (_r(2, 3), _r(2, 4)), dynamic_batch=True, other_inputs=[(_r(6, 3), _r(6, 4))])
    w = _r(5, 3, 4)
    check_traced(lambda a, b: F.bilinear(a, b, w), (_r(2, 7, 3), _r(2, 7, 4)))


def test_linear_module_dynamic_batch():
    m = torch.nn.Linear(4, 3).eval()
    check_traced(m, (_r(2, 5, 4),), dynamic_batch=True, other_inputs=[(_r(3, 5, 4),)])

"""Tracing comparisons, boolean logic, where/masked_fill, NaN/inf tests, dtype conversions and
copies (frontend/torch_ops/logic.py), compared with torch eager at two batch sizes."""
import pytest

torch = pytest.importorskip("torch")

from frontend_helpers import check_traced  # noqa: E402

import kiln  # noqa: E402

gen = torch.Generator().manual_seed(1)


def randn(*shape):
    return torch.randn(*shape, generator=gen)


def ints(*shape):
    return torch.randint(-3, 4, shape, generator=gen)


def check_batched(fn, make):
    return check_traced(fn, make(3), dynamic_batch=True, other_inputs=[make(5)])


def floats_with_ties(b):
    """Two float tensors that agree in some places (so ==, <=, >= see equal elements)."""
    x = torch.round(randn(b, 4))
    return x, torch.round(randn(b, 4))


# ---------------------------------------------------------------------------- comparisons
COMPARE = {
    "eq": lambda x, y: (x == y, torch.eq(x, y), x.eq(y), x == 0),
    "ne": lambda x, y: (x != y, torch.ne(x, y), x.ne(y), torch.not_equal(x, 1.0)),
    "lt": lambda x, y: (x < y, torch.lt(x, y), x.lt(y), torch.less(x, y), 0 > x),
    "le": lambda x, y: (x <= y, torch.le(x, y), x.less_equal(y)),
    "gt": lambda x, y: (x > y, torch.gt(x, y), x.gt(0.5), torch.greater(x, y), 1 < x),
    "ge": lambda x, y: (x >= y, torch.ge(x, y), x.greater_equal(y), 0 <= x),
    "in_place": lambda x, y: (x.clone().lt_(y), x.clone().eq_(y), x.clone().ne_(0)),
    "int_vs_float": lambda x, y: (x.long() < 0.5, x.long() == y, x.int() >= y.long()),
    "bool_operands": lambda x, y: ((x > 0) < (y > 0), (x > 0) == (y > 0), (x > 0) != True),  # noqa: E712
}


@pytest.mark.parametrize("name", sorted(COMPARE))
def test_compare(name):
    check_batched(COMPARE[name], floats_with_ties)


def test_ne_is_true_for_nan():
    x = torch.tensor([float("nan"), 1.0, 2.0])
    check_traced(lambda x: (x != x, x == x, x != 1.0), (x,))


# ---------------------------------------------------------------------------- logic
LOGIC = {
    "logical_and": lambda x, y: (torch.logical_and(x, y), x.logical_and(y > 0), x.clone().logical_and_(y)),
    "logical_or": lambda x, y: (torch.logical_or(x, y), (x > 0).logical_or(y > 0)),
    "logical_xor": lambda x, y: (torch.logical_xor(x, y), x.logical_xor(y)),
    "logical_not": lambda x, y: (torch.logical_not(x), (x > 0).logical_not(), x.clone().logical_not_()),
    "bitwise_bool": lambda x, y: ((x > 0) & (y > 0), (x > 0) | (y > 0), (x > 0) ^ (y > 0), ~(x > 0),
                                  torch.bitwise_and(x > 0, y < 0), (x > 0).bitwise_or(y > 0),
                                  torch.bitwise_xor(x > 0, y > 0), torch.bitwise_not(x > 0)),
    "bitwise_reflected": lambda x, y: (True & (x > 0), False | (y > 0), True ^ (x > 0)),
}


@pytest.mark.parametrize("name", sorted(LOGIC))
def test_logic(name):
    check_batched(LOGIC[name], floats_with_ties)


def test_bitwise_in_place_on_bool():
    def fn(x, y):
        a = x > 0
        a &= y > 0
        b = x > 0
        b |= y > 0
        c = x > 0
        c ^= y > 0
        return a, b, c

    check_batched(fn, floats_with_ties)


def test_bitwise_on_ints_is_refused():
    with pytest.raises(kiln.UnsupportedOpError, match="bitwise and on torch.int64"):
        kiln.trace(lambda a: a & 3, ints(2, 3), check=False)


# ---------------------------------------------------------------------------- where, masked_fill
WHERE = {
    "where": lambda x, y: torch.where(x > y, x, y),
    "where_scalars": lambda x, y: (torch.where(x > 0, x, 0.0), torch.where(x > 0, 1.0, -1.0)),
    "where_broadcast": lambda x, y: torch.where(x > 0, x, Y0),
    "tensor_where": lambda x, y: x.where(x > 0, y),
    "where_promotes": lambda x, y: torch.where(x > 0, x.long(), y),
    "masked_fill": lambda x, y: (x.masked_fill(x > y, float("-inf")), torch.masked_fill(x, y < 0, 2)),
    "masked_fill_tensor_value": lambda x, y: x.masked_fill(y > 0, SEVEN),
    "masked_fill_broadcast_mask": lambda x, y: x.masked_fill(MASK, 0.0),
    "masked_fill_in_place": lambda x, y: x.clone().masked_fill_(x < 0, 0.5),
}
Y0 = torch.tensor([1.0, -2.0, 3.0, -4.0])  # a constant broadcast against the batch
MASK = torch.tensor([True, False, True, False])
SEVEN = torch.tensor(7.0)


@pytest.mark.parametrize("name", sorted(WHERE))
def test_where(name):
    check_batched(WHERE[name], floats_with_ties)


def test_one_argument_where_is_refused():
    with pytest.raises(kiln.UnsupportedOpError, match="torch.where.condition. with one argument"):
        kiln.trace(lambda x: torch.where(x > 0)[0], randn(4), check=False)


# ---------------------------------------------------------------------------- classification
SPECIAL = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, 1.5, -2.0]])


def test_nan_inf_tests():
    check_traced(lambda x: (torch.isnan(x), x.isnan(), torch.isinf(x), x.isinf(), torch.isfinite(x),
                            x.isfinite(), torch.isposinf(x), x.isneginf()), (SPECIAL.repeat(2, 1),),
                 dynamic_batch=True, other_inputs=[(SPECIAL.repeat(4, 1),)])


def test_nan_inf_tests_on_ints():
    check_batched(lambda a: (a.isnan(), torch.isinf(a), a.isfinite()), lambda b: (ints(b, 3),))


# ---------------------------------------------------------------------------- conversions, copies
CONVERT = {
    "to_dtype": lambda x: (x.to(torch.float64), x.to(dtype=torch.float16), x.to(torch.int64)),
    "to_device": lambda x: x.to("cpu") + x.to(torch.device("cpu"), torch.float32) + x.cpu(),
    "to_other": lambda x: x.to(OTHER),
    "shorthands": lambda x: (x.float(), x.double(), x.half(), x.long(), x.int(), x.short(), x.char(),
                             x.abs().byte(), x.bool(), x.bfloat16()),
    "type_as": lambda x: (x.type_as(OTHER), (x > 0).type_as(x)),
    "copies": lambda x: x.detach() + x.clone() + x.contiguous() + torch.clone(x) + torch.detach(x),
    "same_dtype": lambda x: x.to(torch.float32) + x.float(),
    "type": lambda x: x.type(torch.float64) + (1.0 if x.type() == "torch.FloatTensor" else 0.0),
    "bool_to_float": lambda x: (x > 0).float() + (x > 0).to(torch.float32),
}
OTHER = torch.zeros(1, dtype=torch.int32)


@pytest.mark.parametrize("name", sorted(CONVERT))
def test_convert(name):
    check_batched(CONVERT[name], lambda b: (randn(b, 4) * 3,))


def test_same_dtype_conversions_add_no_node():
    g = check_traced(lambda x: x.to(torch.float32).float().contiguous().detach(), (randn(2, 3),))
    assert [n.op for n in g.nodes] == ["Identity"]

"""Tracing elementwise arithmetic and math (frontend/torch_ops/elementwise.py): every alias
(function, method, operator, reflected operator, in-place), int and float rounding semantics,
compared with torch eager at two batch sizes."""
import pytest

torch = pytest.importorskip("torch")

from frontend_helpers import check_traced, op_types  # noqa: E402

gen = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=gen)


def away_from_zero(*shape):
    """Floats with |v| in [0.5, 2.5): safe divisors."""
    sign = torch.where(torch.rand(*shape, generator=gen) > 0.5, 1.0, -1.0)
    return sign * (0.5 + 2 * torch.rand(*shape, generator=gen))


def ints(*shape, low=-20, high=21):
    return torch.randint(low, high, shape, generator=gen)


def nonzero_ints(*shape):
    v = torch.randint(1, 6, shape, generator=gen)
    return torch.where(torch.rand(*shape, generator=gen) > 0.5, v, -v)


def check_batched(fn, make, *, rtol=1e-5, atol=1e-6):
    """Trace fn on make(3) with a symbolic batch and compare at batch 3 and batch 5."""
    return check_traced(fn, make(3), dynamic_batch=True, other_inputs=[make(5)], rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- float binary
FLOAT_BINARY = {
    "torch.div": lambda x, y: torch.div(x, y),
    "Tensor.div": lambda x, y: x.div(y),
    "truediv": lambda x, y: x / y,
    "true_divide": lambda x, y: torch.true_divide(x, y) + x.true_divide(y),
    "divide": lambda x, y: torch.divide(x, y),
    "div_scalar": lambda x, y: x / 2,
    "rtruediv": lambda x, y: 2 / y,
    "div_trunc": lambda x, y: torch.div(x * 4, y, rounding_mode="trunc"),
    "div_floor": lambda x, y: (x * 4).div(y, rounding_mode="floor"),
    "floordiv": lambda x, y: (x * 4) // y,
    "floor_divide": lambda x, y: torch.floor_divide(x * 4, y),
    "rfloordiv": lambda x, y: 3 // y,
    "mod": lambda x, y: (x * 4) % y,
    "rmod": lambda x, y: 5 % y,
    "remainder": lambda x, y: torch.remainder(x * 4, y) + (x * 4).remainder(1.5),
    "fmod": lambda x, y: torch.fmod(x * 4, y) + (x * 4).fmod(-1.5),
    "pow_scalar": lambda x, y: x ** 2 + x.abs() ** 0.5,
    "pow_tensor": lambda x, y: torch.pow(x.abs(), y) + x.pow(3),
    "rpow": lambda x, y: 2 ** x + torch.pow(3, y),
    "square": lambda x, y: torch.square(x) + x.square(),
    "float_power": lambda x, y: x.float_power(2),
    "maximum": lambda x, y: torch.maximum(x, y) + x.maximum(y),
    "minimum": lambda x, y: torch.minimum(x, y) + x.minimum(y),
    "lerp": lambda x, y: torch.lerp(x, y, 0.3) + x.lerp(y, y.abs()),
    "addcmul": lambda x, y: torch.addcmul(x, x, y, value=0.5) + x.addcmul(y, y),
    "addcdiv": lambda x, y: torch.addcdiv(x, x, y, value=2) + x.addcdiv(x, y),
}


@pytest.mark.parametrize("name", sorted(FLOAT_BINARY))
def test_float_binary(name):
    check_batched(FLOAT_BINARY[name], lambda b: (randn(b, 4), away_from_zero(b, 4)))


def test_float_in_place_forms():
    def fn(x, y):
        z = x.clone()
        z /= y
        z.div_(y)
        z.mul_(4)
        z //= y
        z %= y
        z.remainder_(0.7)
        z.fmod_(0.5)
        z **= 2
        z.pow_(0.5)
        z.floor_divide_(y)
        z.square_()
        z.clamp_(-1, 1)
        z.lerp_(y, 0.5)
        return z

    check_batched(fn, lambda b: (randn(b, 4) * 4, away_from_zero(b, 4)))


# ---------------------------------------------------------------------------- integer semantics
INT_BINARY = {
    "truediv_promotes": lambda a, b: a / b,
    "div_scalar_float": lambda a, b: a / 2.5,
    "floordiv": lambda a, b: a // b,
    "floordiv_scalar": lambda a, b: a // 3 + torch.floor_divide(a, -4),
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: a.div(b, rounding_mode="floor"),
    "mod": lambda a, b: a % b + a % -3,
    "rmod": lambda a, b: 7 % b,
    "fmod": lambda a, b: torch.fmod(a, b),
    "pow": lambda a, b: a ** 2 + 2 ** b.abs(),
    "pow_float_exponent": lambda a, b: a.pow(0.5 * b.abs()),
    "square": lambda a, b: a.square(),
    "maximum": lambda a, b: torch.maximum(a, b),
    "int8_pow": lambda a, b: a.to(torch.int8) ** 2,
    "uint8_neg": lambda a, b: -a.abs().to(torch.uint8),
    "sqrt_promotes": lambda a, b: a.abs().sqrt(),
    "abs_sign": lambda a, b: a.abs() + a.sign() - (-a),
    "floor_identity": lambda a, b: a.floor() + a.ceil() + a.round() + a.trunc(),
}


@pytest.mark.parametrize("name", sorted(INT_BINARY))
def test_integer_semantics(name):
    check_batched(INT_BINARY[name], lambda b: (ints(b, 6), nonzero_ints(b, 6)))


def test_integer_floor_division_all_sign_combinations():
    a = torch.tensor([7, -7, 7, -7, 6, -6, 0, 1])
    b = torch.tensor([2, 2, -2, -2, 3, -3, 5, -5])
    check_traced(lambda a, b: (a // b, a % b, torch.fmod(a, b), torch.div(a, b, rounding_mode="trunc")), (a, b))


def test_bool_maximum_is_or():
    check_traced(lambda a, b: (torch.maximum(a, b), torch.minimum(a, b)),
                 (torch.tensor([True, False, True, False]), torch.tensor([True, True, False, False])))


# ---------------------------------------------------------------------------- unary
UNARY = {
    "exp": lambda x: torch.exp(x) + x.exp(),
    "log": lambda x: torch.log(x.abs() + 0.1) + (x.abs() + 0.2).log(),
    "log1p": lambda x: torch.log1p(x.abs()) + x.abs().log1p(),
    "sqrt": lambda x: torch.sqrt(x.abs()) + x.abs().sqrt(),
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.1) + (x.abs() + 0.1).rsqrt(),
    "reciprocal": lambda x: torch.reciprocal(x) + x.reciprocal(),
    "erf": lambda x: torch.erf(x) + x.erf() + torch.special.erf(x),
    "tanh": lambda x: torch.tanh(x) + x.tanh(),
    "sigmoid": lambda x: torch.sigmoid(x) + x.sigmoid() + torch.special.expit(x),
    "sin_cos": lambda x: torch.sin(x) + x.cos() + x.sin() + torch.cos(x),
    "floor_ceil": lambda x: torch.floor(x * 3) + (x * 3).ceil() + torch.ceil(x) + (x * 3).floor(),
    "trunc": lambda x: torch.trunc(x * 3) + (x * 3).fix(),
    "round": lambda x: torch.round(x * 3) + (x * 3).round(),
    "round_decimals": lambda x: torch.round(x * 3, decimals=1) + (x * 300).round(decimals=-1),
    "neg": lambda x: -x + torch.neg(x) + x.neg() + torch.negative(x),
    "abs": lambda x: abs(x) + torch.abs(x) + x.abs() + x.absolute(),
    "sign": lambda x: torch.sign(x) + x.sign(),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name):
    check_batched(UNARY[name], lambda b: (away_from_zero(b, 5),))


def test_unary_in_place_forms():
    def fn(x):
        z = x.abs().clone()
        z.exp_()
        z.log_()
        z.sqrt_()
        z.rsqrt_()
        z.reciprocal_()
        z.neg_()
        z.abs_()
        z.sigmoid_()
        z.tanh_()
        z.erf_()
        z.sin_()
        z.cos_()
        z.mul_(7)
        z.floor_()
        z.sign_()
        return z

    check_batched(fn, lambda b: (away_from_zero(b, 5),))


def test_round_ties_to_even_and_near_half():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.49999997, 3.7, -3.2, 1e7 + 1.0])
    check_traced(lambda x: torch.round(x), (x,))


def test_sign_of_nan_and_zero_is_zero():
    x = torch.tensor([float("nan"), 0.0, -0.0, 2.0, -3.0, float("inf")])
    check_traced(lambda x: torch.sign(x), (x,))


def test_log1p_keeps_tiny_values():
    x = torch.tensor([1e-10, -1e-9, 1e-6, 0.0, 0.5, 3.0, -0.5])
    check_traced(lambda x: torch.log1p(x), (x,), rtol=1e-6, atol=0)


def test_int_unary_promotes_to_float():
    check_batched(lambda a: (a.exp(), torch.sigmoid(a), a.abs().log1p(), a.reciprocal()),
                  lambda b: (ints(b, 4, low=1, high=5),))


# ---------------------------------------------------------------------------- clamp
LOW, HIGH = torch.linspace(-1, 0, 4), torch.tensor(0.5)  # constants: made outside the trace
CLAMP = {
    "both": lambda x: torch.clamp(x, -0.5, 0.5) + x.clamp(-1, 1),
    "min_only": lambda x: torch.clamp(x, min=0) + x.clamp(min=0.1),
    "max_only": lambda x: x.clip(max=0.3) + torch.clip(x, None, 0.2),
    "clamp_min_max": lambda x: x.clamp_min(0) + torch.clamp_max(x, 0.1) + torch.clamp_min(x, -0.1) + x.clamp_max(1),
    "min_above_max": lambda x: x.clamp(min=1, max=-1),
    "tensor_bounds": lambda x: torch.clamp(x, min=LOW, max=HIGH),
    "tensor_bound_batched": lambda x: x.clamp(max=x * 0.5),
    "in_place": lambda x: x.clone().clamp_(-0.2, 0.2) + x.clone().clip_(0) + x.clone().clamp_min_(0),
}


@pytest.mark.parametrize("name", sorted(CLAMP))
def test_clamp(name):
    check_batched(CLAMP[name], lambda b: (randn(b, 4),))


def test_clamp_int_with_float_bound_promotes():
    check_batched(lambda a: (a.clamp(min=0.5), a.clamp(-3, 3)), lambda b: (ints(b, 4),))


def test_clamp_scalar_bounds_use_clip():
    g = check_traced(lambda x: x.clamp(0, 1), (randn(2, 3),))
    assert "Clip" in op_types(g)


# ---------------------------------------------------------------------------- symbolic sizes as operands
def test_symbolic_sizes_as_scalar_operands_stay_symbolic():
    """x.size(0) is a SymInt with a symbolic batch: used as a scalar operand (either side) it must
    come from the graph, or batch 5 would see the example's 3."""
    def fn(x):
        n = x.size(0)
        return (x / n, n / x, n - x, n * x, n + x, n // x.abs().ceil(), x ** n, n ** x.abs(), x.clamp(max=n - 1),
                x.masked_fill(x > 1, n), torch.where(x > 0, x, n), x > n - 2)

    check_batched(fn, lambda b: (randn(b, 4) * 3,))

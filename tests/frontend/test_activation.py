"""Tracing activations, softmax and dropout (frontend/torch_ops/activation.py): functional,
module, method and in-place forms, torch's parameters (gelu approximate, softplus
beta/threshold, softmax dtype and legacy dim), compared with torch eager at two batch sizes."""
import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from frontend_helpers import check_traced, op_types  # noqa: E402

import kiln  # noqa: E402

gen = torch.Generator().manual_seed(2)


def randn(*shape, scale=3.0):
    return torch.randn(*shape, generator=gen) * scale


def check_batched(fn, *rest, rtol=1e-5, atol=1e-6):
    """fn on a [batch, *rest] input, traced with a symbolic batch, compared at batch 3 and 5."""
    return check_traced(fn, (randn(3, *rest),), dynamic_batch=True, other_inputs=[(randn(5, *rest),)],
                        rtol=rtol, atol=atol)


ACTIVATIONS = {
    "relu6": lambda x: F.relu6(x) + F.relu6(x.clone(), inplace=True),
    "relu6_module": nn.ReLU6(),
    "hardtanh": lambda x: F.hardtanh(x) + F.hardtanh(x, -2.0, 0.5) + F.hardtanh_(x.clone(), -0.5, 0.5),
    "hardtanh_module": nn.Hardtanh(-2, 2),
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_module": nn.GELU("tanh"),
    "silu": lambda x: F.silu(x) + F.silu(x.clone(), inplace=True),
    "silu_module": nn.SiLU(),
    "hardswish": lambda x: F.hardswish(x),
    "hardswish_module": nn.Hardswish(),
    "hardsigmoid": lambda x: F.hardsigmoid(x),
    "hardsigmoid_module": nn.Hardsigmoid(),
    "leaky_relu": lambda x: F.leaky_relu(x) + F.leaky_relu(x, 0.2) + F.leaky_relu_(x.clone(), 0.3),
    "leaky_relu_module": nn.LeakyReLU(0.1),
    "elu": lambda x: F.elu(x) + F.elu(x, alpha=0.5) + F.elu_(x.clone(), 2.0),
    "elu_module": nn.ELU(0.7),
    "selu": lambda x: F.selu(x) + torch.selu(x) + torch.selu_(x.clone()),
    "selu_module": nn.SELU(),
    "celu": lambda x: F.celu(x) + F.celu(x, alpha=0.5) + torch.celu(x, 2.0),
    "celu_module": nn.CELU(0.7),
    "softplus": lambda x: F.softplus(x),
    "softplus_beta_threshold": lambda x: F.softplus(x, beta=2, threshold=1) + F.softplus(x, 0.5, 3),
    "softplus_module": nn.Softplus(beta=1.5, threshold=2),
    "mish": lambda x: F.mish(x),
    "mish_module": nn.Mish(),
    "softsign": lambda x: F.softsign(x),
    "softsign_module": nn.Softsign(),
    "logsigmoid": lambda x: F.logsigmoid(x),
    "logsigmoid_module": nn.LogSigmoid(),
    "tanh_sigmoid": lambda x: F.tanh(x) + F.sigmoid(x),
    "tanh_sigmoid_modules": lambda x: nn.Tanh()(x) + nn.Sigmoid()(x),
    "threshold": lambda x: F.threshold(x, 0.5, -1.0) + torch.threshold(x, 0.0, 2.0),
    "threshold_module": nn.Threshold(0.1, 20.0),
    "rrelu_eval": lambda x: F.rrelu(x) + torch.rrelu(x, 0.1, 0.3),
    "rrelu_module": nn.RReLU(0.1, 0.2).eval(),
    "glu": lambda x: F.glu(x) + F.glu(x.transpose(0, 1).transpose(0, 1), -1),
    "glu_module": nn.GLU(),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation(name):
    check_batched(ACTIVATIONS[name], 6)


def test_softplus_threshold_switches_to_linear_in_float64():
    x = torch.tensor([[-30.0, -1.0, 0.0, 0.4, 0.6, 19.0, 21.0, 40.0]], dtype=torch.float64)
    check_traced(lambda x: (F.softplus(x), F.softplus(x, beta=2, threshold=1)), (x,), rtol=1e-12, atol=0)


def test_default_softplus_is_one_op():
    g = check_traced(lambda x: F.softplus(x), (randn(2, 3),))
    assert op_types(g) == ["Softplus", "Identity"]


def test_gelu_uses_the_fused_op_with_torch_approximation():
    g = check_traced(lambda x: F.gelu(x, approximate="tanh"), (randn(2, 3),))
    gelu = next(n for n in g.nodes if n.op == "Gelu")
    assert gelu.attrs["approximate"] == "tanh"


# ---------------------------------------------------------------------------- prelu
@pytest.mark.parametrize("channels, rest", [(1, (4, 5)), (4, (4, 5)), (4, (4,)), (3, (3, 2, 2, 2))])
def test_prelu(channels, rest):
    m = nn.PReLU(channels)
    with torch.no_grad():
        m.weight.copy_(torch.linspace(-0.5, 0.5, channels))
    check_batched(m, *rest)
    check_batched(lambda x: F.prelu(x, m.weight) + torch.prelu(x, m.weight) + x.prelu(m.weight), *rest)


# ---------------------------------------------------------------------------- softmax
SOFTMAX = {
    "F.softmax": lambda x: F.softmax(x, dim=-1) + F.softmax(x, 1),
    "torch.softmax": lambda x: torch.softmax(x, 2) + torch.special.softmax(x, 0),
    "Tensor.softmax": lambda x: x.softmax(-1) + x.softmax(dim=1),
    "softmax_dtype": lambda x: (F.softmax(x, -1, dtype=torch.float64), x.softmax(1, dtype=torch.float64),
                                torch.softmax(x.half(), -1, dtype=torch.float32)),
    "softmax_module": nn.Softmax(dim=-1),
    "log_softmax": lambda x: F.log_softmax(x, -1) + torch.log_softmax(x, 1) + x.log_softmax(0),
    "log_softmax_dtype": lambda x: F.log_softmax(x, 1, dtype=torch.float64),
    "log_softmax_module": nn.LogSoftmax(dim=1),
    "softmin": lambda x: F.softmin(x, -1),
    "softmin_module": nn.Softmin(1),
}


@pytest.mark.parametrize("name", sorted(SOFTMAX))
def test_softmax(name):
    check_batched(SOFTMAX[name], 4, 5, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(5,), (2, 5), (2, 3, 4), (2, 3, 4, 5)])
def test_softmax_without_dim_uses_torch_legacy_choice(shape):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        check_traced(lambda x: (F.softmax(x), F.log_softmax(x)), (randn(*shape),))


def test_int_softmax_with_dtype():
    x = torch.randint(-3, 4, (3, 5), generator=gen)
    check_traced(lambda x: F.softmax(x, -1, dtype=torch.float32), (x,))


# ---------------------------------------------------------------------------- dropout
DROPOUT_EVAL = {
    "F.dropout": (lambda x: F.dropout(x, 0.5, training=False) + F.dropout(x, 0.2, False, True), (3, 4, 5)),
    "p_zero_training": (lambda x: F.dropout(x, 0.0), (3, 4, 5)),
    "torch.dropout": (lambda x: torch.dropout(x, 0.1, False) + torch.dropout_(x.clone(), 0.3, False), (3, 4, 5)),
    "dropout1d": (lambda x: F.dropout1d(x, 0.2, False), (4, 5)),
    "dropout2d_3d": (lambda x: F.dropout2d(x, 0.3, False) + F.dropout3d(x, 0.1, False), (3, 4, 5)),
    "alpha": (lambda x: F.alpha_dropout(x, 0.2) + F.feature_alpha_dropout(x, 0.2, False)
              + torch.alpha_dropout(x, 0.5, False), (3, 4, 5)),
    "feature": (lambda x: torch.feature_dropout(x, 0.5, False) + torch.feature_alpha_dropout(x, 0.5, False),
                (3, 4, 5)),
    "modules": (nn.Sequential(nn.Dropout(0.3), nn.Dropout2d(0.1), nn.Dropout3d(0.1), nn.AlphaDropout(0.2),
                              nn.FeatureAlphaDropout(0.1)).eval(), (3, 4, 5)),
    "dropout1d_module": (nn.Dropout1d(0.2).eval(), (4, 5)),
}


@pytest.mark.parametrize("name", sorted(DROPOUT_EVAL))
def test_dropout_in_eval_is_identity(name):
    fn, rest = DROPOUT_EVAL[name]
    g = check_batched(fn, *rest)
    assert "Dropout" not in op_types(g)


@pytest.mark.parametrize("fn", [lambda x: F.dropout(x), lambda x: torch.dropout(x, 0.5, True),
                                lambda x: F.dropout2d(x, 0.5), lambda x: F.alpha_dropout(x, 0.1, True),
                                lambda x: F.rrelu(x, training=True)])
def test_training_mode_randomness_is_refused(fn):
    with pytest.raises(kiln.UnsupportedOpError, match="training.*not supported"):
        kiln.trace(fn, randn(2, 3, 4, 4), check=False)


def test_dropout_module_traced_from_training_mode_is_identity():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    with pytest.warns(kiln.TraceWarning, match="training mode"):
        g = kiln.trace(m, randn(2, 4), check=False, optimize=False)
    assert "Dropout" not in op_types(g)

"""BatchNorm folding into Conv and Gemm: same outputs, new weights, and where it must not fold."""
import numpy as np
import pytest

from kiln.ir import Graph, verify
from kiln.ir.passes import fold_batchnorm, infer_shapes


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.walk()]


def bn_stats(g: Graph, c: int, rng, dtype=np.float32, name="bn") -> list:
    arrays = {"scale": rng.uniform(0.5, 2.0, c), "bias": rng.normal(size=c),
              "mean": rng.normal(size=c), "var": rng.uniform(0.2, 3.0, c)}
    return [g.add_initializer(f"{name}.{k}", a.astype(dtype)) for k, a in arrays.items()]


def conv_bn(rng, *, bias: bool, group: int = 1, dtype=np.float32, epsilon: float = 1e-5):
    g = Graph()
    x = g.add_input("x", dtype, ("batch", 4, 6, 6))
    w = g.add_initializer("w", rng.normal(size=(6, 4 // group, 3, 3)).astype(dtype))
    args = [x, w] + ([g.add_initializer("b", rng.normal(size=6).astype(dtype))] if bias else [])
    y = g.op("Conv", *args, group=group, pads=[1, 1, 1, 1], name="conv")
    g.outputs = [g.op("Relu", g.op("BatchNormalization", y, *bn_stats(g, 6, rng, dtype), epsilon=epsilon))]
    return g, {"x": rng.normal(size=(2, 4, 6, 6)).astype(dtype)}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("group", [1, 2])
def test_conv_bn(check_pass, rng, bias, group):
    g, feeds = conv_bn(rng, bias=bias, group=group, epsilon=1e-3)
    originals = {k: v.const.copy() for k, v in g.initializers.items()}
    check_pass(fold_batchnorm, g, feeds)
    assert ops(g) == ["Conv", "Relu"]
    conv = g.nodes[0]
    assert len(conv.inputs) == 3 and all(v.is_initializer for v in conv.inputs[1:])
    assert conv.inputs[1].dtype == conv.inputs[2].dtype == g.inputs[0].dtype
    # The original arrays (which a caller may share) are untouched.
    for k, a in originals.items():
        np.testing.assert_array_equal(g.initializers[k].const, a)


def test_conv_bn_float64_against_formula(check_pass, rng):
    g, feeds = conv_bn(rng, bias=True, dtype=np.float64)
    stats = {v.name: v.const for v in g.nodes[1].inputs[1:]}
    w, b = g.initializers["w"].const, g.initializers["b"].const
    check_pass(fold_batchnorm, g, feeds, rtol=1e-12, atol=1e-12)
    s = stats["bn.scale"] / np.sqrt(stats["bn.var"] + 1e-5)
    conv = g.nodes[0]
    np.testing.assert_allclose(conv.inputs[1].const, w * s[:, None, None, None], rtol=1e-14)
    np.testing.assert_allclose(conv.inputs[2].const, (b - stats["bn.mean"]) * s + stats["bn.bias"], rtol=1e-14)


def test_conv_with_two_users_is_left(check_pass, rng):
    g, feeds = conv_bn(rng, bias=True)
    conv_out = g.nodes[0].outputs[0]
    g.outputs.append(g.op("Neg", conv_out))
    check_pass(fold_batchnorm, g, feeds, changes=False)


def test_bn_output_as_graph_output_keeps_its_name(check_pass, rng):
    g, feeds = conv_bn(rng, bias=False)
    g.outputs = [g.nodes[1].outputs[0]]
    name = g.outputs[0].name
    g.remove_node(g.nodes[2])
    check_pass(fold_batchnorm, g, feeds)
    assert ops(g) == ["Conv"] and g.outputs[0].name == name


def test_not_folded(rng):
    g = Graph()
    x = g.add_input("x", "float32", (1, 4, 5, 5))
    w = g.add_input("w", "float32", (4, 4, 1, 1))
    stats = bn_stats(g, 4, rng)
    live_mean = g.add_input("mean", "float32", (4,))
    # Weight not a constant; statistics not constants; producer not a Conv/Gemm.
    a = g.op("BatchNormalization", g.op("Conv", x, w), *stats)
    c = g.op("Conv", x, g.add_initializer("w2", np.ones((4, 4, 1, 1), np.float32)))
    b = g.op("BatchNormalization", c, stats[0], stats[1], live_mean, stats[3])
    d = g.op("BatchNormalization", g.op("Relu", x), *stats)
    g.outputs = [a, b, d]
    infer_shapes(g)
    verify(g)
    assert fold_batchnorm(g) is False
    assert ops(g).count("BatchNormalization") == 3


def gemm_bn(rng, *, trans_b: int, c_shape, alpha=1.0, beta=1.0):
    g = Graph()
    x = g.add_input("x", "float32", (5, 3))
    b = rng.normal(size=(4, 3) if trans_b else (3, 4)).astype(np.float32)
    args = [x, g.add_initializer("B", b)]
    if c_shape is not None:
        args.append(g.add_initializer("C", rng.normal(size=c_shape).astype(np.float32)))
    y = g.op("Gemm", *args, transB=trans_b, alpha=alpha, beta=beta)
    g.outputs = [g.op("BatchNormalization", y, *bn_stats(g, 4, rng))]
    return g, {"x": rng.normal(size=(5, 3)).astype(np.float32)}


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (4,), (1, 4), (5, 1), (5, 4), ()])
def test_gemm_bn(check_pass, rng, trans_b, c_shape):
    g, feeds = gemm_bn(rng, trans_b=trans_b, c_shape=c_shape, alpha=0.7, beta=1.5)
    check_pass(fold_batchnorm, g, feeds)
    assert ops(g) == ["Gemm"]
    gemm = g.nodes[0]
    assert gemm.attr("beta") == 1.0 and gemm.attr("alpha") == 0.7 and gemm.attr("transB") == trans_b


def test_gemm_with_variable_c_is_left(check_pass, rng):
    g = Graph()
    x = g.add_input("x", "float32", (5, 3))
    c = g.add_input("c", "float32", (4,))
    y = g.op("Gemm", x, g.add_initializer("B", np.ones((3, 4), np.float32)), c)
    g.outputs = [g.op("BatchNormalization", y, *bn_stats(g, 4, rng))]
    check_pass(fold_batchnorm, g, {"x": np.ones((5, 3), np.float32), "c": np.ones(4, np.float32)}, changes=False)

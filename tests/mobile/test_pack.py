"""kiln mobile pack: static dims, the arena plan (checked by simulating liveness), int8 weights and
their error bounds, and zoo models packed, run in the full runtime and compared with fp32."""
import json

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.ir.passes import optimize
from kiln.mobile_stub.pack import (ALIGNMENT, PROP_OPS, PROP_VERSION, is_weight_decoder, pack,
                                   pack_file, read_arena, top1_agreement)
from kiln.ir.passes.quantize import QMAX, dequantize, quantize_per_channel


def assert_arena_sound(g: Graph) -> None:
    """Replay the packed graph in order, tracking which values are live (written and still to be
    read, or a graph output): no two live values may share a byte of the arena."""
    plan = read_arena(g)
    assert plan.alignment == ALIGNMENT
    planned = [v for n in g.nodes if not is_weight_decoder(n) for v in n.outputs]
    assert sorted(plan.values) == sorted(v.name for v in planned)  # one slot per intermediate value
    remaining = {v.name: sum(1 for _ in v.uses) for v in planned}
    outputs = {v.name for v in g.outputs}
    live: dict[str, tuple[int, int]] = {}
    for node in g.nodes:
        for v in node.outputs:
            if v.name not in plan.values:
                continue
            off, n = plan.values[v.name]
            assert off % ALIGNMENT == 0 and off + n <= plan.size
            assert n == int(np.prod(v.type.shape)) * v.type.dtype.itemsize
            for other, (o, m) in live.items():
                assert n == 0 or m == 0 or off + n <= o or o + m <= off, f"{v.name} overlaps live {other}"
            live[v.name] = (off, n)
        for v in node.inputs:
            if v is not None and v.name in remaining:
                remaining[v.name] -= 1
                if remaining[v.name] == 0 and v.name not in outputs:
                    live.pop(v.name)  # dies after this node: its inputs and outputs never overlap
        for v in node.outputs:  # written but never read
            if v.name in remaining and remaining[v.name] == 0 and v.name not in outputs:
                live.pop(v.name, None)


def chain_graph() -> Graph:
    """x[batch, 8] -> Relu -> Gemm(W) -> Add(skip) -> Relu: values of different sizes and lifetimes."""
    rng = np.random.default_rng(1)
    g = Graph("chain")
    x = g.add_input("x", "float32", ["batch", 8])
    a = g.op("Relu", x)
    w = g.add_initializer("w", rng.standard_normal((16, 8)).astype(np.float32))
    b = g.add_initializer("b", rng.standard_normal(16).astype(np.float32))
    h = g.op("Gemm", a, w, b, transB=1)
    w2 = g.add_initializer("w2", rng.standard_normal((16, 8)).astype(np.float32))
    y = g.op("Add", g.op("MatMul", h, w2), a)
    g.outputs = [g.op("Relu", y)]
    return g


def test_pack_fixes_dims_and_stores_manifest_and_arena():
    g = pack(chain_graph(), dims={"batch": 3})
    assert g.inputs[0].type.shape == (3, 8)
    props = g.metadata.props
    assert props[PROP_VERSION] == "1"
    assert json.loads(props[PROP_OPS]) == ["Add:float32", "Gemm:float32", "MatMul:float32", "Relu:float32"]
    assert_arena_sound(g)
    plan = read_arena(g)
    assert plan.size < plan.naive_size  # reuse happened: the first Relu's slot is free after Add


def test_dims_default_to_one_and_bad_dims_are_refused():
    assert pack(chain_graph()).inputs[0].type.shape == (1, 8)
    with pytest.raises(KilnError, match="no such symbolic dim"):
        pack(chain_graph(), dims={"batchh": 2})
    with pytest.raises(KilnError, match="positive"):
        pack(chain_graph(), dims={"batch": 0})


def test_unknown_shape_is_a_clear_error():
    g = Graph("unknown")
    x = g.add_input("x", "float32", [2, None])
    g.outputs = [g.op("Relu", x)]
    with pytest.raises(KilnError, match="unknown dim 1"):
        pack(g)
    g = Graph("data_dependent")
    x = g.add_input("x", "float32", [4])
    k = g.add_input("k", "int64", [1])
    g.outputs = list(g.op("TopK", x, k))
    with pytest.raises(KilnError, match="needs every shape known"):
        pack(g)


def test_arena_plan_on_a_wide_diamond():
    """Many values alive at once, then few: the plan must never overlap the concurrent ones."""
    g = Graph("diamond")
    x = g.add_input("x", "float32", [1, 64])
    branches = [g.op("Relu", g.op("Mul", x, g.add_constant(np.float32(i + 1)))) for i in range(6)]
    acc = branches[0]
    for b in branches[1:]:
        acc = g.op("Add", acc, b)
    g.outputs = [acc, branches[2]]
    packed = pack(g)
    assert_arena_sound(packed)


@pytest.mark.parametrize("shape,axis", [((8, 3, 3, 3), 0), ((16, 1, 5, 5), 0), ((32, 24), 1), ((24, 32), 0)])
def test_per_channel_quantization_error_bound(rng, shape, axis):
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10, shape[axis]).reshape(
        [-1 if i == axis else 1 for i in range(len(shape))]).astype(np.float32)
    w[(slice(None),) * axis + (0,)] = 0  # an all-zero channel
    q, scale = quantize_per_channel(w, axis)
    assert q.dtype == np.int8 and scale.shape == (shape[axis],) and np.abs(q).max() <= QMAX
    bshape = [-1 if i == axis else 1 for i in range(len(shape))]
    err = np.abs(dequantize(q, scale, axis) - w)
    assert np.all(err <= scale.reshape(bshape) / 2 * (1 + 1e-6) + 1e-12)  # half a step, per channel
    assert np.all(dequantize(q, scale, axis)[(slice(None),) * axis + (0,)] == 0)
    # The largest magnitude of every channel is represented as +-127 exactly.
    nz = scale > 0
    assert np.all(np.abs(np.moveaxis(q, axis, 0).reshape(shape[axis], -1)).max(axis=1)[nz] == QMAX)


def test_int8_pack_rewrites_weights_and_runs(rng):
    packed = pack(chain_graph(), quantize="int8")
    dq = [n for n in packed.nodes if n.op == "DequantizeLinear"]
    assert sorted((n.inputs[0].name, n.attrs["axis"]) for n in dq) == [("w.q", 0), ("w2.q", 1)]
    assert "w" not in packed.initializers and packed.initializers["w.q"].const.dtype == np.int8
    assert packed.initializers["w.scale"].const.shape == (16,)
    assert "DequantizeLinear:int8" in json.loads(packed.metadata.props[PROP_OPS])
    assert_arena_sound(packed)
    x = rng.standard_normal((1, 8)).astype(np.float32)
    want = kiln.load(pack(chain_graph())).run([x], as_list=True)[0]
    got = kiln.load(packed).run([x], as_list=True)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * np.abs(want).max())


def test_top1_agreement():
    a = np.array([[1, 2, 3], [3, 2, 1]], np.float32)
    assert top1_agreement(a, a) == 1.0
    assert top1_agreement(a, a[::-1]) == 0.0


# ---------------------------------------------------------------------------- zoo models
torch = pytest.importorskip("torch")


def _zoo_file(tmp_path, name, **sizes):
    import zoo

    model, inputs, dynamic = zoo.by_name(name).factory(**sizes)
    g = kiln.trace(model, inputs, dynamic=dynamic)
    optimize(g)
    path = tmp_path / f"{name}.kiln"
    kiln.save(g, path)
    return path


@pytest.mark.parametrize("name,dims,trials", [("mobilenet_v3", {"batch": 1}, 100),
                                              ("transformer_encoder", {"batch": 2, "seq": 8}, 10)])
def test_zoo_int8_pack_matches_fp32(tmp_path, name, dims, trials):
    src = _zoo_file(tmp_path, name)
    dst = tmp_path / f"{name}.mobile.kiln"
    report = pack_file(src, dst, quantize="int8", dims=dims, trials=trials)
    packed = kiln.load_graph(dst)
    assert_arena_sound(packed)
    assert packed.inputs[0].type.shape[:len(dims)] == tuple(dims.values())
    assert report.max_rel_error <= 0.02, str(report)
    if name == "mobilenet_v3":
        assert report.top1_agreement is not None and report.top1_agreement >= 0.95, str(report)
    # The weights shrink to a quarter (plus per-channel scales and the fp32 biases). The whole file
    # of these tiny zoo models does not reach 0.3x: its graph structure (~30-40 kB of FlatBuffer for
    # 50-80 nodes with their attributes and names) is as large as the int8 weights; see the next test.
    fp32 = kiln.load_graph(src)
    weight_bytes = sum(v.const.nbytes for v in fp32.initializers.values())
    packed_bytes = sum(v.const.nbytes for v in packed.initializers.values())
    assert packed_bytes <= 0.3 * weight_bytes, (packed_bytes, weight_bytes)
    assert report.size_after < 0.6 * report.size_before, str(report)


def test_transformer_with_real_weight_sizes_packs_below_three_tenths(tmp_path):
    """Once weights dominate the file (d_model 128: 1.6 MB fp32), the int8 file is <= 0.3x."""
    src = _zoo_file(tmp_path, "transformer_encoder", d_model=128, dim_ff=512)
    report = pack_file(src, tmp_path / "t.mobile.kiln", quantize="int8", dims={"batch": 1, "seq": 8}, trials=3)
    assert report.ratio <= 0.3, str(report)
    assert report.max_rel_error <= 0.02, str(report)


# ---------------------------------------------------------------------- what `kiln mobile check` names
# Found by running the op suite on the stub (tests/op_harness.check_backends): each passed the check, then
# failed in the stub.

def test_check_names_what_the_stub_cannot_run_though_the_op_set_has_the_op():
    from kiln.mobile_stub.check import check_graph
    g = Graph()
    x = g.add_input("x", "float32", [1, 2, 4, 4, 4])
    w = g.add_initializer("w", np.ones((3, 2, 1, 1, 1), np.float32))
    g.outputs = [g.op("Conv", x, w)]
    [p] = check_graph(g)
    assert p.op == "Conv" and "runs 1-D and 2-D convs, not 3-D" in str(p)
    h = Graph()
    y = h.add_input("y", "float32", [4])
    h.outputs = [h.op("Cast", y, to=16)]  # to bfloat16
    [p] = check_graph(h)
    assert "holds no bfloat16 values" in str(p)
    f = Graph()
    z = f.add_input("z", "float32", [1, 2, 4, 4])
    f.outputs = [f.op("MaxPool", z, kernel_shape=[2, 2])]
    assert check_graph(f) == []  # 2-D: runs


def test_a_dequantize_feeding_a_graph_output_is_not_a_weight_decoder():
    """The packer's rule is the stub's: a DequantizeLinear whose output is a graph output (or feeds anything
    but a Conv/Gemm/MatMul weight) runs as a node and gets its arena slot."""
    g = Graph()
    q = g.add_initializer("q", np.ones((4, 3), np.int8))
    s = g.add_initializer("s", np.full((4,), 0.5, np.float32))
    dq = g.op("DequantizeLinear", q, s, axis=0)
    g.outputs = [dq]
    assert not is_weight_decoder(dq.producer)
    pack(g)  # packs (it had no arena slot before), and the stub runs it: tests/ops/test_quant.py
    h = Graph()
    x = h.add_input("x", "float32", [2, 4])
    w = h.op("DequantizeLinear", h.add_initializer("q", np.ones((4, 3), np.int8)),
             h.add_initializer("s", np.full((3,), 0.5, np.float32)), axis=1)
    h.outputs = [h.op("MatMul", x, w)]
    assert is_weight_decoder(w.producer)  # the weight of a MatMul: fused into the stub's kernel

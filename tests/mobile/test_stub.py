"""The mobile stub runtime (mobile_stub/runtime.py + kernels/): packed files run in one arena and
agree with kiln's CPU runtime; unsupported ops are refused at load; the reading path needs no kiln.ir.

Graphs are packed with mobile_stub/pack.py and compared against ``kiln.load(file).run`` on the
same packed file (1e-5 on float32).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.errors import UnsupportedOpError
from kiln.ir.graph import Graph
from kiln.ir.passes import infer_shapes
from kiln.mobile_stub import kernels, opset, runtime
from kiln.mobile_stub.pack import pack

ROOT = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(0)


def _feeds(stub):
    rng = np.random.default_rng(1)
    out = []
    for i in stub.inputs:
        _, dtype, shape = stub.infos[i]
        out.append(rng.standard_normal(shape).astype(dtype) if dtype.kind == "f"
                   else rng.integers(0, 8, shape).astype(dtype))
    return out


def _pack_save(graph, tmp_path, name="m", quantize=None):
    path = str(tmp_path / f"{name}.kiln")
    kiln.save(pack(graph, quantize=quantize), path)
    return path


def _compare(path, atol=1e-5):
    stub = runtime.load(path)
    feeds = _feeds(stub)
    want = kiln.load(path).run(feeds, as_list=True)
    got = stub.run(*feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol)
    return stub


# ------------------------------------------------------------------ zoo models, fp32 and int8
@pytest.fixture(scope="module")
def zoo_graphs():
    zoo = pytest.importorskip("zoo")
    graphs = {}
    for name in ("mobilenet_v3", "transformer_encoder", "gpt"):
        model, inputs, _ = zoo.by_name(name).factory()
        graphs[name] = kiln.trace(model, inputs)
    return graphs


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", ["mobilenet_v3", "transformer_encoder", "gpt"])
def test_zoo_matches_cpu_runtime(zoo_graphs, tmp_path, name, quantize):
    stub = _compare(_pack_save(zoo_graphs[name], tmp_path, name, quantize))
    if quantize:  # every int8 weight reaches its kernel as a QWeight: no DequantizeLinear step runs
        assert not any(node["op"] == "DequantizeLinear" for node, *_ in stub.steps)
        assert any(isinstance(x, kernels.QWeight) for _, _, ins, _ in stub.steps for x in ins)


def test_every_output_is_a_view_of_the_one_arena_and_kernels_write_in_place(zoo_graphs, tmp_path):
    stub = runtime.load(_pack_save(zoo_graphs["mobilenet_v3"], tmp_path, quantize="int8"))
    feeds = _feeds(stub)
    want = stub.run(*feeds)
    for node, kernel, ins, outs in stub.steps:
        for o in outs:
            assert o.base is stub.arena or o.base.base is stub.arena or np.shares_memory(o, stub.arena), node["name"]
    # Poison the arena: a kernel that returned a fresh array instead of filling out= would leave NaN.
    returned = []
    stub.steps = [(n, (lambda k: lambda i, o, a: returned.append(k(i, o, a)))(k), i, o) for n, k, i, o in stub.steps]
    stub.arena[...] = 0xFF  # NaN as float32
    got = stub.run(*feeds)
    assert all(r is None for r in returned) and len(returned) == len(stub.steps)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# ------------------------------------------------------------------ single ops, hand-built graphs
def _single(op, x_shape, attrs=None, consts=(), dtype="float32", inputs_extra=()):
    g = Graph("t")
    x = g.add_input("x", dtype, x_shape)
    ins = [x] + list(inputs_extra)
    for k, c in enumerate(consts):
        ins.append(None if c is None else g.add_initializer(f"c{k}", np.asarray(c)))
    y = g.add_node(op, ins, attrs or {}).outputs[0]
    g.outputs = [g.add_node("Relu", [y]).outputs[0]] if op == "Identity" else [y]  # keep Identity alive
    return g


def _w(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


CASES = [
    ("Conv", (1, 4, 9, 9), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, (_w(6, 4, 3, 3), _w(6))),
    ("Conv", (2, 4, 9, 8), {"kernel_shape": [3, 2], "strides": [2, 1], "dilations": [1, 2], "group": 2}, (_w(6, 2, 3, 2),)),
    ("Conv", (1, 6, 8, 8), {"kernel_shape": [5, 5], "pads": [2, 2, 2, 2], "strides": [2, 2], "group": 6}, (_w(6, 1, 5, 5), _w(6))),
    ("Conv", (1, 3, 8, 8), {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]}, (_w(4, 3, 3, 3),)),
    ("Conv", (2, 3, 10), {"kernel_shape": [3], "pads": [1, 2]}, (_w(5, 3, 3), _w(5))),
    ("MaxPool", (1, 3, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, ()),
    ("MaxPool", (1, 2, 8, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, ()),
    ("AveragePool", (1, 3, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, ()),
    ("AveragePool", (1, 3, 7, 7), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}, ()),
    ("AveragePool", (1, 2, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}, ()),
    ("GlobalAveragePool", (2, 3, 5, 4), {}, ()),
    ("GlobalMaxPool", (2, 3, 5, 4), {}, ()),
    ("Sigmoid", (3, 40), {}, ()), ("Tanh", (3, 40), {}, ()), ("Relu", (3, 40), {}, ()),
    ("LeakyRelu", (3, 40), {"alpha": 0.1}, ()), ("HardSwish", (3, 40), {}, ()),
    ("HardSigmoid", (3, 40), {"alpha": 0.3, "beta": 0.4}, ()),
    ("Gelu", (3, 40), {}, ()), ("Gelu", (3, 40), {"approximate": "tanh"}, ()),
    ("Clip", (3, 40), {}, (np.float32(-0.5), np.float32(0.7))),
    ("Add", (3, 4), {}, (_w(4),)), ("Sub", (3, 4), {}, (_w(3, 1),)), ("Mul", (3, 4), {}, (_w(1),)),
    ("Div", (3, 4), {}, (_w(4) + 3,)), ("Max", (3, 4), {}, (_w(4), _w(3, 1))),
    ("MatMul", (2, 3, 5), {}, (_w(5, 4),)),
    ("Gemm", (3, 5), {"transB": 1, "alpha": 0.5, "beta": 2.0}, (_w(4, 5), _w(4))),
    ("Gemm", (5, 3), {"transA": 1}, (_w(5, 4), _w(3, 4))),
    ("LayerNormalization", (2, 3, 8), {"epsilon": 1e-3}, (_w(8), _w(8))),
    ("LayerNormalization", (2, 3, 8), {"axis": 1}, (_w(3, 8),)),
    ("Softmax", (2, 3, 8), {"axis": 1}, ()), ("LogSoftmax", (2, 8), {}, ()),
    ("Transpose", (2, 3, 4), {"perm": [2, 0, 1]}, ()), ("Flatten", (2, 3, 4), {"axis": 2}, ()),
    ("Reshape", (2, 3, 4), {}, (np.array([4, -1], np.int64),)),
    ("Unsqueeze", (2, 3), {}, (np.array([0, 3], np.int64),)),
    ("Squeeze", (2, 1, 3), {}, (np.array([1], np.int64),)),
    ("Slice", (6, 7), {}, (np.array([1, -2]), np.array([5, 0]), np.array([0, 1]), np.array([2, -1]))),
    ("Gather", (5, 4), {"axis": 0}, (np.array([[0, 4], [-1, 2]], np.int64),)),
    ("Concat", (2, 3), {"axis": 1}, (_w(2, 2),)),
    ("Expand", (3, 1), {}, (np.array([2, 3, 4], np.int64),)),
    ("Identity", (2, 3), {}, ()),
]


@pytest.mark.parametrize("op,shape,attrs,consts", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_single_op_matches_cpu_runtime(tmp_path, op, shape, attrs, consts):
    graph = _single(op, shape, attrs, consts)
    stub = _compare(_pack_save(graph, tmp_path))
    assert any(node["op"] == op for node, *_ in stub.steps) or op == "Identity"


def test_where_and_split(tmp_path):
    g = Graph("t")
    x = g.add_input("x", "float32", (2, 6))
    c = g.add_input("c", "bool", (2, 6))
    w = g.add_node("Where", [c, x, g.add_initializer("k", np.float32(-1))]).outputs[0]
    parts = g.add_node("Split", [w, g.add_initializer("sizes", np.array([2, 4]))], {"axis": 1}, num_outputs=2).outputs
    g.outputs = list(parts)
    _compare(_pack_save(g, tmp_path))


# ------------------------------------------------------------------ refusal at load time
def test_unsupported_op_is_refused_at_load_naming_node_and_op(tmp_path):
    g = Graph("t")
    x = g.add_input("x", "float32", (2, 3))
    y = g.add_node("Relu", [x]).outputs[0]
    g.outputs = [g.add_node("Erf", [y], name="my_erf").outputs[0]]
    path = _pack_save(g, tmp_path)
    assert "Erf:float32" not in opset.declared()
    with pytest.raises(UnsupportedOpError, match=r"node 'my_erf' needs Erf:float32"):
        runtime.load(path)


def test_a_stub_with_fewer_kernel_families_refuses_what_it_lacks(zoo_graphs, tmp_path):
    path = _pack_save(zoo_graphs["mobilenet_v3"], tmp_path)
    stub = runtime.load(path)
    needed = opset.families_for(stub.manifest)
    assert "conv" in needed and "norm" not in needed
    runtime.load(path, families=needed)  # exactly the bundle's modules suffice
    with pytest.raises(UnsupportedOpError, match=r"Conv:float32"):
        runtime.load(path, families=[f for f in needed if f != "conv"])


def test_opset_is_the_union_of_kernel_supports():
    for fam in kernels.FAMILIES:
        mod = __import__(f"kiln.mobile_stub.kernels.{fam}", fromlist=["x"])
        assert set(mod.KERNELS) == set(mod.SUPPORTS)
        for op, dtypes in mod.SUPPORTS.items():
            assert all(opset.supports(f"{op}:{dt}") for dt in dtypes)
    assert opset.unsupported(["Conv:float32", "Conv:int64", "Erf:float32"]) == ["Conv:int64", "Erf:float32"]


def test_unpacked_file_is_refused(tmp_path):
    g = _single("Relu", (2, 3))
    infer_shapes(g)
    path = str(tmp_path / "plain.kiln")
    kiln.save(g, path)
    with pytest.raises(kiln.FormatError, match="kiln mobile pack"):
        runtime.load(path)


# ------------------------------------------------------------------ no kiln.ir, torch or onnx on the reading path
READER = ["errors.py", "serializer/format.py", "serializer/fbread.py", "serializer/fb/layout.py",
          "mobile_stub/runtime.py", "mobile_stub/packed.py", "mobile_stub/kernels/__init__.py"]


def test_stub_runs_from_a_tree_without_kiln_ir(zoo_graphs, tmp_path):
    path = _pack_save(zoo_graphs["mobilenet_v3"], tmp_path, quantize="int8")
    stub = runtime.load(path)
    feeds = _feeds(stub)
    np.save(tmp_path / "x.npy", feeds[0])
    np.save(tmp_path / "want.npy", stub.run(*feeds)[0])
    tree = tmp_path / "tree" / "kiln"
    files = READER + [f"mobile_stub/kernels/{f}.py" for f in opset.families_for(stub.manifest)]
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes((ROOT / rel).read_bytes())
    for pkg in ("", "serializer", "serializer/fb", "mobile_stub"):
        (tree / pkg / "__init__.py").write_text("")
    script = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('torch', 'onnx', 'flatbuffers') or name.startswith('kiln.ir'):
            raise ImportError('the stub must not import ' + name)
sys.meta_path.insert(0, Block())
import numpy as np
from kiln.mobile_stub import runtime
y = runtime.load({path!r}).run(np.load({str(tmp_path / 'x.npy')!r}))[0]
np.testing.assert_array_equal(y, np.load({str(tmp_path / 'want.npy')!r}))
assert not [m for m in sys.modules if m.startswith('kiln.ir') or m == 'torch']
print('ok')
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tree.parent)!r})\n" + script],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr

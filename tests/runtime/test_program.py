"""kiln.load / Program.run: the runtime API, input checks, control flow, errors, threads."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from sample_graphs import feature_graph

import kiln
from kiln import ExecutionError, InputError
from kiln.ir import Graph, evaluate
from kiln.runtime import Program


def mlp(seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)
    g = Graph("mlp")
    x = g.add_input("x", "float32", ("batch", 8))
    w1 = g.add_initializer("fc1.weight", rng.standard_normal((16, 8)).astype(np.float32))
    b1 = g.add_initializer("fc1.bias", rng.standard_normal(16).astype(np.float32))
    w2 = g.add_initializer("fc2.weight", rng.standard_normal((4, 16)).astype(np.float32))
    h = g.op("Relu", g.op("Gemm", x, w1, b1, transB=1))
    g.outputs = [g.op("Softmax", g.op("MatMul", h, g.op("Transpose", w2)), axis=-1)]
    return g


def test_load_file_and_run_by_name_or_list(tmp_path):
    g = mlp()
    path = kiln.save(g, tmp_path / "mlp.kiln")
    p = kiln.load(path)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    (want,) = evaluate(g, [x])
    out = p.run({"x": x})
    assert list(out) == [v.name for v in g.outputs]
    np.testing.assert_allclose(out[g.outputs[0].name], want, rtol=1e-6)
    np.testing.assert_allclose(p.run([x], as_list=True)[0], want, rtol=1e-6)
    assert [(s.name, s.dtype, s.shape) for s in p.inputs] == [("x", "float32", ("batch", 8))]
    assert p.metadata["producer_name"] == "kiln"


def test_input_errors_name_input_expected_and_actual():
    p = Program(mlp())
    with pytest.raises(InputError, match=r"input 'x': expected float32\[batch,8\], got float64\[2, 8\]"):
        p.run({"x": np.zeros((2, 8))})
    with pytest.raises(InputError, match=r"missing \['x'\], unexpected \['y'\]"):
        p.run({"y": np.zeros((2, 8), np.float32)})
    with pytest.raises(InputError, match="takes 1 inputs"):
        p.run([])


def test_symbols_bind_across_inputs():
    g = Graph()
    a = g.add_input("a", "float32", ("batch", 2))
    b = g.add_input("b", "float32", ("batch", 2))
    g.outputs = [g.op("Add", a, b)]
    with pytest.raises(InputError, match=r"input 'b': expected float32\[batch,2\], got float32\[4, 2\] \(batch=3"):
        Program(g).run([np.zeros((3, 2), np.float32), np.zeros((4, 2), np.float32)])


def test_control_flow_and_every_feature_match_the_reference():
    pytest.importorskip("ml_dtypes")
    g = feature_graph()
    feed = {"x": np.ones((2, 3, 4), np.float32), "y": np.arange(20, dtype=np.float32).reshape(5, 4) - 7,
            "z": np.ones((2, 3), np.float32)}
    want = evaluate(g, feed)
    got = Program(g).run(feed, as_list=True)
    for w, o in zip(want, got):
        assert w.dtype == o.dtype and w.shape == o.shape
        np.testing.assert_allclose(o.astype(np.float64), w.astype(np.float64), rtol=1e-6)


def test_constant_outputs_are_writable_copies():
    g = Graph()
    g.add_input("x", "float32", (1,))
    g.outputs = [g.op("Identity", g.add_initializer("c", np.ones(3, np.float32)))]
    out = Program(g).run([np.zeros(1, np.float32)], as_list=True)[0]
    out[0] = 5.0  # would fail on a read-only view of the model file


def test_kernel_failure_names_the_node_and_shapes():
    g = Graph()
    # float64: its MatMul reads the weight from the plan's slot at run time (a float32 one may be packed at load)
    x = g.add_input("x", "float64", (None, 4))
    w = g.add_initializer("w", np.ones((4, 2), np.float64))
    g.outputs = [g.op("MatMul", x, w, name="proj")]
    g.nodes[0].meta["scope"] = "head.proj"
    p = Program(g)
    # Corrupt the planned weight so the kernel itself fails (a verified graph cannot get here).
    p._template[p.plan.instructions[0].inputs[1]] = np.ones((3, 2), np.float64)
    with pytest.raises(ExecutionError, match=r"node 'proj' \(MatMul\) at head.proj on inputs "
                                             r"\(float64\[2, 4\], float64\[3, 2\]\): ValueError"):
        p.run([np.ones((2, 4), np.float64)])


def test_concurrent_runs_match_serial_runs():
    p = Program(mlp())
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((b, 8)).astype(np.float32) for b in (1, 2, 3, 5, 8, 13) * 4]
    serial = [p.run([x], as_list=True)[0] for x in inputs]
    results: list = [None] * len(inputs)

    def worker(k: int) -> None:
        for i in range(k, len(inputs), 6):
            for _ in range(20):
                results[i] = p.run([inputs[i]], as_list=True)[0]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s, r in zip(serial, results):
        np.testing.assert_array_equal(s, r)


def test_values_are_released_after_last_use():
    p = Program(mlp())
    released = {s for ins in p.plan.instructions for s in ins.release}
    produced = {s for ins in p.plan.instructions for s in ins.outputs}
    assert produced - released == set(p.plan.output_slots)


def test_cuda_device_is_refused_clearly(tmp_path):
    path = kiln.save(mlp(), tmp_path / "m.kiln")
    with pytest.raises(kiln.KilnError, match="device 'cuda' is not available yet"):
        kiln.load(path, device="cuda")


def test_auto_device_is_the_gpu_where_one_is_usable(monkeypatch, tmp_path):
    """device='auto' means what it means for the onnxruntime backend: the GPU when CuPy sees one, else the CPU."""
    import importlib.util

    import kiln.runtime.program as program
    path = kiln.save(mlp(), tmp_path / "m.kiln")
    monkeypatch.setattr(program, "cuda_usable", lambda: False)
    assert isinstance(kiln.load(path, device="auto"), Program)
    with pytest.raises(kiln.KilnError, match="device='auto' found no usable GPU"):
        kiln.load(path, device="auto", tf32=False)
    if importlib.util.find_spec("cupy") is None:  # the GPU path is taken (and says CuPy is missing)
        monkeypatch.setattr(program, "cuda_usable", lambda: True)
        with pytest.raises(kiln.KilnError, match="device 'cuda' is not available yet"):
            kiln.load(path, device="auto")

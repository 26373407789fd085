"""kiln.load(..., backend=...): the Program interface behind kiln's runtime and ONNX Runtime alike
(specs, run by name / in order, input checks, errors, threads), .onnx files with either backend, and
zoo models through ORT matching kiln's runtime."""
from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from sample_graphs import if_block, loop_block  # noqa: E402

import kiln  # noqa: E402
from kiln import ExecutionError, InputError, KilnError  # noqa: E402
from kiln.ir import Graph, evaluate  # noqa: E402
from kiln.runtime.onnxruntime_backend import OrtProgram, choose_providers  # noqa: E402

BACKENDS = ["kiln", "onnxruntime"]
RTOL, ATOL = 1e-5, 1e-6


def mlp(seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)
    g = Graph("mlp")
    x = g.add_input("x", "float32", ("batch", 8))
    w1 = g.add_initializer("fc1.weight", rng.standard_normal((16, 8)).astype(np.float32))
    b1 = g.add_initializer("fc1.bias", rng.standard_normal(16).astype(np.float32))
    w2 = g.add_initializer("fc2.weight", rng.standard_normal((4, 16)).astype(np.float32))
    h = g.op("Relu", g.op("Gemm", x, w1, b1, transB=1))
    logits = g.op("MatMul", h, g.op("Transpose", w2), name="logits")
    g.outputs = [logits, g.op("Softmax", logits, axis=-1, name="probs")]
    g.metadata.props["note"] = "two outputs"
    return g


def two_inputs() -> Graph:
    g = Graph("pair")
    a = g.add_input("a", "float32", ("batch", 2))
    b = g.add_input("b", "int64", ("batch", 2))
    g.outputs = [g.op("Add", a, g.op("Cast", b, to=1), name="sum")]
    return g


def onnx_mlp(path) -> tuple[str, np.ndarray, np.ndarray]:
    """An ONNX file made with onnx.helper (not by kiln): MatMul + Add + Relu with a dim_param."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
         helper.make_node("Relu", ["a"], ["y"])], "onnx_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="unit-test",
                              producer_version="1.2")
    model.ir_version = 8
    helper.set_model_props(model, {"origin": "onnx.helper"})
    onnx.save(model, str(path))
    return str(path), w, b


def load(graph_or_path, backend: str, **kwargs):
    return kiln.load(graph_or_path, backend=backend, **kwargs)


# ---------------------------------------------------------------------------- the shared interface
@pytest.mark.parametrize("backend", BACKENDS)
def test_specs_metadata_and_backend(backend):
    g = mlp()
    p = load(g, backend)
    assert p.backend == backend
    assert [(s.name, s.dtype, s.shape) for s in p.inputs] == [("x", "float32", ("batch", 8))]
    assert [(s.name, s.dtype) for s in p.outputs] == [("logits", "float32"), ("probs", "float32")]
    assert [s.shape for s in p.outputs] == [("batch", 4), ("batch", 4)]
    assert p.metadata["producer_name"] == "kiln" and p.metadata["note"] == "two outputs"
    assert p.metadata == kiln.load(g).metadata


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_by_name_in_order_and_as_list(backend):
    g = mlp()
    p = load(g, backend)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    want = evaluate(g, [x])
    by_name = p.run({"x": x})
    assert list(by_name) == ["logits", "probs"]
    in_order = p.run([x])
    as_list = p([x], as_list=True)
    assert isinstance(as_list, list) and len(as_list) == 2
    for w, a, b, c in zip(want, by_name.values(), in_order.values(), as_list):
        assert (a.dtype, a.shape) == (w.dtype, w.shape)
        np.testing.assert_allclose(a, w, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_errors_are_the_same_on_every_backend(backend):
    p = load(two_inputs(), backend)
    a, b = np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int64)
    with pytest.raises(InputError, match=r"input 'a': expected float32\[batch,2\], got float64\[2, 2\]"):
        p.run({"a": np.zeros((2, 2)), "b": b})
    with pytest.raises(InputError, match=r"input 'b': expected int64\[batch,2\], got int64\[2, 3\]"):
        p.run([a, np.zeros((2, 3), np.int64)])
    with pytest.raises(InputError, match=r"input 'b': expected int64\[batch,2\], got int64\[3, 2\] \(batch=2"):
        p.run([a, np.zeros((3, 2), np.int64)])
    with pytest.raises(InputError, match=r"missing \['b'\], unexpected \['c'\]"):
        p.run({"a": a, "c": b})
    with pytest.raises(InputError, match=r"takes 2 inputs \(a, b\), got 1"):
        p.run([a])
    np.testing.assert_array_equal(p.run({"a": a + 1, "b": b + 2})["sum"], np.full((2, 2), 3, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_run(backend):
    g = mlp()
    p = load(g, backend)
    x = np.random.default_rng(4).standard_normal((8, 6)).astype(np.float32).T  # a transposed view
    want = evaluate(g, [np.ascontiguousarray(x)])
    for w, o in zip(want, p.run([x], as_list=True)):
        np.testing.assert_allclose(o, w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failure_inside_the_engine_is_an_execution_error(backend):
    g = Graph("reshape")
    x = g.add_input("x", "float32", ("n",))
    shape = g.add_input("shape", "int64", (2,))
    g.outputs = [g.op("Reshape", x, shape, name="y")]
    p = load(g, backend)
    np.testing.assert_array_equal(p.run([np.arange(6, dtype=np.float32), np.array([2, 3])], as_list=True)[0],
                                  np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(ExecutionError):
        p.run([np.arange(6, dtype=np.float32), np.array([4, 4])])


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_runs_match_serial_runs(backend):
    p = load(mlp(), backend)
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((b, 8)).astype(np.float32) for b in (1, 2, 3, 5, 8, 13) * 2]
    serial = [p.run([x], as_list=True)[1] for x in inputs]
    results: list = [None] * len(inputs)

    def worker(k: int) -> None:
        for i in range(k, len(inputs), 4):
            for _ in range(10):
                results[i] = p.run([inputs[i]], as_list=True)[1]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s, r in zip(serial, results):
        np.testing.assert_array_equal(s, r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_control_flow_subgraphs_run(backend):
    g = Graph("control")
    x = g.add_input("x", "float32", (2, 3))
    outer = g.add_input("outer", "float32", (2, 3))
    g.outputs = [if_block(g, x, outer), loop_block(g, x, 3)]
    p = load(g, backend)
    rng = np.random.default_rng(5)
    for sign in (1, -1):  # both branches of the If
        feed = {"x": sign * np.abs(rng.standard_normal((2, 3))).astype(np.float32),
                "outer": rng.standard_normal((2, 3)).astype(np.float32)}
        for w, o in zip(evaluate(g, feed), p.run(feed, as_list=True)):
            np.testing.assert_allclose(o, w, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------- files
@pytest.mark.parametrize("backend", BACKENDS)
def test_kiln_and_onnx_files_load_with_either_backend(backend, tmp_path):
    onnx_path, w, b = onnx_mlp(tmp_path / "m.onnx")
    p = load(onnx_path, backend)
    assert p.backend == backend
    assert [(s.name, s.dtype, s.shape) for s in p.inputs] == [("x", "float32", ("n", 4))]
    assert [(s.name, s.dtype, s.shape) for s in p.outputs] == [("y", "float32", ("n", 3))]
    assert p.metadata["origin"] == "onnx.helper"  # the file's metadata_props, on either backend
    if backend == "onnxruntime":  # the file's own header
        assert (p.metadata["producer_name"], p.metadata["producer_version"]) == ("unit-test", "1.2")
    else:  # a graph made by kiln's importer, which records where it came from
        assert p.metadata["onnx.producer"] == "unit-test 1.2"
    x = np.random.default_rng(6).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(p.run({"x": x})["y"], np.maximum(x @ w + b, 0), rtol=RTOL, atol=ATOL)

    kiln_path = kiln.save(mlp(), tmp_path / "mlp.kiln")
    q = load(kiln_path, backend)
    assert q.backend == backend and [s.name for s in q.outputs] == ["logits", "probs"]
    x = np.random.default_rng(7).standard_normal((2, 8)).astype(np.float32)
    for w_, o in zip(evaluate(mlp(), [x]), q.run([x], as_list=True)):
        np.testing.assert_allclose(o, w_, rtol=RTOL, atol=ATOL)


def test_onnx_file_in_kiln_runtime_matches_onnxruntime(tmp_path):
    onnx_path, _, _ = onnx_mlp(tmp_path / "m.onnx")
    k, o = kiln.load(onnx_path), kiln.load(onnx_path, backend="onnxruntime")
    assert type(k).__name__ == "Program" and isinstance(o, OrtProgram)
    assert k.graph.metadata.props["onnx.producer"] == "unit-test 1.2"
    x = np.random.default_rng(8).standard_normal((7, 4)).astype(np.float32)
    np.testing.assert_allclose(k.run([x], as_list=True)[0], o.run([x], as_list=True)[0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_file_is_a_kiln_error(backend, tmp_path):
    with pytest.raises(KilnError, match="nothing.kiln: No such file"):
        load(tmp_path / "nothing.kiln", backend)
    with pytest.raises(KilnError, match="no such file: .*nothing.onnx"):
        load(tmp_path / "nothing.onnx", backend)


# ---------------------------------------------------------------------------- options and errors
def test_unknown_backend_lists_the_choices():
    with pytest.raises(KilnError, match=r"unknown backend 'tvm': choose one of 'kiln', 'onnxruntime'"):
        kiln.load(mlp(), backend="tvm")


def test_threads_set_ort_intra_op_threads_and_give_the_same_results():
    g = mlp()
    one, two = (kiln.load(g, backend="onnxruntime", threads=t) for t in (1, 2))
    assert one.session.get_session_options().intra_op_num_threads == 1
    assert two.session.get_session_options().intra_op_num_threads == 2
    x = np.random.default_rng(9).standard_normal((64, 8)).astype(np.float32)
    for a, b in zip(one.run([x], as_list=True), two.run([x], as_list=True)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(KilnError, match="threads= must be a positive int"):
        kiln.load(g, threads=0)  # kiln's own backend takes threads= too (its BLAS threads)
    with pytest.raises(KilnError, match="threads must be at least 1"):
        kiln.load(g, backend="onnxruntime", threads=0)


def test_optimize_false_turns_ort_graph_optimizations_off():
    p = kiln.load(mlp(), backend="onnxruntime", optimize=False)
    assert p.session.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    x = np.ones((2, 8), np.float32)
    np.testing.assert_allclose(p.run([x], as_list=True)[1], evaluate(mlp(), [x])[1], rtol=RTOL, atol=ATOL)


def test_providers_follow_the_device():
    cpu, cuda = ["CPUExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers("cpu", cuda) == cpu
    assert choose_providers("auto", cuda) == cuda
    assert choose_providers("auto", cpu) == cpu
    assert choose_providers("cuda", cuda) == cuda and choose_providers("cuda:1", cuda) == cuda
    with pytest.raises(KilnError, match="no CUDAExecutionProvider.*install onnxruntime-gpu"):
        choose_providers("cuda", cpu)
    for bad in ("gpu", "cpu:1", "cuda:x"):
        with pytest.raises(KilnError, match="unknown device"):
            choose_providers(bad, cuda)


def test_cuda_without_the_cuda_provider_is_refused(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(KilnError, match="device 'cuda': this onnxruntime has no CUDAExecutionProvider"):
        kiln.load(mlp(), backend="onnxruntime", device="cuda")
    assert kiln.load(mlp(), backend="onnxruntime", device="auto").providers == ["CPUExecutionProvider"]
    with pytest.raises(KilnError, match="device 'cuda' is not available yet"):
        kiln.load(mlp(), device="cuda")  # kiln's own runtime: CPU only


def test_missing_onnxruntime_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(KilnError, match=r"the onnxruntime backend needs the 'onnxruntime' package: "
                                        r"pip install 'kiln-compiler\[onnx\]'"):
        kiln.load(mlp(), backend="onnxruntime")


# ---------------------------------------------------------------------------- zoo models
@pytest.mark.parametrize("name", ["mlp", "resnet18", "transformer_encoder", "gpt"])
def test_zoo_models_in_onnxruntime_match_kiln(name, tmp_path):
    pytest.importorskip("torch")
    import zoo
    from kiln.frontend.tracer import to_numpy

    model, inputs, spec = zoo.by_name(name).factory()
    path = kiln.save(kiln.trace(model, inputs, dynamic=spec), tmp_path / f"{name}.kiln")
    k, o = kiln.load(path), kiln.load(path, backend="onnxruntime")
    assert [(s.name, s.type) for s in o.inputs] == [(s.name, s.type) for s in k.inputs]
    assert [(s.name, s.type) for s in o.outputs] == [(s.name, s.type) for s in k.outputs]
    names, tensors = zoo.input_list(model, inputs)
    feeds = {n: to_numpy(t) for n, t in zip(names, tensors)}
    for i, (a, b) in enumerate(zip(k.run(feeds, as_list=True), o.run(feeds, as_list=True))):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"{name}: output {k.outputs[i].name}")


# ---------------------------------------------------------------------------- package surface
def test_top_level_export_and_import_round_trip(tmp_path):
    g = mlp()
    path = kiln.export_onnx(g, tmp_path / "mlp.onnx")
    back = kiln.import_onnx(path)
    assert [v.name for v in back.inputs] == ["x"] and [v.name for v in back.outputs] == ["logits", "probs"]
    x = np.random.default_rng(10).standard_normal((4, 8)).astype(np.float32)
    for w, o in zip(evaluate(g, [x]), evaluate(back, [x])):
        np.testing.assert_allclose(o, w, rtol=RTOL, atol=ATOL)


def test_the_kiln_backend_never_imports_onnx(tmp_path):
    path = kiln.save(mlp(), tmp_path / "mlp.kiln")
    code = ("import sys, numpy as np, kiln\n"
            f"p = kiln.load({str(path)!r})\n"
            "p.run([np.ones((1, 8), np.float32)])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxruntime')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"

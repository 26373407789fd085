"""Per-program CUDA settings (issue 17): ``kiln.runtime.cuda_options.CudaOptions``.

The first half runs everywhere (CI has no GPU): defaults, environment parsing (read once, at
construction), validation, the deprecated process defaults, ``build``/``replace``, and
``kiln.load`` refusing an unknown option before it reads anything. The second half needs CuPy
and a GPU (marked ``gpu``, skipped cleanly without one): two programs in one process with
different settings, run interleaved (A, B, A, B), eager and under CUDA-graph replay, and from
two threads at once, each keeping its own TF32 precision, conv path and attention path."""
from __future__ import annotations

import dataclasses
import threading
import warnings

import numpy as np
import pytest

import kiln
from kiln.errors import KilnError
from kiln.runtime import cuda_options as co
from kiln.runtime.cuda_options import CudaOptions

ENV_VARS = tuple(co.ENV.values())


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """No environment variable and no deprecated process default leaks into a test."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    saved = (co.PROCESS_DEFAULTS["tf32"], co.CONV_DEFAULT["mode"], co.ATTENTION_DEFAULT["mode"])
    co.PROCESS_DEFAULTS["tf32"] = co.CONV_DEFAULT["mode"] = co.ATTENTION_DEFAULT["mode"] = None
    yield
    co.PROCESS_DEFAULTS["tf32"], co.CONV_DEFAULT["mode"], co.ATTENTION_DEFAULT["mode"] = saved


# --------------------------------------------------------------------------- CPU: the options object

def test_wait_is_poll_or_block():
    assert CudaOptions(wait="block").wait == "block"
    with pytest.raises(KilnError, match="wait must be 'poll' or 'block'"):
        CudaOptions(wait="spin")


def test_defaults():
    o = CudaOptions()
    assert o.as_dict() == {"tf32": False, "conv": "auto", "attention": "auto", "cudnn_workspace_mib": 32.0,
                           "cudnn_epilogue": True, "cuda_graphs": "auto", "fuse": True, "output": "cupy",
                           "wait": "poll"}
    assert o.workspace_cap_bytes == 32 << 20
    assert co.FIELDS == tuple(o.as_dict())


@pytest.mark.parametrize("var,value,field,want", [
    ("KILN_CUDA_CONV", "im2col", "conv", "im2col"),
    ("KILN_CUDA_CONV", " CUDNN ", "conv", "cudnn"),
    ("KILN_ATTENTION", "ops", "attention", "ops"),
    ("KILN_ATTENTION", "Kernel", "attention", "kernel"),
    ("KILN_CUDNN_WORKSPACE_MIB", "none", "cudnn_workspace_mib", None),
    ("KILN_CUDNN_WORKSPACE_MIB", "NONE", "cudnn_workspace_mib", None),
    ("KILN_CUDNN_WORKSPACE_MIB", "64", "cudnn_workspace_mib", 64.0),
    ("KILN_CUDNN_WORKSPACE_MIB", "0.5", "cudnn_workspace_mib", 0.5),
    ("KILN_CUDNN_WORKSPACE_MIB", "0", "cudnn_workspace_mib", 0.0),
    ("KILN_CUDNN_EPILOGUE", "0", "cudnn_epilogue", False),
    ("KILN_CUDNN_EPILOGUE", "off", "cudnn_epilogue", False),
    ("KILN_CUDNN_EPILOGUE", "1", "cudnn_epilogue", True),
    ("KILN_CUDNN_EPILOGUE", "true", "cudnn_epilogue", True),
    ("KILN_CUDNN_EPILOGUE", "", "cudnn_epilogue", True),  # empty: as if unset
])
def test_environment_gives_the_defaults(monkeypatch, var, value, field, want):
    monkeypatch.setenv(var, value)
    assert getattr(CudaOptions(), field) == want


def test_workspace_cap_bytes():
    assert CudaOptions(cudnn_workspace_mib=None).workspace_cap_bytes is None
    assert CudaOptions(cudnn_workspace_mib=1.5).workspace_cap_bytes == 3 << 19
    assert CudaOptions(cudnn_workspace_mib="none").cudnn_workspace_mib is None
    assert CudaOptions(cudnn_workspace_mib=8).cudnn_workspace_mib == 8.0


def test_environment_is_read_once_at_construction(monkeypatch):
    monkeypatch.setenv("KILN_CUDA_CONV", "im2col")
    monkeypatch.setenv("KILN_CUDNN_WORKSPACE_MIB", "8")
    first = CudaOptions()
    monkeypatch.setenv("KILN_CUDA_CONV", "cudnn")
    monkeypatch.delenv("KILN_CUDNN_WORKSPACE_MIB")
    assert (first.conv, first.cudnn_workspace_mib) == ("im2col", 8.0)   # unchanged
    assert (CudaOptions().conv, CudaOptions().cudnn_workspace_mib) == ("cudnn", 32.0)


def test_explicit_values_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("KILN_CUDA_CONV", "im2col")
    monkeypatch.setenv("KILN_ATTENTION", "ops")
    monkeypatch.setenv("KILN_CUDNN_EPILOGUE", "0")
    monkeypatch.setenv("KILN_CUDNN_WORKSPACE_MIB", "none")
    o = CudaOptions(conv="cudnn", attention="kernel", cudnn_epilogue=True, cudnn_workspace_mib=16)
    assert (o.conv, o.attention, o.cudnn_epilogue, o.cudnn_workspace_mib) == ("cudnn", "kernel", True, 16.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"conv": "fast"}, "conv must be one of"),
    ({"conv": "CUDNN"}, "conv must be one of"),           # explicit values are exact
    ({"attention": "flash"}, "attention must be one of"),
    ({"tf32": "yes"}, "tf32 must be True or False"),
    ({"tf32": 1}, "tf32 must be True or False"),
    ({"cudnn_workspace_mib": -1}, "finite number of MiB >= 0"),
    ({"cudnn_workspace_mib": float("nan")}, "finite number of MiB >= 0"),
    ({"cudnn_workspace_mib": float("inf")}, "finite number of MiB >= 0"),
    ({"cudnn_workspace_mib": "lots"}, "number of MiB or 'none'"),
    ({"cudnn_workspace_mib": True}, "number of MiB or None"),
    ({"cudnn_epilogue": "0"}, "cudnn_epilogue must be True or False"),
    ({"cuda_graphs": "sometimes"}, "cuda_graphs must be True, False or 'auto'"),
    ({"cuda_graphs": 1}, "cuda_graphs must be True, False or 'auto'"),
    ({"fuse": 1}, "fuse must be True or False"),
    ({"output": "torch"}, "output must be one of"),
])
def test_invalid_values_are_refused(kwargs, match):
    with pytest.raises(KilnError, match=match):
        CudaOptions(**kwargs)


@pytest.mark.parametrize("var,value,match", [
    ("KILN_CUDA_CONV", "fastest", "KILN_CUDA_CONV='fastest'"),
    ("KILN_ATTENTION", "flash", "KILN_ATTENTION='flash'"),
    ("KILN_CUDNN_WORKSPACE_MIB", "lots", "KILN_CUDNN_WORKSPACE_MIB='lots'"),
    ("KILN_CUDNN_WORKSPACE_MIB", "-4", "finite number of MiB >= 0"),
    ("KILN_CUDNN_EPILOGUE", "maybe", "KILN_CUDNN_EPILOGUE='maybe'"),
])
def test_invalid_environment_names_the_variable(monkeypatch, var, value, match):
    monkeypatch.setenv(var, value)
    with pytest.raises(KilnError, match=match):
        CudaOptions()


def test_frozen_hashable_and_comparable():
    a, b = CudaOptions(tf32=True), CudaOptions(tf32=True)
    assert a == b and hash(a) == hash(b) and a != CudaOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tf32 = False  # type: ignore[misc]
    assert {a: 1}[b] == 1


def test_build_and_replace():
    base = CudaOptions(conv="im2col")
    assert CudaOptions.build() == CudaOptions()
    assert CudaOptions.build(base) is base
    assert CudaOptions.build(base, tf32=None, output=None) is base          # None: not given
    built = CudaOptions.build(base, tf32=True, output="numpy")
    assert (built.conv, built.tf32, built.output) == ("im2col", True, "numpy")
    assert base.tf32 is False                                              # the original is untouched
    assert base.replace(attention="ops").attention == "ops"
    with pytest.raises(KilnError, match="unknown CUDA option"):
        CudaOptions.build(base, tf33=True)
    with pytest.raises(KilnError, match="unknown CUDA option"):
        base.replace(mode="cudnn")
    with pytest.raises(KilnError, match="options must be a CudaOptions"):
        CudaOptions.build({"tf32": True})
    with pytest.raises(KilnError, match="conv must be one of"):
        base.replace(conv="fast")


def test_replace_keeps_resolved_values_not_the_environment(monkeypatch):
    monkeypatch.setenv("KILN_CUDA_CONV", "im2col")
    o = CudaOptions()
    monkeypatch.setenv("KILN_CUDA_CONV", "cudnn")
    assert o.replace(tf32=True).conv == "im2col"


def test_deprecated_process_defaults(monkeypatch):
    monkeypatch.setenv("KILN_CUDA_CONV", "im2col")
    monkeypatch.setenv("KILN_ATTENTION", "ops")
    co.set_process_tf32(True)
    co.CONV_DEFAULT["mode"] = "cudnn"           # what the deprecated cudnn.set_mode writes
    co.ATTENTION_DEFAULT["mode"] = "kernel"     # what old code writing attention.MODE does
    o = CudaOptions()
    assert (o.tf32, o.conv, o.attention) == (True, "cudnn", "kernel")   # over the environment
    explicit = CudaOptions(tf32=False, conv="auto", attention="auto")
    assert (explicit.tf32, explicit.conv, explicit.attention) == (False, "auto", "auto")
    co.set_process_tf32(None)
    co.CONV_DEFAULT["mode"] = co.ATTENTION_DEFAULT["mode"] = None
    o = CudaOptions()
    assert (o.tf32, o.conv, o.attention) == (False, "im2col", "ops")
    co.CONV_DEFAULT["mode"] = "fast"            # a bad process default is refused like any value
    with pytest.raises(KilnError, match="conv must be one of"):
        CudaOptions()


def test_load_refuses_an_unknown_cuda_option_before_reading(tmp_path):
    missing = tmp_path / "absent.kiln"
    with pytest.raises(KilnError, match=r"unknown CUDA option\(s\) \['tf33'\]"):
        kiln.load(missing, device="cuda", tf33=True)
    with pytest.raises(KilnError, match="are for device='cuda'"):
        kiln.load(missing, device="cpu", conv="im2col")


# --------------------------------------------------------------------------- GPU: two programs, one process

def _gpu():
    """(cupy, CudaProgram) or skip: no CuPy (CI) or no device."""
    cp = pytest.importorskip("cupy")
    try:
        devices = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        devices = 0
    if devices == 0:
        pytest.skip("no CUDA device")
    from kiln.runtime.cuda_program import CudaProgram
    return cp, CudaProgram


RNG = np.random.default_rng(17)


def _r(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _rel(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def _matmul_graph(kind: str, n: int = 1024):
    """x[n, n] @ W[n, n] (W constant: cuBLAS), x @ y (both inputs: cuBLAS), or x @ W + b (a
    FusedEpilogue: cuBLASLt's bias epilogue), with the float64 reference of one input set."""
    from kiln.ir import Graph
    from kiln.ir.passes.shape_inference import infer_shapes
    g = Graph(f"mm_{kind}")
    x = g.add_input("x", "float32", [n, n])
    w, b = _r(n, n), _r(n)
    if kind == "dynamic":
        y = g.add_input("y", "float32", [n, n])
        g.outputs = [g.op("MatMul", x, y)]
        feeds = [_r(n, n), w]
    else:
        t = g.op("MatMul", x, g.add_initializer("w", w))
        g.outputs = [g.op("Add", t, g.add_initializer("b", b)) if kind == "bias" else t]
        feeds = [_r(n, n)]
    infer_shapes(g)
    want = feeds[0].astype(np.float64) @ (feeds[1] if kind == "dynamic" else w).astype(np.float64)
    if kind == "bias":
        want = want + b
    return g, feeds, want


TF32_ERR = 1e-4    # a TF32 product of 1024-long float32 dot products: ~5e-4 relative
STRICT_ERR = 1e-5  # full float32: ~1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kind", ["const", "dynamic", "bias"])
def test_tf32_is_per_program(kind, graphs):
    cp, CudaProgram = _gpu()
    g, feeds, want = _matmul_graph(kind)
    a = CudaProgram(g.copy(), tf32=True, output="numpy", cuda_graphs=graphs)
    b = CudaProgram(g.copy(), tf32=False, output="numpy", cuda_graphs=graphs)
    assert (a.tf32, b.tf32, a.options.tf32, b.options.tf32) == (True, False, True, False)
    if kind == "bias":
        assert "cublasLt bias" in a.epilogues and "cublasLt bias" in b.epilogues
    errs = {"a": [], "b": []}
    for _ in range(3):  # A, B, A, B, A, B: each keeps its own precision
        errs["a"].append(_rel(a.run(feeds, as_list=True)[0], want))
        errs["b"].append(_rel(b.run(feeds, as_list=True)[0], want))
    assert all(e > TF32_ERR for e in errs["a"]), errs
    assert all(e < STRICT_ERR for e in errs["b"]), errs
    if graphs:
        assert a.captured_graphs() == b.captured_graphs() == 1
        assert a.graph_failures == b.graph_failures == {}
    # Programs made and run after both, with either setting, change neither.
    for tf32 in (False, True):
        CudaProgram(g.copy(), tf32=tf32, output="numpy", cuda_graphs=graphs).run(feeds)
        assert _rel(a.run(feeds, as_list=True)[0], want) > TF32_ERR
        assert _rel(b.run(feeds, as_list=True)[0], want) < STRICT_ERR


@pytest.mark.gpu
def test_tf32_programs_on_two_threads_at_once():
    cp, CudaProgram = _gpu()
    g, feeds, want = _matmul_graph("const")
    progs = {True: CudaProgram(g.copy(), tf32=True, output="numpy", cuda_graphs=False),
             False: CudaProgram(g.copy(), tf32=False, output="numpy", cuda_graphs=False)}
    errs: dict = {True: [], False: []}
    start = threading.Barrier(2)

    def work(tf32):
        start.wait()
        for _ in range(20):  # the default stream of each thread: one stream, both math modes
            errs[tf32].append(_rel(progs[tf32].run(feeds, as_list=True)[0], want))
    threads = [threading.Thread(target=work, args=(t,)) for t in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errs[True]) == len(errs[False]) == 20
    assert all(e > TF32_ERR for e in errs[True]), errs[True]
    assert all(e < STRICT_ERR for e in errs[False]), errs[False]


@pytest.mark.gpu
def test_deprecated_set_tf32_leaves_loaded_programs_alone():
    cp, CudaProgram = _gpu()
    from kiln.runtime.cuda_program import set_tf32
    from cupy._core import _routines_linalg as rl
    g, feeds, want = _matmul_graph("const", n=512)
    compute_type = getattr(rl, "get_compute_type", lambda dtype: None)
    before = compute_type(np.float32)
    strict = CudaProgram(g.copy(), output="numpy", cuda_graphs=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_tf32(True)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    later = CudaProgram(g.copy(), output="numpy", cuda_graphs=False)
    assert (strict.tf32, later.tf32) == (False, True)  # the process default reaches new programs only
    assert _rel(strict.run(feeds, as_list=True)[0], want) < STRICT_ERR
    assert _rel(later.run(feeds, as_list=True)[0], want) > TF32_ERR
    assert compute_type(np.float32) == before   # CuPy's process-wide setting untouched


def _conv_graph():
    from kiln.ir import Graph
    from kiln.ir.passes.shape_inference import infer_shapes
    g = Graph("conv")
    x = g.add_input("x", "float32", [2, 32, 16, 16])
    w, b = _r(48, 32, 3, 3, scale=1 / np.sqrt(288)), _r(48)
    t = g.op("Conv", x, g.add_initializer("w", w), g.add_initializer("b", b), pads=[1, 1, 1, 1])
    g.outputs = [g.op("Relu", t)]
    infer_shapes(g)
    return g


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_conv_mode_is_per_program(graphs):
    cp, CudaProgram = _gpu()
    from kiln.ir import evaluate
    from kiln.runtime.kernels.cuda import cudnn
    if not cudnn.available():
        pytest.skip(f"cuDNN path unavailable: {cudnn.why_unavailable()}")
    g = _conv_graph()
    progs = {mode: CudaProgram(g.copy(), conv=mode, output="numpy", cuda_graphs=graphs)
             for mode in ("im2col", "cudnn", "auto")}
    feeds = [_r(2, 32, 16, 16)]
    want = evaluate(g, feeds)[0].astype(np.float64)
    for _ in range(2):  # interleaved: im2col, cudnn, auto, im2col, cudnn, auto
        outs = {m: p.run(feeds, as_list=True)[0] for m, p in progs.items()}
        for m, y in outs.items():
            assert _rel(y, want) < 1e-5, m
    assert progs["im2col"].conv_paths == {"im2col": 1}
    assert progs["cudnn"].conv_paths == {"cudnn": 1}
    # Batch 2 < CUDNN_MIN_BATCH: "auto" takes im2col even though the cudnn program of the same
    # shape decided for cuDNN (the decisions are keyed by the settings too).
    assert progs["auto"].conv_paths == {"im2col": 1}
    assert {p.options.conv for p in progs.values()} == {"im2col", "cudnn", "auto"}
    if graphs:
        assert all(p.graph_failures == {} for p in progs.values())


def _attention_graph(d: int = 32):
    from kiln.ir import Graph
    from kiln.ir.passes.shape_inference import infer_shapes
    g = Graph("attn")
    x = g.add_input("x", "float32", ["batch", 20, 4 * d])
    shape = g.add_constant(np.array([0, 20, 4, d], np.int64))
    q, k, v = [g.op("Transpose", g.op("Reshape", g.op("MatMul", x, g.add_initializer(n, _r(4 * d, 4 * d) * 0.1)),
                                      shape), perm=[0, 2, 1, 3]) for n in ("wq", "wk", "wv")]
    s = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])),
             g.add_constant(np.array(1 / np.sqrt(d), np.float32)))
    o = g.op("MatMul", g.op("Softmax", s, axis=-1), v)
    g.outputs = [g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]),
                      g.add_constant(np.array([0, 20, 4 * d], np.int64)))]
    infer_shapes(g)
    return g


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_attention_mode_is_per_program(graphs):
    cp, CudaProgram = _gpu()
    from kiln.ir import evaluate
    g = _attention_graph()
    progs = {mode: CudaProgram(g.copy(), attention=mode, output="numpy", cuda_graphs=graphs)
             for mode in ("kernel", "ops")}
    assert all(p.fused_attention == 1 for p in progs.values())
    feeds = [_r(2, 20, 128)]
    want = evaluate(g, feeds)[0]
    for _ in range(3):  # kernel, ops, kernel, ops, ...
        for m, p in progs.items():
            np.testing.assert_allclose(p.run(feeds, as_list=True)[0], want, rtol=1e-4, atol=1e-5, err_msg=m)
    k, o = progs["kernel"].attention_paths, progs["ops"].attention_paths
    assert k["kernel"] > 0 and k["ops"] == 0, k
    assert o["ops"] > 0 and o["kernel"] == 0, o
    if graphs:  # eager warm-up + capture: two calls each, the replays run no Python
        assert k == {"cudnn": 0, "kernel": 2, "ops": 0} and o == {"cudnn": 0, "kernel": 0, "ops": 2}
        assert all(p.graph_failures == {} for p in progs.values()), {m: p.graph_failures for m, p in progs.items()}
    else:
        assert k == {"cudnn": 0, "kernel": 3, "ops": 0} and o == {"cudnn": 0, "kernel": 0, "ops": 3}


@pytest.mark.gpu
def test_load_passes_the_options(tmp_path):
    cp, CudaProgram = _gpu()
    g, feeds, want = _matmul_graph("const", n=512)
    a = kiln.load(g, device="cuda", tf32=True, conv="im2col", attention="ops", cudnn_workspace_mib="none",
                  cudnn_epilogue=False, output="numpy")
    assert a.options == CudaOptions(tf32=True, conv="im2col", attention="ops", cudnn_workspace_mib=None,
                                    cudnn_epilogue=False, output="numpy")
    b = kiln.load(g, device="cuda", options=a.options.replace(tf32=False))
    assert (b.tf32, b.output, b.options.conv) == (False, "numpy", "im2col")
    assert _rel(a.run(feeds, as_list=True)[0], want) > TF32_ERR
    assert _rel(b.run(feeds, as_list=True)[0], want) < STRICT_ERR

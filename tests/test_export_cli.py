"""``kiln export``, run as a real process: the bundled example models, every zoo model, the files
``kiln inspect`` reads back, and the errors a user can make."""
from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
import zoo  # noqa: E402
from cli_helpers import run_cli  # noqa: E402

ROOT = Path(kiln.__file__).resolve().parent
EXAMPLES = ROOT / "examples" / "models.py"
TESTS = ROOT / "tests"


def kiln_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """``kiln ARGS`` in this process (tests/cli_helpers.py: no torch import per call)."""
    return run_cli(*args, cwd=cwd)


def inspect_json(path: Path) -> dict:
    r = kiln_cli("inspect", path, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def load_examples():
    spec = importlib.util.spec_from_file_location("kiln_example_models", EXAMPLES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------- the examples
EXAMPLE_CASES = [
    ("MLP", ["--input", "x:2x64", "--dynamic-batch"], {"x": ["batch", 64]}),
    ("SmallCNN", ["--input", "x:1x3x32x32:float32", "--dynamic-batch"], {"x": ["batch", 3, 32, 32]}),
    ("tiny_transformer", ["--input", "ids:2x16:int64:0:1000", "--dynamic-batch", "--dynamic", "ids:1:seq"],
     {"ids": ["batch", "seq"]}),
]


@pytest.mark.parametrize("attr,args,shapes", EXAMPLE_CASES, ids=[c[0] for c in EXAMPLE_CASES])
def test_export_example_model(attr, args, shapes, tmp_path):
    out = tmp_path / f"{attr}.kiln"
    r = kiln_cli("export", f"{EXAMPLES}:{attr}", "-o", out, *args)
    assert r.returncode == 0, r.stderr
    for step in ("loading", "tracing", "checking", "optimizing", "saving"):
        assert f"\n{step} " in "\n" + r.stderr, f"no progress line for {step}: {r.stderr}"
    assert " s\n" in r.stderr
    for key in ("wrote", "ops", "parameters", "check       passed"):
        assert key in r.stdout, r.stdout
    summary = inspect_json(out)
    assert {v["name"]: v["shape"] for v in summary["inputs"]} == shapes
    assert summary["metadata"]["source"] == f"{EXAMPLES}:{attr}"
    assert "warning" not in r.stderr  # a class is built and put in eval mode by the command
    model = getattr(load_examples(), attr)()
    if attr == "MLP":  # (BatchNorm folding changes the count; see test_zoo for the transformer's)
        assert f"parameters  {sum(p.numel() for p in model.parameters()):,} " in r.stdout
    _check_numerics(out, model.eval(), shapes)


def _check_numerics(path: Path, model, shapes: dict) -> None:
    """The exported graph, loaded back, matches the model at sizes other than the example's."""
    graph = kiln.load_graph(path)
    gen = torch.Generator().manual_seed(5)
    feeds = {}
    for name, shape in shapes.items():
        dims = [3 if d == "batch" else 7 if d == "seq" else d for d in shape]
        is_ids = graph.inputs[0].dtype is kiln.DType.INT64
        feeds[name] = torch.randint(0, 1000, dims, generator=gen) if is_ids else torch.randn(dims, generator=gen)
    with torch.no_grad():
        want = model(**feeds).numpy()
    (got,) = kiln.evaluate(graph, {n: t.numpy() for n, t in feeds.items()})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dotted_module_name_no_check_no_optimize(tmp_path):
    out = tmp_path / "mlp.kiln"
    r = kiln_cli("export", "models:MLP", "-o", out, "--input", "x:3x64", "--no-check", "--no-optimize",
                 cwd=EXAMPLES.parent)
    assert r.returncode == 0, r.stderr
    assert "checking" not in r.stderr and "optimizing" not in r.stderr
    assert "check       skipped (--no-check)" in r.stdout
    summary = inspect_json(out)
    assert summary["inputs"][0]["shape"] == [3, 64]
    assert f"nodes       {summary['nodes']} (traced {summary['nodes']})" in r.stdout


# ---------------------------------------------------------------------------- every zoo model
ZOO_MODULE = """
import sys
sys.path.insert(0, {tests!r})
import zoo


def model():
    return zoo.by_name({name!r}).factory()[0]
"""


def _input_specs(entry) -> list[str]:
    model, inputs, spec = entry.factory()
    names, tensors = zoo.input_list(model, inputs)
    args = []
    for n, t in zip(names, tensors):
        text = f"{n}:{'x'.join(str(s) for s in t.shape)}:{str(t.dtype).replace('torch.', '')}"
        if not t.dtype.is_floating_point:
            text += f":0:{int(t.max()) + 1}"
        args += ["--input", text]
    for n, dims in spec.items():
        args += [a for d, sym in dims.items() for a in ("--dynamic", f"{n}:{d}:{sym}")]
    return args


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.name) for e in zoo.ZOO
                                   if e.needs is None or importlib.util.find_spec(e.needs)])
def test_export_every_zoo_model(entry, tmp_path):
    source = tmp_path / f"zoo_{entry.name}.py"
    source.write_text(ZOO_MODULE.format(tests=str(TESTS), name=entry.name))
    out = tmp_path / f"{entry.name}.kiln"
    # The numerics are checked in-process by tests/frontend/test_zoo.py; here the command runs.
    r = kiln_cli("export", f"{source}:model", "-o", out, "--no-check", *_input_specs(entry))
    assert r.returncode == 0, r.stderr
    summary = inspect_json(out)
    assert summary["nodes"] > 0 and summary["parameters"] > 0


# ---------------------------------------------------------------------------- errors
BAD_MODELS = """
import torch


class Odd(torch.nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x)


class Branchy(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return -x


class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        raise RuntimeError("no weights here")


def not_a_model():
    return 42


THRESHOLD = 0.5
"""


@pytest.fixture
def bad_models(tmp_path) -> Path:
    path = tmp_path / "bad_models.py"
    path.write_text(BAD_MODELS)
    return path


ERRORS = [
    ("{examples}:MLP", ["--input", "x:2xax64"], "bad --input 'x:2xax64'"),
    ("{examples}:MLP", ["--input", "x:2x64:float99"], "unknown dtype 'float99'"),
    ("{examples}:MLP", ["--input", "x"], "expected NAME:SHAPE"),
    ("{examples}:MLP", ["--input", "x:2x64:int64:9:1"], "LOW < HIGH"),
    ("{examples}:MLP", ["--input", "x:2x64", "--dynamic", "x:one:batch"], "DIM 'one' must be an integer"),
    ("{examples}:MLP", ["--input", "x:2x64", "--dynamic", "y:0:batch"], "'y', which is not an input"),
    ("{examples}:MLP", ["--input", "y:2x64"], "not parameters of"),
    ("{examples}:NoSuchModel", ["--input", "x:2x64"], "has no attribute 'NoSuchModel'"),
    ("{examples}", ["--input", "x:2x64"], "expected MODULE:ATTR"),
    ("missing_file.py:MLP", ["--input", "x:2x64"], "no such file: missing_file.py"),
    ("no_such_module_here:MLP", ["--input", "x:2x64"], "no module named 'no_such_module_here'"),
    ("{bad}:not_a_model", ["--input", "x:4"], "a factory returning one (it returned int)"),
    ("{bad}:THRESHOLD", ["--input", "x:4"], "(got float)"),
    ("{bad}:Broken", ["--input", "x:4"], "loading the model failed: RuntimeError: no weights here"),
    ("{examples}:MLP", ["--input", "x:2x65"], "tracing failed: RuntimeError: mat1 and mat2 shapes cannot be"),
    ("{examples}:MLP", ["--input", "x:2x64", "-o", "no/such/folder/m.kiln"], "the folder"),
    ("{bad}:Odd", ["--input", "x:4"], "bessel_j0' is not supported by kiln's tracer"),
    ("{bad}:Branchy", ["--input", "x:4"], "refuses fresh random inputs"),
    ("{examples}:MLP", ["--input", "x:2x64", "--precision", "fp16", "--op-precision", "Relu"], "OP=half or OP=float32"),
    ("{examples}:MLP", ["--input", "x:2x64", "--half-io"], "--op-precision and --half-io go with --precision"),
]


@pytest.mark.parametrize("target,args,message", ERRORS, ids=[e[2] for e in ERRORS])
def test_export_errors_are_one_clear_line(target, args, message, bad_models, tmp_path):
    out = tmp_path / "m.kiln"
    r = kiln_cli("export", target.format(examples=EXAMPLES, bad=bad_models), "-o", out, *args, cwd=tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "kiln export: error: " in r.stderr and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_trace_warnings_are_printed_and_counted(bad_models, tmp_path):
    out = tmp_path / "m.kiln"
    r = kiln_cli("export", f"{bad_models}:Branchy", "-o", out, "--input", "x:4", "--no-check")
    assert r.returncode == 0, r.stderr
    assert "warning: " in r.stderr and "reads a Python value" in r.stderr
    assert "warnings    1 TraceWarning(s)" in r.stdout
    assert out.exists()


def test_missing_input_is_a_usage_error(tmp_path):
    r = kiln_cli("export", f"{EXAMPLES}:MLP", "-o", tmp_path / "m.kiln")
    assert r.returncode == 2 and "--input" in r.stderr


# ---------------------------------------------------------------------------- --script
SCRIPTED_MODELS = """
import torch


class Branchy(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return -x


class Retry(torch.nn.Module):
    def forward(self, x):
        try:
            return x.exp()
        except RuntimeError:
            return x
"""


@pytest.fixture
def scripted_models(tmp_path) -> Path:
    path = tmp_path / "scripted_models.py"
    path.write_text(SCRIPTED_MODELS)
    return path


def test_script_keeps_the_branch_that_tracing_gets_wrong(scripted_models, tmp_path):
    out, onnx_out = tmp_path / "branchy.kiln", tmp_path / "branchy.onnx"
    # Positive examples: a trace would keep only 'x * 2' and its check fails (see ERRORS above).
    r = kiln_cli("export", f"{scripted_models}:Branchy", "--script", "-o", out, "--onnx", onnx_out,
                 "--input", "x:4:float32:0.5:1.5", "--dynamic-batch")
    assert r.returncode == 0, r.stderr
    assert "\nscripting " in "\n" + r.stderr and "tracing" not in r.stderr and "warning" not in r.stderr
    assert "check       passed" in r.stdout
    assert "If" in inspect_json(out)["ops"]
    program = kiln.load(out)
    for x in (np.full(4, 1.5, np.float32), np.full(4, -1.5, np.float32)):
        np.testing.assert_array_equal(program.run([x], as_list=True)[0], x * 2 if x.sum() > 0 else -x)
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(onnx_out), providers=["CPUExecutionProvider"])
    x = np.full(4, -1.5, np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], -x)


def test_script_errors_name_the_line(scripted_models, tmp_path):
    r = kiln_cli("export", f"{scripted_models}:Retry", "--script", "-o", tmp_path / "m.kiln", "--input", "x:4")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "kiln export: error: " in r.stderr and "Traceback" not in r.stderr
    assert "scripted_models.py:14:9: try/except is not supported" in r.stderr, r.stderr


def test_script_flag_is_in_the_help():
    r = kiln_cli("export", "--help")
    assert r.returncode == 0 and "--script" in r.stdout and "kiln.script" in r.stdout


def test_export_in_half_precision(tmp_path):
    out = tmp_path / "mlp16.kiln"
    r = kiln_cli("export", f"{EXAMPLES}:MLP", "-o", out, "--input", "x:2x64", "--dynamic-batch", "--precision", "fp16")
    assert r.returncode == 0, r.stderr
    assert "\nconverting to fp16 " in "\n" + r.stderr and "precision   fp16: " in r.stdout, (r.stdout, r.stderr)
    assert "check       passed" in r.stdout  # the check compares the float32 trace, before the conversion
    graph = kiln.load_graph(out)
    assert {v.dtype for v in graph.initializers.values()} == {kiln.DType.FLOAT16}
    assert graph.inputs[0].dtype is kiln.DType.FLOAT32
    model = load_examples().MLP().eval()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x).numpy()
    got = next(iter(kiln.load(out).run({"x": x.numpy()}).values()))
    assert np.abs(got - want).max() <= 5e-3 * np.abs(want).max()


def test_export_with_int8_weights(tmp_path):
    out = tmp_path / "mlp8.kiln"
    r = kiln_cli("export", f"{EXAMPLES}:MLP", "-o", out, "--input", "x:2x64", "--dynamic-batch", "--weights", "int8")
    assert r.returncode == 0, r.stderr
    assert "converting to int8 weights" in r.stderr and "int8 weights: " in r.stdout, (r.stdout, r.stderr)
    graph = kiln.load_graph(out)
    dq = [n for n in graph.nodes if n.op == "DequantizeLinear"]
    assert dq and all(n.inputs[0].const.dtype == np.int8 for n in dq)
    model = load_examples().MLP().eval()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(x).numpy()
    got = next(iter(kiln.load(out).run({"x": x.numpy()}).values()))
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()

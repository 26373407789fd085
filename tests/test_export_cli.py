"""``kiln export``, run as a real process: the bundled example models, every zoo model, the files
``kiln inspect`` reads back, and the errors a user can make."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import warnings
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
    ("{examples}", ["--input", "x:2x64"], "names the file but not the model in it: give MODULE:ATTR, e.g. '"),
    ("{examples}", ["--input", "x:2x64"], "nn.Module classes there: MLP, SmallCNN, TinyTransformer"),
    ("models", ["--input", "x:2x64"], "expected MODULE:ATTR"),
    ("missing.pt", ["--input", "x:2x64"], "no such file: missing.pt"),
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


# ---------------------------------------------------------------------------- a model file instead of MODULE:ATTR
TINY_MODELS = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x).relu()
"""


@pytest.fixture
def model_files(tmp_path, monkeypatch) -> Path:
    """tinymodels.py (class Net) and what people save from it: TorchScript, a state_dict, a training
    checkpoint, the pickled module, and a state_dict in torch.save's pre-1.6 format."""
    (tmp_path / "tinymodels.py").write_text(TINY_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tinymodels
    try:
        torch.manual_seed(7)
        net = tinymodels.Net().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated, and still in use
            torch.jit.save(torch.jit.script(net), tmp_path / "scripted.pt")
        torch.save(net.state_dict(), tmp_path / "weights.pt")
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        torch.save({"epoch": 3, "model_state_dict": net.state_dict(), "optimizer_state_dict": optimizer.state_dict()},
                   tmp_path / "checkpoint.pth")
        torch.save(net, tmp_path / "whole.pt")
        torch.save(net.state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
        torch.save(net.state_dict(), tmp_path / "expected_weights.pt")
    finally:
        sys.modules.pop("tinymodels", None)
    return tmp_path


def _expected_output(folder: Path, x: np.ndarray) -> np.ndarray:
    weights = torch.load(folder / "expected_weights.pt", weights_only=True)
    return np.maximum(x @ weights["fc.weight"].numpy().T + weights["fc.bias"].numpy(), 0)


def _suggested(message: str, prefix: str) -> list:
    """The arguments of the command after ``prefix`` in an error message."""
    line = next(ln for ln in message.splitlines() if ln.strip().startswith(prefix))
    return shlex.split(line.strip()[len(prefix):].split("   (")[0])


def _factory_code(message: str) -> str:
    """The indented example code of an error message."""
    return "\n".join(ln[4:] for ln in message.splitlines() if ln.startswith("    ") or not ln.strip()).strip() + "\n"


@pytest.mark.parametrize("name,kind", [
    ("weights.pt", "holds a state_dict (2 tensors: fc.weight, fc.bias)"),
    ("checkpoint.pth", "holds a checkpoint with a state_dict under 'model_state_dict' (2 tensors: fc.weight, fc.bias)"),
    ("legacy.pt", "holds a state_dict (2 tensors: fc.weight, fc.bias)"),
])
def test_a_state_dict_gets_a_factory_that_works(model_files, name, kind):
    r = kiln_cli("export", name, "--input", "x:2x4", "-o", "m.kiln", cwd=model_files)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"kiln export: error: {name} {kind}: weights without the code" in r.stderr, r.stderr
    assert "Point MODULE:ATTR at the model's class and load the weights in a factory function" in r.stderr
    # What the message says to do, done: its factory (with the class imported) and its command.
    code = _factory_code(r.stderr).replace("from mymodels import Net", "from tinymodels import Net")
    (model_files / "export_model.py").write_text(code)
    args = _suggested(r.stderr, "then: kiln ")
    assert args == ["export", "export_model.py:model", "--input", "x:2x4", "-o", "m.kiln"]
    done = kiln_cli(*args, cwd=model_files)
    assert done.returncode == 0, done.stderr
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    got = kiln.load(model_files / "m.kiln").run({"x": x}, as_list=True)[0]
    np.testing.assert_allclose(got, _expected_output(model_files, x), rtol=1e-5, atol=1e-6)


def test_a_pickled_module_gets_a_factory_that_works(model_files):
    r = kiln_cli("export", "whole.pt", "--input", "x:2x4", "-o", "m.kiln", cwd=model_files)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "whole.pt is a pickled tinymodels.Net module (torch.save(model)): kiln loads models from code" \
        in r.stderr, r.stderr
    assert "(unpickling needs the class tinymodels.Net: run it where `import tinymodels` works)" in r.stderr
    (model_files / "export_model.py").write_text(_factory_code(r.stderr))
    done = kiln_cli(*_suggested(r.stderr, "then: kiln "), cwd=model_files)
    assert done.returncode == 0, done.stderr
    x = np.ones((2, 4), np.float32)
    got = kiln.load(model_files / "m.kiln").run({"x": x}, as_list=True)[0]
    np.testing.assert_allclose(got, _expected_output(model_files, x), rtol=1e-5, atol=1e-6)


def test_a_torchscript_archive_gets_both_ways_out(model_files, monkeypatch):
    r = kiln_cli("export", "scripted.pt", "--input", "x:2x4", "-o", "m.kiln", cwd=model_files)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "scripted.pt is a TorchScript archive (torch.jit.save) of tinymodels.Net: kiln traces eager" in r.stderr
    # The code route names the class TorchScript compiled, which exists here.
    assert _suggested(r.stderr, "- export from the model's code, if you have it: kiln ") == \
        ["export", "tinymodels.py:Net", "--input", "x:2x4", "-o", "m.kiln"]
    # The ONNX route, run as printed (the python -c in this process, then kiln convert).
    script = _suggested(r.stderr, "python -c ")[0]
    assert "torch.randn(2, 4)" in script
    monkeypatch.chdir(model_files)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(script, {})
    convert = _suggested(r.stderr, "kiln convert ")
    assert convert == ["scripted.onnx", "scripted.kiln"]
    done = kiln_cli("convert", *convert, cwd=model_files)
    assert done.returncode == 0, done.stderr
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    got = kiln.load(model_files / "scripted.kiln").run({"x": x}, as_list=True)[0]
    np.testing.assert_allclose(got, _expected_output(model_files, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,message", [
    ("m.onnx", "m.onnx is an ONNX file: kiln export starts from PyTorch code. Compile it with kiln convert m.onnx "
               "m.kiln"),
    ("m.kiln", "m.kiln is already a .kiln file: kiln run, kiln bench, kiln serve and kiln inspect take it"),
    ("notes.txt", "notes.txt is neither a Python file nor a model file kiln recognizes"),
    ("m.safetensors", "m.safetensors holds safetensors weights: weights without the code that uses them. Point "
                      "MODULE:ATTR at the model's class"),
])
def test_other_files_are_named_for_what_they_are(tmp_path, name, message):
    (tmp_path / name).write_bytes(b"KILN\x89\r\n\x1a" if name.endswith(".kiln") else b"hello")
    r = kiln_cli("export", name, "--input", "x:2x4", "-o", "out.kiln", cwd=tmp_path)
    assert r.returncode == 1 and f"kiln export: error: {message}" in r.stderr, r.stderr
    r = kiln_cli("export", f"{name}:Net", "--input", "x:2x4", "-o", "out.kiln", cwd=tmp_path)
    assert r.returncode == 1 and f"kiln export: error: {message}" in r.stderr, r.stderr


# ---------------------------------------------------------------------------- progress
def _progress_lines(stderr: str) -> list:
    return [ln.split(" ...")[0] for ln in stderr.splitlines() if " ..." in ln]


def test_piped_progress_is_one_plain_line_per_step(tmp_path):
    r = kiln_cli("export", f"{EXAMPLES}:MLP", "-o", tmp_path / "m.kiln", "--input", "x:2x64", "--dynamic-batch")
    assert r.returncode == 0, r.stderr
    assert _progress_lines(r.stderr) == [f"loading {EXAMPLES}:MLP", "tracing", "checking", "optimizing",
                                         f"saving {tmp_path / 'm.kiln'}"]
    assert re.fullmatch(r"(.* \.\.\. \d+\.\d\d s\n){5}", r.stderr), r.stderr  # nothing else: no \r, no escapes
    assert "input set" not in r.stderr and "--no-check" not in r.stderr


def test_terminal_progress_ticks_counts_the_check_and_names_no_check(tmp_path, monkeypatch):
    from kiln.frontend import export_cli
    monkeypatch.setattr(export_cli, "_is_terminal", lambda stream: True)
    monkeypatch.setattr(export_cli, "_SLOW_CHECK_S", 0.0)  # every check is "slow"
    r = kiln_cli("export", f"{EXAMPLES}:MLP", "-o", tmp_path / "m.kiln", "--input", "x:2x64", "--dynamic-batch")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.split("\n")
    finals = [ln.rsplit("\r", 1)[-1] for ln in lines if ln]  # what a terminal shows once a step is done
    assert [f.split(" ...")[0] for f in finals] == [f"loading {EXAMPLES}:MLP", "tracing", "checking", "optimizing",
                                                    f"saving {tmp_path / 'm.kiln'}"]
    assert all(re.fullmatch(r".* \.\.\. \d+\.\d\d s( \(--no-check skips this step\))?\x1b\[K", f) for f in finals)
    check = next(ln for ln in lines if "checking" in ln)
    for k, label in enumerate(["the example inputs", "fresh random inputs #1", "fresh random inputs #2",
                               "fresh random inputs #3"], 1):  # as soon as each starts, not at the next tick
        assert re.search(rf"\rchecking \.\.\. \d+ s, input set {k} of 4: {label}", check), check
    assert "(--no-check skips this step)" in check.rsplit("\r", 1)[-1]
    assert "wrote " in r.stdout and "\r" not in r.stdout


def test_a_failing_step_ends_its_live_line(tmp_path, monkeypatch):
    from kiln.frontend import export_cli
    monkeypatch.setattr(export_cli, "_is_terminal", lambda stream: True)
    r = kiln_cli("export", f"{EXAMPLES}:MLP", "-o", tmp_path / "m.kiln", "--input", "x:2x65")
    assert r.returncode == 1
    assert "\rtracing ... failed\x1b[K\nkiln export: error: tracing failed: " in r.stderr, r.stderr

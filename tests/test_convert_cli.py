"""The ONNX side of the command line: ``kiln convert`` both ways (and the round trip), ``kiln run`` /
``kiln bench`` with ``--backend`` and on .onnx files, ``kiln export --onnx``, and the errors."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import kiln  # noqa: E402
from kiln.cli import main  # noqa: E402

ROOT = Path(kiln.__file__).resolve().parent
FIXTURES = ROOT / "tests" / "fixtures"
MODEL = str(FIXTURES / "mlp_runtime.kiln")  # x: float32[batch,16] -> logits, probs
INPUTS = FIXTURES / "mlp_runtime_inputs.npz"
EXPECTED = FIXTURES / "mlp_runtime_expected.npz"
EXAMPLES = ROOT / "examples" / "models.py"


def expected() -> dict:
    with np.load(EXPECTED) as f:
        return {k: f[k] for k in f.files}


def x_input() -> np.ndarray:
    with np.load(INPUTS) as f:
        return f["x"]


def run_outputs(model: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out.npz"
    assert main(["run", model, "-i", str(INPUTS), "-o", str(out), *extra]) == 0
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


def assert_outputs_match(got: dict, want: dict, rtol: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------- convert
def test_kiln_to_onnx_to_kiln_round_trip_runs_identically(tmp_path, capsys):
    onnx_path, back = tmp_path / "m.onnx", tmp_path / "back.kiln"
    assert main(["convert", MODEL, str(onnx_path)]) == 0
    line = capsys.readouterr().out.strip()
    model = onnx.load(str(onnx_path))
    onnx.checker.check_model(model, full_check=True)
    assert line.startswith(f"wrote {onnx_path} (") and "\n" not in line
    assert f": {len(model.graph.node)} nodes, opset {model.opset_import[0].version}, from {MODEL} (" in line
    assert [i.name for i in model.graph.input] == ["x"]

    assert main(["convert", str(onnx_path), str(back)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {back} (") and "optimized" in line and line.endswith(f"from {onnx_path}")
    original, again = kiln.load(MODEL), kiln.load(back)
    assert [(s.name, s.type) for s in again.inputs] == [(s.name, s.type) for s in original.inputs]
    assert [(s.name, s.type) for s in again.outputs] == [(s.name, s.type) for s in original.outputs]
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    for a, b in zip(original.run([x], as_list=True), again.run([x], as_list=True)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    assert_outputs_match(run_outputs(str(back), tmp_path), expected())


def test_convert_opset_and_no_optimize(tmp_path, capsys):
    onnx_path = tmp_path / "m19.onnx"
    assert main(["convert", MODEL, str(onnx_path), "--opset", "19"]) == 0
    assert "opset 19" in capsys.readouterr().out
    assert [o.version for o in onnx.load(str(onnx_path)).opset_import if o.domain in ("", "ai.onnx")] == [19]
    assert main(["convert", str(onnx_path), str(tmp_path / "raw.kiln"), "--no-optimize"]) == 0
    assert "(not optimized)" in capsys.readouterr().out
    assert_outputs_match(run_outputs(str(tmp_path / "raw.kiln"), tmp_path), expected())


@pytest.mark.parametrize("args, message", [
    (["m.kiln", "m.kiln"], "cannot convert m.kiln to m.kiln: kiln convert turns a .kiln file into .onnx or a .onnx "
                           "file into .kiln, or (with --precision fp16|bf16) a .kiln file into a half-precision "
                           ".kiln file (got '.kiln' -> '.kiln')"),
    ([MODEL, "m.kiln", "--op-precision", "Exp=float32"], "--op-precision and --half-io go with --precision"),
    ([MODEL, "m.kiln", "--precision", "fp16", "--op-precision", "Exp"], "OP=half or OP=float32"),
    ([MODEL, "m.kiln", "--precision", "fp16", "--no-optimize"], "--no-optimize applies to .onnx -> .kiln"),
    (["m.onnx", "m.txt"], "(got '.onnx' -> '.txt')"),
    (["model", "m.onnx"], "(got 'no suffix' -> '.onnx')"),
    (["missing.kiln", "m.onnx"], "no such file: missing.kiln"),
    (["missing.onnx", "m.kiln"], "no such file: missing.onnx"),
    ([MODEL, "no/such/folder/m.onnx"], "cannot write no/such/folder/m.onnx: the folder"),
    ([MODEL, "m.onnx", "--no-optimize"], "--no-optimize applies to .onnx -> .kiln"),
    (["m.onnx", "m.kiln", "--opset", "18"], "--opset applies to .kiln -> .onnx"),
])
def test_convert_errors_are_one_line(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["convert", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln convert: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "m.kiln").exists()


def test_convert_an_invalid_onnx_file_fails_cleanly(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not protobuf")
    assert main(["convert", str(bad), str(tmp_path / "bad.kiln")]) == 1
    assert capsys.readouterr().err.startswith("kiln convert: error: ")
    assert not (tmp_path / "bad.kiln").exists()


# ---------------------------------------------------------------------------- run and bench
def test_run_with_the_onnxruntime_backend_matches_the_reference(tmp_path, capsys):
    assert_outputs_match(run_outputs(MODEL, tmp_path, "--backend", "onnxruntime"), expected())
    capsys.readouterr()
    assert main(["run", MODEL, "-i", str(INPUTS), "--backend", "onnxruntime", "--repeat", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["logits", "float32[3,4]"], ["probs", "float32[3,4]"]]
    assert lines[2].startswith("latency over 3 runs")


@pytest.mark.parametrize("backend", ["kiln", "onnxruntime"])
def test_run_an_onnx_file(backend, tmp_path, capsys):
    onnx_path = tmp_path / "m.onnx"
    assert main(["convert", MODEL, str(onnx_path)]) == 0
    assert_outputs_match(run_outputs(str(onnx_path), tmp_path, "--backend", backend), expected())


def test_run_backend_in_a_real_process(tmp_path):
    out = tmp_path / "o.npz"
    r = subprocess.run([sys.executable, "-m", "kiln", "run", MODEL, "-i", str(INPUTS), "-o", str(out),
                        "--backend", "onnxruntime"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with np.load(out) as f:
        assert_outputs_match({k: f[k] for k in f.files}, expected())
    r = subprocess.run([sys.executable, "-m", "kiln", "run", MODEL, "--backend", "tvm"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "invalid choice: 'tvm'" in r.stderr


def test_bench_with_the_onnxruntime_backend(capsys):
    assert main(["bench", MODEL, "--backend", "onnxruntime", "--threads", "1", "--repeat", "5", "--warmup", "1",
                 "--batch", "3"]) == 0
    out = capsys.readouterr().out
    assert f"model    {MODEL} (onnxruntime, CPUExecutionProvider)" in out
    assert "threads  1 (ORT intra-op threads)" in out and "inputs   x: float32[3,16]" in out
    assert "latency over 5 runs (after 1 warm-up)" in out


def test_bench_profile_is_for_the_kiln_backend_only(capsys):
    assert main(["bench", MODEL, "--backend", "onnxruntime", "--profile"]) == 1
    assert "--profile times kiln's own instructions: it works with --backend kiln only" in capsys.readouterr().err


# ---------------------------------------------------------------------------- export --onnx
@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def test_export_writes_kiln_and_onnx_that_agree(torch, tmp_path, capsys):
    k, o = tmp_path / "mlp.kiln", tmp_path / "mlp.onnx"
    assert main(["export", f"{EXAMPLES}:MLP", "-o", str(k), "--onnx", str(o), "--input", "x:2x64",
                 "--dynamic-batch"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {k} (" in out and f"wrote {o} (" in out
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    a = kiln.load(k).run([x], as_list=True)
    b = kiln.load(o, backend="onnxruntime")
    assert [s.shape for s in b.inputs] == [("batch", 64)]
    for want, got in zip(a, b.run([x], as_list=True)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_export_onnx_only_without_o(torch, tmp_path, capsys):
    o = tmp_path / "only.onnx"
    assert main(["export", f"{EXAMPLES}:MLP", "--onnx", str(o), "--opset", "19", "--input", "x:1x64",
                 "--no-check"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {o} (" in out and "opset 19" in out and "check       skipped (--no-check)" in out
    assert list(tmp_path.iterdir()) == [o]
    onnx.checker.check_model(onnx.load(str(o)), full_check=True)


@pytest.mark.parametrize("args, message", [
    (["--input", "x:1x64"], "nothing to write: give -o FILE.kiln, --onnx FILE.onnx, or both"),
    (["-o", "m.kiln", "--opset", "18", "--input", "x:1x64"], "--opset is the ONNX opset of the --onnx file"),
    (["--onnx", "m.kiln", "--input", "x:1x64"], "--onnx m.kiln: the file name must end in .onnx"),
    (["--onnx", "no/such/m.onnx", "--input", "x:1x64"], "cannot write no/such/m.onnx: the folder"),
])
def test_export_output_errors_come_before_tracing(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["export", f"{EXAMPLES}:MLP", *args]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and "tracing" not in captured.err, captured.err


def test_export_help_documents_onnx(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--onnx FILE.onnx" in out and "may be left out when --onnx is given" in out and "--opset N" in out


# ---------------------------------------------------------------------------- half precision (issue 18)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_convert_to_half_precision_then_run(precision, tmp_path, capsys):
    out = tmp_path / f"m_{precision}.kiln"
    assert main(["convert", MODEL, str(out), "--precision", precision]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and f"{precision}: 6 weights" in text and "casts inserted" in text
    assert out.stat().st_size < Path(MODEL).stat().st_size
    graph = kiln.load_graph(out)
    half = kiln.DType.FLOAT16 if precision == "fp16" else kiln.DType.BFLOAT16
    assert {v.dtype for v in graph.initializers.values()} == {half}
    assert_close_to_scale(run_outputs(str(out), tmp_path), expected(), 3e-2 if precision == "bf16" else 3e-3)
    # Half inputs and outputs, and the half model exported to ONNX runs in onnxruntime.
    io = tmp_path / "io.kiln"
    assert main(["convert", MODEL, str(io), "--precision", precision, "--half-io"]) == 0
    assert kiln.load_graph(io).inputs[0].dtype is half
    if precision == "fp16":
        onnx_path = tmp_path / "m16.onnx"
        assert main(["convert", MODEL, str(onnx_path), "--precision", "fp16"]) == 0
        got = run_outputs(str(onnx_path), tmp_path, "--backend", "onnxruntime")
        assert_close_to_scale(got, expected(), 3e-3)


def assert_close_to_scale(got: dict, want: dict, tol: float) -> None:
    """Half precision: every element within ``tol`` of each output's largest magnitude."""
    assert sorted(got) == sorted(want)
    for name in want:
        err = np.abs(got[name].astype(np.float32) - want[name]).max()
        assert err <= tol * np.abs(want[name]).max(), (name, err)

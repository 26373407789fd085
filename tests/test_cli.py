"""The kiln command, run as a real process (and in-process, through tests/cli_helpers.py, where a test
hides a package or has nothing to learn from a fresh interpreter)."""
import subprocess
import sys

import pytest

import kiln
import kiln.ir.registry


def run(*args):
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=120)


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kiln {kiln.__version__}"


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0 and "info" in r.stdout


def test_no_command_prints_help_and_fails():
    r = run()
    assert r.returncode == 2 and "usage: kiln" in r.stdout


def test_info_reports_versions_and_backends():
    r = run("info", "--ops")
    assert r.returncode == 0, r.stderr
    assert f"IR version {kiln.IR_VERSION}, opset {kiln.OPSET_VERSION}" in r.stdout
    assert "optional backends:" in r.stdout and "onnxruntime" in r.stdout
    assert "  Add(A, B)" in r.stdout


def test_unknown_command_fails():
    r = run("frobnicate")
    assert r.returncode != 0 and "invalid choice" in r.stderr


# ---------------------------------------------------------------------------- kiln info --ops
def test_info_ops_lists_every_op_by_domain():
    from cli_helpers import run_cli
    r = run_cli("info", "--ops")
    assert r.returncode == 0, r.stderr
    assert f"ops: {len(kiln.ir.registry.all_op_names())}" in r.stdout
    onnx_at, kiln_at = r.stdout.index("\ndomain ai.onnx ("), r.stdout.index("\ndomain kiln (")
    assert onnx_at < r.stdout.index("\n  Conv(X, W, B?) [") < kiln_at < r.stdout.index("\n  kiln.Guard(X)")


def test_info_ops_pattern_prints_only_the_matching_ops():
    from cli_helpers import run_cli
    r = run_cli("info", "--ops", "conv")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("ops matching 'conv': ") and "optional backends" not in r.stdout
    ops = [ln.split("(")[0].strip() for ln in lines if ln.startswith("  ")]
    assert "Conv" in ops and "ConvTranspose" in ops and all("conv" in op.lower() for op in ops)
    r = run_cli("info", "--ops", "kiln.*")
    assert r.returncode == 0 and "domain ai.onnx" not in r.stdout and "  kiln.Guard(X)" in r.stdout
    r = run_cli("info", "--ops", "Rellu")
    assert r.returncode == 1 and r.stdout.startswith("no registered op matches 'Rellu' (close: Relu, ")


def test_an_unknown_op_points_to_the_command_not_a_list():
    from kiln.errors import UnknownOpError
    from kiln.ir.registry import get_schema
    with pytest.raises(UnknownOpError) as e:
        get_schema("Rulu")
    message = str(e.value)
    assert message.startswith("op 'Rulu' is not registered (did you mean 'Relu'?); `kiln info --ops` lists the ")
    assert "Softmax" not in message  # no longer every op's name


# ---------------------------------------------------------------------------- kiln export without torch
def test_export_without_torch_says_what_to_install(monkeypatch, tmp_path):
    """torch hidden (None in sys.modules: `import torch` raises ModuleNotFoundError, find_spec finds none)."""
    from cli_helpers import run_cli
    monkeypatch.setitem(sys.modules, "torch", None)
    r = run_cli("export", "models.py:Net", "--input", "x:1x4", "-o", tmp_path / "m.kiln")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("kiln export: error: kiln export traces PyTorch models and needs torch, which is "
                               "not installed: pip install 'kiln-compiler[torch]'"), r.stderr
    assert "loading" not in r.stderr  # refused before any step starts
    assert not (tmp_path / "m.kiln").exists()

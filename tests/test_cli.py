"""The kiln command, run as a real process."""
import subprocess
import sys

import kiln


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

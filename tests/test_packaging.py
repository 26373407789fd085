"""What a user installs: the core needs only numpy and flatbuffers, and never imports torch."""
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_kiln_does_not_import_heavy_packages():
    code = ("import sys, kiln, kiln.ir, kiln.ir.passes, kiln.cli; "
            "heavy = sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'fastapi', 'cupy', 'scipy') if m in sys.modules); "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_core_install_in_fresh_venv(tmp_path):
    """`pip install .` into an empty venv pulls only numpy + flatbuffers, and kiln works."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(ROOT)], check=True, env=env, timeout=600,
                   cwd=tmp_path)
    listing = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                             check=True, env=env).stdout
    names = sorted(p["name"].lower() for p in json.loads(listing) if p["name"].lower() not in ("pip", "setuptools"))
    assert names == ["flatbuffers", "kiln-compiler", "numpy"], names
    r = subprocess.run([str(env_dir / "bin" / "kiln"), "info"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torch        no" in r.stdout
    code = ("import numpy as np, kiln; from kiln.ir import Graph, evaluate; g = Graph(); "
            "x = g.add_input('x', 'float32', (2,)); g.outputs = [g.op('Add', x, x)]; kiln.verify(g); "
            "print(evaluate(g, [np.ones(2, np.float32)])[0].tolist())")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.stdout.strip() == "[2.0, 2.0]", r.stderr

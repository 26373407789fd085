"""The deployed path: a fresh venv with only ``pip install .`` (numpy + flatbuffers) runs the committed
model with ``python -m kiln.runtime`` and matches the committed expected outputs, and neither torch
nor onnx is ever imported on the way."""
from __future__ import annotations

import json
import os
import subprocess
import venv
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
HEAVY = ("torch", "onnx", "onnxruntime", "scipy", "fastapi", "cupy")

# Runs the model through the CLI's entry and through the API, then prints which heavy modules the
# process holds.
RUN_AND_LIST_MODULES = f"""
import json, sys
import numpy as np
import kiln
from kiln.runtime.cli import main
assert main([sys.argv[1], "--input", "x=" + sys.argv[2], "--repeat", "3"]) == 0
x = np.load(sys.argv[2])["x"]
out = kiln.load(sys.argv[1]).run({{"x": x}})
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
print(json.dumps({{"heavy": heavy, "outputs": sorted(out)}}))
"""


@pytest.mark.slow
def test_python_m_kiln_runtime_in_a_core_only_venv(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([py, "-m", "pip", "install", "-q", str(ROOT)], check=True, env=env, timeout=600, cwd=tmp_path)
    listing = subprocess.run([py, "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                             check=True, env=env).stdout
    installed = sorted(p["name"].lower() for p in json.loads(listing) if p["name"].lower() not in ("pip", "setuptools"))
    assert installed == ["flatbuffers", "kiln-compiler", "numpy"], installed

    model, inputs, out = FIXTURES / "mlp_runtime.kiln", FIXTURES / "mlp_runtime_inputs.npz", tmp_path / "out.npz"
    r = subprocess.run([py, "-m", "kiln.runtime", str(model), "--input", f"x={inputs}", "-o", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    with np.load(out) as got, np.load(FIXTURES / "mlp_runtime_expected.npz") as want:
        assert sorted(got.files) == sorted(want.files) == ["logits", "probs"]
        for name in want.files:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)

    r = subprocess.run([py, "-c", RUN_AND_LIST_MODULES, str(model), str(inputs)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == {"heavy": [], "outputs": ["logits", "probs"]}


def test_runtime_path_imports_no_heavy_module_even_where_torch_is_installed():
    """The same check in the dev environment, where torch and onnx could be imported by mistake."""
    import sys

    code = RUN_AND_LIST_MODULES + "\nimport kiln.runtime.cli, kiln.runtime.profile, kiln.cli\n" \
                                  "print(sorted(m for m in sys.modules if m.split('.')[0] in " + repr(HEAVY) + "))"
    r = subprocess.run([sys.executable, "-c", code, str(FIXTURES / "mlp_runtime.kiln"),
                        str(FIXTURES / "mlp_runtime_inputs.npz")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.strip().splitlines()[-2:]
    assert json.loads(first)["heavy"] == [] and second == "[]"

"""python -m kiln.tools.attack: one command in front of every attack module (issue 16)."""
import subprocess
import sys

import pytest

from kiln.tools import attack


def test_lists_every_attack_and_each_module_has_a_main(capsys):
    assert attack.main(["list"]) == 0
    out = capsys.readouterr().out
    import importlib
    for name, (module, _) in attack.ATTACKS.items():
        assert name in out
        assert callable(importlib.import_module(module).main)


def test_unknown_attack_is_refused(capsys):
    assert attack.main(["nope"]) == 2
    assert "unknown attack 'nope'" in capsys.readouterr().err


def test_runs_an_attack_with_its_own_arguments(tmp_path):
    """The crafted ONNX files: each refused with a kiln error (the module's own oracle)."""
    pytest.importorskip("onnx")
    r = subprocess.run([sys.executable, "-m", "kiln.tools.attack", "onnx-files", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert any(tmp_path.iterdir())

"""``kiln serve --ray`` arguments, checked before Ray is needed (runs in every venv; the Ray Serve end-to-end
tests are tests/server/test_ray_serve.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kiln.cli import main

MLP = str(Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln")


@pytest.mark.parametrize("args, message", [
    (["--replicas", "2"], "--ray-address, --replicas and --autoscale go with --ray"),
    (["--ray", "--autoscale", "3:1"], "--autoscale takes MIN:MAX with 1 <= MIN <= MAX"),
    (["--ray", "--autoscale", "2"], "--autoscale takes MIN:MAX"),
    (["--ray", "--replicas", "0"], "--replicas must be at least 1"),
    (["--ray", "--max-batch-size", "-1"], "max_batch_size"),
])
def test_ray_arguments_are_checked_first(args, message, capsys):
    assert main(["serve", MLP, *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln serve: error: ") and message in err, err


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_ray_missing_is_one_line_with_the_install_hint(capsys):
    assert main(["serve", MLP, "--ray"]) == 1
    assert "--ray needs Ray Serve: pip install 'ray[serve]'" in capsys.readouterr().err

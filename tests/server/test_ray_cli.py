"""``kiln serve --ray`` arguments, checked before Ray is needed (runs in every venv; the Ray Serve end-to-end
tests are tests/server/test_ray_serve.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kiln.cli import main

MLP = str(Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln")


@pytest.mark.parametrize("args, message", [
    (["--replicas", "2"],
     "--ray-address, --replicas, --autoscale, --replica-max-ongoing, --ray-proxy and --ray-ship go with --ray"),
    (["--ray-ship"], "go with --ray"),
    (["--replica-max-ongoing", "64"], "go with --ray"),
    (["--ray-proxy", "haproxy"], "go with --ray"),
    (["--ray", "--replica-max-ongoing", "0"], "--replica-max-ongoing must be at least 1"),
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


def test_kiln_deploy_ray_writes_a_serve_config(tmp_path, capsys):
    yaml = pytest.importorskip("yaml")
    out = tmp_path / "serve.yaml"
    assert main(["deploy", "ray", MLP, "-o", str(out), "--autoscale", "1:3", "--port", "9000"]) == 0
    assert "serve deploy" in capsys.readouterr().out
    config = yaml.safe_load(out.read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "kiln.server.ray_serve:build_app" and app["route_prefix"] == "/"
    assert app["args"]["path"] == str(Path(MLP).resolve()) and app["args"]["autoscale"] == "1:3"
    assert config["http_options"] == {"host": "0.0.0.0", "port": 9000}
    assert app["args"]["max_ongoing_requests"] == 128  # not Ray's 5 (server/ray_serve.py)
    assert main(["deploy", "ray", MLP, "-o", str(out)]) == 1
    assert "exists; give --force" in capsys.readouterr().err
    assert main(["deploy", "ray", MLP, "-o", str(out), "--force", "--autoscale", "0:2"]) == 1
    assert "--autoscale takes MIN:MAX" in capsys.readouterr().err


def test_haproxy_on_a_joined_cluster_needs_the_cluster_started_with_it(monkeypatch):
    """Ray's processes read RAY_SERVE_ENABLE_HA_PROXY when they start: a cluster being joined cannot be switched
    from here, so the command says how to start it instead of serving through the other proxy."""
    from kiln.errors import KilnError
    from kiln.server.ray_serve import serve_on_ray
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    with pytest.raises(KilnError, match="RAY_SERVE_ENABLE_HA_PROXY=1"):
        serve_on_ray(MLP, host="127.0.0.1", port=0, address="127.0.0.1:6379", proxy="haproxy")
    with pytest.raises(KilnError, match="'ray' or 'haproxy'"):
        serve_on_ray(MLP, host="127.0.0.1", port=0, proxy="nginx")

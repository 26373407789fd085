"""kiln.server.repository: model discovery and config validation. discover() never loads a model, so
the model files here are placeholders; what matters is the layout and the errors a user sees."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kiln import KilnError
from kiln.server.repository import ModelConfig, ModelEntry, discover


def _touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _repo(root: Path, layout: dict[str, list], configs: dict[str, object] = None) -> Path:
    """layout: model -> version dir names (a str, or (name, file name)); configs: model -> JSON or raw text."""
    for model, versions in layout.items():
        (root / model).mkdir(parents=True, exist_ok=True)
        for v in versions:
            name, file = (v, "model.kiln") if isinstance(v, str) else v
            if file is None:
                (root / model / name).mkdir(parents=True)
            else:
                _touch(root / model / name / file)
    for model, config in (configs or {}).items():
        _touch(root / model / "config.json", config if isinstance(config, str) else json.dumps(config))
    return root


# --- ModelConfig ---

def test_defaults():
    c = ModelConfig()
    assert (c.max_batch_size, c.max_queue_delay_ms, c.queue_size, c.timeout_ms, c.workers, c.instances,
            c.version_policy, c.backend) == (32, 0.5, 1024, 30000.0, 1, 1, {"latest": 1}, "kiln")
    assert c.batching == "auto" and c.may_batch
    assert not ModelConfig(max_batch_size=0).may_batch
    assert not ModelConfig(batching="off").may_batch
    assert ModelConfig().version_policy is not c.version_policy  # no shared mutable default
    assert hash(ModelConfig()) == hash(ModelConfig()) != hash(ModelConfig(version_policy="all"))


def test_batching_mode_is_checked():
    assert ModelConfig.from_json({"batching": "off"}).batching == "off"
    assert ModelConfig().with_overrides({"batching": "force"}).batching == "force"
    with pytest.raises(KilnError, match="'batching' must be one of 'auto', 'force', 'off', got 'yes'"):
        ModelConfig.from_json({"batching": "yes"}, "m/config.json")


def test_from_json_reads_every_key():
    data = {"max_batch_size": 8, "max_queue_delay_ms": 2, "queue_size": 10, "timeout_ms": 500, "workers": 0,
            "instances": 2, "version_policy": "all", "backend": "onnxruntime", "batching": "force",
            "memory_budget": "1GiB", "preferred_batch_size": [2, 4], "buckets": True, "device": "cuda:1",
            "staging_mib": 256}
    c = ModelConfig.from_json(data, "x/config.json")
    # instance_group sets instances, so it cannot be given with it (tests/server/test_buckets.py covers it)
    assert c.to_json() == {**data, "max_queue_delay_ms": 2.0, "timeout_ms": 500.0, "instance_group": None,
                           "staging_mib": 256.0, "precision": None}  # precision: tests/server/test_serve_precision.py
    assert isinstance(c.max_queue_delay_ms, float)


@pytest.mark.parametrize("data, words", [
    ({"max_batch": 4}, ["'max_batch'", "unknown", "max_batch_size"]),
    ({"max_batch_size": -1}, ["'max_batch_size'", ">= 0"]),
    ({"max_batch_size": True}, ["'max_batch_size'", "integer", "boolean"]),
    ({"max_batch_size": "4"}, ["'max_batch_size'", "integer", "string"]),
    ({"max_batch_size": 2.5}, ["'max_batch_size'", "integer"]),
    ({"max_queue_delay_ms": -0.1}, ["'max_queue_delay_ms'", ">= 0"]),
    ({"max_queue_delay_ms": None}, ["'max_queue_delay_ms'", "number", "null"]),
    ({"queue_size": 0}, ["'queue_size'", ">= 1"]),
    ({"timeout_ms": 0}, ["'timeout_ms'", "> 0"]),
    ({"timeout_ms": float("inf")}, ["'timeout_ms'", "finite"]),
    ({"workers": -2}, ["'workers'", ">= 0"]),
    ({"instances": 0}, ["'instances'", ">= 1"]),
    ({"backend": "tensorrt"}, ["'backend'", "'kiln'", "'onnxruntime'"]),
    ({"version_policy": "newest"}, ["'version_policy'", "latest"]),
    ({"version_policy": {"latest": 0}}, ["'version_policy'", ">= 1"]),
    ({"version_policy": {"latest": 1, "all": {}}}, ["'version_policy'", "one policy"]),
    ({"version_policy": {"specific": []}}, ["'version_policy'", "non-empty"]),
    ({"version_policy": {"specific": [1, 0]}}, ["'version_policy'", ">= 1"]),
    ({"version_policy": {"oldest": 1}}, ["'version_policy'", "unknown policy 'oldest'"]),
    ([1, 2], ["top level", "list"]),
])
def test_from_json_errors_name_the_key_and_file(data, words):
    with pytest.raises(KilnError) as e:
        ModelConfig.from_json(data, "repo/mlp/config.json")
    msg = str(e.value)
    assert "repo/mlp/config.json" in msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("policy, normal", [
    ("all", "all"), ({"all": {}}, "all"),
    ({"latest": 3}, {"latest": 3}), ({"latest": {"num_versions": 3}}, {"latest": 3}),
    ({"specific": [3, 1, 3]}, {"specific": [1, 3]}), ({"specific": {"versions": ["2"]}}, {"specific": [2]}),
])
def test_version_policy_spellings_normalize(policy, normal):
    assert ModelConfig.from_json({"version_policy": policy}).version_policy == normal


def test_select_versions():
    versions = [10, 2, 1]
    assert ModelConfig().select_versions(versions) == [10]
    assert ModelConfig(version_policy={"latest": 2}).select_versions(versions) == [2, 10]
    assert ModelConfig(version_policy={"latest": 9}).select_versions(versions) == [1, 2, 10]
    assert ModelConfig(version_policy="all").select_versions(versions) == [1, 2, 10]
    assert ModelConfig(version_policy={"specific": [1, 10]}).select_versions(versions) == [1, 10]
    with pytest.raises(KilnError, match=r"model 'mlp'.*\[3\]"):
        ModelConfig(version_policy={"specific": [1, 3]}).select_versions(versions, "mlp")


def test_overrides_win_and_none_means_not_given():
    c = ModelConfig.from_json({"max_batch_size": 8, "workers": 4}, overrides={"max_batch_size": 0, "workers": None})
    assert c.max_batch_size == 0 and c.workers == 4
    with pytest.raises(KilnError, match="command-line options: 'queue_size' must be >= 1"):
        ModelConfig().with_overrides({"queue_size": 0})
    with pytest.raises(KilnError, match="command-line options: unknown model config key 'batch'"):
        ModelConfig().with_overrides({"batch": 1})


# --- discover: single file ---

def test_single_kiln_file(tmp_path):
    f = _touch(tmp_path / "mlp.kiln")
    [e] = discover(f)
    assert e == ModelEntry("mlp", "1", f, ModelConfig())
    assert e.format == "kiln"


def test_single_file_name_and_overrides(tmp_path):
    f = _touch(tmp_path / "bert-2l.onnx")
    [e] = discover(str(f), name="bert", overrides={"max_batch_size": 4, "max_queue_delay_ms": None})
    assert (e.name, e.version, e.path, e.format) == ("bert", "1", f, "onnx")
    assert e.config.max_batch_size == 4 and e.config.max_queue_delay_ms == 0.5


def test_single_file_errors(tmp_path):
    with pytest.raises(KilnError, match="no such file or directory"):
        discover(tmp_path / "missing.kiln")
    with pytest.raises(KilnError, match=r"\.kiln or \.onnx"):
        discover(_touch(tmp_path / "weights.bin"))
    with pytest.raises(KilnError, match="invalid model name 'my model'.*--name"):
        discover(_touch(tmp_path / "my model.kiln"))
    with pytest.raises(KilnError, match="invalid model name 'a/b'"):
        discover(_touch(tmp_path / "ok.kiln"), name="a/b")
    with pytest.raises(KilnError, match="'workers' must be >= 0"):
        discover(tmp_path / "ok.kiln", overrides={"workers": -1})


# --- discover: repository ---

def test_repository_models_and_versions_sorted(tmp_path):
    repo = _repo(tmp_path, {"mlp": ["1", "2", "10"], "bert": ["3"], "onnxy": [("1", "model.onnx")]},
                 {"mlp": {"version_policy": "all", "max_batch_size": 16}})
    entries = discover(repo)
    assert [(e.name, e.version) for e in entries] == [("bert", "3"), ("mlp", "1"), ("mlp", "2"), ("mlp", "10"),
                                                       ("onnxy", "1")]
    assert entries[1].path == repo / "mlp" / "1" / "model.kiln"
    assert entries[1].config == ModelConfig(version_policy="all", max_batch_size=16)
    assert entries[0].config == ModelConfig()
    assert entries[-1].format == "onnx"


def test_repository_default_policy_serves_latest_numerically(tmp_path):
    repo = _repo(tmp_path, {"mlp": ["2", "10", "9"]})
    assert [e.version for e in discover(repo)] == ["10"]


def test_repository_overrides_beat_config_json(tmp_path):
    repo = _repo(tmp_path, {"a": ["1"], "b": ["1"]}, {"a": {"max_batch_size": 64, "timeout_ms": 100}})
    a, b = discover(repo, overrides={"max_batch_size": 2})
    assert (a.config.max_batch_size, a.config.timeout_ms) == (2, 100.0)
    assert b.config.max_batch_size == 2


def test_kiln_preferred_over_onnx(tmp_path):
    repo = _repo(tmp_path, {"m": [("1", "model.onnx")]})
    _touch(repo / "m" / "1" / "model.kiln")
    [e] = discover(repo)
    assert e.path.name == "model.kiln"


def test_non_version_dirs_are_ignored_with_a_warning(tmp_path, caplog):
    repo = _repo(tmp_path, {"m": ["1", "0", "01", "v2", ("old", None)]})
    (repo / "m" / ".cache").mkdir()
    _touch(repo / "m" / "README.md")
    _touch(repo / "notes.txt")  # a file in the repository root is not a model
    with caplog.at_level(logging.WARNING, logger="kiln.server.repository"):
        entries = discover(repo)
    assert [(e.name, e.version) for e in entries] == [("m", "1")]
    warned = " ".join(r.getMessage() for r in caplog.records)
    for ignored in ("'0'", "'01'", "'v2'", "'old'"):
        assert ignored in warned
    assert ".cache" not in warned and "README" not in warned


def test_repository_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KilnError, match="empty model repository"):
        discover(empty)

    repo = _repo(tmp_path / "r1", {"m": ["1"]})
    with pytest.raises(KilnError, match="--name applies to a single model file"):
        discover(repo, name="x")

    repo = _repo(tmp_path / "r2", {"m": [("1", None)]})
    with pytest.raises(KilnError, match=r"r2/m/1: no model file; expected model\.kiln or model\.onnx"):
        discover(repo)

    repo = _repo(tmp_path / "r3", {"m": [("old", None)]})
    with pytest.raises(KilnError, match="model 'm' has no version directories"):
        discover(repo)

    repo = _repo(tmp_path / "r4", {"m": ["1"]}, {"m": '{"max_batch_size": 4,}'})
    with pytest.raises(KilnError, match=r"r4/m/config\.json: invalid JSON at line 1"):
        discover(repo)

    repo = _repo(tmp_path / "r5", {"m": ["1"]}, {"m": {"max_batch_size": -3}})
    with pytest.raises(KilnError, match=r"r5/m/config\.json: 'max_batch_size' must be >= 0"):
        discover(repo)

    repo = _repo(tmp_path / "r6", {"m": ["1", "2"]}, {"m": {"version_policy": {"specific": [5]}}})
    with pytest.raises(KilnError, match=r"version\(s\) \[5\]"):
        discover(repo)

    repo = _repo(tmp_path / "r7", {"bad name": ["1"]})
    with pytest.raises(KilnError, match="invalid model name 'bad name'"):
        discover(repo)


def test_only_selected_versions_need_a_model_file(tmp_path):
    # Only selected versions need a model file: a half-copied old version does not block serving the latest.
    repo = _repo(tmp_path, {"m": [("1", None), "2"]})
    assert [e.version for e in discover(repo)] == ["2"]
    with pytest.raises(KilnError, match="no model file"):
        discover(repo, overrides={"version_policy": "all"})


def test_model_or_version_dir_passed_instead_of_repository(tmp_path):
    repo = _repo(tmp_path, {"m": ["1", "2"]})
    with pytest.raises(KilnError, match="looks like a model directory.*pass its parent"):
        discover(repo / "m")
    with pytest.raises(KilnError, match="looks like a version directory"):
        discover(repo / "m" / "2")

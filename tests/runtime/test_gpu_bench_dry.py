"""bench/gpu_bench.py's zoo section with graphs traced elsewhere (bench/gpu_zoo_export.py), checked
without a GPU through the benchmark's ``--dry-run`` mode (the same code on kiln's CPU runtime and
torch on the CPU).

The device machine's torch cannot trace every zoo model, so gpu_bench can take a model's graph and
weights from a folder exported on another box. These tests pin what makes those rows trustworthy:
the file path really runs and passes, rows say where the graph was traced, a file changed since
the export or weights that do not fit the model become error rows (never a pass), a failed device
trace falls back to the file, and a model with neither stays "trace failed"."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_bench  # noqa: E402
import gpu_zoo_export  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zoo_traced")
    gpu_zoo_export.export(out, only=["mlp"])
    return out


def run_zoo(tmp_path: Path, monkeypatch, *args: str) -> dict:
    """gpu_bench's main, dry, zoo section on mlp only; the results JSON it wrote."""
    out = tmp_path / "out"
    monkeypatch.setattr(gpu_bench, "OUT", out)
    assert gpu_bench.main(["--dry-run", "--sections", "zoo", "--zoo-only", "mlp", *args]) == 0
    res = json.loads((out / "gpu_bench.json").read_text())
    assert "section_errors" not in res
    return res


def test_export_writes_files_and_manifest(exported):
    manifest = json.loads((exported / "manifest.json").read_text())
    rec = manifest["entries"]["mlp"]
    assert set(manifest["entries"]) == {"mlp"}
    assert rec["files"] == {"kiln": "mlp.kiln", "state_dict": "mlp.pt"}
    assert rec["inputs"] == ["x"]
    assert rec["torch_version"] == torch.__version__ == manifest["torch_version"]
    for name, digest in rec["sha256"].items():
        assert gpu_zoo_export.sha256(exported / name) == digest
        assert (exported / name).stat().st_size == rec["bytes"][name]


def test_entry_over_the_cap_is_skipped_and_removed(tmp_path):
    manifest = gpu_zoo_export.export(tmp_path, only=["mlp"], entry_cap_mib=0.001)
    assert manifest["entries"] == {}
    assert "per-entry cap" in manifest["skipped"]["mlp"]
    assert not (tmp_path / "mlp.kiln").exists() and not (tmp_path / "mlp.pt").exists()


def test_dry_zoo_from_dir_passes(exported, tmp_path, monkeypatch):
    res = run_zoo(tmp_path, monkeypatch, "--zoo-dir", str(exported), "--zoo-prefer-dir")
    rows = res["zoo"]["rows"]
    assert [(r["model"], r["cuda_graphs"]) for r in rows] == [("mlp", False), ("mlp", True)]
    for r in rows:
        assert r["status"] == "pass", r
        assert r["traced"] == f"CPU box (torch {torch.__version__})"
        assert [c["inputs"] for c in r["checks"]] == ["example", "fresh batch=3"]
    md = gpu_bench.render(res)
    assert f"| mlp | CPU box (torch {torch.__version__}) | no | pass |" in md


def test_changed_file_is_an_error_row(exported, tmp_path, monkeypatch):
    folder = tmp_path / "zoo"
    shutil.copytree(exported, folder)
    with open(folder / "mlp.kiln", "ab") as f:
        f.write(b"\0")
    rows = run_zoo(tmp_path, monkeypatch, "--zoo-dir", str(folder), "--zoo-prefer-dir")["zoo"]["rows"]
    assert len(rows) == 1 and rows[0]["status"] == "error"
    assert "sha256" in rows[0]["note"] and rows[0]["traced"].startswith("CPU box")


def test_weights_that_do_not_fit_are_an_error_row(exported, tmp_path, monkeypatch):
    folder = tmp_path / "zoo"
    shutil.copytree(exported, folder)
    state = torch.load(folder / "mlp.pt", weights_only=True)
    state.pop(next(iter(state)))
    torch.save(state, folder / "mlp.pt")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["entries"]["mlp"]["sha256"]["mlp.pt"] = gpu_zoo_export.sha256(folder / "mlp.pt")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    rows = run_zoo(tmp_path, monkeypatch, "--zoo-dir", str(folder), "--zoo-prefer-dir")["zoo"]["rows"]
    assert len(rows) == 1 and rows[0]["status"] == "error"
    assert "load_state_dict" in rows[0]["note"] and "Missing key" in rows[0]["note"]


def test_failed_trace_falls_back_to_the_file_or_stays_trace_failed(exported, tmp_path, monkeypatch):
    import kiln

    def no_trace(*args, **kwargs):
        raise kiln.UnsupportedOpError("this torch cannot trace it")

    monkeypatch.setattr(kiln, "trace", no_trace)
    rows = run_zoo(tmp_path, monkeypatch, "--zoo-dir", str(exported))["zoo"]["rows"]
    assert [r["status"] for r in rows] == ["pass", "pass"]
    assert all(r["traced"].startswith("CPU box") and "cannot trace" in r["device_trace_error"] for r in rows)

    rows = run_zoo(tmp_path, monkeypatch)["zoo"]["rows"]
    assert len(rows) == 1 and rows[0]["status"] == "trace failed"
    assert "cannot trace" in rows[0]["note"] and rows[0]["traced"].startswith("failed on device")

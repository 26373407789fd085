"""GPU metrics (issue 17): nv_gpu_utilization / nv_gpu_memory_{used,total}_bytes{gpu_uuid} from NVML at scrape
time (server/gpu_metrics.py), with a fake ``pynvml`` in sys.modules: no GPU, no real NVML needed."""
from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.server.gpu_metrics import GpuMetrics, gpus_in_use
from kiln.server.repository import ModelConfig, ModelEntry

from tests.server.test_metrics import parse_exposition

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"
GPU_FAMILIES = ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes")
# per NVML index: (uuid, utilization percent, total bytes, used bytes)
DEVICES = {0: ("GPU-aaaa-0000", 37, 80 * 2 ** 30, 5 * 2 ** 30),
           1: ("GPU-bbbb-1111", 100, 80 * 2 ** 30, 79 * 2 ** 30),
           2: ("GPU-cccc-2222", 5, 40 * 2 ** 30, 1)}


class NVMLError(Exception):
    pass


def fake_pynvml(fail_at: str = "", calls: list | None = None) -> types.ModuleType:
    calls = [] if calls is None else calls
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError

    def call(name, result=None):
        calls.append(name)
        if name == fail_at:
            raise NVMLError(f"{name}: Unknown Error")
        return result

    m.nvmlInit = lambda: call("nvmlInit")
    m.nvmlShutdown = lambda: call("nvmlShutdown")
    m.nvmlDeviceGetHandleByIndex = lambda i: (calls.append(("index", i)), call("nvmlDeviceGetHandleByIndex", i))[1]
    m.nvmlDeviceGetHandleByUUID = lambda u: (calls.append(("uuid", u)), call(
        "nvmlDeviceGetHandleByUUID", next(i for i, d in DEVICES.items() if d[0] == u)))[1]
    m.nvmlDeviceGetUUID = lambda h: call("nvmlDeviceGetUUID", DEVICES[h][0])
    m.nvmlDeviceGetUtilizationRates = lambda h: call(
        "nvmlDeviceGetUtilizationRates", types.SimpleNamespace(gpu=DEVICES[h][1], memory=0))
    m.nvmlDeviceGetMemoryInfo = lambda h: call(
        "nvmlDeviceGetMemoryInfo", types.SimpleNamespace(total=DEVICES[h][2], used=DEVICES[h][3],
                                                         free=DEVICES[h][2] - DEVICES[h][3]))
    m.calls = calls
    return m


@pytest.fixture(autouse=True)
def _all_gpus_visible(monkeypatch):
    """The fake's NVML indices are the CUDA ones (a GPU machine may set CUDA_VISIBLE_DEVICES for us)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def gpu_entry(name="g", device="cuda", **config) -> ModelEntry:
    config.setdefault("workers", 0)
    return ModelEntry(name, "1", MLP, ModelConfig(device=device, **config))


def check_page(text: str, gpus) -> dict:
    families = parse_exposition(text)
    for name in GPU_FAMILIES:
        assert families[name]["type"] == "gauge" and families[name]["help"]
        assert [s[1] for s in families[name]["samples"]] == [{"gpu_uuid": DEVICES[g][0]} for g in gpus]
    for g in gpus:
        uuid, util, total, used = DEVICES[g]
        values = {n: {s[1]["gpu_uuid"]: s[2] for s in families[n]["samples"]} for n in GPU_FAMILIES}
        assert values["nv_gpu_utilization"][uuid] == pytest.approx(util / 100)
        assert values["nv_gpu_memory_total_bytes"][uuid] == total
        assert values["nv_gpu_memory_used_bytes"][uuid] == used
    return families


# ------------------------------------------------------------------------------------------ the collector
def test_gpus_in_use_only_cuda_models():
    entries = [gpu_entry("a", "cuda:1"), gpu_entry("b", "cpu"),
               gpu_entry("c", "cuda", instance_group=[{"kind": "gpu", "count": 2, "gpus": [2, 0]}])]
    assert gpus_in_use(entries) == [0, 1, 2]
    assert gpus_in_use([gpu_entry("b", "cpu")]) == []


def test_renders_three_families_with_values_and_labels():
    calls = []
    gm = GpuMetrics([2, 0], importer=lambda: fake_pynvml(calls=calls))
    text = gm.render()
    check_page(text, [0, 2])
    assert 'nv_gpu_utilization{gpu_uuid="GPU-aaaa-0000"} 0.37' in text
    assert "# TYPE nv_gpu_memory_used_bytes gauge" in text
    assert [c for c in calls if isinstance(c, tuple)] == [("index", 0), ("index", 2)]  # only the GPUs in use


def test_gpus_are_looked_up_through_cuda_visible_devices(monkeypatch):
    """NVML ignores CUDA_VISIBLE_DEVICES: a server that sees "2,0" (Ray's replica on two cards) samples NVML's
    2 for its CUDA device 0; a UUID entry is looked up by UUID."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    calls = []
    check_page(GpuMetrics([0], importer=lambda: fake_pynvml(calls=calls)).render(), [2])
    assert [c for c in calls if isinstance(c, tuple)] == [("index", 2)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb-1111")
    calls = []
    check_page(GpuMetrics([0], importer=lambda: fake_pynvml(calls=calls)).render(), [1])
    assert [c for c in calls if isinstance(c, tuple)] == [("uuid", "GPU-bbbb-1111")]


def test_samples_are_cached_for_ttl():
    now = [100.0]
    calls = []
    gm = GpuMetrics([0], ttl=1.0, importer=lambda: fake_pynvml(calls=calls), clock=lambda: now[0])
    first = gm.render()
    n = len(calls)
    now[0] += 0.5
    assert gm.fresh() and gm.render() == first and len(calls) == n  # from the cache: NVML not called
    now[0] += 0.6
    assert not gm.fresh()
    gm.render()
    assert len(calls) > n and calls.count("nvmlInit") == 1  # sampled again; NVML initialized once


@pytest.mark.parametrize("fail_at", ["nvmlInit", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUUID"])
def test_nvml_error_omits_families_and_warns_once(fail_at, caplog):
    now = [0.0]
    gm = GpuMetrics([0, 1], importer=lambda: fake_pynvml(fail_at), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kiln.server"):
        assert gm.render() == ""
        now[0] += 5
        assert gm.render() == ""
    warnings = [r for r in caplog.records if "NVML failed" in r.getMessage()]
    assert len(warnings) == 1 and fail_at in warnings[0].getMessage()


def test_without_pynvml_off_and_logged_once(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with caplog.at_level(logging.WARNING, logger="kiln.server"):
        gm = GpuMetrics([0])
        assert not gm.enabled and gm.render() == "" and gm.render() == ""
    msgs = [r.getMessage() for r in caplog.records if "GPU metrics off" in r.getMessage()]
    assert len(msgs) == 1 and "nvidia-ml-py" in msgs[0]


def test_no_gpu_model_never_imports_pynvml():
    def importer():
        raise AssertionError("pynvml imported for a CPU-only server")
    gm = GpuMetrics([], importer=importer)
    assert not gm.enabled and gm.render() == ""


# ------------------------------------------------------------------------------------------ through /metrics
fastapi = pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from kiln.server.app import create_app  # noqa: E402


def no_gpu_here(entry):
    raise KilnError("no GPU in this test")  # the cuda model fails its own readiness; the server stays up


def scrape(entries) -> tuple[int, str]:
    app = create_app(entries, executor_factory=no_gpu_here)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        r = client.get("/metrics")
        return r.status_code, r.text


def test_metrics_endpoint_shows_gpu_families(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    status, text = scrape([gpu_entry("a", "cuda:1"), gpu_entry("b", "cuda")])
    assert status == 200
    families = check_page(text, [0, 1])
    assert "nv_inference_request_success" in families  # the rest of the page is still there


def test_metrics_endpoint_nvml_error_is_200_without_gpu_families(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml("nvmlDeviceGetUtilizationRates"))
    status, text = scrape([gpu_entry()])
    families = parse_exposition(text)
    assert status == 200 and not set(GPU_FAMILIES) & set(families)
    assert "nv_inference_request_success" in families


def test_metrics_endpoint_without_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    status, text = scrape([gpu_entry()])
    families = parse_exposition(text)
    assert status == 200 and not set(GPU_FAMILIES) & set(families)


def test_metrics_endpoint_cpu_model_has_no_gpu_families(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    status, text = scrape([gpu_entry(device="cpu")])
    assert status == 200 and "nv_gpu_" not in text

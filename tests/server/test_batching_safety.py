"""Issue 16, item 1: dynamic batching never mixes requests.

A model ``y = x - x.mean(axis=0)`` over its symbolic batch dim was stacked with concurrent requests and
199 of 200 answers came back wrong with status 200. Now the server stacks only models whose graph is
proven row-independent (kiln/ir/batch_independence.py); the others run request by request, and the
start-up log and ``GET /v2/models/{m}/config`` say why, naming the op and the module path.

Every answer is compared with the same model run on that request alone; batch sizes are observed
through the metrics object, so "it still batches" is measured, not assumed.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import kiln  # noqa: E402
from kiln.ir import Graph  # noqa: E402
from kiln.server.app import create_app  # noqa: E402
from kiln.server.metrics import Metrics  # noqa: E402
from kiln.server.repository import ModelConfig, ModelEntry  # noqa: E402

MLP = Path(__file__).resolve().parents[1] / "fixtures" / "mlp_runtime.kiln"
REQUESTS = 200


def centered_model(path: Path) -> Path:
    """y = x - x.mean(axis=0): each row's answer depends on every row of its batch."""
    g = Graph("centered")
    x = g.add_input("x", "float32", ("batch", 4))
    mean = g.op("ReduceMean", x, g.add_initializer("axes", np.array([0], np.int64)), keepdims=1, name="mean")
    mean.producer.meta.update({"scope": "head.center", "source": "model.py:7"})
    g.outputs = [g.op("Sub", x, mean, name="y")]
    kiln.save(g, path)
    return path


class Recorder(Metrics):
    """The server's metrics, plus the row count of every batch it ran."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def observe_batch(self, model, version, size, queue_seconds, compute_seconds):
        self.sizes.append(size)
        super().observe_batch(model, version, size, queue_seconds, compute_seconds)


def body(x: np.ndarray) -> dict:
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


def serve(path: Path, name: str, requests: list, workers: int = 0, **config):
    """Send ``requests`` concurrently to a fresh app serving ``path``; returns (answers, metrics, config json)."""
    metrics = Recorder()
    config = dict(workers=workers, max_batch_size=16, max_queue_delay_ms=5, **config)
    app = create_app([ModelEntry(name, "1", path, ModelConfig(**config))], metrics=metrics)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kiln", timeout=60) as client:
                for _ in range(3000):
                    if (await client.get("/v2/health/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.02)
                answers = await asyncio.gather(*(client.post(f"/v2/models/{name}/infer", json=body(x))
                                                 for x in requests))
                cfg = (await client.get(f"/v2/models/{name}/config")).json()
                return answers, cfg

    answers, cfg = asyncio.run(main())
    return answers, metrics, cfg


def wrong_answers(path: Path, requests: list, answers: list) -> int:
    program = kiln.load(path)
    wrong = 0
    for x, r in zip(requests, answers):
        assert r.status_code == 200, r.text
        for out in r.json()["outputs"]:
            got = np.array(out["data"], np.float32).reshape(out["shape"])
            alone = program.run({"x": x})[out["name"]]
            wrong += not np.allclose(got, alone, rtol=1e-5, atol=1e-5)
    return wrong


def distinct_requests(width: int, n: int = REQUESTS) -> list:
    rng = np.random.default_rng(16)
    return [rng.standard_normal((int(rng.integers(1, 4)), width)).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 1])
def test_row_mixing_model_is_served_request_by_request(tmp_path, caplog, workers):
    path = centered_model(tmp_path / "centered.kiln")
    requests = distinct_requests(4)
    with caplog.at_level(logging.INFO, logger="kiln.server"):
        answers, metrics, cfg = serve(path, "centered", requests, workers=workers)
    assert wrong_answers(path, requests, answers) == 0
    assert max(metrics.sizes) <= 3  # each request has 1 to 3 rows
    assert len(metrics.sizes) == REQUESTS  # one run per request: nothing was stacked
    decision = cfg["kiln"]["batching"]
    assert decision["stacks_requests"] is False and decision["batching"] == "auto"
    for words in ("ReduceMean", "head.center", "model.py:7", "reduces over the batch axis", "force"):
        assert words in decision["reason"], decision["reason"]
    assert decision["analysis"]["module"] == "head.center" and decision["analysis"]["op"] == "ReduceMean"
    logged = [r for r in caplog.records if r.levelno == logging.WARNING and "head.center" in r.getMessage()]
    assert logged, "the start-up log does not say why the model is not batched"


def test_force_overrides_the_analysis_and_shows_the_hazard(tmp_path):
    """With ``batching: force`` the same model is stacked, and answers really come back wrong: the
    check above could fail, and the override does what it says."""
    path = centered_model(tmp_path / "centered.kiln")
    requests = distinct_requests(4, 60)
    answers, metrics, cfg = serve(path, "centered", requests, batching="force")
    assert cfg["kiln"]["batching"]["stacks_requests"] is True
    assert "could not prove" in cfg["kiln"]["batching"]["reason"]
    assert max(metrics.sizes) > 3  # requests were stacked
    assert wrong_answers(path, requests, answers) > 0


@pytest.mark.parametrize("workers", [0, 1])
def test_row_independent_model_still_batches(workers):
    requests = distinct_requests(16)
    answers, metrics, cfg = serve(MLP, "mlp", requests, workers=workers)
    assert wrong_answers(MLP, requests, answers) == 0
    assert cfg["kiln"]["batching"]["stacks_requests"] is True, cfg["kiln"]["batching"]["reason"]
    assert "row" in cfg["kiln"]["batching"]["reason"]
    assert cfg["max_batch_size"] == 16 and cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 5000
    assert len(metrics.sizes) < REQUESTS and max(metrics.sizes) > 3  # stacked batches were run
    assert sum(metrics.sizes) == sum(len(x) for x in requests)


def test_batching_off_runs_request_by_request(tmp_path):
    requests = distinct_requests(16, 40)
    answers, metrics, cfg = serve(MLP, "mlp", requests, batching="off")
    assert wrong_answers(MLP, requests, answers) == 0
    assert len(metrics.sizes) == len(requests)
    assert cfg["kiln"]["batching"]["stacks_requests"] is False
    assert '"off"' in cfg["kiln"]["batching"]["reason"]
    assert cfg["kiln"]["config"]["batching"] == "off"
    assert "dynamic_batching" not in cfg and cfg["max_batch_size"] == 0  # Triton's shape: not stacked
